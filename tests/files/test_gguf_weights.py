"""GGUF block dequantization in torch against gguf-py's numpy dequantization (the independent oracle)."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from lingbot_core.files import gguf_weights
from lingbot_core.testing.gguf_fixtures import random_blocks

KINDS = gguf_weights.QUANTIZED_TYPE_NAMES


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_matches_gguf_py_bit_for_bit(kind):
    rng = np.random.default_rng(7)
    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = random_blocks(kind, 6, 2 * max(block, 256), rng)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    got = gguf_weights.dequantize(torch.from_numpy(raw), kind, torch.float32)
    assert got.shape == want.shape == (6, 2 * max(block, 256))
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_1"])
def test_dequantize_real_quantization_and_bf16_cast(kind):
    """Real weights quantized by gguf-py; the bf16 result is the correctly rounded fp32 value, also
    through the chunked path (a stack larger than one chunk)."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal((4, 64, 512), dtype=np.float32) * 0.05
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).copy())
    t = torch.from_numpy(raw)
    assert torch.equal(gguf_weights.dequantize(t, kind), want)
    small = gguf_weights._CHUNK_ELEMENTS
    try:
        gguf_weights._CHUNK_ELEMENTS = 1000  # force several chunks
        assert torch.equal(gguf_weights.dequantize(t, kind, torch.bfloat16), want.to(torch.bfloat16))
    finally:
        gguf_weights._CHUNK_ELEMENTS = small


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_plain_types(kind):
    rng = np.random.default_rng(1)
    values = rng.standard_normal((3, 40), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        raw = values.view(np.uint8)
    elif kind == "F16":
        raw = values.astype(np.float16).view(np.uint8)
    else:
        raw = gguf.quants.quantize(values, qtype)
    want = gguf.quants.dequantize(raw, qtype).reshape(3, 40)
    got = gguf_weights.dequantize(torch.from_numpy(np.ascontiguousarray(raw)), kind)
    np.testing.assert_array_equal(got.numpy(), want)


def test_partial_block_is_refused():
    with pytest.raises(ValueError, match="whole number"):
        gguf_weights.dequantize(torch.zeros(2, 35, dtype=torch.uint8), "Q8_0")


# -- issue 31 item 6: no host syncs and no repeated work in the dequantization ------------------------


def count_factory_calls():
    """Counts ``torch.tensor`` (a Python list to the device: on CUDA a pageable copy that synchronises the
    host) and ``torch.arange`` calls while active; ``calls`` is the running total."""
    from unittest import mock

    calls = {"tensor": 0, "arange": 0}
    orig_tensor, orig_arange = torch.tensor, torch.arange

    def tensor(*a, **k):
        calls["tensor"] += 1
        return orig_tensor(*a, **k)

    def arange(*a, **k):
        calls["arange"] += 1
        return orig_arange(*a, **k)

    return calls, mock.patch.multiple(torch, tensor=tensor, arange=arange)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_makes_no_device_constants_after_the_first_call(kind):
    """Every call after the first builds no constant tensor: nothing from a Python list (a host sync per call
    on CUDA), and the shift vectors are made once per device and reused."""
    rng = np.random.default_rng(5)
    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = torch.from_numpy(random_blocks(kind, 4, 2 * max(block, 256), rng))
    gguf_weights.dequantize(raw, kind, torch.bfloat16)  # the first call may make the shift vectors
    calls, patch = count_factory_calls()
    with patch:
        for _ in range(3):
            gguf_weights.dequantize(raw, kind, torch.bfloat16)
    assert calls == {"tensor": 0, "arange": 0}


def _gguf_moe_block(kind="Q8_0", seed=0, linears=False):
    """A small MoE DiT block whose expert stacks (and with ``linears`` its Linear weights) are GGUF bytes
    (quantized by gguf-py)."""
    from lingbot_core.model.transformer import Linear, MoEFeedForward, TransformerBlock

    cfg = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_group=2, topk_group=1,
               n_shared_experts=1, routed_scaling_factor=2.5, score_func="sigmoid", norm_topk_prob=True)
    dim, heads = 64, 2
    block = TransformerBlock(dim, heads, 1e-6, qkv_bias=False, out_bias=True, ffn=MoEFeedForward(dim, cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(block.named_parameters()) + list(block.named_buffers()):
            p.copy_((1.0 if "norm" in name else 0.0) + torch.randn(p.shape, generator=g) * 0.1)
    experts = block.ffn.experts
    for name in ("w1", "w2", "w3"):
        values = getattr(experts, name).detach().numpy().astype(np.float32)
        raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
        setattr(experts, name, torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(raw)), requires_grad=False))
        experts.qtypes[name] = kind
    for m in block.modules() if linears else ():
        if isinstance(m, Linear):
            raw = gguf.quants.quantize(m.weight.detach().numpy().astype(np.float32), gguf.GGMLQuantizationType[kind])
            m.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(raw)), requires_grad=False)
            m.weight_qtype = kind
    return block


