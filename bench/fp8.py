"""fp8 vs bf16 DiT figures on full-size random weights (issue 10 item 4).

    python -m bench.fp8 --json fp8.json          # CPU; wrap in `flock /tmp/lingbot-heavy.lock` on shared machines

Writes (once, cached under ``--workdir``) the full-size dense DiT in the released layout (bf16 with fp32
islands, 1,357,171,264 params, N(0, 0.02) weights, norm scales 1 + N(0, 0.02)), then measures:

1. **bytes and load peak RSS**, one fresh process per precision: ``load_transformer`` with bf16 and
   with ``fp8_e4m3fn``; DiT bytes as loaded, RSS after imports, peak RSS (``ru_maxrss``), load time;
2. **fp8 error**: per quantized Linear, the relative RMS ``||dequant(fp8) - w|| / ||w||`` against the
   e4m3 rounding bound, and one full DiT velocity (fp8 vs bf16, both computed in bf16) on a small
   latent; the MoE expert stacks are checked on one full-size random stack (128 x 768 x 2048);
3. **resident accelerator weight bytes** of the DiT per offload mode (none, model, sequential,
   block K=0, block K=4) for both precisions, counted during one DiT forward by instrumenting the
   placement functions (accelerate's ``AlignDevicesHook`` and the pack's ``StreamUnit``), as
   ``tests/support/residency.py`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
DIT_VERSION = 1


def _peak_rss_mib() -> float:
    """VmHWM: this process's own peak (``ru_maxrss`` would include the parent's peak from before the exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ensure_dit(workdir: Path) -> Path:
    """The full-size dense DiT (config + one safetensors file), built once."""
    import torch

    from bench.offload import write_random_dit

    root = workdir / f"lingbot-bench-dit-dense-full-v{DIT_VERSION}"
    if (root / "diffusion_pytorch_model.safetensors").is_file():
        return root
    partial = workdir / (root.name + ".partial")
    write_random_dit(partial, torch.Generator().manual_seed(0))
    partial.rename(root)
    return root


def truncated_dit(folder: Path, depth: int) -> Path:
    """A copy of the DiT with only its first ``depth`` blocks (full width), for runs that must stay
    under 3 GB of RAM; read and written tensor by tensor."""
    from safetensors.torch import save_file

    from lingbot_core.files.checkpoint_files import SafetensorsReader

    out = folder.parent / f"{folder.name}-depth{depth}"
    if (out / "diffusion_pytorch_model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["depth"] = depth
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    reader = SafetensorsReader(folder / "diffusion_pytorch_model.safetensors")
    keep = [k for k in reader.keys() if not k.startswith("blocks.") or int(k.split(".")[1]) < depth]
    save_file({k: reader.get(k) for k in keep}, str(out / "diffusion_pytorch_model.safetensors"))
    return out


def _state_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def child_load(folder: str, precision: str) -> dict:
    """One precision's load, in a fresh process."""
    import torch

    from lingbot_core.loading import DIT_DTYPES, load_transformer

    torch.set_num_threads(2)
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    dit = load_transformer(Path(folder), DIT_DTYPES[precision])
    return {"precision": precision, "load_s": round(time.perf_counter() - t0, 2), "dit_bytes": _state_bytes(dit),
            "rss_before_load_mib": round(rss0), "peak_rss_mib": round(_peak_rss_mib()),
            "rss_after_load_mib": round(_rss_mib())}


def _dit_input(dit, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 3, 16, 24, generator=g)  # 3 x 8 x 12 = 288 video tokens
    e = torch.randn(1, 32, dit.config.text_dim, generator=g)
    return x, torch.tensor([600.0]), e


def _resident_during_forward(dit, mode: str, k: int) -> int:
    """Peak DiT weight bytes on the execution device during one forward under ``mode`` (CPU run)."""
    from unittest import mock

    import torch
    from accelerate.hooks import AlignDevicesHook

    from lingbot_core.memory.block_streaming import StreamUnit
    from lingbot_core.memory.offload import Offloader

    offloader = Offloader({"transformer": dit}, preload={"transformer": ["MoEFeedForward"]}, blocks_on_gpu=k)
    offloader.apply(mode, "cpu")
    state = {"now": 0, "peak": 0 if mode in ("sequential", "block") else _state_bytes(dit)}

    def nbytes(module, recurse):
        return sum(t.numel() * t.element_size() for t in list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse)))

    def bump(delta):
        state["now"] += delta
        state["peak"] = max(state["peak"], state["now"])

    o_pre, o_post, o_on, o_off = AlignDevicesHook.pre_forward, AlignDevicesHook.post_forward, StreamUnit.onload, StreamUnit.offload

    def pre(hook, module, *a, **kw):
        out = o_pre(hook, module, *a, **kw)
        if hook.offload:
            bump(nbytes(module, hook.place_submodules))
        return out

    def post(hook, module, output):
        if hook.offload:
            bump(-nbytes(module, hook.place_submodules))
        return o_post(hook, module, output)

    def on(unit, device, stream=None):
        if not unit.on_device:
            bump(unit.nbytes)
        return o_on(unit, device, stream)

    def unit_off(unit):
        if unit.on_device:
            bump(-unit.nbytes)
        return o_off(unit)

    x, t, e = _dit_input(dit)
    with mock.patch.object(AlignDevicesHook, "pre_forward", pre), mock.patch.object(AlignDevicesHook, "post_forward", post), \
            mock.patch.object(StreamUnit, "onload", on), mock.patch.object(StreamUnit, "offload", unit_off), torch.no_grad():
        with offloader.stage():
            dit(x, t, e)
    offloader.remove_hooks()
    return state["peak"]


