"""The worker pool's own costs (issue 49, ComfyUI side), on the CPU with 2 gloo ranks (CFG split), tiny dense package:
pool start, the round trip of a request that does nothing (``device_bytes`` on every rank), a short generate in
the workers vs in this process, each worker's RSS, this process's RSS before / after stop, and the time from
SIGKILL of a rank to the error.

``python -m bench.worker_pool [--steps 8] [--repeats 20] [--json out.json]``. The machine's load average is
printed with the figures: a start is mostly each rank importing torch / diffusers / transformers, which a
loaded machine slows down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rss_mib(pid="self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    sys.path[:0] = [str(REPO)]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from lingbot_core import load_pipeline
    from lingbot_core.parallel.workers import WorkerError, WorkerPool
    from lingbot_core.testing.fixtures import write_package

    torch.set_num_threads(1)
    out = {"load_average": os.getloadavg(), "cpus": os.cpu_count()}
    caption = '{"caption": "a red kite over a beach"}'
    run = dict(height=64, width=96, num_frames=5, seed=7, steps=args.steps, output_type="latent")
    with tempfile.TemporaryDirectory() as tmp:
        package = write_package(Path(tmp) / "lingbot-tiny-dense", fp32=True)
        out["parent_rss_before_mib"] = _rss_mib()
        pool = WorkerPool({"model_dir": str(package)}, ["cpu", "cpu"], {"cfg_degree": 2}, threads=1)
        began = time.monotonic()
        pool.start()
        out["start_s"] = time.monotonic() - began
        out["rank_load_s"] = [round(r["load_s"], 2) for r in pool.ready_info]
        trips = []
        for _ in range(args.repeats):
            began = time.monotonic()
            pool.call("device_bytes")
            trips.append(time.monotonic() - began)
        out["empty_request_ms_median"] = 1000 * statistics.median(trips)
        pool.call("generate", caption, **run)  # warm
        began = time.monotonic()
        pool.call("generate", caption, callback=lambda i, n, x0: None, **run)
        out["generate_workers_s"] = time.monotonic() - began
        out["worker_rss_mib"] = [round(r / 2 ** 20) for r in pool.rss]
        out["parent_rss_with_workers_mib"] = _rss_mib()
        single = load_pipeline(package, device="cpu")
        single.generate(caption, **run)
        began = time.monotonic()
        single.generate(caption, callback=lambda i, n, x0: None, **run)
        out["generate_one_process_s"] = time.monotonic() - began
        single.release()
        del single
        pids = pool.pids
        killed = []

        def kill(i, n, x0):
            if not killed:
                os.kill(pids[1], signal.SIGKILL)
                killed.append(time.monotonic())

        try:
            pool.call("generate", caption, callback=kill, **dict(run, steps=200))
        except WorkerError:
            out["kill_to_error_s"] = time.monotonic() - killed[0]
        pool.start()
        began = time.monotonic()
        pool.stop()
        out["stop_s"] = time.monotonic() - began
        out["workers_left"] = [p for p in pool.pids if Path(f"/proc/{p}").exists()]
        out["parent_rss_after_stop_mib"] = _rss_mib()
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
