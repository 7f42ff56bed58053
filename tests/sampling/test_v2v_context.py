"""Video-to-video (``denoise`` on an input video) and context windows (issue 34), on the tiny packages.

Expected numbers come from the documented rules, computed here on their own: the FlowUniPC grid
(docs: sigma = s b / (1 + (s - 1) b), b = linspace(0.999, 0, N + 1)[:-1]), the last ``steps`` of an int(steps / denoise)-step grid (issue 39: KSampler's rule), the
re-noise ``(1 - s) x + s noise`` with the noise of the seed's generator, and the video posterior drawn
from the generator of sha256("lingbot-video v2v posterior " + seed as 8 little-endian bytes).
"""

import hashlib
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from lingbot_core import load_pipeline
from lingbot_core.model.latents import resize_frames
from lingbot_core.sampling.context_windows import blend_weights, check_context, window_spans

SIZE = dict(height=64, width=96)
TOKENS_PER_FRAME = (64 // 8 // 2) * (96 // 8 // 2)  # latent 8x12, 2x2 patches


def _video(frames, h=48, w=80, seed=5):
    return torch.rand(frames, h, w, 3, generator=torch.Generator().manual_seed(seed))


@contextmanager
def dit_calls(pipe):
    """Every DiT forward: (hidden_states, timestep, text) as passed, and the velocity(ies) it returned."""
    calls = []

    def hook(module, args, kwargs, output):
        hidden, t, text = (list(args) + [kwargs.get(k) for k in ("hidden_states", "timestep", "encoder_hidden_states")][len(args):])[:3]
        calls.append({"x": hidden.detach().clone(), "t": t.detach().clone(), "text": text,
                      "out": [o.detach().clone() for o in output] if isinstance(output, list) else output.detach().clone()})

    handle = pipe.transformer.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def flow_grid(steps, shift=3.0):
    base = np.linspace(float(np.float32(0.999)), 0.0, steps + 1)[:-1]
    return shift * base / (1 + (shift - 1) * base)


def posterior_seed(seed):
    return int.from_bytes(hashlib.sha256(b"lingbot-video v2v posterior " + seed.to_bytes(8, "little")).digest()[:8], "little")


# -- window layout and weights ---------------------------------------------------------------------


@pytest.mark.parametrize("length,size,overlap", [(10, 6, 2), (31, 31, 6), (61, 31, 6), (7, 3, 1), (100, 9, 7), (23, 5, 0), (40, 9, 5)])
def test_blend_weights_sum_to_one_on_every_latent_frame(length, size, overlap):
    spans = list(window_spans(length, size, overlap))
    weights = blend_weights(spans, length)
    total = torch.zeros(length, dtype=torch.float64)
    for (start, end), w in zip(spans, weights):
        assert end - start == min(size, length) and w.shape == (end - start,) and (w > 0).all()
        total[start:end] += w.double()
    assert spans[0][0] == 0 and spans[-1][1] == length
    assert all(b[0] - a[1] <= -overlap for a, b in zip(spans, spans[1:]))  # neighbours share >= overlap frames
    np.testing.assert_allclose(total.numpy(), np.ones(length), rtol=0, atol=1e-6)


def test_two_windows_blend_linearly():
    # 10 latent frames, windows of 6 sharing 2: [0, 6) and [4, 10); frames 4 and 5 are shared.
    spans = list(window_spans(10, 6, 2))
    assert spans == [(0, 6), (4, 10)]
    left, right = blend_weights(spans, 10)
    np.testing.assert_allclose(left.numpy(), [1, 1, 1, 1, 2 / 3, 1 / 3], atol=1e-7)
    np.testing.assert_allclose(right.numpy(), [1 / 3, 2 / 3, 1, 1, 1, 1], atol=1e-7)


def test_context_options_are_checked():
    assert check_context(0, 24) is None
    w = check_context(121, 24)
    assert (w.size, w.overlap) == (31, 6)
    for frames, overlap in ((120, 24), (3, 0), (121, 22), (121, 120), (9, 8), (9, -4)):
        with pytest.raises(ValueError):
            check_context(frames, overlap)


# -- video-to-video --------------------------------------------------------------------------------


@pytest.mark.parametrize("package", ["dense", "moe"])
def test_denoise_one_is_text_to_video_bit_for_bit(packages, package, test_image):
    pipe = load_pipeline(packages[package], device="cpu")
    try:
        run = dict(SIZE, num_frames=5, steps=3, seed=11)
        t2v = pipe.generate("a cat", **run)
        v2v = pipe.generate("a cat", video=_video(5), denoise=1.0, **run)
        assert np.array_equal(t2v, v2v)
        ti2v = pipe.generate("a cat", image=test_image, output_type="latent", **run)
        assert torch.equal(ti2v, pipe.generate("a cat", image=test_image, video=_video(5), denoise=1.0, output_type="latent", **run))
    finally:
        pipe.release()


def test_v2v_runs_the_grid_tail_and_starts_from_the_renoised_video(dense_pipe):
    pipe, seed, steps, denoise = dense_pipe, 3, 20, 0.3
    video = _video(9)
    grid = flow_grid(66)  # KSampler: a grid of int(20 / 0.3) = 66 steps, its last 20 sampled
    expected = grid[66 - steps:]
    assert len(expected) == steps and abs(expected[0] - 0.56569) < 1e-5
    with dit_calls(pipe) as calls:
        pipe.generate("a cat", video=video, denoise=denoise, steps=steps, seed=seed, output_type="latent", **SIZE)
    assert len(calls) == len(expected)  # lockstep CFG: one DiT call per step
    assert [int(c["t"].item()) for c in calls] == (expected * 1000).astype(np.int64).tolist()

    # The start, computed on its own: the video's posterior from its own generator, the T2V noise.
    posterior = pipe.encode_video(resize_frames(video, 64, 96))
    z = posterior.sample(torch.Generator().manual_seed(posterior_seed(seed)))
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    x = ((z - mean) / std).float()
    noise = torch.randn((1, 16, 3, 8, 12), generator=torch.Generator().manual_seed(seed))
    s = float(expected[0])
    want = (1 - s) * x + s * noise
    torch.testing.assert_close(calls[0]["x"], want, rtol=1e-5, atol=1e-5)


def test_v2v_keeps_the_frame_count_and_takes_a_latent(dense_pipe):
    frames = dense_pipe.generate("a cat", video=_video(11), denoise=0.5, steps=4, **SIZE)
    assert frames.shape == (11, 64, 96, 3) and np.isfinite(frames).all()
    latent = torch.randn(1, 16, 2, 8, 12, generator=torch.Generator().manual_seed(1))  # Wan VAE space (a LATENT)
    with dit_calls(dense_pipe) as calls:
        out = dense_pipe.generate("a cat", video_latent=latent, denoise=0.5, steps=4, seed=9, output_type="latent",
                                  height=480, width=832)
    assert out.shape == latent.shape  # the latent's size wins over height/width/num_frames
    mean = torch.tensor(dense_pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(dense_pipe.vae.config.latents_std).view(1, -1, 1, 1, 1)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(9))
    s = float(flow_grid(8)[4])  # denoise 0.5 of 4 steps: the last 4 of an 8-step grid, sigma 0.7496
    torch.testing.assert_close(calls[0]["x"], (1 - s) * (latent - mean) / std + s * noise, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="video_latent must be"):
        dense_pipe.generate("a cat", video_latent=torch.zeros(1, 4, 2, 8, 12), denoise=0.5, **SIZE)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="denoise"):
            dense_pipe.generate("a cat", video=_video(5), denoise=bad, **SIZE)


