"""LoRA files on the DiT: formats, arithmetic against weights merged by hand, exact removal, offload
modes, fp8 storage, and the errors a user sees for a wrong or damaged file."""

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.sizes import TINY
from lingbot_core import load_pipeline
from lingbot_core.testing.fixtures import dit_config
from lingbot_core.model.lora import LoraError, parse_lora_arg

from support.alike_layout import align_alike
from support.lora_files import (
    RANK, _factors, _linear_shapes, kohya_lora, lightx2v_lora, merged_package, overflowing_lora,
)

PROMPT = "a red fox running through snow"
RUN = dict(TINY, guidance_scale=3.0, seed=7)


def _frames(pipe, **kw):
    return torch.as_tensor(pipe.generate(PROMPT, **{**RUN, **kw}))


def test_lightx2v_naming_on_moe_matches_a_hand_merged_package(packages, tmp_path):
    lora, deltas = lightx2v_lora(tmp_path / "lightlingbot_tiny_4steps.safetensors")
    assert len(load_file(str(lora))) == 2 * 7 * dit_config(True)["depth"]  # 672 at full size (48 blocks)
    pipe = load_pipeline(packages["moe"], device="cpu", loras=[(lora, 0.8)])
    try:
        align_alike(pipe)  # merged weights are fresh copies, the merged package's are mapped: alike_layout
        got = _frames(pipe)
        latent = pipe.generate(PROMPT, **RUN, output_type="latent")
    finally:
        pipe.release()
    ref_pipe = load_pipeline(merged_package(packages["moe"], tmp_path / "merged", [(deltas, 0.8)]), device="cpu")
    try:
        align_alike(ref_pipe)
        want = _frames(ref_pipe)
        want_latent = ref_pipe.generate(PROMPT, **RUN, output_type="latent")
    finally:
        ref_pipe.release()
    assert (latent - want_latent).abs().max() < 1e-5
    assert (got - want).abs().max() < 1e-5


def test_kohya_naming_with_alpha_on_dense_matches_a_hand_merged_package(packages, tmp_path):
    lora, deltas = kohya_lora(tmp_path / "style.safetensors")
    pipe = load_pipeline(packages["dense"], device="cpu", loras=[(lora, 0.8)])
    try:
        got = pipe.generate(PROMPT, **RUN, output_type="latent")
    finally:
        pipe.release()
    ref = load_pipeline(merged_package(packages["dense"], tmp_path / "merged", [(deltas, 0.8)]), device="cpu")
    try:
        want = ref.generate(PROMPT, **RUN, output_type="latent")
    finally:
        ref.release()
    plain = load_pipeline(packages["dense"], device="cpu")
    try:
        without = plain.generate(PROMPT, **RUN, output_type="latent")
    finally:
        plain.release()
    assert (want - without).abs().max() > 1e-2  # the LoRA changes the result noticeably
    assert (got - want).abs().max() < 1e-5


def test_twenty_changes_and_a_removal_give_the_bits_of_no_lora(packages, tmp_path):
    lora, _ = lightx2v_lora(tmp_path / "a.safetensors")
    other, _ = lightx2v_lora(tmp_path / "b.safetensors", seed=5)
    pipe = load_pipeline(packages["moe"], device="cpu")
    try:
        before = pipe.generate(PROMPT, **RUN, output_type="latent")
        for i in range(20):
            stack = [(lora, 0.1 * (i + 1))] + ([(other, -0.5)] if i % 3 == 0 else [])
            pipe.set_loras(stack)
        changed = pipe.generate(PROMPT, **RUN, output_type="latent")
        pipe.set_loras([])
        after = pipe.generate(PROMPT, **RUN, output_type="latent")
        assert pipe.loras == ()
        assert not any(p.startswith("lora_") for n, _ in pipe.transformer.named_parameters() for p in [n.rsplit(".", 1)[1]])
        state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    finally:
        pipe.release()
    assert (changed - before).abs().max() > 1e-3
    assert torch.equal(after, before)
    fresh = load_pipeline(packages["moe"], device="cpu")
    try:  # the weights are those of a fresh load, bit for bit
        fresh_state = fresh.transformer.state_dict()
        assert state.keys() == fresh_state.keys() and all(torch.equal(state[k], fresh_state[k]) for k in state)
    finally:
        fresh.release()


