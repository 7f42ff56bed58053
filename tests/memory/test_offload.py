"""Offload lifecycle: residency, input placement, sequential streaming, mode switching, release.

Model-offload scenarios run against a *fake accelerator* (``fake_accelerator.py``: every offload hook's
execution device is ``cuda:3`` and ``Tensor.to`` is recorded), so a CPU run shows where each stage asked
its inputs to go. The residency tracker shows which components would be on the accelerator whenever
each one computes.
"""

import gc
import weakref
from unittest import mock

import numpy as np
import pytest
import torch
from accelerate.hooks import AlignDevicesHook, CpuOffload

from support.fake_accelerator import FAKE, assert_placed_on_hook_device, fake_accelerator
from lingbot_core import load_pipeline
from lingbot_core.memory.offload import Offloader, execution_device_of
from support.residency import ResidencyTracker, only
from support.sizes import RUN, SIZE

STAGE_FUNCTIONS = ("vae_encode", "vae_decode", "encode_text", "denoise")


@pytest.fixture
def model_pipe(packages):
    pipe = load_pipeline(packages["dense"], offload="model", device="cpu")
    yield pipe
    pipe.release()


def leave_resident(pipe, tracker):
    """Start dirty, as after code that ran a component outside any stage: TE and VAE resident."""
    for name in ("text_encoder", "vae"):
        module = pipe.offloader.components[name]
        module._hf_hook.pre_forward(module)
    assert tracker.current() == {"text_encoder", "vae"}


# -- model offload: one component resident at every compute, none after each stage -------------


def test_model_chain_structure(model_pipe):
    chain = model_pipe.offloader._chain
    components = model_pipe.offloader.components
    names = [next(n for n, m in components.items() if m is h.model) for h in chain]
    assert names == ["text_encoder", "transformer", "vae"]
    prevs = [None if h.hook.prev_module_hook is None else h.hook.prev_module_hook.model for h in chain]
    assert prevs == [None, model_pipe.text_encoder, model_pipe.transformer]
    assert all(isinstance(m._hf_hook, CpuOffload) for m in model_pipe.offloader.components.values())


def test_t2v_one_call(model_pipe):
    with ResidencyTracker(model_pipe) as tr, fake_accelerator(model_pipe) as req:
        leave_resident(model_pipe, tr)
        model_pipe.generate("a cat", **RUN)
        assert tr.current() == frozenset()
    assert only(tr.seen("TE"), "text_encoder")
    assert len(tr.seen("DiT")) == RUN["steps"] and only(tr.seen("DiT"), "transformer")  # CFG in lockstep: one call per step
    assert only(tr.seen("VAE.dec"), "vae")
    assert tr.pre_forward_calls["text_encoder"] >= 1, "the text encoder's offload hook never fired"
    assert_placed_on_hook_device(req, ("encode_text", "denoise", "vae_decode"))


def test_ti2v_one_call(model_pipe, test_image):
    with ResidencyTracker(model_pipe) as tr, fake_accelerator(model_pipe) as req:
        leave_resident(model_pipe, tr)
        model_pipe.generate("a cat", image=test_image, **RUN)
        assert tr.current() == frozenset()
    assert only(tr.seen("VAE.enc"), "vae")
    assert only(tr.seen("TE"), "text_encoder")
    assert only(tr.seen("DiT"), "transformer")
    assert only(tr.seen("VAE.dec"), "vae")
    assert_placed_on_hook_device(req, STAGE_FUNCTIONS)


