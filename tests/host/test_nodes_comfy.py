"""The node pack end to end in a real headless ComfyUI 0.3.75 on CPU (the session ``comfy_server``).

Every server test carries ``pytest.mark.comfy`` (deselect with ``-m "not comfy"``). Sizes are tiny
(base 64x96, 5 frames, 2-3 steps; refiner 64x128) so the whole file stays within a few minutes on
2 cores. Apart from the example-workflow runs, the graphs use a short JSON caption: the fixture
tokenizer spends one token per byte, so a realistic caption makes text tokens dominate the DiT's cost.

Independence between tests: ComfyUI's output cache is keyed by node signatures, so a test that
must see a node *execute* either loads the fixture package under its own alias (a second symlink
under models/diffusers: a different loader input, hence a fresh pipeline and nothing cached), or
resets the cache with ``_reset_comfy_cache``.

Frames are compared bit for bit through core ``SaveImage`` (PNG is lossless; uint8 is fine for
"identical"); the example workflows' mp4s (lossy H.264) are only checked for frame count, size and
frame rate, decoded with PyAV.
"""

from __future__ import annotations

import copy
import io
import json
import shutil
import time

import numpy as np
import pytest
import torch
from PIL import Image

from lingbot_core.prompts.text_conditioning import parse_prompt

from support.comfy_host import (
    cached_nodes, execution_error, executed_nodes, preview_events, progress_events, workflow_to_api, ws_events,
)
from support.comfy_graphs import (
    DENSE, EXAMPLES, EXAMPLE_IMAGE, FRAMES, H, MOE, REF_H, REF_STEPS, REF_W, SHORT_CAPTION, STEPS, W, alias_package, check_caption, check_ui_format, decode_video, generate, load_workflow, loader, node_files, nodes_of, patch_nodes, reset_comfy_cache, save_image, saved_frames, t2v_graph, ti2v_graph, widget_inputs,
)

comfy = pytest.mark.comfy

WORKFLOWS = ("lingbot_t2v", "lingbot_ti2v", "lingbot_ti2v_refine")

PACK_NODES = ("LoadLingbotPipeline", "EncodeImageVAE", "GenerateVideo", "Refine", "ExtendVideo", "LoadLingbotPrompt",
              "UnloadLingbotPipeline", "LoadLingbotVAE", "LingbotRewriterServer", "LingbotRewritePrompt",
              "LingbotNegativePrompt", "LingbotSpeedOptions", "LoadLingbotLoRA", "LingbotRemoteServer",
              "LingbotRemoteGenerate")


# --------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(comfy_server):
    comfy_server.add_input(EXAMPLES / EXAMPLE_IMAGE)
    return comfy_server


@pytest.fixture(scope="module")
def object_info(server):
    return server.object_info()


# --------------------------------------------------------------------------------------------
# /object_info
# --------------------------------------------------------------------------------------------