def test_two_loras_add_up_and_strength_zero_is_no_lora(packages, tmp_path):
    a, da = kohya_lora(tmp_path / "a.safetensors", seed=1)
    b, db = kohya_lora(tmp_path / "b.safetensors", seed=2, alpha=8.0)
    pipe = load_pipeline(packages["dense"], device="cpu")
    try:
        pipe.set_loras([(a, 0.5), (b, -0.3)])
        both = pipe.generate(PROMPT, **RUN, output_type="latent")
        pipe.set_loras([(a, 0.0)])
        zero = pipe.generate(PROMPT, **RUN, output_type="latent")
        assert pipe.loras == ()
    finally:
        pipe.release()
    ref = load_pipeline(merged_package(packages["dense"], tmp_path / "merged", [(da, 0.5), (db, -0.3)]), device="cpu")
    plain = load_pipeline(packages["dense"], device="cpu")
    try:
        want = ref.generate(PROMPT, **RUN, output_type="latent")
        without = plain.generate(PROMPT, **RUN, output_type="latent")
    finally:
        ref.release()
        plain.release()
    assert (both - want).abs().max() < 1e-5
    assert (zero - without).abs().max() < 1e-6


@pytest.mark.parametrize("offload", ["model", "sequential", "block"])
def test_every_offload_mode_gives_the_same_frames(packages, tmp_path, offload):
    lora, _ = lightx2v_lora(tmp_path / "l.safetensors")
    pipe = load_pipeline(packages["moe"], device="cpu", loras=[(lora, 1.0)])
    try:
        want = pipe.generate(PROMPT, **RUN, output_type="latent")
        pipe.set_offload(offload, blocks_on_gpu=1)
        got = pipe.generate(PROMPT, **RUN, output_type="latent")
        pipe.set_loras([(lora, 0.5)])  # a change while hooked
        pipe.set_loras([(lora, 1.0)])
        again = pipe.generate(PROMPT, **RUN, output_type="latent")
        assert pipe.offload == offload
    finally:
        pipe.release()
    assert torch.equal(got, want)
    assert torch.equal(again, want)


def test_cli_lora_argument():
    assert parse_lora_arg("a/b.safetensors") == ("a/b.safetensors", 1.0)
    assert parse_lora_arg("a/b.safetensors:0.75") == ("a/b.safetensors", 0.75)
    assert parse_lora_arg(r"C:\loras\x.safetensors") == (r"C:\loras\x.safetensors", 1.0)
    assert parse_lora_arg(r"C:\loras\x.safetensors:-1.5") == (r"C:\loras\x.safetensors", -1.5)
    with pytest.raises(ValueError, match="strength"):
        parse_lora_arg("x.safetensors:50")


# -- errors --------------------------------------------------------------------------------------


def test_wan21_lora_is_refused_naming_the_file_and_what_it_is_for(packages, tmp_path):
    path = tmp_path / "wan21_style.safetensors"
    tensors = {}
    for b in range(3):
        for m in ("self_attn.q", "self_attn.k", "cross_attn.v", "ffn.0"):
            tensors[f"diffusion_model.blocks.{b}.{m}.lora_down.weight"] = torch.zeros(4, 64)
            tensors[f"diffusion_model.blocks.{b}.{m}.lora_up.weight"] = torch.zeros(64, 4)
    save_file(tensors, str(path))
    with pytest.raises(LoraError) as e:
        load_pipeline(packages["dense"], device="cpu", loras=[(path, 1.0)])
    msg = str(e.value)
    assert "wan21_style.safetensors" in msg and "24 tensors" in msg and "Wan 2.1" in msg
    assert msg.count("diffusion_model.blocks.") == 3  # three examples


