"""Components on two devices: the text encoder (and the VAE) on device B, the DiT on device A.

The devices are two pretend CUDA devices (``fake_accelerator.fake_devices``): the Offloader installs its
real hooks for them, ``Tensor.to`` is recorded and returns the CPU tensor, so every number is computed
on the CPU and frames can be compared bit for bit with the same loaded copy run on the CPU. The
residency tracker records which device each component's weights were moved to and what was resident
on each device whenever a component computed.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from support.fake_accelerator import FAKE, FAKE_B, fake_devices, placements
from lingbot_core import load_pipeline
from lingbot_core.pipeline_pool import PipelineSpec
from lingbot_core.memory.placement import check_component_devices, device_choices
from support.residency import ResidencyTracker

A, B = FAKE, FAKE_B
RUN = dict(height=64, width=96, num_frames=5, steps=2, seed=7)
OFFLOADED = ("model", "block", "sequential")


@pytest.fixture(scope="module")
def pipe_and_reference(packages):
    g = torch.Generator().manual_seed(5)
    image = torch.rand(70, 100, 3, generator=g)
    pipe = load_pipeline(packages["dense"], device="cpu")
    reference = pipe.generate("a cat", image=image, **RUN)  # the same loaded copy, on the CPU
    yield pipe, image, reference
    pipe.release()


def _devices_of(onloads, component):
    return {d for name, d in onloads if name == component}


@pytest.mark.parametrize("mode, vae_on", [("none", "B"), ("model", "A"), ("model", "B"), ("block", "B"),
                                           ("sequential", "B")])
def test_text_encoder_on_b_dit_on_a(pipe_and_reference, mode, vae_on):
    pipe, image, reference = pipe_and_reference
    vae_device = A if vae_on == "A" else B
    devices = {"text_encoder": B, **({"vae": B} if vae_on == "B" else {})}
    try:
        with fake_devices() as req:
            pipe.set_offload(mode, device=A, devices=devices)
            assert pipe.offloader.execution_device("text_encoder") == B
            assert pipe.offloader.execution_device("transformer") == A
            assert pipe.offloader.execution_device("vae") == vae_device
            pipe._prompt_cache.clear()  # encode the prompt again, on its device
            with ResidencyTracker(pipe) as tr:
                frames = pipe.generate("a cat", image=image, **RUN)
                after = (tr.resident_on(A), tr.resident_on(B))
    finally:
        pipe.set_offload("none", device="cpu", devices={})
    np.testing.assert_array_equal(frames, reference)  # bit-identical
    # each stage's inputs went to its component's device
    assert placements(req, "encode_text") == {B}
    assert placements(req, "denoise") == {A}
    assert placements(req, "vae_encode") == placements(req, "vae_decode") == {vae_device}
    te = [s for p, s in tr.placed_snapshots if p == "TE"]
    dit = [s for p, s in tr.placed_snapshots if p == "DiT"]
    dec = [s for p, s in tr.placed_snapshots if p == "VAE.dec"]
    assert te and dit and dec
    if mode == "none":  # everything stays on its own device
        assert all(("text_encoder", B) in s and ("transformer", A) in s for s in te + dit)
        return
    # the weights only ever went to their own device ...
    assert _devices_of(tr.onloads, "text_encoder") == {B}
    assert _devices_of(tr.onloads, "transformer") == {A}
    assert _devices_of(tr.onloads, "vae") == {vae_device}
    # ... each component ran alone (under sequential a probe fires before its module streams in, so
    # its snapshot may still be empty; every streaming step's snapshot holds one component, on its device) ...
    alone = (lambda s, pair: s <= {pair}) if mode == "sequential" else (lambda s, pair: s == {pair})
    te_alone = (lambda s, pair: s <= {pair}) if mode == "sequential" else alone
    assert all(te_alone(s, ("text_encoder", B)) for s in te)
    assert all(alone(s, ("transformer", A)) for s in dit)
    assert all(alone(s, ("vae", vae_device)) for s in dec)
    own = {"text_encoder": B, "transformer": A, "vae": vae_device}
    streamed = [s for probe, s in tr.placed_snapshots if probe == "stream"]
    assert all(len(s) <= 1 for s in streamed)  # modules without weights of their own add nothing
    # sequential streams the text encoder and the DiT module by module; its VAE is placed whole, as under model
    # (issue 31); block streams both through rings (placement units, not module streaming)
    expected = {"sequential": set(own.items()) - {("vae", vae_device)}}.get(mode, set())
    assert set().union(*streamed) == expected
    # ... and nothing stayed on either device
    assert after == (frozenset(), frozenset())


@pytest.mark.parametrize("mode", ["model", "sequential"])
def test_nothing_resident_on_either_device_after_each_stage(pipe_and_reference, mode):
    from lingbot_core.model.latents import latent_shape
    from lingbot_core.sampling.scheduling import shifted_sigmas

    pipe, image, _ = pipe_and_reference
    try:
        with fake_devices():
            pipe.set_offload(mode, device=A, devices={"text_encoder": B, "vae": B})
            with ResidencyTracker(pipe) as tr:
                cond = pipe.encode_image(image, 64, 96)
                assert tr.resident_on(A) == tr.resident_on(B) == frozenset()
                embeds = pipe.encode_prompt("a dog", num_frames=5, condition=cond)
                assert tr.resident_on(A) == tr.resident_on(B) == frozenset()
                noise = torch.randn(latent_shape(5, 64, 96), generator=torch.Generator().manual_seed(0))
                lat = pipe.denoise(embeds, noise, sigmas=shifted_sigmas(2, 3.0))
                assert tr.resident_on(A) == tr.resident_on(B) == frozenset()
                pipe.decode(lat)
                assert tr.resident_on(A) == tr.resident_on(B) == frozenset()
    finally:
        pipe.set_offload("none", device="cpu", devices={})
    # while the DiT computed, device B held nothing; while the text encoder did, device A held nothing
    assert all(not any(d == B for _, d in s) for p, s in tr.placed_snapshots if p == "DiT")
    assert all(not any(d == A for _, d in s) for p, s in tr.placed_snapshots if p == "TE")


def test_load_pipeline_places_components_and_keeps_them_on_offload_switch(packages):
    with fake_devices():
        pipe = load_pipeline(packages["dense"], device=A, devices={"text_encoder": B}, offload="model",
                             dtypes={"transformer": "fp32", "text_encoder": "fp32", "vae": "fp32"})
        try:
            pipe.set_offload("sequential")  # the per-component device is kept
            assert pipe.offloader.execution_device("text_encoder") == B
            assert pipe.offloader.execution_device("transformer") == pipe.offloader.execution_device("vae") == A
        finally:
            pipe.release()


def test_default_dtype_follows_each_components_device(packages):
    spec = PipelineSpec.create(packages["dense"], device="cuda:0", devices={"text_encoder": "cpu"})
    assert spec.load_dtypes() == {"transformer": torch.bfloat16, "text_encoder": torch.float32, "vae": torch.float32}
    spec = PipelineSpec.create(packages["dense"], device="cpu", devices={"text_encoder": "cuda:1"})
    assert spec.load_dtypes()["text_encoder"] == torch.bfloat16 and spec.load_dtypes()["transformer"] == torch.float32


def test_placement_is_part_of_the_pipeline_key(packages):
    base = PipelineSpec.create(packages["dense"], device="cuda:0")
    assert PipelineSpec.create(packages["dense"], device="cuda:0", devices={"text_encoder": "default", "vae": None}) == base
    assert PipelineSpec.create(packages["dense"], device="cuda:0", devices={"text_encoder": "cuda:0"}) == base
    moved = PipelineSpec.create(packages["dense"], device="cuda:0", devices={"text_encoder": "cuda:1"})
    assert moved != base and moved.devices == (("text_encoder", "cuda:1"),)
    assert PipelineSpec.create(packages["dense"], device="cuda:0", devices={"text_encoder": "cuda:1"}) == moved


def test_choices_list_only_the_devices_present():
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        assert device_choices() == ["default", "cpu"]
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=1):
        assert device_choices() == ["default", "cpu", "cuda:0"]
        with pytest.raises(ValueError, match=r"text_encoder_device='cuda:1'.*1 CUDA device.*default, cpu, cuda:0"):
            check_component_devices({"text_encoder": "cuda:1"})
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "device_count", return_value=2):
        assert device_choices() == ["default", "cpu", "cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="not 'transformer'"):
        check_component_devices({"transformer": "cpu"})
    with pytest.raises(ValueError, match="vae_device='gpu'"):
        check_component_devices({"vae": "gpu"})
    with pytest.raises(ValueError, match="vae_device='meta'"):
        check_component_devices({"vae": "meta"})
    assert check_component_devices({"text_encoder": "default", "vae": "cpu"}) == {"vae": torch.device("cpu")}