# -- context windows -------------------------------------------------------------------------------


def test_windows_no_longer_than_the_video_change_nothing(dense_pipe, refiner_pipe):
    run = dict(SIZE, num_frames=9, steps=3, seed=4)
    today = dense_pipe.generate("a cat", **run)
    assert np.array_equal(dense_pipe.generate("a cat", context_frames=9, context_overlap=4, **run), today)
    assert np.array_equal(dense_pipe.generate("a cat", context_frames=21, context_overlap=8, **run), today)
    refine = dict(height=64, width=128, steps=3, vae_tiling=False)
    frames = _video(9, 48, 80)
    today = refiner_pipe.refine(frames, "a cat", context_frames=0, **refine)
    assert np.array_equal(refiner_pipe.refine(frames, "a cat", **refine), today)  # default 121 > 9 frames
    assert np.array_equal(refiner_pipe.refine(frames, "a cat", context_frames=9, context_overlap=4, **refine), today)


def test_long_video_in_windows_returns_every_frame_and_bounds_each_call(dense_pipe):
    # 25 frames = 7 latent frames, windows of 9 frames (3 latent) sharing >= 4 (1): about 2.5 windows' worth.
    steps = 2
    spans = list(window_spans(7, 3, 1))
    assert len(spans) == 3
    with dit_calls(dense_pipe) as calls:
        frames = dense_pipe.generate("a cat", num_frames=25, steps=steps, context_frames=9, context_overlap=4, **SIZE)
    assert frames.shape == (25, 64, 96, 3) and np.isfinite(frames).all()
    assert len(calls) == steps * len(spans)
    for call in calls:
        t_lat = call["x"].shape[2]
        assert t_lat * TOKENS_PER_FRAME <= 3 * TOKENS_PER_FRAME  # one window's video tokens at most


