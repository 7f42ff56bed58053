"""Two loads of a model compared on alike memory layouts (issue 28).

A memory-mapped checkpoint hands its tensors out at the file's offsets (safetensors: 8-byte aligned,
``data_ptr() % 64 == 40`` for the fixtures), while a dequantized, converted or cloned tensor is 64-byte
aligned. CPU kernels may round differently for the two (torch's one-row Linear does on AVX-512 with
bf16, measured: 6e-8 on the time MLP), and a MoE's top-k routing turns that into another expert
choice (1e-3 in the latents after two steps). So a test comparing two loads of a MoE (two files, a
GGUF and its dequantized package, LoRA run-time adapters and a merged package, a pool handle and a
direct load) first gives both sides the same layout with :func:`align_alike`; then both run the same
kernels on the same numbers on any CPU, and what remains is what the test is about.
"""

from __future__ import annotations

import torch

from lingbot_core.model.transformer import KERNEL_ALIGNMENT, kernel_aligned

COMPONENTS = ("transformer", "text_encoder", "vae")


def _values(module):
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        # GGUF block bytes and fp8 weights are dequantized into fresh (aligned) buffers when a layer runs.
        if tensor.is_floating_point() and tensor.element_size() > 1:
            yield name, tensor


def misaligned(pipe) -> list:
    """``component.name`` of every CPU value tensor of ``pipe`` that is not 64-byte aligned."""
    return [f"{c}.{name}" for c in COMPONENTS for name, t in _values(getattr(pipe, c))
            if t.device.type == "cpu" and t.data_ptr() % KERNEL_ALIGNMENT]


def align_alike(*pipes) -> int:
    """Give every CPU value tensor of each pipeline 64-byte aligned memory (a copy where it is not);
    returns how many were copied. For tests only: the copies leave the file mapping (RAM)."""
    moved = sum(align_module(getattr(pipe, c)) for pipe in pipes for c in COMPONENTS)
    assert not any(misaligned(p) for p in pipes)
    return moved


def align_module(module, raw_bytes: bool = False) -> int:
    """:func:`align_alike` for one module (a component loaded on its own); returns how many were copied.
    ``raw_bytes`` also aligns weights kept as their GGUF bytes (uint8): an F32/F16 one is viewed, not
    copied, when a layer runs, so its file offset is the kernel's."""
    moved = 0
    tensors = list(_values(module))
    if raw_bytes:
        tensors += [(n, t) for n, t in module.named_parameters() if t.dtype == torch.uint8]
    for _, t in tensors:
        aligned = kernel_aligned(t.data)
        if aligned is not t.data:
            t.data = aligned
            moved += 1
    return moved


def at_offset(tensor: torch.Tensor, offset: int = 40) -> torch.Tensor:
    """A copy of ``tensor`` whose data lies at ``data_ptr() % 64 == offset`` (as a memory-mapped
    safetensors file may place it): the alignment-changing fixture."""
    size = tensor.element_size()
    assert offset % size == 0
    buf = torch.empty(tensor.numel() + 2 * KERNEL_ALIGNMENT // size, dtype=tensor.dtype)
    skip = ((offset - buf.data_ptr()) % KERNEL_ALIGNMENT) // size
    out = buf[skip:skip + tensor.numel()].view(tensor.shape)
    out.copy_(tensor)
    assert out.data_ptr() % KERNEL_ALIGNMENT == offset and torch.equal(out, tensor)
    return out


def in_file_mapping(tensor: torch.Tensor, path) -> bool:
    """Whether ``tensor``'s first byte lies in a memory mapping of ``path`` (file-backed, not a copy)."""
    from pathlib import Path

    addr, target = tensor.data_ptr(), str(Path(path).resolve())
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == target:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    return True
    return False
