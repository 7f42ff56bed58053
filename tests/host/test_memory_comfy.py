"""Memory through a real headless ComfyUI 0.3.75, measured as the server's RSS (issue 9).

Packages are random but big enough to measure: the DiT and the refiner DiT are about 0.5 GiB each
(fp32, loaded without a cast, so memory-mapped: ``MEMORY_DIT``), written once per session by the
fixtures writer and deleted afterwards. "One pipeline" is its weights as loaded,
counted from the safetensors headers (DiT + text encoder + VAE), an independent number. A test-only node (tests/support/rss_probe) records the server's RSS
inside the prompt; the peak comes from VmHWM, reset through /proc/<pid>/clear_refs before each
prompt. Heavy (about 1.5 GiB of RAM in the server): run with ``flock /tmp/lingbot-heavy.lock``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from support.comfy_host import ComfyServer, comfyui_unavailable_reason, executed_nodes
from support.header_bytes import fp32_weight_bytes
from support.memory_graphs import (
    BIG, LAYOUTS, MEDIUM, base_then_refine, free_all, generate, loader, reset_peak, save, unload,
)
from bench.server_rss import kib

pytestmark = pytest.mark.comfy

MIB = 1024 ** 2


def _weights_bytes(package: Path, transformer: str) -> int:
    """The weights of one pipeline as the CPU loads them (tests/support/header_bytes.py: from the headers)."""
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
    (server.custom_nodes_dir / "lingbot-rss-probe").symlink_to(Path(__file__).resolve().parents[1] / "support" / "rss_probe", target_is_directory=True)
    server.start()
    server.rss_log = log
    yield server
    server.stop()


def probes(server) -> list:
    if not server.rss_log.exists():
        return []
    return [json.loads(line) for line in server.rss_log.read_text().splitlines()]


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
    baseline = kib("VmRSS", pid)
    entry = mem_server.run(graph, timeout=300)
    peak = kib("VmHWM", pid)
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
    loaded = kib("VmRSS", pid)
    free_all(mem_server)
    freed = loaded - kib("VmRSS", pid)
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
        after.append(kib("VmRSS", pid))
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
