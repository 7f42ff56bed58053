"""LoadLingbotLoRA and the four-step example workflow in the real headless ComfyUI (tiny MoE, tiny LoRA)."""

from __future__ import annotations

import numpy as np
import pytest

from comfy_host import PromptValidationError
from test_lora import lightx2v_lora
from test_nodes_comfy import (
    FRAMES, H, MOE, SHORT_CAPTION, W, decode_video, example_as_api, generate, loader, node_files, nodes_of,
    patch_nodes, save_image, saved_frames,
)

pytestmark = pytest.mark.comfy

TINY_LORA = "lingbot_tiny_4steps.safetensors"
EXAMPLE = "lingbot_moe_4step_lora"


@pytest.fixture(scope="module")
def server(comfy_server, tmp_path_factory):
    folder = comfy_server.models_dir / "loras"
    folder.mkdir(parents=True, exist_ok=True)
    lightx2v_lora(folder / TINY_LORA)
    (folder / "not_listed.ckpt").write_bytes(b"pickle")
    return comfy_server


@pytest.fixture(scope="module")
def object_info(server):
    return server.object_info()


def test_node_lists_only_safetensors_loras(object_info):
    info = object_info["LoadLingbotLoRA"]
    assert info["display_name"] == "LingBot-Video Load LoRA"
    names, opts = info["input"]["required"]["lora_name"][0], info["input"]["required"]["strength"][1]
    assert TINY_LORA in names and "not_listed.ckpt" not in names
    assert (opts["default"], opts["min"], opts["max"]) == (1.0, -10.0, 10.0)
    assert info["output"] == ["LINGBOT_PIPE"]


def test_four_step_example_loads_with_no_missing_node_and_runs_on_the_tiny_moe(server, object_info):
    wf, api = example_as_api(EXAMPLE, object_info)
    (lid,) = nodes_of(api, "LoadLingbotLoRA")
    (gid,) = nodes_of(api, "GenerateVideo")
    g = api[gid]["inputs"]
    assert api[lid]["inputs"]["lora_name"] == "lightlingbot_video_moe30b_4steps_rank128_v2.safetensors"
    assert api[lid]["inputs"]["strength"] == 1.0 and g["pipe"] == [lid, 0]
    assert (g["steps"], g["guidance_scale"], g["shift"], g["width"], g["height"], g["sampler"]) == (4, 1.0, 3.0, 832, 480, "unipc")
    (note,) = [n for n in wf["nodes"] if n["type"] == "Note"]
    assert "lightlingbot_video_moe30b_4steps_rank128_v2.safetensors" in note["widgets_values"][0]
    assert "models/loras" in note["widgets_values"][0]

    patch_nodes(api, "LoadLingbotPipeline", model=MOE)
    run_tiny_four_step_example(server, api, EXAMPLE)


def run_tiny_four_step_example(server, api: dict, name: str, lora: str = TINY_LORA) -> None:
    """Run a four-step LoRA example (its loader already patched to a tiny model) with a tiny LoRA at
    the fixture's size, and check the video it saves."""
    patch_nodes(api, "LoadLingbotLoRA", lora_name=lora)
    patch_nodes(api, "GenerateVideo", width=W, height=H, num_frames=FRAMES)
    for sid in nodes_of(api, "SaveVideo"):
        api[sid]["inputs"]["filename_prefix"] = f"test_{name}_{sid}"
    entry = server.run(api, timeout=600)
    (sid,) = nodes_of(api, "SaveVideo")
    (path,) = node_files(server, entry, sid)
    frames, rate = decode_video(path)
    assert frames.shape == (FRAMES, H, W, 3) and rate == 24 and frames.std() > 1.0


def test_lora_changes_frames_and_strength_zero_gives_the_plain_pipeline(server):
    def graph(prefix, strength=None):
        g = {"1": loader(MOE, offload="block")}
        src = "1"
        if strength is not None:
            g["2"] = {"class_type": "LoadLingbotLoRA", "inputs": {"pipe": ["1", 0], "lora_name": TINY_LORA, "strength": strength}}
            src = "2"
        g["3"] = generate(src, steps=2, guidance_scale=1.0, prompt=SHORT_CAPTION)
        g["4"] = save_image("3", prefix)
        return g

    plain = saved_frames(server, server.run(graph("lora_plain")), "4")
    with_lora = saved_frames(server, server.run(graph("lora_on", 1.0)), "4")
    off = saved_frames(server, server.run(graph("lora_off", 0.0)), "4")
    again = saved_frames(server, server.run(graph("lora_plain2")), "4")  # the shared pipeline after the LoRA
    assert np.abs(with_lora.astype(int) - plain).max() > 2
    np.testing.assert_array_equal(off, plain)
    np.testing.assert_array_equal(again, plain)


def test_unlisted_lora_names_are_refused(server):
    for name in ("../../secret.safetensors", "not_listed.ckpt"):
        g = {"1": loader(MOE), "2": {"class_type": "LoadLingbotLoRA", "inputs": {"pipe": ["1", 0], "lora_name": name, "strength": 1.0}},
             "3": generate("2", steps=1), "4": save_image("3", "refused")}
        with pytest.raises(PromptValidationError):
            server.queue(g)
