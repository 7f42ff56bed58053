"""Hardening through a real headless ComfyUI 0.3.75 (the session ``comfy_server``): bad inputs, untrusted
workflows and a fuzz pass never crash the server, every error names the node and the input, and the
pipeline gives the same frames afterwards.

Every test carries ``pytest.mark.comfy`` (deselect with ``-m "not comfy"``). Sizes are tiny (64x96,
5 frames, 2 steps). The package is linked under its own alias (``hardening-dense``) so this file does
not depend on what other test files left in ComfyUI's cache or in the pack's pipeline cache.

After a bad prompt the baseline graph is run again with a fresh ``fps`` value: with a plain-text
prompt (no caption duration) fps does not change the frames, but it changes GenerateVideo's cache
signature, so the node really runs again on the same pipeline object instead of being served from
ComfyUI's cache.

Fuzz: ``LINGBOT_FUZZ_N`` submissions (default 60), time-boxed by ``LINGBOT_FUZZ_SECONDS`` (default
90 s per 60 submissions), seeded by ``LINGBOT_FUZZ_SEED``. The long run::

    LINGBOT_FUZZ_N=200 .venv/bin/python -m pytest tests/host/test_hardening_comfy.py -k fuzz -s -q
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from support.comfy_host import ComfyServerError, PromptValidationError, execution_error, executed_nodes

pytestmark = pytest.mark.comfy

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_IMAGE = "lingbot_example_input.png"
DENSE = "hardening-dense"
MOE = "hardening-moe"
H, W, FRAMES, STEPS = 64, 96, 5, 2
PROMPT = "a red kite above green hills"
PROMPT_FILE = "hardening_prompt.json"

_fps = itertools.count(30)  # fresh GenerateVideo fps values (1..120) for re-runs of the baseline
_prefix = itertools.count(1)


# --------------------------------------------------------------------------------------------
# Graph builders
# --------------------------------------------------------------------------------------------


def loader(model=DENSE, transformer="transformer", offload="model", **kw) -> dict:
    inputs = {"model": model, "transformer": transformer, "offload": offload, "dit_precision": "auto",
              "text_encoder_precision": "auto", "vae_precision": "fp32"}
    inputs.update(kw)
    return {"class_type": "LoadLingbotPipeline", "inputs": inputs}


def generate(pipe="1", cond=None, **kw) -> dict:
    inputs = {"pipe": [pipe, 0], "prompt": PROMPT, "negative_prompt": "", "width": W, "height": H,
              "num_frames": FRAMES, "steps": STEPS, "guidance_scale": 3.0, "shift": 3.0, "seed": 42, "fps": 24}
    if cond is not None:
        inputs["image_condition"] = [cond, 0]
    inputs.update(kw)
    return {"class_type": "GenerateVideo", "inputs": inputs}


def encode(image_src, pipe="1", **kw) -> dict:
    inputs = {"pipe": [pipe, 0], "image": [image_src, 0], "width": W, "height": H}
    inputs.update(kw)
    return {"class_type": "EncodeImageVAE", "inputs": inputs}


def refine(pipe, frames_src, **kw) -> dict:
    inputs = {"pipe": [pipe, 0], "frames": [frames_src, 0], "prompt": PROMPT, "negative_prompt": "", "width": 96,
              "height": 64, "steps": 2, "guidance_scale": 3.0, "shift": 3.0, "t_thresh": 0.85, "tail_steps": 1,
              "seed": 42, "vae_tiling": False, "fps": 24}
    inputs.update(kw)
    return {"class_type": "Refine", "inputs": inputs}


def save(src, slot=0, prefix=None) -> dict:
    return {"class_type": "SaveImage", "inputs": {"images": [src, slot], "filename_prefix": prefix or f"hardening{next(_prefix)}"}}


def load_image() -> dict:
    return {"class_type": "LoadImage", "inputs": {"image": EXAMPLE_IMAGE}}


def t2v(**gen) -> dict:
    return {"1": loader(), "2": generate(**gen), "3": save("2")}


def ti2v(image_nodes: dict, image_src: str, **gen) -> dict:
    graph = {"1": loader(), "4": encode(image_src), "2": generate(cond="4", **gen), "3": save("2")}
    graph.update(image_nodes)
    return graph


# --------------------------------------------------------------------------------------------
# Fixtures and checks
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(comfy_server, packages):
    comfy_server.add_model(DENSE, packages["dense"])
    comfy_server.add_model(MOE, packages["moe"])
    comfy_server.add_input(REPO / "example_workflows" / EXAMPLE_IMAGE)
    prompt_file = Path(comfy_server.input_dir) / PROMPT_FILE
    prompt_file.write_text(json.dumps({"caption": {"scene": "a red kite above green hills"}, "duration": 0.2}))
    return comfy_server


def saved_frames(server, entry, node_id="3") -> np.ndarray:
    from PIL import Image

    items = (entry.get("outputs") or {}).get(node_id, {})
    files = server.output_files({"outputs": {node_id: items}})
    assert files, f"SaveImage {node_id} wrote nothing: {entry.get('outputs')}"
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in files])


def run_ok(server, graph, node="3"):
    entry = server.run(graph, timeout=240)
    return entry, saved_frames(server, entry, node)


@pytest.fixture(scope="module")
def baseline(server):
    _, frames = run_ok(server, t2v())
    assert frames.shape == (FRAMES, H, W, 3)
    return frames


def assert_still_good(server, baseline):
    """The server answers, and GenerateVideo re-runs on the same pipeline with the baseline's frames."""
    stats = server.system_stats()
    assert stats["system"]["comfyui_version"]
    assert server.running
    fps = next(_fps)
    assert fps <= 120, "ran out of fresh fps values"
    entry, frames = run_ok(server, t2v(fps=fps))
    assert "2" in executed_nodes(entry), "GenerateVideo was served from the cache; the check proves nothing"
    np.testing.assert_array_equal(frames, baseline)


