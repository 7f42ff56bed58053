"""The Qwen3-VL text encoder as bf16 safetensors vs llama.cpp's text GGUF (Q8_0, Q4_K) on CPU (issue 41):
RSS of the three-file pipeline after the load and after encoding prompts (anonymous and file-backed),
prompt-encode time, and the full-size figures computed from the shipped Qwen3-VL-4B config.

    flock /tmp/lingbot-heavy.lock .venv/bin/python -m bench.text_encoder_gguf --json te-gguf.json [--layers 2]
        [--device cuda --offload block]   (on a GPU: the same, plus the GPU peak per encoder)
    flock /tmp/lingbot-heavy.lock .venv/bin/python -m bench.text_encoder_gguf --server --json te-gguf-server.json
        (the same files in a real headless ComfyUI server, a fresh one per encoder: see ``run_server``)

The measured encoders have the released widths (hidden 2560, 32/8 heads of 128, MLP 9728, the full
151,936-row vocabulary) but ``--layers`` of the 36 decoder layers (default 2), random weights: the bf16
file in ComfyUI's layout with the full-size vision tower (as Comfy-Org's ``qwen3vl_4b_bf16.safetensors``),
the GGUFs in llama.cpp's layout (text model only; every Linear and the token embedding valid random
blocks of the type, norms F32). Same shapes, not the same numbers: the RSS is about bytes. Each load runs
in a fresh child process with a tiny GGUF DiT (text_dim 2560) and the tiny Wan 2.1 VAE: the three files
alone, text encoder in bf16. The computed table counts what each file keeps once loaded at full depth:
values in bf16, block bytes (mapped) for what stays quantized (``text_encoder_gguf.loaded_bytes``'s rule).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 ** 2
GIB = 1024 ** 3
VARIANTS = ("bf16", "Q8_0", "Q4_K")
PROMPTS = ("A red fox runs through fresh snow at dawn, its breath visible, the camera tracking low beside it.",
           "A quiet harbour at night, rain on the water, neon signs reflected in long trembling lines.")


def _status() -> dict:
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def bench_config(layers: int) -> dict:
    """The shipped Qwen3-VL-4B config with ``layers`` decoder layers (deepstack indexes kept in range)."""
    from lingbot_core.model.component_files import text_encoder_config

    config = text_encoder_config().to_dict()
    config["text_config"]["num_hidden_layers"] = layers
    return config


def write_files(work: Path, layers: int) -> dict:
    """The three encoder files (written once) and the tiny DiT and VAE."""
    import numpy as np
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from lingbot_core.testing import file_fixtures as ff
    from lingbot_core.testing import fixtures
    from lingbot_core.testing.gguf_fixtures import random_blocks, write_gguf_dit

    work.mkdir(parents=True, exist_ok=True)
    config = bench_config(layers)
    files = {v: work / (f"qwen3vl_4b_{layers}l_bf16.safetensors" if v == "bf16" else f"Qwen3-VL-4B-{layers}l-{v}.gguf")
             for v in VARIANTS}
    for path in files.values():
        path.with_suffix(".json").write_text(json.dumps(config), encoding="utf-8")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen3VLForConditionalGeneration(Qwen3VLConfig(**config)).state_dict().items()
                  if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(0)
    if not files["bf16"].is_file():
        state = {}
        for k, shape in shapes.items():
            t = torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02)
            if k.endswith("norm.weight") or k.endswith("layernorm.weight"):
                t.add_(1.0)
            state[_comfy(k)] = t.to(torch.bfloat16)
        save_file(state, str(files["bf16"]))
        del state
    import gguf

    text = config["text_config"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3VL, text["num_hidden_layers"])
    rng = np.random.default_rng(0)
    for qtype in ("Q8_0", "Q4_K"):
        if files[qtype].is_file():
            continue
        writer = gguf.GGUFWriter(str(files[qtype]), "qwen3vl")
        for k, shape in shapes.items():
            if not k.startswith("model.language_model."):
                continue
            key = names.get_name("model." + k[len("model.language_model."):], try_suffixes=(".weight",))
            if len(shape) == 2:
                raw = random_blocks(qtype, shape[0], shape[1], rng, 0.02)
                writer.add_tensor(key, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
            else:
                writer.add_tensor(key, (1.0 + 0.02 * rng.standard_normal(shape)).astype(np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    dit = work / "dit-text2560.gguf"
    if not dit.is_file():
        state, _ = fixtures.dit_state_dict({**ff.files_dit_config(False), "text_dim": text["hidden_size"]}, 0, fp32=True)
        write_gguf_dit(dit, state, "Q8_0")
    vae = work / "wan_2.1_vae_tiny.safetensors"
    if not vae.is_file():
        ff.write_wan21_vae_file(vae)
    return {"files": files, "dit": dit, "vae": vae}


def _comfy(key: str) -> str:
    """ComfyUI's names, as Comfy-Org's single file has them."""
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key[len("model."):] if key.startswith("model.visual.") else key


def child(te: str, dit: str, vae: str, repeat: int, device: str = "cpu", offload: str = "none") -> dict:
    import torch

    from lingbot_core import load_pipeline

    torch.set_num_threads(2)
    before = _status()
    t = time.perf_counter()
    pipe = load_pipeline(None, device=device, offload=offload, dtypes={"transformer": "bf16", "text_encoder": "bf16"},
                         transformer_file=dit, text_encoder_file=te, vae_file=vae)
    load_s = time.perf_counter() - t
    loaded = _status()
    times = []
    for i in range(repeat):
        pipe._prompt_cache.clear()  # each encode runs the encoder
        t = time.perf_counter()
        e = pipe.encode_prompt(PROMPTS[i % 2], guidance_scale=1.0)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    encoded = _status()
    gpu = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    return {"file_bytes": Path(te).stat().st_size, "load_s": load_s, "tokens": int(e.positive.shape[1]),
            "device": device, "offload": offload, "gpu_peak_bytes": gpu,
            "encode_s": statistics.median(times), "first_encode_s": times[0],
            "before": before, "loaded": loaded, "encoded": encoded}


NO_PACKAGE = "(none: the three files)"  # the files loader's 'model' choice: the three files are the pipeline
ROLES = {"1": "load", "2": "generate", "3": "save"}


def files_graph(dit_file: str, te_file: str, vae_file: str, size=(64, 64, 5), steps: int = 1,
                prompt: str = PROMPTS[0], seed: int = 7) -> dict:
    """'Load LingBot-Video Pipeline (files)' with the three files -> GenerateVideo -> SaveImage (ids as ``ROLES``)."""
    width, height, frames = size
    return {
        "1": {"class_type": "LoadLingbotPipelineFiles", "inputs": {
            "model": NO_PACKAGE, "dit_file": dit_file, "text_encoder_file": te_file, "vae_file": vae_file,
            "transformer": "transformer", "offload": "none", "dit_precision": "bf16",
            "text_encoder_precision": "bf16", "vae_precision": "fp32"}},
        "2": {"class_type": "GenerateVideo", "inputs": {
            "pipe": ["1", 0], "prompt": prompt, "negative_prompt": "", "width": width, "height": height,
            "num_frames": frames, "steps": steps, "guidance_scale": 1.0, "shift": 3.0, "seed": seed}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "bench_te_gguf"}},
    }


def _generate_seconds(entry: dict) -> float | None:
    """Seconds between ComfyUI's ``executing`` events for GenerateVideo and the node after it (ws times)."""
    marks = {str(e["data"].get("node")): e["t"] for e in entry.get("ws_events") or []
             if e.get("type") == "executing" and isinstance(e.get("data"), dict)}
    return marks["3"] - marks["2"] if "2" in marks and "3" in marks else None


