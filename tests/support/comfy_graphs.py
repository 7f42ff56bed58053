"""API-prompt graphs of the pack's nodes at the tiny sizes, example workflows as the browser queues them, and readers of
what a run saved (frames, videos): the vocabulary of the tests that drive a real ComfyUI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
from PIL import Image

from support.comfy_host import _ordered_inputs, workflow_to_api


REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "example_workflows"
EXAMPLE_IMAGE = "lingbot_example_input.png"
DENSE, MOE = "lingbot-tiny-dense", "lingbot-tiny-moe"


# Tiny sizes (height x width); the refiner needs >= 5 frames.
H, W, FRAMES, STEPS = 64, 96, 5, 3
REF_H, REF_W, REF_STEPS = 64, 128, 3
SHORT_CAPTION = json.dumps({
    "comprehensive_description": {
        "scene_content_description": "A red kite flutters above green hills at sunset.",
        "camera_movement_description": "Static wide shot.",
    },
    "camera_info": {"frame_size": "wide shot", "lighting": "golden hour"},
})
_unique = itertools.count(1)


def alias_package(server, packages, which: str, name: str) -> str:
    """Link a fixture package under another name: a fresh loader key, so a fresh pipeline."""
    server.add_model(name, packages[which])
    return name


def reset_comfy_cache(server) -> None:
    """``POST /free`` and make sure ComfyUI applied it before the next prompt.

    ComfyUI's worker reads the /free flags only after its queue wait returns; when the request
    arrives while the worker is still busy after the previous prompt (gc.collect on a loaded
    machine), the wake-up is lost and the *next* prompt still runs with the old cache. A throwaway
    prompt makes the worker go through its flag check: the reset is applied, at the latest, right
    after it and before any later prompt is taken from the queue.
    """
    server.free(settle=0)
    server.run({"1": {"class_type": "PrimitiveInt", "inputs": {"value": next(_unique)}},
                "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})


def patch_nodes(api: dict, class_type: str, **values) -> list[str]:
    """Set widget values on every node of ``class_type`` in an API prompt; returns their ids.

    Only inputs the node already has as constants may be set (catches typos and linked inputs).
    """
    ids = [nid for nid, node in api.items() if node["class_type"] == class_type]
    assert ids, f"no {class_type} node in the prompt"
    for nid in ids:
        inputs = api[nid]["inputs"]
        for name, value in values.items():
            assert name in inputs, f"{class_type} {nid} has no input {name!r}"
            assert not isinstance(inputs[name], list), f"{class_type} {nid}.{name} is linked"
            inputs[name] = value
    return ids


def nodes_of(api: dict, class_type: str) -> list[str]:
    return [nid for nid, node in api.items() if node["class_type"] == class_type]


def load_workflow(name: str) -> dict:
    return json.loads((EXAMPLES / f"{name}.json").read_text(encoding="utf-8"))


def decode_video(path: Path):
    """(frames (T, H, W, 3) uint8, average frame rate) through PyAV."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        rate = stream.average_rate
    return np.stack(frames), rate


def node_files(server, entry: dict, node_id: str) -> list[Path]:
    items = (entry.get("outputs") or {}).get(str(node_id), {})
    return server.output_files({"outputs": {str(node_id): items}})


def saved_frames(server, entry: dict, node_id: str) -> np.ndarray:
    """The frames a core SaveImage node wrote in this run, (T, H, W, 3) uint8."""
    files = node_files(server, entry, node_id)
    assert files, f"SaveImage {node_id} wrote nothing: {entry.get('outputs')}"
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in files])


def loader(model: str, transformer: str = "transformer", offload: str = "model", **kw) -> dict:
    inputs = {"model": model, "transformer": transformer, "offload": offload, "dit_precision": "auto",
              "text_encoder_precision": "auto", "vae_precision": "fp32"}
    inputs.update(kw)
    return {"class_type": "LoadLingbotPipeline", "inputs": inputs}


def generate(pipe: str, seed: int = 42, steps: int = STEPS, cond: str | None = None,
             prompt=SHORT_CAPTION, num_frames: int = FRAMES, **kw) -> dict:
    inputs = {"pipe": [pipe, 0], "prompt": prompt, "negative_prompt": "", "width": W, "height": H,
              "num_frames": num_frames, "steps": steps, "guidance_scale": 3.0, "shift": 3.0, "seed": seed}
    if cond is not None:
        inputs["image_condition"] = [cond, 0]
    inputs.update(kw)
    return {"class_type": "GenerateVideo", "inputs": inputs}


def save_image(src: str, prefix: str, slot: int = 0) -> dict:
    return {"class_type": "SaveImage", "inputs": {"images": [src, slot], "filename_prefix": prefix}}


def t2v_graph(model: str, prefix: str, **gen) -> dict:
    return {"1": loader(model), "2": generate("1", **gen), "3": save_image("2", prefix)}


