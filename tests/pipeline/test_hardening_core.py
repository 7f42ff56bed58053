"""Hardening of the core (no server): failures mid-run, bad inputs, untrusted packages, no network, soak.

Failures mid-run (for each offload mode): an exception inside the DiT, the VAE encoder or the text
encoder, a cancel raised from the step callback at a seeded random step, and a simulated
out-of-memory inside the DiT. After each: the original exception reaches the caller unchanged, the
residency tracker shows nothing resident, sequential weights are all back on ``meta``, nothing is
materialised, and the *same pipeline object* then gives exactly the frames of an undisturbed run.

Bad inputs raise ``ValueError`` naming the parameter and the allowed values, before any compute,
and leave the pipeline as it was.

Repetition soak (in the default suite, marked ``soak``): 20 load / generate / switch offload / generate
/ release cycles; no component object outlives its release and RSS stays flat. Its RSS figures::

    .venv/bin/python -m pytest tests/pipeline/test_hardening_core.py -m soak -s -q
"""

from __future__ import annotations

import gc
import os
import pickle
import random
import socket
import time
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch

from lingbot_core import ModelPackageError, load_pipeline
from lingbot_core.model.latents import MAX_COVER_PIXELS
from support.residency import ResidencyTracker

MODES = ("none", "model", "sequential")
RUN = dict(height=32, width=32, num_frames=5, steps=3, seed=7)
PROMPT = "a cat"
FAILURES = ("dit", "vae_encode", "text_encoder", "cancel", "oom")


class Cancelled(Exception):
    """What a host's progress callback raises on cancel (ComfyUI: InterruptProcessingException)."""


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


@contextmanager
def failing(module, exc, on_call: int = 1):
    """Make ``module``'s own forward raise ``exc`` on its ``on_call``-th call (earlier calls run normally).

    Under accelerate hooks the module's ``forward`` is the hook wrapper and the real forward is
    ``_old_forward``, called *between* ``pre_forward`` (weights materialised) and ``post_forward``
    (weights back on ``meta``): patching that one raises with the module's weights materialised, which is
    what a real failure inside a layer does.
    """
    attr = "_old_forward" if hasattr(module, "_old_forward") else "forward"
    original = getattr(module, attr)
    calls = []

    def forward(*args, **kwargs):
        # Record whether the module's own weights are materialised (not on meta) at this moment.
        calls.append(any(p.device.type != "meta" for p in module.parameters(recurse=False)))
        if len(calls) == on_call:
            raise exc
        return original(*args, **kwargs)

    with mock.patch.object(module, attr, forward):
        yield calls


def all_meta(module) -> bool:
    return all(p.device.type == "meta" for p in module.parameters())


def live_counts(names=("LingBotVideoTransformer3DModel", "Qwen3VLForConditionalGeneration", "AutoencoderKLWan")) -> dict:
    gc.collect()
    counts = dict.fromkeys(names, 0)
    for obj in gc.get_objects():
        name = type(obj).__name__
        if name in counts:
            counts[name] += 1
    return counts


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------------------------
# Failures mid-run, in every offload mode
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references(packages, test_image):
    """Undisturbed T2V and TI2V frames (frames are bit-identical in every offload mode: test_offload)."""
    pipe = load_pipeline(packages["dense"], device="cpu")
    try:
        return {"t2v": pipe.generate(PROMPT, **RUN), "ti2v": pipe.generate(PROMPT, image=test_image, **RUN)}
    finally:
        pipe.release()


@pytest.fixture(scope="module", params=MODES)
def mode_pipe(request, packages, references):
    """One pipeline per offload mode, shared by every failure: each failure's next run uses the same object."""
    pipe = load_pipeline(packages["dense"], offload=request.param, device="cpu")
    yield pipe, references
    pipe.release()