def expect_400(server, graph, node_id, input_name, error_type):
    with pytest.raises(PromptValidationError) as err:
        server.queue(graph)
    node_errors = err.value.node_errors
    assert set(node_errors) == {node_id}, f"400 attributed to {set(node_errors)}, expected {node_id}: {node_errors}"
    errors = node_errors[node_id]["errors"]
    assert any(e["type"] == error_type and e["extra_info"].get("input_name") == input_name for e in errors), errors
    return errors


def expect_exec_error(server, graph, node_id, pattern):
    entry = server.run(graph, timeout=240, check=False)
    err = execution_error(entry)
    assert err is not None and err["_event"] == "execution_error", f"expected an execution error, got {entry['status']}"
    assert str(err["node_id"]) == node_id, f"error attributed to node {err['node_id']} ({err['node_type']}), expected {node_id}"
    assert re.search(pattern, err["exception_message"]), err["exception_message"]
    return err, entry


# --------------------------------------------------------------------------------------------
# Bad inputs through /prompt
# --------------------------------------------------------------------------------------------

# (id, graph factory, ("400", node, input, type) | ("exec", node, message regex))
BAD = [
    ("num_frames=6", lambda: t2v(num_frames=6), ("exec", "2", r"num_frames=6 is not allowed: use 1 \(an image\) or 4n\+1")),
    ("width=100", lambda: t2v(width=100), ("exec", "2", r"width=100 is not allowed: use a multiple of 16 pixels")),
    ("width=0", lambda: t2v(width=0), ("400", "2", "width", "value_smaller_than_min")),
    ("width=-16", lambda: t2v(width=-16), ("400", "2", "width", "value_smaller_than_min")),
    ("width=99999", lambda: t2v(width=99999), ("400", "2", "width", "value_bigger_than_max")),
    ("steps=0", lambda: t2v(steps=0), ("400", "2", "steps", "value_smaller_than_min")),
    ("steps=abc", lambda: t2v(steps="abc"), ("400", "2", "steps", "invalid_input_type")),
    ("guidance=NaN", lambda: t2v(guidance_scale=math.nan), ("exec", "2", r"guidance_scale=nan is not allowed: use a finite value in \[0, 100\]")),
    ("guidance=inf", lambda: t2v(guidance_scale=math.inf), ("400", "2", "guidance_scale", "value_bigger_than_max")),
    ("shift=NaN", lambda: t2v(shift=math.nan), ("exec", "2", r"shift must be a positive finite number, got nan")),
    ("empty prompt", lambda: t2v(prompt=""), ("exec", "2", r"prompt is empty")),
    ("malformed JSON caption", lambda: t2v(prompt='{"caption": {"scene": "a kite"'), ("exec", "2", r"prompt starts with '\{' but is not valid JSON")),
    ("caption duration 1e308", lambda: t2v(prompt='{"caption": "a kite", "duration": 1e308}'), ("exec", "2", r"duration=1e\+308 s at 24 fps is too long")),
    ("caption duration 3600 s", lambda: t2v(prompt='{"caption": "a kite", "duration": 3600}'), ("exec", "2", r"num_frames=86401 is not allowed: .*at most 1001")),
    ("offload=gpu", lambda: {**t2v(), "1": loader(offload="gpu")}, ("400", "1", "offload", "value_not_in_list")),
    ("transformer=foo", lambda: {**t2v(), "1": loader(transformer="foo")}, ("400", "1", "transformer", "value_not_in_list")),
    ("EncodeImageVAE width=100", lambda: ti2v({"5": load_image()}, "5") | {"4": encode("5", width=100)},
     ("exec", "4", r"width=100 is not allowed: use a multiple of 16")),
    ("condition size != video size", lambda: ti2v({"5": load_image()}, "5") | {"4": encode("5", width=128)},
     ("exec", "2", r"image condition was encoded at 64x128 but the video is 64x96")),
    ("TI2V video 4096x16", lambda: ti2v({"5": load_image()}, "5") | {"4": encode("5", width=4096, height=16)},
     ("exec", "4", r"image-to-video needs a video aspect ratio of at most 200:1 .*width=4096 x height=16")),
    ("10000x10 image at 4096x4096", lambda: ti2v({"5": {"class_type": "EmptyImage", "inputs": {"width": 10000, "height": 10, "batch_size": 1, "color": 0}}}, "5")
     | {"4": encode("5", width=4096, height=4096)}, ("exec", "4", r"image of 10000x10 pixels would have to be scaled to .* crop it closer")),
]


