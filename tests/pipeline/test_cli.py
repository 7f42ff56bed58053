"""``python -m lingbot_core generate`` as a user runs it (subprocesses on the fp32 MoE fixture).

Each run pays for importing torch/diffusers/transformers (several seconds), so all runs of this module
are started together by one fixture and each test waits for its own.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300


def _decode(path: Path):
    import av

    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return frames


@pytest.fixture(scope="module")
def cli_runs(packages, test_image, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli")
    model = str(packages["moe"])
    image = out / "first.png"
    Image.fromarray((test_image.numpy() * 255).round().astype(np.uint8)).save(image)
    prompt_json = out / "prompt.json"
    prompt_json.write_text(json.dumps({"caption": {"scene": "a cat on a mat"}, "duration": 0.3}), encoding="utf-8")

    common = ["--model_dir", model, "--height", "64", "--width", "96", "--steps", "2", "--device", "cpu"]
    runs = {
        "t2v": ["--mode", "t2v", "--prompt", "a cat", "--num_frames", "5", "--output", str(out / "t2v.mp4")],
        "t2i": ["--mode", "t2i", "--prompt", "a cat", "--output", str(out / "t2i.png")],
        "ti2v": ["--mode", "ti2v", "--prompt", "a cat", "--num_frames", "5", "--image", str(image),
                 "--output", str(out / "ti2v.mp4"), "--run_refiner", "--refiner_height", "64",
                 "--refiner_width", "128", "--refiner_steps", "4"],
        # The JSON duration (0.3 s * 24 fps = 7 -> 9 frames) overrides --num_frames.
        "json": ["--mode", "t2v", "--prompt_json", str(prompt_json), "--num_frames", "5",
                 "--output", str(out / "json.mp4")],
        "bad_frames": ["--mode", "t2v", "--prompt", "a cat", "--num_frames", "6", "--output", str(out / "bad.mp4")],
        # Speed flags (later --steps wins): a step cache that skips, sequential CFG; a GPU-only kernel on the CPU.
        "speed": ["--mode", "t2v", "--prompt", "a cat", "--num_frames", "5", "--steps", "10", "--step_cache", "0.5",
                  "--no_cfg_lockstep", "--output", str(out / "speed.mp4")],
        "flash_cpu": ["--mode", "t2v", "--prompt", "a cat", "--num_frames", "5", "--attention", "flash_attn",
                      "--output", str(out / "flash.mp4")],
    }
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "lingbot_core", "generate", *common, *args], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, args in runs.items()
    }
    results = {}

    def result(name):
        if name not in results:
            try:
                stdout, stderr = procs[name].communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                procs[name].kill()
                stdout, stderr = procs[name].communicate()
            results[name] = (procs[name].returncode, stdout, stderr)
        return results[name]

    yield out, result
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def _ok(result, name):
    rc, stdout, stderr = result(name)
    assert rc == 0, f"{name} exited {rc}\n{stderr[-3000:]}"
    return stdout


def test_cli_t2v_writes_mp4(cli_runs):
    out, result = cli_runs
    stdout = _ok(result, "t2v")
    path = out / "t2v.mp4"
    assert str(path) in stdout
    frames = _decode(path)
    assert len(frames) == 5
    assert all(f.shape == (64, 96, 3) for f in frames)


def test_cli_t2i_writes_png(cli_runs):
    out, result = cli_runs
    _ok(result, "t2i")
    with Image.open(out / "t2i.png") as img:
        assert img.size == (96, 64)
        assert img.mode == "RGB"
    assert not (out / "t2i.mp4").exists()


def test_cli_ti2v_with_refiner_writes_both(cli_runs):
    out, result = cli_runs
    _ok(result, "ti2v")
    base = _decode(out / "ti2v.mp4")
    refined = _decode(out / "ti2v_refined.mp4")
    assert len(base) == 5 and base[0].shape == (64, 96, 3)
    assert len(refined) == 5 and refined[0].shape == (64, 128, 3)


def test_cli_prompt_json_duration_sets_frames(cli_runs):
    out, result = cli_runs
    _ok(result, "json")
    assert len(_decode(out / "json.mp4")) == 9


def test_cli_bad_num_frames(cli_runs):
    out, result = cli_runs
    rc, stdout, stderr = result("bad_frames")
    assert rc != 0
    assert "num_frames" in stderr
    assert "Traceback" not in stderr  # a message, not a crash
    assert not (out / "bad.mp4").exists()


def test_cli_prompt_json_bad_duration_is_a_clean_error(tmp_path, capsys):
    from lingbot_core.cli import main

    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps({"caption": "a cat", "duration": "abc"}), encoding="utf-8")
    rc = main(["generate", "--model_dir", str(tmp_path / "no-model"), "--prompt_json", str(prompt)])
    assert rc == 2
    assert "duration" in capsys.readouterr().err


def test_cli_speed_flags(cli_runs):
    out, result = cli_runs
    _ok(result, "speed")
    rc, _, stderr = result("speed")
    assert "of 20 DiT forwards computed" in stderr and (out / "speed.mp4").is_file()
    rc, _, stderr = result("flash_cpu")
    assert rc == 2 and "attention='flash_attn' runs on CUDA GPUs only" in stderr


def test_cli_runs_from_the_three_files_alone(tmp_path):
    """--transformer_file/--text_encoder_file/--vae_file without --model_dir: a GGUF DiT (config from its shapes),
    the text encoder file with its config beside it, the Wan 2.1 VAE file; the processor ships with the pack."""
    from lingbot_core.testing.file_fixtures import write_comfy_files

    files = write_comfy_files(tmp_path / "models", moe=False, seed=2)
    out = tmp_path / "files.mp4"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    args = [sys.executable, "-m", "lingbot_core", "generate", "--transformer_file", str(files["transformer"]),
            "--text_encoder_file", str(files["text_encoder"]), "--vae_file", str(files["vae"]), "--mode", "t2v",
            "--prompt", "a cat", "--num_frames", "5", "--height", "64", "--width", "96", "--steps", "2",
            "--device", "cpu", "--output", str(out)]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frames = _decode(out)
    assert len(frames) == 5 and frames[0].shape == (64, 96, 3) and np.std(frames) > 1.0


def test_cli_without_model_dir_names_the_missing_file(tmp_path, capsys):
    from lingbot_core.cli import main

    gguf = tmp_path / "dit.gguf"
    with pytest.raises(SystemExit, match=r"--text_encoder_file, --vae_file are missing"):
        main(["generate", "--transformer_file", str(gguf), "--prompt", "a cat", "--device", "cpu"])
    with pytest.raises(SystemExit, match=r"--refiner_file"):
        main(["generate", "--transformer_file", str(gguf), "--text_encoder_file", str(gguf), "--vae_file", str(gguf),
              "--prompt", "a cat", "--device", "cpu", "--run_refiner"])


@pytest.mark.parametrize("kind", ["folder", "png renamed .mp4"])
def test_cli_hostile_files_are_plain_errors(tmp_path, capsys, kind):
    """A folder as --prompt_json and a PNG renamed .mp4 as --video: 'error: ...' and exit 2, no traceback,
    before any model is looked for."""
    from lingbot_core.cli import main

    args = ["generate", "--model_dir", str(tmp_path / "no-model")]
    if kind == "folder":
        args += ["--prompt_json", str(tmp_path)]
        expected = f"error: {tmp_path} is a folder, not a prompt file"
    else:
        fake = tmp_path / "clip.mp4"
        Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(fake, format="PNG")
        args += ["--prompt", "a kite", "--video", str(fake)]
        expected = f"error: {fake} is not an mp4 file (its first box is"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