def run_server(paths: dict, size, steps: int) -> dict:
    """Per encoder a fresh ComfyUI server (``tests/support/comfy_host.py``) with the three files hard-linked
    into its model folders (the same page cache as the written files) runs :func:`files_graph` once cold;
    its RSS row comes from ``bench.server_rss.measure_prompt``. The server logs no encode time and the
    generate stage holds load, encode, denoise and decode, so the encode is taken as a difference of two
    warm reruns' generate stages: a new prompt (encode + denoise + decode) minus a new seed with the same
    prompt (the pipeline's prompt cache hits: denoise + decode)."""
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from support.comfy_host import ComfyServer

    from bench.server_rss import measure_prompt

    rows = {}
    for variant in VARIANTS:
        te = paths["files"][variant]
        with ComfyServer(startup_timeout=300) as server:
            links = {te: "text_encoders", te.with_suffix(".json"): "text_encoders",  # the config beside the file
                     paths["dit"]: "diffusion_models", paths["vae"]: "vae"}
            for path, folder in links.items():
                (server.models_dir / folder).mkdir(parents=True, exist_ok=True)
                os.link(path, server.models_dir / folder / path.name)
            names = (paths["dit"].name, te.name, paths["vae"].name)
            row = {"variant": variant, "file_mib": round(te.stat().st_size / MIB),
                   **measure_prompt(server, files_graph(*names, size, steps), ROLES)}
            new_prompt = server.run(files_graph(*names, size, steps, prompt=PROMPTS[1], seed=8), timeout=900)
            same_prompt = server.run(files_graph(*names, size, steps, prompt=PROMPTS[1], seed=9), timeout=900)
            a, b = _generate_seconds(new_prompt), _generate_seconds(same_prompt)
            row["warm_generate_s"] = {"new_prompt": a, "same_prompt": b}
            row["encode_s"] = None if a is None or b is None else round(a - b, 3)
        print(json.dumps(row), flush=True)
        rows[variant] = row
    return rows


