"""Peak RSS of Generate -> Unload -> Refine per offload mode through ComfyUI's own executor (issue 15).

    .venv/bin/python -m bench.sequential_transient            # writes the package once under /tmp
    .venv/bin/python -m bench.sequential_transient --order none,model,sequential,sequential,none

Each ``--order`` entry is one prompt of the graph of ``tests/test_memory_comfy.py`` (its DiT of about
0.5 GiB, fp32, memory-mapped; refiner = a hard link to it), run by ComfyUI 0.3.75's ``PromptExecutor``
in this process (``tests/comfy_inprocess.py``), with ``unload_all_models()`` (what ``/free`` does)
before each. Printed per prompt: the RSS at its start and its peak rise (VmHWM, reset at the start).
``--fresh`` runs every mode and node layout in its own process instead. About 1.3 GiB of RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 ** 2
LAYOUT = {"none": "refiner first", "model": "shuffled", "sequential": "base first"}  # as the memory test


def _kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def ensure_package(root: Path) -> Path:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from conftest import MEMORY_DIT

    from lingbot_core.fixtures import write_package

    if not (root / "refiner").is_dir():
        write_package(root, fp32=True, seed=3, dit=MEMORY_DIT, refiner=False)
        (root / "refiner").mkdir()
        for f in (root / "transformer").iterdir():
            os.link(f, root / "refiner" / f.name)
    return root


def run(order, layouts, package: Path) -> list:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from comfy_inprocess import InProcessComfy
    from test_memory_comfy import LAYOUTS, base_then_refine

    host = InProcessComfy(tempfile.mkdtemp(prefix="lingbot-transient-"), {"memory-big": str(package)})
    import comfy.model_management as mm

    from lingbot_core.memory import return_freed_memory

    out = []
    for i, (mode, layout) in enumerate(zip(order, layouts)):
        graph, n = base_then_refine(LAYOUTS[layout], mode, seed=100 + i)
        probes = {n["probe_gen"]: n["gen"], n["probe_unload"]: n["unload"]}  # test-only nodes: bypass them
        graph = {k: v for k, v in graph.items() if k not in probes}
        for v in graph.values():
            for name, val in v["inputs"].items():
                if isinstance(val, list) and val[0] in probes:
                    v["inputs"][name] = [probes[val[0]], 0]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench.sequential_transient", description=__doc__.split("\n\n")[0])
    p.add_argument("--order", default="none,model,sequential,sequential,none")
    p.add_argument("--fresh", action="store_true", help="each mode x layout in its own process")
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)  # one layout for every prompt (--fresh)
    p.add_argument("--package", default=str(Path(tempfile.gettempdir()) / "lingbot-transient-package"))
    a = p.parse_args(argv)
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
