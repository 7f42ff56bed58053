"""Smoke test of the offload benchmark (``python -m bench.offload``) on the tiny fixture package."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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


def _ring_probe(pinned_gb: float) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ring_probe", "--device", "cpu", "--layers", "2", "--height", "64", "--width", "96",
         "--frames", "5", "--experts", "16", "--pinned-gb", str(pinned_gb)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def test_ring_probe_pinned_homes_skip_the_staging_buffers_cpu():
    """``bench.ring_probe`` on the CPU fake device, homes pretend-pinned: a pin budget that holds the DiT copies
    every unit from its pinned home (no staging buffer, no host memcpy); budget 0 sends every unit through the
    staging buffers. Both report where the host RAM went."""
    staging, pinned = _ring_probe(0), _ring_probe(8)
    mib = 1024 * 1024
    for r in (staging, pinned):
        assert r["pinned"] == "pretend (CPU fake device)" and r["units"] == 3  # the resident weights + two blocks
        before, after = r["memory_mib"]["before_stage"], r["memory_mib"]["after_stage"]
        assert r["hwm_reset"] and after["VmHWM"] >= after["VmRSS"] > 0 and before["VmRSS"] > 0
        assert all(x["bytes"] > 0 and x["compute_wait_s"] >= 0 for x in r["per_step"])
    assert pinned["pinned_gb"] == 8 and pinned["pinned_units"] == 3 and pinned["staging_bytes"] == 0
    assert pinned["pinned_homes_bytes"] >= 2 * pinned["block_bytes"]
    assert pinned["pinned_bytes"] == pinned["pinned_homes_bytes"]
    assert all(x["host_copy_s"] == 0 for x in pinned["per_step"])  # no home -> staging memcpy, by construction
    assert staging["pinned_gb"] == 0 and staging["pinned_units"] == 0 and staging["pinned_homes_bytes"] == 0
    assert staging["staging_bytes"] >= 2 * staging["block_bytes"]  # two staging buffers, a block each
    assert all(x["host_copy_s"] > 0 for x in staging["per_step"])
    # the same copies to the device, from another source
    assert [x["bytes"] for x in staging["per_step"]] == [x["bytes"] for x in pinned["per_step"]]
    # the RAM figures show the cost: the staging buffers stay allocated after the stage; pinned homes replace the
    # homes they were copied from
    grown = {k: r["memory_mib"]["after_stage"]["VmRSS"] - r["memory_mib"]["before_stage"]["VmRSS"]
             for k, r in (("staging", staging), ("pinned", pinned))}
    assert grown["staging"] >= 0.8 * staging["staging_bytes"] / mib, grown
    assert grown["pinned"] < 0.5 * pinned["pinned_homes_bytes"] / mib, grown


def test_pinned_homes_bench_moves_the_homes_of_a_mapped_package(tmp_path):
    """``bench.pinned_homes`` (issue 31 finding 10) on a memory-mapped package, both streamers on the fake device:
    with a budget larger than the weights every home of the DiT and of the text encoder is pinned, no staging
    buffer is made and neither ring copies on the host; with ``LINGBOT_PINNED_GB=0`` nothing is pinned and the
    DiT's ring copies through its staging buffers. The same bytes reach the device either way."""
    out = tmp_path / "pinned.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "bench.pinned_homes", "--dit", "medium", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    off, on = json.loads(out.read_text())
    assert off["pinned_gb"] == "0" and on["pinned_gb"] == "64"
    assert off["homes_pinned_mib"] == 0 and off["staging_mib"] > 0 and off["rings"][0]["host_copy_s"] > 0
    assert on["homes_pinned_mib"] > 0 and on["staging_mib"] == 0 and on["pinned_mib"] == on["homes_pinned_mib"]
    assert all(r["host_copy_s"] == 0 for r in on["rings"])
    assert [r["model"] for r in on["rings"]] == ["transformer", "text_encoder"]
    assert [(r["bytes_mib"], r["copies"]) for r in on["rings"]] == [(r["bytes_mib"], r["copies"]) for r in off["rings"]]
    for r in (off, on):
        assert r["after_generate"]["VmRSS"] > 0 and r["pin_s"] >= 0
