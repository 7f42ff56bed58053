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