@pytest.mark.parametrize("case_id, make, expected", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_named_and_server_survives(server, baseline, case_id, make, expected):
    if expected[0] == "400":
        _, node_id, input_name, error_type = expected
        errors = expect_400(server, make(), node_id, input_name, error_type)
        print(f"\n  {case_id}: HTTP 400 {errors[0]['type']}: {errors[0]['message']} ({errors[0]['details']})")
    else:
        _, node_id, pattern = expected
        err, entry = expect_exec_error(server, make(), node_id, pattern)
        print(f"\n  {case_id}: execution_error in {err['node_type']} {node_id}: {err['exception_message']}")
    assert_still_good(server, baseline)


# -- images and batches (documented behaviour, not errors) -------------------------------------


@pytest.fixture(scope="module")
def ti2v_frames(server, baseline):
    _, frames = run_ok(server, ti2v({"5": load_image()}, "5"))
    return frames


def test_image_batch_uses_the_first_image(server, ti2v_frames):
    nodes = {"5": load_image(),
             "6": {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 32, "batch_size": 3, "color": 0xFF0000}},
             "7": {"class_type": "ImageBatch", "inputs": {"image1": ["5", 0], "image2": ["6", 0]}}}
    entry, frames = run_ok(server, ti2v(nodes, "7"))
    assert "4" in executed_nodes(entry)
    np.testing.assert_array_equal(frames, ti2v_frames)
    assert "EncodeImageVAE: got 4 images; using the first" in server.log_tail(400)


def test_rgba_image_drops_alpha(server, ti2v_frames):
    nodes = {"5": load_image(),
             "6": {"class_type": "SolidMask", "inputs": {"value": 0.25, "width": 64, "height": 64}},
             "7": {"class_type": "JoinImageWithAlpha", "inputs": {"image": ["5", 0], "alpha": ["6", 0]}}}
    entry, frames = run_ok(server, ti2v(nodes, "7"))
    assert "7" in executed_nodes(entry) and "4" in executed_nodes(entry)
    np.testing.assert_array_equal(frames, ti2v_frames)


def test_grayscale_looking_image_is_accepted(server, ti2v_frames):
    # Core nodes cannot make a 1-channel IMAGE; a mask shown as an image (R = G = B) is what users get.
    # (A true (H, W, 1) image is covered in test_hardening_core.)
    nodes = {"5": load_image(),
             "6": {"class_type": "ImageToMask", "inputs": {"image": ["5", 0], "channel": "green"}},
             "7": {"class_type": "MaskToImage", "inputs": {"mask": ["6", 0]}}}
    _, frames = run_ok(server, ti2v(nodes, "7"))
    assert frames.shape == (FRAMES, H, W, 3)
    assert not np.array_equal(frames, ti2v_frames)


