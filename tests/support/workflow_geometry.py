"""How big the ComfyUI frontend draws each node of a workflow, estimated without a browser.

Parent side (pytest): :func:`node_schemas` starts this file as a child Python process (importing ComfyUI
sets process-wide state, see ``comfy_inprocess``) that loads the pack into ComfyUI's own node registry
and writes, for each requested class, its input slots and widgets as the frontend builds them from
``INPUT_TYPES``. :func:`node_box` and :func:`note_overflow` then estimate what the frontend draws.

Calibration (frontend 1.32.9 on ComfyUI 0.3.75, headless Chromium 156, measured with
``scripts/screenshot_workflow.py --layout``): see ``FRONTEND`` and ``CALIBRATION`` below.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: Measured in the frontend (``LiteGraph`` constants and ``computeSize()`` of drawn nodes):
#: - the title bar is 30 px and sits above ``pos`` (a node's box starts at pos.y - 30);
#: - slot rows are 20 px; inputs without a widget and outputs share rows (max of the two counts);
#: - the first widget starts 6 px below the last slot row (a node without slots: 1 row);
#: - a one-line widget (number, combo, toggle, text, button) takes 24 px (20 + 4 spacing);
#: - a multiline text widget takes at least 54 px; LoadImage's preview at least 224 px;
#: - 8 px below the last widget;
#: - a node stored smaller than that is drawn at that size; a larger stored size is kept.
#: Notes: the text area is the node's width minus 20 px, with 2 px padding each side, in
#: "10px monospace" (6.02 px per character in Chromium on Debian, DejaVu Sans Mono), and a
#: vertical scroll bar (15 px) when the text is taller than the box (lines of about 12 px).
#: Widths are taken as stored: the frontend widens a node only to its computed width (210-262 px for
#: the calibration workflow's nodes, all stored wider), which needs text measurement to estimate.
FRONTEND = {
    "title": 30, "slot": 20, "widget_gap": 6, "row": 24, "multiline": 54, "image_preview": 224, "bottom": 8,
    "note_margin": 20, "note_padding": 4, "note_char": 6.02, "note_scrollbar": 15, "note_line": 12,
}

#: What the frontend computed (``node.computeSize()[1]``) for the nodes of lingbot_ti2v_refine.json,
#: with their slot rows and widget kinds: the estimate must reproduce these heights exactly.
CALIBRATION = [
    # (node, slot rows, widget kinds, computed height)
    ("LoadLingbotPipeline", 1, ["row"] * 9, 250),
    ("GenerateVideo", 2, ["multiline"] * 2 + ["row"] * 13, 474),
    ("Refine", 3, ["multiline"] * 2 + ["row"] * 12, 470),
    ("LoadImage", 2, ["row", "row", "image_preview"], 326),
    ("EncodeImageVAE", 2, ["row"] * 2, 102),
    ("CreateVideo", 2, ["row"], 78),
    ("SaveVideo", 1, ["row"] * 3, 106),
    ("PrimitiveStringMultiline", 1, ["multiline"], 88),
]

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def widget_kinds(input_types: dict) -> tuple[int, list[str]]:
    """(input slots without a widget, widget kinds) the frontend builds from an ``INPUT_TYPES`` dict."""
    slots, kinds = 0, []
    for section in ("required", "optional"):
        for name, spec in (input_types.get(section) or {}).items():
            kind, opts = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
            if opts.get("forceInput") or not (isinstance(kind, list) or kind in WIDGET_TYPES):
                slots += 1
                continue
            if kind == "STRING" and opts.get("multiline"):
                kinds.append("multiline")
                continue
            kinds.append("row")
            if kind == "INT" and (name in ("seed", "noise_seed") or opts.get("control_after_generate")):
                kinds.append("row")  # the frontend adds "control after generate" below a seed
            if opts.get("image_upload"):
                kinds += ["row", "image_preview"]  # the upload button and the image preview
    return slots, kinds


def computed_height(slot_rows: int, kinds: list[str]) -> int:
    f = FRONTEND
    return max(slot_rows, 1) * f["slot"] + f["widget_gap"] + sum(f[k] for k in kinds) + f["bottom"]


def node_box(node: dict, schema: dict | None) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) of a workflow node as drawn, title bar included."""
    x, y = node["pos"][:2] if isinstance(node["pos"], list) else (node["pos"]["0"], node["pos"]["1"])
    w, h = node["size"][:2] if isinstance(node["size"], list) else (node["size"]["0"], node["size"]["1"])
    if schema is None:  # frontend-only nodes (Note): one text area filling the node
        need = computed_height(1, ["multiline"])
    else:
        need = computed_height(max(schema["slots"], schema["outputs"]), schema["kinds"])
    return (x, y - FRONTEND["title"], x + w, y + max(h, need))


def overlap(a, b) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def note_columns(node: dict) -> int:
    """Characters that fit on one line of a Note's text area without wrapping."""
    f = FRONTEND
    text = node["widgets_values"][0]
    w, h = node["size"][:2]
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
        schemas[class_type] = {"slots": slots, "outputs": len(cls.RETURN_TYPES), "kinds": kinds}
    schemas["__inputs__"] = _input_runs(comfy, [w for w in workflows.split(",") if w])
    Path(out).write_text(json.dumps(schemas))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
