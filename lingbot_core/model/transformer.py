"""The LingBot-Video diffusion transformer (dense and MoE), as a diffusers model.

One joint self-attention stream over ``[video tokens, text tokens]`` with 3D RoPE, sandwich RMSNorms,
tanh-gated residuals and (optionally) a DeepSeek-style sigmoid MoE feed-forward. Parameter names and
shapes are the released checkpoint's, so ``transformer/`` and ``refiner/`` safetensors load as they are.

Precision: the released weights are bf16 with fp32 "islands" (norms, modulation, time MLPs, router).
The reference runs the DiT under CUDA autocast; this module reproduces autocast's casts explicitly
(every linear in the compute dtype, norms/modulation/RoPE/final LayerNorm/router in fp32) so the same
code runs on CPU without autocast and gives the reference numbers on CUDA.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
from diffusers.models.modeling_utils import ModelMixin

from ..files import gguf_weights
from ..files.fp8 import FP8_COMPUTE_DTYPE, dequantize, is_fp8
from .precision import use_grouped_mm
from .rowwise import RMSNorm, apply_rope, gated_residual, modulated_norm

# A tensor stays fp32 when any dot-separated part of its name is one of these.
FP32_ISLANDS = frozenset(
    {
        "time_embedder", "time_modulation", "scale_shift_table", "norm", "norm1", "norm2", "norm_q",
        "norm_k", "norm_post_attn", "norm_post_ffn", "norm_out", "norm_out_modulation", "router",
    }
)


def is_fp32_island(name: str) -> bool:
    return any(part in FP32_ISLANDS for part in name.split("."))


# CPU kernels may take another path (and round differently) for a weight that is not 64-byte aligned:
# torch's one-row Linear (GEMV) does on AVX-512 machines, measured, while several rows (GEMM) did not.
KERNEL_ALIGNMENT = 64


def kernel_aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its data is 64-byte aligned (or not on the CPU), else an aligned copy
    (torch's CPU allocator aligns to 64)."""
    if tensor.device.type != "cpu" or tensor.data_ptr() % KERNEL_ALIGNMENT == 0:
        return tensor
    return tensor.clone()


def align_islands(model: nn.Module) -> int:
    """Give the fp32 islands of a DiT computed on the CPU 64-byte aligned memory; returns how many moved.

    A memory-mapped checkpoint hands its tensors out at the file's offsets (safetensors: 8-byte
    aligned). The time MLPs run one row per video, so their output would depend on where the file put
    them, and a MoE's top-k routing turns that 1e-7 into another expert choice. The islands are few
    bytes (dense 148 MiB, MoE 198 MiB in fp32: 5.6 % and 0.34 % of the files), so they are copied; the
    big weights stay file-backed. On a GPU the device copy is aligned anyway, so nothing is copied there.
    (A package's islands are read into copies of their own by ``load_transformer(island_copies=True)``,
    without touching their mapped pages; this aligns what else a loader left mapped.)"""
    moved = 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if is_fp32_island(name):
            aligned = kernel_aligned(tensor.data)
            if aligned is not tensor.data:
                tensor.data = aligned
                moved += 1
    return moved


# Run-time LoRA adapters a Linear may carry (built by lingbot_core.model.lora; None when absent).
ADAPTER_PARAMS = ("lora_down", "lora_up", "lora_diff", "lora_diff_b")


