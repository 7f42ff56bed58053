"""Continuing a clip (issue 50): pipe.extend's length, the unchanged input, the tail pinned at every DiT call,
keep_frames 1 = image-to-video from the last frame, chaining, windows and V2V on the result, colour match, and
the errors for bad requests (before any weight is read)."""

import numpy as np
import pytest
import torch

from lingbot_core.model.color_match import match_color
from lingbot_core.pipeline_pool import PipelinePool

H, W = 64, 96
T = 7  # not 4n+1: the input's own length is kept
RUN = dict(steps=2, seed=5)


@pytest.fixture(scope="module")
def video():
    """A structured clip: a random texture sliding 3 px right per frame, 8-bit values as a ComfyUI IMAGE holds them."""
    rng = np.random.default_rng(7)
    base = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    frames = np.stack([np.roll(base, 3 * i, axis=1) for i in range(T)])
    return torch.from_numpy(frames).float() / 255.0


@pytest.fixture(scope="module")
def extended(dense, video):
    """keep_frames 5 (two pinned latent frames), 8 new frames."""
    return dense.extend(video, "a kite", new_frames=8, keep_frames=5, output_type="pt", **RUN)


def _encoded_tail(pipe, video, keep, seed):
    """The tail's DiT-space latent as the run draws it: 8-bit frames, VAE posterior, first draw of the seed."""
    pixels = torch.round(video[-keep:] * 255).div(255).permute(3, 0, 1, 2)[None]
    posterior = pipe.encode_video(pixels)
    return pipe.normalizer.to_dit(posterior.sample(torch.Generator().manual_seed(seed)))


def test_extend_appends_the_new_frames_after_the_unchanged_input(extended, video):
    assert extended.shape == (T + 8, H, W, 3) and extended.dtype == torch.float32
    assert torch.equal(extended[:T], video)  # bit for bit, no frame duplicated or re-encoded
    new = extended[T:]
    assert torch.isfinite(new).all() and 0 <= new.min() and new.max() <= 1 and new.std() > 0
    assert not any(torch.equal(new[0], f) for f in video)  # the seam is not a repeated input frame


def test_keep_one_is_image_to_video_from_the_last_frame_bit_for_bit(dense, video):
    decoded_like = video * 0.9 + 0.013  # values between 8-bit steps, as decoded frames have: TI2V rounds its image
    out = dense.extend(decoded_like, "a kite", new_frames=4, keep_frames=1, output_type="pt", **RUN)
    ti2v = dense.generate("a kite", image=decoded_like[-1], height=H, width=W, num_frames=5, output_type="pt", **RUN)
    assert out.shape == (T + 4, H, W, 3)
    assert torch.equal(out[T:], ti2v[1:])


@pytest.mark.parametrize("context", [None, (9, 4)], ids=["whole", "windows"])
def test_the_tail_is_pinned_at_every_dit_call(dense, video, context):
    keep, new, seed = 5, 12, 3
    expected = _encoded_tail(dense, video, keep, seed)  # (1, 16, 2, h, w)
    assert expected.shape[2] == 2
    seen = []
    hook = dense.transformer.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    try:
        windows = {} if context is None else dict(context_frames=context[0], context_overlap=context[1])
        out = dense.extend(video, "a kite", new_frames=new, keep_frames=keep, steps=2, seed=seed, output_type="pt", **windows)
    finally:
        hook.remove()
    assert out.shape == (T + new, H, W, 3) and torch.equal(out[:T], video)
    # 17 frames = 5 latent frames; windows of 3 latent frames sharing 1: (0, 3) and (2, 5), window 0 first
    per_step = 1 if context is None else 2
    assert len(seen) == 2 * per_step
    assert [x.shape[2] for x in seen] == ([5] * 2 if context is None else [3] * 4)
    heads = seen[::per_step]  # the calls whose input starts at latent frame 0
    for i, x in enumerate(heads):
        assert torch.equal(x[:, :, :2], expected), f"DiT call {i}: the head is not the encoded tail"
        assert not torch.equal(x[:, :, 2:], torch.zeros_like(x[:, :, 2:]))  # the rest is being sampled


