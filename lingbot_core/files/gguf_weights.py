"""GGUF-quantized weights: raw block bytes kept as they are, dequantized when the layer runs.

A quantized weight is a ``uint8`` tensor holding the GGUF blocks of its rows (shape ``(..., rows,
row_bytes)``; for an expert stack ``(experts, rows, row_bytes)``), usually a view of the memory-mapped
file. The module that owns it records the GGML type next to it (``Linear.weight_qtype``,
``Experts.qtypes``). Offload moves, streams and maps these bytes like any other tensor, so every
offload mode carries the quantized size (offload ``block`` copies a Q4_K block at about a quarter of
its bf16 size), and :func:`dequantize` forms the real weight on the device where the layer computes,
for one call only.

The block kernels are written here from the GGML block layouts and evaluated in fp32 in the order of
gguf-py's numpy ``gguf.quants.dequantize``, which they match bit for bit for every type listed in
:data:`QUANTIZED_TYPE_NAMES` (tests/files/test_gguf_weights.py checks each one against it). They never build a
tensor from Python values on the device (on CUDA a pageable copy that synchronises the host, in every call):
their few shift vectors are made once per device and cached. The result is cast to the compute dtype
afterwards, so a bf16 weight is the correctly rounded bf16 of the exact value.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

# Only these formats are accepted in a DiT file; every other GGML type is refused by name.
QUANTIZED_TYPE_NAMES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
PLAIN_TYPE_NAMES = ("F32", "F16", "BF16")
# fp32 elements dequantized at a time for a large tensor (bounds the fp32 temporary to 256 MiB when the
# weight is wanted in bf16; a full-width 30B-A3B expert stack, 128 x 768 x 2048, takes 3 chunks).
_CHUNK_ELEMENTS = 1 << 26
# Temporaries of one dequantization beyond its output, per element dequantized at once (the fp32 values,
# the unpacked fields and scales): at most 12.5 bytes (Q2_K; Q8_0 8.1, Q4_K 9.3, Q6_K 10.5), measured
# by tests/files/test_gguf_weights.py. A chunk of 64M elements therefore holds up to 0.8 GiB while it forms.
WORKSPACE_BYTES_PER_ELEMENT = 13


def _gguf():
    import gguf

    return gguf


def qtype_of(name_or_value):
    """The ``gguf.GGMLQuantizationType`` for a type name (``"Q4_K"``) or value."""
    types = _gguf().GGMLQuantizationType
    return types[name_or_value] if isinstance(name_or_value, str) else types(int(name_or_value))


def is_supported(qtype) -> bool:
    return qtype_of(qtype).name in QUANTIZED_TYPE_NAMES + PLAIN_TYPE_NAMES


def is_block_quantized(qtype) -> bool:
    return qtype_of(qtype).name in QUANTIZED_TYPE_NAMES


def block_sizes(qtype) -> tuple[int, int]:
    """(elements per block, bytes per block)."""
    return _gguf().GGML_QUANT_SIZES[qtype_of(qtype)]


def logical_shape(raw_shape, qtype) -> tuple:
    """The weight's shape for raw bytes of shape ``raw_shape`` (last dimension in bytes)."""
    block, size = block_sizes(qtype)
    *lead, row_bytes = raw_shape
    if row_bytes % size:
        raise ValueError(f"{qtype_of(qtype).name}: a row of {row_bytes} bytes is not a whole number of {size}-byte blocks.")
    return (*lead, row_bytes // size * block)


def raw_nbytes(shape, qtype) -> int:
    """Bytes a tensor of logical ``shape`` takes in ``qtype``."""
    block, size = block_sizes(qtype)
    n = 1
    for d in shape:
        n *= int(d)
    return n // block * size


# -- block kernels (written from the GGML block layouts; fp32 arithmetic in gguf-py's order) --------
#
# Each takes the blocks as a (n, bytes per block) uint8 tensor and returns (n, elements per block) fp32.
# No kernel builds a tensor from Python values on the device (a pageable host-to-device copy that
# synchronises the host on CUDA): the few shift vectors come from :func:`_shifts`, made once per device
# with ``arange`` and cached.

_SHIFTS: Dict[tuple, torch.Tensor] = {}


def _shifts(device: torch.device, step: int, count: int) -> torch.Tensor:
    """``[0, step, 2 * step, ...]`` (``count`` values) as uint8 on ``device``, shaped to broadcast over the
    last-but-one dimension; made once per device and kept."""
    key = (str(device), step, count)
    t = _SHIFTS.get(key)
    if t is None:
        t = (torch.arange(count, device=device, dtype=torch.uint8) * step).reshape(count, 1)
        _SHIFTS[key] = t
    return t


def _f16(blocks: torch.Tensor, lo: int) -> torch.Tensor:
    """The fp16 field at byte ``lo`` of each block, as fp32 of shape (n, 1)."""
    return blocks[:, lo:lo + 2].contiguous().view(torch.float16).float()


def _fields(packed: torch.Tensor, step: int, count: int) -> torch.Tensor:
    """Bit fields of ``packed`` (n, ..., m) uint8: (n, ..., count, m) holding ``(packed >> k * step) & mask``."""
    mask = (1 << step) - 1
    return (packed.unsqueeze(-2) >> _shifts(packed.device, step, count)) & mask


def _q8_0(blocks):
    d = _f16(blocks, 0)
    return d * blocks[:, 2:].contiguous().view(torch.int8).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32): the low nibbles (elements 0-15), then the high ones (16-31)."""
    return _fields(qs, 4, 2).reshape(qs.shape[0], -1)


def _q4_0(blocks):
    d = _f16(blocks, 0)
    return d * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(blocks):
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _nibbles(blocks[:, 4:]).float() + m


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a 32-bit mask -> (n, 32): bit j of the little-endian word, for element j."""
    return _fields(qh, 1, 8).transpose(-1, -2).reshape(qh.shape[0], 32)


