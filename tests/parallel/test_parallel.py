"""One generation split across 2 CPU processes (gloo): CFG parallel, Ulysses context parallel and FSDP2 give the
single-process frames (tiny fp32 packages; the MoE within its reference bar), FSDP keeps about half the weights
per rank, every rank sees the same steps, and the command line under torchrun writes the 1-process frames.

All distributed work runs in ONE torchrun launch (tests/support/parallel_ranks.py) shared by the module: two
processes importing torch/diffusers/transformers dominate the cost.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lingbot_core import load_pipeline
from lingbot_core.cli import main as cli_main
from lingbot_core.parallel import ParallelPlan, local_parameter_bytes

from support.child_runs import REPO, TESTS

H, W, F = 64, 96, 5
BASE = dict(prompt="a cat", height=H, width=W, num_frames=F, steps=2, seed=0)
REFINE = dict(prompt="a cat", height=64, width=128, steps=3, seed=0, tile_size=[32, 32], tile_stride=[24, 24])
PLANS = {"cfg": dict(cfg_degree=2), "cp": dict(context_degree=2),
         "fsdp": dict(cfg_degree=2, fsdp=True, fsdp_text_encoder=True)}  # the CLI case runs context 2 + FSDP
EXACT = 1e-5  # fp32 on one CPU: only the split matmuls may round differently
MOE_REL_RMS, MOE_MAX = 5e-3, 5e-2  # the MoE bars of the reference vectors (tests/sampling/test_dmd_student.py)
CLI = ["generate", "--prompt", "a cat", "--height", "64", "--width", "96", "--num_frames", "5", "--steps", "2",
       "--seed", "3", "--run_refiner", "--refiner_height", "64", "--refiner_width", "128", "--refiner_steps", "2"]
CLI_ONE = dict(generate=dict(BASE, seed=3), refine=dict(prompt="a cat", height=64, width=128, steps=2, seed=3))
CLI_PARALLEL = ["--context_parallel_degree", "2", "--enable_fsdp_inference", "--enable_vlm_fsdp_inference"]
TIMEOUT = 420


def _cases(packages, out: Path) -> list:
    cases = []
    for name, plan in PLANS.items():
        cases += [
            dict(name=f"{name}_t2v", plan=plan, package=str(packages["dense"]), call="generate", kwargs=BASE),
            dict(name=f"{name}_ti2v", plan=plan, package=str(packages["dense"]), call="generate",
                 kwargs=dict(BASE, image=str(out / "image.npy"))),
            dict(name=f"{name}_refine", plan=plan, package=str(packages["dense"]), subfolder="refiner", call="refine",
                 kwargs=dict(REFINE, frames=str(out / "frames.npy"))),
        ]
    cases.append(dict(name="moe_cfg_cp", plan=dict(context_degree=2), package=str(packages["moe"]), call="generate",
                      kwargs=BASE))
    cases.append(dict(name="fsdp_step_cache", plan=PLANS["fsdp"], package=str(packages["dense"]), call="generate",
                      kwargs=dict(BASE, step_cache=0.1)))
    return cases


@pytest.fixture(scope="module")
def runs(packages, tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    g = torch.Generator().manual_seed(5)
    np.save(out / "image.npy", torch.rand(70, 100, 3, generator=g).numpy())
    np.save(out / "frames.npy", torch.rand(5, 48, 80, 3, generator=g).numpy())
    cli = [CLI + ["--model_dir", str(packages["dense"]), "--output", str(out / "cli_2.npy")] + CLI_PARALLEL]
    spec = dict(out=str(out), cases=_cases(packages, out), cli=cli)
    (out / "spec.json").write_text(json.dumps(spec))
    path = os.pathsep.join([str(TESTS), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(TESTS / "support" / "parallel_ranks.py"), str(out / "spec.json")]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def single(packages, runs):
    """The same calls in this one process (no process group): the numbers to match."""
    image = torch.from_numpy(np.load(runs / "image.npy"))
    frames = torch.from_numpy(np.load(runs / "frames.npy"))
    dense = load_pipeline(packages["dense"], device="cpu")
    refiner = load_pipeline(packages["dense"], transformer_subfolder="refiner", device="cpu")
    moe = load_pipeline(packages["moe"], device="cpu")
    cli_base = dense.generate(**CLI_ONE["generate"])  # what the command line's flags ask for, in one process
    result = {"t2v": dense.generate(**BASE), "ti2v": dense.generate(image=image, **BASE),
              "refine": refiner.refine(frames, **REFINE), "moe": moe.generate(**BASE),
              "cli": cli_base, "cli_refined": refiner.refine(cli_base, **CLI_ONE["refine"]),
              "bytes": {"transformer": local_parameter_bytes(dense.transformer),
                        "text_encoder": local_parameter_bytes(dense.text_encoder)}}
    for pipe in (dense, refiner, moe):
        pipe.release()
    return result


def _seen(runs: Path, name: str) -> list:
    return [json.loads((runs / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("mode", ["t2v", "ti2v", "refine"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_split_generation_gives_single_process_frames(runs, single, plan, mode):
    got = np.load(runs / f"{plan}_{mode}.npy")
    assert got.shape == single[mode].shape and got.dtype == np.float32
    assert float(np.abs(got - single[mode]).max()) <= EXACT


def test_moe_context_parallel_within_the_moe_bar(runs, single):
    got, ref = np.load(runs / "moe_cfg_cp.npy"), single["moe"]
    rel = float(np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean()))
    assert rel <= MOE_REL_RMS and float(np.abs(got - ref).max()) <= MOE_MAX


def test_context_parallel_splits_the_tokens(runs):
    """Each context rank's attention gets its part of the joint sequence; CFG rank 0 (the cond branch, which a
    context rank also runs first) gets all of it."""
    whole = _seen(runs, "cfg_t2v")[0]["attn_tokens"][0]
    parts = [seen["attn_tokens"][0] for seen in _seen(runs, "cp_t2v")]
    assert sum(parts) == whole and max(parts) - min(parts) <= 1, (parts, whole)


def test_fsdp_holds_about_half_the_weights_per_rank(runs, single):
    full = single["bytes"]
    for seen in _seen(runs, "fsdp_t2v"):
        for part in ("transformer", "text_encoder"):
            assert 0.45 <= seen[part] / full[part] <= 0.55, (part, seen[part], full[part])
    for seen in _seen(runs, "cfg_t2v"):  # no FSDP: every rank holds all of it
        assert seen["transformer"] == full["transformer"] and seen["text_encoder"] == full["text_encoder"]


def test_callbacks_run_on_every_rank_at_the_same_steps(runs):
    for name in ("cfg_t2v", "cp_refine", "fsdp_ti2v"):
        rank0, rank1 = (seen["steps"] for seen in _seen(runs, name))
        assert rank0 == rank1 and [s[0] for s in rank0] == list(range(rank0[0][1]))


def test_step_cache_with_fsdp_is_refused_on_every_rank(runs):
    for seen in _seen(runs, "fsdp_step_cache"):
        assert "step_cache does not combine with FSDP" in seen["error"]
    assert not (runs / "fsdp_step_cache.npy").exists()


def test_cli_under_torchrun_writes_the_one_process_frames(runs, single):
    """``generate --run_refiner`` with context 2 + DiT FSDP + text-encoder FSDP on 2 ranks: rank 0 wrote both
    passes' float32 frames, equal to one process's run of the same settings."""
    for name, shape in (("cli", (5, 64, 96, 3)), ("cli_refined", (5, 64, 128, 3))):
        got = np.load(runs / f"{name.replace('cli', 'cli_2')}.npy")
        assert got.shape == shape and got.dtype == np.float32
        assert float(np.abs(got - single[name]).max()) <= EXACT


@pytest.mark.parametrize("make, message", [
    (lambda: ParallelPlan(cfg_degree=3), "cfg_parallel_degree=3 is not allowed: use 1 or 2"),
    (lambda: ParallelPlan(context_degree=0), "context_parallel_degree=0 is not allowed"),
    (lambda: ParallelPlan(cfg_degree=2, context_degree=2).check(world_size=2),
     "cfg_parallel_degree 2 x context_parallel_degree 2 needs 4 processes, but 2 were launched"),
    (lambda: ParallelPlan(context_degree=3).check(heads=2), "does not divide the DiT's 2 attention heads (2 % 3 = 2)"),
    (lambda: ParallelPlan(context_degree=2).check(offload="model"), "offload 'model' does not combine"),
    (lambda: ParallelPlan(fsdp=True), "cfg 1 x context 1 is one rank"),
    (lambda: ParallelPlan(cfg_degree=2, context_degree=4).check(device_count=4), "needs 8 devices (one per rank) but 4"),
])
def test_bad_plans_are_refused_with_their_numbers(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_cfg_only_plan_allows_every_offload_mode():
    for mode in ("none", "model", "sequential", "block"):
        ParallelPlan(cfg_degree=2).check(world_size=2, offload=mode)


def test_cli_refuses_degrees_that_do_not_match_the_launch(packages, capsys):
    """One process (no torchrun) asked for 2 ranks: a clean error naming the numbers, no hang."""
    code = cli_main(CLI + ["--model_dir", str(packages["dense"]), "--cfg_parallel_degree", "2"])
    assert code == 2
    assert "needs 2 processes, but 1 were launched" in capsys.readouterr().err
