"""LoRA figures on full-size random weights (issue 16 item 10).

    flock /tmp/lingbot-heavy.lock python -m bench.lora --json lora.json      # CPU (about 10 min, < 7 GB RSS)

Each part runs in a fresh process (its own RSS):

1. ``dense``: the full dense DiT (bf16 with fp32 islands, built once by :func:`bench.fp8.ensure_dit`) and a
   random rank-128 LoRA on all 7 Linears of all 24 blocks (LightX2V naming). Time and peak RSS (VmHWM,
   reset before each operation) to apply it (strength 1), change its strength (0.5) and remove it, the
   number of weights merged / restored, and a check that after the removal every touched weight equals
   the checkpoint's bit for bit. Then the DiT step time with and without the LoRA, interleaved.
2. ``dense_fp8``: the same on the DiT stored in fp8 (run-time adapters instead of merging).
3. ``moe_block``: one full MoE block (hidden 2048, 128 experts x 768, one shared expert) in a depth-1 DiT,
   with the LightX2V LoRA's 14 tensors for it; the operation times and touched bytes are also given
   scaled to 48 blocks (the LoRA's cost is per block; the experts it never touches are never read).
4. ``fp8_error``: one 2048 x 2048 Linear with a rank-128 LoRA: relative RMS output error against the fp32
   merge of (a) run-time adapters on fp8 (what the pack does), (b) merging into the bf16 weight and then
   quantizing once, (c) merging into the fp8 weight (a second rounding).

The ``apply`` path is the pack's own (``lora.read_stack`` + ``lora.apply_stack`` with the checkpoint read
back by ``checkpoint_files.checkpoint_tensor``), without a text encoder and VAE, which a LoRA does not touch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.fp8 import _peak_rss_mib, _rss_mib, ensure_dit

REPO = Path(__file__).resolve().parents[1]
RANK = 128
MOE_LAYERS = 48
MOE_VERSION = 1
MIB = 1024 * 1024


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def lora_specs(config: dict, depth: int, moe: bool):
    """LightX2V naming: to_q/k/v as .lora.down/.lora.up, to_out and the FFN (shared expert on the MoE) as lora_A/B."""
    h = config["hidden_size"]
    ffn = config["moe_intermediate_size"] * (config.get("n_shared_experts") or 1) if moe else config["intermediate_size"]
    ffn_prefix = "ffn.shared_experts" if moe else "ffn"
    out = []
    for b in range(depth):
        mods = [(f"blocks.{b}.attn.{n}", h, h) for n in ("to_q", "to_k", "to_v", "to_out")]
        mods += [(f"blocks.{b}.{ffn_prefix}.gate_proj", ffn, h), (f"blocks.{b}.{ffn_prefix}.up_proj", ffn, h),
                 (f"blocks.{b}.{ffn_prefix}.down_proj", h, ffn)]
        for name, out_f, in_f in mods:
            down, up = (".lora.down.weight", ".lora.up.weight") if name.rsplit(".", 1)[1] in ("to_q", "to_k", "to_v") \
                else (".lora_A.weight", ".lora_B.weight")
            out += [(name + down, (RANK, in_f)), (name + up, (out_f, RANK))]
    return out


def ensure_lora(path: Path, specs) -> Path:
    """A random bf16 LoRA file: down ~ N(0, 1/in) and up ~ N(0, 0.02/sqrt(rank)), so that the update is
    small against weights of N(0, 0.02) as a trained one is."""
    import torch
    from safetensors.torch import save_file

    if path.is_file():
        return path
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, shape in specs:
        std = (1 / shape[1]) ** 0.5 if "down" in name or "lora_A" in name else 0.02 / RANK ** 0.5
        tensors[name] = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp))
    tmp.rename(path)
    return path


def ensure_moe_block(workdir: Path) -> Path:
    """A depth-1 DiT with one full-size MoE block (the MoE 30B-A3B's layer), bf16 with fp32 islands."""
    import torch

    from bench.offload import write_random_dit

    root = workdir / f"lingbot-bench-dit-moe-block-v{MOE_VERSION}"
    if (root / "diffusion_pytorch_model.safetensors").is_file():
        return root
    partial = workdir / (root.name + ".partial")
    write_random_dit(partial, torch.Generator().manual_seed(0), depth=1, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5)
    partial.rename(root)
    return root


def _forward_inputs(config: dict):
    import torch

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 16, 1, 16, 16, generator=gen)  # 64 video tokens
    text = torch.randn(1, 16, config["text_dim"], generator=gen)
    return x, torch.tensor([500.0]), text


