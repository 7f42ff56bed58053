"""fp8 weight storage for the DiT: which tensors are stored in fp8, how they are scaled, and how they
are read back.

A quantized tensor ``X.name`` is stored as fp8 (``float8_e4m3fn`` or ``float8_e5m2``) next to a scale
``X.scale_name`` (so a Linear has ``weight`` + ``scale_weight``, ComfyUI's "fp8 scaled" convention;
the expert stacks have ``w1`` + ``scale_w1``, one scale per expert). The real weight is
``fp8.to(compute_dtype) * scale``, formed at use: one Linear at a time, and each expert stack of a
MoE layer once per call (all experts together: no per-expert kernels).

Scales chosen here are powers of two: scaling a float by 2^k changes only its exponent, so the
quantization error is exactly fp8's own rounding of the weight, and ``fp8 * scale`` is exact in bf16.
The scale only moves the largest magnitude to just under the format's maximum. Checkpoints quantized
elsewhere (any positive scale) load too.

Quantized: the Linear weights inside the transformer blocks (attention projections, dense FFN, MoE
experts, shared expert). The fp32 islands that the DiT computes in fp32 (norms, ``scale_shift_table``,
the router) stay fp32; the island *Linears* (time MLPs, modulation linears) are stored in bf16, which
changes no number: their forward casts the weights to the bf16 compute dtype anyway. Biases, the
patch/text embedders and the output projection are bf16.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

FP8_DTYPES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Weights are read as bf16 when stored in fp8 (the precision of the released weights).
FP8_COMPUTE_DTYPE = torch.bfloat16
# A row block of at most this many elements is converted at a time while quantizing (bounds the fp32 temporary).
_CHUNK_ELEMENTS = 1 << 24

_QUANTIZED_SUFFIXES = (
    ".attn.to_q.weight", ".attn.to_k.weight", ".attn.to_v.weight", ".attn.to_out.weight",
    ".ffn.gate_proj.weight", ".ffn.up_proj.weight", ".ffn.down_proj.weight",
    ".ffn.experts.w1", ".ffn.experts.w2", ".ffn.experts.w3",
    ".ffn.shared_experts.gate_proj.weight", ".ffn.shared_experts.up_proj.weight",
    ".ffn.shared_experts.down_proj.weight",
)


# fp32-island Linears whose forward runs in the compute dtype: bf16 storage is exact for them.
_COMPUTE_DTYPE_ISLANDS = ("time_embedder.", "time_modulation.", "norm_out_modulation.")


def stored_in_compute_dtype(name: str) -> bool:
    """Whether an fp32-island tensor is stored in bf16 under an fp8 precision (see the module doc)."""
    return name.startswith(_COMPUTE_DTYPE_ISLANDS)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES.values()


def is_quantized_name(name: str) -> bool:
    """Whether the checkpoint tensor ``name`` is stored in fp8 under an fp8 precision."""
    return name.startswith("blocks.") and name.endswith(_QUANTIZED_SUFFIXES)


def scale_name(name: str) -> str:
    """``blocks.0.attn.to_q.weight`` -> ``blocks.0.attn.to_q.scale_weight``; ``...experts.w1`` -> ``...experts.scale_w1``."""
    prefix, _, leaf = name.rpartition(".")
    return f"{prefix}.scale_{leaf}"


def scale_shape(name: str, shape) -> tuple:
    """One scale per tensor for a Linear weight, one per expert for the expert stacks."""
    return (shape[0], 1, 1) if ".experts." in name else ()


def quantize(tensor: torch.Tensor, dtype: torch.dtype, scale_shape_: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` -> (fp8 tensor, fp32 power-of-two scale of ``scale_shape_``), in row blocks so that no
    fp32 copy of the whole tensor exists (peak: the fp8 result plus one block)."""
    fmax = torch.finfo(dtype).max
    rows = tensor.shape[0] if tensor.dim() else 1
    flat = tensor.reshape(rows, -1)
    step = max(1, _CHUNK_ELEMENTS // max(1, flat.shape[1]))
    amax = torch.empty(rows, dtype=torch.float32)
    for i in range(0, rows, step):
        amax[i:i + step] = flat[i:i + step].abs().amax(dim=1).float()
    if len(scale_shape_) == 0:
        amax = amax.max().reshape(())
    elif scale_shape_[0] != rows:
        raise ValueError(f"scale shape {scale_shape_} does not match a tensor of {rows} rows.")
    # Smallest power of two with amax / scale <= fmax; all-zero tensors get scale 1.
    ratio = (amax / fmax).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.exp2(torch.ceil(torch.log2(ratio)))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale)).reshape(scale_shape_)
    q = torch.empty(tensor.shape, dtype=dtype)
    q_flat = q.reshape(rows, -1)
    row_scale = scale.reshape(-1, 1) if scale.dim() else scale
    for i in range(0, rows, step):
        s = row_scale[i:i + step] if scale.dim() else row_scale
        q_flat[i:i + step] = (flat[i:i + step].float() / s).to(dtype)
    return q, scale


def dequantize(weight: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype``: ``weight.to(dtype)`` when unscaled, else ``weight.to(dtype) * scale``.

    The scale is applied in place on the converted copy, so an fp8 weight costs one ``dtype`` temporary
    (not two); the same bits as the out-of-place product. A weight already in ``dtype`` is never written.
    """
    w = weight.to(dtype)
    if scale is None:
        return w
    scale = scale.to(device=w.device, dtype=dtype)
    return w * scale if w is weight else w.mul_(scale)


def checkpoint_scale(name: str, scale: torch.Tensor, weight_shape) -> torch.Tensor:
    """A stored scale as this model holds it: a scalar, or (experts) one per expert.

    ComfyUI-style checkpoints store one scale per tensor (shape ``[]`` or ``[1]``); for the expert
    stacks it is broadcast to one per expert.
    """
    target = scale_shape(name, weight_shape)
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(()).expand(target).clone() if target else s.reshape(())
    if tuple(s.shape) == target or (target and s.numel() == target[0]):
        return s.reshape(target).clone()
    raise ValueError(f"scale {scale_name(name)!r} has shape {list(scale.shape)}; expected a single value"
                     + (f" or one per expert ({target[0]})" if target else "") + ".")


def e4m3_relative_rms_bound(mantissa_bits: int = 3) -> float:
    """Relative RMS error of round-to-nearest with ``mantissa_bits`` for log-uniform mantissas:
    ``2^-m * sqrt(E[1/M^2] / 12)`` with ``E[1/M^2] = 3 / (8 ln 2)`` for M log-uniform on [1, 2)."""
    return 2.0 ** -mantissa_bits * math.sqrt(3 / (8 * math.log(2)) / 12)
