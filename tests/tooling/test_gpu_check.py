"""``scripts/gpu-check`` runs on CPU as ``--device cpu --size tiny``: its rows, written to the JSON after
each row (a run cut off still returns them), and its Markdown."""

import json
import os
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
ROWS = ("dense-bf16-none", "dense-bf16-block", "dense-bf16-block-repeats", "moe-bf16-none", "moe-dmd-8step",
        "moe-fp8-none", "moe-fp8-block", "moe-bf16-block-lora-4step", "async-dense-bf16-block")


def test_gpu_check_tiny_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    cmd = [str(REPO / "scripts" / "gpu-check"), "--device", "cpu", "--size", "tiny", "--steps", "1",
           "--out", str(out), "--rows", ",".join(ROWS),
           "--budget-s", "3600"]  # a slow shared CI CPU must not skip parts: the budget is tested on a fake clock
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
        # the prompt encode's seconds split out of each run: timed, and the rest computed from them
        assert len(r["text_encoder_s"]) == len(r["rest_s_computed"]) == r["repeats"]
        for total, te, rest in zip(r["generate_s"], r["text_encoder_s"], r["rest_s_computed"]):
            assert 0 < te < total and abs(te + rest - total) <= 0.02, (r["name"], total, te, rest)
        assert r["rss_peak_mib"] >= r["rss_mib"] > 0 and r["pinned_bytes"] == 0  # nothing is pinned on a CPU
        assert r["pin_s"] == [0.0] * r["repeats"] and r["generate_less_pin_s_computed"] == r["generate_s"]
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
    assert "| generate s | text encoder s |" in md
    te = rows["dense-bf16-block"]["text_encoder_s"][0]
    assert f"| {', '.join(str(t) for t in rows['dense-bf16-block']['generate_s'])} | {te} |" in md
    assert [(r["other"], r["mode"], r["identical"]) for r in report["placement"]["runs"]] == [
        ("cpu", "none", True), ("cpu", "model", True)]  # on a CPU host "another device" is the same one
    gg = report["gguf"]["rows"]  # issue 23: a GGUF MoE in offload block streams its quantized bytes
    assert [r["type"] for r in gg] == ["Q4_K", "Q8_0"] and all(r["finite"] for r in gg)
    assert all(0 < r["streamed_bytes_per_forward_computed"] < r["file_bytes"] for r in gg)
    assert all("ring_bytes_per_step" not in r for r in gg)  # no ring copies on a CPU: nothing measured is claimed
    assert gg[0]["streamed_bytes_per_forward_computed"] < 0.6 * gg[1]["streamed_bytes_per_forward_computed"]  # 4.5 vs 8.5 bits
    assert "| Q4_K | 2 |" in md and "(computed)" in md
    assert "host syncs a step makes outside the DiT forward" in md and "UniPC" in md  # finding 13's list
    prose = [line for line in md.splitlines() if line and not line.startswith(("|", "#", "- date", "Result"))]
    unlabelled = [line for line in prose if "measured" not in line and "computed" not in line]
    assert prose and not unlabelled, unlabelled  # every part says which of its figures are measured


def _gpu_check_module():
    import importlib.util
    import sys

    if "gpu_check_under_test" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check_under_test", REPO / "scripts" / "gpu_check.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules["gpu_check_under_test"]


