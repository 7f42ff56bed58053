"""A fake accelerator for CPU-only tests: offload hooks point at ``cuda:3`` and transfers are recorded.

A CPU run cannot tell a hook's execution device from a parameter's device (both ``cpu``), so every
offload hook of a pipeline (model: the ``CpuOffload`` per component; sequential: every
``AlignDevicesHook``) gets ``execution_device = cuda:3`` -- constructing the device needs no CUDA -- and
``Tensor.to`` is intercepted: each call is recorded with the function that asked for it, and a CUDA
target returns the tensor unchanged (``torch.empty`` on a CUDA device is recorded and allocates on the
CPU). A stage that placed its inputs on the hook's device shows
``cuda:3``; one that used a parameter's device shows ``cpu`` (model offload) or ``meta`` (sequential).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from unittest import mock

import torch
from accelerate.hooks import SequentialHook

FAKE = torch.device("cuda", 3)


def offload_hooks(pipe) -> list:
    """Every hook with an execution device on any module of the pipeline's components."""
    hooks = []
    for component in pipe.offloader.components.values():
        for module in component.modules():
            hook = getattr(module, "_hf_hook", None)
            for h in (hook.hooks if isinstance(hook, SequentialHook) else [hook]) if hook is not None else []:
                if getattr(h, "execution_device", None) is not None:
                    hooks.append(h)
    return hooks


def point_hooks_at(pipe, device=FAKE) -> list:
    """Set every offload hook's execution device to ``device``; returns ``[(hook, previous device)]``."""
    saved = []
    for h in offload_hooks(pipe):
        saved.append((h, h.execution_device))
        h.execution_device = device
    return saved


class Transfers(list):
    """``(module name, function name, requested device)`` per ``Tensor.to``; ``allocations`` lists
    ``(function name, bytes, device)`` per ``torch.empty`` on the fake device (device buffers), and
    ``placed`` the same per ``Tensor.to`` onto it (the bytes the copy would take there)."""

    def __init__(self):
        super().__init__()
        self.allocations = []
        self.placed = []

    def largest_on_device(self) -> int:
        """The bytes of the largest tensor copied to or allocated on the fake device."""
        return max((n for _, n, _ in self.allocations + self.placed), default=0)


def _frame(skip: int = 2):
    """The frame of the function that called the intercepted function (comprehensions skipped)."""
    frame = sys._getframe(skip)
    while frame.f_code.co_name.startswith("<") and frame.f_back is not None:
        frame = frame.f_back
    return frame


def _caller() -> str:
    return _frame(3).f_code.co_name


@contextmanager
def recording_transfers():
    """Intercept ``Tensor.to`` and ``torch.empty`` on a CUDA device: yields a :class:`Transfers`.

    An allocation on the fake device returns a CPU tensor, so code that copies into device buffers
    runs for real and its numbers can be checked."""
    requests = Transfers()
    orig_to = torch.Tensor.to
    orig_empty = torch.empty

    def empty(*size, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            t = orig_empty(*size, **kwargs)
            requests.allocations.append((_caller(), t.numel() * t.element_size(), torch.device(device)))
            return t
        return orig_empty(*size, device=device, **kwargs)

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        frame = _frame()
        requests.append((frame.f_globals.get("__name__", ""), frame.f_code.co_name, device))
        if device is not None and device.type == "cuda":
            size = self.numel() * (dtype.itemsize if dtype is not None else self.element_size())
            requests.placed.append((frame.f_code.co_name, size, device))
            return orig_to(self, dtype=dtype) if dtype is not None else self
        return orig_to(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "to", to), mock.patch.object(torch, "empty", empty):
        yield requests


@contextmanager
def fake_accelerator(pipe):
    """Offload on a pretend ``cuda:3`` for the duration: yields the recorded transfer requests."""
    saved = point_hooks_at(pipe)
    try:
        with recording_transfers() as requests:
            yield requests
    finally:
        for h, device in saved:
            h.execution_device = device


def placements(requests, function) -> set:
    """Devices that lingbot_core's ``function`` requested for tensors (ignoring returns to the CPU).

    Matches ``lingbot_core`` imported on its own or as a subpackage of the pack (as ComfyUI loads it).
    """
    return {d for mod, fn, d in requests
            if "lingbot_core" in mod.split(".") and fn == function and d is not None and d.type != "cpu"}


def assert_placed_on_hook_device(requests, functions):
    for fn in functions:
        assert placements(requests, fn) == {FAKE}, f"{fn} did not place its inputs on the hook's execution device"


# -- two fake devices (components placed on different accelerators, lingbot_core/memory/placement.py) -----

FAKE_B = torch.device("cuda", 4)


@contextmanager
def fake_devices():
    """Real placement on pretend CUDA devices: load or re-hook a pipeline with ``device=FAKE`` and
    ``devices={...: FAKE_B}`` inside this context. Hooks are installed by the Offloader itself (nothing
    is re-pointed); ``Tensor.to`` is recorded and a CUDA target returns the tensor unchanged."""
    with recording_transfers() as requests:
        yield requests
