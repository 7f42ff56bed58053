"""Smoke test of the memory benchmark (``python -m bench.memory``) on the tiny MoE fixture."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_memory_bench_tiny(tmp_path):
    out = tmp_path / "memory.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "bench.memory", "--size", "tiny", "--modes", "sequential", "--threads", "2", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert "(scaled)" in proc.stdout and "| mode | one pipeline (weights) MiB |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["layers"] == 2 and report["scaled_to"] == 48 and report["block_mib"] > 0
    results = {r["mode"]: r for r in report["results"]}
    assert list(results) == ["sequential"]
    for mode, r in results.items():
        assert r["ok"] and r["frames_finite"] and r["frames_shape"] == [5, 32, 32, 3], (mode, r)
        assert r["peak_rss_mib"] >= r["rss_after_base_mib"] >= r["rss_start_mib"] > 0, (mode, r)
        expected = (r["peak_rss_mib"] + 46 * report["block_mib"]) / 1024
        assert abs(r["peak_scaled_gib"] - expected) < 0.05, (mode, r)