def test_sdxl_lora_is_refused(packages, tmp_path):
    path = tmp_path / "sdxl.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 320),
               "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(320, 4),
               "lora_te1_text_model_encoder_layers_0_mlp_fc1.alpha": torch.tensor(4.0)}, str(path))
    with pytest.raises(LoraError, match=r"sdxl\.safetensors has 3 tensors.*Stable Diffusion"):
        load_pipeline(packages["dense"], device="cpu", loras=[(path, 1.0)])


def test_partial_match_warns_with_counts(packages, tmp_path, caplog):
    path = tmp_path / "partial.safetensors"
    gen = torch.Generator().manual_seed(0)
    down, up = _factors(gen, 64, 64)
    save_file({"blocks.0.attn.to_q.lora_A.weight": down, "blocks.0.attn.to_q.lora_B.weight": up,
               "blocks.0.self_attn.q.lora_A.weight": down.clone(), "blocks.0.self_attn.q.lora_B.weight": up.clone(),
               "text_encoder.layers.0.q.lora_A.weight": down.clone()}, str(path))
    pipe = load_pipeline(packages["dense"], device="cpu")
    try:
        w = pipe.transformer.blocks[0].attn.to_q.weight.detach().clone()
        with caplog.at_level(logging.WARNING, logger="lingbot_core"):
            pipe.set_loras([(path, 1.0)])
        assert torch.equal(pipe.transformer.blocks[0].attn.to_q.weight, w + up @ down)
    finally:
        pipe.release()
    text = caplog.text
    assert "partial.safetensors" in text and "3 of its 5 tensors" in text and "1 layers get the LoRA" in text
    assert "self_attn.q" in text


def test_shape_mismatch_names_the_key_and_both_shapes(packages, tmp_path):
    path = tmp_path / "big.safetensors"
    save_file({"blocks.1.attn.to_k.lora_down.weight": torch.zeros(4, 128),
               "blocks.1.attn.to_k.lora_up.weight": torch.zeros(64, 4)}, str(path))
    with pytest.raises(LoraError, match=r"'blocks\.1\.attn\.to_k\.lora_down\.weight' has shape \[4, 128\].*\[64, 64\]"):
        load_pipeline(packages["dense"], device="cpu", loras=[(path, 1.0)])


def test_routed_expert_keys_are_refused(packages, tmp_path):
    path = tmp_path / "experts.safetensors"
    save_file({"blocks.0.ffn.experts.w1.lora_A.weight": torch.zeros(4, 64),
               "blocks.0.ffn.experts.w1.lora_B.weight": torch.zeros(32, 4)}, str(path))
    with pytest.raises(LoraError, match="stacked routed experts or router"):
        load_pipeline(packages["moe"], device="cpu", loras=[(path, 1.0)])


def test_damaged_files_fail_and_leave_the_pipeline_usable(packages, tmp_path):
    good, _ = lightx2v_lora(tmp_path / "good.safetensors")
    data = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].decode()
    # A header that lies: the first tensor claims more bytes than it has (offsets still inside the file).
    import json
    h = json.loads(header)
    first = next(k for k in h if k != "__metadata__")
    h[first]["shape"] = [h[first]["shape"][0] * 2, h[first]["shape"][1]]
    lying_header = json.dumps(h).encode()
    lying = tmp_path / "lying.safetensors"
    lying.write_bytes(len(lying_header).to_bytes(8, "little") + lying_header + data[8 + n:])
    pickle = tmp_path / "lora.ckpt"
    pickle.write_bytes(b"not a safetensors file")
    pipe = load_pipeline(packages["moe"], device="cpu", loras=[(good, 0.5)])
    try:
        want = pipe.generate(PROMPT, **RUN, output_type="latent")
        for bad, pattern in ((truncated, "truncated|too short|larger than the file"), (lying, "outside the file|lies|but its F32 shape .* needs"),
                             (pickle, "only .safetensors")):
            with pytest.raises(LoraError, match=pattern):
                pipe.set_loras([(good, 1.0), (bad, 1.0)])
            assert pipe.loras == ((str(good), 0.5),)
        got = pipe.generate(PROMPT, **RUN, output_type="latent")
    finally:
        pipe.release()
    assert torch.equal(got, want)


