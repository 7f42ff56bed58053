"""Latent shapes and validation, DiT-space normalisation, first-frame preprocessing, posterior sampling,
VAE tiling and the refiner's frame rules (model doc §7, §9)."""

import math
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from lingbot_core import Posterior
from lingbot_core.testing.fixtures import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, tiny_vae
from lingbot_core.model.latents import (
    LatentNormalizer, check_video_size, crop_to_aspect, image_to_uint8, latent_shape, preprocess_first_frame,
    resize_frames, vae_tiling,
)
from lingbot_core.model.refiner import refiner_frame_indices, refiner_output_fps

# ---------------------------------------------------------------------------------------------
# DiT space (§7.2)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def normalizer():
    return LatentNormalizer(WAN21_LATENTS_MEAN, WAN21_LATENTS_STD)


def _random_latent(seed=0, shape=(1, 16, 3, 20, 24)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


def test_to_dit_multiplies_by_fp32_reciprocal(normalizer):
    z = _random_latent()
    mean = torch.tensor(WAN21_LATENTS_MEAN, dtype=torch.float32).view(1, -1, 1, 1, 1)
    std = torch.tensor(WAN21_LATENTS_STD, dtype=torch.float32).view(1, -1, 1, 1, 1)
    out = normalizer.to_dit(z)
    assert out.dtype == torch.float32
    assert torch.equal(out, (z - mean) * (1.0 / std))
    # Dividing by std is not the same computation: it differs in the last bit somewhere.
    assert not torch.equal(out, (z - mean) / std)


def test_normalizer_round_trip(normalizer):
    z = _random_latent(1)
    back = normalizer.to_vae(normalizer.to_dit(z))
    torch.testing.assert_close(back, z, rtol=1e-6, atol=1e-5)


def test_normalizer_per_channel(normalizer):
    # A latent equal to the per-channel mean maps to 0; mean + std maps to 1 in every channel.
    mean = torch.tensor(WAN21_LATENTS_MEAN).view(1, -1, 1, 1, 1).expand(1, 16, 1, 2, 2)
    std = torch.tensor(WAN21_LATENTS_STD).view(1, -1, 1, 1, 1).expand(1, 16, 1, 2, 2)
    assert normalizer.to_dit(mean.clone()).abs().max() == 0
    torch.testing.assert_close(normalizer.to_dit(mean + std), torch.ones(1, 16, 1, 2, 2), rtol=0, atol=1e-6)


def test_normalizer_rejects_mismatched_stats():
    with pytest.raises(ValueError, match="latents_mean"):
        LatentNormalizer([0.0] * 16, [1.0] * 15)


def test_pipeline_normalizer_reads_vae_config(dense_pipe):
    cfg = dense_pipe.vae.config
    assert dense_pipe.normalizer.mean.flatten().tolist() == pytest.approx(list(cfg.latents_mean))
    assert (1 / dense_pipe.normalizer.inv_std.flatten()).tolist() == pytest.approx(list(cfg.latents_std))


# ---------------------------------------------------------------------------------------------
# Sizes (§7.1)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, name, suggestions",
    [
        ((6, 64, 96), "num_frames=6", ("5", "9")),
        ((0, 64, 96), "num_frames=0", ("1", "5")),
        ((5, 60, 96), "height=60", ("48", "64")),
        ((5, 64, 8), "width=8", ("16", "32")),
    ],
)
def test_check_video_size_errors(args, name, suggestions):
    with pytest.raises(ValueError) as e:
        check_video_size(*args)
    msg = str(e.value)
    assert name in msg
    for s in suggestions:
        assert f" {s} " in msg or f" {s})" in msg, msg


@pytest.mark.parametrize("args", [(1, 64, 96), (5, 64, 96), (121, 480, 832), (9, 16, 16)])
def test_check_video_size_accepts_valid(args):
    check_video_size(*args)


def test_check_video_size_accepts_numpy_integers():
    check_video_size(np.int64(5), np.int64(64), np.int64(96))


