"""Prompt tools in a real headless ComfyUI, against the local chat server (127.0.0.1, tests/support/chat_server.py).

The example workflow prose -> rewrite -> TI2V -> Refine runs with tiny sizes: the rewritten caption has a
1 s duration and GenerateVideo runs at 4 fps, so the caption's duration gives 5 frames.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from support.chat_server import Reply
from support.comfy_host import execution_error, executed_nodes, workflow_to_api
from lingbot_core.net.server_list import LOCAL
from support.comfy_graphs import (
    EXAMPLE_IMAGE, EXAMPLES, FRAMES, H, MOE, REF_H, REF_W, W, reset_comfy_cache, check_ui_format, decode_video, load_workflow, node_files, nodes_of, patch_nodes,
)

comfy = pytest.mark.comfy

BASE, LORA = "Qwen/Qwen3.6-27B", "lingbot-video-rewriter"  # the example workflow's model names
SYS_MODULE = ('VIDEO_STEP1_EXPAND = "Expand the video prompt."\nVIDEO_STEP2_MAP = "Map to JSON."\n'
              'IMAGE_STEP1_EXPAND = "Expand the image prompt."\nIMAGE_STEP2_MAP = "Map the image caption."\n')
CAPTION = {"comprehensive_description": {"scene_content_description": "A red kite rises.",
                                         "camera_movement_description": "Tilt up."},
           "prominent_elements": [{"name": "kite", "actions": [{"timestamp": "[0.0s - 1.0s]", "action": "rises"}]}]}
VIDEO_SHA = "43704d85b3951aed0e1d31d2679c3ced979fc11b3c16658bd21286d086b8ea69"  # lingbot-video-model.md §6.7


@pytest.fixture(scope="module")
def server(comfy_server, chat_server):
    comfy_server.add_input(EXAMPLES / EXAMPLE_IMAGE)
    folder = comfy_server.models_dir / "lingbot_rewriter" / "rewriter"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.py").write_text(SYS_MODULE, encoding="utf-8")
    (folder / "NEG_SYS.txt").write_text("Delete negative terms that contradict the caption.", encoding="utf-8")
    return comfy_server


@pytest.fixture
def chat(chat_server):
    chat_server.clear()
    chat_server.replies.clear()
    chat_server.replies.update({BASE: "A red kite rises into the evening sky.",
                                LORA: "```json\n" + json.dumps(CAPTION) + "\n```"})
    return chat_server


def preview(src: str, slot: int = 0) -> dict:
    return {"class_type": "PreviewAny", "inputs": {"source": [src, slot]}}


def preview_text(entry: dict, node_id: str) -> str:
    return entry["outputs"][node_id]["text"][0]


def rewriter_node(url: str, **kw) -> dict:
    inputs = {"base_url": url, "expand_model": BASE, "map_model": LORA, "system_prompts": "rewriter/",
              "server": LOCAL, "timeout": 30, "disable_thinking": True}
    inputs.update(kw)
    return {"class_type": "LingbotRewriterServer", "inputs": inputs}


def rewrite_node(**kw) -> dict:
    inputs = {"rewriter": ["1", 0], "prompt": "a red kite", "mode": "t2v", "duration": 1.0, "temperature": 0.0,
              "seed": 0, "fps": 24}
    inputs.update(kw)
    return {"class_type": "LingbotRewritePrompt", "inputs": inputs}


@comfy
def test_prose_example_workflow_writes_mp4s(server, chat):
    wf = load_workflow("lingbot_prose_ti2v_refine")
    object_info = server.object_info()
    check_ui_format(wf, object_info)
    api = workflow_to_api(wf, object_info)
    (sid,) = nodes_of(api, "LingbotRewriterServer")
    assert api[sid]["inputs"] == {"base_url": "http://127.0.0.1:8000/v1", "expand_model": BASE, "map_model": LORA,
                                  "system_prompts": "rewriter/", "server": LOCAL, "timeout": 600,
                                  "disable_thinking": True}
    (rid,) = nodes_of(api, "LingbotRewritePrompt")
    (lid,) = nodes_of(api, "LoadImage")
    (gid,) = nodes_of(api, "GenerateVideo")
    (fid,) = nodes_of(api, "Refine")
    assert api[rid]["inputs"]["mode"] == "ti2v" and api[rid]["inputs"]["image"] == [lid, 0]
    assert api[gid]["inputs"]["prompt"] == [rid, 0] == api[fid]["inputs"]["prompt"]

    patch_nodes(api, "LingbotRewriterServer", base_url=chat.url)
    patch_nodes(api, "LingbotRewritePrompt", duration=1.0)
    patch_nodes(api, "LoadLingbotPipeline", model=MOE)
    patch_nodes(api, "GenerateVideo", width=W, height=H, steps=1, fps=4)
    patch_nodes(api, "EncodeImageVAE", width=W, height=H)
    patch_nodes(api, "Refine", width=REF_W, height=REF_H, steps=3)
    for save in nodes_of(api, "SaveVideo"):
        api[save]["inputs"]["filename_prefix"] = f"test_prose_{save}"
    entry = server.run(api, timeout=600)

    bodies = chat.bodies()
    assert [b["model"] for b in bodies] == [BASE, LORA]
    for b in bodies:  # the first frame goes to the VLM in both steps, first in the message
        content = b["messages"][0]["content"]
        assert [p["type"] for p in content] == ["image_url", "text"]
        assert content[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert bodies[0]["messages"][0]["content"][1]["text"].endswith("\n\nVideo Duration: 1 seconds")
    for save in nodes_of(api, "SaveVideo"):
        (path,) = node_files(server, entry, save)
        frames, _ = decode_video(path)
        refined = api[api[api[save]["inputs"]["video"][0]]["inputs"]["images"][0]]["class_type"] == "Refine"
        assert path.suffix == ".mp4" and frames.shape == ((FRAMES, REF_H, REF_W, 3) if refined else (FRAMES, H, W, 3))

    # Re-queued after ComfyUI dropped its cache: the node runs again, the server is not asked again.
    reset_comfy_cache(server)
    chat.clear()
    graph = {"1": rewriter_node(chat.url), "2": rewrite_node(**api[rid]["inputs"] | {"rewriter": ["1", 0]}),
             "3": {"class_type": "LoadImage", "inputs": {"image": EXAMPLE_IMAGE}}, "4": preview("2")}
    graph["2"]["inputs"]["image"] = ["3", 0]
    entry = server.run(graph)
    assert "2" in executed_nodes(entry) and chat.requests == []
    assert json.loads(preview_text(entry, "4")) == {"caption": CAPTION, "duration": 1}


@comfy
def test_rewrite_outputs_and_errors(server, chat):
    graph = {"1": rewriter_node(chat.url), "2": rewrite_node(prompt="a kite at dusk", duration=4.4), "3": preview("2"),
             "4": preview("2", 1), "5": preview("2", 2)}
    entry = server.run(graph)
    assert json.loads(preview_text(entry, "3")) == {"caption": CAPTION, "duration": 4}
    assert preview_text(entry, "4") == "A red kite rises into the evening sky."
    assert preview_text(entry, "5") == "97"  # 4 s at 24 fps
    assert [b["model"] for b in chat.bodies()] == [BASE, LORA]

    def error_of(graph):
        entry = server.run(graph, check=False)
        err = execution_error(entry)
        assert err is not None and err["_event"] == "execution_error", entry["status"]
        return err["exception_message"]

    chat.replies[BASE] = "E" * 400
    chat.replies[LORA] = "no json here"
    msg = error_of({**graph, "2": rewrite_node(prompt="another kite")})
    assert re.search(r"not a JSON object.*'no json here'", msg), msg
    chat.replies[BASE] = Reply(status=500, raw=b"model crashed" + b"!" * 400)
    msg = error_of({**graph, "2": rewrite_node(prompt="a third kite")})
    assert "answered HTTP 500" in msg and "model crashed" + "!" * 287 in msg and "!" * 288 not in msg, msg


@comfy
def test_negative_node_is_the_default_until_edited(server, chat):
    keep = {"visual_quality": True, "artistic_style": True, "composition_and_content": True,
            "temporal_and_motion_stability": True, "material_and_structure": True}
    graph = {"1": {"class_type": "LingbotNegativePrompt", "inputs": {"mode": "video", "remove_terms": "", **keep}},
             "2": preview("1"),
             "3": {"class_type": "LingbotNegativePrompt",
                   "inputs": {"mode": "video", "remove_terms": "cartoon\ndrawing", **keep,
                              "temporal_and_motion_stability": False, "material_and_structure": False}},
             "4": preview("3")}
    entry = server.run(graph)
    assert hashlib.sha256(preview_text(entry, "2").encode("utf-8")).hexdigest() == VIDEO_SHA
    edited = json.loads(preview_text(entry, "4"))["universal_negative"]
    assert list(edited) == ["visual_quality", "artistic_style", "composition_and_content"]
    assert edited["artistic_style"] == ["painting", "illustration", "3d render", "cgi", "sketch", "digital art"]

    # auto: the base model drops the style category (allowed: the caption is a cartoon) and adds a term (dropped).
    chat.replies[BASE] = json.dumps({"universal_negative": {"artistic_style": [], "visual_quality": ["low quality", "ugly"]}})
    graph = {"1": rewriter_node(chat.url),
             "2": {"class_type": "PrimitiveStringMultiline", "inputs": {"value": "a cartoon fox jumps"}},
             "3": {"class_type": "LingbotNegativePrompt", "inputs": {
                 "mode": "video", "remove_terms": "", **keep, "auto": ["1", 0], "caption": ["2", 0]}},
             "4": preview("3")}
    entry = server.run(graph)
    auto = json.loads(preview_text(entry, "4"))["universal_negative"]
    assert list(auto) == ["visual_quality", "composition_and_content", "temporal_and_motion_stability",
                          "material_and_structure"] and auto["visual_quality"] == ["low quality"]
    (body,) = chat.bodies()
    assert body["model"] == BASE and "a cartoon fox jumps" in body["messages"][0]["content"][-1]["text"]


@comfy
def test_prompt_files_as_artists_save_them(server, chat):
    data = {"caption": CAPTION, "duration": 1}
    (server.input_dir / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(data).encode("utf-8"))
    (server.input_dir / "utf16.json").write_bytes(b"\xff\xfe" + json.dumps(data, indent=1).replace("\n", "\r\n").encode("utf-16-le"))
    (server.input_dir / "utf32.json").write_bytes(json.dumps(data).encode("utf-32"))
    (server.input_dir / "nodur.json").write_text(json.dumps({"caption": CAPTION, "duration": None}), encoding="utf-8")
    (server.input_dir / "booldur.json").write_text(json.dumps({"caption": CAPTION, "duration": True}), encoding="utf-8")

    def load(name):
        return {"class_type": "LoadLingbotPrompt", "inputs": {"prompt_file": name, "fps": 24}}

    for name in ("bom.json", "utf16.json"):  # Notepad's UTF-8 and "Unicode" (UTF-16 LE, CRLF)
        entry = server.run({"1": load(name), "2": preview("1"), "3": preview("1", 1)})
        assert json.loads(preview_text(entry, "2")) == data and preview_text(entry, "3") == "25", name
    for name, pattern in (("utf32.json", "utf32.json is saved as UTF-32 LE, which is not read; save it as UTF-8"),
                          ("booldur.json", r"duration must be a number of seconds \(or null\), got true")):
        entry = server.run({"1": load(name), "2": preview("1")}, check=False)
        assert re.search(pattern, execution_error(entry)["exception_message"]), name
    # num_frames 0 from a file without a duration, wired to GenerateVideo: the message names the cause.
    graph = {"1": load("nodur.json"),
             "2": {"class_type": "LoadLingbotPipeline", "inputs": {
                 "model": "lingbot-tiny-dense", "transformer": "transformer", "offload": "model",
                 "dit_precision": "auto", "text_encoder_precision": "auto", "vae_precision": "fp32"}},
             "3": {"class_type": "GenerateVideo", "inputs": {
                 "pipe": ["2", 0], "prompt": ["1", 0], "negative_prompt": "", "width": W, "height": H,
                 "num_frames": ["1", 1], "steps": 1, "guidance_scale": 3.0, "shift": 3.0, "seed": 0}},
             "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "nodur"}}}
    entry = server.run(graph, check=False)
    err = execution_error(entry)
    assert err["node_type"] == "GenerateVideo"
    assert "num_frames is 0 and the prompt has no duration" in err["exception_message"], err["exception_message"]


@comfy
def test_whitespace_negative_is_the_default(server):
    """A negative box holding only spaces/newlines encodes the default negative, like an empty box."""
    from support.comfy_graphs import saved_frames, t2v_graph

    results = []
    for i, negative in enumerate(("", " \n\t ")):
        graph = t2v_graph("lingbot-tiny-dense", f"ws_negative_{i}", steps=1, num_frames=1,
                          negative_prompt=negative)
        entry = server.run(graph)
        results.append(saved_frames(server, entry, "3"))
    assert results[0].shape == (1, H, W, 3)
    assert (results[0] == results[1]).all()


@comfy
def test_image_negative_ignores_the_video_only_toggle(server):
    """A negative node switched from video to image keeps the temporal toggle it had off for video: image mode
    has no such category and gives the image default, byte for byte."""
    keep = {"visual_quality": True, "artistic_style": True, "composition_and_content": True,
            "temporal_and_motion_stability": False, "material_and_structure": True}
    graph = {"1": {"class_type": "LingbotNegativePrompt", "inputs": {"mode": "image", "remove_terms": "", **keep}},
             "2": preview("1")}
    entry = server.run(graph, check=False)
    assert execution_error(entry) is None, execution_error(entry)["exception_message"]
    image_sha = "7e277788a8bb3d2fb0a2a4109316c544345fefff1c22868861c90741b0c47e7b"  # lingbot-video-model.md §6.7
    assert hashlib.sha256(preview_text(entry, "2").encode("utf-8")).hexdigest() == image_sha


@comfy
def test_prompt_schedule_rewrites_each_prose_part_for_its_length(server, chat):
    caption = json.dumps({"comprehensive_description": {"scene_content_description": "A boat drifts."}})
    graph = {"1": rewriter_node(chat.url),
             "2": {"class_type": "LingbotPromptSchedule",
                   "inputs": {"parts": f"a red kite\n---\n{caption}\n---\na kite lands", "start_frames": "0, 24, 72",
                              "negative_prompt": "", "rewriter": ["1", 0], "num_frames": 121, "fps": 24, "seed": 0}},
             "3": preview("2")}
    out = json.loads(preview_text(server.run(graph), "3"))
    assert out["starts"] == [0, 24, 72] and out["negatives"] is None
    assert [json.loads(p) for p in out["prompts"]] == [{"caption": CAPTION, "duration": 1}, json.loads(caption),
                                                        {"caption": CAPTION, "duration": 2}]
    bodies = chat.bodies()  # two steps per prose part; the JSON part is kept as written
    assert [b["model"] for b in bodies] == [BASE, LORA, BASE, LORA]
    durations = [re.search(r"Video Duration: (\d+) seconds", b["messages"][0]["content"][-1]["text"]).group(1)
                 for b in bodies[::2]]
    assert durations == ["1", "2"]  # frames 0-23 (1 s) and 72-120 (49 frames, 2 s at 24 fps)