def test_separate_stages_prompt_image_denoise_decode(model_pipe, test_image):
    from lingbot_core.model.latents import latent_shape
    from lingbot_core.sampling.scheduling import shifted_sigmas

    with ResidencyTracker(model_pipe) as tr, fake_accelerator(model_pipe) as req:
        leave_resident(model_pipe, tr)
        embeds = model_pipe.encode_prompt("a cat", num_frames=5)
        assert tr.current() == frozenset()
        cond = model_pipe.encode_image(test_image, **SIZE)
        assert tr.current() == frozenset()
        g = torch.Generator().manual_seed(0)
        cond_latent = model_pipe.normalizer.to_dit(cond.posterior.sample(g)).float()
        noise = torch.randn(latent_shape(5, **SIZE), generator=g)
        lat = model_pipe.denoise(embeds, noise, sigmas=shifted_sigmas(3, 3.0), condition_latent=cond_latent)
        assert tr.current() == frozenset()
        model_pipe.decode(lat)
        assert tr.current() == frozenset()
    assert only(tr.seen("TE"), "text_encoder") and only(tr.seen("VAE.enc"), "vae")
    assert only(tr.seen("DiT"), "transformer") and only(tr.seen("VAE.dec"), "vae")
    assert_placed_on_hook_device(req, STAGE_FUNCTIONS)


def test_image_encode_after_complete_generate(model_pipe, test_image):
    """Another branch ran a whole generate first (decode left the VAE last); the encode still runs alone."""
    with ResidencyTracker(model_pipe) as tr, fake_accelerator(model_pipe) as req:
        model_pipe.generate("a dog", **RUN)
        tr.clear()
        leave_resident(model_pipe, tr)
        cond = model_pipe.encode_image(test_image, **SIZE)
        assert tr.current() == frozenset()
        model_pipe.generate("a cat", condition=cond, **RUN)
        assert tr.current() == frozenset()
    assert only(tr.seen("VAE.enc"), "vae")
    assert only(tr.seen("DiT"), "transformer")
    assert_placed_on_hook_device(req, STAGE_FUNCTIONS)


def test_decode_alone_then_denoise(model_pipe):
    from lingbot_core.sampling.scheduling import shifted_sigmas

    lat = model_pipe.generate("a cat", output_type="latent", **RUN)
    embeds = model_pipe.encode_prompt("a cat", num_frames=5)
    with ResidencyTracker(model_pipe) as tr, fake_accelerator(model_pipe) as req:
        leave_resident(model_pipe, tr)
        model_pipe.decode(lat)
        assert tr.current() == frozenset()
        model_pipe.denoise(embeds, torch.randn(lat.shape, generator=torch.Generator().manual_seed(1)), sigmas=shifted_sigmas(3, 3.0))
        assert tr.current() == frozenset()
    assert only(tr.seen("VAE.dec"), "vae") and only(tr.seen("DiT"), "transformer")
    assert_placed_on_hook_device(req, ("vae_decode", "denoise"))


def test_refiner_flow(packages, test_image):
    base = load_pipeline(packages["moe"], device="cpu")
    frames = base.generate("a cat", **RUN)
    base.release()
    refiner = load_pipeline(packages["moe"], transformer_subfolder="refiner", offload="model", device="cpu")
    try:
        with ResidencyTracker(refiner) as tr, fake_accelerator(refiner) as req:
            leave_resident(refiner, tr)
            refiner.refine(frames, "a cat", first_frame=test_image, height=64, width=128, steps=8,
                           tile_size=(32, 32), tile_stride=(24, 24))
            assert tr.current() == frozenset()
        assert len(tr.seen("VAE.enc")) > 2 and only(tr.seen("VAE.enc"), "vae")  # tiled: several encoder calls
        assert only(tr.seen("TE"), "text_encoder")
        assert only(tr.seen("DiT"), "transformer")
        assert only(tr.seen("VAE.dec"), "vae")
        assert_placed_on_hook_device(req, STAGE_FUNCTIONS)
    finally:
        refiner.release()


def test_exception_inside_vae_encode_leaves_nothing_resident(model_pipe, test_image):
    reference = model_pipe.generate("a cat", image=test_image, **RUN)
    with ResidencyTracker(model_pipe) as tr, fake_accelerator(model_pipe) as req:
        leave_resident(model_pipe, tr)
        with mock.patch.object(type(model_pipe.vae.encoder), "forward", side_effect=RuntimeError("boom")):
            with pytest.raises(RuntimeError, match="boom"):
                model_pipe.encode_image(test_image, **SIZE)
        assert tr.current() == frozenset()
    assert only(tr.seen("VAE.enc"), "vae")
    assert_placed_on_hook_device(req, ("vae_encode",))
    np.testing.assert_array_equal(model_pipe.generate("a cat", image=test_image, **RUN), reference)