@pytest.mark.parametrize(
    "args, shape",
    [((5, 64, 96), (1, 16, 2, 8, 12)), ((1, 64, 96), (1, 16, 1, 8, 12)), ((121, 480, 832), (1, 16, 31, 60, 104)),
     ((49, 192, 320), (1, 16, 13, 24, 40))],
)
def test_latent_shape(args, shape):
    assert latent_shape(*args) == shape


# ---------------------------------------------------------------------------------------------
# First frame (§7.5)
# ---------------------------------------------------------------------------------------------


def _expected_first_frame(img_u8: torch.Tensor, H: int, W: int) -> torch.Tensor:
    """Scale to cover with ceil, bilinear on the uint8 tensor, centre crop with Python round, /255."""
    h0, w0 = img_u8.shape[:2]
    s = max(H / h0, W / w0)
    nh, nw = max(math.ceil(h0 * s), H), max(math.ceil(w0 * s), W)
    x = F.interpolate(img_u8.permute(2, 0, 1)[None], size=(nh, nw), mode="bilinear", align_corners=False)
    assert x.dtype == torch.uint8
    top, left = round((nh - H) / 2), round((nw - W) / 2)
    return (x[:, :, top:top + H, left:left + W].float() / 255)[:, :, None]


def test_preprocess_first_frame_wide_image(test_image):
    out = preprocess_first_frame(test_image, 64, 96)
    assert out.shape == (1, 3, 1, 64, 96) and out.dtype == torch.float32
    # 70x100 -> scale 0.96 -> 68x96, crop rows 2..66.
    u8 = torch.round(test_image * 255).to(torch.uint8)
    assert torch.equal(out, _expected_first_frame(u8, 64, 96))
    # Every value came from uint8.
    assert torch.equal(torch.round(out * 255) / 255, out)


def test_preprocess_first_frame_tall_image():
    g = torch.Generator().manual_seed(5)
    img = torch.randint(0, 256, (200, 50, 3), generator=g, dtype=torch.uint8)
    out = preprocess_first_frame(img.numpy(), 64, 96)
    assert out.shape == (1, 3, 1, 64, 96)
    assert torch.equal(out, _expected_first_frame(img, 64, 96))  # 200x50 -> 384x96, rows 160..224


def test_preprocess_first_frame_centre_crop_position():
    # A 64x192 image whose left third is 0, middle third 255, right third 0: cropping to 64x64 keeps the middle.
    img = np.zeros((64, 192, 3), dtype=np.uint8)
    img[:, 64:128] = 255
    out = preprocess_first_frame(img, 64, 64)
    assert torch.equal(out, torch.ones(1, 3, 1, 64, 64))


def test_image_to_uint8_pil_and_uint8():
    arr = np.random.default_rng(0).integers(0, 256, (7, 9, 3), dtype=np.uint8)
    assert torch.equal(image_to_uint8(Image.fromarray(arr)), torch.from_numpy(arr))
    assert torch.equal(image_to_uint8(arr), torch.from_numpy(arr))
    rgba = np.concatenate([arr, np.full((7, 9, 1), 7, np.uint8)], -1)
    assert torch.equal(image_to_uint8(Image.fromarray(rgba, "RGBA")), torch.from_numpy(arr))


def test_image_to_uint8_float_rounds():
    x = torch.tensor([[[0.0, 0.5, 1.0], [2 / 255, 0.4999 / 255, 254.6 / 255]]])
    assert image_to_uint8(x).tolist() == [[[0, 128, 255], [2, 0, 255]]]
    # Float pixels from uint8 come back exactly.
    u8 = torch.arange(256, dtype=torch.uint8).view(16, 16, 1).expand(16, 16, 3)
    assert torch.equal(image_to_uint8(u8.float() / 255), u8)
    assert torch.equal(image_to_uint8((u8.double() / 255).numpy()), u8)