@comfy
def test_object_info_lists_the_nodes_with_documented_defaults(server):
    infos = {name: server.object_info(name) for name in PACK_NODES}
    for name, info in infos.items():
        assert info["category"] == "LingBot-Video", name
        assert info["description"], name
        for inp, spec in widget_inputs(info).items():
            opts = spec[1] if len(spec) > 1 else {}
            assert opts.get("tooltip"), f"{name}.{inp} has no tooltip"
        assert len(info.get("output_tooltips") or []) == len(info["output"]), name

    load = widget_inputs(infos["LoadLingbotPipeline"])
    assert load["offload"][0] == ["none", "model", "sequential", "block"] and load["offload"][1]["default"] == "model"
    assert load["transformer"][0] == ["transformer", "refiner"] and load["transformer"][1]["default"] == "transformer"
    assert {DENSE, MOE} <= set(load["model"][0]), load["model"][0]
    assert load["dit_precision"][1]["default"] == "auto" and load["vae_precision"][1]["default"] == "fp32"
    assert infos["LoadLingbotPipeline"]["output"] == ["LINGBOT_PIPE"]

    gen = widget_inputs(infos["GenerateVideo"])
    expected = {"guidance_scale": 3.0, "shift": 3.0, "steps": 40, "seed": 42, "num_frames": 121,
                "width": 832, "height": 480, "use_caption_duration": True, "fps": 24}
    assert {k: gen[k][1]["default"] for k in expected} == expected
    assert gen["pipe"][0] == "LINGBOT_PIPE" and gen["image_condition"][0] == "LINGBOT_IMAGE_COND"
    assert "image_condition" in infos["GenerateVideo"]["input"]["optional"]
    assert infos["GenerateVideo"]["output"] == ["IMAGE", "LATENT"]
    assert gen["sampler"][0] == ["auto", "unipc", "euler", "dmd_student"] and gen["sampler"][1]["default"] == "auto"
    assert gen["sigmas"][1]["default"] == ""
    # vae_tiling is the last optional input: a workflow saved before it keeps its widget values in place
    assert gen["vae_tiling"][0] == ["auto", "on", "off"] and gen["vae_tiling"][1]["default"] == "auto"
    assert list(infos["GenerateVideo"]["input"]["optional"])[-1] == "vae_tiling"

    ref = widget_inputs(infos["Refine"])
    expected = {"width": 1920, "height": 1088, "steps": 8, "t_thresh": 0.85, "tail_steps": 2,
                "guidance_scale": 3.0, "shift": 3.0, "seed": 42, "vae_tiling": True, "fps": 24}
    assert {k: ref[k][1]["default"] for k in expected} == expected
    assert ref["first_frame"][0] == "IMAGE" and "first_frame" in infos["Refine"]["input"]["optional"]

    enc = widget_inputs(infos["EncodeImageVAE"])
    assert (enc["width"][1]["default"], enc["height"][1]["default"]) == (832, 480)
    assert infos["EncodeImageVAE"]["output"] == ["LINGBOT_IMAGE_COND"]

    prm = infos["LoadLingbotPrompt"]
    assert prm["output"] == ["STRING", "INT", "FLOAT"] and widget_inputs(prm)["fps"][1]["default"] == 24


# --------------------------------------------------------------------------------------------
# Example workflows
# --------------------------------------------------------------------------------------------