def test_interrupt_in_the_middle_of_denoising(model_pipe):
    reference = model_pipe.generate("a cat", **RUN)

    class Interrupted(Exception):
        pass

    def cancel_at_step_1(i, total, x0):
        if i == 1:
            raise Interrupted()

    with ResidencyTracker(model_pipe) as tr, fake_accelerator(model_pipe) as req:
        leave_resident(model_pipe, tr)
        with pytest.raises(Interrupted):
            model_pipe.generate("a cat", callback=cancel_at_step_1, **RUN)
        assert tr.current() == frozenset()
    assert len(tr.seen("DiT")) == 2 and only(tr.seen("DiT"), "transformer")  # stopped after 2 of 3 steps
    assert_placed_on_hook_device(req, ("denoise",))
    np.testing.assert_array_equal(model_pipe.generate("a cat", **RUN), reference)


def test_reset_brackets_every_stage(model_pipe, test_image):
    """Each stage resets before it starts and after it ends (also when it raises)."""
    calls = []
    orig = Offloader.reset

    def counting_reset(self):
        calls.append(1)
        return orig(self)

    with mock.patch.object(Offloader, "reset", counting_reset):
        model_pipe.encode_image(test_image, **SIZE)
        assert len(calls) == 2
        with mock.patch.object(type(model_pipe.vae.encoder), "forward", side_effect=RuntimeError("boom")):
            with pytest.raises(RuntimeError):
                model_pipe.encode_image(test_image, **SIZE)
        assert len(calls) == 4


# -- execution device --------------------------------------------------------------------------


def test_execution_device_comes_from_hooks_not_parameters(model_pipe):
    assert next(model_pipe.vae.parameters()).device.type == "cpu"
    with fake_accelerator(model_pipe):
        assert execution_device_of(model_pipe.vae) == FAKE
    model_pipe.set_offload("none", "cpu")
    assert execution_device_of(model_pipe.vae) == torch.device("cpu")  # no hook: the parameter device


def test_cpu_device_is_never_indexed(packages):
    pipe = load_pipeline(packages["dense"], offload="sequential", device="cpu:0")
    try:
        assert pipe.device == torch.device("cpu")
        devices = {h.execution_device for m in pipe.transformer.modules()
                   if isinstance(getattr(m, "_hf_hook", None), AlignDevicesHook) for h in [m._hf_hook] if h.execution_device is not None}
        assert devices == {torch.device("cpu")}
        out = pipe.generate("a cat", **RUN)
        assert np.isfinite(out).all()
    finally:
        pipe.release()


def test_offload_on_cpu_logs_a_notice(packages, caplog):
    with caplog.at_level("INFO", logger="lingbot_core"):
        pipe = load_pipeline(packages["dense"], offload="model", device="cpu")
    pipe.release()
    assert any("saves no memory" in r.getMessage() for r in caplog.records)


# -- sequential offload --------------------------------------------------------------------------


def _all_params_meta(module):
    return all(p.device.type == "meta" for p in module.parameters())


def _vae_placed_whole(pipe):
    """The VAE under a whole-module offload hook (as under model), its weights on the CPU between stages."""
    from lingbot_core.memory.offload import HomeOffload, _hooks

    vae = pipe.offloader.components["vae"]
    return (any(isinstance(h, HomeOffload) for h in _hooks(vae))
            and not any(hasattr(m, "_hf_hook") for m in vae.modules() if m is not vae)
            and all(p.device.type == "cpu" for p in vae.parameters()))


