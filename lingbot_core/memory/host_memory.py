"""Page-locked (pinned) host memory of an exact size, the budget for pinned weight homes, and emptying
PyTorch's pinned-memory cache.

Offload ``block`` copies each streamed block from a pinned home (within :class:`PinBudget`) or through a
few pinned staging buffers (see :class:`lingbot_core.memory.block_streaming.BlockRing`). Both are allocated here
with ``cudaHostRegister`` on a plain host allocation, not through PyTorch's caching host allocator
(``pin_memory()``, ``torch.empty(..., pin_memory=True)``): that allocator rounds every request up to a
power of two (a 1.15 GiB MoE block would lock 2 GiB) and keeps freed blocks locked until
``torch._C._host_emptyCache()``. A registered buffer locks exactly its bytes and is unlocked the
moment :meth:`PinnedBuffer.free` runs.
"""

from __future__ import annotations

import logging
import mmap
import weakref
from typing import Callable, Optional

import torch

from .budget import GIB, available_ram, pinned_homes_from_env, total_ram

logger = logging.getLogger("lingbot_core")

# Default share of physical RAM that pinned weight homes may lock (``LINGBOT_PINNED_GB`` overrides it).
# Locked pages cannot be swapped or dropped: a quarter keeps a dense pipeline (about 11 GiB with its text
# encoder) fully pinned from 48 GB up, and leaves the page cache room on a machine that streams the MoE.
PINNED_HOMES_SHARE = 0.25
# RAM left available (``MemAvailable``) after any pin: pinning stops short of it.
PIN_HEADROOM = 4 * GIB

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as cudaHostAlloc's default
PAGE = mmap.PAGESIZE  # page locking works on whole pages


class PinnedBuffer:
    """``nbytes`` of host memory as one flat ``uint8`` tensor, page-locked when CUDA allows it.

    ``pinned`` is False where CUDA is not available or the OS refused the lock (a pinned-memory limit:
    WSL, Windows caps it near half of RAM); the buffer then still works, as pageable memory, and
    host-to-device copies from it simply do not overlap compute.

    The locked range is whole pages that belong to this buffer only: the allocation is one page
    larger, and ``tensor`` starts at its first page boundary. Two small buffers from the same heap page
    would otherwise register overlapping pages, and CUDA refuses the second registration
    (``cudaErrorHostMemoryAlreadyRegistered``). A buffer dropped without :meth:`free` (a pipeline
    released by the garbage collector) is unlocked by its finalizer.
    """

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self.pinned = False
        locked = -(-self.nbytes // PAGE) * PAGE
        raw = torch.empty(locked + PAGE if self.nbytes else 0, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE if self.nbytes else 0
        self.tensor = raw[start:start + self.nbytes]
        self._finalizer = None
        if self.nbytes and torch.cuda.is_available():
            ptr = raw.data_ptr() + start
            err = _register(ptr, locked)
            if err == 0:
                self.pinned = True
                # Holds ``raw`` (not ``self``): the memory stays allocated until it is unlocked.
                self._finalizer = weakref.finalize(self, _unregister, ptr, raw)
            else:
                _discard_cuda_error()
                logger.info("offload=block: could not pin a %d MiB staging buffer (cudaError %d); copies will not "
                            "overlap compute.", self.nbytes >> 20, err)

    def free(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unlocks once; a later garbage collection does nothing
            self._finalizer = None
        self.pinned = False
        self.tensor = None


def _register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))


def _unregister(ptr: int, raw: torch.Tensor) -> None:
    try:
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            _discard_cuda_error()
    except Exception:  # a finalizer at interpreter exit, after CUDA was torn down: the process unlocks all
        pass


def pinned_buffer(nbytes: int) -> PinnedBuffer:
    """The one place the pack pins host memory (tests count its calls)."""
    return PinnedBuffer(nbytes)


def empty_host_cache() -> None:
    """Unlock the pinned blocks PyTorch's caching host allocator keeps after they were freed.

    ``torch.cuda.empty_cache``, ComfyUI's ``soft_empty_cache`` and ``malloc_trim`` do not touch that
    cache. A no-op where CUDA was never initialised (nothing can be cached then)."""
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        fn()


def _discard_cuda_error() -> None:
    """A failed runtime call leaves CUDA's last-error set, and PyTorch's next kernel-launch check would
    report it as that kernel's failure: run and synchronise a trivial kernel so it surfaces here."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass


class PinBudget:
    """Host bytes that offload ``block`` may page-lock for weight homes (the process's: :func:`shared_pin_budget`).

    ``take(n)`` grants ``n`` bytes while the total stays within the limit and the system keeps
    :data:`PIN_HEADROOM` available after the pin; ``give(n)`` returns them when the homes are unpinned.
    The limit is ``total`` less what the host pinned itself (``pinned_elsewhere()``: ComfyUI's own pinned
    models, which it counts without ours; gpu-review-4 finding 11), read at every request.
    """

    def __init__(self, total: int, headroom: int = PIN_HEADROOM, pinned_elsewhere: Optional[Callable[[], int]] = None):
        self.total = max(0, int(total))
        self.headroom = headroom
        self.used = 0
        self.pinned_elsewhere: Callable[[], int] = pinned_elsewhere or (lambda: 0)

    def limit(self) -> int:
        return max(0, self.total - max(0, int(self.pinned_elsewhere())))

    def take(self, nbytes: int) -> bool:
        if self.used + nbytes > self.limit():
            return False
        available = available_ram()
        if available is not None and available - nbytes < self.headroom:
            return False
        self.used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)

    def left(self) -> int:
        return max(0, self.limit() - self.used)

    def excess(self) -> int:
        """Pinned bytes to give back now: what is over the limit (the host pinned more since), or the RAM
        missing from :data:`PIN_HEADROOM` (locked pages cannot be swapped out), whichever is larger."""
        over = self.used - self.limit()
        available = available_ram()
        short = 0 if available is None else self.headroom - available
        return max(0, min(self.used, max(over, short)))


_SHARED: Optional[PinBudget] = None  # the process's pin budget (module state: one object, bounded by itself)


def shared_pin_budget() -> PinBudget:
    """The process-wide budget of pinned homes (read from the environment once): every pipeline's offloader
    draws from it, so two pipelines in ``block`` (a base and its refiner) never lock more than one budget."""
    global _SHARED
    if _SHARED is None:
        _SHARED = PinBudget(pinned_homes_budget())
    return _SHARED


def pinned_homes_budget(environ=None) -> int:
    """Bytes of pinned homes allowed: ``LINGBOT_PINNED_GB`` when set, else :data:`PINNED_HOMES_SHARE` of
    physical RAM (0 where it is unknown)."""
    explicit: Optional[int] = pinned_homes_from_env(environ)
    if explicit is not None:
        return explicit
    total = total_ram()
    return 0 if total is None else int(total * PINNED_HOMES_SHARE)
