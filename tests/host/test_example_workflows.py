"""Every example workflow stays readable when opened: no node drawn over another, no Note line wider
than its box (see workflow_geometry.py for the frontend measurements the estimate is calibrated on)."""

import json
import re
from itertools import combinations
from pathlib import Path

import pytest

from support.workflow_geometry import (
    CALIBRATION, FRONTEND, computed_height, node_box, node_schemas, note_columns, overlap,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "example_workflows"
WORKFLOWS = sorted(EXAMPLES.glob("*.json"))
FRONTEND_ONLY = {"Note", "MarkdownNote"}  # drawn by the frontend alone: no class in ComfyUI's registry


def load(path):
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def schemas():
    from support.comfy_host import comfyui_unavailable_reason

    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    types = {n["type"] for p in WORKFLOWS for n in load(p)["nodes"]} - FRONTEND_ONLY
    found = node_schemas(types, WORKFLOWS)
    inputs = found.pop("__inputs__")
    found["__inputs__"] = inputs
    assert set(found) - {"__inputs__"} == types, f"not registered in ComfyUI: {sorted(types - set(found))}"
    return found


def test_every_examples_input_files_load_in_comfyui_on_a_fresh_install(schemas):
    # The schema child's ComfyUI started on an empty input/ folder: the pack placed the files there,
    # and each example's Load Image / Load Video offers, validates and loads its file as stored.
    runs = schemas["__inputs__"]
    users = {p.stem for p in WORKFLOWS if any(n["type"] in ("LoadImage", "LoadVideo") for n in load(p)["nodes"])}
    assert {key.split()[0] for key in runs} == users and len(users) >= 6
    bad = {key: run for key, run in runs.items() if not (run["offered"] and run["status"] == "success")}
    assert not bad, bad
    for key, run in runs.items():  # the image once; the video's 17 frames, 4n+1 as the model takes them
        assert run["images"] == (1 if key.endswith("LoadImage") else 17), (key, run)


@pytest.mark.parametrize("node, rows, kinds, height", CALIBRATION, ids=[c[0] for c in CALIBRATION])
def test_the_height_estimate_reproduces_the_frontends_own(node, rows, kinds, height):
    assert computed_height(rows, kinds) == height


def test_the_estimate_counts_the_loaders_widgets_as_the_frontend_drew_them(schemas):
    # The calibration screenshot's loader: 1 slot row (speed_options / pipe), 9 one-line widgets.
    loader = schemas["LoadLingbotPipeline"]
    assert (max(loader["slots"], loader["outputs"]), loader["kinds"]) == (1, ["row"] * 9)
    generate = schemas["GenerateVideo"]
    # since the screenshot: video, video_latent (slots), denoise, context_frames, context_overlap, vae_tiling (rows)
    assert (max(generate["slots"], generate["outputs"]), generate["kinds"]) == (4, ["multiline"] * 2 + ["row"] * 17)


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_no_node_is_drawn_over_another(path, schemas):
    nodes = load(path)["nodes"]
    boxes = {f"{n['id']} {n['type']}": node_box(n, schemas.get(n["type"])) for n in nodes}
    covered = [(a, b, overlap(boxes[a], boxes[b])) for a, b in combinations(boxes, 2) if overlap(boxes[a], boxes[b])]
    assert not covered, "\n".join(
        f"{a} {tuple(round(v) for v in boxes[a])} overlaps {b} {tuple(round(v) for v in boxes[b])} ({area:.0f} px²)"
        for a, b, area in covered)


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_every_note_line_fits_its_box(path):
    notes = [n for n in load(path)["nodes"] if n["type"] in FRONTEND_ONLY]
    assert notes, "every example explains itself in a Note"
    for note in notes:
        columns = note_columns(note)
        long = [line for line in note["widgets_values"][0].splitlines() if len(line) > columns]
        assert not long, (f"Note {note['id']} is {note['size'][0]} px wide ({columns} characters of "
                          f"{FRONTEND['note_char']} px); these lines wrap: {long[:3]}")


def test_the_readme_lists_every_example_workflow_and_no_other():
    readme = (EXAMPLES.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Example workflows\n", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert rows == {p.name for p in WORKFLOWS}
    assert {m for m in re.findall(r"lingbot_\w+\.json", section)} == {p.name for p in WORKFLOWS}
    assert "schematic" not in section  # the thumbnails are screenshots (scripts/screenshot_workflow.py)


def _example_inputs_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("lingbot_example_inputs", EXAMPLES.parent / "nodes" / "example_inputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_inputs_never_replace_a_users_file_and_a_failed_copy_does_not_raise(tmp_path):
    place = _example_inputs_module().place
    png, mp4 = "lingbot_example_input.png", "lingbot_example_input.mp4"
    (tmp_path / png).write_bytes(b"the user's own picture")
    assert place(tmp_path) == ([mp4], [])
    assert (tmp_path / png).read_bytes() == b"the user's own picture"
    assert (tmp_path / mp4).read_bytes() == (EXAMPLES / mp4).read_bytes()
    assert place(tmp_path) == ([], [])  # the second start: nothing to do
    blocked = tmp_path / "not-a-folder"
    blocked.write_bytes(b"")  # an input "folder" that is a file: every copy fails, nothing raises
    copied, failed = place(blocked)
    assert copied == [] and [f.split(":")[0] for f in failed] == [png, mp4]
    assert sum(p.stat().st_size for p in EXAMPLES.glob("lingbot_example_input.*")) < 100_000  # small enough to ship
