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

from support.alike_layout import align_alike

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


def test_files_that_are_not_three_name_what_is_missing(files):
    with pytest.raises(ModelPackageError, match=r"three files.*text_encoder_file, vae_file are missing"):
        load_pipeline(None, device="cpu", transformer_file=files["dit"])
    with pytest.raises(ModelPackageError, match=r"vae_file is missing"):
        load_pipeline(None, device="cpu", transformer_file=files["dit"], text_encoder_file=files["te"])


def _aligned(pipe):
    """Every weight of the pipeline copied into fresh (64-byte aligned) memory: two loads then run the same CPU
    kernels on alike layouts (issue 28), so their frames can be compared exactly."""
    with torch.no_grad():
        for module in (pipe.transformer, pipe.text_encoder, pipe.vae):
            for p in module.parameters():
                p.data = p.data.clone()
            for name, b in list(module.named_buffers()):
                owner, _, leaf = name.rpartition(".")
                sub = module.get_submodule(owner) if owner else module
                if b is not None and leaf in sub._buffers:
                    sub._buffers[leaf] = b.clone()
    return pipe


@pytest.fixture(scope="module")
def three_files(tmp_path_factory):
    """The three files alone (a Q8_0 GGUF DiT described by its shapes, a real-vocabulary Qwen3-VL file under
    ComfyUI's names, a Wan 2.1 VAE of the original layout) and a package folder of the same weights that holds
    the processor shipped with the pack."""
    import json

    from lingbot_core import load_processor
    from lingbot_core.testing import file_fixtures as ff
    from lingbot_core.testing.fixtures import MODEL_INDEX, tiny_wan21_vae

    root = tmp_path_factory.mktemp("three")
    held = ff.write_dit_gguf(root / "models" / "lingbot-files-dense-Q8_0.gguf", moe=False, seed=3)
    te = ff.write_text_encoder_file(root / "models" / "qwen3vl_tiny.safetensors", seed=3)
    vae = ff.write_wan21_vae_file(root / "models" / "wan_2.1_vae.safetensors", seed=3)
    pkg = root / "pkg"
    (pkg / "transformer").mkdir(parents=True)
    (pkg / "model_index.json").write_text(json.dumps(MODEL_INDEX))
    config = {"_class_name": "LingBotVideoTransformer3DModel", **ff.files_dit_config(False)}
    (pkg / "transformer" / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in held.items()}, str(pkg / "transformer" / "diffusion_pytorch_model.safetensors"))
    ff.tiny_text_encoder(3).save_pretrained(pkg / "text_encoder")
    tiny_wan21_vae(3).save_pretrained(pkg / "vae")
    load_processor(None).save_pretrained(pkg / "processor")
    return {"dit": root / "models" / "lingbot-files-dense-Q8_0.gguf", "te": te, "vae": vae, "pkg": pkg,
            "text_config": ff.TINY_TEXT_CONFIG}


FP32 = {"transformer": "fp32", "text_encoder": "fp32"}


@pytest.mark.parametrize("image", [False, True], ids=["t2v", "ti2v"])
def test_three_files_alone_give_the_package_frames(three_files, image):
    """load_pipeline(None, three files) == the same weights as a package folder holding the shipped processor."""
    kw = dict(RUN, height=64, width=64)
    if image:
        g = torch.Generator().manual_seed(2)
        kw["image"] = torch.rand(64, 64, 3, generator=g)
    ref = _aligned(load_pipeline(three_files["pkg"], device="cpu", dtypes=FP32))
    try:
        want = ref.generate("a cat on a sofa, 一只猫 🐱", **kw)
    finally:
        ref.release()
    pipe = load_pipeline(None, device="cpu", dtypes=FP32, transformer_file=three_files["dit"],
                         text_encoder_file=three_files["te"], vae_file=three_files["vae"],
                         text_encoder_config=three_files["text_config"])
    try:
        assert pipe.model_dir is None and len(pipe.processor.tokenizer) == 151669
        assert pipe.text_encoder.config.text_config.vocab_size == 151936
        got = _aligned(pipe).generate("a cat on a sofa, 一只猫 🐱", **kw)
    finally:
        pipe.release()
    assert want.shape == got.shape and torch.isfinite(want).all() and want.std() > 0.01
    assert torch.equal(got, want)