def test_each_window_runs_as_a_standalone_clip(dense_pipe):
    """A window's velocity is the DiT's on that clip alone (RoPE positions from 0), not a slice of a
    longer clip's: re-run the recorded input through the DiT and compare."""
    with dit_calls(dense_pipe) as calls:
        dense_pipe.generate("a cat", num_frames=25, steps=1, context_frames=9, context_overlap=4, output_type="latent", **SIZE)
    assert len(calls) == 3 and [c["x"].shape[2] for c in calls] == [3, 3, 3]
    for call in calls[1:]:
        with torch.no_grad():
            again = dense_pipe.transformer(call["x"], call["t"], call["text"])
        for got, want in zip(call["out"], again):
            assert torch.equal(got, want)


def test_first_frame_pinned_in_window_one_only(dense_pipe, test_image):
    seed = 6
    with dit_calls(dense_pipe) as calls:
        dense_pipe.generate("a cat", image=test_image, num_frames=17, steps=2, seed=seed, context_frames=9,
                            context_overlap=4, output_type="latent", **SIZE)
    condition = dense_pipe.encode_image(test_image, 64, 96)
    cond = dense_pipe.normalizer.to_dit(condition.posterior.sample(torch.Generator().manual_seed(seed))).float()
    spans = list(window_spans(5, 3, 1))
    for step in range(2):
        window_calls = calls[step * len(spans):(step + 1) * len(spans)]
        assert torch.equal(window_calls[0]["x"][:, :, :1], cond)
        for (start, _), call in zip(spans[1:], window_calls[1:]):
            assert not torch.equal(call["x"][:, :, :1], cond)
            # the window's frames are the global latent's: where it overlaps window 1, they agree
            overlap = spans[0][1] - start
            if overlap > 0:
                assert torch.equal(call["x"][:, :, :overlap], window_calls[0]["x"][:, :, start:spans[0][1]])


def test_windows_same_frames_in_every_offload_mode_and_lockstep(packages, test_image):
    """The sampled latent (what the frames are decoded from) is the same in every offload mode and without
    lockstep CFG; the frames are compared once, decoded under the last mode."""
    pipe = load_pipeline(packages["dense"], device="cpu")
    run = dict(SIZE, num_frames=13, steps=2, seed=8, context_frames=9, context_overlap=4)
    try:
        condition = pipe.encode_image(test_image, 64, 96)
        reference = pipe.generate("a cat", condition=condition, output_type="latent", **run)
        frames = pipe.decode(reference)
        for mode in ("model", "sequential", "block", "none"):
            pipe.set_offload(mode, blocks_on_gpu=0) if mode == "block" else pipe.set_offload(mode)
            assert torch.equal(pipe.generate("a cat", condition=condition, output_type="latent", **run), reference), mode
        pipe.set_offload("block", blocks_on_gpu=0)
        assert torch.equal(torch.as_tensor(pipe.generate("a cat", condition=condition, **run)), frames)
        pipe.set_speed(cfg_lockstep=False)
        assert torch.equal(pipe.generate("a cat", condition=condition, output_type="latent", **run), reference)
    finally:
        pipe.release()


def test_windows_with_step_cache_and_dmd_sampler(dense_pipe):
    run = dict(SIZE, num_frames=13, steps=12, seed=2, context_frames=9, context_overlap=4, output_type="latent")
    with dit_calls(dense_pipe) as calls:
        out = dense_pipe.generate("a cat", step_cache=0.5, **run)
    assert torch.isfinite(out).all() and len(calls) == 12 * 2  # two windows per step; skips happen inside the DiT
    dmd = dense_pipe.generate("a cat", sampler="dmd_student", guidance_scale=1.0, **dict(run, steps=4))
    assert dmd.shape == (1, 16, 4, 8, 12) and torch.isfinite(dmd).all()


