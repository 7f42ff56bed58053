"""Memory benchmark: peak RSS of the TI2V + Refine graph (base pipeline, Unload, refiner pipeline) per offload mode.

    python -m bench.memory                          # full-size dims, as many MoE layers as fit in RAM
    python -m bench.memory --layers 2 --json /tmp/memory.json
    python -m bench.memory --size tiny --json /tmp/m.json   # smoke run on tiny fixtures (< 1 min)

``--size full`` uses the full-size text encoder (Qwen3-VL-4B, bf16) and Wan 2.1 VAE of the offload
benchmark's cached package (``bench.offload``; built once under ``--workdir``) and writes a MoE DiT and a
MoE refiner DiT with the full-size MoE dims (hidden 2048, 128 experts of 768, 8 per token) but only
``--layers`` of the 48 blocks, as many as fit in this machine's RAM (bf16, random). Figures for 48
layers are **scaled**: measured peak + (48 - layers) x the bytes of one block, because every offload
mode keeps the whole DiT in CPU RAM (offload only limits what sits on the GPU).

Each mode runs in a fresh subprocess, the way the nodes run the graph: lazy handles from a
``PipelinePool``; the base generates a TI2V clip, is released (UnloadLingbotPipeline), then the
refiner refines it. Recorded: RSS before, after the base run, right after the release, peak (VmHWM).
Heavy with --size full: run under ``flock /tmp/lingbot-heavy.lock``.
"""

from __future__ import annotations

import os

for _key, _value in (
    ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
    ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error"), ("DIFFUSERS_VERBOSITY", "error"),
):
    os.environ.setdefault(_key, _value)

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "model", "sequential")
MIB = 1024 ** 2
GIB = 1024 ** 3
FULL_DEPTH = 48
MOE_DIMS = {  # lingbot-video-model.md: the MoE 30B-A3B config (depth set by --layers)
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "n_group": 4, "topk_group": 2,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "score_func": "sigmoid", "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "axes_lens": [4096, 512, 512],
}
PROMPT = "A red fox trots through fresh snow in a quiet pine forest at sunrise."
WORKLOAD = dict(height=32, width=32, num_frames=5, steps=1, refine_steps=2)