def computed_full_size() -> dict:
    """Bytes each encoder keeps once loaded at the released 36 layers (bf16 compute), from the shipped config."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from lingbot_core.files import gguf_weights
    from lingbot_core.model.component_files import text_encoder_config
    from lingbot_core.model.text_encoder_gguf import _stays_quantized

    with torch.device("meta"):
        state = Qwen3VLForConditionalGeneration(text_encoder_config()).state_dict()
    out = {}
    for variant in VARIANTS:
        total = vision = 0
        for k, v in state.items():
            if k == "lm_head.weight":
                continue
            if not k.startswith("model.language_model."):
                vision += 2 * v.numel()
                continue
            if variant != "bf16" and _stays_quantized(k, gguf_weights.qtype_of(variant)):
                total += gguf_weights.raw_nbytes(v.shape, variant)
            else:
                total += 2 * v.numel()
        out[variant] = {"text_bytes": total, "vision_bytes": vision if variant == "bf16" else 0}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.text_encoder_gguf", description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/lingbot-bench-te-gguf")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU check: the same loads and encodes there)")
    p.add_argument("--offload", default="none", help="the pipeline's offload mode (none, model, sequential, block)")
    p.add_argument("--server", action="store_true",
                   help="the three encoders through the files loader in a real ComfyUI server, a fresh one each")
    p.add_argument("--size", default="64x64x5", help="--server: width x height x frames")
    p.add_argument("--steps", type=int, default=1, help="--server: denoise steps (guidance 1.0)")
    p.add_argument("--json")
    p.add_argument("--child", nargs=3, metavar=("TE", "DIT", "VAE"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(*a.child, a.repeat, a.device, a.offload)))
        return None
    paths = write_files(Path(a.work), a.layers)
    if a.server:
        rows = run_server(paths, tuple(int(v) for v in a.size.split("x")), a.steps)
        result = {"layers": a.layers, "server": rows}
        print(f"| text encoder ({a.layers} of 36 layers) | file | peak rise (VmHWM) | load stage (anon / file) "
              "| generate stage (anon / file) | encode (warm difference) |")
        print("|---|---|---|---|---|---|")
        for variant, r in rows.items():
            st = r["stages"]
            cells = [f"+{st[k]['VmRSS']:,} MiB ({st[k]['RssAnon']:+,} / {st[k]['RssFile']:+,})" if k in st else "-"
                     for k in ("load", "generate")]
            enc = "-" if r["encode_s"] is None else f"{r['encode_s']:.2f} s"
            print(f"| {variant} | {r['file_mib']:,} MiB | +{r['peak_rise_mib']:,} MiB | {cells[0]} | {cells[1]} | {enc} |")
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
        return result
    rows = {}
    for variant in VARIANTS:
        cmd = [sys.executable, "-m", "bench.text_encoder_gguf", "--repeat", str(a.repeat), "--device", a.device,
               "--offload", a.offload, "--child",
               str(paths["files"][variant]), str(paths["dit"]), str(paths["vae"])]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    result = {"layers": a.layers, "measured": rows, "computed_full_size": computed_full_size()}
    print(f"| text encoder ({a.layers} of 36 layers) | file | RSS after load (anon / file) | after encoding (anon / file) "
          "| encode (median) |")
    print("|---|---|---|---|---|")
    for variant, r in rows.items():
        lo, en, b = r["loaded"], r["encoded"], r["before"]
        print(f"| {variant} | {r['file_bytes'] / MIB:,.0f} MiB | +{(lo['RssAnon'] - b['RssAnon']) / MIB:,.0f} / "
              f"+{(lo['RssFile'] - b['RssFile']) / MIB:,.0f} MiB | +{(en['RssAnon'] - b['RssAnon']) / MIB:,.0f} / "
              f"+{(en['RssFile'] - b['RssFile']) / MIB:,.0f} MiB | {r['encode_s']:.2f} s ({r['tokens']} tokens) |")
    print("\n| computed, full size (36 layers) | text model | vision tower |")
    print("|---|---|---|")
    for variant, c in result["computed_full_size"].items():
        print(f"| {variant} | {c['text_bytes'] / GIB:.2f} GiB | {c['vision_bytes'] / GIB:.2f} GiB |")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
