"""Starts: one rank of the parallel tests (torchrun runs two, from tests/parallel/test_parallel.py); runs every case of a JSON spec
with its plan on this rank, then the spec's command lines (``lingbot_core.cli.main``, which joins the same
process group and leaves it at the end). Rank 0 writes each case's frames (.npy); every rank writes what it
saw (.json): the weight bytes it holds, the tokens its first attention got, its steps, or the error raised."""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from lingbot_core import load_pipeline
from lingbot_core.parallel import ParallelPlan, init_distributed, local_parameter_bytes, parallelize, shutdown


def run_case(case: dict, out: Path) -> None:
    ctx = init_distributed(ParallelPlan(**case["plan"]), timeout_s=120)
    pipe = load_pipeline(case["package"], transformer_subfolder=case.get("subfolder", "transformer"), device=ctx.device)
    seen = {"steps": [], "attn_tokens": []}
    attn = pipe.transformer.blocks[0].attn
    attn.register_forward_pre_hook(lambda _m, args: seen["attn_tokens"].append(int(args[0].shape[1])))
    parallelize(pipe, ctx)
    kwargs = dict(case["kwargs"])
    for key in ("image", "frames"):
        if key in kwargs:
            kwargs[key] = torch.from_numpy(np.load(kwargs[key]))

    def callback(i, total, _x0):  # on every rank; the collective any_rank would hang if a rank skipped a step
        seen["steps"].append([i, total, ctx.any_rank(False)])

    try:
        if case["call"] == "refine":
            frames = pipe.refine(kwargs.pop("frames"), callback=callback, **kwargs)
        else:
            frames = pipe.generate(callback=callback, **kwargs)
    except ValueError as e:
        seen["error"] = str(e)
    else:
        if ctx.is_main:
            np.save(out / f"{case['name']}.npy", frames)
    seen.update(transformer=local_parameter_bytes(pipe.transformer), text_encoder=local_parameter_bytes(pipe.text_encoder))
    (out / f"{case['name']}.rank{ctx.rank}.json").write_text(json.dumps(seen))
    pipe.release()


def main(spec_path: str) -> int:
    from lingbot_core import cli

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    try:
        for case in spec["cases"]:
            run_case(case, Path(spec["out"]))
        for argv in spec["cli"]:
            code = cli.main(argv)
            if code:
                return code
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