def _dequantizations(block, xs, temb6, freqs):
    """``block`` run on two CFG branches in lockstep, then branch by branch: (lockstep outputs, the raw
    tensors (data pointers) dequantized in the lockstep call, the one-by-one outputs, those dequantized then)."""
    from unittest import mock

    calls = []
    orig = gguf_weights.dequantize

    def counting(raw, qtype, *a, **k):
        calls.append(raw.data_ptr())
        return orig(raw, qtype, *a, **k)

    with torch.no_grad(), mock.patch.object(gguf_weights, "dequantize", counting):
        both = block(xs, temb6, [freqs, freqs], torch.bfloat16)
        lockstep = list(calls)
        calls.clear()
        alone = [block(x, temb6, freqs, torch.bfloat16) for x in xs]
    return both, lockstep, alone, calls


def test_a_lockstep_block_call_dequantizes_each_stack_once_for_both_branches():
    """The two CFG branches of one block call (lockstep) share the dequantized expert stacks: one
    dequantization per stack per block call, dropped after it, and the same numbers as branch by branch."""
    from lingbot_core.model.transformer import rope_frequencies, rope_position_ids

    block = _gguf_moe_block()
    g = torch.Generator().manual_seed(1)
    grid, text_len = (1, 2, 3), 4
    freqs = rope_frequencies(rope_position_ids(grid, text_len), (8, 12, 12), 256.0)
    xs = [torch.randn(1, 6 + text_len, 64, generator=g) for _ in range(2)]
    temb6 = torch.randn(1, 6 * 64, generator=g) * 0.5
    both, per_call, alone, stacks = _dequantizations(block, xs, temb6, freqs)  # only the stacks are quantized
    experts = block.ffn.experts
    assert sorted(per_call) == sorted(t.data_ptr() for t in (experts.w1, experts.w2, experts.w3))  # one each
    assert len(stacks) == 6  # branch by branch: three per call
    assert experts._held is None  # dropped after the call
    for a, b in zip(both, alone):
        assert torch.equal(a, b)


