"""How big the ComfyUI frontend draws each node of a workflow, estimated without a browser.

Parent side (pytest): :func:`node_schemas` starts this file as a child Python process (importing ComfyUI
sets process-wide state, see ``comfy_inprocess``) that loads the pack into ComfyUI's own node registry
and writes, for each requested class, its input slots and widgets as the frontend builds them from
``INPUT_TYPES``. :func:`node_box` and :func:`note_overflow` then estimate what the frontend draws.

Calibration (frontends 1.32.9 and 1.58.1, classic and Nodes 2.0, on ComfyUI 0.3.75, headless Chromium,
measured with ``scripts/screenshot_workflow.py --layout``): see ``RENDERERS`` and ``CALIBRATION`` below.
The figures are per widget kind, not per node, so new nodes are checked without new measurements.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: Widget kinds, as the frontend builds them from ``INPUT_TYPES`` (see :func:`widget_kinds`): "row" (number,
#: combo, toggle), "text" (one-line STRING), "multiline", "seed_control" (the "control after generate" the
#: frontend adds below a seed), "file" (a combo of input files with an upload), "upload" (its button),
#: "image_preview" / "video_preview" (what Load Image / Load Video show under it).
#:
#: Each renderer's figures, measured with ``scripts/screenshot_workflow.py --layout`` in headless Chromium
#: on ComfyUI 0.3.75 (``computeSize()`` of drawn nodes, the DOM boxes of Nodes 2.0's nodes and widgets):
#: - classic (canvas; frontend 1.32.9 and 1.58.1 without Nodes 2.0): the title bar is 30 px above ``pos``;
#:   slot rows are 20 px (inputs without a widget and outputs share rows, at least 1 row); the first
#:   widget starts 6 px below them; each kind takes ``height`` px (one-line widgets 24: 20 + 4 spacing);
#:   8 px below the last widget. A linked widget keeps its row (its input dot sits on it).
#:   A multiline text box is its widget's height minus 20 px (margins).
#: - nodes2 (frontend 1.58.1, setting ``Comfy.VueNodes.Enabled``: every node a DOM element): the same
#:   30 px title; slot rows 20 px, none for a node without slots; the first widget 6 px below; kinds
#:   take ``height`` px including the 4 px gap to the next; 12 px below the last widget (14 below the
#:   slot rows without widgets) plus 24 px for the pack's source badge on a custom node; a linked widget becomes a slot
#:   row. A multiline text box is its widget's height minus 4 px (the gap).
#: Both: a node stored taller than that is drawn at the stored height (the frontend never shrinks a
#: node), and the extra height goes to the multiline boxes, shared equally. Widths are taken as stored
#: (the frontend widens a node only to its computed width, 210-330 px here, all stored wider).
#: Text boxes: "10px monospace", 6.02 px a character (DejaVu Sans Mono in Chromium on Debian), a line
#: is ``line`` px tall (classic: normal line height, 12 px; Nodes 2.0: 15 px).
RENDERERS = {
    "classic": {
        "title": 30, "slot": 20, "min_slot_rows": 1, "widget_gap": 6, "bottom": 8, "bottom_bare": 8, "badge": 0,
        "linked_widget_is_slot": False, "text_margin": 20, "line": 12,
        "height": {"row": 24, "text": 24, "multiline": 54, "seed_control": 24, "file": 24, "upload": 24,
                   "image_preview": 224, "video_preview": 224},
    },
    "nodes2": {
        "title": 30, "slot": 20, "min_slot_rows": 0, "widget_gap": 6, "bottom": 12, "bottom_bare": 14, "badge": 24,
        "linked_widget_is_slot": True, "text_margin": 4, "line": 15,
        "height": {"row": 28, "text": 36, "multiline": 68, "seed_control": 0, "file": 36, "upload": 0,
                   "image_preview": 232, "video_preview": 232},
    },
}
CLASSIC = RENDERERS["classic"]

#: Notes (classic 1.32.9): the text area is the node's width minus 20 px, with 2 px padding each side,
#: and a vertical scroll bar (15 px) when the text is taller than the box.
FRONTEND = {"title": 30, "note_margin": 20, "note_padding": 4, "note_char": 6.02, "note_scrollbar": 15, "note_line": 12}

#: What each renderer drew for nodes of lingbot_ti2v_refine.json / lingbot_ti2v.json / a probe graph
#: (height below ``pos``, title excluded; classic: ``computeSize()[1]``, Nodes 2.0: the node element's
#: bottom): (renderer, node, slot rows, widget kinds, custom node, measured). The estimate must
#: reproduce them exactly.
CALIBRATION = [
    ("classic", "LoadLingbotPipeline", 1, ["row"] * 9, True, 250),
    ("classic", "GenerateVideo", 2, ["multiline"] * 2 + ["row"] * 6 + ["seed_control"] + ["row"] * 6, True, 474),
    # frontend 1.58.1's classic renderer, today's GenerateVideo (video, video_latent slots; sigmas, denoise,
    # context_frames, context_overlap, vae_tiling rows): the same figures as 1.32.9
    ("classic", "GenerateVideo", 4, ["multiline"] * 2 + ["row"] * 7 + ["seed_control"] + ["row"] * 4 + ["text"]
     + ["row"] * 4, True, 610),
    ("classic", "Refine", 3, ["multiline"] * 2 + ["row"] * 12, True, 470),
    ("classic", "LoadImage", 2, ["file", "upload", "image_preview"], False, 326),
    ("classic", "EncodeImageVAE", 2, ["row"] * 2, True, 102),
    ("classic", "CreateVideo", 2, ["row"], False, 78),
    ("classic", "SaveVideo", 1, ["text", "row", "row"], False, 106),
    ("classic", "PrimitiveStringMultiline", 1, ["multiline"], False, 88),
    ("nodes2", "LoadLingbotPipeline", 1, ["row"] * 9, True, 310),
    ("nodes2", "GenerateVideo", 4, ["multiline"] * 2 + ["row"] * 7 + ["seed_control"] + ["row"] * 4 + ["text"]
     + ["row"] * 4, True, 710),
    ("nodes2", "LoadImage", 2, ["file", "upload", "image_preview"], False, 322),
    ("nodes2", "LoadVideo", 1, ["file", "upload", "video_preview"], False, 302),
    ("nodes2", "EncodeImageVAE", 2, ["row"] * 2, True, 134),
    ("nodes2", "CreateVideo", 2, ["row"], False, 82),
    ("nodes2", "LoadLingbotLoRA", 1, ["row"] * 2, True, 114),
    ("nodes2", "GetVideoComponents", 3, [], False, 66 + 8),
]

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def widget_kinds(input_types: dict) -> tuple[int, list[tuple[str, str]]]:
    """(input slots without a widget, [(widget name, kind)]) the frontend builds from ``INPUT_TYPES``."""
    slots, kinds = 0, []
    for section in ("required", "optional"):
        for name, spec in (input_types.get(section) or {}).items():
            kind, opts = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
            if opts.get("forceInput") or not (isinstance(kind, list) or kind in WIDGET_TYPES):
                slots += 1
                continue
            if kind == "STRING":
                kinds.append((name, "multiline" if opts.get("multiline") else "text"))
                continue
            upload = opts.get("image_upload") or opts.get("video_upload") or opts.get("upload")
            if upload:
                preview = "video_preview" if (opts.get("video_upload") or "video" in str(upload)) else "image_preview"
                kinds += [(name, "file"), (name, "upload"), (name, preview)]
                continue
            kinds.append((name, "row"))
            if kind == "INT" and (name in ("seed", "noise_seed") or opts.get("control_after_generate")):
                kinds.append((name, "seed_control"))
    return slots, kinds


def content_height(renderer: str, slot_rows: int, kinds: list[str], custom: bool) -> int:
    """What the renderer draws below ``pos`` (title excluded) for these slot rows and widget kinds."""
    f = RENDERERS[renderer]
    rows = max(slot_rows, f["min_slot_rows"]) * f["slot"]
    widgets = sum(f["height"][k] for k in kinds)
    if renderer == "classic":
        return rows + f["widget_gap"] + widgets + f["bottom"]
    if not any(f["height"][k] for k in kinds):
        return rows + f["bottom_bare"] + (f["badge"] if custom else 0)
    return rows + f["widget_gap"] + widgets - 4 + f["bottom"] + (f["badge"] if custom else 0)


def _layout(node: dict, schema: dict | None, renderer: str):
    """(slot rows, [(widget name, kind)]) of a workflow node in a renderer: a Note is one text box; a
    linked widget is a slot row in Nodes 2.0."""
    f = RENDERERS[renderer]
    if schema is None:  # frontend-only nodes (Note): one text area filling the node
        return 0, [("text", "multiline")]
    linked = {i["widget"]["name"] for i in node.get("inputs") or [] if i.get("widget") and i.get("link") is not None}
    widgets = [(name, k) for name, k in schema["kinds"] if not (f["linked_widget_is_slot"] and name in linked)]
    slot_inputs = schema["slots"] + (len(linked) if f["linked_widget_is_slot"] else 0)
    return max(slot_inputs, schema["outputs"]), widgets


def _size(node: dict) -> tuple[float, float]:
    return tuple(node["size"][:2]) if isinstance(node["size"], list) else (node["size"]["0"], node["size"]["1"])


def node_box(node: dict, schema: dict | None, renderer: str = "classic") -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of a workflow node as drawn, title bar included."""
    x, y = node["pos"][:2] if isinstance(node["pos"], list) else (node["pos"]["0"], node["pos"]["1"])
    w, h = _size(node)
    rows, widgets = _layout(node, schema, renderer)
    need = content_height(renderer, rows, [k for _, k in widgets], bool(schema and schema.get("custom")))
    return (x, y - RENDERERS[renderer]["title"], x + w, y + max(h, need))