def test_the_shipped_4b_config_refuses_a_smaller_text_encoder_by_name(three_files):
    with pytest.raises(ModelPackageError, match=r"qwen3vl_tiny.safetensors is a Qwen3-VL of hidden size 64.*Qwen3-VL-4B \(hidden size 2560\)"):
        load_pipeline(None, device="cpu", transformer_file=three_files["dit"], text_encoder_file=three_files["te"],
                      vae_file=three_files["vae"])


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


def test_the_refiner_as_a_file_refines_from_the_three_files_alone(tmp_path):
    """transformer_subfolder='refiner' with an MoE GGUF: its config from the shapes (128 experts), no package."""
    from lingbot_core.testing import file_fixtures as ff

    dit = tmp_path / "lingbot-refiner-Q8_0.gguf"
    ff.write_dit_gguf(dit, moe=True, seed=5)
    te = ff.write_text_encoder_file(tmp_path / "qwen3vl_tiny.safetensors", sidecar=True)  # its config beside it
    vae = ff.write_wan21_vae_file(tmp_path / "wan_2.1_vae.safetensors")
    pipe = load_pipeline(None, transformer_subfolder="refiner", device="cpu", dtypes=FP32, transformer_file=dit,
                         text_encoder_file=te, vae_file=vae)
    try:
        assert pipe.transformer.config.num_experts == 128 and pipe.transformer_subfolder == "refiner"
        frames = torch.rand(5, 32, 32, 3, generator=torch.Generator().manual_seed(0))
        out = pipe.refine(frames, "a cat", height=64, width=64, steps=2, seed=1, output_type="pt")
    finally:
        pipe.release()
    assert out.shape == (5, 64, 64, 3) and torch.isfinite(out).all() and out.std() > 0.01


def test_the_wan21_vae_file_fixture_is_the_original_layout(tmp_path):
    """Issue 32 item 7: a small Wan 2.1 VAE file under the original Wan names and architecture (what
    Comfy-Org's wan_2.1_vae.safetensors holds), read with the shipped config at the file's own width."""
    from safetensors import safe_open

    from lingbot_core.files.vae_layout import ORIGINAL_WAN21_ARCH
    from lingbot_core.model.component_files import load_vae_file, vae_config
    from lingbot_core.testing.file_fixtures import write_wan21_vae_file
    from lingbot_core.testing.fixtures import tiny_wan21_vae

    path = write_wan21_vae_file(tmp_path / "wan_2.1_vae.safetensors", seed=2)
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("encoder.conv1.weight").shape[0] == 4  # base width 4 (the release: 96)
    assert {"decoder.middle.0.residual.0.gamma", "decoder.upsamples.3.resample.1.weight", "conv2.weight"} <= keys
    assert not any(k.startswith(("decoder.mid_block", "decoder.up_blocks")) for k in keys)
    config = vae_config(None, path)
    assert config["base_dim"] == 4 and all(config[k] == v for k, v in ORIGINAL_WAN21_ARCH.items() if k != "is_residual")
    vae = load_vae_file(path, torch.float32, config)
    want = tiny_wan21_vae(2).state_dict()
    got = vae.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_the_memory_budget_counts_the_three_files_without_a_package(three_files):
    """The pool's RAM and pinned-ring figures come from the files' headers alone when there is no package."""
    from lingbot_core.memory.budget import package_bytes
    from lingbot_core.memory.block_streaming import ring_staging_bytes
    from lingbot_core.pipeline_pool import PipelinePool

    files = {"transformer": str(three_files["dit"]), "text_encoder": str(three_files["te"]), "vae": str(three_files["vae"])}
    dtypes = {"transformer": torch.float32, "text_encoder": torch.float32, "vae": torch.float32}
    total = package_bytes(None, "transformer", dtypes, files)
    te_and_vae = three_files["te"].stat().st_size + three_files["vae"].stat().st_size
    assert te_and_vae < total < te_and_vae + 4 * three_files["dit"].stat().st_size
    assert ring_staging_bytes(None, "transformer", torch.bfloat16, files["transformer"]) > 0
    pipe = PipelinePool().handle(None, device="cpu", transformer_file=files["transformer"],
                                 text_encoder_file=files["text_encoder"], vae_file=files["vae"])
    assert pipe.spec.model_dir is None and pipe.spec.label.startswith("lingbot-files-dense-Q8_0.gguf")
    assert pipe.pool.weight_bytes(pipe.spec) == package_bytes(None, "transformer", pipe.spec.load_dtypes(), files)
    with pytest.raises(ModelPackageError, match="vae_file is missing"):
        PipelinePool().handle(None, device="cpu", transformer_file=files["transformer"], text_encoder_file=files["text_encoder"])


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
