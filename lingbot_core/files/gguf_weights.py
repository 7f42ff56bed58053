"""GGUF-quantized weights: raw block bytes kept as they are, dequantized when the layer runs.

A quantized weight is a ``uint8`` tensor holding the GGUF blocks of its rows (shape ``(..., rows,
row_bytes)``; for an expert stack ``(experts, rows, row_bytes)``), usually a view of the memory-mapped
file. The module that owns it records the GGML type next to it (``Linear.weight_qtype``,
``Experts.qtypes``). Offload moves, streams and maps these bytes like any other tensor, so every
offload mode carries the quantized size (offload ``block`` copies a Q4_K block at about a quarter of
its bf16 size), and :func:`dequantize` forms the real weight on the device where the layer computes,
for one call only.

The block formulas are diffusers' torch ports (``diffusers.quantizers.gguf.utils``), evaluated in fp32:
with fp32 arithmetic they give gguf-py's numpy ``gguf.quants.dequantize`` bit for bit for every type
listed in :data:`QUANTIZED_TYPES` (tests/test_gguf_weights.py checks each one against it). The result is
cast to the compute dtype afterwards, so a bf16 weight is the correctly rounded bf16 of the exact value.
"""

from __future__ import annotations

from typing import Optional

import torch

# Only these formats are accepted in a DiT file; every other GGML type is refused by name.
QUANTIZED_TYPE_NAMES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "Q5_1", "Q5_0", "Q4_1", "Q4_0")
PLAIN_TYPE_NAMES = ("F32", "F16", "BF16")
# fp32 elements dequantized at a time for a large tensor (bounds the fp32 temporary to 64 MiB when the
# weight is wanted in bf16).
_CHUNK_ELEMENTS = 1 << 24


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


def _kernels():
    """GGML type -> torch block kernel (diffusers' ports; see the module docstring)."""
    from diffusers.quantizers.gguf import utils

    return utils.dequantize_functions


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
    block, size = block_sizes(qtype)
    blocks = raw.reshape(-1, size)
    return _kernels()[qtype](blocks, block, size, torch.float32).reshape(-1)


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
