"""``scripts/gpu-check`` runs on CPU as ``--device cpu --size tiny`` and writes its JSON and Markdown."""

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_tiny_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--size", "tiny", "--steps", "1",
                           "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    report = json.loads((out / "gpu-check.json").read_text())
    md = (out / "gpu-check.md").read_text()
    assert report["ok"] and "Result: PASS" in md
    runs = report["offload"]["runs"]
    assert [(r["precision"], r["mode"]) for r in runs] == [
        (p, m) for p in ("bf16", "fp8_e4m3fn") for m in ("none", "model", "sequential", "block")]
    assert all(r["generate_s"] > 0 and r["frames_finite"] for r in runs)
    assert report["offload"]["bf16_frames_identical"] and report["offload"]["fp8_e4m3fn_frames_identical"]
    bf16 = {r["frames_sha256"] for r in runs if r["precision"] == "bf16"}
    fp8 = {r["frames_sha256"] for r in runs if r["precision"] == "fp8_e4m3fn"}
    assert bf16 != fp8  # the fp8 DiT really ran with other weights
    for label in ("bf16", "fp8_e4m3fn"):
        x = report["precision"][label]
        assert 0 < x["mean_abs"] <= x["max_abs"] <= 0.25, x
    assert report["moe"]["bit_identical_to_before"]["slices"]
    assert [(r["other"], r["mode"], r["identical"]) for r in report["placement"]["runs"]] == [
        ("cpu", "none", True), ("cpu", "model", True)]  # on a CPU host "another device" is the same one
    assert "| bf16 | block K=0 |" in md