def test_sequential_tiled_decode_loads_the_vae_weights_once(packages):
    """Issue 31 (gpu-review-3 finding 8): under sequential the tiled decode calls the decoder once per latent
    frame of every tile; streamed per call, the VAE's weights would cross the bus that many times. Placed as
    under model, each weight is loaded once per decode; the frames are those of offload none."""
    pipe = load_pipeline(packages["dense"], device="cpu")
    try:
        latents = torch.randn(1, 16, 2, 8, 12, generator=torch.Generator().manual_seed(2))
        tiles = dict(tiling=True, tile_size=(32, 32), tile_stride=(24, 24))
        reference = pipe.decode(latents, **tiles)
        pipe.set_offload("sequential")
        vae = pipe.offloader.components["vae"]
        calls = []
        handle = vae.decoder.register_forward_pre_hook(lambda m, a: calls.append(1))
        try:
            with fake_accelerator(pipe) as req:
                frames = pipe.decode(latents, **tiles)
        finally:
            handle.remove()
        weights = len(list(vae.parameters())) + len(list(vae.buffers()))
        loads = [r for r in req if r[2] is not None and r[2].type == "cuda" and "lingbot_core" not in r[0].split(".")]
        assert len(calls) >= 2 * 2  # tiled: several tiles, one decoder call per latent frame of each
        assert 0 < len(loads) <= weights  # each weight at most once per decode
        assert pipe.offloader.resident() == []
        torch.testing.assert_close(frames, reference, rtol=0, atol=0)
    finally:
        pipe.release()


def test_sequential_structure_and_meta_between_forwards(packages, test_image):
    pipe = load_pipeline(packages["moe"], offload="sequential", device="cpu")
    try:
        visual = pipe.text_encoder.model.visual
        hook = visual._hf_hook
        hooks = hook.hooks if hasattr(hook, "hooks") else [hook]
        assert any(isinstance(h, AlignDevicesHook) and h.offload and h.place_submodules for h in hooks)
        assert not any(hasattr(m, "_hf_hook") for m in visual.modules() if m is not visual)
        # Whole DiT blocks stream in at once (their forward runs both CFG branches; MoE experts included).
        dit_blocks = [m for m in pipe.transformer.modules() if type(m).__name__ == "TransformerBlock"]
        assert len(dit_blocks) == pipe.transformer.config.depth
        for block in dit_blocks:
            assert isinstance(block._hf_hook, AlignDevicesHook) and block._hf_hook.offload and block._hf_hook.place_submodules
            assert not any(hasattr(m, "_hf_hook") for m in block.modules() if m is not block)
        for name in ("transformer", "text_encoder"):
            assert _all_params_meta(pipe.offloader.components[name]), name
        assert _vae_placed_whole(pipe)  # issue 31: the VAE is placed as under model
        with ResidencyTracker(pipe) as tr:
            pipe.generate("a cat", image=test_image, **RUN)
            assert tr.current() == frozenset()
        assert tr.peak_bytes > 0
        for name in ("transformer", "text_encoder"):
            assert _all_params_meta(pipe.offloader.components[name]), name
        assert _vae_placed_whole(pipe)
    finally:
        pipe.release()


def test_sequential_moe_frames_equal_no_offload(packages, test_image):
    pipe = load_pipeline(packages["moe"], device="cpu")
    try:
        reference = pipe.generate("a cat", image=test_image, **RUN)
        pipe.set_offload("sequential")
        np.testing.assert_array_equal(pipe.generate("a cat", image=test_image, **RUN), reference)
    finally:
        pipe.release()


def test_without_moe_preload_sequential_output_is_wrong(packages):
    """Guards the test above: the MoE experts are only loaded when their block is a preload unit."""
    pipe = load_pipeline(packages["moe"], device="cpu")
    try:
        reference = pipe.generate("a cat", output_type="latent", **RUN)
        pipe.offloader.preload["transformer"] = []
        pipe.set_offload("sequential")
        try:
            out = pipe.generate("a cat", output_type="latent", **RUN)
        except (NotImplementedError, RuntimeError, FloatingPointError):
            return  # meta experts raised, or read uninitialised memory that held NaN: wrong, as expected
        assert not torch.equal(out, reference)  # or silently wrong numbers
    finally:
        pipe.release()


