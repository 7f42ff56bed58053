"""Peak RSS of Generate -> Unload -> Refine per offload mode through ComfyUI's own executor (issue 15).

    .venv/bin/python -m bench.sequential_transient            # writes the package once under /tmp
    .venv/bin/python -m bench.sequential_transient --order none,model,sequential,sequential,none

Each ``--order`` entry is one prompt of the graph of ``tests/host/test_memory_comfy.py`` (its DiT of about
0.5 GiB, fp32, memory-mapped; refiner = a hard link to it), run by ComfyUI 0.3.75's ``PromptExecutor``
in this process (``tests/support/comfy_inprocess.py``), with ``unload_all_models()`` (what ``/free`` does)
before each. Printed per prompt: the RSS at its start and its peak rise (VmHWM, reset at the start).
``--fresh`` runs every mode and node layout in its own process instead. About 1.3 GiB of RSS.

``--server`` runs the graph through a real headless ComfyUI server instead (``python main.py`` of the
test host, ``tests/support/comfy_host.py``), on the package of issue 24's finding 11: a dense package whose DiT
and refiner DiT are separate files of 553 MiB each (fp32, hidden 1024, depth 8, memory-mapped).
``bench.server_rss`` measures each prompt: a thread polls the server's ``/proc/<pid>/status`` every 50 ms (VmRSS, RssAnon, RssFile); the server's
websocket ``executing`` events split the samples into stages. Printed per prompt: the peak rise over
the prompt (VmHWM) and per stage the peak rise of the RSS and, at that sample, of its anonymous and
file-backed parts. Hold ``flock /tmp/lingbot-heavy.lock`` while it runs (about 1.5 GiB in the server)::

    flock /tmp/lingbot-heavy.lock .venv/bin/python -m bench.sequential_transient --server --order none,sequential
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.server_rss import kib as _kib
from bench.server_rss import measure_prompt

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 ** 2
LAYOUT = {"none": "refiner first", "model": "shuffled", "sequential": "base first"}  # as the memory test
# Issue 24, finding 11: DiT and refiner DiT of 553 MiB each in fp32, written as two files.
SERVER_DIT = {"hidden_size": 1024, "num_attention_heads": 8, "axes_dims": [32, 48, 48], "depth": 8,
              "intermediate_size": 4096}


def ensure_package(root: Path) -> Path:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from support.sizes import MEMORY_DIT

    from lingbot_core.testing.fixtures import write_package

    if not (root / "refiner").is_dir():
        write_package(root, fp32=True, seed=3, dit=MEMORY_DIT, refiner=False)
        (root / "refiner").mkdir()
        for f in (root / "transformer").iterdir():
            os.link(f, root / "refiner" / f.name)
    return root


def ensure_server_package(root: Path) -> Path:
    sys.path[:0] = [str(REPO)]
    from lingbot_core.testing.fixtures import DIT_WEIGHTS, write_package

    if not (root / "refiner" / DIT_WEIGHTS).is_file() or not (root / "scheduler").is_dir():
        write_package(root, fp32=True, seed=5, dit=SERVER_DIT, refiner=True)
    return root


def without_probes(graph: dict, n: dict) -> dict:
    """The graph minus the test-only RSS probe nodes, their consumers wired to what they passed through."""
    probes = {n["probe_gen"]: n["gen"], n["probe_unload"]: n["unload"]}
    graph = {k: v for k, v in graph.items() if k not in probes}
    for v in graph.values():
        for name, val in v["inputs"].items():
            if isinstance(val, list) and val[0] in probes:
                v["inputs"][name] = [probes[val[0]], 0]
    return graph


def run(order, layouts, package: Path) -> list:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from support.comfy_inprocess import InProcessComfy
    from support.memory_graphs import LAYOUTS, base_then_refine

    host = InProcessComfy(tempfile.mkdtemp(prefix="lingbot-transient-"), {"memory-big": str(package)})
    import comfy.model_management as mm

    from lingbot_core.memory.budget import return_freed_memory

    out = []
    for i, (mode, layout) in enumerate(zip(order, layouts)):
        graph, n = base_then_refine(LAYOUTS[layout], mode, seed=100 + i)
        graph = without_probes(graph, n)
        mm.unload_all_models()
        return_freed_memory()
        start = _kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        status = host.run(graph)["status"]
        row = {"prompt": i, "mode": mode, "layout": layout, "status": status, "start_mib": round(start / MIB),
               "peak_rise_mib": round((_kib("VmHWM") - start) / MIB)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def resize(graph: dict, width: int, height: int, frames: int, guidance: float) -> dict:
    for node in graph.values():
        inputs = node["inputs"]
        if node["class_type"] in ("GenerateVideo", "Refine"):
            inputs.update(width=width, height=height, guidance_scale=guidance)
        if node["class_type"] == "GenerateVideo":
            inputs["num_frames"] = frames
    return graph


def run_server(order, layouts, package: Path, size=(32, 32, 5), guidance: float = 1.0) -> list:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from support.comfy_host import ComfyServer
    from support.memory_graphs import BIG, LAYOUTS, base_then_refine

    out = []
    with ComfyServer(models={BIG: package}, startup_timeout=300) as server:
        for i, (mode, layout) in enumerate(zip(order, layouts)):
            graph, n = base_then_refine(LAYOUTS[layout], mode, seed=100 + i)
            graph = resize(without_probes(graph, n), *size, guidance)
            row = {"prompt": i, "mode": mode, "layout": layout,
                   **measure_prompt(server, graph, {v: k for k, v in n.items()})}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench.sequential_transient", description=__doc__.split("\n\n")[0])
    p.add_argument("--order", default="none,model,sequential,sequential,none")
    p.add_argument("--fresh", action="store_true", help="each mode x layout in its own process")
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)  # one layout for every prompt (--fresh)
    p.add_argument("--package", default=None, help="package folder (written once; default under /tmp)")
    p.add_argument("--server", action="store_true", help="through a real ComfyUI server (issue 24, finding 11)")
    p.add_argument("--size", default="32x32x5", help="--server: width x height x frames (default: the memory test's)")
    p.add_argument("--guidance", type=float, default=1.0, help="--server: guidance_scale (> 1: two CFG branches)")
    a = p.parse_args(argv)
    if a.server:
        order = a.order.split(",")
        package = ensure_server_package(Path(a.package or Path(tempfile.gettempdir()) / "lingbot-transient-server-package"))
        size = tuple(int(v) for v in a.size.split("x"))
        run_server(order, [a.layout or "base first"] * len(order), package, size, a.guidance)
        return 0
    a.package = a.package or str(Path(tempfile.gettempdir()) / "lingbot-transient-package")
    package = ensure_package(Path(a.package))
    if a.fresh:
        for layout in ("base first", "refiner first", "shuffled"):
            for mode in ("none", "model", "sequential"):
                subprocess.run([sys.executable, "-m", "bench.sequential_transient", "--order", mode, "--layout", layout,
                                "--package", str(package)], cwd=REPO, check=True)
        return 0
    order = a.order.split(",")
    run(order, [a.layout] * len(order) if a.layout else [LAYOUT[m] for m in order], package)
    return 0


if __name__ == "__main__":
    sys.exit(main())
