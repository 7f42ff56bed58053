"""GGUF DiT figures on CPU (issue 23): load time and RSS against safetensors, dequantization cost per
forward, and a full-width MoE GGUF (8 of the 48 blocks, Q4_K, valid random blocks) loaded in offload
``block`` and denoising, with its load and peak RSS scaled to 48 blocks.

    flock /tmp/lingbot-heavy.lock .venv/bin/python -m bench.gguf --json gguf.json [--blocks 8]

Each measured load runs in a fresh child process (RSS after imports, after the load, and the peak):

1. ``dense``: the full-size dense DiT shape (24 blocks, 1.36 B params) as a Q8_0 GGUF (random blocks)
   and as the released-layout bf16 safetensors (bench.offload's random DiT): load time, RSS after the
   load and after reading every weight once (anonymous and file-backed parts). Same shapes, not the
   same numbers: the RSS is about bytes.
2. ``dequant``: milliseconds to dequantize one 2048 x 2048 Linear and one MoE expert stack
   (3 x 128 x 768 x 2048) per type, into bf16, on this CPU (the cost a forward pays per layer).
3. ``moe``: the MoE 30B-A3B config with ``--blocks`` blocks (default 8 of 48), every Linear and expert
   stack Q4_K, loaded with ``load_pipeline(transformer_file=...)`` in offload ``block`` on the CPU, then
   one denoise step (guidance off) on a 1 x 16 x 16 latent with a random 2560-wide prompt. Reported:
   file bytes, load time, RSS after load, step time, peak RSS; and each scaled to 48 blocks: file bytes
   and the file-backed RSS grow per block, the anonymous part is one block's dequantized experts at a
   time (it does not grow with depth).

``--server`` measures where a user sees it, in a real headless ComfyUI server (``tests/support/comfy_host.py``):
the dense DiT as the Q8_0 GGUF and as bf16 safetensors (text_dim 64, the side package's tiny text
encoder's; every other shape the released one's, written once in the workdir) in the server's
``models/diffusion_models``, the side package as ``model``, run through 'Load LingBot-Video Pipeline
(files)' -> GenerateVideo (64 x 64 x 5, 2 steps, guidance 1.0) -> SaveImage, a fresh server per offload
mode (``--offload none,block``) and file. RSS (VmRSS, RssAnon, RssFile) per prompt and stage comes from
``bench.server_rss``::

    flock /tmp/lingbot-heavy.lock .venv/bin/python -m bench.gguf --server --json gguf-server.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
GIB = 1024 ** 3
FULL_DEPTH = 48


def _status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def moe_config(blocks: int) -> dict:
    return {
        "patch_size": [1, 2, 2], "in_channels": 16, "out_channels": 16, "hidden_size": 2048, "num_attention_heads": 16,
        "depth": blocks, "intermediate_size": 6144, "text_dim": 2560, "freq_dim": 256, "axes_dims": [32, 48, 48],
        "axes_lens": [4096, 512, 512], "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    }


def dense_config() -> dict:
    return {"hidden_size": 2048, "num_attention_heads": 16, "depth": 24, "intermediate_size": 6144, "text_dim": 2560}


def ensure_side_package(workdir: Path) -> Path:
    """A folder with the tiny package's model_index.json, processor, text encoder, VAE and scheduler and no transformer/:
    the DiT comes from the GGUF file and its config from the file's shapes."""
    from lingbot_core.testing.fixtures import write_package

    root = workdir / "side-package"
    if (root / "model_index.json").is_file():
        return root
    full = workdir / "tiny-package"
    if not (full / "model_index.json").is_file():
        write_package(full, refiner=False)
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("processor", "text_encoder", "vae", "scheduler"):
        shutil.copytree(full / sub, root / sub, dirs_exist_ok=True)
    shutil.copy(full / "model_index.json", root)  # ComfyUI's model list shows folders that have one
    return root


