"""MoE feed-forward dispatch variants timed against each other, interleaved in one process; peak memory per variant.

    python -m bench.moe_ffn                         # full-size MoE block (128 experts, 2048 -> 768), 3,400 tokens
    python -m bench.moe_ffn --tokens 512 --repeats 3 --json out.json
    python -m bench.moe_ffn --peak --tokens 63240   # peak RSS of one layer call per variant, one fresh process each

One full-size ``MoEFeedForward`` (random bf16 weights, fp32 router) runs on the same input with every
variant, alternating them in every repeat so load changes hit all alike:

- ``before``: the per-expert ``index_add_`` loop the pack used until issue 10 (one scan and host sync per expert);
- ``issue10``: the dispatch of issue 10 (pairs sorted once, all N*k routed rows gathered at once, one
  matmul triple per expert slice, ``y.float() * w``), kept here as the baseline of issue 15;
- ``reference``: the reference implementation's approach, written from its description (pairs sorted
  once, each expert's group padded to a multiple of 16 rows, ``torch._grouped_mm`` on the bf16 stacks,
  weighted rows scattered back in one ``index_add_``): a timing comparison, its bits may differ;
- ``slices``: the pack's per-slice path now (each expert gathers only its own rows);
- ``grouped``: the pack's ``torch._grouped_mm`` path now.

Reports the median per variant, the ratios to ``before`` and to ``issue10``, and whether outputs are
bit-identical to them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lingbot_core.model.transformer import MoEFeedForward, route_tokens  # noqa: E402

MOE_CFG = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, n_group=4, topk_group=2,
               n_shared_experts=1, routed_scaling_factor=2.5, score_func="sigmoid", norm_topk_prob=True)
DIM = 2048


def _with_experts(ffn: MoEFeedForward, f: torch.Tensor, dtype: torch.dtype, experts) -> torch.Tensor:
    """The MoE forward with routed experts computed by ``experts(x bf16, ids, gates) -> fp32 sum``."""
    shape = f.shape
    tokens = f.reshape(-1, shape[-1])
    ids, gates = route_tokens(
        tokens, ffn.router.weight, ffn.router.e_score_correction_bias, top_k=ffn.top_k, n_group=ffn.n_group,
        topk_group=ffn.topk_group, norm_topk_prob=ffn.norm_topk_prob, routed_scaling_factor=ffn.routed_scaling_factor,
    )
    out = experts(tokens.to(torch.bfloat16), ids, gates.to(tokens.dtype)).to(tokens.dtype)
    out = out + ffn.shared_experts(tokens, dtype).to(tokens.dtype)
    return out.reshape(shape)


def _stack(ffn, name, e=None):
    w = getattr(ffn.experts, name)
    return (w if e is None else w[e]).to(torch.bfloat16)


def before(ffn: MoEFeedForward, f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The MoE forward as it was before issue 10 (one index_add_ and one host sync per used expert)."""

    def experts(xb, ids, gates):
        out = torch.zeros(xb.shape[0], ffn.experts.w2.shape[1], dtype=torch.float32, device=xb.device)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            x = xb[rows]
            h = F.silu(x @ _stack(ffn, "w1", e).t()) * (x @ _stack(ffn, "w3", e).t())
            y = h @ _stack(ffn, "w2", e).t()
            out.index_add_(0, rows, y.float() * gates[rows, slot].float()[:, None])
        return out

    return _with_experts(ffn, f, dtype, experts)