# -- handles: the pool makes the shared pipeline's LoRA set equal to the handle's ------------------


def test_lora_handles_share_one_pipeline_and_each_gets_its_own_stack(packages, tmp_path):
    from lingbot_core import PipelinePool

    lora, _ = lightx2v_lora(tmp_path / "l.safetensors")
    pool = PipelinePool(headroom=0)
    base = pool.handle(packages["moe"], offload="model", device="cpu")
    strong = base.with_lora(lora, 1.0)
    weak = base.with_lora(lora, 0.3)
    assert pool.loaded() == () and strong.loras == ((str(lora), 1.0),) and base.loras == ()
    assert "l.safetensors @ 1" in repr(strong)
    try:
        plain = base.generate(PROMPT, **RUN, output_type="latent")
        a = strong.generate(PROMPT, **RUN, output_type="latent")
        b = weak.generate(PROMPT, **RUN, output_type="latent")
        a2 = strong.generate(PROMPT, **RUN, output_type="latent")
        plain2 = base.generate(PROMPT, **RUN, output_type="latent")
        assert len(pool.loaded()) == 1
    finally:
        base.release()
    direct = load_pipeline(packages["moe"], device="cpu", loras=[(lora, 0.3)])
    try:
        want_b = direct.generate(PROMPT, **RUN, output_type="latent")
    finally:
        direct.release()
    assert torch.equal(a, a2) and torch.equal(plain, plain2)  # one loaded copy: bit for bit
    # Another load of the same file: the same offsets, and both merge into fresh copies (alike layouts).
    assert (b - want_b).abs().max() < 1e-5
    assert (a - b).abs().max() > 1e-3


def test_with_lora_checks_the_file_without_reading_weights(packages, tmp_path):
    from lingbot_core import PipelinePool

    path = tmp_path / "wan.safetensors"
    save_file({"blocks.0.self_attn.q.lora_down.weight": torch.zeros(2, 64),
               "blocks.0.self_attn.q.lora_up.weight": torch.zeros(64, 2)}, str(path))
    pool = PipelinePool(headroom=0)
    base = pool.handle(packages["dense"], device="cpu")
    with pytest.raises(LoraError, match="Wan 2.1"):
        base.with_lora(path, 1.0)
    with pytest.raises(ValueError, match="strength"):
        base.with_lora(path, float("nan"))
    assert pool.loaded() == ()


# -- fp8 storage: run-time adapters ----------------------------------------------------------------


def test_fp8_dit_gets_run_time_adapters_close_to_the_fp32_merge(packages, tmp_path):
    lora, deltas = lightx2v_lora(tmp_path / "l.safetensors")
    pipe = load_pipeline(packages["moe"], device="cpu", dtypes={"transformer": "fp8_e4m3fn"})
    try:
        to_q = pipe.transformer.blocks[0].attn.to_q
        w = to_q.weight.detach().clone()
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        before = to_q(x, torch.bfloat16).float()
        pipe.set_loras([(lora, 0.8)])
        assert torch.equal(to_q.weight, w)  # fp8 weights are never rewritten
        assert to_q.lora_down is not None and to_q.lora_down.dtype == torch.bfloat16
        after = to_q(x, torch.bfloat16).float()
        down, up, _ = deltas["blocks.0.attn.to_q"]
        w32 = load_file(str(packages["moe"] / "transformer" / "diffusion_pytorch_model.safetensors"))["blocks.0.attn.to_q.weight"]
        exact = x.float() @ (w32 + 0.8 * (up @ down)).t()
        err = (after - exact).norm() / exact.norm()
        fp8_alone = (before - x.float() @ w32.t()).norm() / (x.float() @ w32.t()).norm()
        assert err < 2 * fp8_alone + 1e-2  # the LoRA adds no more than bf16 rounding to fp8's own error
        lat = pipe.generate(PROMPT, **RUN, output_type="latent")
        pipe.set_loras([])
        assert to_q.lora_down is None
    finally:
        pipe.release()
    assert torch.isfinite(lat).all()