def test_refine_in_windows_keeps_every_frame(refiner_pipe):
    refine = dict(height=64, width=128, steps=3, vae_tiling=False)
    with dit_calls(refiner_pipe) as calls:
        frames = refiner_pipe.refine(_video(21, 48, 80), "a cat", context_frames=9, context_overlap=4, **refine)
    assert frames.shape == (21, 64, 128, 3) and np.isfinite(frames).all()
    assert {c["x"].shape[2] for c in calls} == {3}


WINDOWED = dict(SIZE, num_frames=13, steps=2, seed=3, context_frames=9, context_overlap=4, output_type="latent")


def test_windows_with_a_lora_match_a_hand_merged_package(packages, tmp_path):
    from support.lora_files import lightx2v_lora, merged_package

    lora, deltas = lightx2v_lora(tmp_path / "tiny_lora.safetensors")
    pipe = load_pipeline(packages["moe"], device="cpu", loras=[(lora, 0.8)])
    try:
        got = pipe.generate("a cat", **WINDOWED)
    finally:
        pipe.release()
    merged = load_pipeline(merged_package(packages["moe"], tmp_path / "merged", [(deltas, 0.8)]), device="cpu")
    try:
        want = merged.generate("a cat", **WINDOWED)
    finally:
        merged.release()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_windows_on_a_gguf_dit_same_latent_under_block_and_none(tmp_path):
    """A quantized DiT (block bytes dequantized per layer) in windows: the same latent streamed block by block
    as resident, and one window covering the video gives the latent of no windows. (Against its dequantized
    package the tiny MoE flips expert choices on rounding at this size, windows or not: test_gguf_dit covers it.)"""
    pytest.importorskip("gguf")
    from lingbot_core.testing.fixtures import write_package
    from lingbot_core.testing.gguf_fixtures import package_state, write_gguf_dit
    from support.sizes import GGUF_DIT

    pkg = write_package(tmp_path / "pkg", moe=True, fp32=True, refiner=False, seed=3, dit=GGUF_DIT)
    path = tmp_path / "dit-Q8_0.gguf"
    write_gguf_dit(path, package_state(pkg), "Q8_0", layout="rebel", seed=11)
    pipe = load_pipeline(pkg, device="cpu", dtypes={"transformer": "fp32"}, transformer_file=path,
                         offload="block", blocks_on_gpu=0)
    try:
        assert pipe.transformer.blocks[0].attn.to_q.weight_qtype is not None
        got = pipe.generate("a cat", **WINDOWED)
        assert torch.isfinite(got).all()
        pipe.set_offload("none")
        assert torch.equal(pipe.generate("a cat", **WINDOWED), got)
        one = dict(WINDOWED, num_frames=9)
        assert torch.equal(pipe.generate("a cat", **one), pipe.generate("a cat", **dict(one, context_frames=0)))
    finally:
        pipe.release()


def test_v2v_with_an_image_pins_the_first_frame(dense_pipe, test_image):
    seed = 12
    with dit_calls(dense_pipe) as calls:
        out = dense_pipe.generate("a cat", image=test_image, video=_video(9), denoise=0.5, steps=4, seed=seed,
                                  output_type="latent", **SIZE)
    condition = dense_pipe.encode_image(test_image, 64, 96)
    cond = dense_pipe.normalizer.to_dit(condition.posterior.sample(torch.Generator().manual_seed(seed))).float()
    assert all(torch.equal(c["x"][:, :, :1], cond) for c in calls) and torch.equal(out[:, :, :1], cond)
    assert not torch.equal(calls[0]["x"][:, :, 1:2], calls[-1]["x"][:, :, 1:2])