def test_sequential_exception_mid_forward_restores_meta(packages):
    pipe = load_pipeline(packages["dense"], device="cpu")
    try:
        reference = pipe.generate("a cat", **RUN)
        pipe.set_offload("sequential")
        block = pipe.transformer.blocks[1]
        with mock.patch.object(type(block.attn), "forward", side_effect=RuntimeError("mid-forward failure")):
            with pytest.raises(RuntimeError, match="mid-forward"):
                pipe.generate("a cat", **RUN)
        assert _all_params_meta(pipe.transformer)
        assert pipe.offloader.resident() == []
        np.testing.assert_array_equal(pipe.generate("a cat", **RUN), reference)
    finally:
        pipe.release()


# -- one seed, same frames in every mode; switching; release ---------------------------------------


def test_bit_identical_across_modes_and_switching(packages, test_image):
    pipe = load_pipeline(packages["dense"], device="cpu")
    try:
        reference = pipe.generate("a cat", image=test_image, **RUN)
        for mode in ("model", "sequential", "model", "none", "sequential", "none"):
            pipe.set_offload(mode)
            assert pipe.offload == mode
            np.testing.assert_array_equal(pipe.generate("a cat", image=test_image, **RUN), reference, err_msg=mode)
        assert not any(hasattr(m, "_hf_hook") for c in pipe.offloader.components.values() for m in c.modules())
        assert all(p.device.type == "cpu" for c in pipe.offloader.components.values() for p in c.parameters())
    finally:
        pipe.release()


@pytest.mark.parametrize("mode", ["none", "model", "sequential"])
def test_release_frees_every_component(packages, mode):
    pipe = load_pipeline(packages["dense"], offload=mode, device="cpu")
    pipe.generate("a cat", **RUN)
    refs = [weakref.ref(m) for m in (pipe.transformer, pipe.text_encoder, pipe.vae)]
    pipe.release()
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    with pytest.raises(RuntimeError, match="released"):
        pipe.generate("a cat", **RUN)


def test_mode_change_drops_old_hooks(packages):
    pipe = load_pipeline(packages["dense"], offload="model", device="cpu")
    try:
        old_hooks = [weakref.ref(m._hf_hook) for m in pipe.offloader.components.values()]
        pipe.set_offload("sequential")
        gc.collect()
        assert all(r() is None for r in old_hooks)
        pipe.set_offload("none")
        assert pipe.offloader._chain == []
    finally:
        pipe.release()


def test_unknown_mode_rejected(packages):
    with pytest.raises(ValueError, match="offload='gpu'.*none, model, sequential"):
        load_pipeline(packages["dense"], offload="gpu", device="cpu")


def test_failed_placement_leaves_everything_on_cpu_and_is_recoverable(packages):
    pipe = load_pipeline(packages["dense"], offload="model", device="cpu")
    try:
        reference = pipe.generate("a cat", **RUN)
        real_to, failures = type(pipe.vae).to, []

        def out_of_memory_once(module, *args, **kwargs):  # the move to the device fails, the way back works
            if not failures:
                failures.append(1)
                raise torch.OutOfMemoryError("simulated")
            return real_to(module, *args, **kwargs)

        with mock.patch.object(type(pipe.vae), "to", out_of_memory_once):
            with pytest.raises(torch.OutOfMemoryError):
                pipe.set_offload("none")
        assert not any(hasattr(m, "_hf_hook") for c in pipe.offloader.components.values() for m in c.modules())
        assert pipe.offloader.resident() == []
        with pytest.raises(RuntimeError, match="offload='none'.*failed.*choose another offload mode"):
            pipe.generate("a cat", **RUN)
        pipe.set_offload("sequential")
        np.testing.assert_array_equal(pipe.generate("a cat", **RUN), reference)
    finally:
        pipe.release()
