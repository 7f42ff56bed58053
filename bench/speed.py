"""Speed levers on the CPU: lockstep weight traffic, block compile, step-cache skip counts.

    python -m bench.speed --json /tmp/speed.json          # all three parts (run under the heavy-job lock)
    python -m bench.speed --parts lockstep,cache          # skip the compile part
    python -m bench.speed --parts device --package PKG --device cuda   # the gpu-check rows (seed workload)

- ``lockstep``: weight bytes copied to the device per denoising step, sequential CFG vs lockstep,
  measured with the residency tracker (tests/support/residency.py) on a 6-block tiny dense package under
  offload ``block`` (K = 0 and 2) and ``sequential``, and computed for the full-size dense and MoE
  configs from their module sizes (built on ``meta``: block = streamed blocks once per branch vs
  once per step; sequential adds the per-branch text embedding and output projection);
- ``compile``: one lockstep CFG forward of a mid-size dense DiT (fp32) eager vs ``compile_blocks``,
  after warm-up; median of ``--repeats``; plus the first (compiling) call's time and the max
  difference;
- ``cache``: a 40-step TI2V-less T2V run of the tiny dense package at step_cache 0, 0.05, 0.1, 0.2:
  computed / skipped DiT forwards, time ratio and mean frame difference to the uncached run (random
  weights: the difference says nothing about quality);
- ``device`` (not in the default parts): the gpu-check rows on one TI2V workload (default the seed
  workload, 192x320 x 49 frames, 40 steps, bf16 on CUDA): plain, flash_attn, sage, compile (first and
  second run), block K=0 with lockstep off / on, step cache 0.05 / 0.1; time and peak-VRAM ratios to
  the plain run and the max |frame diff| against it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MOE_DIMS = {  # the MoE 30B-A3B config (as bench/memory.py), 48 blocks
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "n_group": 4, "topk_group": 2,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "score_func": "sigmoid", "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "axes_lens": [4096, 512, 512], "depth": 48,
}


def log(msg: str) -> None:
    print(f"[bench.speed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _nbytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.parameters())


def lockstep_part(workdir: Path) -> dict:
    import torch

    sys.path.insert(0, str(REPO / "tests"))
    from support.residency import ResidencyTracker

    from lingbot_core import load_pipeline
    from lingbot_core.testing.fixtures import dit_config, write_dit, write_package
    from lingbot_core.sampling.scheduling import shifted_sigmas
    from lingbot_core.model.transformer import LingBotVideoTransformer3DModel

    root = write_package(workdir / "lingbot-tiny-deep", fp32=True, refiner=False, seed=5)
    write_dit(root / "transformer", {**dit_config(False), "depth": 6}, seed=5, fp32=True)
    measured = {}
    for label, kwargs in (("block K=0", dict(offload="block")), ("block K=2", dict(offload="block", blocks_on_gpu=2)),
                          ("sequential", dict(offload="sequential"))):
        pipe = load_pipeline(root, device="cpu", **kwargs)
        embeds = pipe.encode_prompt("a cat", num_frames=5)
        noise = torch.randn(1, 16, 2, 8, 12, generator=torch.Generator().manual_seed(0))
        row = {}
        for lockstep in (False, True):
            pipe.set_speed(cfg_lockstep=lockstep)
            moved = []
            for steps in (2, 3):
                with ResidencyTracker(pipe) as tr:
                    pipe.denoise(embeds, noise, sigmas=shifted_sigmas(steps, 3.0))
                moved.append(tr.bytes_moved)
            row["lockstep" if lockstep else "sequential_cfg"] = moved[1] - moved[0]
        row["ratio"] = round(row["lockstep"] / row["sequential_cfg"], 4)
        measured[label] = row
        pipe.release()
        log(f"lockstep {label}: {row}")
    full = {}
    for label, cfg in (("dense 1.3B", {}), ("MoE 30B-A3B", MOE_DIMS)):
        with torch.device("meta"):
            dit = LingBotVideoTransformer3DModel(**cfg).to(torch.bfloat16)
        whole, per_branch = _nbytes(dit), _nbytes(dit.text_embedder) + _nbytes(dit.proj_out)
        full[label] = {"dit_gb_bf16": round(whole / 1e9, 2), "block_ratio": 0.5,
                       "sequential_ratio": round((whole + per_branch) / (2 * whole), 4)}
    return {"tiny_measured": measured, "full_size_computed": full}


def compile_part(repeats: int) -> dict:
    import torch

    from lingbot_core.model.block_compile import compile_blocks
    from lingbot_core.model.transformer import LingBotVideoTransformer3DModel

    torch.manual_seed(0)
    cfg = dict(hidden_size=512, num_attention_heads=4, depth=4, intermediate_size=1536, text_dim=256, freq_dim=64,
               axes_dims=(32, 48, 48))
    dit = LingBotVideoTransformer3DModel(**cfg).eval()
    with torch.no_grad():
        for name, p in dit.named_parameters():
            parts = name.split(".")
            p.normal_(1.0 if len(parts) >= 2 and parts[-2].startswith("norm") else 0.0, 0.02)
    latent = torch.randn(1, 16, 3, 16, 24)  # 3 x 8 x 12 = 288 video tokens
    texts = [torch.randn(1, 40, 256), torch.randn(1, 120, 256)]
    t = torch.tensor([500.0])

    def forward():
        with torch.no_grad():
            return dit(latent, t, texts)

    def timed():
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            forward()
            out.append(time.perf_counter() - start)
        return statistics.median(out)

    eager_out = forward()
    eager = timed()
    compile_blocks(dit)
    start = time.perf_counter()
    compiled_out = forward()
    first = time.perf_counter() - start
    compiled = timed()
    diff = max((a - b).abs().max().item() for a, b in zip(eager_out, compiled_out))
    row = {"tokens": [3 * 8 * 12 + 40, 3 * 8 * 12 + 120], "eager_s": round(eager, 4), "compiled_s": round(compiled, 4),
           "speedup": round(eager / compiled, 3), "first_compiled_call_s": round(first, 1), "max_abs_diff": diff,
           "threads": torch.get_num_threads()}
    log(f"compile: {row}")
    return row


def cache_part(workdir: Path) -> dict:
    import re

    import numpy as np

    from lingbot_core import load_pipeline
    from lingbot_core.testing.fixtures import write_package

    root = write_package(workdir / "lingbot-tiny-dense", fp32=True, refiner=False)
    pipe = load_pipeline(root, device="cpu")
    run = dict(height=64, width=96, num_frames=9, steps=40, seed=3)
    rows, base = {}, None
    for threshold in (0.0, 0.05, 0.1, 0.2):
        lines = []

        def callback(i, total, x0):
            pass

        callback.status = lines.append  # the step cache's counts after each step
        start = time.perf_counter()
        frames = pipe.generate("a cat walks on a wall", step_cache=threshold, callback=callback, **run)
        seconds = time.perf_counter() - start
        if base is None:
            base = (frames, seconds)
        found = re.search(r"(\d+) of (\d+) DiT forwards computed, (\d+) skipped", lines[-1]) if lines else None
        computed, skipped = (int(found.group(1)), int(found.group(3))) if found else (2 * run["steps"], 0)
        rows[str(threshold)] = {"computed": computed, "skipped": skipped, "time_ratio": round(seconds / base[1], 3),
                                "mean_abs_frame_diff": float(np.abs(frames - base[0]).mean())}
        log(f"cache {threshold}: {rows[str(threshold)]}")
    pipe.release()
    return {"workload": run, "rows": rows}


def device_rows(package: str, device: str, steps: int, height: int, width: int, frames: int) -> list:
    """The gpu-check rows: every lever on one TI2V workload, as ratios to the plain run (offload none,
    sdpa, no compile, lockstep on, no cache) in this process, with the max |frame diff| against it.
    Kernels whose package is missing are reported as skipped with the reason."""
    import re

    import numpy as np
    import torch

    from lingbot_core import load_pipeline
    from lingbot_core.model.attention import diffusers_backend

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dtypes = {"transformer": "bf16", "text_encoder": "bf16"} if cuda else None
    pipe = load_pipeline(package, device=device, dtypes=dtypes)
    g = torch.Generator().manual_seed(0)
    image = torch.rand(height, width, 3, generator=g)
    run = dict(image=image, height=height, width=width, num_frames=frames, steps=steps, seed=42)

    def measure(label, offload="none", step_cache=0.0, **speed):
        pipe.set_offload(offload)
        pipe.set_speed(**{"attention": "sdpa", "compile_blocks": False, "cfg_lockstep": True, **speed})
        lines = []

        def callback(i, total, x0):
            pass

        callback.status = lines.append
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = pipe.generate("A red fox trots through fresh snow.", callback=callback, step_cache=step_cache, **run)
        if cuda:
            torch.cuda.synchronize()
        row = {"row": label, "seconds": round(time.perf_counter() - start, 2),
               "peak_vram_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
        found = re.search(r"(\d+) of (\d+) DiT forwards computed, (\d+) skipped", lines[-1]) if lines else None
        if found:
            row["computed"], row["skipped"] = int(found.group(1)), int(found.group(3))
        log(f"device row {row}")
        return row, out

    base, base_frames = measure("plain (none, sdpa)")
    rows = [base]
    plan = [("attention flash_attn", dict(attention="flash_attn")), ("attention sage", dict(attention="sage")),
            ("compile_blocks (first run, compiles)", dict(compile_blocks=True)),
            ("compile_blocks (second run)", dict(compile_blocks=True)),
            ("block K=0, lockstep off", dict(offload="block", cfg_lockstep=False)),
            ("block K=0, lockstep on", dict(offload="block")),
            ("step_cache 0.05", dict(step_cache=0.05)), ("step_cache 0.1", dict(step_cache=0.1))]
    for label, kwargs in plan:
        if "attention" in kwargs:
            try:
                diffusers_backend(kwargs["attention"], pipe.device, pipe.transformer.compute_dtype)
            except ValueError as e:
                rows.append({"row": label, "skipped_because": str(e)})
                continue
        row, out = measure(label, **kwargs)
        row["time_ratio"] = round(row["seconds"] / base["seconds"], 3)
        if cuda:
            row["vram_ratio"] = round(row["peak_vram_gib"] / base["peak_vram_gib"], 3)
        row["max_abs_frame_diff"] = float(np.abs(out - base_frames).max())
        rows.append(row)
    pipe.release()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speed", description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="lockstep,compile,cache")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--package", default=None, help="part 'device': a model package (gpu-check: the full-size dense one)")
    p.add_argument("--device", default="cuda", help="part 'device': where it runs")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--size", default="192x320", help="part 'device': HxW (the seed workload: 192x320)")
    p.add_argument("--frames", type=int, default=49)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(2)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        parts = args.parts.split(",")
        if "lockstep" in parts:
            report["lockstep"] = lockstep_part(Path(tmp))
        if "compile" in parts:
            report["compile"] = compile_part(args.repeats)
        if "cache" in parts:
            report["cache"] = cache_part(Path(tmp))
        if "device" in parts:
            h, w = (int(v) for v in args.size.split("x"))
            report["device"] = device_rows(args.package, args.device, args.steps, h, w, args.frames)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
