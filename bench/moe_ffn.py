"""MoE feed-forward time before and after the sorted dispatch (issue 10), interleaved in one process.

    python -m bench.moe_ffn                         # full-size MoE block (128 experts, 2048 -> 768), 3,400 tokens
    python -m bench.moe_ffn --tokens 512 --repeats 3 --json out.json

One full-size ``MoEFeedForward`` (random bf16 weights, fp32 router) runs on the same input with
``before`` (the per-expert ``index_add_`` loop the pack used until issue 10, kept here as the baseline)
and with the current dispatch (``grouped``: ``torch._grouped_mm``; ``slices``: one matmul per expert
slice), alternating ``before``/``after`` in every repeat so load changes hit both alike. Reports the
median per variant, the ratio after/before, and whether the outputs are bit-identical.
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

from lingbot_core.transformer import MoEFeedForward, route_tokens  # noqa: E402

MOE_CFG = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, n_group=4, topk_group=2,
               n_shared_experts=1, routed_scaling_factor=2.5, score_func="sigmoid", norm_topk_prob=True)
DIM = 2048


def before(ffn: MoEFeedForward, f: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The MoE forward as it was before issue 10 (one index_add_ and one host sync per used expert)."""
    shape = f.shape
    tokens = f.reshape(-1, shape[-1])
    ids, gates = route_tokens(
        tokens, ffn.router.weight, ffn.router.e_score_correction_bias, top_k=ffn.top_k, n_group=ffn.n_group,
        topk_group=ffn.topk_group, norm_topk_prob=ffn.norm_topk_prob, routed_scaling_factor=ffn.routed_scaling_factor,
    )
    gates = gates.to(tokens.dtype)
    xb = tokens.to(torch.bfloat16)
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        x = xb[rows]
        h = F.silu(x @ ffn.experts.w1[e].to(torch.bfloat16).t()) * (x @ ffn.experts.w3[e].to(torch.bfloat16).t())
        y = h @ ffn.experts.w2[e].to(torch.bfloat16).t()
        out.index_add_(0, rows, y.float() * gates[rows, slot].float()[:, None])
    out = out.to(tokens.dtype)
    out = out + ffn.shared_experts(tokens, dtype).to(tokens.dtype)
    return out.reshape(shape)


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


def run(device="cpu", tokens: int = 3400, repeats: int = 5, seed: int = 0, tiny: bool = False) -> dict:
    device = torch.device(device)
    dim = TINY_DIM if tiny else DIM
    ffn = build(device, seed, TINY_CFG if tiny else MOE_CFG, dim)
    f = (torch.randn(1, tokens, dim, generator=torch.Generator().manual_seed(seed + 1)) * 1.0).to(torch.bfloat16).to(device)
    variants = {"before": lambda: before(ffn, f, torch.bfloat16)}
    grouped_ok = hasattr(torch, "_grouped_mm")
    for name, grouped in (("grouped", True), ("slices", False)):
        if grouped and not grouped_ok:
            continue
        variants[name] = (lambda grouped=grouped: _patched(ffn, f, grouped))
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
        "ratio_to_before": {k: round(v / med["before"], 3) for k, v in med.items() if k != "before"},
        "bit_identical_to_before": {k: bool(torch.equal(outputs[k], outputs["before"])) for k in outputs if k != "before"},
    }
    return report


def _patched(ffn, f, grouped):
    with mock.patch("lingbot_core.transformer._use_grouped_mm", return_value=grouped):
        return ffn(f, torch.bfloat16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=3400, help="tokens per block (3,120 video + ~280 text at 320x192x49)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    report = run(args.device, args.tokens, args.repeats)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(report["bit_identical_to_before"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