def _check_real_defaults(name: str, api: dict, wf: dict) -> None:
    """The converted prompt carries the real-weights settings: proves widgets_values line up."""
    real_model = "lingbot-video-moe-30b-a3b" if name.endswith("refine") else "lingbot-video-dense-1.3b"
    loaders = {api[n]["inputs"]["transformer"]: api[n]["inputs"] for n in nodes_of(api, "LoadLingbotPipeline")}
    assert set(loaders) == ({"transformer", "refiner"} if name.endswith("refine") else {"transformer"})
    offload = "block" if name.endswith("refine") else "model"  # the MoE never fits a 8-24 GB card whole
    for inputs in loaders.values():
        assert inputs == {**inputs, "model": real_model, "offload": offload, "dit_precision": "auto",
                          "text_encoder_precision": "auto", "vae_precision": "fp32"}
    (gid,) = nodes_of(api, "GenerateVideo")
    g = api[gid]["inputs"]
    assert {k: g[k] for k in ("width", "height", "num_frames", "steps", "guidance_scale", "shift", "seed",
                              "negative_prompt", "use_caption_duration", "fps")} == {
        "width": 832, "height": 480, "num_frames": 121, "steps": 40, "guidance_scale": 3.0, "shift": 3.0,
        "seed": 42, "negative_prompt": "", "use_caption_duration": True, "fps": 24}
    prompt = g["prompt"]
    if isinstance(prompt, list):  # refine workflow: one caption node feeds both samplers
        src = api[prompt[0]]
        assert src["class_type"] == "PrimitiveStringMultiline"
        prompt = src["inputs"]["value"]
    check_caption(prompt, 121 / 24)
    for cid in nodes_of(api, "CreateVideo"):
        assert api[cid]["inputs"]["fps"] == 24
    for sid in nodes_of(api, "SaveVideo"):
        assert (api[sid]["inputs"]["format"], api[sid]["inputs"]["codec"]) == ("auto", "auto")
        assert api[sid]["inputs"]["filename_prefix"].startswith("lingbot/")
    notes = [n for n in wf["nodes"] if n["type"] == "Note"]
    assert len(notes) == 1 and "models/diffusers" in notes[0]["widgets_values"][0]
    if name == "lingbot_t2v":
        assert "image_condition" not in g and not nodes_of(api, "LoadImage")
        return
    (lid,) = nodes_of(api, "LoadImage")
    assert api[lid]["inputs"] == {"image": EXAMPLE_IMAGE} and (EXAMPLES / EXAMPLE_IMAGE).is_file()
    (eid,) = nodes_of(api, "EncodeImageVAE")
    assert (api[eid]["inputs"]["width"], api[eid]["inputs"]["height"]) == (832, 480)
    assert g["image_condition"] == [eid, 0] and api[eid]["inputs"]["image"] == [lid, 0]
    if name.endswith("refine"):
        (rid,) = nodes_of(api, "Refine")
        r = api[rid]["inputs"]
        assert {k: r[k] for k in ("width", "height", "steps", "t_thresh", "tail_steps", "guidance_scale", "shift",
                                  "seed", "vae_tiling", "fps", "negative_prompt")} == {
            "width": 1920, "height": 1088, "steps": 8, "t_thresh": 0.85, "tail_steps": 2, "guidance_scale": 3.0,
            "shift": 3.0, "seed": 42, "vae_tiling": True, "fps": 24, "negative_prompt": ""}
        assert r["frames"] == [gid, 0] and r["first_frame"] == [lid, 0] and r["prompt"] == g["prompt"]
        assert api[r["pipe"][0]]["inputs"]["transformer"] == "refiner"
        assert len(nodes_of(api, "SaveVideo")) == 2  # base video kept


def tiny_example(name: str, object_info: dict) -> dict:
    """An example workflow converted to API format, with tiny sizes and the fixture packages."""
    api = workflow_to_api(load_workflow(name), object_info)
    patch_nodes(api, "LoadLingbotPipeline", model=MOE if name.endswith("refine") else DENSE)
    patch_nodes(api, "GenerateVideo", width=W, height=H, num_frames=FRAMES, steps=STEPS)
    if nodes_of(api, "EncodeImageVAE"):
        patch_nodes(api, "EncodeImageVAE", width=W, height=H)
    if nodes_of(api, "Refine"):
        patch_nodes(api, "Refine", width=REF_W, height=REF_H, steps=REF_STEPS)
    return api


@comfy
@pytest.mark.parametrize("name", WORKFLOWS)
def test_example_workflow_runs_and_writes_videos(server, object_info, name):
    wf = load_workflow(name)
    check_ui_format(wf, object_info)
    _check_real_defaults(name, workflow_to_api(wf, object_info), wf)

    api = tiny_example(name, object_info)
    for sid in nodes_of(api, "SaveVideo"):  # keep this test's files apart
        api[sid]["inputs"]["filename_prefix"] = f"test_{name}_{sid}"
    entry = server.run(api, timeout=600)
    assert entry["status"]["status_str"] == "success"

    expected = {}  # SaveVideo id -> (frames, height, width)
    for sid in nodes_of(api, "SaveVideo"):
        images = api[api[sid]["inputs"]["video"][0]]["inputs"]["images"][0]
        refined = api[images]["class_type"] == "Refine"
        expected[sid] = (FRAMES, REF_H, REF_W) if refined else (FRAMES, H, W)
    for sid, (t, h, w) in expected.items():
        files = node_files(server, entry, sid)
        assert len(files) == 1 and files[0].suffix == ".mp4" and files[0].is_file(), files
        frames, rate = decode_video(files[0])
        assert frames.shape == (t, h, w, 3), (sid, frames.shape)
        assert rate == 24
        assert frames.std() > 1.0  # not a blank video

    (gid,) = nodes_of(api, "GenerateVideo")
    assert [p["value"] for p in progress_events(entry, gid)] == list(range(1, STEPS + 1))


