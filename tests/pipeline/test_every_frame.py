"""Video in, the same video out (issue 39): every frame kept in video-to-video and Refine, with and without
context windows; the cancel check between windows; an fp8 DiT in windows. Tiny packages on the CPU.

Expected numbers come from the documented rules, computed here on their own: a video of T frames is sampled
at the next 4n+1 length P with its last frame repeated (the VAE input), and T frames come back; the
re-noised start is ``(1 - s) x + s noise`` with the video posterior drawn from the generator of
sha256("lingbot-video v2v posterior " + seed as 8 little-endian bytes); Refine at more than 24 fps sees
int(T / fps * 24) frames spread over the clip.
"""

import hashlib
import time

import numpy as np
import pytest
import torch

from lingbot_core import load_pipeline
from lingbot_core.model.latents import resize_frames

SIZE = dict(height=64, width=96)
REFINE = dict(height=64, width=128, steps=2, vae_tiling=False)
WINDOWS = dict(context_frames=9, context_overlap=4)


def _video(frames, h=48, w=80, seed=5):
    return torch.rand(frames, h, w, 3, generator=torch.Generator().manual_seed(seed))


def _dit_inputs(pipe):
    calls = []
    handle = pipe.transformer.register_forward_hook(lambda m, args, out: calls.append(args[0].detach().clone()))
    return calls, handle


@pytest.mark.parametrize("frames", [17, 20, 6])
@pytest.mark.parametrize("windows", [False, True], ids=["one-pass", "windows"])
def test_v2v_returns_exactly_the_input_frame_count(dense_pipe, frames, windows):
    run = dict(SIZE, denoise=0.5, steps=2, seed=1, **(WINDOWS if windows else {}))
    out = dense_pipe.generate("a cat", video=_video(frames), **run)
    assert out.shape == (frames, 64, 96, 3) and np.isfinite(out).all()
    latent = dense_pipe.generate("a cat", video=_video(frames), output_type="latent", **run)
    assert latent.shape[2] == (frames - 1 + 3) // 4 + 1  # sampled at the next 4n+1 length


@pytest.mark.parametrize("frames", [17, 20, 7])
@pytest.mark.parametrize("windows", [False, True], ids=["one-pass", "windows"])
def test_refine_returns_exactly_the_input_frame_count(refiner_pipe, frames, windows):
    out = refiner_pipe.refine(_video(frames), "a cat", context_frames=9 if windows else 0, context_overlap=4, **REFINE)
    assert out.shape == (frames, 64, 128, 3) and np.isfinite(out).all()


def test_refine_of_a_faster_video_keeps_its_duration_at_24_fps(refiner_pipe):
    out = refiner_pipe.refine(_video(30), "a cat", fps=30, **REFINE)
    assert out.shape[0] == 24  # int(30 / 30 * 24): one second of 30 fps video is one second at 24 fps


def test_v2v_pads_the_tail_by_repeating_the_last_frame(dense_pipe):
    """The DiT's first input is the re-noised encoding of the video with its last frame held to 4n+1 frames,
    computed here from the frames themselves."""
    pipe, seed, frames = dense_pipe, 4, 18  # 18 -> 21 frames (three held), 6 latent frames
    video = _video(frames)
    calls, handle = _dit_inputs(pipe)
    try:
        pipe.generate("a cat", video=video, denoise=0.5, steps=2, seed=seed, output_type="latent", **SIZE)
    finally:
        handle.remove()
    held = torch.cat([video, video[-1:].repeat(3, 1, 1, 1)])
    posterior = pipe.encode_video(resize_frames(held, 64, 96))
    draw_seed = int.from_bytes(hashlib.sha256(b"lingbot-video v2v posterior " + seed.to_bytes(8, "little")).digest()[:8], "little")
    z = posterior.sample(torch.Generator().manual_seed(draw_seed))
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    x = (z - mean) / std
    noise = torch.randn((1, 16, 6, 8, 12), generator=torch.Generator().manual_seed(seed))
    base = np.linspace(float(np.float32(0.999)), 0.0, 5)[:-1][2]  # denoise 0.5 of 2 steps: the last 2 of a 4-step grid
    s = 3 * base / (1 + 2 * base)
    torch.testing.assert_close(calls[0], (1 - s) * x + s * noise, rtol=1e-5, atol=1e-5)


