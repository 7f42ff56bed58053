"""Process memory: how much RAM is available, what a package will cost once loaded, and handing freed
memory back to the operating system.

Linux-first (``/proc``); elsewhere ``psutil`` when it is installed. Where neither answers, the
functions return ``None`` and callers skip the RAM check instead of guessing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sys
from pathlib import Path
from typing import Dict, Optional

import torch

from ..files.checkpoint_files import safetensors_header

logger = logging.getLogger("lingbot_core")

GIB = 1024 ** 3
MIB = 1024 ** 2

# safetensors header dtype names -> bytes per element
_SAFETENSORS_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}
_FLOAT_TAGS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def _meminfo_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/meminfo", "r", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def available_ram() -> Optional[int]:
    """Bytes the system can still give to this process without swapping (Linux ``MemAvailable``)."""
    return _system_ram("MemAvailable", "available")


def total_ram() -> Optional[int]:
    """Bytes of physical memory (Linux ``MemTotal``)."""
    return _system_ram("MemTotal", "total")


def _system_ram(meminfo_field: str, psutil_field: str) -> Optional[int]:
    kib = _meminfo_kib(meminfo_field)
    if kib is not None:
        return kib * 1024
    try:
        import psutil
    except ImportError:
        return None
    return int(getattr(psutil.virtual_memory(), psutil_field))


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS (Linux: "5" into ``/proc/self/clear_refs``);
    False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def process_rss(pid: Optional[int] = None) -> Optional[int]:
    """Resident set size of ``pid`` (default: this process) in bytes."""
    path = f"/proc/{pid or 'self'}/status"
    try:
        with open(path, "r", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process(pid or os.getpid()).memory_info().rss)


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # glibc only (musl has none)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (cheap; no garbage collection)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def return_freed_memory() -> None:
    """Collect unreachable objects now and hand freed heap pages back to the OS.

    glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold in the heap, so the
    RSS of a process that just dropped hundreds of medium-size tensors stays high until
    ``malloc_trim`` returns those pages.
    """
    gc.collect()
    trim_heap()


# -- what a package costs --------------------------------------------------------------------------


def tensor_bytes(path, dtype: Optional[torch.dtype] = None, keep_fp32=None) -> int:
    """Bytes the tensors of ``path`` take once loaded with floating tensors cast to ``dtype``.

    ``keep_fp32(name)`` marks tensors that stay fp32 whatever ``dtype`` is (the DiT's fp32 islands).
    """
    return sum(loaded_tensor_bytes(path, dtype, keep_fp32).values())


def loaded_tensor_bytes(path, dtype: Optional[torch.dtype] = None, keep_fp32=None) -> Dict[str, int]:
    """Bytes of each tensor of ``path`` once loaded (see :func:`tensor_bytes`)."""
    target = torch.empty(0, dtype=dtype).element_size() if dtype is not None else None
    out = {}
    for name, info in safetensors_header(path).items():
        count = 1
        for d in info["shape"]:
            count *= int(d)
        tag = info["dtype"]
        size = _SAFETENSORS_ITEMSIZE.get(tag, 4)
        if tag in _FLOAT_TAGS and target is not None:
            size = 4 if keep_fp32 is not None and keep_fp32(name) else target
        out[name] = count * size
    return out


def text_encoder_file_bytes(path, dtype: Optional[torch.dtype] = None) -> Dict[str, int]:
    """Bytes of each tensor of a single text-encoder file once loaded: a llama.cpp text GGUF's quantized
    weights at their mapped size (``text_encoder_gguf.loaded_bytes``, header only), a safetensors file's
    tensors cast to ``dtype``."""
    from ..model.text_encoder_gguf import is_gguf, loaded_bytes

    return loaded_bytes(path, dtype) if is_gguf(path) else loaded_tensor_bytes(path, dtype)


def package_bytes(model_dir, transformer_subfolder: str, dtypes: Dict[str, torch.dtype],
                  files: Optional[dict] = None) -> int:
    """RAM the weights of one pipeline take at the given component dtypes (headers only, no weights read).

    ``files`` (component -> single file, as ``load_pipeline`` takes them) replace package components; a
    GGUF DiT counts its quantized weights at their mapped file size (they stay mapped)."""
    from ..files.checkpoint_files import safetensors_files
    from ..model.transformer import is_fp32_island

    root = None if model_dir is None else Path(model_dir)  # None: the three files alone
    files = files or {}
    total = 0
    for comp, sub, stem, dtype, islands in (
        ("transformer", transformer_subfolder, "diffusion_pytorch_model", dtypes["transformer"], is_fp32_island),
        ("text_encoder", "text_encoder", "model", dtypes["text_encoder"], None),
        ("vae", "vae", "diffusion_pytorch_model", dtypes["vae"], None),
    ):
        single = files.get(comp)
        if single and comp == "transformer":
            from ..model.dit_files import DitFile, loaded_bytes, transformer_config

            dit = DitFile(single)
            total += sum(loaded_bytes(dit, dtype, transformer_config(root, sub, single, dit)).values())
            continue
        if single and comp == "text_encoder":
            total += sum(text_encoder_file_bytes(single, dtype).values())
            continue
        for path in [Path(single)] if single else safetensors_files(root / sub, sub, stem):
            total += tensor_bytes(path, dtype, islands)
    return total


def format_bytes(n: Optional[int]) -> str:
    if n is None:
        return "unknown"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


RAM_BUDGET_ENV = "LINGBOT_RAM_BUDGET_GB"
PINNED_HOMES_ENV = "LINGBOT_PINNED_GB"


def ram_budget_from_env(environ=None) -> Optional[int]:
    """``LINGBOT_RAM_BUDGET_GB`` in bytes (GB counted as GiB, ``1024 ** 3``), or None when unset/empty."""
    return _gib_from_env(RAM_BUDGET_ENV, environ, zero_ok=False, what="the GB of RAM LingBot pipelines may hold "
                                                                       "(e.g. 48), or unset it to use the RAM available")


def pinned_homes_from_env(environ=None) -> Optional[int]:
    """``LINGBOT_PINNED_GB`` in bytes (0 turns pinned homes off), or None when unset/empty."""
    return _gib_from_env(PINNED_HOMES_ENV, environ, zero_ok=True,
                         what="the GB of RAM offload 'block' may page-lock for weights (0 = none), or unset it "
                              "for a quarter of the machine's RAM")


def _gib_from_env(name: str, environ, zero_ok: bool, what: str) -> Optional[int]:
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return None
    try:
        gb = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; set it to {what}.") from None
    if gb != gb or gb == float("inf") or gb < 0 or (gb == 0 and not zero_ok):
        raise ValueError(f"{name}={raw!r} must be a {'non-negative' if zero_ok else 'positive'}, finite number of GB.")
    return int(gb * 1024 ** 3)