def issue10(ffn: MoEFeedForward, f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dispatch of issue 10: sorted pairs, every routed row gathered at once, one matmul triple per slice."""

    def experts(x, ids, gates):
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        rows = order // k
        xs = x[rows]
        weights = gates.reshape(-1)[order].float()[:, None]
        counts = torch.bincount(flat, minlength=ffn.experts.w1.shape[0])
        out = torch.zeros(n, ffn.experts.w2.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for e, count in enumerate(counts.tolist()):
            if count:
                part = slice(start, start + count)
                h = F.silu(xs[part] @ _stack(ffn, "w1", e).t()) * (xs[part] @ _stack(ffn, "w3", e).t())
                y = h @ _stack(ffn, "w2", e).t()
                out.index_add_(0, rows[part], y.float() * weights[part])
                start += count
        return out

    return _with_experts(ffn, f, dtype, experts)


PAD_ROWS = 16


def reference(ffn: MoEFeedForward, f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference's approach (from its description): sorted pairs, groups padded to PAD_ROWS rows,
    ``torch._grouped_mm`` on the bf16 stacks, one scatter back."""

    def experts(x, ids, gates):
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=ffn.experts.w1.shape[0])
        padded = (counts + PAD_ROWS - 1) // PAD_ROWS * PAD_ROWS
        ends = padded.cumsum(0)
        # destination row of each sorted pair inside the padded layout
        group_start = ends - padded
        rank = torch.arange(n * k, device=x.device) - (counts.cumsum(0) - counts).repeat_interleave(counts)
        dest = group_start.repeat_interleave(counts) + rank
        xs = x.new_zeros(int(ends[-1]), x.shape[1])
        xs[dest] = x[order // k]
        offs = ends.to(torch.int32)
        h = F.silu(torch._grouped_mm(xs, _stack(ffn, "w1").transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(xs, _stack(ffn, "w3").transpose(-2, -1), offs=offs)
        ys = torch._grouped_mm(h, _stack(ffn, "w2").transpose(-2, -1), offs=offs)[dest]
        out = torch.zeros(n, ys.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, order // k, ys.float() * gates.reshape(-1)[order].float()[:, None])
        return out

    return _with_experts(ffn, f, dtype, experts)


# A small MoE block for smoke runs (same routing structure, 64x fewer expert weights).
TINY_CFG = dict(MOE_CFG, num_experts=32, moe_intermediate_size=96)
TINY_DIM = 256


def build(device: torch.device, seed: int = 0, cfg: dict = MOE_CFG, dim: int = DIM) -> MoEFeedForward:
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        ffn = MoEFeedForward(dim, cfg)
    for module in ffn.modules():
        for name, p in list(module._parameters.items()) + list(module._buffers.items()):
            if p is None:
                continue
            keep_fp32 = module is ffn.router
            t = torch.empty(p.shape, dtype=torch.float32 if keep_fp32 else torch.bfloat16)
            t.normal_(0.0, 0.02, generator=g)
            if name == "e_score_correction_bias":
                t.zero_()
            setattr(module, name, torch.nn.Parameter(t, requires_grad=False) if name in module._parameters else t)
    return ffn.to(device).eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(device="cpu", tokens: int = 3400, repeats: int = 5, seed: int = 0, tiny: bool = False, only=None) -> dict:
    device = torch.device(device)
    dim = TINY_DIM if tiny else DIM
    ffn = build(device, seed, TINY_CFG if tiny else MOE_CFG, dim)
    f = (torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(seed + 1)) * 1.0).to(torch.bfloat16).to(device)
    variants = {k: v for k, v in _variants(ffn, f).items() if not only or k in only}
    times = {k: [] for k in variants}
    outputs = {}
    with torch.no_grad():
        for name, fn in variants.items():  # warm-up, and the outputs compared below
            outputs[name] = fn().float().cpu()
            _sync(device)
        for _ in range(repeats):
            for name, fn in variants.items():
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "device": str(device), "tokens": tokens, "size": "tiny" if tiny else "full", "repeats": repeats, "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }
    ref = fp64_reference(ffn, f).cpu()
    report["vs_fp64"] = {k: error_vs(outputs[k], ref) for k in ("slices", "grouped") if k in outputs}
    for base in ("before", "issue10"):
        if base in med:
            report[f"ratio_to_{base}"] = {k: round(v / med[base], 3) for k, v in med.items() if k != base}
            report[f"bit_identical_to_{base}"] = {k: bool(torch.equal(outputs[k], outputs[base])) for k in outputs if k != base}
            report[f"max_abs_diff_to_{base}"] = {k: float((outputs[k] - outputs[base]).abs().max()) for k in outputs if k != base}
    return report


def _variants(ffn, f) -> dict:
    variants = {"before": lambda: before(ffn, f, torch.bfloat16), "issue10": lambda: issue10(ffn, f, torch.bfloat16)}
    if hasattr(torch, "_grouped_mm"):
        variants["reference"] = lambda: reference(ffn, f, torch.bfloat16)
        variants["grouped"] = lambda: _patched(ffn, f, True)
    variants["slices"] = lambda: _patched(ffn, f, False)
    return variants


def fp64_reference(ffn: MoEFeedForward, f: torch.Tensor) -> torch.Tensor:
    """The MoE forward with the routed experts as an fp64 product of the same bf16 operands (the bf16
    input rows, the bf16 expert weights, the routing of the pack), without the bf16 rounding of the
    intermediate; the shared expert as every variant computes it. fp64, on ``f``'s device."""

    def experts(xb, ids, gates):
        out = torch.zeros(xb.shape[0], ffn.experts.w2.shape[1], dtype=torch.float64, device=xb.device)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            x = xb[rows].double()
            h = F.silu(x @ _stack(ffn, "w1", e).double().t()) * (x @ _stack(ffn, "w3", e).double().t())
            out.index_add_(0, rows, (h @ _stack(ffn, "w2", e).double().t()) * gates[rows, slot].double()[:, None])
        return out

    shape = f.shape
    tokens = f.reshape(-1, shape[-1])
    ids, gates = route_tokens(
        tokens, ffn.router.weight, ffn.router.e_score_correction_bias, top_k=ffn.top_k, n_group=ffn.n_group,
        topk_group=ffn.topk_group, norm_topk_prob=ffn.norm_topk_prob, routed_scaling_factor=ffn.routed_scaling_factor,
    )
    out = experts(tokens.to(torch.bfloat16), ids, gates.to(tokens.dtype))
    out = out + ffn.shared_experts(tokens, torch.bfloat16).double()
    return out.reshape(shape)


def error_vs(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """``out``'s error against ``ref`` (fp64): relative RMS, and the largest error in bf16 ulps of its row's
    largest magnitude (the spacing of bf16 numbers at that magnitude: 2^(floor(log2 m) - 7))."""
    out, ref = out.double().reshape(-1, ref.shape[-1]), ref.double().reshape(-1, ref.shape[-1])
    err = (out - ref).abs()
    rel_rms = float(err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300))
    row_max = ref.abs().amax(dim=-1).clamp_min(1e-30)
    ulp = torch.exp2(torch.floor(torch.log2(row_max)) - 7)
    return {"rel_rms": rel_rms, "max_ulps": float((err.amax(dim=-1) / ulp).max())}


def _vm(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_one(variant: str, tokens: int, seed: int = 0, tiny: bool = False) -> dict:
    """Peak RSS (MiB) of one layer call of ``variant`` above the RSS after a warm-up call (Linux)."""
    dim = TINY_DIM if tiny else DIM
    ffn = build(torch.device("cpu"), seed, TINY_CFG if tiny else MOE_CFG, dim)
    f = torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    fn = _variants(ffn, f)[variant]
    with torch.no_grad():
        fn()  # warm-up: kernel set-up and allocator arenas are not the variant's memory
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start = _vm("VmRSS")
    t0 = time.perf_counter()
    with torch.no_grad():
        fn()
    return {"variant": variant, "tokens": tokens, "rss_start_mib": round(start), "peak_above_start_mib": round(_vm("VmHWM") - start),
            "wall_s": round(time.perf_counter() - t0, 2)}


def peaks(tokens: int, variants=("issue10", "slices"), tiny: bool = False) -> list:
    """:func:`peak_one` per variant, each in a fresh process (so one variant's freed pages do not hide another's)."""
    import subprocess

    out = []
    for v in variants:
        code = f"import json; from bench.moe_ffn import peak_one; print(json.dumps(peak_one({v!r}, {tokens}, tiny={tiny})))"
        res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def _patched(ffn, f, grouped):
    with mock.patch("lingbot_core.model.transformer._use_grouped_mm", return_value=grouped):
        return ffn(f, torch.bfloat16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=3400, help="tokens per block (3,120 video + ~280 text at 320x192x49)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--peak", action="store_true", help="peak RSS of one call of issue10 and slices instead of timings (CPU)")
    p.add_argument("--tiny", action="store_true", help="the small smoke-test block")
    p.add_argument("--only", help="comma-separated variants to time (default: all)")
    args = p.parse_args(argv)
    if args.peak:
        rows = peaks(args.tokens, tiny=args.tiny)
        print(json.dumps(rows, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    report = run(args.device, args.tokens, args.repeats, tiny=args.tiny, only=args.only.split(",") if args.only else None)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    bits = report.get("bit_identical_to_before") or report.get("bit_identical_to_issue10") or {}
    return 0 if bits.get("slices", True) and bits.get("grouped", True) else 1


if __name__ == "__main__":
    sys.exit(main())