def ti2v_graph(model: str, prefix: str, **gen) -> dict:
    return {
        "1": loader(model),
        "5": {"class_type": "LoadImage", "inputs": {"image": EXAMPLE_IMAGE}},
        "2": {"class_type": "EncodeImageVAE", "inputs": {"pipe": ["1", 0], "image": ["5", 0], "width": W, "height": H}},
        "3": generate("1", cond="2", **gen),
        "6": save_image("3", prefix),
    }


def widget_inputs(info: dict) -> dict:
    out = {}
    for section in ("required", "optional"):
        out.update(info["input"].get(section) or {})
    return out


def _widget_count(spec_list, info) -> int:
    """How many widgets_values the frontend stores for a node (seed control and upload extras)."""
    n = 0
    for name, spec in spec_list:
        typ = spec[0]
        opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
        if opts.get("forceInput") or not (isinstance(typ, list) or typ in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")):
            continue
        n += 1
        if typ == "INT" and (name in ("seed", "noise_seed") or opts.get("control_after_generate")):
            n += 1
        if opts.get("image_upload"):
            n += 1
    return n


def check_ui_format(wf: dict, object_info: dict) -> None:
    """The frontend's saved-workflow format (0.4), internally consistent and matching /object_info."""
    for key in ("last_node_id", "last_link_id", "nodes", "links", "groups", "config", "extra", "version"):
        assert key in wf, key
    assert wf["version"] == 0.4
    nodes = {n["id"]: n for n in wf["nodes"]}
    assert len(nodes) == len(wf["nodes"]) and wf["last_node_id"] == max(nodes)
    assert wf["last_link_id"] == max(link[0] for link in wf["links"])
    for n in wf["nodes"]:
        for key in ("id", "type", "pos", "size", "flags", "order", "mode", "inputs", "outputs", "properties", "widgets_values"):
            assert key in n, (n["id"], key)
        assert n["mode"] == 0
        if n["type"] == "Note":
            continue
        assert n["properties"]["Node name for S&R"] == n["type"]
        info = object_info[n["type"]]
        assert [o["type"] for o in n["outputs"]] == list(info["output"]), n["type"]
        # A workflow saved before an optional input existed has no value for it (the frontend gives it the
        # default): any prefix of the optional widgets is accepted, nothing less than the required ones.
        ordered = _ordered_inputs(info)
        required = len(info["input"].get("required") or {})
        allowed = {_widget_count(ordered[:k], info) for k in range(required, len(ordered) + 1)}
        assert len(n["widgets_values"]) in allowed, n["type"]
        specs = widget_inputs(info)
        for inp in n["inputs"]:
            name = (inp.get("widget") or {}).get("name") or inp["name"]
            assert name in specs, (n["type"], name)
    orders = sorted(n["order"] for n in wf["nodes"])
    assert orders == list(range(len(orders)))
    for lid, src, sslot, dst, dslot, typ in wf["links"]:
        assert lid in (nodes[src]["outputs"][sslot]["links"] or []), lid
        assert nodes[dst]["inputs"][dslot]["link"] == lid, lid
        assert nodes[src]["outputs"][sslot]["type"] == typ == nodes[dst]["inputs"][dslot]["type"], lid
        assert nodes[src]["order"] < nodes[dst]["order"], lid
    linked = {inp["link"] for n in wf["nodes"] for inp in n["inputs"] if inp.get("link") is not None}
    assert linked == {link[0] for link in wf["links"]}


def example_as_api(name: str, object_info: dict):
    """``(workflow, API prompt)`` of an example workflow, as the browser would queue it, after checking that
    every node type it uses is registered in the host and that the file is in the UI format."""
    wf = load_workflow(name)
    assert {n["type"] for n in wf["nodes"]} - {"Note"} <= set(object_info)  # no missing node
    check_ui_format(wf, object_info)
    return wf, workflow_to_api(wf, object_info)


def check_caption(text: str, duration: float) -> None:
    """§6.5 schema of a video caption; action timestamps inside the video's duration."""
    cap = json.loads(text)
    assert set(cap) >= {"comprehensive_description", "camera_info", "world_knowledge", "prominent_elements"}
    assert set(cap["comprehensive_description"]) == {"scene_content_description", "camera_movement_description"}
    assert set(cap["camera_info"]) == {"color", "frame_size", "shot_type_angle", "lens_size", "composition",
                                       "lighting", "lighting_type"}
    assert isinstance(cap["world_knowledge"], list)
    element_keys = {"name", "description", "location", "relative_size", "shape_and_color", "texture",
                    "appearance_details", "relationship", "orientation", "pose", "expression", "clothing",
                    "gender", "skin_tone_and_texture"}
    for el in cap["prominent_elements"]:
        assert element_keys <= set(el) <= element_keys | {"actions", "is_cluster", "number_of_objects"}, el["name"]
        for act in el.get("actions", []):
            start, end = (float(x.strip().rstrip("s")) for x in act["timestamp"].strip("[]").split("-"))
            assert 0 <= start < end <= duration + 1e-6, act
TINY_LORA = "lingbot_tiny_4steps.safetensors"


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