def child_error_and_residency(folder: str) -> dict:
    import torch

    from lingbot_core.files.fp8 import dequantize, e4m3_relative_rms_bound, is_quantized_name, quantize, scale_name
    from lingbot_core.loading import load_transformer

    torch.set_num_threads(2)
    out = {}
    bf16 = load_transformer(Path(folder), torch.bfloat16)
    fp8 = load_transformer(Path(folder), torch.float8_e4m3fn)
    ref_sd, q_sd = bf16.state_dict(), fp8.state_dict()
    errors = []
    for name, w in ref_sd.items():
        if not is_quantized_name(name):
            continue
        deq = dequantize(q_sd[name], q_sd[scale_name(name)], torch.float32)
        errors.append(((deq - w.float()).norm() / w.float().norm()).item())
    errors.sort()
    bound = e4m3_relative_rms_bound()
    out["per_linear_rel_rms"] = {"count": len(errors), "min": errors[0], "median": errors[len(errors) // 2],
                                 "max": errors[-1], "e4m3_bound": bound, "max_over_bound": errors[-1] / bound}
    g = torch.Generator().manual_seed(3)
    w = torch.empty(128, 768, 2048, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g)
    q, s = quantize(w, torch.float8_e4m3fn, (128, 1, 1))
    err = ref = 0.0
    for e in range(w.shape[0]):  # one expert at a time: no fp32 copy of the stack
        we = w[e].float()
        err += (dequantize(q[e], s[e], torch.float32) - we).pow(2).sum().item()
        ref += we.pow(2).sum().item()
    out["moe_expert_stack_rel_rms"] = (err / ref) ** 0.5
    del w, q, s
    x, t, e = _dit_input(bf16)
    with torch.no_grad():
        v_ref, v_q = bf16(x, t, e).float(), fp8(x, t, e).float()
    out["dit_velocity"] = {"rel_rms": ((v_q - v_ref).norm() / v_ref.norm()).item(),
                           "max_abs": (v_q - v_ref).abs().max().item(), "ref_rms": v_ref.pow(2).mean().sqrt().item(),
                           "tokens": int(x.shape[2] * x.shape[3] * x.shape[4] / 4), "text_tokens": int(e.shape[1])}
    resident = {}
    for precision, dit in (("bf16", bf16), ("fp8_e4m3fn", fp8)):
        resident[precision] = {"dit_bytes": _state_bytes(dit)}
        for label, mode, k in (("none", "none", 0), ("model", "model", 0), ("sequential", "sequential", 0),
                               ("block K=0", "block", 0), ("block K=4", "block", 4)):
            resident[precision][label] = _resident_during_forward(dit, mode, k)
        block = dit.blocks[0]
        resident[precision]["one_block_bytes"] = sum(t.numel() * t.element_size() for t in block.state_dict().values())
    out["resident_bytes"] = resident
    out["peak_rss_mib"] = round(_peak_rss_mib())
    return out


def _child(kind: str, folder: str, *extra) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", "bench.fp8", "--_child", kind, folder, path, *extra], check=True, env=env, cwd=REPO)
    result = json.loads(Path(path).read_text())
    os.unlink(path)
    return result


def markdown(r: dict) -> str:
    gib = 1024 ** 3
    lines = ["| DiT precision | DiT bytes | vs bf16 | RSS before load MiB | load peak RSS MiB | peak - before MiB | load s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base = r["load"]["bf16"]["dit_bytes"]
    for p, x in r["load"].items():
        lines.append(f"| {p} | {x['dit_bytes'] / gib:.3f} GiB | {x['dit_bytes'] / base:.3f}x | {x['rss_before_load_mib']:,} | "
                     f"{x['peak_rss_mib']:,} | {x['peak_rss_mib'] - x['rss_before_load_mib']:,} | {x['load_s']} |")
    e = r["error"]["per_linear_rel_rms"]
    v = r["error"]["dit_velocity"]
    lines += ["", f"- per-Linear relative RMS error, fp8_e4m3fn vs the bf16 weights ({e['count']} Linears): min {e['min']:.5f}, "
              f"median {e['median']:.5f}, max {e['max']:.5f}; e4m3 rounding bound {e['e4m3_bound']:.5f} "
              f"(max / bound = {e['max_over_bound']:.3f})",
              f"- one full-size MoE expert stack (128 x 768 x 2048, per-expert scales): relative RMS {r['error']['moe_expert_stack_rel_rms']:.5f}",
              f"- full DiT velocity, fp8 vs bf16 weights (both computed in bf16; {v['tokens']} video + {v['text_tokens']} text tokens): "
              f"relative RMS {v['rel_rms']:.4f}, max |diff| {v['max_abs']:.4f} (velocity RMS {v['ref_rms']:.3f})", "",
              "| resident DiT weights MiB | none | model | sequential | block K=0 | block K=4 | one block |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for p, x in r["error"]["resident_bytes"].items():
        cells = " | ".join(f"{x[k] / MIB:,.1f}" for k in ("none", "model", "sequential", "block K=0", "block K=4", "one_block_bytes"))
        lines.append(f"| {p} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=os.environ.get("LINGBOT_BENCH_CACHE", str(Path.home() / ".cache" / "lingbot-bench")))
    p.add_argument("--json")
    p.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--load-only", action="store_true", help="only the bytes / load peak RSS part")
    p.add_argument("--error-depth", type=int, default=None,
                   help="run the error/residency part on the first N blocks only (full width; RAM under 3 GB)")
    args, rest = p.parse_known_args(argv)
    if args._child:
        kind, folder, path = args._child
        result = child_load(folder, rest[0]) if kind == "load" else child_error_and_residency(folder)
        Path(path).write_text(json.dumps(result))
        return 0
    sys.path.insert(0, str(REPO))
    folder = ensure_dit(Path(args.workdir).expanduser())
    report = {"dit": str(folder), "load": {}}
    if args.error_depth:
        report["error_depth"] = args.error_depth
        report["error"] = _child("error", str(truncated_dit(folder, args.error_depth)))
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return 0
    for precision in ("bf16", "fp8_e4m3fn"):
        report["load"][precision] = _child("load", str(folder), precision)
        print(f"[bench.fp8] load {precision}: {report['load'][precision]}", file=sys.stderr, flush=True)
    if args.load_only:
        print(json.dumps(report, indent=2))
    else:
        report["error"] = _child("error", str(folder))
        print(markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
