"""The LingBot-Video DiT: checkpoint names/shapes, dtype policy, patchify, RoPE, timestep embedding and
MoE routing (model doc §2-§5)."""

import math

import pytest
import torch
import torch.nn.functional as F

from lingbot_core.testing.fixtures import dit_config, dit_state_dict
from lingbot_core.model.transformer import (
    LingBotVideoTransformer3DModel, MoEFeedForward, SwiGLU, TransformerBlock, apply_rope, is_fp32_island, patchify,
    rope_frequencies, rope_position_ids, route_tokens, timestep_projection, unpatchify,
)
from lingbot_core.model import rowwise
from support.live_bytes import LiveBytes

MOE_FULL = dict(
    depth=48, axes_lens=[4096, 512, 512], num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, score_func="sigmoid",
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
)


def _meta_model(**cfg):
    with torch.device("meta"):
        return LingBotVideoTransformer3DModel(**cfg)


@pytest.fixture(scope="module")
def full_dense():
    return _meta_model()


@pytest.fixture(scope="module")
def full_moe():
    return _meta_model(**MOE_FULL)


# ---------------------------------------------------------------------------------------------
# Checkpoint conformance (model doc §3)
# ---------------------------------------------------------------------------------------------


def test_full_dense_counts(full_dense):
    sd = full_dense.state_dict()
    assert len(sd) == 377
    assert sum(t.numel() for t in sd.values()) == 1_357_171_264
    assert sum(t.numel() for k, t in sd.items() if is_fp32_island(k)) == 38_793_728


def test_full_moe_counts(full_moe):
    sd = full_moe.state_dict()
    assert len(sd) == 977
    assert sum(t.numel() for t in sd.values()) == 30_084_512_320
    assert sum(t.numel() for k, t in sd.items() if is_fp32_island(k)) == 51_880_448


# Rows of the §3 table: name -> (dense shape, kept fp32).
TOP_LEVEL = {
    "patch_embedder.weight": ([2048, 64], False), "patch_embedder.bias": ([2048], False),
    "time_embedder.linear_1.weight": ([2048, 256], True), "time_embedder.linear_1.bias": ([2048], True),
    "time_embedder.linear_2.weight": ([2048, 2048], True), "time_embedder.linear_2.bias": ([2048], True),
    "time_modulation.1.weight": ([12288, 2048], True), "time_modulation.1.bias": ([12288], True),
    "text_embedder.norm.weight": ([2560], True),
    "text_embedder.linear_1.weight": ([2048, 2560], False), "text_embedder.linear_1.bias": ([2048], False),
    "text_embedder.linear_2.weight": ([2048, 2048], False), "text_embedder.linear_2.bias": ([2048], False),
    "norm_out_modulation.1.weight": ([4096, 2048], True), "norm_out_modulation.1.bias": ([4096], True),
    "proj_out.weight": ([64, 2048], False), "proj_out.bias": ([64], False),
}
BLOCK_COMMON = {
    "scale_shift_table": ([1, 12288], True),
    "norm1.weight": ([2048], True), "norm2.weight": ([2048], True),
    "norm_post_attn.weight": ([2048], True), "norm_post_ffn.weight": ([2048], True),
    "attn.to_q.weight": ([2048, 2048], False), "attn.to_k.weight": ([2048, 2048], False),
    "attn.to_v.weight": ([2048, 2048], False),
    "attn.norm_q.weight": ([128], True), "attn.norm_k.weight": ([128], True),
    "attn.to_out.weight": ([2048, 2048], False), "attn.to_out.bias": ([2048], False),
}
BLOCK_DENSE = {
    "ffn.gate_proj.weight": ([6144, 2048], False), "ffn.up_proj.weight": ([6144, 2048], False),
    "ffn.down_proj.weight": ([2048, 6144], False),
}
BLOCK_MOE = {
    "ffn.router.weight": ([128, 2048], True), "ffn.router.e_score_correction_bias": ([128], True),
    "ffn.experts.w1": ([128, 768, 2048], False), "ffn.experts.w3": ([128, 768, 2048], False),
    "ffn.experts.w2": ([128, 2048, 768], False),
    "ffn.shared_experts.gate_proj.weight": ([768, 2048], False),
    "ffn.shared_experts.up_proj.weight": ([768, 2048], False),
    "ffn.shared_experts.down_proj.weight": ([2048, 768], False),
}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_names_and_shapes_match_table(kind, full_dense, full_moe):
    model, depth, block_ffn = (full_dense, 24, BLOCK_DENSE) if kind == "dense" else (full_moe, 48, BLOCK_MOE)
    expected = dict(TOP_LEVEL)
    for i in range(depth):
        for suffix, row in {**BLOCK_COMMON, **block_ffn}.items():
            expected[f"blocks.{i}.{suffix}"] = row
    sd = model.state_dict()
    assert set(sd) == set(expected)  # no extra, no missing names (no bias on q/k/v, no norm_out affine)
    for name, (shape, fp32) in expected.items():
        assert list(sd[name].shape) == shape, name
        assert is_fp32_island(name) == fp32, name


