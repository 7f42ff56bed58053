"""LoadLingbotLoRA and the four-step example workflow in the real headless ComfyUI (tiny MoE, tiny LoRA)."""

from __future__ import annotations

import numpy as np
import pytest

from support.comfy_host import PromptValidationError
from support.lora_files import lightx2v_lora
from support.comfy_graphs import (
    MOE, SHORT_CAPTION, example_as_api, generate, loader, nodes_of, patch_nodes, save_image, saved_frames,
)
from support.comfy_graphs import TINY_LORA, run_tiny_four_step_example

pytestmark = pytest.mark.comfy

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