def test_extend_chains_and_feeds_video_to_video(dense, extended):
    again = dense.extend(extended, "a kite", new_frames=4, keep_frames=9, output_type="pt", **RUN)
    assert again.shape == (T + 12, H, W, 3)
    assert torch.equal(again[:T + 8], extended)
    v2v = dense.generate("a kite", video=again, denoise=0.5, height=H, width=W, steps=2, seed=1, output_type="pt")
    assert v2v.shape == again.shape and torch.isfinite(v2v).all()


def test_color_match_maps_each_channels_mean_and_spread_to_the_reference():
    g = torch.Generator().manual_seed(0)
    reference = 0.3 + 0.4 * torch.rand(16, 24, 3, generator=g)
    frames = 0.1 + 0.2 * torch.rand(3, 16, 24, 3, generator=g)  # darker and flatter: no value reaches the clamp
    out = match_color(frames, reference, "mean-std")
    flat, ref = out.reshape(-1, 3).double(), reference.reshape(-1, 3).double()
    torch.testing.assert_close(flat.mean(0), ref.mean(0), rtol=0, atol=1e-5)
    torch.testing.assert_close(flat.std(0), ref.std(0), rtol=0, atol=1e-5)
    # one affine map per channel for the whole clip: the frames keep their order of brightness
    assert torch.equal(out.mean((1, 2, 3)).argsort(), frames.mean((1, 2, 3)).argsort())
    assert match_color(frames, reference, "off") is frames


def test_extend_color_match_touches_only_the_new_frames(dense, video):
    out = dense.extend(video, "a kite", new_frames=4, keep_frames=1, color_match="mean-std", output_type="pt", **RUN)
    assert torch.equal(out[:T], video)
    new, last = out[T:].reshape(-1, 3), video[-1].reshape(-1, 3)
    torch.testing.assert_close(new.mean(0), last.mean(0), rtol=0, atol=0.02)  # clamping moves it a little


@pytest.mark.parametrize("frames, size, keep, new, message", [
    (7, (H, W), 4, 8, "use 1 + 4k frames (1, 5, 9, ...), e.g. 1 or 5"),
    (7, (H, W), 9, 8, "longer than the video (7 frames): use at most 5"),
    (7, (H, W), 1, 81, "multiple of 4 (4, 8, ... 80 = 3.3 s at 24 fps); the nearest: 80 or 84"),
    (7, (H, W), 1, 0, "the nearest: 4."),
    (7, (H, W), True, 8, "keep_frames=True is not allowed"),
    (0, (H, W), 1, 8, "the video to extend is empty"),
    (5, (70, 100), 1, 8, "the video is 100x70 (width x height), a size the model cannot take"),
    (5, (70, 100), 1, 8, "The nearest it takes is 96x64"),
    (5, (H, W), 1, 1004, "longer than the longest clip (1001): use new_frames 1000 or fewer"),
])
def test_bad_requests_fail_before_any_weight_is_read(packages, frames, size, keep, new, message):
    pool = PipelinePool(headroom=0)
    handle = pool.handle(packages["dense"], offload="model", device="cpu")
    with pytest.raises(ValueError) as err:
        handle.extend(torch.zeros(frames, *size, 3), "a kite", new_frames=new, keep_frames=keep)
    assert message in str(err.value)
    assert not handle.loaded and pool.loaded() == ()


def test_extend_refuses_options_it_sets_itself_and_the_refiner(dense, video, refiner_pipe):
    with pytest.raises(ValueError, match="extend sets height, width itself"):
        dense.extend(video, "a kite", new_frames=4, height=H, width=W)
    with pytest.raises(ValueError, match="color_match='auto' is not allowed"):
        dense.extend(video, "a kite", new_frames=4, color_match="auto")
    with pytest.raises(ValueError, match="refiner DiT, which only refines"):
        refiner_pipe.extend(video, "a kite", new_frames=4)
