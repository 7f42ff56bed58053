"""Every example workflow stays readable when opened: no node drawn over another, no Note line wider
than its box (see workflow_geometry.py for the frontend measurements the estimate is calibrated on)."""

import json
import re
from itertools import combinations
from pathlib import Path

import pytest

from support.workflow_geometry import (
    CALIBRATION, FRONTEND, RENDERERS, content_height, node_box, node_schemas, note_columns, overlap, text_box_lines,
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


@pytest.mark.parametrize("renderer, node, rows, kinds, custom, height", CALIBRATION,
                         ids=[f"{c[0]}-{c[1]}" for c in CALIBRATION])
def test_the_height_estimate_reproduces_the_frontends_own(renderer, node, rows, kinds, custom, height):
    assert content_height(renderer, rows, kinds, custom) == height


def test_the_estimate_counts_the_loaders_widgets_as_the_frontend_drew_them(schemas):
    # The calibration screenshots' loader: 2 slot rows (speed_options and multi_gpu / pipe), 9 one-line widgets.
    loader = schemas["LoadLingbotPipeline"]
    assert (max(loader["slots"], loader["outputs"]), [k for _, k in loader["kinds"]], loader["custom"]) == (2, ["row"] * 9, True)
    generate = schemas["GenerateVideo"]
    kinds = [k for _, k in generate["kinds"]]
    assert kinds[:2] == ["multiline"] * 2 and kinds.count("seed_control") == 1 and kinds.count("text") == 1
    assert max(generate["slots"], generate["outputs"]) >= 5  # video, video_latent, prompt_schedule, image, pipe and generate["custom"]
    assert [k for _, k in schemas["LoadImage"]["kinds"]] == ["file", "upload", "image_preview"]
    assert [k for _, k in schemas["LoadVideo"]["kinds"]] == ["file", "upload", "video_preview"]
    assert not schemas["LoadImage"]["custom"] and not schemas["SaveVideo"]["custom"]


@pytest.mark.parametrize("renderer", RENDERERS)
@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_no_node_is_drawn_over_another(path, renderer, schemas):
    nodes = load(path)["nodes"]
    boxes = {f"{n['id']} {n['type']}": node_box(n, schemas.get(n["type"]), renderer) for n in nodes}
    covered = [(a, b, overlap(boxes[a], boxes[b])) for a, b in combinations(boxes, 2) if overlap(boxes[a], boxes[b])]
    assert not covered, "\n".join(
        f"{a} {tuple(round(v) for v in boxes[a])} overlaps {b} {tuple(round(v) for v in boxes[b])} ({area:.0f} px²)"
        for a, b, area in covered)


MIN_PROMPT_LINES = 8


def _first_multiline(schema):
    return next((name for name, kind in schema["kinds"] if kind == "multiline"), None)


@pytest.mark.parametrize("renderer", RENDERERS)
@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_every_prompt_box_shows_at_least_8_lines(path, renderer, schemas):
    # The prompt is typed in GenerateVideo / Refine's box, or in the text node linked into it.
    workflow = load(path)
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {link[0]: link[1] for link in workflow["links"]}
    boxes = {}
    for n in nodes.values():
        if n["type"] not in ("GenerateVideo", "Refine", "LingbotRemoteGenerate"):
            continue
        prompt = next((i for i in n.get("inputs") or [] if i["name"] == "prompt"), None)
        if prompt and prompt.get("link") is not None:
            source = nodes[links[prompt["link"]]]  # a text node, or the rewriter with its prose box
            boxes[f"{source['id']} {source['type']}"] = text_box_lines(
                source, schemas[source["type"]], _first_multiline(schemas[source["type"]]), renderer)
            continue
        boxes[f"{n['id']} {n['type']}"] = text_box_lines(n, schemas[n["type"]], "prompt", renderer)
    assert boxes, "every example has a prompt box"
    short = {k: round(v, 1) for k, v in boxes.items() if v is None or v < MIN_PROMPT_LINES}
    assert not short, f"prompt boxes under {MIN_PROMPT_LINES} lines in {renderer}: {short}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=[p.stem for p in WORKFLOWS])
def test_every_note_line_fits_its_box(path):
    notes = [n for n in load(path)["nodes"] if n["type"] in FRONTEND_ONLY]
    assert notes, "every example explains itself in a Note"
    for note, renderer in ((n, r) for n in notes for r in RENDERERS):
        columns = note_columns(note, renderer)
        long = [line for line in note["widgets_values"][0].splitlines() if len(line) > columns]
        assert not long, (f"Note {note['id']} is {note['size'][0]} px wide ({columns} characters of "
                          f"{FRONTEND['note_char']} px in {renderer}); these lines wrap: {long[:3]}")
        lines = len(note["widgets_values"][0].splitlines())
        for name, renderer in RENDERERS.items():  # the whole Note shows without scrolling, 15 px lines in Nodes 2.0
            assert lines * renderer["line"] <= note["size"][1] - 20, (name, note["id"], lines, note["size"])


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
