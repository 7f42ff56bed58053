"""The fp32 islands of a DiT loaded for the CPU sit in 64-byte aligned memory, wherever the file put them
(issue 51: skipping this alignment at load was the cause of round two's machine-dependent frames, and no
test noticed). A single-file DiT is rewritten here so that its islands lie off 64 bytes in the file."""

from __future__ import annotations

import json
import struct

import pytest
from safetensors.torch import load_file, save_file

from lingbot_core import load_pipeline
from lingbot_core.model.transformer import KERNEL_ALIGNMENT, is_fp32_island


def _misaligned_copy(src, dst) -> list:
    """``src`` saved again with a metadata entry sized so that some fp32 island's bytes begin off a 64-byte
    boundary of the file; returns those islands' names (the test's precondition)."""
    tensors = load_file(str(src))
    for pad in range(0, 64, 8):
        save_file(tensors, str(dst), metadata={"format": "pt", "pad": "x" * pad})
        raw = dst.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        off = [k for k, v in header.items() if k != "__metadata__" and is_fp32_island(k)
               and (8 + n + v["data_offsets"][0]) % KERNEL_ALIGNMENT]
        if off:
            return off
    raise AssertionError("no layout put an island off 64 bytes")


def _misaligned_islands(pipe) -> list:
    model = pipe.transformer
    return [name for name, t in list(model.named_parameters()) + list(model.named_buffers())
            if is_fp32_island(name) and t.data_ptr() % KERNEL_ALIGNMENT]


@pytest.mark.parametrize("source", ["package", "single file"])
def test_fp32_islands_are_64_byte_aligned_after_a_cpu_load(packages, tmp_path, source):
    package = packages["dense"]
    dit = package / "transformer" / "diffusion_pytorch_model.safetensors"
    if source == "single file":
        dit = tmp_path / "dit.safetensors"
        assert _misaligned_copy(package / "transformer" / "diffusion_pytorch_model.safetensors", dit)
        pipe = load_pipeline(package, device="cpu", transformer_file=dit)
    else:
        pipe = load_pipeline(package, device="cpu")
    try:
        islands = [n for n, _ in pipe.transformer.named_parameters() if is_fp32_island(n)]
        assert islands
        assert _misaligned_islands(pipe) == []
    finally:
        pipe.release()