# --------------------------------------------------------------------------------------------
# Offload modes give the same frames
# --------------------------------------------------------------------------------------------

@comfy
def test_ti2v_refine_identical_in_every_offload_mode(server, object_info, packages):
    """The TI2V + Refine example graph (tiny) with both loaders in offload none, model and sequential.

    Each mode loads the MoE package under its own alias, so every stage (text encoder, VAE encode,
    DiT, refiner, VAE decode) runs afresh under that mode. Base and refined frames are saved as PNG.
    """
    api = tiny_example("lingbot_ti2v_refine", object_info)
    (cap,) = nodes_of(api, "PrimitiveStringMultiline")
    api[cap]["inputs"]["value"] = SHORT_CAPTION
    for nid in nodes_of(api, "CreateVideo") + nodes_of(api, "SaveVideo"):
        del api[nid]
    (gid,) = nodes_of(api, "GenerateVideo")
    (rid,) = nodes_of(api, "Refine")
    api["90"] = save_image(gid, "offload_base")
    api["91"] = save_image(rid, "offload_refined")

    results = {}
    for mode in ("none", "model", "sequential"):
        prompt = copy.deepcopy(api)
        patch_nodes(prompt, "LoadLingbotPipeline", model=alias_package(server, packages, "moe", f"offload-{mode}/{MOE}"),
                    offload=mode)
        entry = server.run(prompt, timeout=300)
        assert set(executed_nodes(entry)) >= {gid, rid, "90", "91"}, executed_nodes(entry)
        results[mode] = (saved_frames(server, entry, "90"), saved_frames(server, entry, "91"))

    base, refined = results["none"]
    assert base.shape == (FRAMES, H, W, 3) and refined.shape == (FRAMES, REF_H, REF_W, 3)
    for mode in ("model", "sequential"):
        assert np.array_equal(results[mode][0], base), f"base frames differ with offload={mode}"
        assert np.array_equal(results[mode][1], refined), f"refined frames differ with offload={mode}"


# --------------------------------------------------------------------------------------------
# Execution order and caching
# --------------------------------------------------------------------------------------------

@comfy
def test_encode_after_other_branch_generate_matches_ti2v_alone(server, packages):
    """comfyui-host.md §4: two GenerateVideo branches on one loader; ComfyUI runs the T2V branch
    (text encoder -> DiT -> VAE decode) before the TI2V branch's EncodeImageVAE. The VAE encode
    must place itself and give the same frames as the TI2V branch run on its own."""
    both = ti2v_graph(alias_package(server, packages, "dense", f"order/{DENSE}"), "order_ti2v", seed=11)
    both["4"] = generate("1", seed=12)
    both["7"] = save_image("4", "order_t2v")
    entry = server.run(both)
    order = executed_nodes(entry)
    assert set(both) - {"5"} <= set(order), order  # LoadImage may be cached from an earlier test
    assert order.index("4") < order.index("2"), f"the encode did not run after the other generate: {order}"
    together = saved_frames(server, entry, "6")

    alone = ti2v_graph(alias_package(server, packages, "dense", f"alone/{DENSE}"), "alone_ti2v", seed=11)
    entry = server.run(alone)
    assert set(alone) - {"5"} <= set(executed_nodes(entry))
    single = saved_frames(server, entry, "6")
    assert single.shape == (FRAMES, H, W, 3)
    assert np.array_equal(together, single)