def _failing_run(pipe, kind, test_image):
    """(callable that runs and raises, expected exception type, match, context manager, kind of reference)."""
    mode = pipe.offload
    if kind == "dit":
        # Third call of block 1: after a whole step's cond/uncond pair, mid-denoise.
        ctx = failing(pipe.transformer.blocks[1], RuntimeError("DiT block failure"), on_call=3)
        return (lambda: pipe.generate(PROMPT, **RUN)), RuntimeError, "DiT block failure", ctx, "t2v"
    if kind == "oom":
        ctx = failing(pipe.transformer.blocks[0], torch.cuda.OutOfMemoryError("simulated"), on_call=2)
        return (lambda: pipe.generate(PROMPT, **RUN)), torch.OutOfMemoryError, "simulated", ctx, "t2v"
    if kind == "vae_encode":
        ctx = failing(pipe.vae.encoder, RuntimeError("VAE encoder failure"))
        return (lambda: pipe.generate(PROMPT, image=test_image, **RUN)), RuntimeError, "VAE encoder failure", ctx, "ti2v"
    if kind == "text_encoder":
        pipe._prompt_cache.clear()  # else the cached embedding means the encoder never runs
        layer = pipe.text_encoder.model.language_model.layers[1]
        ctx = failing(layer, RuntimeError("text encoder failure"))
        return (lambda: pipe.generate(PROMPT, **RUN)), RuntimeError, "text encoder failure", ctx, "t2v"
    assert kind == "cancel"
    step = random.Random(f"cancel-{mode}").randrange(RUN["steps"])

    def cancel(i, total, x0):
        if i == step:
            raise Cancelled(f"cancelled at step {step}")

    return (lambda: pipe.generate(PROMPT, callback=cancel, **RUN)), Cancelled, f"step {step}", _nothing(), "t2v"


@contextmanager
def _nothing():
    yield


@pytest.mark.parametrize("kind", FAILURES)
def test_failure_mid_run_leaves_nothing_behind(mode_pipe, kind, test_image):
    pipe, refs = mode_pipe
    mode = pipe.offload
    run, exc_type, match, ctx, ref = _failing_run(pipe, kind, test_image)
    with ResidencyTracker(pipe) as tracker:
        with ctx as calls:
            with pytest.raises(exc_type, match=match):
                run()
        if calls is not None:
            assert calls, f"{kind}: the patched module never ran"
            if mode == "sequential" and kind in ("dit", "oom"):
                assert calls[-1], "the failure should leave the block's weights materialised (else the reset is untested)"
        if mode != "none":  # in 'none' everything is always on the device by design
            assert tracker.current() == frozenset(), f"{kind} under {mode} left {set(tracker.current())} resident"
    assert pipe.offload == mode
    assert pipe.offloader.resident() == []
    if mode == "sequential":  # the streamed components hold no weights; the VAE is placed whole, as under 'model'
        for name in ("transformer", "text_encoder"):
            assert all_meta(pipe.offloader.components[name]), f"{kind}: {name} has materialised weights"
        assert all(p.device.type == "cpu" for p in pipe.offloader.components["vae"].parameters()), f"{kind}: vae left off the CPU"
    else:
        assert all(p.device.type == "cpu" for c in pipe.offloader.components.values() for p in c.parameters())
    if kind == "text_encoder":
        pipe._prompt_cache.clear()  # make the next run go through the text encoder again
    again = pipe.generate(PROMPT, image=test_image, **RUN) if ref == "ti2v" else pipe.generate(PROMPT, **RUN)
    np.testing.assert_array_equal(again, refs[ref], err_msg=f"{kind} under {mode}: next run differs")


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_pipe(packages, references):
    pipe = load_pipeline(packages["dense"], device="cpu")
    yield pipe, references["t2v"]
    pipe.release()


NAN, INF = float("nan"), float("inf")
IMAGE = torch.rand(40, 60, 3, generator=torch.Generator().manual_seed(9))

