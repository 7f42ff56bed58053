"""Cancel a running GenerateVideo in ComfyUI's own executor, with the residency tracker and fake accelerator.

Parent side: :func:`observations` runs this file as a child process (importing ComfyUI sets process-wide
state) and returns what it wrote. Child side: per offload mode, a T2V prompt of ``STEPS`` steps; when
GenerateVideo reports step ``AT``, the test calls ``nodes.interrupt_processing()``, the very call ComfyUI's
``POST /interrupt`` route makes (0.3.75 and current), then records how the prompt ended, how many steps
were reported, and which components the tracker saw resident on the (fake) accelerator at the end.
Then the same prompt runs again, undisturbed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODEL = "lingbot-tiny-dense"
STEPS, AT = 8, 3
MODES = ("model", "sequential", "block")


def observations(package, workdir: Path, timeout: float = 600) -> dict:
    from support.child_runs import run

    return run(__file__, Path(workdir) / "interrupts.json", workdir, package, timeout, "interrupt runner")


def graph(offload, seed):
    from support.inprocess_runner import H, W, loader, save

    return {"1": loader(MODEL, offload),
            "2": {"class_type": "GenerateVideo",
                  "inputs": {"pipe": ["1", 0], "prompt": "a red kite", "negative_prompt": "", "width": W, "height": H,
                             "num_frames": 5, "steps": STEPS, "guidance_scale": 3.0, "shift": 3.0, "seed": seed}},
            "3": save("2", f"interrupt_{offload}_{seed}")}


def main(out_path, base, package):
    from support.comfy_inprocess import InProcessComfy
    from support.inprocess_runner import Observer

    base = Path(base)
    comfy = InProcessComfy(base, {MODEL: package})
    observer = Observer(comfy, package)
    import nodes as comfy_nodes

    armed = {"on": False, "resident": None}

    def cancel_at_step(event, data):
        if event == "progress" and str(data.get("node")) == "2" and data.get("value") == AT:
            armed["resident"] = observer.current()  # what the sampler holds on the accelerator mid-run
            if armed["on"]:
                armed["on"] = False
                comfy_nodes.interrupt_processing()  # what POST /interrupt calls

    comfy.server.listeners.append(cancel_at_step)
    obs = {}
    for i, mode in enumerate(MODES):
        rec = {}
        for run, interrupt in (("interrupted", True), ("again", False)):
            armed.update(on=interrupt, resident=None)
            start_msg, start_mark = len(comfy.server.messages), len(observer.marks)
            result = comfy.run(graph(mode, seed=100 + i))
            messages = comfy.server.messages[start_msg:]
            end = [m for m in observer.marks[start_mark:] if m["event"] != "executing"]
            err = result["error"]
            rec[run] = {
                "status": result["status"],
                "event": next((e for e, _ in messages if e in ("execution_success", "execution_error",
                                                                 "execution_interrupted")), None),
                "node": None if err is None else err.get("node_id"),
                "steps": [d["value"] for e, d in messages if e == "progress" and str(d.get("node")) == "2"],
                "resident_at_step": armed["resident"],
                "resident_at_end": end[-1]["resident"] if end else None,
                "saved": sorted(p.name for p in comfy.output_dir.glob(f"interrupt_{mode}_*")),
            }
        obs[mode] = rec
    Path(out_path).write_text(json.dumps(obs, indent=1, default=str))


if __name__ == "__main__":
    from support.child_runs import prepare

    prepare()
    main(*sys.argv[1:4])