@comfy
def test_seed_change_reruns_only_generate_and_identical_prompt_runs_nothing(server, packages):
    graph = ti2v_graph(alias_package(server, packages, "dense", f"seed/{DENSE}"), "seed_ti2v", seed=21)
    first = server.run(graph)
    assert set(graph) - {"5"} <= set(executed_nodes(first))  # LoadImage may be cached
    frames_a = saved_frames(server, first, "6")

    changed = copy.deepcopy(graph)
    changed["3"]["inputs"]["seed"] = 22
    second = server.run(changed)
    assert executed_nodes(second) == ["3", "6"]  # GenerateVideo + its SaveImage only
    assert set(cached_nodes(second)) >= {"1", "5", "2"}  # loader, LoadImage, EncodeImageVAE (no VAE call)
    frames_b = saved_frames(server, second, "6")
    assert frames_b.shape == frames_a.shape and not np.array_equal(frames_a, frames_b)

    third = server.run(copy.deepcopy(changed))
    assert executed_nodes(third) == []
    assert set(cached_nodes(third)) == set(changed)


@comfy
def test_generate_vae_tiling_reaches_the_decode_and_the_v2v(server):
    """GenerateVideo's vae_tiling on tall 400x16 frames (two rows of the refiner's 384-pixel tiles, far below
    720p): left out (a workflow saved before the input: auto) it is 'off' there; 'on' on a T2V node tiles its
    decode, and on a V2V node fed by it tiles the video's encode (its LATENT output, the sampled latent, changes)."""
    from safetensors.torch import load_file

    tall = dict(width=16, height=400, num_frames=5, steps=1)
    base = {"1": loader(DENSE), "2": generate("1", seed=71, **tall), "3": save_image("2", "tiling_t2v"),
            "4": generate("1", seed=72, video=["2", 0], denoise=0.5, **tall), "5": save_image("4", "tiling_v2v"),
            "6": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 1], "filename_prefix": "tiling_v2v"}}}

    def run(t2v, v2v):
        graph = copy.deepcopy(base)
        for nid, mode in (("2", t2v), ("4", v2v)):
            if mode is not None:
                graph[nid]["inputs"]["vae_tiling"] = mode
        entry = server.run(graph)
        (latent,) = node_files(server, entry, "6")
        return entry, saved_frames(server, entry, "3"), saved_frames(server, entry, "5"), load_file(latent)["latent_tensor"]

    _, t2v_auto, v2v_auto, _ = run(None, None)
    _, t2v_off, v2v_off, latent_off = run("off", "off")
    assert t2v_off.shape == v2v_off.shape == (5, 400, 16, 3) and latent_off.shape == (1, 16, 2, 50, 2)
    assert np.array_equal(t2v_auto, t2v_off) and np.array_equal(v2v_auto, v2v_off)
    entry, t2v_same, v2v_on, latent_on = run("off", "on")
    assert "2" not in executed_nodes(entry) and np.array_equal(t2v_same, t2v_off)  # the T2V node was cached
    assert not torch.equal(latent_on, latent_off) and not np.array_equal(v2v_on, v2v_off)
    _, t2v_on, _, _ = run("on", "off")
    assert not np.array_equal(t2v_on, t2v_off)


# --------------------------------------------------------------------------------------------
# Interrupt, progress, previews
# --------------------------------------------------------------------------------------------

def _wait_for_progress(server, prompt_id: str, node_id: str, timeout: float = 120) -> bool:
    """True once a ``progress`` event of ``node_id`` arrived for the prompt (websocket), False if the
    prompt finished first or the time ran out."""
    ws = getattr(server, "_ws", None)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ws is not None:
            events = ws.events_for(prompt_id)
            if any(e["type"] == "progress" and str(e["data"].get("node")) == node_id for e in events):
                return True
            if any(e["type"] == "executing" and e["data"].get("node") is None for e in events):
                return False
        else:  # no websocket: wait until it runs, then give sampling a moment
            running = server.get("/queue").get("queue_running", [])
            if any(len(item) > 1 and item[1] == prompt_id for item in running):
                time.sleep(3)
                return True
        time.sleep(0.02)
    return False


