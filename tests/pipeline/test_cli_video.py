"""``python -m lingbot_core generate --video`` and ``refine`` as a user runs them (issue 39): a video file in,
an mp4 out with every frame, at the source's frame rate (subprocesses on the tiny fp32 MoE package; runs whose
tiling and context windows are observed by hooks on the loaded modules call ``main()`` in this process).
"""

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def write_mp4(path, frames: int, fps: int, height: int = 48, width: int = 80) -> None:
    import av

    base = np.random.default_rng(3).integers(0, 255, (height, width, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)  # H.264: the CLI reads what a video server sends
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.roll(base, 2 * i, axis=1), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def decode(path):
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


@pytest.fixture(scope="module")
def runs(packages, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_video")
    write_mp4(out / "in20.mp4", 20, fps=20)
    write_mp4(out / "in30.mp4", 22, fps=30)
    model = str(packages["moe"])
    commands = {
        # 20 frames at 20 fps, V2V in windows of 9 frames; its size (80x48, multiples of 16) is the output's.
        "v2v": ["generate", "--model_dir", model, "--video", str(out / "in20.mp4"), "--denoise", "0.5",
                "--steps", "2", "--context_frames", "9", "--context_overlap", "4", "--prompt", "a cat",
                "--device", "cpu", "--output", str(out / "v2v.mp4")],
        # 22 frames at 30 fps through the refiner in windows: int(22 / 30 * 24) = 17 frames at 24 fps.
        "refine": ["refine", "--model_dir", model, "--video", str(out / "in30.mp4"), "--prompt", "a cat",
                   "--height", "64", "--width", "128", "--steps", "2", "--no_vae_tiling", "--context_frames", "9",
                   "--context_overlap", "4", "--device", "cpu", "--output", str(out / "refined.mp4")],
        "bad_video": ["refine", "--model_dir", model, "--video", str(out / "missing.mp4"), "--prompt", "a cat",
                      "--device", "cpu"],
    }
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    procs = {name: subprocess.Popen([sys.executable, "-m", "lingbot_core", *args], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in commands.items()}
    results = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            results[name] = (p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out, results


def test_generate_video_to_video_keeps_every_frame_and_the_source_rate(runs):
    out, results = runs
    rc, stdout, stderr = results["v2v"]
    assert rc == 0, stderr[-2000:]
    frames, fps = decode(out / "v2v.mp4")
    assert frames.shape == (20, 48, 80, 3) and fps == 20.0
    assert "V2V: 2 steps from sigma 0.7496" in stderr  # denoise 0.5 of 2 steps: the last 2 of a 4-step grid
    assert "context windows" in stderr


def test_refine_a_video_file_in_windows(runs):
    out, results = runs
    rc, stdout, stderr = results["refine"]
    assert rc == 0, stderr[-2000:]
    frames, fps = decode(out / "refined.mp4")
    assert frames.shape == (17, 64, 128, 3) and fps == 24.0


def test_a_missing_video_is_a_plain_error(runs):
    _, results = runs
    rc, _, stderr = results["bad_video"]
    assert rc == 2 and "no video file at" in stderr and "Traceback" not in stderr


@contextmanager
def observed_pipelines():
    """Every pipeline the CLI loads in this process, observed by hooks on its real modules: the frame count
    of each DiT input (context windows show as shorter clips) and the VAE decoder's calls (one per latent
    frame, per tile row when tiled)."""
    import lingbot_core

    real, seen = lingbot_core.load_pipeline, []

    def load(*args, **kwargs):
        pipe = real(*args, **kwargs)
        run = {"refiner": pipe.is_refiner, "dit_frames": [], "decoder_calls": 0}
        pipe.transformer.register_forward_pre_hook(lambda m, a: run["dit_frames"].append(a[0].shape[2]))
        pipe.vae.decoder.register_forward_hook(lambda *a: run.__setitem__("decoder_calls", run["decoder_calls"] + 1))
        seen.append(run)
        return pipe

    with mock.patch.object(lingbot_core, "load_pipeline", load):
        yield seen


def test_refine_no_vae_tiling_decodes_whole_frames_and_keeps_a_slower_rate(packages, tmp_path):
    """``refine --no_vae_tiling`` on frames taller than a tile (400 > 384 pixels): the decoder runs once per
    latent frame (whole frames, no tile rows); a 20 fps source keeps every frame and its rate."""
    from lingbot_core.cli import main

    write_mp4(tmp_path / "in.mp4", 5, fps=20)
    out = tmp_path / "refined.mp4"
    with observed_pipelines() as runs:
        assert main(["refine", "--model_dir", str(packages["moe"]), "--video", str(tmp_path / "in.mp4"), "--prompt",
                     "a cat", "--height", "400", "--width", "16", "--steps", "2", "--no_vae_tiling", "--device", "cpu",
                     "--output", str(out)]) == 0
    assert [r["refiner"] for r in runs] == [True]
    assert runs[0]["decoder_calls"] == 2  # 5 frames = 2 latent frames, each decoded whole
    frames, fps = decode(out)
    assert frames.shape == (5, 400, 16, 3) and fps == 20.0


def test_generate_run_refiner_takes_the_refiner_context_windows(packages, tmp_path):
    """``generate --run_refiner --refiner_context_frames 9 --refiner_context_overlap 4``: the refiner DiT sees
    17 frames (5 latent frames) as windows of 3 latent frames, two per step; the base run (no windows) sees all 5."""
    from lingbot_core.cli import main

    out = tmp_path / "base.mp4"
    with observed_pipelines() as runs:
        assert main(["generate", "--model_dir", str(packages["moe"]), "--mode", "t2v", "--prompt", "a cat",
                     "--num_frames", "17", "--height", "32", "--width", "48", "--steps", "1", "--guidance_scale", "1",
                     "--device", "cpu", "--output", str(out), "--run_refiner", "--refiner_height", "32",
                     "--refiner_width", "48", "--refiner_steps", "2", "--refiner_sigma_tail_steps", "0",
                     "--refiner_context_frames", "9", "--refiner_context_overlap", "4"]) == 0
    base, refiner = runs
    assert not base["refiner"] and base["dit_frames"] == [5]
    assert refiner["refiner"] and refiner["dit_frames"] == [3] * 4  # 2 steps x 2 windows
    assert decode(tmp_path / "base_refined.mp4")[0].shape == (17, 32, 48, 3)
