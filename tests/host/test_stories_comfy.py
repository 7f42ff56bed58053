"""Prompt Schedule and Size Preset (issue 50) in the session's real headless ComfyUI (no server of its own).

13 frames = 4 latent frames; context_frames 9 / overlap 4 gives windows of 3 latent frames at [0, 3) and [1, 4),
two windows, so a two-part schedule conditions one window per part.
"""

from __future__ import annotations

import numpy as np
import pytest

from lingbot_core.model.latents import latent_shape
from lingbot_core.model.size_presets import BUCKETS
from lingbot_core.prompts.prompt_schedule import check_schedule, parse_starts, split_parts, window_parts
from lingbot_core.prompts.text_conditioning import parse_prompt
from lingbot_core.sampling.context_windows import centre_frame, check_context
from support.comfy_host import execution_error
from support.comfy_graphs import (
    alias_package, example_as_api, generate, loader, nodes_of, save_image, saved_frames, widget_inputs,
)

comfy = pytest.mark.comfy

STORY = dict(num_frames=13, steps=1, context_frames=9, context_overlap=4, prompt="")


def schedule(parts: str, starts: str = "", negative: str = "") -> dict:
    return {"class_type": "LingbotPromptSchedule", "inputs": {"parts": parts, "start_frames": starts, "negative_prompt": negative}}


def story_graph(model: str, prefix: str, parts: str, **gen) -> dict:
    graph = {"1": loader(model), "4": schedule(parts), "2": generate("1", **{**STORY, **gen}), "3": save_image("2", prefix)}
    graph["2"]["inputs"]["prompt_schedule"] = ["4", 0]
    return graph


@comfy
def test_schedule_node_feeds_generate(comfy_server, packages):
    model = alias_package(comfy_server, packages, "dense", "lingbot-tiny-dense-stories")
    plain = {"1": loader(model), "2": generate("1", **{**STORY, "prompt": "a red kite"}), "3": save_image("2", "story_plain")}
    single = saved_frames(comfy_server, comfy_server.run(plain), "3")
    same = saved_frames(comfy_server, comfy_server.run(story_graph(model, "story_same", "a red kite\n---\na red kite")), "3")
    story = saved_frames(comfy_server, comfy_server.run(story_graph(model, "story_two", "a red kite\n---\na blue boat")), "3")
    assert single.shape == (13, 64, 96, 3)
    assert np.array_equal(same, single)  # identical parts: exactly the single prompt
    assert not np.array_equal(story, single)

    entry = comfy_server.run(story_graph(model, "story_three", "a\n---\nb\n---\nc"), check=False)
    err = execution_error(entry)
    assert err is not None and "3 parts but the video is sampled in only 2 context windows" in err["exception_message"], err
    entry = comfy_server.run(story_graph(model, "story_nowin", "a\n---\nb", context_frames=1), check=False)
    err = execution_error(entry)
    assert err is not None and "needs context windows" in err["exception_message"], err


@comfy
def test_size_preset_is_the_cli_table(comfy_server):
    info = comfy_server.object_info("LingbotSizePreset")
    presets = widget_inputs(info)["preset"][0]
    listed = [tuple(map(int, p.split(" - ")[1].split(" ")[0].split("x"))) for p in presets]  # (width, height)
    assert listed == [(w, h) for ratios in BUCKETS.values() for h, w in ratios.values()]
    assert info["output"] == ["INT", "INT"] and info["output_name"] == ["width", "height"]
    label = "480p 9:16 - 832x480 (landscape)"
    assert label in presets and widget_inputs(info)["preset"][1]["default"] == label
    graph = {"1": {"class_type": "LingbotSizePreset", "inputs": {"preset": "720p 16:9 - 736x1280 (portrait)"}},
             "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}},
             "3": {"class_type": "PreviewAny", "inputs": {"source": ["1", 1]}}}
    entry = comfy_server.run(graph)
    assert (entry["outputs"]["2"]["text"][0], entry["outputs"]["3"]["text"][0]) == ("736", "1280")
    for name in ("LingbotPromptSchedule", "LingbotSizePreset"):
        node = comfy_server.object_info(name)
        assert node["category"] == "LingBot-Video" and node["description"], name
        assert all(spec[1].get("tooltip") for spec in widget_inputs(node).values()), name
        assert len(node["output_tooltips"]) == len(node["output"]), name
    assert widget_inputs(comfy_server.object_info("GenerateVideo"))["prompt_schedule"][0] == "LINGBOT_PROMPT_SCHEDULE"


@comfy
def test_story_example_is_a_valid_workflow_with_the_documented_windows(comfy_server):
    wf, api = example_as_api("lingbot_story_three_parts", comfy_server.object_info())
    (sid,) = nodes_of(api, "LingbotPromptSchedule")
    (gid,) = nodes_of(api, "GenerateVideo")
    (pid,) = nodes_of(api, "LingbotSizePreset")
    assert api[gid]["inputs"]["prompt_schedule"] == [sid, 0]
    assert (api[gid]["inputs"]["width"], api[gid]["inputs"]["height"]) == ([pid, 0], [pid, 1])
    parts = split_parts(api[sid]["inputs"]["parts"])
    assert len(parts) == 3 and all(parse_prompt(p).structured for p in parts)
    # the documented layout: 241 frames in 81-frame windows sharing 24 -> 4 windows, centres 40, 92, 144, 200
    windows = check_context(api[gid]["inputs"]["context_frames"], api[gid]["inputs"]["context_overlap"])
    spans = windows.spans(latent_shape(api[gid]["inputs"]["num_frames"], 480, 832)[2])
    schedule = check_schedule(parts, api[gid]["inputs"]["num_frames"], parse_starts(api[sid]["inputs"]["start_frames"]))
    assert window_parts(schedule, [centre_frame(s) for s in spans]) == [0, 1, 1, 2]