def test_an_overflowing_lora_on_an_fp8_dit_is_refused_when_applied(packages, tmp_path):
    """fp8 Linears get run-time adapters; adapters that overflow are refused by set_loras, naming the
    LoRA, instead of a run that ends in the generic NaN error; removing it gives the plain frames back."""
    shapes = _linear_shapes(moe=False)
    bad = overflowing_lora(tmp_path / "overflowing_lora.safetensors", "blocks.1.attn.to_v", shapes["blocks.1.attn.to_v"])
    pipe = load_pipeline(packages["dense"], device="cpu", dtypes={"transformer": "fp8_e4m3fn"})
    try:
        plain = pipe.generate(PROMPT, **RUN, output_type="latent")
        with pytest.raises(LoraError, match=r"overflowing_lora\.safetensors @ 4.*NaN or infinite"):
            pipe.set_loras([(bad, 4.0)])
        pipe.set_loras([])
        assert torch.equal(pipe.generate(PROMPT, **RUN, output_type="latent"), plain)
    finally:
        pipe.release()


# -- other formats ---------------------------------------------------------------------------------


def test_diff_loha_and_lokr_match_their_formulas(packages, tmp_path):
    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen) * 0.1  # noqa: E731
    t = {
        "transformer.blocks.0.attn.to_out.diff": r(64, 64), "transformer.blocks.0.attn.to_out.diff_b": r(64),
        "lora_unet_blocks_1_attn_to_k.hada_w1_a": r(64, 3), "lora_unet_blocks_1_attn_to_k.hada_w1_b": r(3, 64),
        "lora_unet_blocks_1_attn_to_k.hada_w2_a": r(64, 3), "lora_unet_blocks_1_attn_to_k.hada_w2_b": r(3, 64),
        "lora_unet_blocks_1_attn_to_k.alpha": torch.tensor(1.5),
        "model.diffusion_model.blocks.0.ffn.up_proj.lokr_w1": r(4, 8),
        "model.diffusion_model.blocks.0.ffn.up_proj.lokr_w2_a": r(32, 2),
        "model.diffusion_model.blocks.0.ffn.up_proj.lokr_w2_b": r(2, 8),
        "model.diffusion_model.blocks.0.ffn.up_proj.alpha": torch.tensor(4.0),
    }
    path = tmp_path / "mixed.safetensors"
    save_file(t, str(path))
    pipe = load_pipeline(packages["dense"], device="cpu")
    try:
        m = pipe.transformer
        w_out, b_out = m.blocks[0].attn.to_out.weight.detach().clone(), m.blocks[0].attn.to_out.bias.detach().clone()
        w_k, w_up = m.blocks[1].attn.to_k.weight.detach().clone(), m.blocks[0].ffn.up_proj.weight.detach().clone()
        pipe.set_loras([(path, 0.5)])
        torch.testing.assert_close(m.blocks[0].attn.to_out.weight, w_out + 0.5 * t["transformer.blocks.0.attn.to_out.diff"], rtol=0, atol=1e-7)
        torch.testing.assert_close(m.blocks[0].attn.to_out.bias, b_out + 0.5 * t["transformer.blocks.0.attn.to_out.diff_b"], rtol=0, atol=1e-7)
        p = "lora_unet_blocks_1_attn_to_k."
        loha = (t[p + "hada_w1_a"] @ t[p + "hada_w1_b"]) * (t[p + "hada_w2_a"] @ t[p + "hada_w2_b"])
        torch.testing.assert_close(m.blocks[1].attn.to_k.weight, w_k + 0.5 * (1.5 / 3) * loha, rtol=0, atol=1e-7)
        p = "model.diffusion_model.blocks.0.ffn.up_proj."
        lokr = torch.kron(t[p + "lokr_w1"], t[p + "lokr_w2_a"] @ t[p + "lokr_w2_b"])
        torch.testing.assert_close(m.blocks[0].ffn.up_proj.weight, w_up + 0.5 * (4.0 / 2) * lokr, rtol=0, atol=1e-7)
        pipe.set_loras([])
        assert torch.equal(m.blocks[0].attn.to_out.bias, b_out) and torch.equal(m.blocks[1].attn.to_k.weight, w_k)
    finally:
        pipe.release()