def test_gpu_check_survives_a_missing_package(tmp_path, monkeypatch):
    """Issue 31 item 1: the device lacks ``gguf``. The run the device call makes (budget 420 s) still writes
    its JSON, runs offload rows and the moe part, and records the gguf part's failure instead of dying."""
    import sys

    gpu_check = _gpu_check_module()
    monkeypatch.setitem(sys.modules, "gguf", None)  # ``import gguf`` raises ImportError
    for name in [m for m in sys.modules if m.startswith("gguf.")]:
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "out"
    rc = gpu_check.main(["--device", "cpu", "--size", "tiny", "--budget-s", "420", "--steps", "1", "--out", str(out),
                         "--workdir", str(tmp_path / "work"), "--skip", "precision,placement",
                         "--rows", "dense-bf16-none,dense-bf16-block"])
    report = json.loads((out / "gpu-check.json").read_text())
    assert rc == 1 and not report["ok"] and not report["partial"]  # a part raised: FAIL, but a complete report
    assert "import of gguf" in report["gguf_error"] and "gguf" not in report
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"dense-bf16-none", "dense-bf16-block"}
    assert all("skipped" not in r and "error" not in r and r["frames_finite"] for r in rows.values())
    assert rows["dense-bf16-block"]["same_as"] == {"row": "dense-bf16-none", "equal": True}
    moe = report["moe"]  # the part after gguf ran
    assert moe["bit_identical_to_before"]["slices"] and all(moe["within_bound"].values())
    md = (out / "gpu-check.md").read_text()
    assert "Errors (the part raised; the run went on): gguf: " in md and "Result: FAIL" in md


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_budget_schedule_leaves_the_rows_a_window_after_the_build():
    """Issue 31 item 2: at the device call's budget (420 s), after the precision part (20 s) and the first
    run's package build (60 s), the offload rows still get their window (at least the floor, ending where
    the later parts' reservations begin), and each later part then starts when it takes its estimate."""
    gpu_check = _gpu_check_module()
    clock = FakeClock()
    sched = gpu_check.Schedule(420, clock=clock)
    clock.t += 20 + 60  # precision, package build
    later = ["placement", "gguf", "moe", "ring", "decode"]
    rows_end = sched.rows_deadline(later)
    assert rows_end - clock() >= gpu_check.ROWS_FLOOR_S > 0  # the dense-bf16 group (and more) is started
    assert rows_end <= sched.deadline - sum(gpu_check.PART_ESTIMATE_S[p] for p in later)
    clock.t = rows_end  # the rows used their whole window
    for part in later:
        assert sched.fits(part), part
        clock.t += gpu_check.PART_ESTIMATE_S[part]
    assert clock() <= sched.deadline
    # a late build: the floor holds (bounded by the budget), and what no longer fits is not started
    clock2 = FakeClock()
    late = gpu_check.Schedule(420, clock=clock2)
    clock2.t += 300
    end = late.rows_deadline(later)
    assert end == min(late.deadline, clock2() + gpu_check.ROWS_FLOOR_S)
    clock2.t = end
    assert not late.fits("gguf") and late.left() >= 0
    # the old reservations (gguf 120, moe 30, ring 120, decode 90) would have left the rows nothing at 80 s
    assert 420 - (120 + 30 + 120 + 90) < 80


def test_moe_verdict_does_not_require_bit_identity_of_grouped():
    """Issue 31 item 3: on sm90 cuBLAS may reduce in another order than the per-expert loop: grouped is judged
    by the bound against the fp64 product, its bit identity is reported only."""
    gpu_check = _gpu_check_module()
    moe = {"bit_identical_to_before": {"slices": True, "grouped": False}, "grouped_is_default": True,
           "vs_fp64": {"slices": {"rel_rms": 1e-3, "max_ulps": 1.0}, "grouped": {"rel_rms": 1.1e-3, "max_ulps": 1.5}}}
    moe["within_bound"] = {k: gpu_check.grouped_within_bound(v) for k, v in moe["vs_fp64"].items()}
    assert gpu_check.verdict({"moe": moe})
    moe["vs_fp64"]["grouped"] = {"rel_rms": 0.3, "max_ulps": 900.0}  # a wrong expert: O(1) errors
    moe["within_bound"] = {k: gpu_check.grouped_within_bound(v) for k, v in moe["vs_fp64"].items()}
    assert not gpu_check.verdict({"moe": moe})


def test_ring_part_runs_the_probe_without_and_with_pinned_homes():
    """Finding 10's catch: the ring part runs ``bench.ring_probe`` with pin budget 0 and with one that holds every
    home, and prints both (here one layer on the CPU fake device, homes pretend-pinned)."""
    gpu_check = _gpu_check_module()
    ring = gpu_check.ring_check(torch.device("cpu"), layers=1, height=64, width=96, frames=5, experts=16)
    staging, pinned = ring["staging"], ring["pinned_homes"]
    assert staging["pinned_gb"] == 0 and pinned["pinned_gb"] == gpu_check.RING_PINNED_GB
    assert staging["staging_bytes"] > 0 and staging["pinned_homes_bytes"] == 0
    assert pinned["pinned_units"] == pinned["units"] > 0 and pinned["staging_bytes"] == 0
    assert pinned["pinned_homes_bytes"] > pinned["block_bytes"]
    host_copy = ring["last_step"]["host_copy_s"]
    assert host_copy[0] > 0 and host_copy[1] == 0
    assert ring["last_step"]["wall_s"] == [staging["per_step"][-1]["wall_s"], pinned["per_step"][-1]["wall_s"]]
    assert ring["last_step_wall_ratio_computed"] > 0
    machine = {"device_name": "cpu", "torch": torch.__version__, "cuda": None, "python": "3", "tf32_matmul": False}
    md = gpu_check.markdown({"machine": machine, "size": "tiny", "date": "today", "ring": ring})
    assert "per pin budget; measured (pinning: pretend (CPU fake device))" in md
    assert f"| staging | 0 | 0 | {staging['staging_bytes'] / 2**20:.0f} | 0/{staging['units']} |" in md
    assert f"| pinned_homes | {gpu_check.RING_PINNED_GB} | {pinned['pinned_homes_bytes'] / 2**20:.0f} | 0 |" in md
    assert sum(line.startswith("| staging | ") for line in md.splitlines()) == 1 + len(staging["per_step"])
    assert "Last step, staging -> pinned homes (measured): wall_s" in md
    assert f"wall pinned homes / staging {ring['last_step_wall_ratio_computed']} (computed)" in md