def _q5_0(blocks):
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:]) | (_fifth_bits(blocks[:, 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).float()


def _q5_1(blocks):
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:]) | (_fifth_bits(blocks[:, 4:8]) << 4)
    return d * q.float() + m


def _k_scales(s: torch.Tensor):
    """The 8 six-bit scales and 8 mins of a Q4_K / Q5_K block from its 12 scale bytes, as fp32 (n, 8)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


def _k_scaled(blocks, n: int):
    """(d x scale, dmin x min) of the 8 sub-blocks of a Q4_K / Q5_K block, each (n, 8, 1)."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scales(blocks[:, 4:16])
    return (d * sc).reshape(n, 8, 1), (dmin * mn).reshape(n, 8, 1)


def _q4_k(blocks):
    n = blocks.shape[0]
    d, dm = _k_scaled(blocks, n)
    q = _fields(blocks[:, 16:].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)  # sub-block 2c + t
    return (d * q.float() - dm).reshape(n, 256)


def _q5_k(blocks):
    n = blocks.shape[0]
    d, dm = _k_scaled(blocks, n)
    ql = _fields(blocks[:, 48:].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)
    qh = _fields(blocks[:, 16:48], 1, 8)  # (n, 8, 32): bit 2c + t of qh[l]
    q = ql | (qh << 4)
    return (d * q.float() - dm).reshape(n, 256)


def _q6_k(blocks):
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 2, 32)  # (half, k % 2, l)
    qh = blocks[:, 128:192].reshape(n, 2, 32)  # (half, l)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16)
    d = _f16(blocks, 208)
    low = _fields(ql, 4, 2)  # (n, half, k % 2, k // 2, l)
    low = low.transpose(2, 3).reshape(n, 2, 4, 32)  # k = 2 * (k // 2) + k % 2
    high = _fields(qh, 2, 4)  # (n, half, k, l)
    q = ((low | (high << 4)).to(torch.int8) - 32).float().reshape(n, 16, 16)  # sub-block = half * 8 + 2k + l // 16
    return ((d * scales).reshape(n, 16, 1) * q).reshape(n, 256)


def _q2_k(blocks):
    n = blocks.shape[0]
    s = blocks[:, 0:16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (s & 15).float()).reshape(n, 16, 1)
    ml = (dmin * (s >> 4).float()).reshape(n, 16, 1)
    q = _fields(blocks[:, 16:80].reshape(n, 2, 32), 2, 4)  # (n, half, shift j, l)
    q = q.reshape(n, 16, 16).float()  # sub-block = half * 8 + 2j + l // 16
    return (dl * q - ml).reshape(n, 256)