def ensure_moe_gguf(workdir: Path, blocks: int) -> Path:
    from lingbot_core.testing.gguf_fixtures import write_random_gguf_dit

    path = workdir / f"lingbot-moe-{blocks}of48-q4k.gguf"
    if not path.is_file():
        partial = path.with_suffix(".partial")
        write_random_gguf_dit(partial, moe_config(blocks), "Q4_K", layout="rebel", seed=0)
        partial.rename(path)
    return path


def ensure_dense_files(workdir: Path, text_dim: int = 2560) -> tuple:
    """The full-size dense DiT as a Q8_0 GGUF and as a bf16 safetensors folder (written once). A
    ``text_dim`` other than the released 2560 (the tiny text encoder's width, for a graph that encodes a
    real prompt with the side package) is in the names; it changes one 2048-wide Linear's input only."""
    from bench.offload import write_random_dit
    from lingbot_core.testing.gguf_fixtures import write_random_gguf_dit

    tag = "" if text_dim == 2560 else f"-text{text_dim}"
    gguf_path = workdir / f"lingbot-dense{tag}-q8_0.gguf"
    if not gguf_path.is_file():
        write_random_gguf_dit(gguf_path.with_suffix(".partial"),
                              {**moe_config(0), **dense_config(), "num_experts": 0, "text_dim": text_dim},
                              "Q8_0", layout="sdcpp", seed=1)
        gguf_path.with_suffix(".partial").rename(gguf_path)
    st_dir = workdir / f"lingbot-dense{tag}-bf16"
    if not (st_dir / "diffusion_pytorch_model.safetensors").is_file():
        import torch

        # class defaults: the released dense DiT
        write_random_dit(st_dir, torch.Generator().manual_seed(1), **({} if text_dim == 2560 else {"text_dim": text_dim}))
    return gguf_path, st_dir


# -- children ----------------------------------------------------------------------------------------