def test_image_to_uint8_grayscale_and_alpha():
    gray = torch.rand(5, 6, 1)
    out = image_to_uint8(gray)
    assert out.shape == (5, 6, 3)
    assert torch.equal(out[..., 0], out[..., 2]) and torch.equal(out[..., 0], torch.round(gray[..., 0] * 255).byte())
    assert image_to_uint8(torch.rand(5, 6)).shape == (5, 6, 3)
    rgba = torch.rand(5, 6, 4)
    assert torch.equal(image_to_uint8(rgba), image_to_uint8(rgba[..., :3]))


def test_image_to_uint8_rejects_bad_input():
    bad = torch.rand(4, 4, 3)
    bad[1, 1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        image_to_uint8(bad)
    with pytest.raises(ValueError, match="channels"):
        image_to_uint8(torch.rand(4, 4, 5))
    with pytest.raises(ValueError):
        image_to_uint8(torch.rand(2, 4, 4, 3))


@pytest.mark.parametrize("make", [lambda a: a.astype(np.int64), lambda a: torch.from_numpy(a.astype(np.int32))],
                         ids=["numpy-int64", "torch-int32"])
def test_image_to_uint8_integer_pixels(make):
    arr = np.array([[[0, 128, 255], [1, 2, 3]]])
    try:
        out = image_to_uint8(make(arr))
    except ValueError:
        return  # refusing the input would be acceptable too
    assert out.tolist() == arr.tolist()


# ---------------------------------------------------------------------------------------------
# Posterior (§7.3)
# ---------------------------------------------------------------------------------------------


def _moments(seed=0):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(1, 16, 2, 4, 6, generator=g)
    logvar = torch.randn(1, 16, 2, 4, 6, generator=g) - 2
    return torch.cat([mean, logvar], dim=1)


def test_posterior_sample_consumes_rng():
    post = Posterior(_moments())
    g = torch.Generator().manual_seed(42)
    a, b = post.sample(g), post.sample(g)
    assert a.shape == (1, 16, 2, 4, 6)
    assert not torch.equal(a, b)
    assert torch.equal(a, post.sample(torch.Generator().manual_seed(42)))


def test_posterior_sample_is_mean_plus_std_eps():
    m = _moments(1)
    mean, logvar = m[:, :16], m[:, 16:]
    eps = torch.randn(mean.shape, generator=torch.Generator().manual_seed(3))
    got = Posterior(m).sample(torch.Generator().manual_seed(3))
    torch.testing.assert_close(got, mean + torch.exp(0.5 * logvar) * eps, rtol=1e-6, atol=1e-6)


def test_posterior_mode_is_mean_half():
    m = _moments(2)
    post = Posterior(m)
    assert torch.equal(post.mode(), m[:, :16])
    assert post.latent_frames == 2


# ---------------------------------------------------------------------------------------------
# VAE tiling context manager
# ---------------------------------------------------------------------------------------------

TILING_KEYS = ("use_tiling", "tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height",
               "tile_sample_stride_width")


def test_vae_tiling_sets_and_restores():
    vae = tiny_vae()
    vae.enable_tiling(tile_sample_min_height=100, tile_sample_min_width=120, tile_sample_stride_height=80,
                      tile_sample_stride_width=96)
    vae.use_tiling = False
    before = {k: getattr(vae, k) for k in TILING_KEYS}
    with vae_tiling(vae, True, (32, 48), (24, 40)):
        assert vae.use_tiling is True
        assert (vae.tile_sample_min_height, vae.tile_sample_min_width) == (32, 48)
        assert (vae.tile_sample_stride_height, vae.tile_sample_stride_width) == (24, 40)
    assert {k: getattr(vae, k) for k in TILING_KEYS} == before


def test_vae_tiling_restores_when_body_raises():
    vae = tiny_vae()
    vae.use_tiling = True
    before = {k: getattr(vae, k) for k in TILING_KEYS}
    with pytest.raises(RuntimeError, match="boom"):
        with vae_tiling(vae, False):
            assert vae.use_tiling is False
            raise RuntimeError("boom")
    assert {k: getattr(vae, k) for k in TILING_KEYS} == before
    with pytest.raises(RuntimeError, match="boom"):
        with vae_tiling(vae, True, (32, 32), (24, 24)):
            raise RuntimeError("boom")
    assert {k: getattr(vae, k) for k in TILING_KEYS} == before


# ---------------------------------------------------------------------------------------------
# Refiner helpers (§9)
# ---------------------------------------------------------------------------------------------


def test_crop_to_aspect_wide_and_tall():
    img = torch.arange(70 * 100 * 3, dtype=torch.int64).remainder(256).to(torch.uint8).view(70, 100, 3)
    square = crop_to_aspect(img, 1.0)  # w/h = 1.43 > 1: full height, width round(70) at left round(15)
    assert square.shape == (70, 70, 3) and torch.equal(square, img[:, 15:85])
    wide = crop_to_aspect(img, 2.0)  # 1.43 < 2: full width, height round(50) at top round(10)
    assert wide.shape == (50, 100, 3) and torch.equal(wide, img[10:60])
    same = crop_to_aspect(img, 100 / 70)
    assert torch.equal(same, img)


def test_refiner_frames_24fps_keeps_every_frame():
    assert refiner_frame_indices(9, 24.0) == list(range(9))
    assert refiner_frame_indices(121, 24.0) == list(range(121))
    assert refiner_frame_indices(12, 24.0) == list(range(12))  # any count: the pipeline pads to 4n+1 and trims
    assert refiner_frame_indices(8, 20.0) == list(range(8))


def test_refiner_frames_30fps_resampled():
    idx = refiner_frame_indices(121, 30.0)  # int(121 / 30 * 24) = 96 frames over the whole clip
    assert len(idx) == 96
    assert idx == np.linspace(0, 120, 96).astype(int).tolist()
    assert idx[0] == 0 and idx[-1] == 120


@pytest.mark.parametrize("src_fps, frames, kept, out_fps", [(20.0, 100, 100, 20.0), (12.5, 50, 50, 12.5),
                                                            (24.0, 121, 121, 24.0), (30.0, 121, 96, 24.0),
                                                            (60.0, 120, 48, 24.0)])
def test_refined_frames_keep_the_clip_duration_at_their_frame_rate(src_fps, frames, kept, out_fps):
    """A source slower than the refiner's 24 fps keeps every frame and its own rate; a faster one is resampled to
    24 fps. Either way the refined video lasts as long as the source (frames / fps)."""
    assert refiner_output_fps(src_fps) == out_fps
    assert len(refiner_frame_indices(frames, src_fps)) == kept
    assert abs(kept / out_fps - frames / src_fps) < 1 / out_fps


def test_refiner_frames_max_frames_cap_not_resnapped():
    assert len(refiner_frame_indices(121, 24.0, max_frames=50)) == 50
    assert refiner_frame_indices(121, 24.0, max_frames=0) == list(range(121))  # 0 = no cap


def test_refiner_frames_invalid():
    with pytest.raises(ValueError, match="fps"):
        refiner_frame_indices(9, 0.0)
    with pytest.raises(ValueError):
        refiner_frame_indices(0, 24.0)


def test_resize_frames_bicubic_clamped():
    g = torch.Generator().manual_seed(0)
    frames = (torch.rand(5, 16, 24, 3, generator=g) > 0.5).float()  # hard edges overshoot under bicubic
    out = resize_frames(frames, 32, 64)
    assert out.shape == (1, 3, 5, 32, 64)
    assert out.min() >= 0 and out.max() <= 1
    raw = F.interpolate(frames.permute(0, 3, 1, 2), size=(32, 64), mode="bicubic", align_corners=False)
    assert raw.min() < 0 or raw.max() > 1  # the clamp matters for this input
    torch.testing.assert_close(out, raw.clamp(0, 1).permute(1, 0, 2, 3)[None], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Streamed tiled decode and chunked encode (issue 24 item 6)
# ---------------------------------------------------------------------------------------------


def _diffusers_frames(vae, z):
    """diffusers' own decode (tiled when the VAE's tiling is on), post-processed as the pack always did."""
    with torch.no_grad():
        video = vae.decode(z).sample
    return ((video.float().clamp(-1, 1) + 1) / 2)[0].permute(1, 2, 3, 0).contiguous()


@pytest.mark.parametrize("shape", [(1, 16, 2, 10, 13), (1, 16, 1, 7, 6)], ids=["3x3 tiles", "2x2 tiles, short edges"])
def test_tiled_decode_streams_tiles_to_the_host_with_diffusers_numbers(shape):
    """The tiled decode gives diffusers' tiled decode bit for bit, and each tile's finished part is copied
    to the host right after that tile is decoded, before the next tile's first decoder call: the device
    never holds more than one row of tiles and the overlap above it."""
    from lingbot_core.model.latents import vae_decode

    vae = tiny_vae(seed=2)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    tile, stride = (32, 48), (24, 40)
    events = []
    handle = vae.decoder.register_forward_hook(lambda m, a, o: events.append("decode"))
    orig_to = torch.Tensor.to

    def to(t, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and device.type == "cpu" and t.dim() == 4 and t.shape[-1] == 3:
            events.append(("host", t.shape[1] * t.shape[2] * t.shape[0]))
        return orig_to(t, *args, **kwargs)

    try:
        with vae_tiling(vae, True, tile, stride), torch.no_grad(), mock.patch.object(torch.Tensor, "to", to):
            frames = vae_decode(vae, z, torch.device("cpu"))
        handle.remove()
        with vae_tiling(vae, True, tile, stride):
            expected = _diffusers_frames(vae, z)
    finally:
        handle.remove()
    assert torch.equal(frames, expected)
    rows = math.ceil(shape[3] / (stride[0] // 8))
    cols = math.ceil(shape[4] / (stride[1] // 8))
    # per tile: one decoder call per latent frame, then its part goes to the host
    tiles = "".join("d" if e == "decode" else "h" for e in events)
    runs = [r for r in tiles.split("h") if r]
    assert tiles.startswith("d") and tiles.endswith("h")
    assert len(runs) == rows * cols and all(r == "d" * shape[2] for r in runs), tiles
    # every pixel was copied to the host exactly once
    assert sum(n for e in events if e != "decode" for n in [e[1]]) == frames.shape[0] * frames.shape[1] * frames.shape[2]


@pytest.mark.parametrize("tile, stride", [((32, 48), (24, 40)), ((32, 48), (32, 48))], ids=["overlapping", "no overlap"])
def test_a_latent_of_exactly_one_tile_decodes_whole_with_tiling_on(tile, stride):
    """A latent exactly one tile large is not tiled (diffusers decodes it whole): every pixel of every
    frame is the whole decode's, none left from an uninitialised buffer or a blend with a phantom tile."""
    from lingbot_core.model.latents import vae_decode

    vae = tiny_vae(seed=2)
    z = torch.randn(1, 16, 2, tile[0] // 8, tile[1] // 8, generator=torch.Generator().manual_seed(4))
    with vae_tiling(vae, False):
        whole = _diffusers_frames(vae, z)
    with vae_tiling(vae, True, tile, stride), torch.no_grad():
        frames = vae_decode(vae, z, torch.device("cpu"))
    assert frames.shape == whole.shape == (5, tile[0], tile[1], 3)
    assert torch.equal(frames, whole)


def test_untiled_decode_and_encode_unchanged():
    """Without tiling the decode is diffusers' decode post-processed in frame chunks (the same bits), and
    the chunked encode input gives the moments of the whole-video formula."""
    from lingbot_core.model.latents import CHUNK_FRAMES, vae_decode, vae_encode

    vae = tiny_vae(seed=4)
    z = torch.randn(1, 16, 3, 4, 6, generator=torch.Generator().manual_seed(5))
    with vae_tiling(vae, False), torch.no_grad():
        frames = vae_decode(vae, z, torch.device("cpu"))
        assert frames.shape[0] == 9 > CHUNK_FRAMES
        assert torch.equal(frames, _diffusers_frames(vae, z))
        pixels = torch.rand(1, 3, 9, 32, 48, generator=torch.Generator().manual_seed(6))
        moments = vae_encode(vae, pixels, torch.device("cpu")).moments
        expected = vae.encode((pixels - 0.5) / 0.5).latent_dist.parameters
    assert torch.equal(moments, expected)


def _encoder_inputs(vae):
    """Record the (T, H, W) of every encoder call (the chunks the encode placed on the device)."""
    shapes = []
    return shapes, vae.encoder.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(args[0].shape[2:])),
                                                         with_kwargs=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_untiled_encode_gives_the_whole_video_encode_bits(dtype):
    """Issue 40: the encoder is fed frame 0, then 4 frames at a time, straight from the host pixels (never the
    whole video), and the moments are the old whole-video encode's bit for bit (fp32 and a bf16 VAE)."""
    from lingbot_core.model.latents import vae_encode

    vae = tiny_vae(seed=4).to(dtype)
    pixels = torch.rand(1, 3, 13, 32, 48, generator=torch.Generator().manual_seed(7))
    shapes, handle = _encoder_inputs(vae)
    try:
        with vae_tiling(vae, False), torch.no_grad():
            moments = vae_encode(vae, pixels, torch.device("cpu")).moments
    finally:
        handle.remove()
    with torch.no_grad():
        old = torch.empty(pixels.shape, dtype=dtype)  # the whole video converted, as the encode was
        old[:] = (pixels - 0.5) / 0.5
        expected = vae.encode(old).latent_dist.parameters
    assert shapes == [(1, 32, 48)] + [(4, 32, 48)] * 3
    assert moments.dtype == dtype and moments.shape == (1, 32, 4, 4, 6)
    assert torch.equal(moments, expected)


@pytest.mark.parametrize("size, tile, stride", [((56, 88), (32, 48), (24, 40)), ((40, 48), (32, 48), (32, 48))],
                         ids=["3x2 overlapping tiles", "2x1 tiles, no overlap"])
def test_the_tiled_encode_streams_chunks_of_tiles_with_diffusers_numbers(size, tile, stride):
    """With the VAE's tiling on and frames larger than a tile, each encoder call gets one chunk of one tile,
    and the moments are diffusers' tiled encode's bit for bit (so tiled differs from untiled only by the tile
    blending, as Refine's encode always did)."""
    from lingbot_core.model.latents import vae_encode

    vae = tiny_vae(seed=5)
    pixels = torch.rand(1, 3, 9, *size, generator=torch.Generator().manual_seed(8))
    shapes, handle = _encoder_inputs(vae)
    try:
        with vae_tiling(vae, True, tile, stride), torch.no_grad():
            moments = vae_encode(vae, pixels, torch.device("cpu")).moments
    finally:
        handle.remove()
    with torch.no_grad():
        with vae_tiling(vae, True, tile, stride):
            expected = vae.encode((pixels - 0.5) / 0.5).latent_dist.parameters
        with vae_tiling(vae, False):
            untiled = vae.encode((pixels - 0.5) / 0.5).latent_dist.parameters
    tiles = math.ceil(size[0] / stride[0]) * math.ceil(size[1] / stride[1])
    assert len(shapes) == tiles * 3 and all(t <= 4 and h <= tile[0] and w <= tile[1] for t, h, w in shapes), shapes
    assert moments.shape == expected.shape == (1, 32, 3, size[0] // 8, size[1] // 8)
    assert torch.equal(moments, expected)
    assert not torch.equal(moments, untiled)
