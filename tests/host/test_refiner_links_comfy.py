"""A pipeline wired into the wrong sampler is refused before anything runs, in a real ComfyUI (0.3.75).

ComfyUI (0.3.75 and the current source) gives VALIDATE_INPUTS neither a linked value nor the graph, so the
loader, the first node of every such chain, checks where its pipeline goes (hidden PROMPT) and refuses
it before any sampler or encoder starts: the error names the wrong link and how to fix it. Messages name
the package the user picked, never the server's folders.
"""

import re

import pytest

from support.comfy_host import execution_error, executed_nodes, progress_events

pytestmark = pytest.mark.comfy

DENSE, MOE = "lingbot-tiny-dense", "lingbot-tiny-moe"
H, W, FRAMES = 64, 96, 5


_fresh = iter(range(1, 40))


def loader(model, transformer, blocks_on_gpu=None):
    """A loader ComfyUI has not cached: a fresh blocks_on_gpu (no effect outside offload 'block') per call."""
    return {"class_type": "LoadLingbotPipeline",
            "inputs": {"model": model, "transformer": transformer, "offload": "model", "dit_precision": "auto",
                       "text_encoder_precision": "auto", "vae_precision": "fp32",
                       "blocks_on_gpu": next(_fresh) if blocks_on_gpu is None else blocks_on_gpu}}


def generate(pipe, seed):
    return {"class_type": "GenerateVideo",
            "inputs": {"pipe": [pipe, 0], "prompt": "a red kite", "negative_prompt": "", "width": W, "height": H,
                       "num_frames": FRAMES, "steps": 2, "guidance_scale": 1.0, "shift": 3.0, "seed": seed}}


def refine(pipe, frames):
    return {"class_type": "Refine",
            "inputs": {"pipe": [pipe, 0], "frames": [frames, 0], "prompt": "a red kite", "negative_prompt": "",
                       "width": 128, "height": 64, "steps": 2, "guidance_scale": 1.0, "shift": 3.0,
                       "t_thresh": 0.85, "tail_steps": 0, "seed": 1, "vae_tiling": False}}


def save(src, prefix):
    return {"class_type": "SaveImage", "inputs": {"images": [src, 0], "filename_prefix": prefix}}


def test_a_base_pipeline_wired_into_refine_is_refused_before_generate_runs(comfy_server):
    graph = {"1": loader(MOE, "transformer"), "2": generate("1", seed=701), "3": refine("1", "2"),
             "4": save("3", "wrong_refine"), "5": save("2", "wrong_base")}
    entry = comfy_server.run(graph, check=False)
    err = execution_error(entry)
    assert err is not None and err["node_id"] == "1", err
    assert "Refine" in err["exception_message"] and "transformer='refiner'" in err["exception_message"]
    assert "2" not in executed_nodes(entry) and not progress_events(entry, "2")
    assert not list(comfy_server.output_dir.glob("wrong_*"))


def test_a_refiner_pipeline_wired_into_generate_is_refused_at_its_loader(comfy_server):
    graph = {"1": loader(MOE, "refiner"), "2": generate("1", seed=702), "3": save("2", "wrong_generate")}
    entry = comfy_server.run(graph, check=False)
    err = execution_error(entry)
    assert err is not None and err["node_id"] == "1", err
    assert "GenerateVideo" in err["exception_message"] and "transformer='transformer'" in err["exception_message"]
    assert "2" not in executed_nodes(entry)


def test_refine_with_the_dense_package_is_refused_before_the_base_run_naming_the_package_not_the_folder(
        comfy_server, tmp_path_factory):
    from lingbot_core.testing.fixtures import write_package

    # As released: the dense package has no refiner/ folder. The refiner loader runs only when Refine first
    # needs it, after the base GenerateVideo; the base loader, which runs first, refuses it instead.
    dense = write_package(tmp_path_factory.mktemp("released") / "lingbot-video-dense-1.3b", fp32=True, refiner=False)
    comfy_server.add_model("lingbot-video-dense-1.3b", dense)
    graph = {"1": loader(MOE, "transformer"), "2": generate("1", seed=703),
             "6": loader("lingbot-video-dense-1.3b", "refiner"), "3": refine("6", "2"), "4": save("3", "dense_refine")}
    entry = comfy_server.run(graph, check=False)
    err = execution_error(entry)
    assert err is not None and err["node_id"] in ("1", "6"), err
    assert "2" not in executed_nodes(entry) and not progress_events(entry, "2")  # the base run never started
    message = err["exception_message"]
    assert "package 'lingbot-video-dense-1.3b' is missing the refiner/ folder" in message, message
    assert "(node 6)" in message and "lingbot-video-moe-30b-a3b" in message, message
    for folder in (dense, comfy_server.models_dir, comfy_server.models_dir.parent):
        assert str(folder) not in message, message
    assert not re.search(r"(^|[\s'\"(])/[\w.-]", message), f"an absolute path in: {message}"


def test_a_base_pipeline_through_a_lora_into_refine_is_refused_at_the_loader(comfy_server):
    from support.lora_files import lightx2v_lora

    folder = comfy_server.models_dir / "loras"
    folder.mkdir(parents=True, exist_ok=True)
    lightx2v_lora(folder / "lingbot_tiny_refine_link.safetensors")
    graph = {"1": loader(MOE, "transformer"), "2": generate("1", seed=704),
             "7": {"class_type": "LoadLingbotLoRA",
                   "inputs": {"pipe": ["1", 0], "lora_name": "lingbot_tiny_refine_link.safetensors", "strength": 1.0}},
             "3": refine("7", "2"), "4": save("3", "wrong_lora_refine")}
    entry = comfy_server.run(graph, check=False)
    err = execution_error(entry)
    assert err is not None and err["node_id"] == "1" and "node 3" in err["exception_message"], err
    assert "2" not in executed_nodes(entry)


def test_a_cached_base_loader_wired_into_refine_is_refused_by_refine(comfy_server):
    """The limit of the loader's check: a loader ComfyUI kept cached from the previous prompt does not run
    again, so Refine's own check refuses the base pipeline (after the cached GenerateVideo, not a new one)."""
    base = loader(MOE, "transformer", blocks_on_gpu=39)
    comfy_server.run({"1": base, "2": generate("1", seed=705), "5": save("2", "cached_base")})
    entry = comfy_server.run({"1": base, "2": generate("1", seed=705), "5": save("2", "cached_base"),
                              "3": refine("1", "2"), "4": save("3", "cached_wrong_refine")}, check=False)
    err = execution_error(entry)
    assert err is not None and err["node_id"] == "3", err
    assert "Refine needs the refiner DiT" in err["exception_message"]
    assert "2" not in executed_nodes(entry)  # GenerateVideo was cached: nothing was sampled again