def test_tiny_and_extreme_images_are_accepted_at_video_size(server):
    for w, h in ((1, 1), (10000, 10)):
        nodes = {"5": {"class_type": "EmptyImage", "inputs": {"width": w, "height": h, "batch_size": 1, "color": 0x336699}}}
        _, frames = run_ok(server, ti2v(nodes, "5"))
        assert frames.shape == (FRAMES, H, W, 3), (w, h)


# -- wrong pipe / wrong frames -----------------------------------------------------------------


def test_refiner_pipe_given_to_generate(server, baseline):
    graph = {"1": loader(MOE, transformer="refiner", blocks_on_gpu=6), "2": generate(), "3": save("2")}
    # Refused by the loader, before GenerateVideo starts (the core's own check stays behind it).
    err, _ = expect_exec_error(server, graph, "1", r"'GenerateVideo' \(node 2\) is connected to a refiner pipeline \(transformer='refiner'\)")
    assert_still_good(server, baseline)


def test_base_pipe_given_to_refine(server, baseline):
    graph = {"1": loader(blocks_on_gpu=5),  # not the baseline's (cached) loader; test_refiner_links_comfy.py pins the cached case
             "5": {"class_type": "EmptyImage", "inputs": {"width": W, "height": H, "batch_size": 5, "color": 0x808080}},
             "6": refine("1", "5"), "3": save("6")}
    expect_exec_error(server, graph, "1", r"'Refine' \(node 6\) is connected to a base pipeline \(transformer='transformer'\)")
    assert_still_good(server, baseline)


def test_refine_given_a_single_frame(server, baseline):
    graph = {"1": loader(), "2": generate(num_frames=1), "7": loader(MOE, transformer="refiner"),
             "6": refine("7", "2"), "3": save("6")}
    err, entry = expect_exec_error(server, graph, "6", r"Refine needs a video of at least 5 frames; got 1")
    assert "2" in executed_nodes(entry)  # the T2I run itself worked
    assert_still_good(server, baseline)


# -- model folders -----------------------------------------------------------------------------


@pytest.mark.parametrize("variant, pattern", [
    ("missing_vae", r"is missing the vae/ folder"),
    ("truncated", r"diffusion_pytorch_model\.safetensors is not a readable safetensors file .*truncated, download it again"),
    ("wrong_shape", r"tensor 'blocks\.0\.attn\.to_q\.weight' .* has shape \[63, 64\], but config\.json implies \[64, 64\]"),
    ("pickle_only", r"holds only pickle weights \(diffusion_pytorch_model\.bin\); they are refused because loading them can run arbitrary code"),
])
def test_broken_model_folder(server, baseline, broken_packages, variant, pattern):
    name = f"hardening-broken-{variant}"
    server.add_model(name, broken_packages[variant])
    # No /object_info refresh: 0.3.75 validates combos against a fresh INPUT_TYPES() call, which lists
    # the packages on disk at that moment, so the new folder is accepted by validation straight away.
    err, entry = expect_exec_error(server, t2v() | {"1": loader(name)}, "1", pattern)
    assert err["exception_type"].endswith("ModelPackageError")
    assert executed_nodes(entry) == ["1"], "nothing after the failed loader may run"
    assert_still_good(server, baseline)


@pytest.mark.parametrize("widget, value", [("vae_precision", "bf16"), ("dit_precision", "fp16"), ("offload", "sequential")])
def test_every_loader_option_runs_here(server, baseline, widget, value):
    """Each loader option that validation accepts must also run on this (CPU) device."""
    entry, frames = run_ok(server, t2v(steps=1, guidance_scale=1.0) | {"1": loader(**{widget: value})})
    assert frames.shape == (FRAMES, H, W, 3)
    assert "1" in executed_nodes(entry)
    assert_still_good(server, baseline)


def test_failed_load_does_not_evict_a_loaded_pipeline(server, baseline, broken_packages):
    name = "hardening-broken-truncated"
    server.add_model(name, broken_packages["truncated"])
    both = t2v() | {"7": loader(MOE), "8": generate("7"), "9": save("8")}  # two pipelines loaded
    server.run(both, timeout=240)
    mark = len(server.log_path.read_text(errors="replace").splitlines())
    expect_exec_error(server, t2v() | {"1": loader(name)}, "1", r"not a readable safetensors file")
    released = [line for line in server.log_path.read_text(errors="replace").splitlines()[mark:] if "freed" in line]
    assert released == [], released


