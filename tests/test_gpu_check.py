"""``scripts/gpu-check`` runs on CPU as ``--device cpu --size tiny``: its rows, written to the JSON after
each row (a run cut off still returns them), and its Markdown."""

import json
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = ("dense-bf16-none", "dense-bf16-block", "dense-bf16-block-repeats", "moe-bf16-none", "moe-dmd-8step",
        "moe-fp8-none", "moe-fp8-block", "moe-bf16-block-lora-4step", "async-dense-bf16-block")


def test_gpu_check_tiny_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    cmd = [str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--size", "tiny", "--steps", "1",
           "--out", str(out), "--rows", ",".join(ROWS)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    snapshot, deadline = None, time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        path = out / "gpu-check.json"
        if snapshot is None and path.is_file():
            data = json.loads(path.read_text())  # replaced atomically: never half-written
            if data.get("rows"):
                snapshot = data
        time.sleep(0.2)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stdout + stderr[-4000:]
    report = json.loads((out / "gpu-check.json").read_text())
    md = (out / "gpu-check.md").read_text()
    assert report["ok"] and not report["partial"] and "Result: PASS" in md

    # rows reached the file while the run was still going
    assert snapshot is not None and snapshot["partial"] and 0 < len(snapshot["rows"]) < len(ROWS)
    assert not report["machine"]["tf32_matmul"]

    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == list(ROWS)
    assert rows["async-dense-bf16-block"] == {"name": "async-dense-bf16-block", "skipped": "CUDA only"}
    ran = [r for r in rows.values() if "skipped" not in r]
    for r in ran:
        assert r["frames_finite"] and r["repeats_identical"] and len(r["generate_s"]) == r["repeats"]
        assert r["text_encoder_forwards"] >= r["repeats"]  # the prompt cache was cleared: the encoder ran each time
        assert r["rss_peak_mib"] >= r["rss_mib"] > 0 and r["pinned_bytes"] == 0  # nothing is pinned on a CPU
    assert [x["load"][0] for x in report["after_release"]] == ["dense-bf16-none", "moe-bf16-none", "moe-fp8-none",
                                                                "moe-bf16-block-lora-4step"]
    lora = rows["moe-bf16-block-lora-4step"]  # issue 16's row: the LoRA is applied and the run is 4 steps
    assert lora["steps"] == 4 and lora["frames_sha256"] != rows["moe-bf16-none"]["frames_sha256"]
    dmd = rows["moe-dmd-8step"]  # issue 22's row: the DMD student's sampler, 8 steps, repeats identical
    assert dmd["steps"] == 8 and dmd["repeats"] == 2 and dmd["frames_sha256"] != rows["moe-bf16-none"]["frames_sha256"]
    assert report["speed_skipped"].startswith("CUDA only")
    assert all(set(x["locked_mib"]) == {"VmPin", "VmLck"} for x in report["after_release"])
    assert rows["dense-bf16-block"]["same_as"] == {"row": "dense-bf16-none", "equal": True}
    assert rows["moe-fp8-block"]["same_as"] == {"row": "moe-fp8-none", "equal": True}
    assert rows["dense-bf16-block-repeats"]["repeats"] == 5 and rows["dense-bf16-block-repeats"]["steps"] == 2
    assert rows["moe-bf16-none"]["frames_sha256"] != rows["dense-bf16-none"]["frames_sha256"]
    assert rows["moe-fp8-none"]["frames_sha256"] != rows["moe-bf16-none"]["frames_sha256"]  # fp8 really ran
    for label in ("bf16", "fp8_e4m3fn"):
        x = report["precision"][label]
        assert 0 < x["mean_abs"] <= x["max_abs"] <= 0.25, x
    assert report["moe"]["bit_identical_to_before"]["slices"]
    assert "| dense-bf16-block | dense | bf16 | block K=0 | native |" in md
    assert [(r["other"], r["mode"], r["identical"]) for r in report["placement"]["runs"]] == [
        ("cpu", "none", True), ("cpu", "model", True)]  # on a CPU host "another device" is the same one
    gg = report["gguf"]["rows"]  # issue 23: a GGUF MoE in offload block streams its quantized bytes
    assert [r["type"] for r in gg] == ["Q4_K", "Q8_0"] and all(r["finite"] for r in gg)
    assert all(0 < r["streamed_bytes_per_step"] < r["file_bytes"] for r in gg)
    assert gg[0]["streamed_bytes_per_step"] < 0.6 * gg[1]["streamed_bytes_per_step"]  # 4.5 vs 8.5 bits a weight
    assert "| Q4_K | 2 |" in md
