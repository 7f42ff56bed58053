"""``python -m lingbot_core generate --video`` and ``refine`` as a user runs them (issue 39): a video file in,
an mp4 out with every frame, at the source's frame rate (subprocesses on the tiny fp32 MoE package).
"""

import os
import subprocess
import sys
from pathlib import Path

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
