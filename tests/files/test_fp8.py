"""fp8 weight storage (issue 10 item 1): what is quantized, that the stored values are e4m3's nearest
values, DiT bytes, the same frames in every offload mode, and ComfyUI-style fp8 checkpoints."""

import json

import pytest
import torch
from safetensors.torch import save_file

from lingbot_core import load_pipeline
from lingbot_core.testing.fixtures import dit_config, dit_state_dict
from lingbot_core.files.fp8 import (
    FP8_DTYPES, e4m3_relative_rms_bound, is_fp8, is_quantized_name, quantize, scale_name, stored_in_compute_dtype,
)
from lingbot_core.loading import ModelPackageError, load_transformer
from lingbot_core.model.transformer import LingBotVideoTransformer3DModel, is_fp32_island

RUN = dict(height=64, width=96, num_frames=5, steps=2, seed=7, output_type="latent")
FULL_MOE = dict(depth=48, axes_lens=[4096, 512, 512], num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5)


def e4m3_grid():
    """Every finite float8_e4m3fn value, from its 256 bit patterns (independent of any rounding code)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values)].unique()


def test_quantize_gives_nearest_e4m3_value_times_power_of_two():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16)
    q, scale = quantize(w, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == ()
    mantissa, _ = torch.frexp(scale)
    assert mantissa.item() == 0.5  # a power of two
    assert 224 < w.float().abs().max() / scale <= 448  # the largest weight sits in the top binade
    grid = e4m3_grid()
    x = (w.float() / scale).reshape(-1)
    dist = (x[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1).values
    got = q.float().reshape(-1)
    assert torch.equal((got - x).abs(), best)  # the stored value is a nearest grid point
    # the dequantized weight's error is e4m3 rounding alone
    rel_rms = ((q.float() * scale - w.float()).norm() / w.float().norm()).item()
    assert rel_rms < 1.5 * e4m3_relative_rms_bound()


def test_quantize_per_expert_scales_and_e5m2():
    w = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1)) * torch.tensor([1e-3, 1.0, 30.0, 0.0])[:, None, None]
    q, scale = quantize(w, torch.float8_e5m2, (4, 1, 1))
    assert q.dtype == torch.float8_e5m2 and scale.shape == (4, 1, 1)
    assert scale[3].item() == 1.0 and torch.equal(q[3].float(), torch.zeros(8, 16))
    for e in range(3):
        assert 28672 < w[e].abs().max() / scale[e] <= 57344
    assert torch.allclose(q.float() * scale, w, rtol=2 ** -3, atol=0)


def test_which_tensors_are_quantized():
    with torch.device("meta"):
        model = LingBotVideoTransformer3DModel(**FULL_MOE)
    names = [k for k in model.state_dict() if is_quantized_name(k)]
    assert all(k.startswith("blocks.") for k in names)
    assert not any(is_fp32_island(k) for k in names)
    block0 = sorted(k[len("blocks.0."):] for k in names if k.startswith("blocks.0."))
    assert block0 == sorted(["attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight", "attn.to_out.weight",
                             "ffn.experts.w1", "ffn.experts.w2", "ffn.experts.w3",
                             "ffn.shared_experts.gate_proj.weight", "ffn.shared_experts.up_proj.weight",
                             "ffn.shared_experts.down_proj.weight"])
    assert not any("router" in k or "bias" in k for k in names)


@pytest.mark.parametrize("cfg", [{}, FULL_MOE], ids=["dense", "moe"])
def test_full_size_dit_bytes_at_most_052_of_bf16(cfg):
    """Byte count of the full-size DiT as loaded: quantized weights 1 byte + scales, islands computed in
    fp32 4 bytes, the rest bf16; against bf16 as loaded (every island fp32)."""
    with torch.device("meta"):
        model = LingBotVideoTransformer3DModel(**cfg)
    bf16 = fp8 = 0
    for k, t in model.state_dict().items():
        island = is_fp32_island(k)
        bf16 += t.numel() * (4 if island else 2)
        if is_quantized_name(k):
            fp8 += t.numel() + 4 * (t.shape[0] if ".experts." in k else 1)
        else:
            fp8 += t.numel() * (4 if island and not stored_in_compute_dtype(k) else 2)
    assert fp8 / bf16 <= 0.52, fp8 / bf16


@pytest.fixture(scope="module")
def fp8_pipe(packages):
    pipe = load_pipeline(packages["moe"], device="cpu", dtypes={"transformer": "fp8_e4m3fn"})
    yield pipe
    pipe.release()


def test_fp8_load_dtypes(fp8_pipe):
    dit = fp8_pipe.transformer
    for name, t in dit.state_dict().items():
        if name.endswith(tuple(f".scale_{leaf}" for leaf in ("weight", "w1", "w2", "w3"))):
            assert t.dtype == torch.float32
        elif is_quantized_name(name):
            assert t.dtype == torch.float8_e4m3fn, name
            assert scale_name(name) in dit.state_dict(), name
        elif is_fp32_island(name) and not stored_in_compute_dtype(name):
            assert t.dtype == torch.float32, name
        else:
            assert t.dtype == torch.bfloat16, name
    assert dit.compute_dtype == torch.bfloat16
    assert dit.time_modulation[1].weight.dtype == torch.bfloat16  # computed in bf16 anyway
    assert dit.blocks[0].ffn.router.weight.dtype == torch.float32  # computed in fp32
    assert dit.blocks[0].ffn.experts.scale_w1.shape == (dit.config.num_experts, 1, 1)


def test_fp8_frames_identical_in_every_offload_mode_and_close_to_bf16(fp8_pipe, packages):
    reference = fp8_pipe.generate("a cat", **RUN)
    for mode in ("model", "sequential", "block"):
        fp8_pipe.set_offload(mode, blocks_on_gpu=0)
        assert torch.equal(fp8_pipe.generate("a cat", **RUN), reference), mode
    fp8_pipe.set_offload("none")
    bf16 = load_pipeline(packages["moe"], device="cpu", dtypes={"transformer": "bf16"})
    try:
        other = bf16.generate("a cat", **RUN)
    finally:
        bf16.release()
    rel = ((reference - other).norm() / other.norm()).item()
    assert 0 < rel < 0.15, rel  # fp8 rounding (up to 6 % per weight) through 2 steps; a lost scale would be ~1e3


def _comfy_style_fp8(folder, moe=False, scale_input=False):
    """An fp8 checkpoint written as ComfyUI's "fp8 scaled" models are: fp8 weight, scalar scale_weight
    = amax / 448 (not a power of two), and a ``scaled_fp8`` marker tensor. With ``scale_input``, each
    quantized Linear also has the ``scale_input`` tensor that ComfyUI's fp8-matmul path reads (0.25 here,
    so applying it to anything would change the numbers)."""
    state, cfg = dit_state_dict(dit_config(moe), seed=4, fp32=True)
    out, expected = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}, {}
    for k, t in state.items():
        if is_quantized_name(k):
            s = t.abs().max() / 448.0
            q = (t / s).to(torch.float8_e4m3fn)
            out[k], out[scale_name(k)] = q, s.reshape(1)
            if scale_input and k.endswith(".weight"):
                out[k[: -len("weight")] + "scale_input"] = torch.full((1,), 0.25)
            expected[k] = (q, s)
        else:
            out[k] = t
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"_class_name": "LingBotVideoTransformer3DModel", **cfg}))
    save_file(out, str(folder / "diffusion_pytorch_model.safetensors"))
    return expected


def test_load_comfyui_style_fp8_checkpoint(tmp_path):
    expected = _comfy_style_fp8(tmp_path / "t", moe=True)
    dit = load_transformer(tmp_path / "t", torch.float8_e4m3fn)
    sd = dit.state_dict()
    for k, (q, s) in expected.items():
        assert sd[k].dtype == torch.float8_e4m3fn and torch.equal(sd[k].view(torch.uint8), q.view(torch.uint8)), k
        assert torch.all(sd[scale_name(k)] == s.float()), k  # scalar, broadcast per expert for expert stacks
    # loaded as bf16: dequantized once, weight = fp8 value x scale (then bf16)
    dit16 = load_transformer(tmp_path / "t", torch.bfloat16)
    w = dit16.blocks[0].attn.to_q.weight
    q, s = expected["blocks.0.attn.to_q.weight"]
    assert w.dtype == torch.bfloat16 and dit16.blocks[0].attn.to_q.scale_weight is None
    torch.testing.assert_close(w.float(), (q.float() * s).to(torch.bfloat16).float(), rtol=2 ** -7, atol=0)
    # the two loads compute the same DiT up to bf16 rounding of the dequantized weights
    g = torch.Generator().manual_seed(0)
    x, t, e = torch.randn(1, 16, 2, 4, 6, generator=g), torch.tensor([500.0]), torch.randn(1, 7, dit.config.text_dim, generator=g)
    with torch.no_grad():
        a, b = dit(x, t, e), dit16(x, t, e)
    assert ((a.float() - b.float()).norm() / b.float().norm()) < 0.02


def test_comfyui_scale_input_tensors_are_ignored(tmp_path):
    """ComfyUI "fp8 scaled" files may carry ``scale_input`` (an activation scale for fp8 matmuls); the pack
    computes in bf16, so they are checked as known keys and ignored: the package passes the header check, and
    the DiT is the same (weights bit for bit, one forward exactly) as from the file without them."""
    from lingbot_core.loading import check_transformer

    _comfy_style_fp8(tmp_path / "with", moe=True, scale_input=True)
    _comfy_style_fp8(tmp_path / "without", moe=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "with" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert sum(k.endswith(".scale_input") for k in f.keys()) >= 7
    check_transformer(tmp_path / "with")
    a, b = load_transformer(tmp_path / "with", torch.float8_e4m3fn), load_transformer(tmp_path / "without", torch.float8_e4m3fn)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].view(torch.uint8) if is_fp8(sa[k].dtype) else sa[k], sb[k].view(torch.uint8) if is_fp8(sb[k].dtype) else sb[k]), k
    g = torch.Generator().manual_seed(0)
    x, t, e = torch.randn(1, 16, 2, 4, 6, generator=g), torch.tensor([500.0]), torch.randn(1, 7, a.config.text_dim, generator=g)
    with torch.no_grad():
        assert torch.equal(a(x, t, e), b(x, t, e))


def test_bad_scale_shape_is_a_clear_error(tmp_path):
    _comfy_style_fp8(tmp_path / "t")
    from safetensors.torch import load_file

    path = tmp_path / "t" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(path))
    state["blocks.0.attn.to_q.scale_weight"] = torch.ones(3)
    save_file(state, str(path))
    with pytest.raises(ModelPackageError, match="scale_weight.*shape \\[3\\].*single value"):
        load_transformer(tmp_path / "t", torch.float8_e4m3fn)


def test_fp8_precision_names():
    assert list(FP8_DTYPES) == ["fp8_e4m3fn", "fp8_e5m2"]


def test_fp8_rejected_for_the_text_encoder(packages):
    with pytest.raises(ValueError, match="text_encoder.*bf16, fp16, fp32"):
        load_pipeline(packages["dense"], device="cpu", dtypes={"text_encoder": "fp8_e4m3fn"})


# ---------------------------------------------------------------------------------------------
# fp8 MoE and Linear kernels (issue 15 item 2)
# ---------------------------------------------------------------------------------------------

MOE_CFG = dict(num_experts_per_tok=4, moe_intermediate_size=32, n_group=4, topk_group=2, n_shared_experts=1,
               routed_scaling_factor=2.5, score_func="sigmoid", norm_topk_prob=True)
MOE_DIM = 48


def _fp8_moe(num_experts, seed=0):
    """(fp8 MoE feed-forward, the same layer with bf16 experts holding exactly the fp8 values x scale).

    Expert e's weights are scaled by 4^(e mod 5 - 2), so the experts' power-of-two scales differ (as in a
    real MoE), and the bf16 twin is built by hand from the fp8 bits and each expert's own scale."""
    from lingbot_core.model.transformer import MoEFeedForward

    g = torch.Generator().manual_seed(seed)
    ffn = MoEFeedForward(MOE_DIM, dict(MOE_CFG, num_experts=num_experts))
    with torch.no_grad():
        for name, p in list(ffn.named_parameters()) + list(ffn.named_buffers()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "router" in name else 0.1))
    for name, p in ffn.named_parameters():
        if "router" not in name:
            p.data = p.data.to(torch.bfloat16)
    magnitude = 4.0 ** (torch.arange(num_experts) % 5 - 2).float()
    twin = MoEFeedForward(MOE_DIM, dict(MOE_CFG, num_experts=num_experts))
    twin.load_state_dict(ffn.state_dict())
    for leaf in ("w1", "w2", "w3"):
        w = getattr(ffn.experts, leaf).data.float() * magnitude[:, None, None]
        q, scale = quantize(w, torch.float8_e4m3fn, (num_experts, 1, 1))
        setattr(ffn.experts, leaf, torch.nn.Parameter(q, requires_grad=False))
        setattr(ffn.experts, f"scale_{leaf}", scale)
        exact = torch.stack([q[e].float() * scale[e].item() for e in range(num_experts)]).to(torch.bfloat16)
        assert torch.equal(exact.float(), torch.stack([q[e].float() * scale[e].item() for e in range(num_experts)]))
        setattr(twin.experts, leaf, torch.nn.Parameter(exact, requires_grad=False))
    assert ffn.experts.scale_w1.unique().numel() >= 4  # the experts really differ in scale
    return ffn.eval(), twin.eval()