# (id, generate() overrides, regex the message must match: the parameter and its allowed values)
BAD_GENERATE = [
    ("num_frames=6", dict(num_frames=6), r"num_frames=6 .*1 \(an image\) or 4n\+1 .*e\.g\. 5 or 9"),
    ("num_frames=0", dict(num_frames=0), r"num_frames=0 .*4n\+1"),
    ("num_frames=-1", dict(num_frames=-1), r"num_frames=-1 .*4n\+1"),
    ("num_frames=10**6+1", dict(num_frames=10**6 + 1), r"num_frames=1000001 .*at most 1001"),
    ("num_frames=5.0", dict(num_frames=5.0), r"num_frames=5\.0 .*4n\+1"),
    ("height=60", dict(height=60), r"height=60 .*multiple of 16 .*e\.g\. 48 or 64"),
    ("width=0", dict(width=0), r"width=0 .*multiple of 16 pixels, from 16 to 4096"),
    ("height=10**6", dict(height=10**6), r"height=1000000 .*from 16 to 4096"),
    ("width=10**6", dict(width=10**6), r"width=1000000 .*from 16 to 4096"),
    ("steps=0", dict(steps=0), r"steps=0 .*integer from 1 to 1000"),
    ("steps=-1", dict(steps=-1), r"steps=-1 .*integer from 1 to 1000"),
    ("steps=10**6", dict(steps=10**6), r"steps=1000000 .*integer from 1 to 1000"),
    ("steps=2.5", dict(steps=2.5), r"steps=2\.5 .*integer from 1 to 1000"),
    ("guidance=nan", dict(guidance_scale=NAN), r"guidance_scale=nan .*finite value in \[0, 100\]"),
    ("guidance=inf", dict(guidance_scale=INF), r"guidance_scale=inf .*finite value in \[0, 100\]"),
    ("guidance=-1", dict(guidance_scale=-1), r"guidance_scale=-1 .*finite value in \[0, 100\]"),
    ("shift=0", dict(shift=0), r"shift .*positive finite number, got 0"),
    ("shift=nan", dict(shift=NAN), r"shift .*positive finite number, got nan"),
    ("seed=-1", dict(seed=-1), r"seed=-1 .*integer from 0 to 2\^64-1"),
    ("seed=2**64", dict(seed=2**64), r"seed=18446744073709551616 .*integer from 0 to 2\^64-1"),
    ("output_type=gif", dict(output_type="gif"), r"output_type='gif' .*'np', 'pt' or 'latent'"),
    ("prompt empty", dict(prompt=""), r"prompt is empty: write a structured JSON caption .* or a text description"),
    ("prompt whitespace", dict(prompt=" \n\t "), r"prompt is empty"),
    ("prompt None", dict(prompt=None), r"prompt must be text"),
    ("prompt bad JSON", dict(prompt='{"caption": {"scene": "a cat"'), r"prompt starts with '\{' but is not valid JSON .*line 1"),
    ("prompt bad JSON list", dict(prompt='[{"caption": 1},'), r"prompt starts with '\[' but is not valid JSON"),
    ("prompt bad duration", dict(prompt='{"caption": "a cat", "duration": "long"}'), r"duration must be a number of seconds"),
    ("negative bad JSON", dict(negative_prompt="{not json"), r"negative_prompt starts with '\{' but is not valid JSON"),
    # With an image: still rejected before the image is VAE-encoded.
    ("TI2V guidance=nan", dict(guidance_scale=NAN, image=IMAGE), r"guidance_scale=nan .*finite value in \[0, 100\]"),
    ("TI2V prompt empty", dict(prompt="", image=IMAGE), r"prompt is empty"),
    ("TI2V negative bad JSON", dict(negative_prompt="[1,", image=IMAGE), r"negative_prompt starts with '\[' but is not valid JSON"),
    ("TI2V width=100", dict(width=100, image=IMAGE), r"width=100 .*multiple of 16 .*e\.g\. 96 or 112"),
    ("denoise=None", dict(denoise=None), r"denoise=None is not allowed: use a number, a strength in \(0, 1\]"),
    ("denoise='0.5'", dict(denoise="0.5"), r"denoise='0\.5' is not allowed: use a number"),
]


