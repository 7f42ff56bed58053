"""generate()'s vae_tiling (issue 40, gpu-review-4 findings 1-2): the video-to-video encode reaches the device one
4-frame chunk (of one tile) at a time, never whole, and the encode and decode are tiled as the mode says (auto:
above 720p). On the fake accelerator (support/fake_accelerator.py) every copy to the device is recorded with its
bytes."""

from unittest import mock

import numpy as np
import pytest
import torch

from lingbot_core import load_pipeline
from lingbot_core.model import latents
from lingbot_core.model.latents import REFINER_TILE, tiling_enabled
from support.fake_accelerator import fake_accelerator

# Tall frames: taller than the refiner's 384-pixel tile (two tile rows), narrow enough to stay cheap.
H, W, FRAMES = 400, 16, 5
FP32 = 4
CHUNK = 3 * 4 * H * W * FP32  # one 4-frame chunk of whole fp32 frames
TILE_CHUNK = 3 * 4 * REFINER_TILE[0] * W * FP32  # one 4-frame chunk of one tile (the frame is one tile wide)
VIDEO = 3 * FRAMES * H * W * FP32


@pytest.mark.parametrize("mode, height, width, tiled", [
    ("auto", 1088, 1920, True), ("auto", 1920, 1088, True), ("auto", 720, 1280, False), ("auto", 480, 832, False),
    ("auto", 736, 1280, True),  # the reference's 720p bucket is 2 % above 720x1280
    ("on", 64, 96, True), ("off", 2176, 3840, False), (True, 64, 96, True), (False, 1088, 1920, False),
])
def test_auto_tiles_above_720p(mode, height, width, tiled):
    assert tiling_enabled(mode, height, width) is tiled


@pytest.mark.parametrize("bad", ["yes", "Auto", None, 1])
def test_an_unknown_mode_is_refused_naming_the_choices(dense_pipe, bad):
    with mock.patch("lingbot_core.pipeline.vae_encode", side_effect=AssertionError("must not encode")), \
            pytest.raises(ValueError, match=r"vae_tiling=.* is not allowed: use 'auto' .*'on' or 'off'"):
        dense_pipe.generate("a cat", video=torch.rand(5, 32, 48, 3), denoise=0.5, height=32, width=48, steps=1,
                            vae_tiling=bad)


@pytest.fixture
def model_pipe(packages):
    pipe = load_pipeline(packages["dense"], offload="model", device="cpu")
    yield pipe
    pipe.release()


@pytest.mark.parametrize("mode, tiled", [("on", True), ("off", False), ("auto", True)],
                         ids=["on", "off", "auto above the threshold"])
def test_v2v_places_one_chunk_at_a_time_and_tiles_as_the_mode_says(model_pipe, mode, tiled):
    """V2V on tall frames: the largest tensor put on the device is one chunk of one tile (tiled) or one chunk of
    whole frames (untiled), never the video; the decode runs in tiles (or whole) as the encode did (the tiled
    decode's numbers are diffusers' tiled decode's: tests/model/test_latents.py).
    ``auto`` runs with the threshold lowered below these frames (a real 1080p frame costs seconds on a CPU;
    the threshold itself is checked above)."""
    video = torch.rand(FRAMES, H, W, 3, generator=torch.Generator().manual_seed(1))
    threshold = H * W - 1 if mode == "auto" else latents.AUTO_TILING_PIXELS
    decoder_calls = []
    handle = model_pipe.vae.decoder.register_forward_hook(lambda *a: decoder_calls.append(1))
    try:
        with mock.patch.object(latents, "AUTO_TILING_PIXELS", threshold), fake_accelerator(model_pipe) as requests:
            frames = model_pipe.generate("a cat", video=video, denoise=0.5, steps=1, seed=3, height=H, width=W,
                                         vae_tiling=mode)
    finally:
        handle.remove()
    largest = requests.largest_on_device()
    assert largest <= (TILE_CHUNK if tiled else CHUNK) < VIDEO, (largest, TILE_CHUNK, CHUNK)
    if not tiled:
        assert largest > TILE_CHUNK  # whole-frame chunks: the encode was not tiled
    # the decode: one decoder call per latent frame (2) of each tile (2 rows of one column when tiled)
    assert len(decoder_calls) == (4 if tiled else 2)
    assert frames.shape == (FRAMES, H, W, 3) and np.isfinite(frames).all()


def test_decode_auto_judges_the_frames_pixels(dense_pipe):
    """``decode(tiling="auto")`` (what the Generate node calls) tiles when the decoded frames' pixels exceed the
    threshold, although the latent's cells (8x fewer per side) do not: the frames of "on", in tiles (one decoder
    call per tile row); at the threshold, the frames of "off", whole."""
    latent = torch.randn(1, 16, 1, H // 8, W // 8, generator=torch.Generator().manual_seed(2))
    calls = []
    handle = dense_pipe.vae.decoder.register_forward_hook(lambda *a: calls.append(1))
    try:
        with mock.patch.object(latents, "AUTO_TILING_PIXELS", H * W - 1):
            auto = dense_pipe.decode(latent, tiling="auto")
            assert len(calls) == 2  # 2 tile rows of the one latent frame
            assert torch.equal(auto, dense_pipe.decode(latent, tiling="on"))
        calls.clear()
        with mock.patch.object(latents, "AUTO_TILING_PIXELS", H * W):
            whole = dense_pipe.decode(latent, tiling="auto")
            assert len(calls) == 1
            assert torch.equal(whole, dense_pipe.decode(latent, tiling="off")) and not torch.equal(whole, auto)
    finally:
        handle.remove()
    assert auto.shape == (1, H, W, 3)


def test_the_cli_passes_vae_tiling_to_generate(packages, tmp_path):
    """``generate --vae_tiling on`` reaches pipe.generate (default auto; other values are refused by argparse)."""
    from lingbot_core import cli
    from lingbot_core.pipeline import LingbotPipeline

    seen = []
    real = LingbotPipeline.generate

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("vae_tiling"))
        return real(self, *args, **kwargs)

    args = ["generate", "--model_dir", str(packages["dense"]), "--mode", "t2i", "--prompt", "a cat", "--height", "32",
            "--width", "48", "--steps", "1", "--device", "cpu", "--output", str(tmp_path / "x.png")]
    with mock.patch.object(LingbotPipeline, "generate", spy):
        assert cli.main(args + ["--vae_tiling", "on"]) == 0
    assert seen == ["on"] and (tmp_path / "x.png").is_file()
    assert cli.build_parser().parse_args(args).vae_tiling == "auto"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(args + ["--vae_tiling", "yes"])
