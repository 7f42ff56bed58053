"""What offloading copies, counted in bytes on a fake device whose copies are real copies (issue 24
item 3), and where offload ``none`` puts each component (issue 25 item 3).

``device_clones`` replaces ``Tensor.to``: a copy to a CUDA device returns a *new* tensor (a clone on
the CPU, remembered as device memory) and a copy of such a tensor back to the CPU is a device-to-host
transfer, counted in bytes when the tensor is a weight (a parameter or a buffer of a component). So a
stage end that evicts by copying the weights back shows up as bytes, and one that only drops the
device copies shows 0.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from support.fake_accelerator import FAKE, FAKE_B, point_hooks_at
from lingbot_core import load_pipeline

RUN = dict(height=64, width=96, num_frames=5, steps=2, seed=7)


class Moves:
    def __init__(self):
        self.to_device = []  # (source data_ptr, bytes, device)
        self.d2h_weight_bytes = 0
        self.h2d_bytes = 0
        self._device = {}  # data_ptr -> the clone standing for device memory (kept alive: no address reuse)


@contextmanager
def device_clones(weights=()):
    """``weights``: data_ptrs counted as weights besides Parameters (the components' buffers)."""
    moves, orig_to, orig_empty = Moves(), torch.Tensor.to, torch.empty
    weight_ptrs = set(weights)

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        src = orig_to(self, dtype=dtype) if dtype is not None else self
        if device is not None and device.type == "cuda":
            clone = src.detach().clone()
            if isinstance(self, nn.Parameter):  # as Tensor.to returns for a Parameter (accelerate rewraps it)
                clone = nn.Parameter(clone, requires_grad=self.requires_grad)
            moves.to_device.append((self.data_ptr(), self.numel() * self.element_size(), device))
            moves.h2d_bytes += clone.numel() * clone.element_size()
            moves._device[clone.data_ptr()] = clone
            return clone
        if device is not None and device.type == "cpu" and self.data_ptr() in moves._device:
            if isinstance(self, nn.Parameter) or self.data_ptr() in weight_ptrs:
                moves.d2h_weight_bytes += self.numel() * self.element_size()
            return src.detach().clone()
        return orig_to(self, *args, **kwargs)

    def empty(*size, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            t = orig_empty(*size, **kwargs)
            moves._device[t.data_ptr()] = t
            return t
        return orig_empty(*size, device=device, **kwargs)

    with mock.patch.object(torch.Tensor, "to", to), mock.patch.object(torch, "empty", empty):
        yield moves


@pytest.fixture(scope="module")
def pipe_and_reference(packages):
    g = torch.Generator().manual_seed(5)
    image = torch.rand(70, 100, 3, generator=g)
    pipe = load_pipeline(packages["dense"], device="cpu")
    reference = pipe.generate("a cat", image=image, **RUN)
    yield pipe, image, reference
    pipe.release()


def _component_bytes(pipe, name):
    return sum(t.numel() * t.element_size() for t in pipe.offloader.components[name].parameters())


@pytest.mark.parametrize("mode", ["model", "block"])
def test_stage_end_copies_no_weight_back_to_the_host(pipe_and_reference, mode):
    """Every stage end drops the device copies and keeps the host copies: 0 weight bytes device-to-host,
    while the weights really were copied to the device (at least each component once) and the frames
    are those of the CPU run."""
    pipe, image, reference = pipe_and_reference
    pipe.set_offload(mode, device="cpu")
    try:
        point_hooks_at(pipe)
        if mode == "block":
            pipe.transformer._hf_hook.execution_device = FAKE
        with device_clones() as moves:
            pipe._prompt_cache.clear()
            frames = pipe.generate("a cat", image=image, **RUN)
        np.testing.assert_allclose(frames, reference, rtol=0, atol=1e-4)
        assert moves.h2d_bytes >= sum(_component_bytes(pipe, n) for n in ("text_encoder", "vae"))
        assert moves.d2h_weight_bytes == 0
        assert pipe.offloader.resident() == []  # and nothing stayed behind
    finally:
        pipe.set_offload("none", device="cpu", devices={})


def test_offload_none_puts_each_component_on_its_own_device(pipe_and_reference):
    """Issue 25 item 3: offload ``none`` with ``text_encoder`` and ``vae`` on device B moves their weights
    to B and only the DiT's to A (a text encoder on the DiT's card would not fit, or mismatch devices)."""
    pipe, image, reference = pipe_and_reference
    homes = {name: {t.data_ptr() for t in list(m.parameters()) + list(m.buffers())}
             for name, m in pipe.offloader.components.items()}
    try:
        with device_clones() as moves:
            pipe.set_offload("none", device=FAKE, devices={"text_encoder": FAKE_B, "vae": FAKE_B})
        where = {name: {d for ptr, _, d in moves.to_device if ptr in ptrs} for name, ptrs in homes.items()}
        assert where == {"text_encoder": {FAKE_B}, "vae": {FAKE_B}, "transformer": {FAKE}}
        moved = {name: sum(n for ptr, n, _ in moves.to_device if ptr in ptrs) for name, ptrs in homes.items()}
        assert moved["text_encoder"] >= _component_bytes(pipe, "text_encoder")
    finally:
        pipe.set_offload("none", device="cpu", devices={})