def test_bad_generate_inputs_are_rejected_then_same_frames(plain_pipe):
    pipe, reference = plain_pipe
    seen = []
    for case_id, overrides, pattern in BAD_GENERATE:
        kw = dict(RUN, prompt=PROMPT)
        kw.update(overrides)
        prompt = kw.pop("prompt")
        t0 = time.monotonic()
        no_compute = AssertionError("validation must happen before compute")
        with mock.patch.object(pipe, "denoise", side_effect=no_compute), \
                mock.patch.object(pipe, "encode_image", side_effect=no_compute), \
                mock.patch("lingbot_core.pipeline.encode_text", side_effect=no_compute):
            with pytest.raises(ValueError, match=pattern) as err:
                try:
                    pipe.generate(prompt, **kw)
                except AssertionError as e:
                    raise AssertionError(f"{case_id}: {e}") from None
        assert time.monotonic() - t0 < 5, f"{case_id}: took too long to reject"
        seen.append((case_id, str(err.value)))
    assert len(seen) == len(BAD_GENERATE)
    for case_id, msg in seen:
        print(f"  {case_id:22s} -> {msg}")
    assert pipe.offloader.resident() == []
    np.testing.assert_array_equal(pipe.generate(PROMPT, **RUN), reference)


BAD_REFINE = [
    ("t_thresh=0", dict(t_thresh=0.0), r"t_thresh must be in \(0, 1\], got 0"),
    ("t_thresh=2", dict(t_thresh=2.0), r"t_thresh must be in \(0, 1\], got 2"),
    ("t_thresh=nan", dict(t_thresh=NAN), r"t_thresh must be in \(0, 1\]"),
    ("tail_steps=-1", dict(tail_steps=-1), r"tail_steps must be >= 0, got -1"),
    ("steps=0", dict(steps=0), r"steps=0 .*integer from 1 to 1000"),
    ("height=60", dict(height=60), r"height=60 .*multiple of 16"),
    ("width=10**6", dict(width=10**6), r"width=1000000 .*from 16 to 4096"),
    ("guidance=nan", dict(guidance_scale=NAN), r"guidance_scale=nan .*finite value in \[0, 100\]"),
    ("shift=0", dict(shift=0.0), r"shift .*positive finite number"),
    ("seed=-1", dict(seed=-1), r"seed=-1 .*0 to 2\^64-1"),
    ("fps=0", dict(fps=0.0), r"fps must be a positive number"),
    ("output_type=gif", dict(output_type="gif"), r"output_type='gif' .*'np', 'pt' or 'latent'"),
    ("one frame", dict(frames=np.random.default_rng(0).random((1, 32, 32, 3), dtype=np.float32)),
     r"Refine needs a video of at least 5 frames; got 1"),
    ("5 frames at 120 fps", dict(fps=120.0), r"Refine needs a video of at least 5 frames; got 5; at 120 fps they are "
                                             r"resampled to 1 at the refiner's 24 fps \(the refiner is not trained"),
    ("9 frames, max_frames=3", dict(frames=np.zeros((9, 32, 32, 3), np.float32), max_frames=3),
     r"got 9; at 24 fps they are resampled to 3 at the refiner's 24 fps \(max_frames=3\)"),
    ("four channels", dict(frames=np.zeros((5, 32, 32, 4), np.float32)), r"frames must be \(T, H, W, 3\)"),
    ("NaN frames", dict(frames=np.full((5, 32, 32, 3), np.nan, np.float32)), r"frames contain NaN"),
]
REFINE = dict(height=32, width=32, steps=2, tail_steps=1, seed=3, vae_tiling=False)


def test_bad_refine_inputs_are_rejected_then_same_frames(packages):
    frames = np.random.default_rng(1).random((5, 32, 32, 3), dtype=np.float32)
    pipe = load_pipeline(packages["moe"], transformer_subfolder="refiner", device="cpu")
    try:
        reference = pipe.refine(frames, PROMPT, **REFINE)
        for case_id, overrides, pattern in BAD_REFINE:
            kw = dict(REFINE, frames=frames)
            kw.update(overrides)
            no_compute = AssertionError("validation must happen before compute")
            with mock.patch.object(pipe, "denoise", side_effect=no_compute), \
                    mock.patch.object(pipe, "encode_video", side_effect=no_compute):
                with pytest.raises(ValueError, match=pattern):
                    try:
                        pipe.refine(kw.pop("frames"), PROMPT, **kw)
                    except AssertionError as e:
                        raise AssertionError(f"{case_id}: {e}") from None
        np.testing.assert_array_equal(pipe.refine(frames, PROMPT, **REFINE), reference)
    finally:
        pipe.release()


