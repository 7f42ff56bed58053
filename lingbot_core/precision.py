"""Which dtypes and kernels a device can run well: the ``auto`` precision and where ``torch._grouped_mm`` is used.

Decisions take the CUDA compute capability as an argument (read from the device when not given), so they
can be tested without a GPU.

- **auto dtypes.** bf16 DiT and text encoder on sm80+ (Ampere and newer: the reference's precision). Below
  sm80 (Turing T4 / RTX 20xx, Volta), SDPA's flash and memory-efficient kernels refuse bf16 and the math
  fallback at refiner sizes needs tens of GB, so the DiT runs in fp16 (its fp32 islands stay fp32) and the
  text encoder in fp32 (Qwen3-VL is not validated in fp16). A CPU gets fp32 (bf16 matmuls are slow or
  emulated on many CPUs). The VAE is fp32 everywhere.
- **grouped matmul.** ``torch._grouped_mm`` has a fast bf16 kernel only on sm90/sm100 (CUTLASS); elsewhere it
  loops over the groups with one matmul each, which gains nothing over the pack's own per-expert loop
  (and was slower on CPU, docs/benchmarks.md). So it is used on CUDA sm90 and sm100 only.
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


def grouped_mm_fast(device: torch.device, capability: Optional[Capability] = None) -> bool:
    """Whether the MoE experts run as one ``torch._grouped_mm`` per weight stack on ``device``."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    capability = capability if capability is not None else cuda_capability(device)
    return capability is not None and capability[0] in GROUPED_MM_MAJORS