def test_cli_takes_lora_arguments_and_reports_a_wrong_file(packages, tmp_path, capsys, caplog):
    from lingbot_core.cli import main

    lora, _ = lightx2v_lora(tmp_path / "four_step.safetensors")
    wan = tmp_path / "wan.safetensors"
    save_file({"blocks.0.self_attn.q.lora_down.weight": torch.zeros(2, 64),
               "blocks.0.self_attn.q.lora_up.weight": torch.zeros(64, 2)}, str(wan))
    common = ["generate", "--model_dir", str(packages["moe"]), "--prompt", "a cat", "--height", "64", "--width", "96",
              "--num_frames", "5", "--device", "cpu", "--guidance_scale", "1"]
    with caplog.at_level(logging.INFO, logger="lingbot_core"):
        rc = main([*common, "--lora", f"{lora}:0.8", "--sampler", "euler", "--sigmas", "1.0,0.9,0.75,0.5",
                   "--output", str(tmp_path / "out.mp4")])
    assert rc == 0 and (tmp_path / "out.mp4").stat().st_size > 0
    assert "four_step.safetensors @ 0.8" in caplog.text
    rc = main([*common, "--lora", str(wan), "--output", str(tmp_path / "bad.mp4")])
    err = capsys.readouterr().err
    assert rc == 2 and "wan.safetensors" in err and "Wan 2.1" in err and not (tmp_path / "bad.mp4").exists()


def test_fp8_run_time_adapters_give_the_same_frames_in_every_offload_mode(packages, tmp_path):
    lora, _ = lightx2v_lora(tmp_path / "l.safetensors")
    pipe = load_pipeline(packages["moe"], device="cpu", dtypes={"transformer": "fp8_e4m3fn"}, loras=[(lora, 1.0)])
    try:
        want = pipe.generate(PROMPT, **RUN, output_type="latent")
        for offload in ("model", "sequential", "block"):
            pipe.set_offload(offload, blocks_on_gpu=1)
            assert torch.equal(pipe.generate(PROMPT, **RUN, output_type="latent"), want), offload
        pipe.set_loras([])
        plain = pipe.generate(PROMPT, **RUN, output_type="latent")
        state = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    finally:
        pipe.release()
    fresh = load_pipeline(packages["moe"], device="cpu", dtypes={"transformer": "fp8_e4m3fn"})
    try:
        fresh_state = fresh.transformer.state_dict()
        # Weights compared exactly (frames of two loads only within a bound: machines differ).
        assert state.keys() == fresh_state.keys() and all(torch.equal(state[k], fresh_state[k]) for k in state)
        assert (fresh.generate(PROMPT, **RUN, output_type="latent") - plain).abs().max() < 1e-5
    finally:
        fresh.release()
    assert (plain - want).abs().max() > 1e-3