@comfy
def test_interrupt_stops_sampling_and_next_run_matches(server, packages):
    model = alias_package(server, packages, "dense", f"interrupt/{DENSE}")
    reference_graph = t2v_graph(model, "interrupt_ref", seed=31)
    reference = saved_frames(server, server.run(reference_graph), "3")

    long_graph = t2v_graph(model, "interrupt_long", seed=31, steps=200)
    pid = server.queue(long_graph)
    try:
        assert _wait_for_progress(server, pid, "2"), "GenerateVideo reported no progress"
    finally:
        server.interrupt(pid)
    entry = server.wait(pid, timeout=120)
    err = execution_error(entry)
    assert err is not None and err["_event"] == "execution_interrupted", err
    assert err["node_id"] == "2" and entry["status"]["status_str"] == "error"
    assert 1 <= len(progress_events(entry, "2")) < 200
    assert not node_files(server, entry, "3") and not list(server.output_dir.glob("interrupt_long*"))

    reset_comfy_cache(server)  # so the reference prompt runs again on the same (interrupted) pipeline
    again = server.run(reference_graph)
    assert executed_nodes(again) == ["1", "2", "3"], executed_nodes(again)
    assert np.array_equal(saved_frames(server, again, "3"), reference)


@comfy
def test_progress_per_step_and_latent_previews(server):
    assert "latent2rgb" in server.system_stats()["system"]["argv"]
    steps = 4
    entry = server.run(t2v_graph(DENSE, "progress", seed=41, steps=steps))
    progress = progress_events(entry, "2")
    assert [p["value"] for p in progress] == list(range(1, steps + 1))
    assert all(p["max"] == steps for p in progress)
    previews = preview_events(entry)
    assert len(previews) == steps
    for p in previews:
        assert p.get("node_id") in (None, "2")
        with Image.open(io.BytesIO(p["image"])) as img:
            assert img.format == "JPEG" and img.width > 0


@comfy
def test_speed_options_and_step_cache(server):
    """Speed Options feed the loader (no reload, same frames with lockstep off); a step cache on
    GenerateVideo skips DiT forwards and says how many under the node."""
    steps = 12
    plain = server.run(t2v_graph(DENSE, "speed_plain", seed=61, steps=steps))
    frames = saved_frames(server, plain, "3")
    graph = t2v_graph(DENSE, "speed_opts", seed=61, steps=steps)
    graph["4"] = {"class_type": "LingbotSpeedOptions",
                  "inputs": {"attention": "sdpa", "compile_blocks": False, "cfg_lockstep": False}}
    graph["1"]["inputs"]["speed_options"] = ["4", 0]
    assert np.array_equal(saved_frames(server, server.run(graph), "3"), frames)
    graph["2"]["inputs"]["step_cache"] = 0.5
    graph["3"]["inputs"]["filename_prefix"] = "speed_cached"
    entry = server.run(graph)
    texts = [e["data"]["text"] for e in ws_events(entry, "binary") if e.get("event") == 3 and e["data"].get("node_id") == "2"]
    assert len(texts) == steps and "skipped" in texts[-1], texts[-3:]
    skipped = int(texts[-1].split(", ")[-1].split()[0])
    assert skipped > 0 and not np.array_equal(saved_frames(server, entry, "3"), frames)


# --------------------------------------------------------------------------------------------
# Offload switch without a reload
# --------------------------------------------------------------------------------------------

