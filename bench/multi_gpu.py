"""One generation on 1 vs 2 ranks (issue 49), measured on the CPU with gloo: per-rank peak RSS (VmHWM), the
DiT weight bytes each rank holds, and the median step time, for CFG parallel 2, context parallel 2 and context
parallel 2 + FSDP, as ratios to the 1-rank run.

``python -m bench.multi_gpu [--hidden 512] [--depth 4] [--frames 17] [--json out.json]``. Every run is its own
torchrun launch (``--nproc_per_node`` 1 or 2, one thread per rank, so 2 ranks have twice the cores of 1), on a
random-weight fp32 package whose DiT is ``--hidden`` wide and ``--depth`` deep. On GPUs the same flags split a
real model (docs/multi-gpu.md has the reference's 8-GPU table); here the figures show the split's shape: CFG and
context parallel cut the step time, FSDP halves the DiT bytes per rank. Peak RSS includes the whole model as
loaded before it is sharded, and about 1 GiB of torch and libraries per process: the DiT's share shows in the
resident size after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLANS = {"1 rank": {}, "cfg 2": {"cfg_degree": 2}, "context 2": {"context_degree": 2},
         "context 2 + FSDP": {"context_degree": 2, "fsdp": True, "fsdp_text_encoder": True}}
TIMEOUT = 900


def _status_mib(field: str) -> float:
    """``VmHWM`` (peak resident) or ``VmRSS`` (resident now) of this process, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(spec: dict) -> None:
    """One rank: load, split (when the plan has 2 ranks), generate; write this rank's figures."""
    import torch

    from lingbot_core import load_pipeline
    from lingbot_core.parallel import ParallelPlan, init_distributed, local_parameter_bytes, parallelize, shutdown

    torch.set_num_threads(1)
    plan = ParallelPlan(**spec["plan"])
    ctx = init_distributed(plan) if plan.world_size > 1 else None
    pipe = load_pipeline(spec["package"], device="cpu")
    if ctx is not None:
        parallelize(pipe, ctx)
    stamps = []
    pipe.generate("a cat", height=spec["height"], width=spec["width"], num_frames=spec["frames"], steps=spec["steps"],
                  seed=0, callback=lambda i, n, x0: stamps.append(time.perf_counter()))
    rank = 0 if ctx is None else ctx.rank
    step_s = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    result = {"rank": rank, "vm_hwm_mib": _status_mib("VmHWM"), "vm_rss_after_mib": _status_mib("VmRSS"), "dit_mib": local_parameter_bytes(pipe.transformer) / 2 ** 20,
              "text_encoder_mib": local_parameter_bytes(pipe.text_encoder) / 2 ** 20, "step_s": step_s}
    Path(spec["out"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))
    shutdown()


def _launch(name: str, plan: dict, package: Path, args, tmp: Path) -> list:
    ranks = max(1, plan.get("cfg_degree", 1) * plan.get("context_degree", 1))
    out = tmp / name.replace(" ", "_").replace("+", "")
    spec = dict(plan=plan, package=str(package), height=args.height, width=args.width, frames=args.frames,
                steps=args.steps, out=str(out))
    spec_path = out.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--standalone",
           "-m", "bench.multi_gpu", "--worker", str(spec_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(ranks)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return 0

    from lingbot_core.testing.fixtures import write_package

    with tempfile.TemporaryDirectory() as tmp:
        dit = {"hidden_size": args.hidden, "num_attention_heads": 4, "axes_dims": [args.hidden // 16, args.hidden // 32 * 3,
               args.hidden // 32 * 3], "depth": args.depth, "intermediate_size": 4 * args.hidden}
        package = write_package(Path(tmp) / "pkg", fp32=True, refiner=False, dit=dit)
        results = {name: _launch(name, plan, package, args, Path(tmp)) for name, plan in PLANS.items()}
    one = results["1 rank"][0]
    rows = []
    print(f"DiT {args.hidden} wide, {args.depth} blocks (fp32, {one['dit_mib']:.1f} MiB); {args.frames} frames at "
          f"{args.height}x{args.width}, {args.steps} steps; CPU, gloo, one thread per rank\n")
    print("| plan | ranks | peak RSS / rank MiB | x 1 rank | RSS after / rank MiB | DiT MiB / rank | x 1 rank | step s | x 1 rank |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, ranks in results.items():
        rss = max(r["vm_hwm_mib"] for r in ranks)
        after = max(r["vm_rss_after_mib"] for r in ranks)
        dit_mib = max(r["dit_mib"] for r in ranks)
        step = max(r["step_s"] for r in ranks)
        row = {"plan": name, "ranks": len(ranks), "peak_rss_mib": rss, "rss_ratio": rss / one["vm_hwm_mib"], "rss_after_mib": after,
               "dit_mib": dit_mib, "dit_ratio": dit_mib / one["dit_mib"], "step_s": step, "step_ratio": step / one["step_s"],
               "per_rank": ranks}
        rows.append(row)
        print(f"| {name} | {len(ranks)} | {rss:.0f} | {row['rss_ratio']:.2f} | {after:.0f} | {dit_mib:.1f} | {row['dit_ratio']:.2f} | "
              f"{step:.3f} | {row['step_ratio']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