def text_box_lines(node: dict, schema: dict | None, widget: str, renderer: str) -> float | None:
    """Lines of text the multiline widget ``widget`` shows without scrolling (None: not drawn as a box,
    e.g. linked in Nodes 2.0). A node's height beyond its content is shared by its multiline boxes."""
    f = RENDERERS[renderer]
    rows, widgets = _layout(node, schema, renderer)
    kinds = [k for _, k in widgets]
    if (widget, "multiline") not in widgets:
        return None
    extra = max(0.0, _size(node)[1] - content_height(renderer, rows, kinds, bool(schema and schema.get("custom"))))
    return (f["height"]["multiline"] + extra / kinds.count("multiline") - f["text_margin"]) / f["line"]


def overlap(a, b) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


#: Nodes 2.0's Note text box: 12 px margins each side, 8 px padding each side and a scroll-bar gutter
#: (15 px) kept even without a scroll bar: 60 px of the node's width hold no text. Estimated from the
#: 1.58.1 screenshot of lingbot_v2v_restyle.json (540 px wide): 81- and 82-character lines wrapped,
#: 79-character lines did not.
NODES2_NOTE_MARGIN = 60


def note_columns(node: dict, renderer: str = "classic") -> int:
    """Characters that fit on one line of a Note's text area without wrapping."""
    f = FRONTEND
    text = node["widgets_values"][0]
    w, h = node["size"][:2]
    if renderer == "nodes2":
        return math.floor((w - NODES2_NOTE_MARGIN) / f["note_char"])
    inner = w - f["note_margin"] - f["note_padding"]
    if len(text.splitlines()) * f["note_line"] > h - 8:
        inner -= f["note_scrollbar"]
    return math.floor(inner / f["note_char"])