def test_denoise_one_with_a_video_is_text_to_video_trimmed(dense_pipe):
    run = dict(SIZE, steps=2, seed=3)
    t2v = dense_pipe.generate("a cat", num_frames=21, **run)
    assert np.array_equal(dense_pipe.generate("a cat", video=_video(20), denoise=1.0, **run), t2v[:20])
    assert np.array_equal(dense_pipe.generate("a cat", video=_video(21), denoise=1.0, **run), t2v)


def test_decode_refuses_more_frames_than_the_latent_holds(dense_pipe):
    latent = torch.zeros(1, 16, 2, 8, 12)
    assert dense_pipe.decode(latent, num_frames=3).shape[0] == 3
    with pytest.raises(ValueError, match="decodes to 5 frames"):
        dense_pipe.decode(latent, num_frames=6)


# -- cancel between windows ---------------------------------------------------------------------------


class Cancelled(Exception):
    pass


@pytest.mark.parametrize("offload", ["model", "block"])
def test_cancel_is_honoured_between_windows_and_leaves_nothing_resident(packages, offload):
    """The host's cancel check (``callback.interrupt``) is asked before every window's DiT call: a cancel
    requested during window 1 of step 1 stops the run before window 2 starts, and the stage ends."""
    from support.fake_accelerator import fake_accelerator
    from support.residency import ResidencyTracker

    pipe = load_pipeline(packages["dense"], offload=offload, device="cpu")
    try:
        state = {"requested": None, "calls": 0}

        def dit_ran(module, args, output):
            state["calls"] += 1
            if state["requested"] is None:
                state["requested"] = time.perf_counter()  # the user presses cancel while window 1 runs

        def interrupt():
            if state["requested"] is not None:
                raise Cancelled()

        def callback(i, total, x0):
            interrupt()

        callback.interrupt = interrupt
        handle = pipe.transformer.register_forward_hook(dit_ran)
        with ResidencyTracker(pipe) as tr, fake_accelerator(pipe):
            with pytest.raises(Cancelled):
                pipe.generate("a cat", num_frames=25, steps=3, callback=callback, output_type="latent", **WINDOWS, **SIZE)
            latency = time.perf_counter() - state["requested"]
            assert tr.current() == frozenset()
        handle.remove()
        assert state["calls"] == 1  # 3 windows per step: the cancel came before window 2
        assert pipe.device_bytes() == 0
        print(f"cancel latency ({offload}): {latency * 1000:.1f} ms")
    finally:
        pipe.release()


# -- fp8 DiT with windows -----------------------------------------------------------------------------


def test_fp8_dit_in_windows(packages):
    """fp8-stored DiT weights in context windows: one window equals no windows bit for bit, a long video keeps
    every frame, and each window's velocity is the fp8 DiT's on that clip alone."""
    pipe = load_pipeline(packages["moe"], device="cpu", dtypes={"transformer": "fp8_e4m3fn"})
    try:
        run = dict(SIZE, steps=2, seed=5, output_type="latent")
        assert torch.equal(pipe.generate("a cat", num_frames=9, **WINDOWS, **run), pipe.generate("a cat", num_frames=9, **run))
        calls = []

        def hook(module, args, kwargs, output):
            calls.append((args[0].detach().clone(), args[1].detach().clone(), args[2], [o.clone() for o in output]))

        handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
        try:
            frames = pipe.generate("a cat", video=_video(22), denoise=0.6, **WINDOWS, **dict(run, output_type="np"))
        finally:
            handle.remove()
        assert frames.shape == (22, 64, 96, 3) and np.isfinite(frames).all()
        assert len(calls) == 2 * 3 and {c[0].shape[2] for c in calls} == {3}  # 7 latent frames: 3 windows of 3
        for x, t, text, out in calls[1:3]:
            with torch.no_grad():
                again = pipe.transformer(x, t, text)
            assert all(torch.equal(a, b) for a, b in zip(out, again))
    finally:
        pipe.release()