def test_router_bias_is_a_persistent_buffer(full_moe):
    buffers = dict(full_moe.named_buffers())
    params = dict(full_moe.named_parameters())
    assert "blocks.0.ffn.router.e_score_correction_bias" in buffers
    assert "blocks.0.ffn.router.e_score_correction_bias" not in params
    assert "blocks.0.ffn.experts.w1" in params  # raw parameters, read by the MoE block


def test_head_dim_must_equal_sum_of_axes_dims():
    with pytest.raises(ValueError, match="axes_dims"):
        _meta_model(hidden_size=64, num_attention_heads=2, axes_dims=[8, 12, 14])
    with pytest.raises(ValueError, match="head_dim"):
        _meta_model(hidden_size=65, num_attention_heads=2, axes_dims=[8, 12, 12])


# ---------------------------------------------------------------------------------------------
# Patchify (§5.2, §5.10)
# ---------------------------------------------------------------------------------------------


def test_patchify_token_and_feature_order():
    b, c, t, h, w = 1, 3, 2, 4, 6
    x = torch.arange(b * c * t * h * w, dtype=torch.float32).reshape(b, c, t, h, w)
    tokens = patchify(x)
    gt, gh, gw = t, h // 2, w // 2
    assert tokens.shape == (b, gt * gh * gw, 4 * c)
    for f in range(gt):
        for i in range(gh):
            for j in range(gw):
                n = (f * gh + i) * gw + j  # (f, h, w) raster, f slowest
                for ph in range(2):
                    for pw in range(2):
                        for ch in range(c):
                            feat = (ph * 2 + pw) * c + ch  # (pf, ph, pw, c), channel fastest
                            assert tokens[0, n, feat] == x[0, ch, f, 2 * i + ph, 2 * j + pw]


def test_patchify_round_trip():
    x = torch.randn(2, 16, 3, 8, 12)
    tokens = patchify(x)
    assert torch.equal(unpatchify(tokens, (3, 4, 6), 16), x)


# ---------------------------------------------------------------------------------------------
# RoPE (§5.5)
# ---------------------------------------------------------------------------------------------


def test_rope_position_ids_video_then_text():
    grid, text_len = (2, 2, 3), 4
    pos = rope_position_ids(grid, text_len)
    assert pos.shape == (12 + 4, 3)
    rows = pos.tolist()
    expected_video = [[text_len + 1 + f, i, j] for f in range(2) for i in range(2) for j in range(3)]
    assert rows[:12] == expected_video
    assert rows[12:] == [[1, 0, 0], [2, 0, 0], [3, 0, 0], [4, 0, 0]]


def test_rope_frequencies_against_float64():
    axes_dims, theta = [32, 48, 48], 256.0
    pos = torch.tensor([[0, 0, 0], [19, 5, 7], [4000, 300, 1023]])
    freqs = rope_frequencies(pos, axes_dims, theta)
    assert freqs.dtype == torch.float32  # real (cos, sin) pairs: inductor compiles no complex ops
    assert freqs.shape == (3, 64, 2)
    for r, p in enumerate(pos.tolist()):
        col = 0
        for axis, d in enumerate(axes_dims):
            for k in range(d // 2):
                angle64 = p[axis] * (1.0 / theta ** (2 * k / d))
                angle = float(torch.tensor(angle64, dtype=torch.float64).to(torch.float32))  # cast as the reference
                cos, sin = freqs[r, col].tolist()
                assert cos == pytest.approx(math.cos(angle), abs=2e-6)
                assert sin == pytest.approx(math.sin(angle), abs=2e-6)
                col += 1


def test_apply_rope_is_interleaved_pair_rotation():
    q = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    a, b = 0.3, -1.1
    freqs = torch.view_as_real(torch.polar(torch.ones(1, 2), torch.tensor([[a, b]])))
    out = apply_rope(q, freqs).view(-1).tolist()
    expected = [
        1 * math.cos(a) - 2 * math.sin(a), 1 * math.sin(a) + 2 * math.cos(a),
        3 * math.cos(b) - 4 * math.sin(b), 3 * math.sin(b) + 4 * math.cos(b),
    ]
    assert out == pytest.approx(expected, abs=1e-6)
    # Not the rotate-half form (which would pair 0 with 2 and 1 with 3).
    rotate_half = [1 * math.cos(a) - 3 * math.sin(a)]
    assert out[0] != pytest.approx(rotate_half[0], abs=1e-3)


def test_apply_rope_preserves_norm_and_dtype():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 10, 2, 32, generator=g)
    pos = rope_position_ids((1, 2, 3), 4)
    freqs = rope_frequencies(pos, [8, 12, 12], 256.0)
    out = apply_rope(x, freqs)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    assert apply_rope(x.to(torch.bfloat16), freqs).dtype == torch.bfloat16
    # Text rows at positions (j+1, 0, 0) still rotate along t; video rows differ from the identity too.
    assert not torch.allclose(out, x)