# --------------------------------------------------------------------------------------------
# Node schemas from ComfyUI's registry (child process)
# --------------------------------------------------------------------------------------------

def node_schemas(class_types, workflows=(), timeout: float = 300) -> dict:
    """{class: {"slots", "outputs", "kinds"}} for classes registered in ComfyUI with the pack loaded, and
    under ``"__inputs__"`` what :func:`_input_runs` saw of ``workflows``' input files."""
    with tempfile.TemporaryDirectory(prefix="lingbot-geometry-") as tmp:
        out = Path(tmp) / "schemas.json"
        cmd = [sys.executable, __file__, str(out), str(Path(tmp) / "base"), ",".join(map(str, workflows)),
               *sorted(set(class_types))]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"schema child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


#: ComfyUI's file-loading nodes of the examples: (widget holding the file name, graph that runs it).
INPUT_NODES = {
    "LoadImage": lambda name: {"1": {"class_type": "LoadImage", "inputs": {"image": name}},
                               "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}},
    "LoadVideo": lambda name: {"1": {"class_type": "LoadVideo", "inputs": {"file": name}},
                               "2": {"class_type": "GetVideoComponents", "inputs": {"video": ["1", 0]}},
                               "3": {"class_type": "PreviewImage", "inputs": {"images": ["2", 0]}}},
}


def _input_runs(comfy, workflows) -> dict:
    """Each example's Load Image / Load Video, as stored, run by ComfyUI: offered in the node's file list,
    validated (its ``VALIDATE_INPUTS`` resolves the name in the input folder) and executed."""
    runs = {}
    for path in workflows:
        for node in json.loads(Path(path).read_text(encoding="utf-8"))["nodes"]:
            if node["type"] not in INPUT_NODES:
                continue
            name = node["widgets_values"][0]
            spec = comfy.node_class(node["type"]).INPUT_TYPES()["required"]
            kind, *opts = next(iter(spec.values()))
            options = kind if isinstance(kind, list) else (opts[0] if opts else {}).get("options", [])  # V3: ("COMBO", {options})
            result = comfy.run(INPUT_NODES[node["type"]](name))
            images = [i for out in result["outputs"].values() for i in out.get("images", [])]
            runs[f"{Path(path).stem} {node['id']} {node['type']}"] = {
                "file": name, "offered": name in options, "status": result["status"], "images": len(images),
                "problem": result["validation"] or result["error"]}
    return runs


def _child(out: str, base: str, workflows: str, class_types: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the support package
    from support.comfy_inprocess import InProcessComfy

    comfy = InProcessComfy(base)  # a fresh base directory: input/ is empty until the pack loads
    schemas = {}
    for class_type in class_types:
        cls = comfy.nodes.NODE_CLASS_MAPPINGS.get(class_type)
        if cls is None:
            continue  # frontend-only (Note) or missing: the caller decides
        slots, kinds = widget_kinds(cls.INPUT_TYPES())
        custom = str(getattr(cls, "RELATIVE_PYTHON_MODULE", "")).startswith("custom_nodes")
        schemas[class_type] = {"slots": slots, "outputs": len(cls.RETURN_TYPES), "kinds": kinds, "custom": custom}
    schemas["__inputs__"] = _input_runs(comfy, [w for w in workflows.split(",") if w])
    Path(out).write_text(json.dumps(schemas))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
