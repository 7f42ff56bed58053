"""'Load LingBot-Video Pipeline (files)' and the GGUF four-step example in the real headless ComfyUI: a tiny
MoE GGUF in models/diffusion_models, llama.cpp's text GGUF in models/text_encoders, a tiny LoRA, offload block."""

from __future__ import annotations

import pytest

from support.lora_files import lightx2v_lora
from support.comfy_graphs import TINY_LORA, run_tiny_four_step_example
from support.comfy_graphs import MOE, example_as_api, nodes_of, patch_nodes

pytestmark = pytest.mark.comfy
gguf = pytest.importorskip("gguf")

TINY_GGUF = "lingbot-tiny-moe-Q8_0.gguf"
FILES_GGUF = "lingbot-tiny-files-moe-Q8_0.gguf"  # an MoE its shapes describe (128 experts, head size 128)
FILES_LORA = "lingbot_tiny_files_4steps.safetensors"
EXAMPLE = "lingbot_moe_gguf_4step_lora"
TEXT_GGUF = "Qwen3-VL-4B-Instruct-Q8_0.gguf"  # llama.cpp's text model (tiny, its config beside it)
MMPROJ = "mmproj-Qwen3-VL-4B-Instruct-F16.gguf"  # its vision projector: not a text encoder of its own


