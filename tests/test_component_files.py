"""Single files as ComfyUI users have them (prefixed DiT safetensors, Qwen3-VL text encoder under ComfyUI's
names, Wan 2.1 VAE under its original names) give the package's own frames; files of other models are
refused with a message naming the file and what was expected."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lingbot_core import load_pipeline
from lingbot_core.files.checkpoint_files import ModelPackageError
from lingbot_core.testing.gguf_fixtures import package_state

from alike_layout import align_alike

RUN = dict(height=32, width=32, num_frames=5, steps=2, seed=7, guidance_scale=1.0, output_type="pt")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from lingbot_core.testing.fixtures import tiny_wan21_vae, write_package
    from lingbot_core.files.vae_layout import write_original_wan21

    root = tmp_path_factory.mktemp("files")
    pkg = write_package(root / "pkg", fp32=True, refiner=False, seed=4)
    shutil.rmtree(pkg / "vae")
    tiny_wan21_vae(4).save_pretrained(pkg / "vae")  # the Wan 2.1 architecture, as ComfyUI's file holds it
    dit = root / "dit.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in package_state(pkg).items()}, str(dit))
    te_state = {}
    for f in (pkg / "text_encoder").glob("*.safetensors"):
        te_state.update(load_file(str(f)))
    comfy = {}
    for k, v in te_state.items():
        if k == "lm_head.weight":
            continue  # tied: ComfyUI's files leave it out
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        elif k.startswith("model.visual."):
            k = k[len("model."):]
        comfy[k] = v
    te = root / "qwen3vl_tiny.safetensors"
    save_file(comfy, str(te))
    vae = write_original_wan21(pkg, root / "wan_2.1_vae_tiny.safetensors")
    side = root / "side"  # what the user keeps besides the files: the processor and three small configs
    for sub in ("processor", "scheduler"):
        shutil.copytree(pkg / sub, side / sub)
    for sub in ("transformer", "text_encoder", "vae"):
        (side / sub).mkdir(parents=True)
        shutil.copy(pkg / sub / "config.json", side / sub / "config.json")
    return {"pkg": pkg, "side": side, "dit": dit, "te": te, "vae": vae, "root": root}


def test_single_files_give_the_package_frames(files):
    ref = load_pipeline(files["pkg"], device="cpu", dtypes={"transformer": "fp32", "text_encoder": "fp32"})
    try:
        align_alike(ref)  # two files, two layouts: compared on alike ones (alike_layout)
        want = ref.generate("a cat", **RUN)
    finally:
        ref.release()
    pipe = load_pipeline(files["side"], device="cpu", dtypes={"transformer": "fp32", "text_encoder": "fp32"},
                         transformer_file=files["dit"], text_encoder_file=files["te"], vae_file=files["vae"])
    try:
        align_alike(pipe)
        got = pipe.generate("a cat", **RUN)
        te = pipe.text_encoder
    finally:
        pipe.release()
    assert want.shape == got.shape and torch.isfinite(want).all()
    assert (got - want).abs().max().item() <= 1e-5


def test_model_dir_is_required_for_the_processor(files):
    with pytest.raises(ModelPackageError, match="processor"):
        load_pipeline(None, device="cpu", transformer_file=files["dit"], text_encoder_file=files["te"], vae_file=files["vae"])


def test_refusals_name_the_file_and_what_was_expected(files, tmp_path):
    side, pkg = files["side"], files["pkg"]
    wan = tmp_path / "wan2.1_t2v_1.3B.safetensors"
    save_file({"patch_embedding.weight": torch.zeros(4, 16, 1, 2, 2), "blocks.0.self_attn.q.weight": torch.zeros(4, 4)}, str(wan))
    with pytest.raises(ModelPackageError, match=r"wan2.1_t2v_1.3B.safetensors is not a LingBot-Video DiT.*Wan 2.1/2.2 DiT"):
        load_pipeline(pkg, device="cpu", transformer_file=wan)
    flux_vae = tmp_path / "ae.safetensors"
    save_file({"decoder.mid.block_1.norm1.weight": torch.zeros(4)}, str(flux_vae))
    with pytest.raises(ModelPackageError, match=r"ae.safetensors is not a Wan 2.1 VAE.*Stable Diffusion / Flux VAE"):
        load_pipeline(pkg, device="cpu", vae_file=flux_vae)
    wrong_te = tmp_path / "qwen3vl_big.safetensors"
    state = load_file(str(files["te"]))
    state["model.embed_tokens.weight"] = torch.zeros(state["model.embed_tokens.weight"].shape[0], 96)
    save_file(state, str(wrong_te))
    with pytest.raises(ModelPackageError, match=r"qwen3vl_big.safetensors is a Qwen3-VL of hidden size 96.*Qwen3-VL-4B"):
        load_pipeline(pkg, device="cpu", text_encoder_file=wrong_te)
    not_te = tmp_path / "t5xxl.safetensors"
    save_file({"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(2, 2)}, str(not_te))
    with pytest.raises(ModelPackageError, match="t5xxl.safetensors is not a Qwen3-VL text encoder"):
        load_pipeline(pkg, device="cpu", text_encoder_file=not_te)


def test_gguf_refusals(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from lingbot_core.testing.fixtures import dit_config
    from lingbot_core.testing.gguf_fixtures import write_gguf_dit
    from lingbot_core.model.dit_files import DitFile

    flux = tmp_path / "flux1-dev-Q4_K_S.gguf"
    w = gguf.GGUFWriter(str(flux), "flux")
    w.add_tensor("double_blocks.0.img_attn.qkv.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelPackageError, match=r"flux1-dev-Q4_K_S.gguf is not a LingBot-Video DiT.*Flux"):
        DitFile(flux)
    iq = tmp_path / "lingbot-IQ4_XS.gguf"
    w = gguf.GGUFWriter(str(iq), "lingbot_video")
    w.add_tensor("patch_embedder.weight", np.zeros((64, 136), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_XS)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelPackageError, match=r"stored as IQ4_XS.*Q8_0"):
        DitFile(iq)
    # an unknown type id (a newer ggml type) is refused by name too
    broken = tmp_path / "lingbot-unknown.gguf"
    data = bytearray(iq.read_bytes())
    pos = data.find(b"patch_embedder.weight") + len(b"patch_embedder.weight")
    pos += 4 + 8 * 2  # n_dims (u32), two u64 dims
    data[pos:pos + 4] = (250).to_bytes(4, "little")
    broken.write_bytes(bytes(data))
    with pytest.raises(ModelPackageError, match="quantization type"):
        DitFile(broken)


def test_fp8_single_file_with_key_scale_tensors(files, tmp_path):
    """ALX-CODE's fp8 dense files: F8_E4M3 weights with an fp32 ``<key>_scale`` [1] each; read as weight * scale
    (fp32), or kept fp8 with that scale under an fp8 precision."""
    from lingbot_core.model.dit_files import load_dit_file
    from lingbot_core.testing.gguf_fixtures import package_config

    state = package_state(files["pkg"])
    out, want = {}, {}
    for k, v in state.items():
        if k.endswith((".attn.to_q.weight", ".ffn.gate_proj.weight")):
            scale = v.abs().max() / 448.0
            q = (v / scale).to(torch.float8_e4m3fn)
            out[k], out[k + "_scale"] = q, scale.reshape(1).float()
            want[k] = q.float() * scale
        else:
            out[k] = want[k] = v
    path = tmp_path / "lingbot_dense_fp8_e4m3fn.safetensors"
    save_file(out, str(path))
    config = package_config(files["pkg"])
    model = load_dit_file(path, torch.float32, config)
    got = model.state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    kept = load_dit_file(path, torch.float8_e4m3fn, config)
    q = kept.blocks[0].attn.to_q
    assert q.weight.dtype == torch.float8_e4m3fn and torch.equal(q.weight, out["blocks.0.attn.to_q.weight"])
    assert torch.equal(q.scale_weight, out["blocks.0.attn.to_q.weight_scale"].reshape(()))


@pytest.mark.parametrize("scale_leaf", ["scale_weight", "weight_scale"])
def test_fp8_scaled_text_encoder_file_is_descaled_under_either_scale_name(files, tmp_path, scale_leaf):
    """ComfyUI's fp8_scaled Qwen3-VL files store F8_E4M3 Linear weights with an fp32 scale named
    ``scale_weight`` or ``weight_scale``; both are applied (a file loaded unscaled ignores the prompt)."""
    from lingbot_core.model.component_files import load_text_encoder_file

    comfy = load_file(str(files["te"]))
    out, want = {}, {}
    for k, v in comfy.items():
        if k.startswith("model.layers.") and k.endswith(("self_attn.q_proj.weight", "mlp.down_proj.weight")):
            scale = v.abs().max() / 448.0
            q = (v / scale).to(torch.float8_e4m3fn)
            out[k], out[f"{k[:-len('weight')]}{scale_leaf}"] = q, scale.float().reshape(())
            want["model.language_model." + k[len("model."):]] = q.float() * scale
        else:
            out[k] = v
    assert len(want) >= 4 and all(s.item() < 0.1 for k, s in out.items() if k.endswith(scale_leaf))  # far from 1
    path = tmp_path / f"qwen3vl_tiny_fp8_{scale_leaf}.safetensors"
    save_file(out, str(path))
    got = load_text_encoder_file(path, torch.float32, files["pkg"] / "text_encoder").state_dict()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