def test_real_rope_matches_the_complex_product():
    """Issue 24 item 7: the rotation with real cos/sin gives the complex64 product's numbers within 1e-6
    (an independent computation: torch's complex multiply of the complex table), at the DiT's head size
    and the released RoPE's axes, for fp32 and bf16 inputs."""
    g = torch.Generator().manual_seed(3)
    pos = rope_position_ids((3, 6, 10), 12)
    freqs = rope_frequencies(pos, [32, 48, 48], 256.0)
    table = torch.view_as_complex(freqs.contiguous())
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(1, pos.shape[0], 4, 128, generator=g) * 3).to(dtype)
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * table[None, :, None, :]
        expected = torch.view_as_real(z).flatten(-2)
        got = apply_rope(x, freqs)
        assert got.dtype == dtype
        if dtype == torch.float32:
            assert (got - expected).abs().max() <= 1e-6 * expected.abs().max().clamp_min(1)
        else:  # both round the same fp32 result to bf16: equal but where the fp32 values straddle a rounding edge
            assert (got.float() - expected.to(dtype).float()).abs().max() <= 2 ** -7 * expected.abs().max()


# ---------------------------------------------------------------------------------------------
# Timestep embedding (§5.6)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [256, 32])
def test_timestep_projection_matches_diffusers(dim):
    from diffusers.models.embeddings import get_timestep_embedding

    t = torch.tensor([0.0, 1.0, 71.0, 498.0, 852.0, 999.0, 1000.0])
    ours = timestep_projection(t, dim)
    ref = get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)
    assert ours.shape == (len(t), dim)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    # cos first: t = 0 gives ones then zeros.
    assert ours[0, : dim // 2].eq(1).all() and ours[0, dim // 2 :].eq(0).all()


# ---------------------------------------------------------------------------------------------
# dtype policy (§4) and forward
# ---------------------------------------------------------------------------------------------


def _tiny_model(moe: bool, seed: int = 0) -> LingBotVideoTransformer3DModel:
    state, cfg = dit_state_dict(dit_config(moe), seed=seed, fp32=True)
    model = LingBotVideoTransformer3DModel(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_to_bf16_keeps_fp32_islands(moe):
    model = _tiny_model(moe).to(torch.bfloat16)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in tensors.items():
        assert t.dtype == (torch.float32 if is_fp32_island(name) else torch.bfloat16), name
    assert tensors["blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    assert tensors["blocks.0.norm1.weight"].dtype == torch.float32
    assert tensors["time_modulation.1.weight"].dtype == torch.float32
    assert model.compute_dtype == torch.bfloat16
    # Device + dtype in one call behaves the same.
    model.to("cpu", torch.float32)
    assert all(t.dtype == torch.float32 for t in model.parameters())


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_bf16_forward_close_to_fp32(moe):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 2, 4, 6, generator=g)
    text = torch.randn(1, 5, 64, generator=g)
    t = torch.tensor([749.0])
    model = _tiny_model(moe)
    ref = model(x, t, text)
    assert ref.shape == x.shape and ref.dtype == torch.float32
    out = model.to(torch.bfloat16)(x, t, text)
    assert out.shape == x.shape
    assert torch.isfinite(out.float()).all()
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 0.05
    assert not torch.equal(out.float(), ref)  # it really ran in bf16


def test_forward_depends_on_timestep_and_text():
    model = _tiny_model(False)
    g = torch.Generator().manual_seed(4)
    x, text = torch.randn(1, 16, 1, 4, 4, generator=g), torch.randn(1, 3, 64, generator=g)
    a = model(x, torch.tensor([999.0]), text)
    assert not torch.allclose(a, model(x, torch.tensor([500.0]), text))
    assert not torch.allclose(a, model(x, torch.tensor([999.0]), text + 1))


def test_forward_rejects_latent_not_divisible_by_patch():
    model = _tiny_model(False)
    with pytest.raises(ValueError, match="patch_size"):
        model(torch.randn(1, 16, 1, 5, 4), torch.tensor([500.0]), torch.randn(1, 3, 64))


# ---------------------------------------------------------------------------------------------
# MoE routing (§5.8)
# ---------------------------------------------------------------------------------------------

ROUTE = dict(top_k=2, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)


def _route_logits(logits: list[float], bias: list[float]):
    """Tokens of width 1 with value 1: the router weight column is the logit vector."""
    tokens = torch.ones(1, 1)
    weight = torch.tensor(logits).view(8, 1)
    ids, gates = route_tokens(tokens, weight, torch.tensor(bias), **ROUTE)
    order = ids[0].argsort()
    return ids[0][order].tolist(), gates[0][order]


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_route_group_wins_by_sum_of_top2():
    # Expert 0 has the best single score, but group 1 (experts 4-7) has the larger top-2 sum.
    logits = [3.0, -3.0, -3.0, -3.0, 1.0, 0.5, -3.0, -3.0]
    ids, gates = _route_logits(logits, [0.0] * 8)
    assert ids == [4, 5]
    s4, s5 = _sig(1.0), _sig(0.5)
    assert gates.dtype == torch.float32
    torch.testing.assert_close(gates, torch.tensor([s4, s5]) / (s4 + s5) * 2.5, rtol=1e-6, atol=1e-6)
    assert gates.sum().item() == pytest.approx(2.5, abs=1e-6)


def test_route_bias_changes_selection_but_gates_use_bias_free_scores():
    logits = [3.0, -3.0, -3.0, -3.0, 1.0, 0.5, -3.0, -3.0]
    bias = [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # group 0 top-2 sum: .953 + .547 > 1.353
    ids, gates = _route_logits(logits, bias)
    assert ids == [0, 1]
    s0, s1 = _sig(3.0), _sig(-3.0)
    torch.testing.assert_close(gates, torch.tensor([s0, s1]) / (s0 + s1) * 2.5, rtol=1e-6, atol=1e-6)


def test_route_bias_within_group_picks_other_expert():
    logits = [-3.0, -3.0, -3.0, -3.0, 1.0, 0.5, 0.0, -3.0]
    bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.4, 0.0]  # expert 6 overtakes expert 5 for selection only
    ids, gates = _route_logits(logits, bias)
    assert ids == [4, 6]
    s4, s6 = _sig(1.0), _sig(0.0)
    torch.testing.assert_close(gates, torch.tensor([s4, s6]) / (s4 + s6) * 2.5, rtol=1e-6, atol=1e-6)


def test_route_uniform_bias_changes_nothing():
    logits = [0.2, -1.0, 0.7, 0.1, 1.0, 0.5, -0.3, 2.0]
    a = _route_logits(logits, [0.0] * 8)
    b = _route_logits(logits, [0.3] * 8)
    assert a[0] == b[0] == [4, 7]
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


def test_route_tokens_independently():
    # Two tokens, two router input features: token k reads column k of the router weight.
    w = torch.tensor([[3.0, -3.0], [-3.0, -3.0], [-3.0, 2.0], [-3.0, 2.5], [1.0, -3.0], [0.5, -3.0],
                      [-3.0, -3.0], [-3.0, -3.0]])
    ids, gates = route_tokens(torch.eye(2), w, torch.zeros(8), **ROUTE)
    assert sorted(ids[0].tolist()) == [4, 5]
    assert sorted(ids[1].tolist()) == [2, 3]
    assert gates.shape == (2, 2)


def _moe_reference(ffn, f, expert_dtype):
    """Per-token loop: bias-corrected group-limited selection, bias-free normalised gates x 2.5,
    experts with ``expert_dtype`` operands accumulated in fp32, plus the shared SwiGLU expert (fp32)."""
    dim = f.shape[-1]
    W = ffn.router.weight.float()
    bias = ffn.router.e_score_correction_bias.float()
    w1, w2, w3 = (t.to(expert_dtype) for t in (ffn.experts.w1, ffn.experts.w2, ffn.experts.w3))
    sh = ffn.shared_experts
    tokens = f.reshape(-1, dim)
    ref = torch.zeros(tokens.shape)
    used = set()
    for n, tok in enumerate(tokens):
        s = torch.sigmoid(W @ tok)
        sel = (s + bias).tolist()
        groups = [sel[0:4], sel[4:8]]
        group_scores = [sum(sorted(gr, reverse=True)[:2]) for gr in groups]
        best = max(range(2), key=lambda i: group_scores[i])
        candidates = list(range(4 * best, 4 * best + 4))
        chosen = sorted(candidates, key=lambda e: sel[e], reverse=True)[:2]
        used.update(chosen)
        gsum = sum(s[e].item() for e in chosen)
        acc = torch.zeros(dim, dtype=torch.float32)
        xb = tok.to(expert_dtype)
        for e in chosen:
            h = F.silu(xb @ w1[e].t()) * (xb @ w3[e].t())
            y = h @ w2[e].t()
            acc += (s[e].item() / (gsum + 1e-20) * 2.5) * y.float()
        shared = F.linear(F.silu(F.linear(tok, sh.gate_proj.weight)) * F.linear(tok, sh.up_proj.weight),
                          sh.down_proj.weight)
        ref[n] = acc + shared
    return ref, used


def test_moe_ffn_matches_per_token_reference():
    cfg = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
               n_shared_experts=1, routed_scaling_factor=2.5, score_func="sigmoid", norm_topk_prob=True)
    dim = 64
    ffn = MoEFeedForward(dim, cfg)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in list(ffn.parameters()) + list(ffn.buffers()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    f = torch.randn(2, 7, dim, generator=g)
    out = ffn(f, torch.float32)
    assert out.shape == f.shape and out.dtype == torch.float32
    out = out.reshape(-1, dim)

    ref, used = _moe_reference(ffn, f, torch.bfloat16)
    assert len(used) > 2  # the tokens really spread over experts
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    # Experts use bf16 operands even in an fp32 model: fp32 experts would be measurably different.
    ref32, _ = _moe_reference(ffn, f, torch.float32)
    assert (out - ref32).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# One block against a per-token reference (§5.5, §5.7)
# ---------------------------------------------------------------------------------------------


def _block_reference(block, x, temb6, grid, text_len, axes_dims, theta, eps=1e-6):
    """Model doc §5.7 token by token: plain vector math, explicit per-pair RoPE (§5.5) and a softmax
    loop per query, reading only the block's weights."""
    _, seq, dim = x.shape
    heads = block.attn.heads
    hd = dim // heads
    mod = temb6[0] + block.scale_shift_table[0]
    shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = (mod[i * dim:(i + 1) * dim] for i in range(6))

    def rms(z, norm):
        return norm.weight * z / torch.sqrt((z * z).mean() + eps)

    def lin(layer, z):
        return layer.weight @ z + (0 if layer.bias is None else layer.bias)

    gt, gh, gw = grid
    positions = [(text_len + 1 + f, h, w) for f in range(gt) for h in range(gh) for w in range(gw)]
    positions += [(j + 1, 0, 0) for j in range(text_len)]

    def angles(pos):
        out = []
        for axis, d in enumerate(axes_dims):
            out += [float(torch.tensor(pos[axis] / theta ** (2 * k / d), dtype=torch.float64).float())
                    for k in range(d // 2)]
        return out

    def rotate(vec, ang):
        out = torch.empty_like(vec)
        for j, a in enumerate(ang):
            c, s = math.cos(a), math.sin(a)
            out[2 * j] = vec[2 * j] * c - vec[2 * j + 1] * s
            out[2 * j + 1] = vec[2 * j] * s + vec[2 * j + 1] * c
        return out

    att = block.attn
    q, k, v = [], [], []
    for i in range(seq):
        a = rms(x[0, i], block.norm1) * (1 + scale_a) + shift_a
        ang = angles(positions[i])
        qi, ki, vi = lin(att.to_q, a), lin(att.to_k, a), lin(att.to_v, a)
        q.append([rotate(rms(qi[h * hd:(h + 1) * hd], att.norm_q), ang) for h in range(heads)])
        k.append([rotate(rms(ki[h * hd:(h + 1) * hd], att.norm_k), ang) for h in range(heads)])
        v.append([vi[h * hd:(h + 1) * hd] for h in range(heads)])
    out = torch.empty_like(x)
    ffn = block.ffn
    for i in range(seq):
        o = []
        for h in range(heads):
            scores = torch.stack([q[i][h] @ k[j][h] for j in range(seq)]) / math.sqrt(hd)
            p = torch.exp(scores - scores.max())
            p = p / p.sum()
            o.append(sum(p[j] * v[j][h] for j in range(seq)))
        o = lin(att.to_out, torch.cat(o))
        x1 = x[0, i] + torch.tanh(gate_a) * rms(o, block.norm_post_attn)
        f = rms(x1, block.norm2) * (1 + scale_f) + shift_f
        y = lin(ffn.down_proj, F.silu(lin(ffn.gate_proj, f)) * lin(ffn.up_proj, f))
        out[0, i] = x1 + torch.tanh(gate_f) * rms(y, block.norm_post_ffn)
    return out


def test_dense_block_matches_per_token_reference():
    dim, heads, axes_dims, theta = 64, 2, (8, 12, 12), 256.0
    block = TransformerBlock(dim, heads, 1e-6, qkv_bias=False, out_bias=True, ffn=SwiGLU(dim, 96))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in block.named_parameters():
            base = 1.0 if "norm" in name else 0.0  # RMSNorm weights around 1, everything else around 0
            p.copy_(base + torch.randn(p.shape, generator=g) * 0.3)
    grid, text_len = (2, 2, 3), 5
    x = torch.randn(1, 12 + text_len, dim, generator=g)
    temb6 = torch.randn(1, 6 * dim, generator=g) * 0.5
    freqs = rope_frequencies(rope_position_ids(grid, text_len), axes_dims, theta)
    with torch.no_grad():
        out = block(x, temb6, freqs, torch.float32)
        ref = _block_reference(block, x, temb6, grid, text_len, axes_dims, theta)
    assert (out - x).abs().max() > 0.1  # the block really changes its input
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def _route_one_token(scores: list, bias: list, *, top_k, n_group, topk_group):
    """Per-token reference in plain Python (model doc §5.8): groups ranked by the sum of their two best
    bias-corrected scores, the best ``topk_group`` groups kept, then the top-k corrected scores among them."""
    per = len(scores) // n_group
    select = [s + b for s, b in zip(scores, bias)]
    group_sums = [sum(sorted(select[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
    kept = sorted(range(n_group), key=lambda g: -group_sums[g])[:topk_group]
    candidates = [e for g in kept for e in range(g * per, (g + 1) * per)]
    chosen = sorted(sorted(candidates, key=lambda e: -select[e])[:top_k])
    total = sum(scores[e] for e in chosen)
    return chosen, [scores[e] / (total + 1e-20) * 2.5 for e in chosen]


def test_route_keeps_topk_group_groups_like_the_release():
    """The release routes with n_group 4, topk_group 2: a token's experts may come from two groups. Checked
    token by token against the plain-Python rule on random logits (the tiny fixture's n_group 2 / topk_group 1
    cannot tell 'the best topk_group groups' from 'the best group')."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randn(64, 32, generator=g)
    weight = torch.randn(16, 32, generator=g) * 0.3
    bias = torch.randn(16, generator=g) * 0.1
    ids, gates = route_tokens(tokens, weight, bias, top_k=4, n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5)
    scores = torch.sigmoid(tokens.double() @ weight.double().t())
    two_groups = 0
    for i in range(tokens.shape[0]):
        expected, expected_gates = _route_one_token(scores[i].tolist(), bias.double().tolist(), top_k=4, n_group=4, topk_group=2)
        order = ids[i].argsort()
        assert ids[i][order].tolist() == expected, i
        torch.testing.assert_close(gates[i][order].double(), torch.tensor(expected_gates, dtype=torch.float64), rtol=1e-5, atol=1e-6)
        two_groups += len({e // 4 for e in expected}) == 2
    assert two_groups > 16  # many tokens really use two groups, so topk_group matters here


# ---------------------------------------------------------------------------------------------
# RoPE table cache (issue 15 item 4)
# ---------------------------------------------------------------------------------------------


def test_rope_table_is_cached_exactly_and_bounded():
    """The cached table equals the uncached one bit for bit; the second forward with the same grid and text
    length builds nothing; another text length (CFG's negative) gets its own entry; at most
    ROPE_CACHE_SIZE entries are kept; clear_rope_cache empties it."""
    from unittest import mock

    import lingbot_core.model.transformer as tr

    model = _tiny_model(False)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 16, 2, 4, 6, generator=g), torch.tensor([500.0])
    e7, e5 = torch.randn(1, 7, cfg.text_dim, generator=g), torch.randn(1, 5, cfg.text_dim, generator=g)
    with torch.no_grad():
        uncached = model(x, t, e7)
        model.clear_rope_cache()
        with mock.patch.object(tr, "rope_frequencies", wraps=tr.rope_frequencies) as build:
            first = model(x, t, e7)
            second = model(x, t, e7)
            assert build.call_count == 1  # the second forward did not rebuild
            model(x, t, e5)
            model(x, t, e7)
            assert build.call_count == 2
    assert torch.equal(first, uncached) and torch.equal(second, uncached)
    expected = rope_frequencies(rope_position_ids((2, 2, 3), 7), cfg.axes_dims, cfg.rope_theta)
    assert torch.equal(model.rope_table((2, 2, 3), 7, torch.device("cpu")), expected)
    for n in range(1, 9):
        model.rope_table((1, 1, 1), n, torch.device("cpu"))
    assert len(model._rope_cache) == tr.ROPE_CACHE_SIZE
    model.clear_rope_cache()
    assert len(model._rope_cache) == 0


def test_denoise_leaves_no_rope_table_cached(dense_pipe):
    dense_pipe.generate("a cat", height=32, width=32, num_frames=1, steps=1, seed=0, output_type="latent")
    assert len(dense_pipe.transformer._rope_cache) == 0


# ---------------------------------------------------------------------------------------------
# Issue 31 item 8: RoPE's live memory
# ---------------------------------------------------------------------------------------------


def _rope_plain(x, freqs):
    """The rotation as one expression (the formula before issue 31): the numbers to keep."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = freqs[None, :, None, :, 0], freqs[None, :, None, :, 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_apply_rope_live_bytes_are_bounded_and_bits_kept(dtype, monkeypatch):
    """At S = 8192 one rotation holds at most 3 units of (B, S, heads, head_dim/2) fp32 alive, its result
    included (the plain expression: 6), and gives the plain expression's bits (in two chunks here: 1 MiB
    chunks of 256-byte pair rows)."""
    monkeypatch.setattr(rowwise, "CHUNK_BYTES", 1 << 20)
    g = torch.Generator().manual_seed(4)
    pos = rope_position_ids((8, 32, 32), 0)
    freqs = rope_frequencies(pos, [16, 24, 24], 256.0)
    seq, heads, hd = pos.shape[0], 2, 64
    assert seq == 8192
    x = (torch.randn(1, seq, heads, hd, generator=g) * 3).to(dtype)
    unit = seq * heads * hd // 2 * 4
    with torch.no_grad(), LiveBytes() as plain:
        _rope_plain(x, freqs)
    with torch.no_grad(), LiveBytes() as live:
        got = apply_rope(x, freqs)
    assert plain.peak >= 4 * unit  # the probe sees the plain expression's temporaries
    assert live.peak <= 3 * unit
    assert got.dtype == dtype and torch.equal(got, _rope_plain(x, freqs))
    # a non-contiguous input (a view, as q out of a fused projection would be) and a partial last chunk
    wide = (torch.randn(1, 5000, heads, 2 * hd, generator=g) * 3).to(dtype)[..., :hd]
    f2 = rope_frequencies(rope_position_ids((5, 25, 40), 0), [16, 24, 24], 256.0)
    assert torch.equal(apply_rope(wide, f2), _rope_plain(wide, f2))


# ---------------------------------------------------------------------------------------------
# Issue 40 (gpu-review-4 findings 3, 9, 10): bounded fp32 temporaries, fewer launches, bits kept
# ---------------------------------------------------------------------------------------------


def _compute_ops(fn, *args):
    """The non-view aten operations ``fn(*args)`` dispatches (what launches a kernel on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket not in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
                ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        fn(*args)
    return ops


def test_apply_rope_at_65536_tokens_launches_at_most_60_kernels():
    """Finding 9: the chunk is sized by bytes (32k tokens of 16 heads x 64 pairs), not 4,096 tokens: at
    S = 65,536 one bf16 rotation is 2 chunks of 7 kernels (16 chunks, 112 kernels before). On meta tensors:
    counted, not computed."""
    seq, heads, hd = 65536, 16, 128
    x = torch.empty(1, seq, heads, hd, dtype=torch.bfloat16, device="meta")
    freqs = torch.empty(seq, hd // 2, 2, device="meta")
    ops = _compute_ops(apply_rope, x, freqs)
    assert len(ops) <= 60, len(ops)
    assert ops.count("mul") == 2 * 4  # both chunks really rotate (4 products each)


def _norm_plain(norm, x):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (h * norm.weight.float()).to(x.dtype)


def _block_plain(block, x, temb6, freqs, dtype):
    """BlockCompute as whole-tensor expressions (before issue 40): the numbers to keep."""
    mod = (temb6 + block.scale_shift_table.float())[:, None, :]
    shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mod.chunk(6, dim=-1)
    a = (_norm_plain(block.norm1, x) * (1 + scale_a) + shift_a).to(dtype)
    o = block.attn(a, freqs, dtype)
    x = x + (torch.tanh(gate_a) * _norm_plain(block.norm_post_attn, o)).to(x.dtype)
    f = (_norm_plain(block.norm2, x) * (1 + scale_f) + shift_f).to(dtype)
    y = block.ffn(f, dtype)
    return x + (torch.tanh(gate_f) * _norm_plain(block.norm_post_ffn, y)).to(x.dtype)


def _random_block(dim, heads, hidden, seed):
    block = TransformerBlock(dim, heads, 1e-6, qkv_bias=False, out_bias=True, ffn=SwiGLU(dim, hidden))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + torch.randn(p.shape, generator=g) * 0.3)
    return block.to(torch.bfloat16)


def test_norm_and_modulation_hold_one_chunk_of_fp32_and_keep_the_bits(monkeypatch):
    """Finding 3: RMSNorm, the adaLN modulation and the gated residual run by token chunks. At S = 8192
    (eight 1,024-token chunks) each holds its bf16 result plus at most three of one chunk's fp32
    temporaries (U = the bf16 input: 1.75 U), where the whole expressions hold 4-5 U, with the plain
    expressions' bits."""
    from lingbot_core.model.rowwise import RMSNorm, gated_residual, modulated_norm

    seq, dim = 8192, 256
    monkeypatch.setattr(rowwise, "CHUNK_BYTES", 1024 * dim * 4)
    g = torch.Generator().manual_seed(6)
    norm = RMSNorm(dim)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(dim, generator=g) * 0.3)
    x = (torch.randn(1, seq, dim, generator=g) * 2).to(torch.bfloat16)
    y = (torch.randn(1, seq, dim, generator=g) * 2).to(torch.bfloat16)
    scale, shift, gate = (torch.randn(1, 1, dim, generator=g) for _ in range(3))
    unit, chunk = x.nbytes, rowwise.CHUNK_BYTES
    cases = {
        "rmsnorm": (lambda: norm(x), lambda: _norm_plain(norm, x)),
        "modulation": (lambda: modulated_norm(norm, x, scale, shift, torch.bfloat16),
                       lambda: (_norm_plain(norm, x) * (1 + scale) + shift).to(torch.bfloat16)),
        "gated residual": (lambda: gated_residual(x, gate, norm, y),
                           lambda: x + (torch.tanh(gate) * _norm_plain(norm, y)).to(x.dtype)),
    }
    for name, (chunked, plain) in cases.items():
        with torch.no_grad(), LiveBytes() as whole:
            want = plain()
        with torch.no_grad(), LiveBytes() as live:
            got = chunked()
        assert whole.peak >= 4 * unit, (name, whole.peak / unit)
        assert live.peak <= unit + 3 * chunk, (name, live.peak / unit)
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_block_compute_by_chunks_keeps_the_bits_and_lowers_the_peak(monkeypatch):
    """Finding 3 at the block: one bf16 branch through a dense block at S = 8192 gives the whole-expression
    block's bits while its peak of live bytes drops by at least 2 U (U = the bf16 hidden state); the
    lockstep call of two branches gives each branch's own result."""
    seq, dim, heads = 8192, 128, 2
    block = _random_block(dim, heads, dim // 2, seed=7)
    g = torch.Generator().manual_seed(8)
    freqs = rope_frequencies(rope_position_ids((8, 32, 32), 0), (16, 24, 24), 256.0)
    x = torch.randn(1, seq, dim, generator=g).to(torch.bfloat16)
    temb6 = torch.randn(1, 6 * dim, generator=g) * 0.5
    with torch.no_grad(), LiveBytes() as whole:
        want = _block_plain(block, x, temb6, freqs, torch.bfloat16)
    monkeypatch.setattr(rowwise, "CHUNK_BYTES", 1024 * dim * 4)
    with torch.no_grad(), LiveBytes() as live:
        got = block(x, temb6, freqs, torch.bfloat16)
    assert torch.equal(got, want)
    assert whole.peak - live.peak >= 2 * x.nbytes, (whole.peak / x.nbytes, live.peak / x.nbytes)
    x2 = torch.randn(1, seq, dim, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        pair = block([x, x2], temb6, [freqs, freqs], torch.bfloat16)
        assert torch.equal(pair[0], want) and torch.equal(pair[1], _block_plain(block, x2, temb6, freqs, torch.bfloat16))


def test_grouped_experts_gather_once_per_chunk_with_the_loops_bits():
    """Finding 10: the grouped path adds each token's k expert rows from one gather: 2k + 3 kernels for
    the additions instead of 5k, with the per-expert loop's bits (k = 8 of 16 experts)."""
    from lingbot_core.model.transformer import Experts, run_experts

    n, dim, hidden, num, k = 300, 64, 32, 16, 8
    g = torch.Generator().manual_seed(9)
    experts = Experts(num, dim, hidden)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    experts = experts.to(torch.bfloat16)
    x = torch.randn(n, dim, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num, generator=g)[:k] for _ in range(n)])
    gates = torch.rand(n, k, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        loop = run_experts(x, ids, gates, experts, grouped=False)
        grouped = run_experts(x, ids, gates, experts, grouped=True)
    assert torch.equal(grouped, loop)
    ops = _compute_ops(run_experts, x, ids, gates, experts, True)
    # 19 kernels route, sort and run the chunk; then the additions (5k = 40 of them before, 2k + 3 now)
    assert ops.count("add_") == k and ops.count("index") <= 4 and len(ops) <= 19 + 2 * k + 3, ops