@pytest.mark.parametrize("grouped", [False, True], ids=["slices", "grouped_mm"])
def test_fp8_moe_uses_each_experts_scale(grouped):
    """fp8 experts compute exactly what bf16 experts holding fp8 value x that expert's scale compute (the
    power-of-two scales make the bf16 weights exact), on the per-slice and the grouped path."""
    from unittest import mock

    ffn, twin = _fp8_moe(16)
    f = torch.randn(2, 37, MOE_DIM, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad(), mock.patch("lingbot_core.model.transformer._use_grouped_mm", return_value=grouped):
        out, expected = ffn(f, torch.bfloat16), twin(f, torch.bfloat16)
    assert torch.equal(out, expected), (out.float() - expected.float()).abs().max()
    assert expected.float().abs().mean() > 0.01


class _OpLog:
    """Every aten op run under it, with its inputs' dtypes and whether its output is a new tensor."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self.ops = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                dtypes = [a.dtype for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
                log.append((func.overloadpacket.__name__, dtypes, shape, isinstance(out, torch.Tensor) and out.dtype))
                return out

        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def _moe_ops(ffn, tokens):
    with torch.no_grad(), _OpLog() as log:
        ffn(tokens, torch.bfloat16)
    return log.ops


def test_fp8_moe_dequantizes_each_stack_once_whatever_the_expert_count():
    """Counted with an op logger on CPU: an fp8 MoE layer runs the same ops as the bf16 layer plus a fixed
    number (one cast and one scale per stack), for 8 and for 32 experts; only 3 ops read fp8 tensors."""
    extra, used = {}, {}
    for experts in (8, 32):
        ffn, twin = _fp8_moe(experts, seed=experts)
        tokens = torch.randn(1, 8 * experts, MOE_DIM, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        fp8_ops, bf16_ops = _moe_ops(ffn, tokens), _moe_ops(twin, tokens)
        reads_fp8 = [op for op in fp8_ops if torch.float8_e4m3fn in op[1]]
        assert len(reads_fp8) == 3, reads_fp8  # w1, w3, w2: one cast each
        extra[experts] = len(fp8_ops) - len(bf16_ops)
        used[experts] = sum(op[0] == "index_add_" for op in bf16_ops)  # experts that ran
    assert used[32] >= 2 * used[8], used
    assert extra[8] == extra[32] <= 9, extra


def test_fp8_linear_makes_one_weight_temporary():
    """An fp8 Linear forward allocates one bf16 copy of its weight (the cast), scaled in place."""
    from lingbot_core.model.transformer import Linear

    lin = Linear(64, 32, bias=True)
    q, scale = quantize(lin.weight.data, torch.float8_e4m3fn)
    lin.weight = torch.nn.Parameter(q, requires_grad=False)
    lin.scale_weight = scale
    lin.bias.data = lin.bias.data.to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad(), _OpLog() as log:
        y = lin(x, torch.bfloat16)
    new_weights = [op for op in log.ops if op[2] == (32, 64) and op[3] == torch.bfloat16 and not op[0].endswith("_")]
    assert len(new_weights) == 1, log.ops
    expected = x.float() @ (q.float() * scale).t() + lin.bias.float()
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)
