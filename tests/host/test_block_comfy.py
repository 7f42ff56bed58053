"""Issue 10 in the real ComfyUI host: the loader lists offload ``block``, the fp8 DiT precisions and an
optional ``blocks_on_gpu``; a saved workflow from before (no ``blocks_on_gpu``) still loads and runs;
``block`` gives the frames of ``model`` bit for bit; an fp8 DiT runs."""

import copy
import json

import numpy as np
import pytest

from support.comfy_host import executed_nodes, workflow_to_api
from support.comfy_graphs import EXAMPLES, alias_package, widget_inputs, saved_frames, t2v_graph

pytestmark = pytest.mark.comfy


def test_loader_lists_block_fp8_and_blocks_on_gpu(comfy_server):
    info = comfy_server.object_info("LoadLingbotPipeline")
    inputs = widget_inputs(info)
    assert inputs["offload"][0] == ["none", "model", "sequential", "block"]
    assert inputs["dit_precision"][0] == ["auto", "bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2"]
    assert inputs["text_encoder_precision"][0] == ["auto", "bf16", "fp16", "fp32"]
    spec = info["input"]["optional"]["blocks_on_gpu"]
    assert spec[0] == "INT" and spec[1]["default"] == 0 and spec[1]["min"] == 0 and spec[1]["max"] == 64


def test_old_workflow_loads_and_block_matches_model(comfy_server, packages):
    object_info = {"LoadLingbotPipeline": comfy_server.object_info("LoadLingbotPipeline")}
    # A workflow saved before issue 10: the loader has six widget values.
    old = json.loads((EXAMPLES / "lingbot_t2v.json").read_text(encoding="utf-8"))
    old["nodes"] = [n for n in old["nodes"] if n["type"] == "LoadLingbotPipeline"]
    old["links"] = []
    old["nodes"][0]["widgets_values"] = old["nodes"][0]["widgets_values"][:6]
    api = workflow_to_api(old, object_info)
    (node,) = api.values()
    assert "blocks_on_gpu" not in node["inputs"]

    model = alias_package(comfy_server, packages, "dense", "blocks/lingbot-tiny-dense")
    graph = t2v_graph(model, "block_old", seed=61, steps=2)
    assert "blocks_on_gpu" not in graph["1"]["inputs"]  # the old prompt form
    first = comfy_server.run(graph)
    assert executed_nodes(first) == ["1", "2", "3"]
    reference = saved_frames(comfy_server, first, "3")

    block = copy.deepcopy(graph)
    block["1"]["inputs"].update(offload="block", blocks_on_gpu=1)
    entry = comfy_server.run(block)
    assert executed_nodes(entry) == ["1", "2", "3"]
    assert np.array_equal(saved_frames(comfy_server, entry, "3"), reference)

    fp8 = copy.deepcopy(block)
    fp8["1"]["inputs"].update(dit_precision="fp8_e4m3fn", blocks_on_gpu=0)
    fp8["3"]["inputs"]["filename_prefix"] = "block_fp8"
    entry = comfy_server.run(fp8)
    frames = saved_frames(comfy_server, entry, "3")
    assert frames.shape == reference.shape and not np.array_equal(frames, reference)
    # fp8 weights (bf16 compute) against the fp32 package: close, not equal
    assert np.abs(frames.astype(int) - reference.astype(int)).mean() < 8