def child_dense(kind: str, path: str) -> dict:
    import torch

    from lingbot_core.model.dit_files import load_dit_file
    from lingbot_core.loading import load_transformer

    torch.set_num_threads(2)
    base = _status()
    t0 = time.perf_counter()
    if kind == "gguf":
        model = load_dit_file(path, torch.bfloat16)
    else:
        model = load_transformer(Path(path), torch.bfloat16)
    load_s = time.perf_counter() - t0
    after = _status()
    tensors = list(model.parameters()) + list(model.buffers())
    held = sum(t.numel() * t.element_size() for t in tensors)
    for t in tensors:  # read every weight once (as a forward would): mapped pages become resident
        t.detach().reshape(-1)[:: max(1, 4096 // t.element_size())].float().sum()
    touched = _status()
    return {"kind": kind, "load_s": round(load_s, 2), "weights_bytes": held,
            "rss_after_imports": base["VmRSS"], "rss_after_load": after["VmRSS"],
            "anon_after_load": after["RssAnon"], "file_after_load": after["RssFile"],
            "rss_after_reading_weights": touched["VmRSS"], "anon_after_reading_weights": touched["RssAnon"],
            "file_after_reading_weights": touched["RssFile"],
            "file_bytes": sum(p.stat().st_size for p in ([Path(path)] if kind == "gguf" else Path(path).glob("*.safetensors")))}


def child_moe(pkg: str, path: str) -> dict:
    import torch

    from lingbot_core import load_pipeline
    from lingbot_core.sampling.scheduling import shifted_sigmas
    from lingbot_core.prompts.text_conditioning import PromptEmbeds

    torch.set_num_threads(2)
    base = _status()
    t0 = time.perf_counter()
    pipe = load_pipeline(pkg, transformer_file=path, offload="block", device="cpu",
                         dtypes={"transformer": "bf16", "text_encoder": "fp32", "vae": "fp32"})
    load_s = time.perf_counter() - t0
    after = _status()
    gen = torch.Generator().manual_seed(0)
    embeds = PromptEmbeds(torch.randn(1, 16, 2560, generator=gen), None)
    latents = torch.randn(1, 16, 1, 16, 16, generator=gen)
    t0 = time.perf_counter()
    out = pipe.denoise(embeds, latents, sigmas=list(shifted_sigmas(1, 3.0)), guidance_scale=1.0)
    step_s = time.perf_counter() - t0
    end = _status()
    finite = bool(torch.isfinite(out).all())
    pipe.release()
    return {"load_s": round(load_s, 2), "step_s": round(step_s, 2), "finite": finite,
            "rss_after_imports": base["VmRSS"], "rss_after_load": after["VmRSS"], "anon_after_load": after["RssAnon"],
            "file_after_load": after["RssFile"], "peak_rss": end["VmHWM"], "anon_after_step": end["RssAnon"],
            "file_after_step": end["RssFile"]}


def _run_child(*args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "bench.gguf", "--child", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- in-process: dequantization cost ------------------------------------------------------------------


def dequant_costs(repeat: int = 3) -> list:
    import numpy as np
    import torch

    from lingbot_core.files import gguf_weights
    from lingbot_core.testing.gguf_fixtures import random_blocks

    torch.set_num_threads(2)
    rows = []
    rng = np.random.default_rng(0)
    for kind in ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q4_0"):
        linear = torch.from_numpy(random_blocks(kind, 2048, 2048, rng))
        stack = torch.from_numpy(random_blocks(kind, 128 * 768, 2048, rng)).reshape(128, 768, -1)

        def timed(raw):
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                gguf_weights.dequantize(raw, kind, torch.bfloat16)
                best = min(best, time.perf_counter() - t0)
            return round(best * 1000, 1)

        rows.append({"type": kind, "linear_2048x2048_ms": timed(linear), "expert_stack_ms": timed(stack),
                     "moe_block_experts_ms": None})
        rows[-1]["moe_block_experts_ms"] = round(rows[-1]["expert_stack_ms"] * 3, 1)  # w1, w2, w3 of one block
        del stack
    return rows


# -- --server: the files loader in a real ComfyUI server ----------------------------------------------

FROM_PACKAGE = "(from the package)"  # the files loader's choice for a component the package provides
SIDE = "lingbot-side"  # the package folder the files loader's ``model`` names (processor, text encoder, VAE)
ROLES = {"1": "load", "2": "generate", "3": "save"}


def files_graph(dit_file: str, offload: str, size=(64, 64, 5), steps: int = 2, dit_precision: str = "bf16") -> dict:
    """'Load LingBot-Video Pipeline (files)' -> GenerateVideo -> SaveImage (node ids as ``ROLES``)."""
    width, height, frames = size
    return {
        "1": {"class_type": "LoadLingbotPipelineFiles", "inputs": {
            "model": SIDE, "dit_file": dit_file, "text_encoder_file": FROM_PACKAGE, "vae_file": FROM_PACKAGE,
            "transformer": "transformer", "offload": offload, "dit_precision": dit_precision,
            "text_encoder_precision": "auto", "vae_precision": "fp32"}},
        "2": {"class_type": "GenerateVideo", "inputs": {
            "pipe": ["1", 0], "prompt": "a red kite above green hills", "negative_prompt": "", "width": width,
            "height": height, "num_frames": frames, "steps": steps, "guidance_scale": 1.0, "shift": 3.0, "seed": 7}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "bench_gguf"}},
    }


def run_server(workdir: Path, modes, size, steps: int, dit_precision: str) -> list:
    """Per offload mode and DiT file (the dense GGUF Q8_0, then the same shapes as bf16 safetensors), a
    fresh ComfyUI server (``tests/support/comfy_host.py``) runs :func:`files_graph` once; its RSS comes from
    ``bench.server_rss``. The DiT's text_dim is the tiny text encoder's (the side package encodes the
    prompt), every other shape is the released dense DiT's."""
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from support.comfy_host import ComfyServer

    from bench.server_rss import measure_prompt
    from lingbot_core.testing.fixtures import DIT_WEIGHTS, TEXT_HIDDEN

    side = ensure_side_package(workdir)
    gguf_path, st_dir = ensure_dense_files(workdir, text_dim=TEXT_HIDDEN)
    files = {"gguf Q8_0": gguf_path, "safetensors bf16": st_dir / DIT_WEIGHTS}
    names = {"gguf Q8_0": gguf_path.name, "safetensors bf16": st_dir.name + ".safetensors"}
    out = []
    for mode in modes:
        for kind, path in files.items():
            with ComfyServer(models={SIDE: side}, startup_timeout=300) as server:
                unet = server.models_dir / "diffusion_models"
                unet.mkdir(parents=True, exist_ok=True)
                os.link(path, unet / names[kind])  # a hard link: the same page cache as the cached file
                row = {"offload": mode, "dit": kind, "file_mib": round(path.stat().st_size / MIB),
                       **measure_prompt(server, files_graph(names[kind], mode, size, steps, dit_precision), ROLES)}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.environ.get("LINGBOT_BENCH_DIR", "/tmp/lingbot-bench-gguf"))
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: dense,dequant,moe")
    ap.add_argument("--child", nargs="*")
    ap.add_argument("--server", action="store_true",
                    help="the dense DiT as GGUF Q8_0 and as bf16 safetensors through the files loader in a real ComfyUI server")
    ap.add_argument("--offload", default="none,block", help="--server: offload modes, a fresh server each")
    ap.add_argument("--size", default="64x64x5", help="--server: width x height x frames")
    ap.add_argument("--steps", type=int, default=2, help="--server: denoise steps (guidance 1.0)")
    ap.add_argument("--dit-precision", default="bf16", help="--server: the loader's dit_precision (auto is fp32 on CPU)")
    args = ap.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        result = child_moe(*rest) if kind == "moe" else child_dense(kind, *rest)
        print(json.dumps(result))
        return result
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    report = {}
    if args.server:
        size = tuple(int(v) for v in args.size.split("x"))
        report["server"] = run_server(workdir, args.offload.split(","), size, args.steps, args.dit_precision)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        return report
    skip = set(filter(None, args.skip.split(",")))
    if "dequant" not in skip:
        report["dequant"] = dequant_costs()
        print(json.dumps(report["dequant"], indent=1), flush=True)
    if "dense" not in skip:
        gguf_path, st_dir = ensure_dense_files(workdir)
        report["dense"] = [_run_child("gguf", str(gguf_path)), _run_child("safetensors", str(st_dir))]
        print(json.dumps(report["dense"], indent=1), flush=True)
    if "moe" not in skip:
        pkg = ensure_side_package(workdir)
        t0 = time.perf_counter()
        path = ensure_moe_gguf(workdir, args.blocks)
        write_s = time.perf_counter() - t0
        moe = _run_child("moe", str(pkg), str(path))
        size = path.stat().st_size
        from lingbot_core.model.dit_files import DitFile

        dit = DitFile(path)
        per_block = sum(dit.reader.nbytes(k) for k in dit.reader.keys() if k.startswith("blocks.0."))
        outside = size - args.blocks * per_block
        # RssFile also counts the shared libraries mapped at import; the weights' pages are what it gained.
        weights_paged = moe["file_after_step"] - moe["file_after_load"]
        scale = {
            "file_bytes_48": outside + FULL_DEPTH * per_block,
            # file-backed pages grow with the blocks touched; the anonymous part does not grow with depth
            "peak_rss_48": moe["peak_rss"] - weights_paged + weights_paged * (outside + FULL_DEPTH * per_block) / size,
            "anon_peak_bound": moe["peak_rss"] - moe["file_after_step"],
            "weights_paged": weights_paged,
        }
        report["moe"] = {"blocks": args.blocks, "file_bytes": size, "block_bytes": per_block, "write_s": round(write_s, 1),
                         **moe, **{k: int(v) for k, v in scale.items()}}
        print(json.dumps(report["moe"], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