def test_wrong_pipe_for_the_run(packages, plain_pipe):
    pipe, _ = plain_pipe
    with pytest.raises(ValueError, match=r"Refine needs the refiner DiT: load the MoE package with transformer='refiner'"):
        pipe.refine(np.zeros((5, 32, 32, 3), np.float32), PROMPT, **REFINE)
    refiner = load_pipeline(packages["moe"], transformer_subfolder="refiner", device="cpu")
    try:
        with pytest.raises(ValueError, match=r"refiner DiT, which only refines videos; load transformer='transformer'"):
            refiner.generate(PROMPT, **RUN)
    finally:
        refiner.release()


@pytest.mark.parametrize("vae_dtype", ["bf16", "fp16"])
def test_low_precision_vae_runs_without_autocast(packages, test_image, vae_dtype):
    """The loader offers vae_precision bf16/fp16; off CUDA there is no autocast, so inputs must be cast.

    (Before the fix: ``RuntimeError: Input type (float) and bias type (c10::BFloat16) should be the same``.)
    """
    quick = dict(height=32, width=32, num_frames=5, steps=1, guidance_scale=1.0, seed=7)
    pipe = load_pipeline(packages["dense"], device="cpu", dtypes={"vae": vae_dtype})
    try:
        frames = pipe.generate(PROMPT, image=test_image, **quick)
    finally:
        pipe.release()
    assert frames.dtype == np.float32 and np.isfinite(frames).all()
    if vae_dtype == "bf16":
        refiner = load_pipeline(packages["moe"], transformer_subfolder="refiner", device="cpu", dtypes={"vae": vae_dtype})
        try:
            refined = refiner.refine(frames, PROMPT, first_frame=test_image, **dict(REFINE, steps=1, tail_steps=0))
        finally:
            refiner.release()
        assert np.isfinite(refined).all()


# -- images ------------------------------------------------------------------------------------


def test_accepted_image_formats_give_finite_frames(plain_pipe, test_image):
    pipe, _ = plain_pipe
    size = dict(height=RUN["height"], width=RUN["width"])
    rgb = test_image
    gray = test_image[..., :1]
    rgba = torch.cat([test_image, torch.rand(*test_image.shape[:2], 1, generator=torch.Generator().manual_seed(5))], -1)
    # Grayscale (H, W, 1) is the same image as its 3-channel repeat; RGBA drops alpha.
    assert torch.equal(pipe.encode_image(gray, **size).pixels, pipe.encode_image(gray.expand(-1, -1, 3), **size).pixels)
    assert torch.equal(pipe.encode_image(gray[..., 0], **size).pixels, pipe.encode_image(gray.expand(-1, -1, 3), **size).pixels)
    assert torch.equal(pipe.encode_image(rgba, **size).pixels, pipe.encode_image(rgb, **size).pixels)
    quick = dict(size, num_frames=1, steps=1, guidance_scale=1.0, seed=7)  # each image costs a VLM encode
    for name, image in (("grayscale", gray), ("rgba", rgba), ("1x1", torch.rand(1, 1, 3)),
                        ("10000x10", torch.rand(10000, 10, 3)), ("10x10000", torch.rand(10, 10000, 3)),
                        ("uint8", (test_image * 255).to(torch.uint8).numpy())):
        cond = pipe.encode_image(image, **size)
        frames = pipe.generate(PROMPT, condition=cond, **quick)
        assert frames.shape == (1, 32, 32, 3) and np.isfinite(frames).all(), name