def files_moe_lora(path):
    """A four-step-LoRA-like file (LightX2V's .lora.down/.lora.up names) for the files fixture's MoE."""
    import torch
    from safetensors.torch import save_file

    from lingbot_core.testing.file_fixtures import files_dit_config

    cfg = files_dit_config(moe=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for b in range(cfg["depth"]):
        for m in ("to_q", "to_k", "to_v"):
            tensors[f"blocks.{b}.attn.{m}.lora.down.weight"] = torch.randn(4, cfg["hidden_size"], generator=gen) * 0.2
            tensors[f"blocks.{b}.attn.{m}.lora.up.weight"] = torch.randn(cfg["hidden_size"], 4, generator=gen) * 0.2
    save_file(tensors, str(path))


@pytest.fixture(scope="module")
def server(comfy_server, packages):
    from lingbot_core.testing.gguf_fixtures import package_state, write_gguf_dit

    loras = comfy_server.models_dir / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    lightx2v_lora(loras / TINY_LORA)
    unet = comfy_server.models_dir / "diffusion_models"
    unet.mkdir(parents=True, exist_ok=True)
    write_gguf_dit(unet / TINY_GGUF, package_state(packages["moe"]), "Q8_0", layout="rebel")
    (unet / "other.ckpt").write_bytes(b"pickle")
    # The three files alone, the text encoder and VAE under the example's names (Comfy-Org's files).
    from lingbot_core.testing.file_fixtures import write_comfy_files

    write_comfy_files(comfy_server.models_dir, moe=True, seed=1, dit_name=FILES_GGUF)
    files_moe_lora(loras / FILES_LORA)
    from lingbot_core.testing.file_fixtures import write_text_encoder_gguf_file

    text = comfy_server.models_dir / "text_encoders"
    write_text_encoder_gguf_file(text / TEXT_GGUF, seed=1)
    (text / MMPROJ).write_bytes(b"GGUF")
    return comfy_server


def test_files_loader_lists_component_files_and_runs_the_gguf_example(server):
    info = server.object_info()
    node = info["LoadLingbotPipelineFiles"]
    assert node["display_name"] == "Load LingBot-Video Pipeline (files)" and node["output"] == ["LINGBOT_PIPE"]
    dit_files = node["input"]["required"]["dit_file"][0]
    assert TINY_GGUF in dit_files and "other.ckpt" not in dit_files and dit_files[0] == "(from the package)"
    text_files = node["input"]["required"]["text_encoder_file"][0]
    assert TEXT_GGUF in text_files and MMPROJ not in text_files and TEXT_GGUF not in dit_files
    for key in ("offload", "dit_precision", "text_encoder_precision", "vae_precision", "transformer"):
        assert node["input"]["required"][key] == info["LoadLingbotPipeline"]["input"]["required"][key] or key == "model"

    _, api = example_as_api(EXAMPLE, info)
    (pid,) = nodes_of(api, "LoadLingbotPipelineFiles")
    assert api[pid]["inputs"]["offload"] == "block" and api[pid]["inputs"]["dit_file"].endswith(".gguf")
    (gid,) = nodes_of(api, "GenerateVideo")
    g = api[gid]["inputs"]
    assert (g["steps"], g["guidance_scale"], g["shift"]) == (4, 1.0, 3.0)
    # the text encoder from llama.cpp's Q8_0 text GGUF (offload block: its layers stream their block bytes)
    patch_nodes(api, "LoadLingbotPipelineFiles", model=MOE, dit_file=TINY_GGUF, text_encoder_file=TEXT_GGUF,
                vae_file="(from the package)")
    run_tiny_four_step_example(server, api, EXAMPLE)


def test_the_gguf_example_runs_from_the_three_files_alone(server):
    """The example as shipped: 'model' = '(none: the three files)', the text encoder and VAE widgets as they are
    (qwen3vl_4b_bf16 / wan_2.1_vae: the fixture's files under those names); only the DiT and LoRA names and the
    size are changed to the fixture's."""
    info = server.object_info()
    model = info["LoadLingbotPipelineFiles"]["input"]["required"]["model"]
    assert model[0][0] == "(none: the three files)" and model[1]["default"] == "(none: the three files)"
    assert "(none: the three files)" not in info["LoadLingbotPipeline"]["input"]["required"]["model"][0]
    vae_files = info["LoadLingbotPipelineFiles"]["input"]["required"]["vae_file"][0]
    assert "wan_2.1_vae.safetensors" in vae_files

    _, api = example_as_api(EXAMPLE, info)
    (pid,) = nodes_of(api, "LoadLingbotPipelineFiles")
    p = api[pid]["inputs"]
    assert (p["model"], p["text_encoder_file"], p["vae_file"]) == (
        "(none: the three files)", "qwen3vl_4b_bf16.safetensors", "wan_2.1_vae.safetensors")
    patch_nodes(api, "LoadLingbotPipelineFiles", dit_file=FILES_GGUF)
    run_tiny_four_step_example(server, api, "three_files", lora=FILES_LORA)


def test_none_with_a_file_left_from_the_package_names_the_widget(server):
    from support.comfy_graphs import generate, save_image
    from support.comfy_host import PromptExecutionError

    g = {"1": {"class_type": "LoadLingbotPipelineFiles", "inputs": {
        "model": "(none: the three files)", "dit_file": FILES_GGUF, "text_encoder_file": "qwen3vl_4b_bf16.safetensors",
        "vae_file": "(from the package)", "transformer": "transformer", "offload": "none", "dit_precision": "auto",
        "text_encoder_precision": "auto", "vae_precision": "fp32"}}}
    g["2"] = generate("1", steps=1, guidance_scale=1.0)
    g["3"] = save_image("2", "test_none_missing_vae")
    with pytest.raises(PromptExecutionError, match="vae_file"):
        server.run(g, timeout=120)


def test_a_typed_path_is_refused(server):
    from support.comfy_graphs import generate, save_image
    from support.comfy_host import PromptValidationError

    g = {"1": {"class_type": "LoadLingbotPipelineFiles", "inputs": {
        "model": MOE, "dit_file": "/etc/passwd", "text_encoder_file": "(from the package)", "vae_file": "(from the package)",
        "transformer": "transformer", "offload": "none", "dit_precision": "auto", "text_encoder_precision": "auto",
        "vae_precision": "fp32"}}}
    g["2"] = generate("1", steps=1, guidance_scale=1.0)
    g["3"] = save_image("2", "test_gguf_typed_path")
    with pytest.raises(PromptValidationError):
        server.run(g, timeout=120)
