"""One-command GPU check (issue 10 item 5): precision and offload figures, written as JSON + Markdown.

    scripts/gpu-check                              # CUDA, full-size random weights, the seed workload
    scripts/gpu-check --device cpu --size tiny     # the same checks on the tiny fixture (CI smoke run)

Three parts, all in this one process:

1. **precision** (tiny fp32 fixture package, TI2V 64x96, 5 frames, 3 steps): frames with the DiT and
   text encoder in bf16, and with an fp8_e4m3fn DiT, against fp32; pass when the mean |diff| is at most
   ``MEAN_BOUND`` and the max at most ``MAX_BOUND`` (frames in [0, 1]).
2. **offload** (``--size full``: the full-size random package of ``bench.offload``; the seed workload
   TI2V 320x192, 49 frames, 40 steps on CUDA, 64x96x5 / 2 steps on CPU): per DiT precision (bf16,
   fp8_e4m3fn) the pipeline is loaded once and run in ``none``, ``model``, ``sequential`` and
   ``block`` (``blocks_on_gpu`` 0): wall time of ``generate`` and, on CUDA, ``max_memory_allocated``
   (peak statistics reset before each run). One short warm-up run first, so CUDA start-up costs are
   not charged to ``none``. Frames must be bit-identical across the modes of one precision.
3. **placement** (tiny fp32 package, TI2V as in 1): the text encoder and VAE on another device than the
   DiT (``cpu``; and ``cuda:1`` when a second GPU is present), offload ``none`` and ``model``, against the
   default placement on the same loaded copy: frames bit-identical on a second GPU of the same kind, within
   the precision bounds with the CPU; on CUDA the DiT device's peak memory per placement.
4. **moe**: ``bench.moe_ffn`` (the MoE feed-forward before/after the sorted dispatch, and whether
   ``torch._grouped_mm`` gives the bits of the per-slice path on this device).

Writes ``gpu-check.json`` and ``gpu-check.md`` into ``--out`` (default ``out/gpu-check``); exits 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                     ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error")):
    os.environ.setdefault(_key, _value)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

MEAN_BOUND = 0.02
MAX_BOUND = 0.25
MODES = (("none", 0), ("model", 0), ("sequential", 0), ("block", 0))
PRECISIONS = ("bf16", "fp8_e4m3fn")
TINY_RUN = dict(height=64, width=96, num_frames=5, steps=2, seed=7)
MIB = 1024 * 1024


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _image(h, w):
    from bench.offload import bench_image

    return bench_image(h, w)


def precision_check(device, workdir: Path) -> dict:
    from lingbot_core import load_pipeline
    from lingbot_core.fixtures import write_package

    package = write_package(workdir / "tiny-fp32", fp32=True, refiner=False, seed=3)
    image = _image(TINY_RUN["height"], TINY_RUN["width"])
    frames = {}
    for label, dtypes in (("fp32", {"transformer": "fp32", "text_encoder": "fp32"}),
                          ("bf16", {"transformer": "bf16", "text_encoder": "bf16"}),
                          ("fp8_e4m3fn", {"transformer": "fp8_e4m3fn", "text_encoder": "bf16"})):
        pipe = load_pipeline(package, device=device, dtypes=dtypes)
        try:
            frames[label] = pipe.generate("a red fox in the snow", image=image, **TINY_RUN)
        finally:
            pipe.release()
    out = {"workload": dict(TINY_RUN, ti2v=True), "bounds": {"mean_abs": MEAN_BOUND, "max_abs": MAX_BOUND}}
    for label in ("bf16", "fp8_e4m3fn"):
        diff = np.abs(frames[label].astype(np.float64) - frames["fp32"].astype(np.float64))
        out[label] = {"mean_abs": float(diff.mean()), "max_abs": float(diff.max()),
                      "ok": bool(diff.mean() <= MEAN_BOUND and diff.max() <= MAX_BOUND)}
    return out


def offload_check(device, size: str, workdir: Path, steps) -> dict:
    from bench.offload import CPU_NEGATIVE, CPU_WORKLOAD, CUDA_WORKLOAD, PROMPT, ensure_full_package
    from lingbot_core import load_pipeline
    from lingbot_core.fixtures import write_package

    cuda = device.type == "cuda"
    work = dict(CUDA_WORKLOAD if cuda else CPU_WORKLOAD)
    if steps:
        work["steps"] = steps
    if size == "full":
        package, _, _ = ensure_full_package(workdir)
    else:
        package = write_package(workdir / "tiny-bf16", refiner=False)
    negative = None if cuda else CPU_NEGATIVE
    image = _image(work["height"], work["width"])
    run = dict(negative_prompt=negative, image=image, height=work["height"], width=work["width"],
               num_frames=work["frames"], guidance_scale=3.0, shift=3.0, seed=42)
    results = {"workload": dict(work, package=str(package), negative_prompt=negative or "model default"), "runs": []}
    for precision in PRECISIONS:
        t0 = time.perf_counter()
        pipe = load_pipeline(package, offload="none", device=device,
                             dtypes={"transformer": precision, "text_encoder": "bf16"})
        load_s = time.perf_counter() - t0
        try:
            pipe.generate(PROMPT, steps=1, **run)  # warm-up: CUDA context, kernels, allocator
            for mode, k in MODES:
                pipe.set_offload(mode, device, blocks_on_gpu=k)
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                _sync(device)
                t1 = time.perf_counter()
                frames = pipe.generate(PROMPT, steps=work["steps"], **run)
                _sync(device)
                wall = time.perf_counter() - t1
                entry = {"precision": precision, "mode": mode, "blocks_on_gpu": k, "generate_s": round(wall, 2),
                         "load_s": round(load_s, 1),
                         "frames_sha256": hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest(),
                         "frames_finite": bool(np.isfinite(frames).all())}
                if cuda:
                    entry["max_memory_allocated_mib"] = round(torch.cuda.max_memory_allocated(device) / MIB)
                results["runs"].append(entry)
                log(f"{precision} {mode}: {wall:.1f} s" + (f", {entry['max_memory_allocated_mib']} MiB" if cuda else ""))
        finally:
            pipe.release()
    for precision in PRECISIONS:
        runs = [r for r in results["runs"] if r["precision"] == precision]
        base = next(r for r in runs if r["mode"] == "none")
        for r in runs:
            r["ratio_to_none"] = round(r["generate_s"] / base["generate_s"], 3)
        results[f"{precision}_frames_identical"] = len({r["frames_sha256"] for r in runs}) == 1
    return results


def placement_check(device, workdir: Path) -> dict:
    from lingbot_core import load_pipeline
    from lingbot_core.fixtures import write_package

    package = write_package(workdir / "tiny-placement", fp32=True, refiner=False, seed=4)
    image = _image(TINY_RUN["height"], TINY_RUN["width"])
    others = ["cpu"]
    if device.type == "cuda" and torch.cuda.device_count() > 1:  # a second GPU: the next one
        main = device.index if device.index is not None else torch.cuda.current_device()
        others.append(f"cuda:{(main + 1) % torch.cuda.device_count()}")
    pipe = load_pipeline(package, device=device, dtypes={"transformer": "fp32", "text_encoder": "fp32"})
    runs = []
    try:
        reference = pipe.generate("a red fox in the snow", image=image, **TINY_RUN)
        for other in others:
            for mode in ("none", "model"):
                pipe.set_offload(mode, devices={"text_encoder": other, "vae": other})
                pipe._prompt_cache.clear()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                frames = pipe.generate("a red fox in the snow", image=image, **TINY_RUN)
                diff = np.abs(frames.astype(np.float64) - reference.astype(np.float64))
                same_kind = other != "cpu" or device.type == "cpu"
                entry = {"other": other, "mode": mode, "max_abs": float(diff.max()), "identical": bool(diff.max() == 0),
                         "ok": bool(diff.max() == 0) if same_kind else bool(diff.mean() <= MEAN_BOUND and diff.max() <= MAX_BOUND)}
                if device.type == "cuda":
                    entry["dit_device_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / MIB, 1)
                runs.append(entry)
                log(f"placement text encoder + VAE on {other}, {mode}: max |diff| {diff.max():.3g}")
    finally:
        pipe.release()
    return {"workload": dict(TINY_RUN, ti2v=True), "runs": runs}


def moe_check(device, size: str) -> dict:
    from bench.moe_ffn import run

    if size == "tiny":
        return run(str(device), tokens=256, repeats=1, tiny=True)
    return run(str(device), tokens=3400, repeats=3)


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"## gpu-check ({report['size']} components, {m['device_name']})", "",
             f"- date: {report['date']}; torch {m['torch']}, CUDA {m['cuda']}, Python {m['python']}", ""]
    p = report.get("precision")
    if p:
        lines += [f"Precision (tiny fp32 package, TI2V {p['workload']['height']}x{p['workload']['width']}, "
                  f"{p['workload']['num_frames']} frames, {p['workload']['steps']} steps), frames vs fp32; bound: mean |diff| "
                  f"<= {MEAN_BOUND}, max <= {MAX_BOUND}:", "",
                  "| DiT / text encoder | mean abs diff | max abs diff | within bound |", "|---|---:|---:|:---:|"]
        for label in ("bf16", "fp8_e4m3fn"):
            x = p[label]
            lines.append(f"| {label} / bf16 | {x['mean_abs']:.5f} | {x['max_abs']:.5f} | {'yes' if x['ok'] else 'NO'} |")
        lines.append("")
    o = report.get("offload")
    if o:
        w = o["workload"]
        lines += [f"Offload (TI2V {w['width']}x{w['height']} (W x H), {w['frames']} frames, {w['steps']} steps; "
                  f"text encoder bf16, VAE fp32; one load per precision, one warm-up run):", "",
                  "| DiT | mode | generate s | ratio to none | max_memory_allocated MiB | frames identical |",
                  "|---|---|---:|---:|---:|:---:|"]
        for r in o["runs"]:
            ident = "yes" if o[f"{r['precision']}_frames_identical"] else "NO"
            lines.append(f"| {r['precision']} | {r['mode']}{' K=' + str(r['blocks_on_gpu']) if r['mode'] == 'block' else ''} | "
                         f"{r['generate_s']} | {r['ratio_to_none']} | {r.get('max_memory_allocated_mib', '—')} | {ident} |")
        lines.append("")
    pl = report.get("placement")
    if pl:
        lines += ["Placement (text encoder and VAE on another device, tiny fp32 TI2V), frames vs the default placement:", "",
                  "| text encoder + VAE on | mode | max abs diff | DiT device peak MiB | ok |", "|---|---|---:|---:|:---:|"]
        for r in pl["runs"]:
            lines.append(f"| {r['other']} | {r['mode']} | {r['max_abs']:.3g} | {r.get('dit_device_peak_mib', '—')} | "
                         f"{'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    moe = report.get("moe")
    if moe:
        lines += [f"MoE FFN ({moe['tokens']} tokens, {moe['size']}-size block), median s: "
                  + ", ".join(f"{k} {v}" for k, v in moe["median_s"].items())
                  + "; bit-identical to before: " + ", ".join(f"{k} {v}" for k, v in moe["bit_identical_to_before"].items()), ""]
    lines.append(f"Result: {'PASS' if report['ok'] else 'FAIL'}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--size", choices=["full", "tiny"], default="full")
    p.add_argument("--out", default=str(REPO / "out" / "gpu-check"))
    p.add_argument("--workdir", default=os.environ.get("LINGBOT_BENCH_CACHE", str(Path.home() / ".cache" / "lingbot-bench")))
    p.add_argument("--steps", type=int, default=None, help="override the workload's steps (default 40 on CUDA)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: precision, offload, placement, moe")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but no CUDA device is available; use --device cpu.")
        torch.backends.cuda.matmul.allow_tf32 = True  # as the reference runner
        torch.backends.cudnn.allow_tf32 = True
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import diffusers
    import transformers

    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "size": args.size,
        "machine": {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
                    "transformers": transformers.__version__, "python": platform.python_version()},
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lingbot-gpu-check-") as tmp:
        if "precision" not in skip:
            log("precision check (tiny) ...")
            report["precision"] = precision_check(device, Path(tmp))
        if "offload" not in skip:
            log(f"offload check ({args.size}) ...")
            workdir = Path(args.workdir).expanduser() if args.size == "full" else Path(tmp)
            report["offload"] = offload_check(device, args.size, workdir, args.steps)
        if "placement" not in skip:
            log("placement check (tiny) ...")
            report["placement"] = placement_check(device, Path(tmp))
        if "moe" not in skip:
            log("MoE FFN ...")
            report["moe"] = moe_check(device, args.size)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    checks = []
    if "precision" in report:
        checks += [report["precision"][k]["ok"] for k in ("bf16", "fp8_e4m3fn")]
    if "offload" in report:
        checks += [report["offload"][f"{q}_frames_identical"] for q in PRECISIONS]
        checks += [r["frames_finite"] for r in report["offload"]["runs"]]
    if "placement" in report:
        checks += [r["ok"] for r in report["placement"]["runs"]]
    if "moe" in report:
        checks.append(report["moe"]["bit_identical_to_before"].get("slices", False))
    report["ok"] = bool(checks) and all(checks)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out / "gpu-check.md").write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
