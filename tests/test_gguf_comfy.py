"""'Load LingBot-Video Pipeline (files)' and the GGUF four-step example in the real headless ComfyUI: a tiny
MoE GGUF in models/diffusion_models, a tiny LoRA, offload block."""

from __future__ import annotations

import pytest

from test_lora import lightx2v_lora
from test_lora_comfy import TINY_LORA, run_tiny_four_step_example
from test_nodes_comfy import MOE, example_as_api, nodes_of, patch_nodes

pytestmark = pytest.mark.comfy
gguf = pytest.importorskip("gguf")

TINY_GGUF = "lingbot-tiny-moe-Q8_0.gguf"
EXAMPLE = "lingbot_moe_gguf_4step_lora"


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
    return comfy_server


def test_files_loader_lists_component_files_and_runs_the_gguf_example(server):
    info = server.object_info()
    node = info["LoadLingbotPipelineFiles"]
    assert node["display_name"] == "Load LingBot-Video Pipeline (files)" and node["output"] == ["LINGBOT_PIPE"]
    dit_files = node["input"]["required"]["dit_file"][0]
    assert TINY_GGUF in dit_files and "other.ckpt" not in dit_files and dit_files[0] == "(from the package)"
    for key in ("offload", "dit_precision", "text_encoder_precision", "vae_precision", "transformer"):
        assert node["input"]["required"][key] == info["LoadLingbotPipeline"]["input"]["required"][key] or key == "model"

    _, api = example_as_api(EXAMPLE, info)
    (pid,) = nodes_of(api, "LoadLingbotPipelineFiles")
    assert api[pid]["inputs"]["offload"] == "block" and api[pid]["inputs"]["dit_file"].endswith(".gguf")
    (gid,) = nodes_of(api, "GenerateVideo")
    g = api[gid]["inputs"]
    assert (g["steps"], g["guidance_scale"], g["shift"]) == (4, 1.0, 3.0)
    patch_nodes(api, "LoadLingbotPipelineFiles", model=MOE, dit_file=TINY_GGUF, text_encoder_file="(from the package)",
                vae_file="(from the package)")
    run_tiny_four_step_example(server, api, EXAMPLE)


def test_a_typed_path_is_refused(server):
    from test_nodes_comfy import generate, save_image
    from comfy_host import PromptValidationError

    g = {"1": {"class_type": "LoadLingbotPipelineFiles", "inputs": {
        "model": MOE, "dit_file": "/etc/passwd", "text_encoder_file": "(from the package)", "vae_file": "(from the package)",
        "transformer": "transformer", "offload": "none", "dit_precision": "auto", "text_encoder_precision": "auto",
        "vae_precision": "fp32"}}}
    g["2"] = generate("1", steps=1, guidance_scale=1.0)
    g["3"] = save_image("2", "test_gguf_typed_path")
    with pytest.raises(PromptValidationError):
        server.run(g, timeout=120)
