"""Smoke test of the offload benchmark (``python -m bench.offload``) on the tiny fixture package."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_offload_bench_tiny_cpu(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.offload", "--size", "tiny", "--device", "cpu", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert "| mode | load s | generate s |" in proc.stdout

    report = json.loads(out.read_text())
    results = {r["mode"]: r for r in report["results"]}
    assert list(results) == ["none", "model", "sequential"]
    for mode, r in results.items():
        assert r["ok"], (mode, r)
        assert r["load_s"] > 0 and r["generate_s"] > 0, (mode, r)
        assert r["peak_rss_mib"] > 0
        assert r["frames_finite"]
        assert r["frames_shape"] == [5, 64, 96, 3]
    assert report["frames_identical"]
    assert len({r["frames_sha256"] for r in results.values()}) == 1

    peak = {mode: r["peak_resident_weights_mib"] for mode, r in results.items()}
    assert peak["none"] >= peak["model"] >= peak["sequential"] > 0, peak
    # none keeps all three components resident; model at most the largest one.
    weights = results["none"]["component_weights_mib"]
    assert abs(peak["none"] - sum(weights.values())) < 1e-6
    assert peak["model"] <= max(weights.values()) + 1e-6
