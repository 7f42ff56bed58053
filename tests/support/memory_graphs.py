"""The Generate -> Unload -> Refine graphs of the memory tests (and bench.sequential_transient) at the memory
packages' sizes, with pass-through RSS probes (support/rss_probe), and the server-side resets between prompts."""

import itertools
import time

from bench.server_rss import kib


MIB = 1024 ** 2
BIG = "memory-big"


MEDIUM = "memory-medium"


PROMPT = "a red kite above green hills"


_seeds = itertools.count(1000)


# Node-id layouts for the Generate -> Unload -> Refine graph: ComfyUI's order among independent nodes
# (the two loaders) follows ids, so each mode runs with a different one.
ROLES = ("base", "gen", "probe_gen", "unload", "probe_unload", "refiner", "refine", "save")


LAYOUTS = {
    "base first": ("1", "2", "3", "4", "5", "6", "7", "8"),
    "refiner first": ("8", "7", "6", "5", "4", "1", "2", "3"),
    "shuffled": ("5", "3", "8", "1", "6", "2", "4", "7"),
}


def loader(model, transformer, offload):
    return {"class_type": "LoadLingbotPipeline", "inputs": {
        "model": model, "transformer": transformer, "offload": offload, "dit_precision": "auto",
        "text_encoder_precision": "auto", "vae_precision": "fp32"}}


def generate(pipe, seed):
    return {"class_type": "GenerateVideo", "inputs": {
        "pipe": [pipe, 0], "prompt": PROMPT, "negative_prompt": "", "width": 32, "height": 32, "num_frames": 5,
        "steps": 1, "guidance_scale": 1.0, "shift": 3.0, "seed": seed}}


def refine(pipe, frames, seed):
    return {"class_type": "Refine", "inputs": {
        "pipe": [pipe, 0], "frames": [frames, 0], "prompt": PROMPT, "negative_prompt": "", "width": 32,
        "height": 32, "steps": 2, "guidance_scale": 1.0, "shift": 3.0, "t_thresh": 0.85, "tail_steps": 0,
        "seed": seed, "vae_tiling": False}}


def unload(pipe, frames):
    return {"class_type": "UnloadLingbotPipeline", "inputs": {"pipe": [pipe, 0], "frames": [frames, 0]}}


def probe(frames, label):
    return {"class_type": "LingbotTestRSSProbe", "inputs": {"images": [frames, 0], "label": label}}


def save(frames, prefix):
    return {"class_type": "SaveImage", "inputs": {"images": [frames, 0], "filename_prefix": prefix}}


def base_then_refine(ids, offload, model=BIG, seed=None, tag="mem"):
    """Generate -> Unload -> Refine with SaveImage as the only output (plus two pass-through probes)."""
    n = dict(zip(ROLES, ids))
    seed = next(_seeds) if seed is None else seed
    return {
        n["base"]: loader(model, "transformer", offload),
        n["refiner"]: loader(model, "refiner", offload),
        n["gen"]: generate(n["base"], seed),
        n["probe_gen"]: probe(n["gen"], f"{tag}:after_generate"),
        n["unload"]: unload(n["base"], n["probe_gen"]),
        n["probe_unload"]: probe(n["unload"], f"{tag}:after_unload"),
        n["refine"]: refine(n["refiner"], n["probe_unload"], seed),
        n["save"]: save(n["refine"], tag),
    }, n


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def free_all(server) -> None:
    """POST /free and wait until ComfyUI has applied it and the server's RSS has settled.

    ComfyUI 0.3.75 applies /free when its worker next wakes; a /free that arrives while the worker is
    still finishing the previous prompt wakes nobody, so a tiny prompt follows it (the flags are
    applied right after that prompt)."""
    server.free(settle=0)
    server.run({"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": next(_seeds)}},
                "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}}, timeout=120)
    pid = server.proc.pid
    samples = [kib("VmRSS", pid)]
    for _ in range(60):
        time.sleep(0.25)
        samples.append(kib("VmRSS", pid))
        if len(samples) >= 5 and max(samples[-5:]) - min(samples[-5:]) < 4 * MIB:
            return
