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
- **grouped matmul.** The MoE experts run as one ``torch._grouped_mm`` per weight stack where the
  installed torch runs it in bf16 on the device (probed once per device), with two limits
  (:func:`grouped_dispatch`): a width (hidden size or expert width) not a multiple of 8 takes the loop
  (torch's 16-byte stride rule would raise), and off torch's native kernel (its fallback reads the offsets
  on the host and launches one matmul per expert, three times per 8,192-token chunk) the loop is used above
  :data:`FALLBACK_GROUPED_MAX_TOKENS` tokens, where the loop's one sync and fewer launches win (gpu-review-3
  finding 6; unmeasured on sm80/89). Whether the kernel is native is probed on each CUDA device at placement
  (:func:`probe_grouped_mm`, from ``Offloader.apply``; never mid-forward, where its two synchronisations and
  its process-wide sync-debug switch would land inside whatever is being timed): one grouped call on
  transposed stacks, as the experts pass them, that makes no host sync (``torch.cuda.set_sync_debug_mode``).
  For a device not probed yet, or a capability asked about without its device, torch's architecture list
  (sm90/sm100) stands in, and only the native kernel counts as running. On a CPU the pack's per-expert loop stays:
  there it was faster than torch's grouped kernel (docs/benchmarks.md), and a host sync costs nothing.
- **sm70/75 experts** run with bf16 operands like everywhere else (the reference's numbers); those GPUs
  have no bf16 tensor cores, so the MoE experts are slow there. fp16 operands are not used: unmeasured
  against the fidelity bounds (gpu-review-3 finding 12).
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


# Tokens above which torch's fallback grouped kernel (host-read offsets, one matmul per expert) loses to
# the per-expert loop: the grouped path's chunk (transformer.GROUPED_CHUNK_TOKENS), one pass of three calls.
FALLBACK_GROUPED_MAX_TOKENS = 8192
# Whether torch._grouped_mm made no host sync on a device (its native kernel): one entry per CUDA device.
_GROUPED_NATIVE: Dict[torch.device, bool] = {}


def grouped_mm_fast(device: torch.device, capability: Optional[Capability] = None) -> bool:
    """Whether ``torch._grouped_mm`` has its native bf16 kernel on ``device`` (no host sync): the placement
    probe's answer for this machine's CUDA device (:func:`probe_grouped_mm`); before it, or for a
    ``capability`` asked about, torch's architecture list. Never probes (it is asked per MoE layer call)."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    if capability is None and device in _GROUPED_NATIVE:
        return _GROUPED_NATIVE[device]
    capability = capability if capability is not None else cuda_capability(device)
    return capability is not None and capability[0] in GROUPED_MM_MAJORS


def probe_grouped_mm(device: torch.device) -> bool:
    """Probe ``torch._grouped_mm`` on this machine's CUDA ``device`` once (at placement): whether its native
    kernel runs (no host sync) and, if not, whether the fallback runs at all. Returns the native answer;
    False off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm") or not torch.cuda.is_available():
        return False
    if device not in _GROUPED_NATIVE:
        _GROUPED_NATIVE[device] = _grouped_mm_sync_free(device)
    if not _GROUPED_NATIVE[device] and device not in _GROUPED_PROBES:
        _GROUPED_PROBES[device] = _grouped_mm_runs(device)
    return _GROUPED_NATIVE[device]


def _probe_operands(device: torch.device):
    """A 16-token bf16 call on two experts, with the stacks ``(experts, out, in)`` passed transposed (a
    non-contiguous view), as ``run_experts`` passes them; widths multiples of 8."""
    x = torch.ones(16, 32, dtype=torch.bfloat16, device=device)
    w = torch.ones(2, 16, 32, dtype=torch.bfloat16, device=device).transpose(-2, -1)
    offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
    return x, w, offs


def grouped_dispatch(tokens: int, dim: int, hidden: int, *, supported: bool, native: bool) -> bool:
    """Whether a MoE layer call of ``tokens`` tokens (model width ``dim``, expert width ``hidden``) runs the
    grouped path: where it runs at all, both widths are multiples of 8 (16-byte strides in bf16), and off
    the native kernel only up to :data:`FALLBACK_GROUPED_MAX_TOKENS` tokens (see the module doc)."""
    if not supported or dim % 8 or hidden % 8:
        return False
    return native or tokens <= FALLBACK_GROUPED_MAX_TOKENS


def use_grouped_mm(device: torch.device, tokens: int, dim: int, hidden: int,
                   capability: Optional[Capability] = None) -> bool:
    """:func:`grouped_dispatch` for ``device`` (its probes, or a ``capability`` asked about)."""
    supported = grouped_mm_supported(device, capability)
    return grouped_dispatch(tokens, dim, hidden, supported=supported,
                            native=supported and grouped_mm_fast(device, capability))


def _grouped_mm_sync_free(device: torch.device) -> bool:
    """One small grouped call on ``device``: True when it ran and made no host synchronisation."""
    import warnings

    try:
        x, w, offs = _probe_operands(device)
        torch.cuda.synchronize(device)
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                torch._grouped_mm(x, w, offs=offs)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 -- no native kernel known: the fallback rules apply
        logger.info("torch._grouped_mm probe on %s failed (%s): treated as torch's fallback kernel.", device, e)
        return False
    return not any("synchroniz" in str(w.message) for w in caught)


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
    return _GROUPED_PROBES.get(device, False)  # probed at placement; never here, per MoE layer call


def _grouped_mm_runs(device: torch.device) -> bool:
    try:
        x, w, offs = _probe_operands(device)
        torch._grouped_mm(x, w, offs=offs)
        return True
    except (RuntimeError, NotImplementedError) as e:
        logger.info("torch._grouped_mm does not run on %s (%s): the MoE experts run in a per-expert loop.", device, e)
        return False
