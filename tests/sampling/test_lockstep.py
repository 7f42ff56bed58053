"""CFG branches in lockstep (issue 17 item 2): frames bit-identical to one forward after the other in
every offload mode (dense, MoE, fp8), and half the weight bytes copied per step under streaming
offload, counted by the residency tracker (``bytes_moved``)."""

import numpy as np
import pytest
import torch

from lingbot_core import OFFLOAD_MODES, load_pipeline
from lingbot_core.sampling.scheduling import shifted_sigmas
from support.residency import ResidencyTracker
from support.sizes import RUN


def _nbytes(module):
    return sum(t.numel() * t.element_size() for t in module.parameters())


@pytest.mark.parametrize("variant", ["dense", "moe", "fp8"])
def test_lockstep_frames_bit_identical_in_every_offload_mode(packages, variant):
    package = packages["dense" if variant == "dense" else "moe"]
    dtypes = {"transformer": "fp8_e4m3fn"} if variant == "fp8" else None
    pipe = load_pipeline(package, device="cpu", dtypes=dtypes, cfg_lockstep=False)
    try:
        reference = pipe.generate("a cat", **RUN)  # sequential CFG, no offload
        for mode in OFFLOAD_MODES:
            pipe.set_offload(mode, blocks_on_gpu=1 if mode == "block" else None)
            for lockstep in (True, False):
                pipe.set_speed(cfg_lockstep=lockstep)
                np.testing.assert_array_equal(pipe.generate("a cat", **RUN), reference, err_msg=f"{mode} lockstep={lockstep}")
    finally:
        pipe.release()


def _bytes_per_step(pipe, lockstep):
    """Weight bytes copied to the device per denoising step: a 3-step minus a 2-step denoise (the
    DiT's one-off placements cancel out)."""
    pipe.set_speed(cfg_lockstep=lockstep)
    embeds = pipe.encode_prompt("a cat", num_frames=RUN["num_frames"])
    noise = torch.randn(1, 16, 2, 8, 12, generator=torch.Generator().manual_seed(0))  # the RUN latent
    moved = []
    for steps in (2, 3):
        with ResidencyTracker(pipe) as tr:
            pipe.denoise(embeds, noise, sigmas=shifted_sigmas(steps, 3.0))
        moved.append(tr.bytes_moved)
    return moved[1] - moved[0]


@pytest.mark.parametrize("k", [0, 2])
def test_block_offload_copies_half_the_bytes_per_step(deep_package, k):  # noqa: F811
    pipe = load_pipeline(deep_package, offload="block", blocks_on_gpu=k, device="cpu")
    try:
        old, new = _bytes_per_step(pipe, False), _bytes_per_step(pipe, True)
        streamed = sum(_nbytes(b) for b in pipe.transformer.blocks[k:])
        assert old == 2 * streamed  # every streamed block once per branch
        assert new == streamed and new / old <= 0.52
    finally:
        pipe.release()


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_sequential_offload_streams_each_block_once_per_step(packages, deep_package, variant):  # noqa: F811
    pipe = load_pipeline(deep_package if variant == "dense" else packages["moe"], offload="sequential", device="cpu")
    try:
        dit = pipe.transformer
        old, new = _bytes_per_step(pipe, False), _bytes_per_step(pipe, True)
        assert old == 2 * _nbytes(dit)  # the whole DiT streamed per branch
        # In lockstep only the per-branch modules (text embedding, output projection) run twice.
        assert new == _nbytes(dit) + _nbytes(dit.text_embedder) + _nbytes(dit.proj_out)
    finally:
        pipe.release()