def test_denoise_below_one_without_a_video_runs_the_full_grid(dense_pipe, caplog):
    """``denoise`` is a video-to-video strength: with no video a plain text-to-video run samples the whole
    grid (the DiT sees the full grid's timesteps) and gives the latent of denoise 1.0."""
    import logging

    run = dict(SIZE, num_frames=5, steps=2, seed=11, guidance_scale=1.0, output_type="latent")
    with dit_calls(dense_pipe) as calls, caplog.at_level(logging.WARNING, logger="lingbot_core"):
        got = dense_pipe.generate("a cat", denoise=0.5, **run)
    assert "denoise 0.5 has no effect without a video" in caplog.text, caplog.text
    assert [int(c["t"].item()) for c in calls] == (flow_grid(2) * 1000).astype(np.int64).tolist()
    assert torch.equal(got, dense_pipe.generate("a cat", **run))


def test_overlapping_windows_blend_their_velocities_linearly(dense_pipe):
    """One flow-Euler step from sigma 0.8 to 0 (x - 0.8 v), guidance off, 6 latent frames in windows of 4
    sharing 2: [0, 4) and [2, 6). The shared frames 2 and 3 take 2/3 and 1/3 of the left window's velocity and
    1/3 and 2/3 of the right one's (the module's linear rule, written out here); the others their window's."""
    s, seed = 0.8, 5
    with dit_calls(dense_pipe) as calls:
        out = dense_pipe.generate("a cat", num_frames=21, sampler="euler", sigmas=[s], guidance_scale=1.0, seed=seed,
                                  context_frames=13, context_overlap=8, output_type="latent", **SIZE)
    noise = torch.randn((1, 16, 6, 8, 12), generator=torch.Generator().manual_seed(seed))
    assert [c["x"].shape[2] for c in calls] == [4, 4]
    assert torch.equal(calls[0]["x"], noise[:, :, :4]) and torch.equal(calls[1]["x"], noise[:, :, 2:])
    left, right = calls[0]["out"], calls[1]["out"]
    v = torch.cat([left[:, :, :2],
                   left[:, :, 2:3] * (2 / 3) + right[:, :, 0:1] * (1 / 3),
                   left[:, :, 3:4] * (1 / 3) + right[:, :, 1:2] * (2 / 3),
                   right[:, :, 2:]], dim=2)
    torch.testing.assert_close(out, noise - s * v, rtol=0, atol=1e-5)


def test_each_window_keeps_its_own_step_cache(dense_pipe, caplog):
    """Windows that share no frame (overlap 0) evolve as separate clips: with the step cache on, the windowed
    run equals the two halves sampled alone (guidance off: one branch each), each with its own cache, and computes and skips as many DiT
    forwards as they do together (a cache shared by the windows would compare one window's input with the
    other's, and reuse the other's residual)."""
    import logging
    import re

    from lingbot_core.sampling.scheduling import sampler_sigmas

    pipe = dense_pipe
    embeds = pipe.encode_prompt("a cat", num_frames=21, guidance_scale=1.0)
    start = torch.randn((1, 16, 6, 8, 12), generator=torch.Generator().manual_seed(7))
    run = dict(sigmas=sampler_sigmas("unipc", 5, 3.0), guidance_scale=1.0, step_cache=0.5)

    def counts():
        found = [re.search(r"(\d+) of (\d+) DiT forwards computed, (\d+) skipped", r.getMessage()) for r in caplog.records]
        caplog.clear()
        return np.array([int(n) for m in found if m for n in m.groups()])

    with caplog.at_level(logging.INFO, logger="lingbot_core"):
        windowed = pipe.denoise(embeds, start, windows=check_context(9, 0), **run)
        in_windows = counts()
        halves = [pipe.denoise(embeds, start[:, :, a:b], **run) for a, b in ((0, 3), (3, 6))]
        alone = counts()
    assert list(window_spans(6, 3, 0)) == [(0, 3), (3, 6)]
    alone = alone.reshape(2, 3)  # (computed, total, skipped) of each half
    assert (alone[:, 2] > 0).all()  # the cache does skip on these clips
    np.testing.assert_array_equal(in_windows, alone.sum(axis=0))
    torch.testing.assert_close(windowed, torch.cat(halves, dim=2), rtol=0, atol=1e-5)
def test_context_frames_off_reads_the_same_in_the_widget_the_cli_and_the_messages():
    # ComfyUI's widget steps 4n+1 values from its minimum 1, so 1 is its "off"; the CLI's off is 0.
    assert check_context(0, 24) is None and check_context(1, 24) is None
    with pytest.raises(ValueError, match=r"context_frames=3 is not allowed: use 0 or 1 \(off\) or 4n\+1"):
        check_context(3, 0)