class FakeSyncSource:
    """Stands for CUDA's sync-debug mode: ``sync()`` warns as torch does while the mode is "warn"."""

    def __init__(self):
        self.mode, self.modes = "default", []

    def set_mode(self, mode):
        self.mode = mode
        self.modes.append(mode)

    def sync(self):
        import warnings

        if self.mode == "warn":
            warnings.warn("called a synchronizing CUDA operation", UserWarning)


def test_gguf_syncs_are_counted_inside_the_dit_forward_on_its_thread_only():
    """gpu-review-4 finding 5: the GGUF row's "host syncs per step" counts what the DiT forward makes on the thread
    that runs it (3 per forward here), not the callback's or the solver's syncs between forwards, not a
    staging thread's syncs that happen during the forward, and not the forwards before counting starts."""
    import threading
    import warnings

    gpu_check = _gpu_check_module()
    source = FakeSyncSource()

    class Dit(torch.nn.Module):
        def forward(self, x):
            for _ in range(3):
                source.sync()
            worker = threading.Thread(target=source.sync)  # a staging thread's wait, inside the window
            worker.start()
            worker.join()
            warnings.warn("an unrelated warning")  # passed on, not counted
            return x

    dit = Dit()
    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        with gpu_check.ForwardSyncs(dit, source.set_mode) as syncs:
            syncs.counting = False
            dit(torch.zeros(1))  # step 1: not counted
            syncs.counting = True
            for _ in range(2):  # steps 2 and 3: forward, then the solver's and the callback's syncs
                dit(torch.zeros(1))
                source.set_mode("warn")  # as the old check left it: every sync between forwards would count
                source.sync()
                source.set_mode("default")
    assert syncs.count == 2 * 3
    assert [str(w.message) for w in others] == ["an unrelated warning"] * 3
    assert source.mode == "default" and dit._forward_pre_hooks == {} and dit._forward_hooks == {}


def test_decode_still_fits_when_a_row_group_overruns_the_rows_window_by_40_s():
    """gpu-review-4 finding 6: at the device call's budget a row group started just before the rows' deadline runs
    on (a moe-bf16 group, 30-60 s); with 40 s of overrun, the parts after the rows are started in order while
    they fit, and decode (the 1080p refine-decode answer) is among them: the last part gives way."""
    gpu_check = _gpu_check_module()
    clock = FakeClock()
    sched = gpu_check.Schedule(420, clock=clock)
    clock.t += 20 + 60  # precision, package build
    later = list(gpu_check.LATER_PARTS)
    clock.t = sched.rows_deadline(later) + 40  # the last group started at the deadline and ran 40 s over it
    ran = []
    for part in later:
        if sched.fits(part):
            ran.append(part)
            clock.t += gpu_check.PART_ESTIMATE_S[part]
    assert "decode" in ran and ran[-1] != "ring" and clock() <= sched.deadline, ran


def test_pinning_is_left_out_of_the_step_weighting():
    """gpu-review-4 finding 7: a block row's first run pays the pinning of the homes (before its first step): the
    one-off seconds and the 40-step projection leave it out; per step is unchanged."""
    gpu_check = _gpu_check_module()
    stamps = [10.0, 11.0, 12.0, 13.0]  # steps 1..4 end 1 s apart
    plain = gpu_check.step_weights(20.0, stamps, 4)
    pinned = gpu_check.step_weights(20.0 + 7.5, stamps, 4, pin_s=7.5)
    assert plain == {"per_step_s": 1.0, "fixed_s": 16.0, "projected_s": 56.0}
    assert pinned == plain


def test_distributed_part_at_world_size_one_cpu():
    """The multi-GPU part on the CPU (gloo; NCCL on the lent GPU): the collectives and an FSDP2 forward equal the
    unsplit results, the process group is left afterwards, and the verdict and Markdown carry it."""
    import torch.distributed as dist

    gpu_check = _gpu_check_module()
    result = gpu_check.distributed_check(torch.device("cpu"))
    assert result["ok"] and result["backend"] == "cpu:gloo" and result["world_size"] == 1
    assert not dist.is_initialized()
    machine = {"device_name": "cpu", "torch": torch.__version__, "cuda": None, "python": "3", "tf32_matmul": False}
    report = {"size": "tiny", "date": "today", "machine": machine, "distributed": result}
    assert gpu_check.verdict(report)
    assert "Distributed at world size 1 (cpu:gloo on cpu" in gpu_check.markdown(report)  # labelled "measured"
    assert not gpu_check.verdict({"distributed": dict(result, ok=False)})
