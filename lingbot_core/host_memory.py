"""Page-locked (pinned) host memory of an exact size, and emptying PyTorch's pinned-memory cache.

Offload ``block`` copies each DiT block through a few pinned staging buffers (see
:class:`lingbot_core.offload.BlockRing`). They are allocated here with ``cudaHostRegister`` on a plain
host allocation, not through PyTorch's caching host allocator (``pin_memory()``,
``torch.empty(..., pin_memory=True)``): that allocator rounds every request up to a power of two
(a 1.15 GiB MoE block would lock 2 GiB) and keeps freed blocks locked until
``torch._C._host_emptyCache()``. A registered buffer locks exactly its bytes and is unlocked the
moment :meth:`PinnedBuffer.free` runs.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("lingbot_core")

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as cudaHostAlloc's default


class PinnedBuffer:
    """``nbytes`` of host memory as one flat ``uint8`` tensor, page-locked when CUDA allows it.

    ``pinned`` is False where CUDA is not available or the OS refused the lock (a pinned-memory limit:
    WSL, Windows caps it near half of RAM); the buffer then still works, as pageable memory, and
    host-to-device copies from it simply do not overlap compute.
    """

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self.tensor = torch.empty(self.nbytes, dtype=torch.uint8)
        self.pinned = False
        if self.nbytes and torch.cuda.is_available():
            err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, _PORTABLE))
            if err == 0:
                self.pinned = True
            else:
                _discard_cuda_error()
                logger.info("offload=block: could not pin a %d MiB staging buffer (cudaError %d); copies will not "
                            "overlap compute.", self.nbytes >> 20, err)

    def free(self) -> None:
        if self.pinned:
            self.pinned = False
            if int(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())) != 0:
                _discard_cuda_error()
        self.tensor = None


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