def run_part(folder: Path, lora: Path, dtype: str, reps: int) -> dict:
    import torch

    from lingbot_core.files.checkpoint_files import checkpoint_tensor
    from lingbot_core.loading import load_transformer
    from lingbot_core.model.lora import apply_stack, lora_targets, read_stack
    from lingbot_core.memory.budget import trim_heap

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    rss0 = _rss_mib()
    t = time.perf_counter()
    model = load_transformer(folder, getattr(torch, dtype) if dtype != "fp8_e4m3fn" else torch.float8_e4m3fn)
    out = {"dtype": dtype, "load_s": round(time.perf_counter() - t, 2), "rss_after_imports_mib": round(rss0),
           "rss_loaded_mib": round(_rss_mib()), "lora_file_mib": round(lora.stat().st_size / MIB, 1)}
    targets = lora_targets(model)
    merged: set = set()

    def original(key, dt):
        return checkpoint_tensor(folder, "transformer", key, dt)

    def apply(stack):
        _reset_peak()
        before = _rss_mib()
        t0 = time.perf_counter()
        report = apply_stack(model, read_stack(stack, targets), merged, original)
        trim_heap()
        return {"s": round(time.perf_counter() - t0, 2), "rss_before_mib": round(before), "rss_after_mib": round(_rss_mib()),
                "peak_rss_mib": round(_peak_rss_mib()), "merged": report.merged, "restored": report.restored,
                "run_time_layers": report.run_time, "adapter_mib": round(report.adapter_bytes / MIB, 1)}

    touched = sorted({k for k in merged} | {f"{m}.weight" for m in read_stack([(str(lora), 1.0)], targets)[0].modules})
    out["touched_weight_mib"] = round(sum(targets[k.rsplit(".", 1)[0]].weight.numel() * targets[k.rsplit(".", 1)[0]].weight.element_size()
                                          for k in touched) / MIB, 1)
    x, ts, text = _forward_inputs(model.config)
    with torch.no_grad():
        model(x, ts, text)  # warm-up: first touch of the memory-mapped weights
        out["apply"] = apply([(str(lora), 1.0)])
        out["change_strength"] = apply([(str(lora), 0.5)])
        out["remove"] = apply([])
        out["removal_bit_exact"] = all(torch.equal(targets[k.rsplit(".", 1)[0]].weight, original(k, targets[k.rsplit(".", 1)[0]].weight.dtype))
                                       for k in touched) if dtype != "fp8_e4m3fn" else None
        if dtype == "fp8_e4m3fn":
            out["removal_bit_exact"] = all(m.lora_down is None for m in targets.values())
        times = {"without": [], "with": []}
        for _ in range(reps):
            for label, stack in (("without", []), ("with", [(str(lora), 1.0)])):
                apply(stack)
                t0 = time.perf_counter()
                model(x, ts, text)
                times[label].append(time.perf_counter() - t0)
        out["step_s"] = {k: [round(v, 3) for v in vs] for k, vs in times.items()}
        out["step_median_s"] = {k: round(sorted(vs)[len(vs) // 2], 3) for k, vs in times.items()}
    out["peak_rss_total_mib"] = round(_peak_rss_mib())
    return out


def fp8_error() -> dict:
    import torch

    from lingbot_core.files.fp8 import dequantize, quantize

    gen = torch.Generator().manual_seed(3)
    n = 2048
    w = (torch.randn(n, n, generator=gen) * 0.02).to(torch.bfloat16)
    down = torch.randn(RANK, n, generator=gen) * (1 / n) ** 0.5
    up = torch.randn(n, RANK, generator=gen) * 0.02 / RANK ** 0.5
    x = torch.randn(256, n, generator=gen).to(torch.bfloat16)
    delta = up @ down
    ref = x.float() @ (w.float() + delta).t()

    def rel(y):
        return float((y.float() - ref).norm() / ref.norm())

    q, s = quantize(w, torch.float8_e4m3fn)
    wq = dequantize(q, s, torch.bfloat16)
    run_time = x @ wq.t() + (x @ down.to(torch.bfloat16).t()) @ up.to(torch.bfloat16).t()
    q1, s1 = quantize((w.float() + delta).to(torch.bfloat16), torch.float8_e4m3fn)
    once = x @ dequantize(q1, s1, torch.bfloat16).t()
    q2, s2 = quantize((wq.float() + delta).to(torch.bfloat16), torch.float8_e4m3fn)
    twice = x @ dequantize(q2, s2, torch.bfloat16).t()
    bf16_merge = x @ (w.float() + delta).to(torch.bfloat16).t()
    return {"delta_over_weight_rms": round(float(delta.norm() / w.float().norm()), 4),
            "rel_rms_error": {"bf16_merge": round(rel(bf16_merge), 5), "fp8_run_time_adapters": round(rel(run_time), 5),
                              "fp8_merge_then_quantize_once": round(rel(once), 5),
                              "fp8_merge_into_fp8_weight": round(rel(twice), 5)}}


def _child(part: str, workdir: Path, reps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "part.json"
        cmd = [sys.executable, "-m", "bench.lora", "--part", part, "--workdir", str(workdir), "--reps", str(reps),
               "--json", str(out)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench.lora part {part} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["all", "dense", "dense_fp8", "moe_block", "fp8_error"], default="all")
    p.add_argument("--workdir", default=os.environ.get("LINGBOT_BENCH_CACHE", str(Path.home() / ".cache" / "lingbot-bench")))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    workdir = Path(args.workdir).expanduser()
    workdir.mkdir(parents=True, exist_ok=True)
    if args.part == "all":
        result = {part: _child(part, workdir, args.reps) for part in ("fp8_error", "moe_block", "dense", "dense_fp8")}
        mb = result["moe_block"]
        result["moe_scaled_to_48_layers"] = {
            "apply_s": round(mb["apply"]["s"] * MOE_LAYERS, 1), "change_strength_s": round(mb["change_strength"]["s"] * MOE_LAYERS, 1),
            "remove_s": round(mb["remove"]["s"] * MOE_LAYERS, 1),
            "touched_weight_gib": round(mb["touched_weight_mib"] * MOE_LAYERS / 1024, 2),
            "lora_file_gib": round(mb["lora_file_mib"] * MOE_LAYERS / 1024, 2),
        }
    elif args.part == "fp8_error":
        result = fp8_error()
    else:
        import json as _json

        if args.part == "moe_block":
            folder = ensure_moe_block(workdir)
            depth, moe = 1, True
        else:
            folder = ensure_dit(workdir)
            depth, moe = 24, False
        config = _json.loads((folder / "config.json").read_text())
        lora = ensure_lora(workdir / f"lora-{'moe-block' if moe else 'dense'}-r{RANK}.safetensors", lora_specs(config, depth, moe))
        result = run_part(folder, lora, "fp8_e4m3fn" if args.part == "dense_fp8" else "bfloat16", args.reps)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