@pytest.mark.parametrize("image, pattern", [
    (torch.full((70, 100, 3), float("nan")), r"image contains NaN or infinite values"),
    (torch.rand(70, 100, 5), r"image must have 1, 3 or 4 channels; got 5"),
    (torch.rand(2, 70, 100, 3), r"image must be \(H, W, C\); got shape \(2, 70, 100, 3\)"),
    (torch.rand(0, 10, 3), r"image is empty"),
    (torch.rand(10, 0, 3), r"image is empty"),
], ids=["nan", "5-channels", "batch-4d", "zero-height", "zero-width"])
def test_rejected_images_raise_clear_errors(plain_pipe, image, pattern):
    pipe, _ = plain_pipe
    with pytest.raises(ValueError, match=pattern):
        pipe.encode_image(image, height=32, width=32)
    assert pipe.offloader.resident() == []


def test_ti2v_video_aspect_beyond_the_vlm_limit_is_named(plain_pipe):
    """A 4096x16 video is a valid size, but its first frame is too elongated for the VLM: say so, up front."""
    pipe, _ = plain_pipe
    with mock.patch("lingbot_core.pipeline.vae_encode", side_effect=AssertionError("must not encode")):
        with pytest.raises(ValueError, match=r"video aspect ratio of at most 200:1 .*width=4096 x height=16 is 256:1"):
            pipe.encode_image(torch.rand(70, 100, 3), height=16, width=4096)
    pipe.encode_image(torch.rand(70, 100, 3), height=16, width=3200)  # 200:1 is fine


def test_extreme_aspect_image_is_refused_without_allocating(plain_pipe):
    """10000x10 covering 832x480 would need an 832000x832 intermediate (2 GB as uint8): refused up front."""
    pipe, _ = plain_pipe
    image = torch.rand(10000, 10, 3)
    before, t0 = rss_bytes(), time.monotonic()
    with mock.patch.object(torch.nn.functional, "interpolate", side_effect=AssertionError("must not resize")):
        with pytest.raises(ValueError, match=r"image of 10x10000 pixels would have to be scaled to .* crop it closer"):
            pipe.encode_image(image, height=480, width=832)
    assert time.monotonic() - t0 < 2
    assert rss_bytes() - before < 256 * 2**20
    assert 832000 * 832 > MAX_COVER_PIXELS


# --------------------------------------------------------------------------------------------
# Untrusted packages: no pickles, no network, no arbitrary paths
# --------------------------------------------------------------------------------------------


def test_pickle_only_package_is_refused_without_unpickling(broken_packages, monkeypatch):
    called = []

    def forbidden(name):
        def fail(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"{name} must not be called")
        return fail

    for target, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(target, name, forbidden(f"{target.__name__}.{name}"))
    with pytest.raises(ModelPackageError) as err:
        load_pipeline(broken_packages["pickle_only"], device="cpu")
    assert called == []
    msg = str(err.value)
    assert "pickle" in msg and "refused" in msg and "diffusion_pytorch_model.bin" in msg and ".safetensors" in msg


@pytest.mark.parametrize("variant, pattern", [
    ("missing_vae", r"missing the vae/ folder"),
    ("truncated", r"not a readable safetensors file .*truncated"),
    ("wrong_shape", r"has shape .* but config\.json implies"),
    ("no_model_index", r"no model_index\.json"),
])
def test_broken_packages_raise_clear_errors(broken_packages, variant, pattern):
    before = live_counts()
    with pytest.raises(ModelPackageError, match=pattern):
        load_pipeline(broken_packages[variant], device="cpu")
    assert live_counts() == before  # nothing half-loaded stays alive


@pytest.mark.parametrize("path, pattern", [("../../somewhere", r"does not exist"), ("/etc", r"no model_index\.json")])
def test_arbitrary_paths_give_clear_errors(path, pattern):
    with pytest.raises(ModelPackageError, match=pattern):
        load_pipeline(path, device="cpu")