# -- untrusted workflows -----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["../../somewhere", "/etc", "../" + DENSE, DENSE + "/../" + DENSE, "/"])
def test_paths_are_refused_before_anything_loads(server, model):
    before = server.get("/history")
    errors = expect_400(server, t2v() | {"1": loader(model)}, "1", "model", "value_not_in_list")
    assert model in errors[0]["details"]
    assert server.get("/history") == before  # nothing was queued, so nothing ran
    listed = server.object_info("LoadLingbotPipeline")["input"]["required"]["model"][0]
    assert all(not p.startswith("/") and ".." not in p.split("/") for p in listed), listed


# --------------------------------------------------------------------------------------------
# Fuzz
# --------------------------------------------------------------------------------------------

FUZZ_N = int(os.environ.get("LINGBOT_FUZZ_N", "60"))
FUZZ_SECONDS = float(os.environ.get("LINGBOT_FUZZ_SECONDS", str(90.0 * max(FUZZ_N, 60) / 60)))
FUZZ_SEED = int(os.environ.get("LINGBOT_FUZZ_SEED", "20250611"))

HUGE = "{" + "x" * 200_000  # a huge string that is a malformed caption (fast to reject)
FUZZ_VERBOSE = bool(os.environ.get("LINGBOT_FUZZ_VERBOSE"))
# In range for ComfyUI's own min/max checks, wrong for the pack: these must come back as clear execution errors.
SEMANTIC_BAD = {"width": [100, 24, 4000], "height": [100, 40], "num_frames": [2, 6, 1000], "steps": [],
                "guidance_scale": [math.nan, "nan"], "shift": [math.nan, "nan"], "t_thresh": [math.nan, "nan"]}
# Small valid values, so that a fuzz case that passes every check still runs in seconds on a CPU.
SMALL_VALID = {"width": [16, 32, 64, 96], "height": [16, 32, 64], "num_frames": [1, 5], "steps": [1, 2],
               "tail_steps": [0, 1], "fps": [1, 24, 120]}


def bad_values(spec, rng):
    typ = spec[0]
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    common = [None, [], [1, 2, 3], {}, True, HUGE, "", math.nan, -math.inf]
    if isinstance(typ, list):
        return common + ["definitely-not-an-option", typ[0].upper() + "x", "../../etc", "/etc/passwd", 0, 1.5, {"__value__": "nope"}]
    if typ == "INT":
        lo, hi = opts.get("min", -(2**63)), opts.get("max", 2**63)
        return common + [lo - 1, hi + 1, -1, -(2**63), 2**64 + 7, 10**30, 3.7, "12x", "1e3", math.inf, 1e308]
    if typ == "FLOAT":
        lo, hi = opts.get("min", -1e308), opts.get("max", 1e308)
        return common + [lo - 1, hi + 1, math.inf, "nan", "inf", -1e-300, 10**400, "three"]
    if typ == "STRING":
        return [HUGE, "", "   ", "{", '{"caption": ', "[1,", '{"caption": "x", "duration": -1}', '{"caption": "x", "duration": 1e999}',
                '{"caption": "x", "duration": 10000}', '{"duration": "soon"}', None, 0, math.nan, [1, 2, 3]]
    if typ == "BOOLEAN":
        return [None, "no", 0, math.nan, [1, 2, 3], HUGE]
    return common


def valid_value(name, spec, rng):
    typ = spec[0]
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if isinstance(typ, list):
        return rng.choice(typ)
    if name in SMALL_VALID:
        return rng.choice(SMALL_VALID[name])
    if typ == "INT":
        return rng.randint(opts.get("min", 0), min(opts.get("max", 2**31), 2**64 - 1))
    if typ == "FLOAT":
        return round(rng.uniform(opts.get("min", 0.0), opts.get("max", 10.0)), 3)
    if typ == "BOOLEAN":
        return rng.random() < 0.5
    if typ == "STRING":
        return rng.choice(["a kite", "", "猫 🐱 \u0000 \u202e", json.dumps({"caption": {"scene": "a kite"}, "duration": 0.1}), "{}", "[]"])
    raise AssertionError(typ)