def adapter_output(module: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """What a Linear's run-time adapters add to its output for input ``x`` (already in ``dtype``); None without."""
    if module.lora_down is None and module.lora_diff is None and module.lora_diff_b is None:
        return None
    out = None
    if module.lora_down is not None:
        out = F.linear(F.linear(x, module.lora_down.to(dtype)), module.lora_up.to(dtype))
    if module.lora_diff is not None or module.lora_diff_b is not None:
        w = module.lora_diff.to(dtype) if module.lora_diff is not None else None
        b = module.lora_diff_b.to(dtype) if module.lora_diff_b is not None else None
        dense = F.linear(x, w, b) if w is not None else b.expand(*x.shape[:-1], b.shape[0])
        out = dense if out is None else out + dense
    return out


class Linear(nn.Linear):
    """``nn.Linear`` whose forward takes the compute dtype, as autocast would apply it.

    The weights are cast per call, never in place, so fp32-island linears keep fp32 storage. The cast
    happens inside ``forward`` so that offload hooks on this module fire before its weights are read.
    An fp8-stored weight carries a ``scale_weight`` buffer (see :mod:`lingbot_core.files.fp8`); otherwise
    that buffer is ``None`` and not part of the state dict. A GGUF-quantized weight is its raw block bytes
    with ``weight_qtype`` set (see :mod:`lingbot_core.files.gguf_weights`), dequantized here on the input's device.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("scale_weight", None)
        self.weight_qtype = None
        self._held: Optional[dict] = None  # dtype -> converted weight, while a block call holds it (holding)
        for name in ADAPTER_PARAMS:  # LoRA adapters, added at run time (see lingbot_core.model.lora)
            self.register_parameter(name, None)

    @property
    def converts(self) -> bool:
        """Whether the stored weight is converted per use (GGUF blocks, fp8)."""
        return self.weight_qtype is not None or self.scale_weight is not None or is_fp8(self.weight.dtype)

    def weight_in(self, dtype: torch.dtype, device) -> torch.Tensor:
        """The weight in ``dtype`` on ``device``'s side of the call; kept and returned again inside :meth:`holding`.

        Traced (``compile_blocks``), the hold is not read: the graph's guards would differ between the
        branch that fills it and the one that finds it (a second graph), and the compiled graph fuses the
        dequantization into the projection anyway."""
        if self.weight_qtype is not None:
            return _held_or(self, dtype, lambda: gguf_weights.dequantize(self.weight, self.weight_qtype, dtype, device))
        return _held_or(self, dtype, lambda: dequantize(self.weight, self.scale_weight, dtype))

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Within: a weight that needs converting is converted once and kept (the CFG branches of one
        lockstep block call share it, as :meth:`Experts.holding_stacks` shares the stacks); dropped on exit."""
        with _holding(self, self.converts):
            yield

    def forward(self, x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        dtype = dtype or (x.dtype if self.weight_qtype is not None else self.weight.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        x = x.to(dtype)
        y = F.linear(x, self.weight_in(dtype, x.device), bias)
        delta = adapter_output(self, x, dtype)
        return y if delta is None else y + delta


# ----------------------------------------------------------------------------------------------
# Patchify / RoPE / timestep helpers (pure functions, unit-tested on their own)
# ----------------------------------------------------------------------------------------------


def patchify(x: torch.Tensor, patch_size: Sequence[int] = (1, 2, 2)) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, T*H/2*W/2, C*pt*ph*pw), tokens (f, h, w) raster, channel fastest."""
    pt, ph, pw = patch_size
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, (t // pt) * (h // ph) * (w // pw), pt * ph * pw * c)


def unpatchify(tokens: torch.Tensor, grid: Sequence[int], channels: int, patch_size: Sequence[int] = (1, 2, 2)):
    """Inverse of :func:`patchify`."""
    pt, ph, pw = patch_size
    gt, gh, gw = grid
    b = tokens.shape[0]
    x = tokens.reshape(b, gt, gh, gw, pt, ph, pw, channels)
    return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, channels, gt * pt, gh * ph, gw * pw)


def rope_position_ids(grid: Sequence[int], text_len: int) -> torch.Tensor:
    """(n_video + text_len, 3) int64 positions in joint order: video (L+1+f, h, w), then text (j+1, 0, 0)."""
    gt, gh, gw = grid
    f, h, w = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
    video = torch.stack([f.reshape(-1) + text_len + 1, h.reshape(-1), w.reshape(-1)], dim=-1)
    text = torch.zeros(text_len, 3, dtype=torch.long)
    text[:, 0] = torch.arange(text_len) + 1
    return torch.cat([video, text], dim=0)


def rope_frequencies(positions: torch.Tensor, axes_dims: Sequence[int], theta: float) -> torch.Tensor:
    """fp32 (S, sum(axes_dims)/2, 2): per-axis angles in float64, cast to fp32, then (cos, sin).

    Real numbers, not complex64, so that ``compile_blocks`` can fuse the rotation (inductor generates no
    code for complex ops); the layout is ``view_as_real`` of the complex table ``cos + i sin``."""
    tables = []
    for axis, dim in enumerate(axes_dims):
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angle = (positions[:, axis].to(torch.float64)[:, None] * inv[None, :]).to(torch.float32)
        tables.append(torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1))
    return torch.cat(tables, dim=1)


def timestep_projection(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """``[cos(t f_k), sin(t f_k)]`` with ``f_k = max_period^(-k/half)`` (diffusers Timesteps, flip_sin_to_cos)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    args = t.float()[:, None] * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


# ----------------------------------------------------------------------------------------------
# Modules (names follow the checkpoint)
# ----------------------------------------------------------------------------------------------


class TimestepEmbedder(nn.Module):
    def __init__(self, freq_dim: int, dim: int, bias: bool):
        super().__init__()
        self.linear_1 = Linear(freq_dim, dim, bias=bias)
        self.linear_2 = Linear(dim, dim, bias=bias)

    def forward(self, t_proj: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(t_proj, dtype)), dtype)


class TextEmbedder(nn.Module):
    def __init__(self, text_dim: int, dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(text_dim, eps)
        self.linear_1 = Linear(text_dim, dim)
        self.linear_2 = Linear(dim, dim)

    def forward(self, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(self.norm(e), dtype)), dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, eps: float, qkv_bias: bool, out_bias: bool):
        super().__init__()
        self.heads = heads
        head_dim = dim // heads
        self.to_q = Linear(dim, dim, bias=qkv_bias)
        self.to_k = Linear(dim, dim, bias=qkv_bias)
        self.to_v = Linear(dim, dim, bias=qkv_bias)
        self.norm_q = RMSNorm(head_dim, eps)
        self.norm_k = RMSNorm(head_dim, eps)
        self.to_out = Linear(dim, dim, bias=out_bias)
        # The one attention dispatch point (diffusers' dispatcher); chosen per model, see lingbot_core.model.attention.
        self.backend = AttentionBackendName.NATIVE
        # diffusers' ParallelConfig under context parallel (lingbot_core.parallel): the dispatcher then runs
        # Ulysses attention over the context ranks; None = local attention.
        self.parallel_config = None

    def forward(self, a: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, s, _ = a.shape
        q = self.to_q(a, dtype).view(b, s, self.heads, -1)
        k = self.to_k(a, dtype).view(b, s, self.heads, -1)
        v = self.to_v(a, dtype).view(b, s, self.heads, -1)
        q = apply_rope(self.norm_q(q), freqs)
        k = apply_rope(self.norm_k(k), freqs)
        o = dispatch_attention_fn(q, k, v, backend=self.backend, parallel_config=self.parallel_config)  # (B, S, heads, head_dim)
        return self.to_out(o.reshape(b, s, -1), dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h = F.silu(self.gate_proj(x, dtype)) * self.up_proj(x, dtype)
        return self.down_proj(h, dtype)


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts), persistent=True)


class Experts(nn.Module):
    """Raw expert weights; read by :class:`MoEFeedForward` (this container has no forward).

    fp8-stored stacks carry one scale per expert in ``scale_w1/2/3`` (``None`` otherwise). GGUF stacks are
    raw block bytes ``(experts, rows, row_bytes)`` with their type in ``qtypes`` (see ``gguf_weights``).
    """

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        for name in ("w1", "w2", "w3"):
            self.register_buffer(f"scale_{name}", None)
        self.qtypes = {}
        self._held: Optional[dict] = None  # dtype -> stacks, while a block call holds them (holding_stacks)

    def stacks(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1, w3, w2)`` in ``dtype``, each whole stack converted once (bf16 stacks are returned as they
        are). fp8 stacks cost one cast and one in-place scale per stack, whatever the number of experts;
        the price is one block's expert weights in bf16 while the layer runs. Inside :meth:`holding_stacks`
        the converted stacks are kept and returned again."""
        return _held_or(self, dtype, lambda: tuple(
            gguf_weights.dequantize(getattr(self, name), self.qtypes[name], dtype) if name in self.qtypes
            else dequantize(getattr(self, name), getattr(self, f"scale_{name}"), dtype) for name in ("w1", "w3", "w2")))

    @contextmanager
    def holding_stacks(self) -> Iterator[None]:
        """Within: stacks that need converting (GGUF or fp8) are converted once and kept, so the CFG branches
        of one lockstep block call share them (one dequantization per stack per block call, not per branch);
        dropped on exit. Costs nothing extra at the peak: a branch holds them while its experts run anyway."""
        with _holding(self, bool(self.qtypes) or any(getattr(self, f"scale_{n}") is not None for n in ("w1", "w2", "w3"))):
            yield


def _held_or(owner: nn.Module, dtype: torch.dtype, convert):
    """``owner``'s converted weight(s) in ``dtype``: the held ones inside :func:`_holding`, else ``convert()``
    (kept there for the next branch). Traced, the hold is not read (see :meth:`Linear.weight_in`)."""
    held = None if torch.compiler.is_compiling() else owner._held
    if held is None:
        return convert()
    if dtype not in held:
        held[dtype] = convert()
    return held[dtype]


@contextmanager
def _holding(owner: nn.Module, converts: bool) -> Iterator[None]:
    """``owner._held`` is a dict of converted weights by dtype within (when it ``converts``), None outside."""
    if not converts:
        yield
        return
    owner._held = {}
    try:
        yield
    finally:
        owner._held = None


def converted_bytes(block: nn.Module, dtype: torch.dtype) -> int:
    """Device bytes that converted copies of ``block``'s stored weights (GGUF blocks, fp8) take at once
    while it computes in ``dtype``, beyond the stored weights: a lockstep block call holds every converted
    weight, expert stacks and Linear weights, for all its CFG branches (:func:`holding_converted`), and a
    GGUF dequantization adds its workspace while a chunk forms. 0 for weights
    stored in ``dtype``. Offload ``block``'s VRAM bound adds this for the largest block (as ComfyUI-GGUF
    reserves its largest layer's dequantized weight)."""
    size = torch.empty(0, dtype=dtype).element_size()
    stacks = linear = largest_gguf = 0
    for m in block.modules():
        if isinstance(m, Experts):
            for name in ("w1", "w3", "w2"):
                t = getattr(m, name)
                if name in m.qtypes:
                    n = math.prod(gguf_weights.logical_shape(t.shape, m.qtypes[name]))
                    largest_gguf = max(largest_gguf, n)
                elif getattr(m, f"scale_{name}") is not None or t.dtype != dtype:
                    n = t.numel()
                else:
                    continue
                stacks += n * size
        elif isinstance(m, Linear) and m.weight is not None:
            if m.weight_qtype is not None:
                n = math.prod(gguf_weights.logical_shape(m.weight.shape, m.weight_qtype))
                largest_gguf = max(largest_gguf, n)
            elif m.scale_weight is not None or (is_fp8(m.weight.dtype) and m.weight.dtype != dtype):
                n = m.weight.numel()
            else:
                continue
            linear += n * size
    workspace = gguf_weights.workspace_bytes(largest_gguf, dtype) if largest_gguf else 0
    return stacks + linear + workspace


def _use_grouped_mm(x: torch.Tensor, hidden: int) -> bool:
    """The dispatch for tokens ``x`` (N, D) and experts of width ``hidden`` (``precision.use_grouped_mm``)."""
    return use_grouped_mm(x.device, x.shape[0], x.shape[-1], hidden)


# Tokens per ``torch._grouped_mm`` pass: bounds the gathered (token, expert) rows to 8 x 8192 rows at a time.
GROUPED_CHUNK_TOKENS = 8192


def _sort_pairs(ids: torch.Tensor, num_experts: int):
    """The (token, expert) pairs sorted by expert, stably: ``order`` (pair indices) and ``ends``
    (int64 (E,): end of each expert's slice in the sorted pairs). Computed on the device by a
    ``searchsorted`` of the sorted ids, not ``bincount``, which reads its maximum back to the host on CUDA."""
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    bounds = torch.arange(1, num_experts + 1, device=ids.device, dtype=flat.dtype)
    return order, torch.searchsorted(flat[order], bounds)


def run_experts(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, experts: Experts,
                grouped: Optional[bool] = None) -> torch.Tensor:
    """Sum over the selected experts of ``gate * expert(x)``, in fp32, for tokens ``x`` (N, D) bf16.

    The (token, expert) pairs are sorted by expert once (stably: tokens stay ascending within an
    expert), so each expert reads a contiguous slice of the sorted rows. Each expert gathers only its
    own rows (never all N * k pairs at once), and its weighted output is added into the fp32 sum in
    ascending expert id: per token the same rows, operations and order as one ``index_add_`` per expert
    over ``ids == e``, hence the same bits. This per-expert loop needs the slice sizes on the host: one
    host sync per call (the one ``tolist``).

    ``grouped`` (the default wherever ``torch._grouped_mm`` runs on the device, within the limits of
    ``precision.grouped_dispatch``: widths divisible by 8, and off torch's native kernel at most
    ``precision.FALLBACK_GROUPED_MAX_TOKENS`` tokens) runs the experts as one ``torch._grouped_mm`` per weight stack,
    in chunks of :data:`GROUPED_CHUNK_TOKENS` tokens, with the offsets kept on the device (no host sync
    in this function), and then adds each token's k contributions in ascending expert id, starting from
    zero: the same bits again where the grouped kernel computes each row as a matmul would (checked on
    CPU; scripts/gpu-check compares on CUDA).
    """
    if grouped is None:
        grouped = _use_grouped_mm(x, experts.w1.shape[1])
    w1, w3, w2 = experts.stacks(x.dtype)
    if grouped:
        return _run_experts_grouped(x, ids, gates, w1, w3, w2)
    n, k = ids.shape
    order, ends = _sort_pairs(ids, w1.shape[0])
    rows = order // k  # token of each sorted pair
    weights = gates.reshape(-1)[order].float()[:, None]
    out = torch.zeros(n, w2.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, end in enumerate(ends.tolist()):  # the one host sync
        if end > start:
            part = rows[start:end]
            xe = x.index_select(0, part)
            h = F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())
            # bf16 y times fp32 weights promotes to fp32: the same bits as y.float() * w, in one kernel.
            out.index_add_(0, part, torch.mul(h @ w2[e].t(), weights[start:end]))
            start = end
    return out


def _run_experts_grouped(x, ids, gates, w1, w3, w2) -> torch.Tensor:
    n, k = ids.shape
    out = torch.empty(n, w2.shape[1], dtype=torch.float32, device=x.device)
    w1t, w3t, w2t = (w.transpose(-2, -1) for w in (w1, w3, w2))
    for lo in range(0, n, GROUPED_CHUNK_TOKENS):
        hi = min(n, lo + GROUPED_CHUNK_TOKENS)
        order, ends = _sort_pairs(ids[lo:hi], w1.shape[0])
        xs = x[lo:hi].index_select(0, order // k)
        weights = gates[lo:hi].reshape(-1)[order].float()[:, None]
        offsets = ends.to(torch.int32)
        h = F.silu(torch._grouped_mm(xs, w1t, offs=offsets)) * torch._grouped_mm(xs, w3t, offs=offsets)
        ys = torch._grouped_mm(h, w2t, offs=offsets)
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device)
        # Row of ys holding (token, j-th smallest expert id): pairs are sorted by expert, so sorting a
        # token's positions sorts its experts.
        position = position.view(hi - lo, k).sort(dim=-1).values
        # One gather of every token's k rows, then the k additions in ascending expert id from zero: the
        # loop's bits in 2k + 3 kernels instead of 5k (bf16 row times fp32 weight promotes exactly, in one).
        picked, w = ys[position], weights[position]  # (n, k, D) bf16, (n, k, 1) fp32
        acc = out[lo:hi]
        acc.zero_()
        for j in range(k):
            acc += torch.mul(picked[:, j], w[:, j])
        del picked, w
    return out


def route_tokens(
    tokens: torch.Tensor,
    router_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid, group-limited top-k routing. Returns (expert ids (N, k), gate weights fp32 (N, k)).

    Selection uses the bias-corrected score; the gate weights use the bias-free score.
    """
    scores = torch.sigmoid(tokens.float() @ router_weight.float().t())
    select = scores + correction_bias.float()
    n, e = select.shape
    if n_group > 1:
        grouped = select.view(n, n_group, e // n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(topk_group, dim=-1).indices, 1.0)
        mask = keep.bool()[:, :, None].expand_as(grouped).reshape(n, e)
        select = select.masked_fill(~mask, float("-inf"))
    ids = select.topk(top_k, dim=-1).indices
    gates = scores.gather(1, ids)
    if norm_topk_prob:
        gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
    return ids, gates * routed_scaling_factor


class MoEFeedForward(nn.Module):
    def __init__(self, dim: int, cfg: dict):
        super().__init__()
        hidden = cfg["moe_intermediate_size"]
        self.num_experts = cfg["num_experts"]
        self.top_k = cfg["num_experts_per_tok"]
        self.n_group = cfg["n_group"] or 1
        self.topk_group = cfg["topk_group"] or 1
        self.norm_topk_prob = cfg["norm_topk_prob"]
        self.routed_scaling_factor = cfg["routed_scaling_factor"]
        if cfg["score_func"] != "sigmoid":
            raise ValueError(f"score_func {cfg['score_func']!r} is not supported (only 'sigmoid').")
        self.router = Router(dim, self.num_experts)
        self.experts = Experts(self.num_experts, dim, hidden)
        n_shared = cfg["n_shared_experts"] or 0
        self.shared_experts = SwiGLU(dim, hidden * n_shared) if n_shared else None

    def forward(self, f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        shape = f.shape
        tokens = f.reshape(-1, shape[-1])
        ids, gates = route_tokens(
            tokens, self.router.weight, self.router.e_score_correction_bias, top_k=self.top_k,
            n_group=self.n_group, topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        gates = gates.to(tokens.dtype)
        # Experts always run with bf16 operands (as the reference), accumulated in fp32.
        out = run_experts(tokens.to(torch.bfloat16), ids, gates, self.experts).to(tokens.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens, dtype).to(tokens.dtype)
        return out.reshape(shape)


class TransformerBlock(nn.Module):
    """One DiT block. ``forward`` also takes lists of CFG branches (each a batch-1 ``x`` with its RoPE
    table) and runs them one after the other while this block's weights are resident: one forward
    call, so one firing of the offload hooks, for every branch (lockstep CFG)."""

    def __init__(self, dim: int, heads: int, eps: float, qkv_bias: bool, out_bias: bool, ffn: nn.Module):
        super().__init__()
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6 * dim))
        self.norm1 = RMSNorm(dim, eps)
        self.attn = Attention(dim, heads, eps, qkv_bias, out_bias)
        self.norm_post_attn = RMSNorm(dim, eps)
        self.norm2 = RMSNorm(dim, eps)
        self.ffn = ffn
        self.norm_post_ffn = RMSNorm(dim, eps)
        self.compute = BlockCompute()

    def forward(self, x, temb6: torch.Tensor, freqs, dtype: torch.dtype):
        if isinstance(x, torch.Tensor):
            return self.forward([x], temb6, [freqs], dtype)[0]
        for h, f in zip(x, freqs):  # the sequence length changes with the prompt: no recompile for it
            torch._dynamo.maybe_mark_dynamic(h, 1)
            torch._dynamo.maybe_mark_dynamic(f, 0)
        with holding_converted(self) if len(x) > 1 else nullcontext():  # the branches share converted weights
            return [self.compute(self, h, temb6, f, dtype) for h, f in zip(x, freqs)]


@contextmanager
def holding_converted(module: nn.Module) -> Iterator[None]:
    """Within: every weight of ``module`` stored as GGUF blocks or fp8 is converted at its first use and kept
    (expert stacks and Linear weights alike), so a lockstep block call converts each once for all its CFG
    branches; dropped on exit. What that holds at once is in :func:`converted_bytes`."""
    with ExitStack() as stack:
        for m in module.modules():
            if isinstance(m, Experts):
                stack.enter_context(m.holding_stacks())
            elif isinstance(m, Linear):
                stack.enter_context(m.holding())
        yield


def _moe_ffn(ffn: nn.Module, f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ffn(f, dtype)


# Expert routing sizes depend on the data (the per-expert loop's slice sizes): traced, every step would
# recompile.
_eager_moe_ffn = torch.compiler.disable(_moe_ffn)


class BlockCompute(nn.Module):
    """One branch through one block: the block's math, as a module without tensors of its own.

    It is the unit ``torch.compile`` compiles (``_repeated_blocks``): the offload hooks sit on
    :class:`TransformerBlock` (accelerate replaces its ``forward``), so compiling the block itself would
    trace the hooks; this module is called inside the hooked forward and sees only tensors.
    """

    def forward(self, block: TransformerBlock, x: torch.Tensor, temb6: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype):
        mod = (temb6 + block.scale_shift_table.float())[:, None, :]  # fp32 (B, 1, 6D)
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mod.chunk(6, dim=-1)
        a = modulated_norm(block.norm1, x, scale_a, shift_a, dtype)
        o = block.attn(a, freqs, dtype)
        del a
        x = gated_residual(x, gate_a, block.norm_post_attn, o)
        del o
        f = modulated_norm(block.norm2, x, scale_f, shift_f, dtype)
        y = _eager_moe_ffn(block.ffn, f, dtype) if isinstance(block.ffn, MoEFeedForward) else block.ffn(f, dtype)
        del f
        return gated_residual(x, gate_f, block.norm_post_ffn, y)


# RoPE tables a model keeps (see LingBotVideoTransformer3DModel.rope_table).
ROPE_CACHE_SIZE = 4


class LingBotVideoTransformer3DModel(ModelMixin, ConfigMixin):
    """LingBot-Video DiT. ``forward(latents, timestep, text_states)`` returns the flow velocity."""

    _supports_gradient_checkpointing = False
    _no_split_modules = ["TransformerBlock"]
    _repeated_blocks = ["BlockCompute"]  # what compile_repeated_blocks compiles (lingbot_core.model.block_compile)
    _keep_in_fp32_modules = sorted(FP32_ISLANDS)

    @register_to_config
    def __init__(
        self,
        patch_size: Sequence[int] = (1, 2, 2),
        in_channels: int = 16,
        out_channels: int = 16,
        hidden_size: int = 2048,
        num_attention_heads: int = 16,
        depth: int = 24,
        intermediate_size: int = 6144,
        text_dim: int = 2560,
        freq_dim: int = 256,
        norm_eps: float = 1e-6,
        rope_theta: float = 256.0,
        axes_dims: Sequence[int] = (32, 48, 48),
        axes_lens: Sequence[int] = (8192, 1024, 1024),
        qkv_bias: bool = False,
        out_bias: bool = True,
        patch_embed_bias: bool = True,
        timestep_mlp_bias: bool = True,
        num_experts: int = 0,
        num_experts_per_tok: int = 8,
        moe_intermediate_size: int = 512,
        n_group: Optional[int] = None,
        topk_group: Optional[int] = None,
        n_shared_experts: Optional[int] = None,
        routed_scaling_factor: float = 1.0,
        score_func: str = "sigmoid",
        norm_topk_prob: bool = True,
        decoder_sparse_step: int = 1,
        mlp_only_layers: Sequence[int] = (),
    ):
        super().__init__()
        head_dim = hidden_size // num_attention_heads
        if head_dim * num_attention_heads != hidden_size or sum(axes_dims) != head_dim:
            raise ValueError(
                f"transformer config: hidden_size/num_attention_heads = {hidden_size}/{num_attention_heads} "
                f"must be an integer head_dim equal to sum(axes_dims) = {sum(axes_dims)}."
            )
        if any(d % 2 for d in axes_dims):
            raise ValueError(f"transformer config: every axes_dims entry must be even, got {list(axes_dims)}.")
        if num_experts:
            groups = n_group or 1
            if num_experts % groups or num_experts // groups < 2 or (topk_group or 1) * (num_experts // groups) < num_experts_per_tok:
                raise ValueError(
                    f"transformer config: MoE routing needs num_experts % n_group == 0, >= 2 experts per group "
                    f"and topk_group * experts_per_group >= num_experts_per_tok "
                    f"(got {num_experts}, {n_group}, {topk_group}, {num_experts_per_tok})."
                )
        dim = hidden_size
        patch_dim = in_channels * math.prod(patch_size)
        self.patch_embedder = Linear(patch_dim, dim, bias=patch_embed_bias)
        self.time_embedder = TimestepEmbedder(freq_dim, dim, timestep_mlp_bias)
        self.time_modulation = nn.Sequential(nn.SiLU(), Linear(dim, 6 * dim))
        self.text_embedder = TextEmbedder(text_dim, dim, norm_eps)
        moe_cfg = dict(
            num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size, n_group=n_group, topk_group=topk_group,
            n_shared_experts=n_shared_experts, routed_scaling_factor=routed_scaling_factor,
            score_func=score_func, norm_topk_prob=norm_topk_prob,
        )
        blocks = []
        for i in range(depth):
            is_moe = num_experts > 0 and i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
            ffn = MoEFeedForward(dim, moe_cfg) if is_moe else SwiGLU(dim, intermediate_size)
            blocks.append(TransformerBlock(dim, num_attention_heads, norm_eps, qkv_bias, out_bias, ffn))
        self.blocks = nn.ModuleList(blocks)
        self.norm_out_modulation = nn.Sequential(nn.SiLU(), Linear(dim, 2 * dim))
        self.proj_out = Linear(dim, patch_dim // in_channels * out_channels, bias=True)
        self._rope_cache: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
        # What weights stored in fp8 or as GGUF blocks are computed in: set by the loader that chose it
        # (auto's DiT dtype for the execution device, see precision); bf16 until then.
        self.stored_compute_dtype = FP8_COMPUTE_DTYPE

    # -- RoPE table cache --------------------------------------------------------------------

    def rope_table(self, grid: Sequence[int], text_len: int, device: torch.device) -> torch.Tensor:
        """The fp32 (cos, sin) RoPE table for ``grid`` and ``text_len`` on ``device``, from a small per-model cache.

        A bounded cache (:data:`ROPE_CACHE_SIZE` entries, least recently used dropped; CFG alternates two
        text lengths, so a run needs two): the table is built once (in float64 on the CPU, as
        :func:`rope_frequencies` defines it, so the bits are the uncached table's) and copied to the device
        once, instead of on every forward (about 130 MB at the refiner's size). The pipeline empties it when
        a denoise stage ends (:meth:`clear_rope_cache`), so no table outlives the stage on the GPU.
        """
        key = (tuple(int(v) for v in grid), int(text_len), torch.device(device))
        table = self._rope_cache.get(key)
        if table is None:
            cfg = self.config
            table = rope_frequencies(rope_position_ids(key[0], key[1]), cfg.axes_dims, cfg.rope_theta).to(device)
            self._rope_cache[key] = table
            while len(self._rope_cache) > ROPE_CACHE_SIZE:
                self._rope_cache.popitem(last=False)
        else:
            self._rope_cache.move_to_end(key)
        return table

    def clear_rope_cache(self) -> None:
        self._rope_cache.clear()

    # -- precision ---------------------------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the attention/FFN weights (meta tensors keep their dtype under offload); for weights
        stored in fp8 or as GGUF blocks, :attr:`stored_compute_dtype`."""
        to_q = self.blocks[0].attn.to_q
        if to_q.weight_qtype is not None or is_fp8(to_q.weight.dtype):
            return self.stored_compute_dtype
        return to_q.weight.dtype

    def to(self, *args, **kwargs):
        """Like ``nn.Module.to``, but a floating-point dtype cast keeps the fp32 islands in fp32."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None or not dtype.is_floating_point:
            return super().to(*args, **kwargs)
        if device is not None:
            super().to(device=device, non_blocking=non_blocking)
        for name, tensor in list(self.named_parameters()) + list(self.named_buffers()):
            target = torch.float32 if is_fp32_island(name) else dtype
            if tensor.is_floating_point() and tensor.dtype != target:
                tensor.data = tensor.data.to(target)
        return self

    # -- forward -----------------------------------------------------------------------------

    def set_attention_backend(self, backend) -> None:
        """Route every attention through diffusers backend ``backend`` (checked by lingbot_core.model.attention)."""
        backend = AttentionBackendName(backend)
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend

    def set_attention_parallel(self, config) -> None:
        """Give every attention diffusers' ``ParallelConfig`` (context parallel, see lingbot_core.parallel); None = local."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.parallel_config = config

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states, step_cache=None):
        """hidden_states (B, C, T, H, W) DiT-space latents; timestep (B,) in [0, 1000];
        encoder_hidden_states (B, L, text_dim) valid text tokens only (no padding).

        ``encoder_hidden_states`` may be a list of CFG branches (lockstep): every branch shares the
        latent and timestep and is its own computation, block by block; a list of velocities is
        returned. ``step_cache`` (a list with one entry per branch, see lingbot_core.sampling.step_cache) may
        skip the block stack for a branch and reuse its cached residual.
        """
        cfg = self.config
        dtype = self.compute_dtype
        branched = isinstance(encoder_hidden_states, (list, tuple))
        texts = list(encoder_hidden_states) if branched else [encoder_hidden_states]
        caches = list(step_cache) if step_cache is not None else [None] * len(texts)
        b, c, t, h, w = hidden_states.shape
        pt, ph, pw = cfg.patch_size
        if t % pt or h % ph or w % pw:
            raise ValueError(f"latent (T, H, W) = {(t, h, w)} is not divisible by patch_size {list(cfg.patch_size)}.")
        grid = (t // pt, h // ph, w // pw)
        n_video = grid[0] * grid[1] * grid[2]

        video = self.patch_embedder(patchify(hidden_states, cfg.patch_size), dtype)
        xs, freqs = [], []
        # The per-branch top-level Linears convert their weights once for all branches, as a block does.
        with holding_converted(self.text_embedder) if branched else nullcontext():
            for text in texts:
                u = self.text_embedder(text.to(dtype), dtype)
                xs.append(torch.cat([video, u], dim=1))
                freqs.append(self.rope_table(grid, text.shape[1], video.device))
        del video  # each branch holds its own copy in xs

        t_emb = self.time_embedder(timestep_projection(timestep, cfg.freq_dim), dtype)
        temb6 = self.time_modulation[1](F.silu(t_emb), dtype).float()

        run = [i for i, cache in enumerate(caches) if cache is None or cache.should_compute(xs[i])]
        ys = list(xs)
        if run:
            hs = [xs[i] for i in run]
            fs = [freqs[i] for i in run]
            # Only a step cache reads a branch's input after the blocks: without one, the input goes with
            # the first block's output instead of staying alive through the stack (one hidden state per branch).
            for i in run:
                if caches[i] is None:
                    xs[i] = ys[i] = None
            for block in self.blocks:
                hs = block(hs, temb6, fs, dtype)
            for i, out in zip(run, hs):
                ys[i] = out
            del hs
        for i, cache in enumerate(caches):
            if cache is not None:
                ys[i] = cache.store(xs[i], ys[i]) if i in run else cache.reuse(xs[i])
        del xs

        shift, scale = self.norm_out_modulation[1](F.silu(t_emb), dtype).float()[:, None, :].chunk(2, dim=-1)
        outs = []
        with holding_converted(self.proj_out) if branched else nullcontext():
            for x in ys:
                x = F.layer_norm(x[:, :n_video].float(), (x.shape[-1],), eps=cfg.norm_eps) * (1 + scale) + shift
                outs.append(unpatchify(self.proj_out(x, dtype), grid, cfg.out_channels, cfg.patch_size))
        return outs if branched else outs[0]