@comfy
def test_offload_switch_reuses_loaded_weights(server, packages, tmp_path):
    """Switching offload on a loaded pipeline moves hooks; it does not load a second copy.

    Observable from outside: a private COPY of the dense package is loaded once, then every
    ``.safetensors`` file of the copy is moved away. Switching offload (model -> sequential ->
    model) re-runs the loader and the sampler and still works with identical frames, so nothing
    was read from disk again; a different precision (a different loader key, i.e. a real load)
    then fails with the core's missing-weights error. The files are restored afterwards.
    """
    copy_dir = tmp_path / "probe"
    shutil.copytree(packages["dense"], copy_dir)
    model = "reload-probe/lingbot-tiny-dense"
    server.add_model(model, copy_dir)
    graph = t2v_graph(model, "offload_switch", seed=51)

    first = server.run(graph)
    assert executed_nodes(first) == ["1", "2", "3"]
    frames = saved_frames(server, first, "3")

    hidden = tmp_path / "hidden"
    moved = []
    for f in sorted(copy_dir.rglob("*.safetensors")):
        dest = hidden / f.relative_to(copy_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        f.rename(dest)
        moved.append((dest, f))
    assert len(moved) >= 3  # transformer, text encoder, VAE (+ refiner)
    try:
        for mode in ("sequential", "model"):
            graph["1"]["inputs"]["offload"] = mode
            entry = server.run(copy.deepcopy(graph))
            assert executed_nodes(entry) == ["1", "2", "3"], (mode, executed_nodes(entry))
            assert np.array_equal(saved_frames(server, entry, "3"), frames), mode

        reload = copy.deepcopy(graph)
        reload["1"]["inputs"]["dit_precision"] = "bf16"
        entry = server.run(reload, check=False)
        err = execution_error(entry)
        assert err is not None and err["node_id"] == "1", err
        assert "ModelPackageError" in err["exception_type"]
        assert "no .safetensors weights found" in err["exception_message"]
    finally:
        for dest, original in moved:
            dest.rename(original)


# --------------------------------------------------------------------------------------------
# LoadLingbotPrompt
# --------------------------------------------------------------------------------------------

@comfy
def test_load_prompt_json_sets_frame_count(server, tmp_path):
    caption = json.loads(SHORT_CAPTION)
    path = tmp_path / "lingbot_test_prompt.json"
    path.write_text(json.dumps({"caption": caption, "duration": 0.3}), encoding="utf-8")
    name = server.add_input(path)
    info = server.object_info("LoadLingbotPrompt")
    assert name in info["input"]["required"]["prompt_file"][0]

    graph = {
        "1": loader(DENSE),
        "2": {"class_type": "LoadLingbotPrompt", "inputs": {"prompt_file": name, "fps": 24}},
        # num_frames widget 5: the caption's duration (0.3 s at 24 fps -> 9 frames) overrides it.
        "3": generate("1", seed=61, prompt=["2", 0], num_frames=FRAMES, steps=2, use_caption_duration=True, fps=24),
        "4": {"class_type": "CreateVideo", "inputs": {"images": ["3", 0], "fps": 24}},
        "5": {"class_type": "SaveVideo", "inputs": {"video": ["4", 0], "filename_prefix": "prompt_json",
                                                     "format": "auto", "codec": "auto"}},
        "6": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
        "7": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}},
        "8": {"class_type": "PreviewAny", "inputs": {"source": ["2", 2]}},
    }
    entry = server.run(graph)
    outputs = entry["outputs"]
    # The prompt output keeps the duration next to the caption; the encoder sees only the caption.
    (prompt,) = outputs["6"]["text"]
    assert json.loads(prompt) == {"caption": caption, "duration": 0.3}
    parsed = parse_prompt(prompt)
    assert parsed.text == json.dumps(caption, ensure_ascii=False, separators=(",", ":")) and parsed.duration == 0.3
    assert outputs["7"]["text"] == ["9"] and float(outputs["8"]["text"][0]) == pytest.approx(0.3)
    (video,) = node_files(server, entry, "5")
    frames, rate = decode_video(video)
    assert frames.shape == (9, H, W, 3) and rate == 24