def fuzz_templates():
    """(target node id, graph) per node class; downstream consumers of each target are listed for attribution."""
    refine_graph = {"1": loader(), "2": generate(), "7": loader(MOE, transformer="refiner"),
                    "6": refine("7", "2", width=32, height=32), "3": save("6")}
    prompt_graph = {"1": loader(), "8": {"class_type": "LoadLingbotPrompt", "inputs": {"prompt_file": PROMPT_FILE, "fps": 24}},
                    "2": generate(prompt=["8", 0]), "3": save("2")}
    return {
        "LoadLingbotPipeline": ("1", t2v(), {"2", "3"}),
        "GenerateVideo": ("2", t2v(), {"3"}),
        "EncodeImageVAE": ("4", ti2v({"5": load_image()}, "5"), {"2", "3"}),
        "Refine": ("6", refine_graph, {"3"}),
        "LoadLingbotPrompt": ("8", prompt_graph, {"2", "3"}),
    }


# A clear rejection is a ValueError (ModelPackageError is one) with a message; anything else (TypeError,
# KeyError, OverflowError, a torch RuntimeError about dtypes...) means the pack crashed on an input.
CLEAR = ("ValueError", "ModelPackageError")


def test_fuzz_widget_values(server, baseline):
    import copy

    rng = random.Random(FUZZ_SEED)
    infos = {cls: server.object_info(cls) for cls in fuzz_templates()}
    counts = {"submissions": 0, "http_400": 0, "execution_errors": 0, "successes": 0, "crashes": 0}
    problems, t0 = [], time.monotonic()
    for i in range(FUZZ_N):
        if time.monotonic() - t0 > FUZZ_SECONDS:
            break
        cls = rng.choice(sorted(fuzz_templates()))
        target, graph, downstream = fuzz_templates()[cls]
        graph = copy.deepcopy(graph)
        for node in graph.values():  # fresh output files, and a fresh fps so nothing is a pure cache hit
            if node["class_type"] == "SaveImage":
                node["inputs"]["filename_prefix"] = f"fuzz{i}"
        specs = {**infos[cls]["input"]["required"], **(infos[cls]["input"].get("optional") or {})}
        widgets = [n for n, s in specs.items() if isinstance(s[0], list) or s[0] in ("INT", "FLOAT", "STRING", "BOOLEAN")]
        if cls == "LoadLingbotPrompt":
            widgets = [n for n in widgets if n != "prompt_file"] + ["prompt_file"]
        mutated = {}
        for name in rng.sample(widgets, k=min(len(widgets), rng.choice([1, 1, 1, 2, 3]))):
            choices = bad_values(specs[name], rng) + SEMANTIC_BAD.get(name, []) * 6
            # Loader combos get valid values more often: every valid precision/offload must then really run.
            p_valid = 0.5 if cls == "LoadLingbotPipeline" else 0.3
            value = valid_value(name, specs[name], rng) if rng.random() < p_valid else rng.choice(choices)
            mutated[name] = value
            graph[target]["inputs"][name] = value
        counts["submissions"] += 1
        label = f"#{i} {cls}.{ {k: (v if not isinstance(v, str) or len(v) < 40 else v[:20] + '...') for k, v in mutated.items()} }"
        try:
            status, body = server.post("/prompt", {"prompt": graph, "client_id": server.client_id}, timeout=60)
        except (OSError, urllib.error.URLError) as e:
            counts["crashes"] += 1
            problems.append(f"{label}: connection error {e!r}")
            if not server.running:
                break
            continue
        if FUZZ_VERBOSE:
            detail = (json.dumps(body.get("node_errors"))[:300] if status == 400 and isinstance(body, dict) else "")
            print(f"  {label}: HTTP {status} {detail}")
        if status == 400:
            counts["http_400"] += 1
            node_errors = body.get("node_errors") if isinstance(body, dict) else None
            named = node_errors and target in node_errors and any(
                e.get("extra_info", {}).get("input_name") in mutated for e in node_errors[target]["errors"])
            if not named:
                problems.append(f"{label}: 400 does not name the node/input: {json.dumps(body)[:600]}")
            continue
        if status != 200 or not isinstance(body, dict) or "prompt_id" not in body:
            counts["crashes"] += 1
            problems.append(f"{label}: HTTP {status}: {str(body)[:600]}")
            continue
        try:
            entry = server.wait(body["prompt_id"], timeout=180)
        except (ComfyServerError, TimeoutError) as e:
            counts["crashes"] += 1
            problems.append(f"{label}: {e!r}"[:800])
            if not server.running:
                break
            server.interrupt()
            continue
        err = execution_error(entry)
        if FUZZ_VERBOSE:
            print(f"    -> {'success' if err is None else err.get('node_type') + ': ' + str(err.get('exception_type')) + ': ' + str(err.get('exception_message'))[:200]}")
        if err is None:
            counts["successes"] += 1
            continue
        counts["execution_errors"] += 1
        node_id, etype, msg = str(err.get("node_id")), str(err.get("exception_type", "")), err.get("exception_message", "")
        if node_id != target and node_id not in downstream:
            problems.append(f"{label}: error attributed to node {node_id} ({err.get('node_type')}), not {target}: {msg[:300]}")
        elif etype.rsplit(".", 1)[-1] not in CLEAR or not msg.strip():
            problems.append(f"{label}: unclear error {etype}: {msg[:300]}")
        else:
            known = set(specs) | {"image condition", "refiner", "pipeline", "caption", "duration", "image", "frames", "prompt"}
            if not any(word in msg for word in known):
                problems.append(f"{label}: error names no input: {etype}: {msg[:300]}")
    counts["seconds"] = round(time.monotonic() - t0, 1)
    print(f"\nfuzz (seed {FUZZ_SEED}): " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    for p in problems:
        print("  PROBLEM", p)
    assert counts["crashes"] == 0, problems
    assert not problems, "\n".join(problems)
    assert counts["submissions"] >= min(FUZZ_N, 20), counts
    assert server.running
    assert_still_good(server, baseline)


def test_unload_node_frees_the_pipeline_and_the_next_run_reloads(server, baseline):
    """Unload between stages (as before Refine): same frames, the weights are freed, and the handle that
    ComfyUI keeps cached loads them again when GenerateVideo next runs (same frames again)."""
    def log_lines():
        return server.log_path.read_text(errors="replace").splitlines()

    graph = t2v(fps=next(_fps))  # a fresh GenerateVideo signature: it runs whatever this file ran before
    graph["5"] = {"class_type": "UnloadLingbotPipeline", "inputs": {"pipe": ["1", 0], "frames": ["2", 0]}}
    graph["3"] = save("5")
    mark = len(log_lines())
    entry, frames = run_ok(server, graph)
    np.testing.assert_array_equal(frames, baseline)
    order = executed_nodes(entry)
    assert order.index("5") > order.index("2")
    assert any(f"unloaded {DENSE} (transformer)" in line for line in log_lines()[mark:]), log_lines()[mark:]
    mark = len(log_lines())
    entry, frames = run_ok(server, t2v(fps=next(_fps)))
    assert "2" in executed_nodes(entry)
    assert any(f"loading {DENSE} (transformer)" in line for line in log_lines()[mark:]), "GenerateVideo did not reload the weights"
    np.testing.assert_array_equal(frames, baseline)


# -- files a workflow names (issue 51) -------------------------------------------------------------


def test_a_prompt_file_linked_out_of_input_or_too_large_is_refused(server, baseline, tmp_path):
    """A link in input/ to a file elsewhere is listed (ComfyUI lists what it finds) but never read; a 200 MB
    caption (sparse) is refused from its size, the server's RSS flat (+800 MiB peak on main)."""
    from bench.server_rss import kib

    secret = tmp_path / "private.json"
    secret.write_text(json.dumps({"caption": {"scene": "the private text"}, "duration": 0.2}))
    link, huge = Path(server.input_dir) / "linked_out.json", Path(server.input_dir) / "huge_caption.json"
    link.symlink_to(secret)
    with open(huge, "wb") as f:
        f.truncate(200_000_000)
    try:
        def graph(name):
            return {"1": loader(), "8": {"class_type": "LoadLingbotPrompt", "inputs": {"prompt_file": name, "fps": 24}},
                    "2": generate(prompt=["8", 0], fps=next(_fps)), "3": save("2")}

        err, entry = expect_exec_error(server, graph(link.name), "8",
                                       r"prompt_file 'linked_out.json' leads outside .* through a link")
        assert "private text" not in json.dumps(entry)
        pid = server.proc.pid
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        before = kib("VmRSS", pid)
        expect_exec_error(server, graph(huge.name), "8", r"huge_caption\.json is 200,000,000 bytes; a prompt file is "
                                                         r"at most 4 MiB")
        rise = kib("VmHWM", pid) - before
        print(f"\n  200 MB caption refused: server peak RSS rise {rise / 2**20:.1f} MiB")
        assert rise < 64 * 2**20
    finally:
        link.unlink()
        huge.unlink()
    assert_still_good(server, baseline)