def test_a_lockstep_block_call_dequantizes_every_quantized_tensor_once():
    """Issue 40 (review 4, finding 6 of the issue): with its Linear weights quantized too (attention,
    shared expert), a lockstep block call dequantizes each of the block's GGUF tensors once for both CFG
    branches (before: each Linear weight twice, 7 of the 10 here), drops them after, and gives the numbers
    of the branches run one by one."""
    from lingbot_core.model.transformer import Linear, rope_frequencies, rope_position_ids

    block = _gguf_moe_block(linears=True)
    linears = [m for m in block.modules() if isinstance(m, Linear)]
    experts = block.ffn.experts
    quantized = {t.data_ptr() for t in (experts.w1, experts.w2, experts.w3)} | {m.weight.data_ptr() for m in linears}
    assert len(quantized) == 10
    g = torch.Generator().manual_seed(2)
    freqs = rope_frequencies(rope_position_ids((1, 2, 3), 4), (8, 12, 12), 256.0)
    xs = [torch.randn(1, 10, 64, generator=g).to(torch.bfloat16) for _ in range(2)]
    temb6 = torch.randn(1, 6 * 64, generator=g) * 0.5
    both, lockstep, alone, calls = _dequantizations(block, xs, temb6, freqs)
    assert sorted(lockstep) == sorted(quantized)  # each once
    assert sorted(calls) == sorted(2 * list(quantized))  # branch by branch: each once per call
    assert all(m._held is None for m in linears) and experts._held is None
    for a, b in zip(both, alone):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_workspace_stays_within_its_stated_bound(kind):
    """Issue 31 item 5 (the VRAM bound): the temporaries of one dequantization beyond its output, measured by
    a dispatch mode that follows every storage (``LiveBytes``), stay within ``workspace_bytes`` for a
    chunked bf16 dequantization (4 chunks) and an unchunked fp32 one."""
    from support.live_bytes import LiveBytes

    rng = np.random.default_rng(11)
    raw = torch.from_numpy(random_blocks(kind, 256, 1024, rng))
    small = gguf_weights._CHUNK_ELEMENTS
    try:
        gguf_weights._CHUNK_ELEMENTS = 1 << 16  # 64 rows a chunk: four chunks
        for dtype in (torch.bfloat16, torch.float32):
            with LiveBytes() as live:
                out = gguf_weights.dequantize(raw, kind, dtype)
            beyond = live.peak - out.numel() * out.element_size()
            bound = gguf_weights.workspace_bytes(out.numel(), dtype)
            assert beyond <= bound, (dtype, beyond, bound)
            if dtype == torch.bfloat16:  # the case the GPU runs: a bound, and not a loose one
                assert beyond > 0.6 * bound, (beyond, bound)
    finally:
        gguf_weights._CHUNK_ELEMENTS = small


@pytest.mark.parametrize("linears", [False, True], ids=["stacks", "stacks+linears"])
def test_converted_bytes_bounds_what_a_gguf_block_call_adds_on_the_device(monkeypatch, linears):
    """Issue 31 item 5 (the VRAM bound): a lockstep two-branch call of a GGUF MoE block holds its three
    dequantized stacks (and, issue 40, every dequantized Linear weight) at once, and adds no more than
    ``converted_bytes`` over the same call of the block with plain bf16 weights (both measured with
    ``LiveBytes``: what the block's activations take cancels)."""
    from support.live_bytes import LiveBytes

    from lingbot_core.model.transformer import Linear, converted_bytes, rope_frequencies, rope_position_ids

    block = _gguf_moe_block("Q8_0", linears=linears)
    experts = block.ffn.experts
    g = torch.Generator().manual_seed(1)
    grid, text_len = (1, 2, 3), 4
    freqs = rope_frequencies(rope_position_ids(grid, text_len), (8, 12, 12), 256.0)
    xs = [torch.randn(1, 6 + text_len, 64, generator=g) for _ in range(2)]
    temb6 = torch.randn(1, 6 * 64, generator=g) * 0.5
    monkeypatch.setattr(gguf_weights, "_CHUNK_ELEMENTS", 1 << 12)  # stacks of 8 chunks: the stacks dominate the workspace
    bound = converted_bytes(block, torch.bfloat16)
    stack_bytes = sum(gguf_weights.dequantize(getattr(experts, n), "Q8_0", torch.bfloat16).nbytes for n in ("w1", "w2", "w3"))
    with torch.no_grad():
        with LiveBytes() as live:
            block(xs, temb6, [freqs, freqs], torch.bfloat16)
        gguf_peak = live.peak
        for name in ("w1", "w2", "w3"):  # the same block with plain bf16 stacks: nothing to convert
            setattr(experts, name, torch.nn.Parameter(gguf_weights.dequantize(getattr(experts, name), "Q8_0", torch.bfloat16),
                                                      requires_grad=False))
        experts.qtypes = {}
        for m in block.modules():
            if isinstance(m, Linear) and m.weight_qtype is not None:
                stack_bytes += m.out_features * m.in_features * 2
                m.weight = torch.nn.Parameter(gguf_weights.dequantize(m.weight, m.weight_qtype, torch.bfloat16), requires_grad=False)
                m.weight_qtype = None
        assert converted_bytes(block, torch.bfloat16) == 0
        with LiveBytes() as live:
            block(xs, temb6, [freqs, freqs], torch.bfloat16)
        plain_peak = live.peak
    assert stack_bytes <= gguf_peak - plain_peak <= bound
    assert bound < 1.5 * stack_bytes