def log(msg: str) -> None:
    print(f"[bench.memory {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _write_moe_dit(folder: Path, layers: int, seed: int) -> int:
    """A MoE DiT with the full-size dims and ``layers`` blocks, bf16 with fp32 islands, random."""
    import torch
    from safetensors.torch import save_file

    from lingbot_core.testing.fixtures import DIFFUSERS_VERSION
    from lingbot_core.model.transformer import LingBotVideoTransformer3DModel, is_fp32_island

    with torch.device("meta"):
        dit = LingBotVideoTransformer3DModel(**MOE_DIMS, depth=layers)
    cfg = {"_class_name": "LingBotVideoTransformer3DModel", "_diffusers_version": DIFFUSERS_VERSION}
    cfg.update({k: v for k, v in dict(dit.config).items() if not k.startswith("_")})
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(json.loads(json.dumps(cfg)), indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    total = 0
    shard, shard_bytes, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes, n
        if shard:
            n += 1
            name = f"diffusion_pytorch_model-{n:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, shard_bytes = {}, 0

    for name, ref in dit.state_dict().items():
        dtype = torch.float32 if is_fp32_island(name) else torch.bfloat16
        t = torch.empty(ref.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
        if name.split(".")[-2:-1] and name.split(".")[-2].startswith("norm") and name.endswith(".weight"):
            t += 1.0
        t = t.to(dtype)
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if shard_bytes >= 2 * GIB:
            flush()
    flush()
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2) + "\n")
    return total


def block_bytes(package: Path) -> int:
    """Bytes of one DiT block (``blocks.0.*``) as stored, from the safetensors headers."""
    from lingbot_core.files.checkpoint_files import safetensors_header

    itemsize = {"BF16": 2, "F16": 2, "F32": 4}
    total = 0
    for path in (package / "transformer").glob("*.safetensors"):
        for name, t in safetensors_header(path).items():
            if name.startswith("blocks.0."):
                n = 1
                for d in t["shape"]:
                    n *= d
                total += n * itemsize.get(t["dtype"], 4)
    return total


def _full_block_bytes() -> int:
    import torch

    from lingbot_core.model.transformer import LingBotVideoTransformer3DModel, is_fp32_island

    with torch.device("meta"):
        dit = LingBotVideoTransformer3DModel(**MOE_DIMS, depth=1)
    return sum(t.numel() * (4 if is_fp32_island(k) else 2) for k, t in dit.state_dict().items() if k.startswith("blocks.0."))


def default_layers(reserve_gib: float = 3.0) -> int:
    """As many MoE layers as fit next to the text encoder and VAE in the RAM available now."""
    from lingbot_core.memory.budget import available_ram

    avail = available_ram() or 16 * GIB
    fixed = 8.9 * GIB + 0.5 * GIB  # Qwen3-VL-4B bf16 + Wan VAE fp32
    return max(1, min(8, int((avail - fixed - reserve_gib * GIB) // _full_block_bytes())))


def build_package(size: str, workdir: Path, layers: Optional[int]) -> tuple:
    from lingbot_core.testing.fixtures import write_package

    if size == "tiny":
        root = workdir / "lingbot-memory-tiny"
        if not (root / "model_index.json").is_file():
            write_package(root, moe=True, fp32=True, seed=5)
        return root, 2, {"package": "tiny MoE fixture (fp32)", "dtypes": {}}
    from bench.offload import ensure_full_package

    full, _, _ = ensure_full_package(workdir)
    layers = layers or default_layers()
    root = workdir / f"lingbot-memory-moe-{layers}layers"
    if not (root / "BUILT").is_file():
        import shutil

        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        for item in ("model_index.json", "text_encoder", "processor", "vae", "scheduler"):
            (root / item).symlink_to(full / item, target_is_directory=(full / item).is_dir())
        t0 = time.perf_counter()
        for sub, seed in (("transformer", 11), ("refiner", 12)):
            _write_moe_dit(root / sub, layers, seed)
        (root / "BUILT").write_text(f"{time.perf_counter() - t0:.1f} s\n")
    return root, layers, {"package": f"full-size dims, MoE DiT with {layers} of {FULL_DEPTH} layers",
                          "dtypes": {"transformer": "bf16", "text_encoder": "bf16"}}


def run_mode(spec: Dict) -> Dict:
    """One mode of the graph in this (fresh) process."""
    import numpy as np
    import torch

    from lingbot_core import PipelinePool

    torch.manual_seed(0)
    threads = spec.get("threads")
    if threads:
        torch.set_num_threads(threads)
    w = WORKLOAD
    image = torch.rand(48, 64, 3, generator=torch.Generator().manual_seed(1))
    pool = PipelinePool(headroom=0)
    kw = dict(offload=spec["mode"], dtypes=spec["dtypes"], device="cpu")
    base = pool.handle(spec["package"], **kw)
    refiner = pool.handle(spec["package"], transformer_subfolder="refiner", **kw)
    out: Dict = {"mode": spec["mode"], "weights_mib": round(pool.weight_bytes(base.spec) / MIB, 1)}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out["rss_start_mib"] = round(_status("VmRSS") / MIB, 1)
    t0 = time.perf_counter()
    frames = base.generate(PROMPT, image=image, height=w["height"], width=w["width"], num_frames=w["num_frames"],
                           steps=w["steps"], guidance_scale=1.0)
    out["rss_after_base_mib"] = round(_status("VmRSS") / MIB, 1)
    base.release()
    out["rss_after_unload_mib"] = round(_status("VmRSS") / MIB, 1)
    refined = refiner.refine(frames, PROMPT, first_frame=image, height=w["height"], width=w["width"],
                             steps=w["refine_steps"], tail_steps=0, guidance_scale=1.0, vae_tiling=False)
    out["rss_after_refine_mib"] = round(_status("VmRSS") / MIB, 1)
    out["peak_rss_mib"] = round(_status("VmHWM") / MIB, 1)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["frames_finite"] = bool(np.isfinite(refined).all())
    out["frames_shape"] = list(refined.shape)
    refiner.release()
    return out


def run_child(spec: Dict, tmp: Path) -> Dict:
    spec_path = tmp / f"{spec['mode']}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "bench.memory", "--child", str(spec_path)], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"mode": spec["mode"], "ok": False, "error": proc.stderr[-3000:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["ok"] = True
    return result


def markdown(report: Dict) -> str:
    layers, scale = report["layers"], report["scaled_to"]
    lines = [
        f"Package: {report['package']}; workload TI2V {WORKLOAD['width']}x{WORKLOAD['height']}x{WORKLOAD['num_frames']}, "
        f"{WORKLOAD['steps']} step, then Refine ({WORKLOAD['refine_steps']} steps); {report['machine']}.",
        "",
        f"| mode | one pipeline (weights) MiB | RSS start MiB | after base MiB | after Unload MiB | peak MiB "
        f"| peak - start MiB | peak / one pipeline | peak, {scale} layers (scaled) GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if not r["ok"]:
            lines.append(f"| {r['mode']} | failed | | | | | | | |")
            continue
        grow = r["peak_rss_mib"] - r["rss_start_mib"]
        lines.append(
            f"| {r['mode']} | {r['weights_mib']:,.0f} | {r['rss_start_mib']:,.0f} | {r['rss_after_base_mib']:,.0f} | "
            f"{r['rss_after_unload_mib']:,.0f} | {r['peak_rss_mib']:,.0f} | {grow:,.0f} | {grow / r['weights_mib']:.2f} | "
            f"{r['peak_scaled_gib']:.1f} (scaled) |")
    lines.append("")
    lines.append(f"Scaled: measured peak + ({scale} - {layers}) x {report['block_mib']:,.0f} MiB (one block's weights).")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--layers", type=int, default=None, help="MoE layers to build (default: as many as fit in RAM)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--workdir", type=Path, default=Path(os.environ.get("LINGBOT_BENCH_DIR", Path.home() / ".cache" / "lingbot-bench")))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_mode(json.loads(Path(args.child).read_text()))))
        return 0
    workdir = args.workdir if args.size == "full" else Path(tempfile.mkdtemp(prefix="lingbot-bench-memory-"))
    package, layers, info = build_package(args.size, workdir, args.layers)
    one_block = block_bytes(package)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            log(f"{mode} ...")
            r = run_child({"mode": mode, "package": str(package), "dtypes": info["dtypes"], "threads": args.threads}, Path(tmp))
            if r["ok"]:
                r["peak_scaled_gib"] = round((r["peak_rss_mib"] * MIB + (FULL_DEPTH - layers) * one_block) / GIB, 2)
            results.append(r)
            log(f"{mode}: {r}")
    report = {
        "package": info["package"], "layers": layers, "scaled_to": FULL_DEPTH, "block_mib": round(one_block / MIB, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads or 'default'}",
        "results": results,
    }
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
