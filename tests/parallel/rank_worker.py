"""One rank of the parallel tests (started by torchrun from test_parallel.py): runs every case of a JSON spec
with its plan, on this rank; rank 0 writes each case's frames (.npy) and every rank its weight bytes (.json)."""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from lingbot_core import load_pipeline
from lingbot_core.parallel import ParallelPlan, init_distributed, local_parameter_bytes, parallelize, shutdown


def run_case(case: dict, out: Path, steps_seen: list) -> None:
    plan = ParallelPlan(**case["plan"])
    ctx = init_distributed(plan, timeout_s=120)
    pipe = load_pipeline(case["package"], transformer_subfolder=case.get("subfolder", "transformer"), device=ctx.device)
    parallelize(pipe, ctx)
    kwargs = dict(case["kwargs"])
    for key in ("image", "frames"):
        if key in kwargs:
            kwargs[key] = torch.from_numpy(np.load(kwargs[key]))

    def callback(i, total, _x0):  # every rank, every step: recorded so the test sees the same steps everywhere
        steps_seen.append([case["name"], i, total, ctx.any_rank(False)])

    if case["call"] == "refine":
        frames = pipe.refine(kwargs.pop("frames"), callback=callback, **kwargs)
    else:
        frames = pipe.generate(callback=callback, **kwargs)
    sizes = {"transformer": local_parameter_bytes(pipe.transformer), "text_encoder": local_parameter_bytes(pipe.text_encoder)}
    (out / f"{case['name']}.rank{ctx.rank}.json").write_text(json.dumps(sizes))
    if ctx.is_main:
        np.save(out / f"{case['name']}.npy", frames)
    pipe.release()


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    torch.set_num_threads(1)
    steps_seen: list = []
    try:
        for case in spec["cases"]:
            run_case(case, out, steps_seen)
        import torch.distributed as dist
        (out / f"steps.rank{dist.get_rank()}.json").write_text(json.dumps(steps_seen))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
