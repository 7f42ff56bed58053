"""A lockstep DiT call converts each stored weight once for its CFG branches (issue 51, findings 7 and 8).

The whole tiny DiT with every Linear weight stored as GGUF Q8_0 bytes (gguf-py's quantizer), or as fp8
with a scale: one call on two branches (lockstep) must dequantize each stored weight exactly once,
the top-level per-branch Linears (text embedding, output projection) as well as the blocks', drop the
held copies after the call, and give the frames of the branches run one by one, bit for bit.
"""

from __future__ import annotations

from collections import Counter
from unittest import mock

import gguf
import numpy as np
import pytest
import torch

from lingbot_core.files import fp8 as fp8_files
from lingbot_core.files import gguf_weights
from lingbot_core.model import transformer as transformer_module
from lingbot_core.model.transformer import Linear, LingBotVideoTransformer3DModel
from lingbot_core.testing.fixtures import dit_config, dit_state_dict


def _model(store: str) -> LingBotVideoTransformer3DModel:
    state, config = dit_state_dict(dit_config(), seed=3, fp32=True)
    model = LingBotVideoTransformer3DModel(**config)
    model.load_state_dict(state)
    model.stored_compute_dtype = torch.bfloat16  # what a GGUF or fp8 load sets
    for m in model.modules():
        if not isinstance(m, Linear) or m.weight.shape[1] % 32:
            continue
        values = m.weight.detach().float()
        if store == "gguf":
            raw = gguf.quants.quantize(values.numpy(), gguf.GGMLQuantizationType.Q8_0)
            m.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(raw)), requires_grad=False)
            m.weight_qtype = "Q8_0"
        else:
            q, scale = fp8_files.quantize(values, torch.float8_e4m3fn)
            m.weight = torch.nn.Parameter(q, requires_grad=False)
            m.scale_weight = scale
    return model.eval()


def _count_conversions(model, store, run):
    """(run's result, Counter of stored weights converted: data pointer -> times)."""
    seen = Counter()
    if store == "gguf":
        orig, target, name = gguf_weights.dequantize, gguf_weights, "dequantize"
    else:
        orig, target, name = transformer_module.dequantize, transformer_module, "dequantize"

    def counting(raw, *a, **k):
        seen[raw.data_ptr()] += 1
        return orig(raw, *a, **k)

    with torch.no_grad(), mock.patch.object(target, name, counting):
        out = run()
    return out, seen


@pytest.mark.parametrize("store", ["gguf", "fp8"])
def test_a_lockstep_dit_call_converts_every_stored_weight_once(store):
    model = _model(store)
    stored = {m.weight.data_ptr(): n for n, m in model.named_modules()
              if isinstance(m, Linear) and m.converts}
    top_level = {p for p, n in stored.items() if not n.startswith("blocks.")}
    per_branch = {p for p, n in stored.items() if n.startswith(("text_embedder.", "proj_out"))}
    assert len(per_branch) == 3 and per_branch <= top_level  # text_embedder.linear_1/2 and proj_out
    g = torch.Generator().manual_seed(4)
    latents = torch.randn(1, 16, 2, 4, 6, generator=g)
    t = torch.tensor([700.0])
    texts = [torch.randn(1, 5, 64, generator=g), torch.randn(1, 3, 64, generator=g)]

    both, lockstep = _count_conversions(model, store, lambda: model(latents, t, texts))
    alone, one_by_one = _count_conversions(model, store, lambda: [model(latents, t, x) for x in texts])
    assert set(lockstep) == set(stored) and set(lockstep.values()) == {1}, \
        sorted(stored[p] for p, n in lockstep.items() if n > 1)
    assert all(one_by_one[p] == 2 for p in stored)  # one call per branch: each weight twice
    assert all(m._held is None for m in model.modules() if isinstance(m, Linear))  # dropped after the call
    for a, b in zip(both, alone):
        assert torch.equal(a, b)
