"""Memory through a real headless ComfyUI 0.3.75, measured as the server's RSS (issue 9).

Packages are random but big enough to measure: the DiT and the refiner DiT are about 0.5 GiB each
(fp32, loaded without a cast, so memory-mapped: ``MEMORY_DIT``), written once per session by the
fixtures writer and deleted afterwards. "One pipeline" is its weights as loaded,
counted from the safetensors headers (DiT + text encoder + VAE), an independent number. A test-only node (tests/rss_probe) records the server's RSS
inside the prompt; the peak comes from VmHWM, reset through /proc/<pid>/clear_refs before each
prompt. Heavy (about 1.5 GiB of RAM in the server): run with ``flock /tmp/lingbot-heavy.lock``.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np
import pytest

from comfy_host import ComfyServer, comfyui_unavailable_reason, executed_nodes
from header_bytes import fp32_weight_bytes

pytestmark = pytest.mark.comfy

BIG = "memory-big"
MEDIUM = "memory-medium"
MIB = 1024 ** 2
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


def _ram_kib(field: str, pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _weights_bytes(package: Path, transformer: str) -> int:
    """The weights of one pipeline as the CPU loads them (tests/header_bytes.py: from the headers)."""
    return fp32_weight_bytes(package, transformer)


@pytest.fixture(scope="module")
def mem_server(memory_packages, tmp_path_factory):
    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("comfy-memory")
    log = base / "rss.jsonl"
    server = ComfyServer(base, models={BIG: memory_packages["big"], MEDIUM: memory_packages["medium"]},
                         env={"LINGBOT_RSS_LOG": str(log)})
    server.prepare()
    (server.custom_nodes_dir / "lingbot-rss-probe").symlink_to(Path(__file__).parent / "rss_probe", target_is_directory=True)
    server.start()
    server.rss_log = log
    yield server
    server.stop()


def probes(server) -> list:
    if not server.rss_log.exists():
        return []
    return [json.loads(line) for line in server.rss_log.read_text().splitlines()]


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
    samples = [_ram_kib("VmRSS", pid)]
    for _ in range(60):
        time.sleep(0.25)
        samples.append(_ram_kib("VmRSS", pid))
        if len(samples) >= 5 and max(samples[-5:]) - min(samples[-5:]) < 4 * MIB:
            return


@pytest.mark.parametrize("offload, layout", [("none", "refiner first"), ("model", "shuffled"), ("sequential", "base first"),
                                             ("block", "shuffled")])
def test_generate_unload_refine_holds_one_pipeline_at_a_time(mem_server, memory_packages, offload, layout):
    """Peak RSS over the whole prompt <= one pipeline + 25 %, and the Unload node frees >= 90 % of the
    base pipeline's weight bytes before the next node runs, with no garbage collection in between."""
    one = max(_weights_bytes(memory_packages["big"], t) for t in ("transformer", "refiner"))
    free_all(mem_server)
    pid = mem_server.proc.pid
    tag = f"peak-{offload}"
    graph, n = base_then_refine(LAYOUTS[layout], offload, tag=tag)
    reset_peak(pid)
    baseline = _ram_kib("VmRSS", pid)
    entry = mem_server.run(graph, timeout=300)
    peak = _ram_kib("VmHWM", pid)
    order = executed_nodes(entry)
    assert order.index(n["unload"]) < order.index(n["refine"])
    rss = {p["label"].split(":")[1]: p["rss"] for p in probes(mem_server) if p["label"].startswith(tag + ":")}
    dropped = rss["after_generate"] - rss["after_unload"]
    print(f"\n{offload} ({layout}): one pipeline {one / MIB:.0f} MiB; peak +{(peak - baseline) / MIB:.0f} MiB "
          f"({(peak - baseline) / one:.2f}x); the Unload node freed {dropped / MIB:.0f} MiB ({dropped / one:.0%})")
    assert peak - baseline <= 1.25 * one, f"peak RSS grew by {(peak - baseline) / MIB:.0f} MiB; one pipeline is {one / MIB:.0f} MiB"
    assert dropped >= 0.9 * one, f"RSS fell by only {dropped / MIB:.0f} MiB at the Unload node; the pipeline is {one / MIB:.0f} MiB"


def test_free_releases_idle_pipelines_and_the_next_run_reloads(mem_server):
    """POST /free (ComfyUI's "Unload models" + "Free model and node cache") releases the pack's idle
    pipelines: RSS drops by a pipeline, and the same prompt then reloads and gives identical frames."""
    pid = mem_server.proc.pid
    free_all(mem_server)
    graph = {"1": loader(BIG, "transformer", "model"), "2": generate("1", 7), "3": save("2", "free")}
    entry = mem_server.run(graph, timeout=300)
    first = mem_server.output_files(entry)
    loaded = _ram_kib("VmRSS", pid)
    free_all(mem_server)
    freed = loaded - _ram_kib("VmRSS", pid)
    one = _weights_bytes(mem_server.models_dir / "diffusers" / BIG, "transformer")
    print(f"\n/free: RSS fell by {freed / MIB:.0f} MiB (one pipeline {one / MIB:.0f} MiB)")
    assert freed >= 0.9 * one
    entry = mem_server.run(graph, timeout=300)
    assert "1" in executed_nodes(entry) and "2" in executed_nodes(entry)  # the node cache was reset too
    again = mem_server.output_files(entry)
    from PIL import Image

    a = np.stack([np.asarray(Image.open(p)) for p in first])
    b = np.stack([np.asarray(Image.open(p)) for p in again])
    np.testing.assert_array_equal(a, b)


@pytest.mark.soak
def test_soak_load_generate_unload_refine_keeps_rss_flat(mem_server):
    """20 cycles of load / generate / unload / refine / unload (new seed each time, so everything
    reloads): the server's RSS after each cycle stays within 5 % of cycle 1's."""
    pid = mem_server.proc.pid
    free_all(mem_server)
    after = []
    for cycle in range(20):
        graph, n = base_then_refine(LAYOUTS["base first"], "sequential" if cycle % 2 else "model",
                                    model=MEDIUM, tag=f"soak{cycle}")
        graph["9"] = unload(n["refiner"], n["refine"])
        graph[n["save"]] = save("9", "soak")
        entry = mem_server.run(graph, timeout=300)
        assert n["base"] in executed_nodes(entry)
        after.append(_ram_kib("VmRSS", pid))
    first = after[0]
    print("\nsoak RSS after each cycle (MiB): " + ", ".join(f"{a / MIB:.0f}" for a in after))
    worst = max(abs(a - first) for a in after)
    assert worst <= 0.05 * first, f"RSS moved by {worst / MIB:.0f} MiB from cycle 1 ({first / MIB:.0f} MiB)"


def test_a_symlink_loop_lists_each_package_once(mem_server):
    """models/diffusers/loop -> models/diffusers must not list every package again as loop/..., loop/loop/..."""
    loop = mem_server.models_dir / "diffusers" / "loop"
    loop.symlink_to(mem_server.models_dir / "diffusers", target_is_directory=True)
    try:
        names = mem_server.object_info("LoadLingbotPipeline")["input"]["required"]["model"][0]
    finally:
        loop.unlink()
    assert sorted(names) == sorted([BIG, MEDIUM]), names