def test_refiner_pipeline_takes_a_lora_and_restores_from_its_own_checkpoint(packages, tmp_path):
    lora, deltas = lightx2v_lora(tmp_path / "l.safetensors")
    pipe = load_pipeline(packages["moe"], transformer_subfolder="refiner", device="cpu")
    try:
        file = packages["moe"] / "refiner" / "diffusion_pytorch_model.safetensors"
        w = load_file(str(file))["blocks.1.ffn.shared_experts.down_proj.weight"]
        pipe.set_loras([(lora, 0.3)])
        pipe.set_loras([(lora, 0.7)])  # merged from the refiner's checkpoint value, not the 0.3 weight
        down, up, _ = deltas["blocks.1.ffn.shared_experts.down_proj"]
        assert torch.equal(pipe.transformer.blocks[1].ffn.shared_experts.down_proj.weight, w + 0.7 * (up @ down))
        pipe.set_loras([])
        assert torch.equal(pipe.transformer.blocks[1].ffn.shared_experts.down_proj.weight, w)
    finally:
        pipe.release()


def test_router_keys_are_refused_and_the_pipeline_is_unchanged(packages, tmp_path):
    # A file that also trains the MoE router: refused whole, not applied without its router part.
    path = tmp_path / "with_router.safetensors"
    gen = torch.Generator().manual_seed(0)
    down, up = _factors(gen, 64, 64)
    r_down, r_up = _factors(gen, dit_config(True)["num_experts"], 64)
    save_file({"blocks.0.attn.to_q.lora_A.weight": down, "blocks.0.attn.to_q.lora_B.weight": up,
               "blocks.0.ffn.router.lora_A.weight": r_down, "blocks.0.ffn.router.lora_B.weight": r_up}, str(path))
    pipe = load_pipeline(packages["moe"], device="cpu")
    try:
        w = pipe.transformer.blocks[0].attn.to_q.weight.detach().clone()
        with pytest.raises(LoraError, match=r"with_router\.safetensors: key 'blocks\.0\.ffn\.router\.lora_[AB]\.weight' "
                                            r"targets blocks\.0\.ffn\.router, the MoE layer's stacked routed experts or router"):
            pipe.set_loras([(path, 1.0)])
        assert torch.equal(pipe.transformer.blocks[0].attn.to_q.weight, w)
    finally:
        pipe.release()


def test_fp8_run_time_adapter_scales_by_alpha_over_rank(packages, tmp_path):
    # kohya file, rank 4, alpha 1, strength 0.8: the to_q output moves by 0.8 * (1 / 4) * x (up @ down)^T.
    gen = torch.Generator().manual_seed(5)
    down, up = _factors(gen, 64, 64)
    path = tmp_path / "kohya_alpha.safetensors"
    save_file({"diffusion_model.blocks.0.attn.to_q.lora_down.weight": down,
               "diffusion_model.blocks.0.attn.to_q.lora_up.weight": up,
               "diffusion_model.blocks.0.attn.to_q.alpha": torch.tensor(1.0)}, str(path))
    pipe = load_pipeline(packages["moe"], device="cpu", dtypes={"transformer": "fp8_e4m3fn"})
    try:
        to_q = pipe.transformer.blocks[0].attn.to_q
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        before = to_q(x, torch.bfloat16).float()
        pipe.set_loras([(path, 0.8)])
        moved = to_q(x, torch.bfloat16).float() - before
    finally:
        pipe.release()
    expected = x.float() @ (0.8 * (1.0 / RANK) * (up @ down)).t()
    ratio = (moved * expected).sum() / (expected * expected).sum()  # 1.0 right, 4.0 when alpha/rank is dropped
    assert ratio.item() == pytest.approx(1.0, abs=0.03)
    assert (moved - expected).norm() / expected.norm() < 0.05  # bf16 rounding of the adapter only
