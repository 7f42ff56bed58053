"""The worker pool (lingbot_core.parallel.workers) on the CPU: 2 gloo ranks splitting CFG, the tiny dense package.

One pool serves the module (a start imports torch, diffusers and transformers in each rank: seconds of CPU);
the kill test restarts it, as a host does on the next prompt. Processes are found by scanning /proc for
children of this process, not through the pool's own bookkeeping."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import torch

from lingbot_core.parallel.workers import (
    SHARE_BYTES, DevicesBusyError, WorkerError, WorkerPool, claim_devices, release_devices,
)
from support.worker_processes import alive, worker_pids as children_running_workers

PLAN = {"cfg_degree": 2, "context_degree": 1, "fsdp": False, "fsdp_text_encoder": False}
CAPTION = '{"caption": "a red kite over a beach"}'
RUN = dict(height=64, width=96, num_frames=5, seed=7, output_type="latent")


def worker_pids() -> set:
    return children_running_workers(os.getpid())


@pytest.fixture(scope="module")
def pool(packages):
    pool = WorkerPool({"model_dir": str(packages["dense"])}, ["cpu", "cpu"], PLAN, label="tiny dense",
                      start_timeout_s=300, collective_timeout_s=60, error_grace_s=5, threads=1)
    started = time.monotonic()
    pool.start()
    pool.start_s = time.monotonic() - started
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def single(packages):
    from lingbot_core import load_pipeline

    pipe = load_pipeline(packages["dense"], device="cpu")
    yield pipe
    pipe.release()


def test_two_ranks_give_the_single_process_latent_and_forward_every_step(pool, single):
    assert worker_pids() == set(pool.pids) and len(pool.pids) == 2
    steps = []
    latent = pool.call("generate", CAPTION, steps=3, callback=lambda i, n, x0: steps.append((i, n, tuple(x0.shape))), **RUN)
    expected = single.generate(CAPTION, steps=3, **RUN)
    assert latent.shape == expected.shape == (1, 16, 2, 8, 12)
    assert (latent - expected).abs().max().item() <= 1e-5
    assert steps == [(i, 3, (1, 16, 2, 8, 12)) for i in range(3)]
    print(f"\npool start {pool.start_s:.1f} s; worker RSS after a request "
          f"{[round(r / 2 ** 20) for r in pool.rss]} MiB")


def test_large_tensors_cross_as_files_both_ways_and_none_is_left(pool, single):
    """A 3 MiB image in, a 2.7 MiB decode out: above SHARE_BYTES, so both cross as files."""
    image = torch.rand(512, 512, 3, generator=torch.Generator().manual_seed(3))
    cond = pool.call("encode_image", image, 128, 192)
    expected = single.encode_image(image, 128, 192)
    assert torch.equal(cond.pixels, expected.pixels)
    assert (cond.posterior.moments - expected.posterior.moments).abs().max().item() <= 1e-5
    latent = torch.randn(1, 16, 3, 16, 24, generator=torch.Generator().manual_seed(4))
    frames = pool.call("decode", latent)
    reference = single.decode(latent)
    assert frames.shape == reference.shape == (9, 128, 192, 3) and frames.numel() * 4 > SHARE_BYTES
    assert (frames - reference).abs().max().item() <= 1e-5
    assert sorted(os.listdir(pool._dir)) == ["cancel"]


def test_cancel_stops_every_rank_and_the_next_request_runs(pool, single):
    class Cancel(Exception):
        pass

    seen = []

    def cancel_at_1(i, n, x0):
        seen.append(i)
        if i == 1:
            raise Cancel("stop")

    pids = pool.pids
    with pytest.raises(Cancel):
        pool.call("generate", CAPTION, steps=40, callback=cancel_at_1, **RUN)
    assert seen == [0, 1]
    # Rank 0 stopped within a step or two of the cancel, not at the end of the 40 steps.
    assert 2 <= pool.steps_run <= 4, pool.steps_run
    # Both ranks left the run at the same step: the same processes run the next request's collectives.
    assert pool.pids == pids and all(alive(p) for p in pids)
    latent = pool.call("generate", CAPTION, steps=2, **RUN)
    assert (latent - single.generate(CAPTION, steps=2, **RUN)).abs().max().item() <= 1e-5


def test_bad_input_is_the_single_process_error_and_the_pool_stays(pool, single):
    with pytest.raises(ValueError) as local:
        single.generate(CAPTION, steps=2, guidance_scale=-1.0, **RUN)
    pids = pool.pids
    with pytest.raises(ValueError) as remote:
        pool.call("generate", CAPTION, steps=2, guidance_scale=-1.0, **RUN)
    assert str(remote.value) == str(local.value)
    assert pool.pids == pids and all(alive(p) for p in pids)


def test_a_killed_rank_is_one_error_within_seconds_no_orphan_and_the_pool_restarts(pool, single):
    victim, other = pool.pids[1], pool.pids[0]
    killed = []

    def kill_rank_1(i, n, x0):
        if not killed:
            os.kill(victim, signal.SIGKILL)
            killed.append(time.monotonic())

    with pytest.raises(WorkerError) as error:
        pool.call("generate", CAPTION, steps=200, callback=kill_rank_1, **RUN)
    to_error = time.monotonic() - killed[0]
    message = str(error.value)
    assert f"rank 1 (cpu, pid {victim}) was killed by signal SIGKILL" in message, message
    assert "Traceback" not in message
    assert to_error < 10, to_error
    assert not alive(victim) and not alive(other) and worker_pids() == set()
    print(f"\nerror {to_error:.2f} s after the kill")
    # The next request starts fresh ranks and runs.
    latent = pool.call("generate", CAPTION, steps=2, **RUN)
    assert len(set(pool.pids) - {victim, other}) == 2 and worker_pids() == set(pool.pids)
    assert (latent - single.generate(CAPTION, steps=2, **RUN)).abs().max().item() <= 1e-5


def test_stop_leaves_no_process_and_no_file(pool):
    pool.call("generate", CAPTION, steps=1, **RUN)  # running (restarted by the previous test when run alone)
    folder = pool._dir
    assert Path(folder).is_dir() and worker_pids()
    pool.stop()
    assert worker_pids() == set() and not Path(folder).exists()


def test_a_cancel_while_the_workers_load_stops_them(packages):
    class Cancel(Exception):
        pass

    began = time.monotonic()

    def interrupt():
        if time.monotonic() - began > 0.5:
            raise Cancel()

    pool = WorkerPool({"model_dir": str(packages["dense"])}, ["cpu", "cpu"], PLAN, threads=1)
    with pytest.raises(Cancel):
        pool.start(interrupt)
    assert time.monotonic() - began < 5
    assert worker_pids() == set() and not pool.running


def test_the_same_gpu_for_two_pools_is_refused_naming_the_holder():
    claim_devices(["cuda:0", "cuda:1"], "dense (transformer)")
    try:
        with pytest.raises(DevicesBusyError, match=r"cuda:1 is held by the worker processes of 'dense \(transformer\)'"):
            claim_devices(["cuda:1", "cuda:2"], "moe (refiner)")
        claim_devices(["cuda:2"], "moe (refiner)")  # another GPU is free
        claim_devices(["cuda:0"], "dense (transformer)")  # the holder itself may ask again
    finally:
        release_devices(["cuda:0", "cuda:1"], "dense (transformer)")
        release_devices(["cuda:2"], "moe (refiner)")
    claim_devices(["cuda:1"], "moe (refiner)")  # released: free again
    release_devices(["cuda:1"], "moe (refiner)")


def test_workers_exit_when_their_parent_is_killed(tmp_path, packages):
    """The parent (a stand-in for ComfyUI) dies by SIGKILL while its worker is busy sampling (1000 steps, none
    sent back, so no failed send ends it): the worker exits at once, not when its run ends."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal, sys, threading
        from lingbot_core.parallel.workers import WorkerPool
        pool = WorkerPool({{"model_dir": {str(packages["dense"])!r}}}, ["cpu"], {{"cfg_degree": 1}}, threads=1,
                          start_timeout_s=300)
        pool.start()
        print(json.dumps([pool.pids, pool._dir]), flush=True)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        pool.call("generate", {CAPTION!r}, steps=1000, height=64, width=96, num_frames=21)
    """))
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:  # a file, not a pipe: the worker inherits it, and run() must not wait for it
        proc = subprocess.run([sys.executable, str(script)], stdout=sink, stderr=subprocess.STDOUT, timeout=300, env=env)
    log = out.read_text()
    assert proc.returncode == -signal.SIGKILL, log[-3000:]
    (pid,), folder = json.loads([line for line in log.splitlines() if line.startswith("[")][-1])
    deadline = time.monotonic() + 3
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the worker outlived its parent"
    assert not Path(folder).exists()  # the dead parent's private folder went with its workers


def test_gpu_choices_resolve_to_devices_or_say_what_is_wrong():
    from lingbot_core.parallel.plan import ParallelPlan
    from lingbot_core.parallel.remote_pipeline import WorkerSetup, resolve_devices

    assert resolve_devices("all", 4, False) == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert resolve_devices("2", 4, False) == ("cuda:0", "cuda:1")
    assert resolve_devices("0, cuda:3", 4, False) == ("cuda:0", "cuda:3")
    assert resolve_devices("2", 0, True) == ("cpu", "cpu")
    with pytest.raises(ValueError, match=r"asks for 4 GPU\(s\), but this machine has 2 \(cuda:0..cuda:1\)"):
        resolve_devices("4", 2, False)
    with pytest.raises(ValueError, match=r"asks for 2 GPU\(s\) \(index 5\), but this machine has 4"):
        resolve_devices("1,5", 4, False)
    with pytest.raises(ValueError, match="names a GPU twice"):
        resolve_devices("1,1", 4, False)
    with pytest.raises(ValueError, match="no CUDA GPU is present"):
        resolve_devices("2", 0, False)
    with pytest.raises(ValueError, match="only a number of CPU worker processes"):
        resolve_devices("0,1", 0, True)
    with pytest.raises(ValueError, match=r"needs 4 GPU\(s\), one per rank, but 2 were chosen"):
        WorkerSetup.create(ParallelPlan(2, 2), ("cuda:0", "cuda:1"))
