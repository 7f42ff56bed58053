"""Which dtypes and kernels a device can run well: the ``auto`` precision and where ``torch._grouped_mm`` is used.

Decisions take the CUDA compute capability as an argument (read from the device when not given), so they
can be tested without a GPU.

- **auto dtypes.** bf16 DiT and text encoder on sm80+ (Ampere and newer: the reference's precision). Below
  sm80 (Turing T4 / RTX 20xx, Volta), SDPA's flash and memory-efficient kernels refuse bf16 and the math
  fallback at refiner sizes needs tens of GB, so the DiT runs in fp16 (its fp32 islands stay fp32) and the
  text encoder in fp32 (Qwen3-VL is not validated in fp16). A CPU gets fp32 (bf16 matmuls are slow or
  emulated on many CPUs). The VAE is fp32 everywhere.
- **fp8 weights** are computed in the dtype ``auto`` gives the DiT on that device: bf16 on sm80+ (the released
  weights' precision), fp16 below sm80 (in bf16 SDPA would take the O(S^2) math kernel there), and bf16 on a
  CPU (the precision of the released weights; fp8 on a CPU is for tests and comparisons).
- **grouped matmul.** The MoE experts run as one ``torch._grouped_mm`` per weight stack wherever the
  installed torch runs it in bf16 on the device: with its CUTLASS kernel on sm90/sm100 (offsets read on
  the device: no host sync), and with torch's fallback elsewhere (one matmul per expert from C++, which
  replaces the pack's Python loop of about 8 launches per expert; torch reads the offsets on the host
  there). Whether it runs is probed once per device. On a CPU the pack's per-expert loop stays: there it
  was faster than torch's grouped kernel (docs/benchmarks.md), and a host sync costs nothing.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import torch

logger = logging.getLogger("lingbot_core")

Capability = Tuple[int, int]
BF16_MIN_CAPABILITY: Capability = (8, 0)
# Compute-capability majors with a native bf16 grouped-GEMM kernel behind torch._grouped_mm.
GROUPED_MM_MAJORS = frozenset({9, 10})


def cuda_capability(device: torch.device) -> Optional[Capability]:
    """The device's compute capability, or None off CUDA (or without a usable CUDA runtime)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def auto_dtypes(device: torch.device, capability: Optional[Capability] = None, log: bool = True) -> Dict[str, torch.dtype]:
    """What ``auto`` means on ``device`` for the DiT, the text encoder and the VAE (see the module doc)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"transformer": torch.float32, "text_encoder": torch.float32, "vae": torch.float32}
    capability = capability if capability is not None else cuda_capability(device)
    if capability is None or tuple(capability) >= BF16_MIN_CAPABILITY:
        chosen = {"transformer": torch.bfloat16, "text_encoder": torch.bfloat16, "vae": torch.float32}
        why = "bf16 DiT and text encoder"
    else:
        chosen = {"transformer": torch.float16, "text_encoder": torch.float32, "vae": torch.float32}
        why = "fp16 DiT and fp32 text encoder (below sm80 SDPA has no fast bf16 kernels)"
    if log:
        where = "unknown capability" if capability is None else "sm%d%d" % tuple(capability)
        logger.info("auto precision on %s (%s): %s, fp32 VAE.", device, where, why)
    return chosen


def fp8_compute_dtype(device: torch.device, capability: Optional[Capability] = None) -> torch.dtype:
    """The dtype fp8-stored DiT weights are turned into for compute on ``device`` (see the module doc)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.bfloat16
    return auto_dtypes(device, capability, log=False)["transformer"]


def grouped_mm_fast(device: torch.device, capability: Optional[Capability] = None) -> bool:
    """Whether ``torch._grouped_mm`` has its native bf16 kernel on ``device`` (no host sync)."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    capability = capability if capability is not None else cuda_capability(device)
    return capability is not None and capability[0] in GROUPED_MM_MAJORS


# Whether torch._grouped_mm ran in bf16 on a device: one entry per CUDA device probed (bounded by the
# number of devices in the machine).
_GROUPED_PROBES: Dict[torch.device, bool] = {}


def grouped_mm_supported(device: torch.device, capability: Optional[Capability] = None) -> bool:
    """Whether the MoE experts run as one ``torch._grouped_mm`` per weight stack on ``device``."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    if grouped_mm_fast(device, capability):
        return True
    if capability is not None or not torch.cuda.is_available():
        return False  # a capability asked about, not this machine's device: only the native kernel is known
    if device not in _GROUPED_PROBES:
        _GROUPED_PROBES[device] = _grouped_mm_runs(device)
    return _GROUPED_PROBES[device]


def _grouped_mm_runs(device: torch.device) -> bool:
    try:
        x = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        w = torch.ones(2, 16, 16, dtype=torch.bfloat16, device=device)
        torch._grouped_mm(x, w, offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
        return True
    except (RuntimeError, NotImplementedError) as e:
        logger.info("torch._grouped_mm does not run on %s (%s): the MoE experts run in a per-expert loop.", device, e)
        return False
