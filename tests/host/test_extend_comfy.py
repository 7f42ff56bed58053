"""Extend Video in the real headless ComfyUI (issue 50): the example chain (text-to-video, extended twice, then
refined) on the tiny packages, the input's frames unchanged through the server, and a bad request refused with
its fix (the session's one server, shared with the other host tests)."""

from __future__ import annotations

import numpy as np
import pytest

from support.comfy_graphs import (
    DENSE, H, MOE, REF_H, REF_W, SHORT_CAPTION, W, decode_video, example_as_api, generate, loader, node_files, nodes_of,
    patch_nodes, save_image, saved_frames,
)
from support.comfy_host import execution_error

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def object_info(comfy_server):
    return comfy_server.object_info()


def _saved_video(server, entry, node_id):
    (path,) = node_files(server, entry, node_id)
    return decode_video(path)


def test_the_extend_chain_example_extends_twice_and_refines(comfy_server, object_info):
    wf, api = example_as_api("lingbot_extend_chain_refine", object_info)
    (gid,) = nodes_of(api, "GenerateVideo")
    first, second = sorted(nodes_of(api, "ExtendVideo"), key=lambda n: api[n]["inputs"]["frames"] != [gid, 0])
    (rid,) = nodes_of(api, "Refine")
    one, two = api[first]["inputs"], api[second]["inputs"]
    assert api[gid]["inputs"]["num_frames"] == 81 and (one["new_frames"], one["keep_frames"]) == (80, 1)
    assert one["frames"] == [gid, 0] and two["frames"] == [first, 0] and two["fps"] == [first, 1]
    assert api[rid]["inputs"]["frames"] == [second, 0] and api[rid]["inputs"]["fps"] == [second, 1]
    assert (api[rid]["inputs"]["width"], api[rid]["inputs"]["height"], api[rid]["inputs"]["context_frames"]) == (1920, 1088, 121)
    base_loader, refiner_loader = sorted(nodes_of(api, "LoadLingbotPipeline"), key=lambda n: api[n]["inputs"]["transformer"] != "transformer")
    assert api[refiner_loader]["inputs"]["transformer"] == "refiner"

    api[base_loader]["inputs"]["model"], api[refiner_loader]["inputs"]["model"] = DENSE, MOE
    patch_nodes(api, "GenerateVideo", width=W, height=H, num_frames=5, steps=2)
    patch_nodes(api, "ExtendVideo", new_frames=4, steps=2)
    two["keep_frames"] = 5  # the second extend pins two latent frames of the first one's tail
    patch_nodes(api, "Refine", width=REF_W, height=REF_H, steps=2, context_frames=9, context_overlap=4)
    saves = {api[n]["inputs"]["filename_prefix"]: n for n in nodes_of(api, "SaveVideo")}
    for prefix, n in saves.items():
        api[n]["inputs"]["filename_prefix"] = "test_" + prefix.replace("/", "_")
    entry = comfy_server.run(api, timeout=900)
    base, base_rate = _saved_video(comfy_server, entry, saves["lingbot/extend_chain_base"])
    refined, rate = _saved_video(comfy_server, entry, saves["lingbot/extend_chain_refined"])
    assert base.shape == (5 + 4 + 4, H, W, 3) and base_rate == 24 and base.std() > 1.0
    assert refined.shape == (13, REF_H, REF_W, 3) and rate == 24 and refined.std() > 1.0


def _extend(frames, keep_frames=1, new_frames=4):
    return {"class_type": "ExtendVideo", "inputs": {
        "pipe": ["1", 0], "frames": frames, "prompt": SHORT_CAPTION, "negative_prompt": "", "new_frames": new_frames,
        "keep_frames": keep_frames, "steps": 2, "guidance_scale": 3.0, "shift": 3.0, "seed": 7, "fps": 30.0}}


def test_extend_keeps_the_input_frames_and_refuses_a_tail_longer_than_the_video(comfy_server):
    graph = {"1": loader(DENSE), "2": generate("1", steps=2), "3": _extend(["2", 0]),
             "4": save_image("2", "test_extend_in"), "5": save_image("3", "test_extend_out"),
             "6": {"class_type": "PreviewAny", "inputs": {"source": ["3", 1]}}}
    entry = comfy_server.run(graph, timeout=600)
    before, after = saved_frames(comfy_server, entry, "4"), saved_frames(comfy_server, entry, "5")
    assert before.shape == (5, H, W, 3) and after.shape == (9, H, W, 3)
    assert np.array_equal(after[:5], before)  # the same 8-bit frames: nothing re-encoded, nothing repeated
    assert entry["outputs"]["6"]["text"] == ["30.0"]  # the input's fps passed on

    graph["3"] = _extend(["2", 0], keep_frames=9)
    failed = comfy_server.run(graph, timeout=600, check=False)
    err = execution_error(failed)
    assert err["node_type"] == "ExtendVideo" and "keep_frames=9 is longer than the video (5 frames): use at most 5" in err["exception_message"]
    graph["3"] = _extend(["2", 0], new_frames=6)
    err = execution_error(comfy_server.run(graph, timeout=600, check=False))
    assert "new_frames=6 is not allowed" in err["exception_message"] and "the nearest: 4 or 8" in err["exception_message"]