def _q3_k(blocks):
    n = blocks.shape[0]
    hmask = blocks[:, 0:32]
    qs = blocks[:, 32:96].reshape(n, 2, 32)
    s = blocks[:, 96:108]
    d = _f16(blocks, 108)
    low4 = torch.cat([s[:, 0:8] & 15, s[:, 0:8] >> 4], dim=1)  # (n, 16)
    top2 = _fields(s[:, 8:12], 2, 4).reshape(n, 16)  # scale i: bits 2 * (i // 4) of byte 8 + i % 4
    scales = ((low4 | (top2 << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).reshape(n, 16, 1)
    q = _fields(qs, 2, 4).to(torch.int8)  # (n, half, j, l)
    hbit = _fields(hmask, 1, 8).reshape(n, 2, 4, 32).to(torch.int8)  # bit 4 * half + j of hmask[l]
    q = (q - 4 * (1 - hbit)).float().reshape(n, 16, 16)
    return (dl * q).reshape(n, 256)


_BLOCK_KERNELS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
                  "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def _plain(raw: torch.Tensor, name: str) -> torch.Tensor:
    if name == "F32":
        return raw.view(torch.float32)
    if name == "F16":
        return raw.view(torch.float16).float()
    return raw.view(torch.bfloat16).float()  # BF16: exact in fp32


def _dequantize_flat(raw: torch.Tensor, qtype) -> torch.Tensor:
    """fp32 values of the contiguous raw bytes ``raw`` (1-D, whole blocks)."""
    qtype = qtype_of(qtype)
    if qtype.name in PLAIN_TYPE_NAMES:
        return _plain(raw, qtype.name)
    _, size = block_sizes(qtype)
    return _BLOCK_KERNELS[qtype.name](raw.reshape(-1, size)).reshape(-1)


def dequantize(raw: torch.Tensor, qtype, dtype: torch.dtype = torch.float32,
               device: Optional[torch.device] = None) -> torch.Tensor:
    """The weight stored as GGUF bytes ``raw`` (``uint8``, last dim in bytes) as a ``dtype`` tensor on
    ``device`` (default: where ``raw`` is), of shape :func:`logical_shape`.

    The bytes are moved first (the quantized size crosses the bus), then dequantized in fp32 in chunks of
    whole rows, each cast to ``dtype`` as it is formed: the fp32 temporary stays bounded whatever the size.
    """
    qtype = qtype_of(qtype)
    if raw.dtype != torch.uint8:
        raise TypeError(f"GGUF bytes must be uint8, got {raw.dtype}.")
    shape = logical_shape(raw.shape, qtype)
    if device is not None:
        raw = raw.to(device, non_blocking=True)
    raw = raw.contiguous()
    row_bytes = raw.shape[-1]
    rows = raw.numel() // max(1, row_bytes)
    cols = shape[-1]
    flat = raw.reshape(rows, row_bytes)
    if dtype == torch.float32 or rows * cols <= _CHUNK_ELEMENTS:
        return _dequantize_flat(flat.reshape(-1), qtype).to(dtype).reshape(shape)
    out = torch.empty(rows, cols, dtype=dtype, device=raw.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, cols))
    for lo in range(0, rows, step):
        out[lo:lo + step] = _dequantize_flat(flat[lo:lo + step].reshape(-1), qtype).reshape(-1, cols)
    return out.reshape(shape)


def workspace_bytes(numel: int, dtype: torch.dtype) -> int:
    """Device bytes one :func:`dequantize` of ``numel`` elements into ``dtype`` holds besides its output
    (an upper bound: chunked unless the target is fp32)."""
    at_once = numel if dtype == torch.float32 else min(numel, _CHUNK_ELEMENTS)
    return WORKSPACE_BYTES_PER_ELEMENT * at_once


def quantized_bytes(module: torch.nn.Module) -> int:
    """Bytes of GGUF-quantized weights held by ``module`` and its children (wherever they are)."""
    total = 0
    for sub in module.modules():
        names = list(getattr(sub, "qtypes", {}) or {})
        if getattr(sub, "weight_qtype", None) is not None:
            names.append("weight")
        for name in names:
            t = getattr(sub, name, None)
            if t is not None:
                total += t.numel() * t.element_size()
    return total