def test_no_network_during_load_generate_and_refine(packages, monkeypatch, test_image):
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[1:] if args else kwargs)
        raise OSError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    base = load_pipeline(packages["dense"], device="cpu")
    try:
        frames = base.generate(PROMPT, image=test_image, **RUN)
    finally:
        base.release()
    refiner = load_pipeline(packages["moe"], transformer_subfolder="refiner", device="cpu")
    try:
        refined = refiner.refine(frames, PROMPT, first_frame=test_image, **REFINE)
    finally:
        refiner.release()
    assert np.isfinite(refined).all() and refined.shape == (5, 32, 32, 3)
    assert attempts == []


# --------------------------------------------------------------------------------------------
# Repetition soak
# --------------------------------------------------------------------------------------------

SOAK_RUN = dict(height=16, width=16, num_frames=1, steps=1, guidance_scale=1.0, seed=3)


def _soak(packages, cycles):
    """``cycles`` x (load / generate / set_offload(next mode) / generate / release); returns RSS per cycle."""
    baseline = live_counts()
    rss, reference = [], None
    for i in range(cycles):
        pipe = load_pipeline(packages["dense"], offload=MODES[i % 3], device="cpu")
        first = pipe.generate(PROMPT, **SOAK_RUN)
        pipe.set_offload(MODES[(i + 1) % 3])
        second = pipe.generate(PROMPT, **SOAK_RUN)
        pipe.release()
        del pipe
        reference = first if reference is None else reference
        np.testing.assert_array_equal(first, reference)
        np.testing.assert_array_equal(second, reference)
        counts = live_counts()
        assert counts == baseline, f"cycle {i}: live components {counts} != baseline {baseline}"
        rss.append(rss_bytes())
    return rss


@pytest.mark.soak
def test_soak_load_generate_switch_release(packages, record_property):
    """20 cycles (about 15 s on 2 idle cores; ``LINGBOT_SOAK_CYCLES`` for more): no component object outlives
    its release, and RSS after the last cycle is within 10 % of RSS after the first. See the figures with
    ``.venv/bin/python -m pytest tests/pipeline/test_hardening_core.py -m soak -s -q``; skip with ``-m "not soak"``."""
    cycles = int(os.environ.get("LINGBOT_SOAK_CYCLES", "20"))
    t0 = time.monotonic()
    rss = _soak(packages, cycles)
    elapsed = time.monotonic() - t0
    mib = [r / 2**20 for r in rss]
    print(f"\nsoak: {cycles} cycles in {elapsed:.1f} s; RSS after cycle 1 {mib[0]:.1f} MiB, "
          f"after cycle {cycles} {mib[-1]:.1f} MiB ({(mib[-1] / mib[0] - 1) * 100:+.1f} %), max {max(mib):.1f} MiB")
    record_property("soak_rss_mib", [round(m, 1) for m in mib])
    record_property("soak_seconds", round(elapsed, 1))
    assert abs(rss[-1] - rss[0]) <= 0.10 * rss[0], f"RSS changed from {mib[0]:.1f} to {mib[-1]:.1f} MiB"


def test_an_integer_video_is_read_as_0_to_255_like_an_image(plain_pipe):
    """generate(video=uint8) used to clamp every non-zero pixel to white: the VAE now sees the same pixels as
    for the same video in [0, 1] floats (the image rule, latents.integer_pixels)."""
    pipe, _ = plain_pipe
    video = np.random.default_rng(4).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    seen = []

    class Seen(Exception):
        pass

    def capture(pixels, **_):
        seen.append(pixels.clone())
        raise Seen

    for frames in (video, video.astype(np.int64), video.astype(np.float32) / 255):
        with mock.patch.object(pipe, "encode_video", side_effect=capture), pytest.raises(Seen):
            pipe.generate(PROMPT, video=frames, denoise=0.5, **{k: v for k, v in RUN.items() if k != "num_frames"})
    assert seen[0].max() <= 1.0 and seen[0].float().mean() < 0.75  # not white
    torch.testing.assert_close(seen[0], seen[2], rtol=0, atol=1e-6)
    torch.testing.assert_close(seen[1], seen[2], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"integer video values must be in 0\.\.255; got 300\.\.300"):
        pipe.generate(PROMPT, video=np.full((5, 32, 32, 3), 300, np.int64), denoise=0.5, height=32, width=32, steps=3)
