"""Graphs run by ComfyUI's own executor in a child process, with the offload instrumentation installed.

Parent side (pytest): :func:`observations` starts this file as a child Python process once per test
session and returns the JSON it wrote. Child side (``python inprocess_runner.py OUT BASE PACKAGE``):
starts :class:`comfy_inprocess.InProcessComfy`, installs the residency tracker and the fake
accelerator, runs the graphs and writes what it observed. A child process because importing ComfyUI
parses ``sys.argv`` and sets process-wide state that must not leak into pytest.

Observed per executed node (between its ``executing`` message and the next message): the residency
snapshots of each probe (``residency.py``; ``"stream"`` = a sequential-offload weight load), the
devices that each ``lingbot_core`` function requested for tensors (``fake_accelerator.py``), and the
resident set when the node finished.

Scenarios:
- ``links``: LoadLingbotPipeline's ``model`` fed through a link with ``../..``, an absolute path (a real
  package) and an unknown name, from core ``PrimitiveString`` and from an any-typed string node
  (ComfyUI's ``IO.ANY``, ``"*"``, which many custom-node packs output and which matches every input type);
  then a valid prompt. Counts safetensors opens and file opens under the package meanwhile.
- ``prompt_links``: LoadLingbotPrompt's ``prompt_file`` fed through the any-typed string node with a
  ``.json`` file outside ``input/`` (as ``../outside.json`` and as an absolute path), then a listed file;
  counts opens of the outside file meanwhile.
- ``encode``: in ``model`` then ``sequential`` offload, graph ``a`` (independent T2V and TI2V branches;
  ComfyUI 0.3.75 runs the T2V branch first) and graph ``b`` (GenerateVideo -> its frames ->
  EncodeImageVAE -> GenerateVideo, one pipeline).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

MODEL = "lingbot-tiny-dense"
H, W, FRAMES = 32, 48, 5
MODES = ("model", "sequential")
LINK_VALUES = {"dotdot": "../..", "absolute": None, "unknown": "no-such-package"}  # absolute: the package path
OUTSIDE_CAPTION = "a private note kept outside the input folder"
PROMPT_LINK_VALUES = {"dotdot": "../outside.json", "absolute": None, "listed": "listed.json"}  # absolute: outside.json

ANY_STRING_NODE = '''"""Test-only node: a string through ComfyUI's own "any" output type (IO.ANY), as custom-node packs use it."""

from comfy.comfy_types import IO


class AnyString:
    RETURN_TYPES = (IO.ANY,)  # "*": ComfyUI's link type check accepts it for every input, combos included
    FUNCTION = "run"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("STRING", {"default": ""})}}

    def run(self, value):
        return (value,)


NODE_CLASS_MAPPINGS = {"AnyString": AnyString}
'''

_CACHE: dict = {}


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------

def observations(package: str | os.PathLike, workdir: Path, timeout: float = 600) -> dict:
    """Run the child once per (package, workdir) per process and return its observations."""
    key = (str(package), str(workdir))
    if key not in _CACHE:
        from support.child_runs import run

        _CACHE[key] = run(__file__, Path(workdir) / "observations.json", workdir, package, timeout,
                          "in-process ComfyUI runner")
    return _CACHE[key]


# --------------------------------------------------------------------------------------------
# Child side
# --------------------------------------------------------------------------------------------

def loader(model, offload="model"):
    return {"class_type": "LoadLingbotPipeline",
            "inputs": {"model": model, "transformer": "transformer", "offload": offload, "dit_precision": "auto",
                       "text_encoder_precision": "auto", "vae_precision": "fp32"}}


def generate(seed, cond=None, pipe="1"):
    inputs = {"pipe": [pipe, 0], "prompt": "a red kite", "negative_prompt": "", "width": W, "height": H,
              "num_frames": FRAMES, "steps": 1, "guidance_scale": 1.0, "shift": 3.0, "seed": seed}
    if cond is not None:
        inputs["image_condition"] = [cond, 0]
    return {"class_type": "GenerateVideo", "inputs": inputs}


def encode(image_src):
    return {"class_type": "EncodeImageVAE", "inputs": {"pipe": ["1", 0], "image": [image_src, 0], "width": W, "height": H}}


def save(src, prefix):
    return {"class_type": "SaveImage", "inputs": {"images": [src, 0], "filename_prefix": prefix}}


def graph_a(offload, tag):
    """Two independent branches on one pipeline; ids as observed in comfyui-host.md §4 (T2V runs first)."""
    return {"1": loader(MODEL, offload),
            "5": {"class_type": "EmptyImage", "inputs": {"width": 70, "height": 50, "batch_size": 1, "color": 0x3366AA}},
            "2": encode("5"), "3": generate(11, cond="2"), "4": generate(12),
            "6": save("3", f"{tag}_ti2v"), "7": save("4", f"{tag}_t2v")}


def graph_b(offload, tag):
    """GenerateVideo -> its frames -> EncodeImageVAE -> GenerateVideo: the encode runs between the two."""
    return {"1": loader(MODEL, offload), "2": generate(21), "3": encode("2"), "4": generate(22, cond="3"),
            "5": save("4", f"{tag}_ti2v"), "6": save("2", f"{tag}_t2v")}


def link_graph(source_class, value):
    return {"1": {"class_type": source_class, "inputs": {"value": value}},
            "2": loader(["1", 0]), "3": generate(31, pipe="2"), "4": save("3", "links")}


def prompt_link_graph(value):
    return {"1": {"class_type": "AnyString", "inputs": {"value": value}},
            "2": {"class_type": "LoadLingbotPrompt", "inputs": {"prompt_file": ["1", 0], "fps": 24}},
            "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}}}


def _key(components) -> str:
    return ",".join(sorted(components))


class Observer:
    """Residency tracker + fake accelerator around every pipeline a stage uses (loaded lazily by the pack)."""

    def __init__(self, comfy, package_dir):
        from support.fake_accelerator import point_hooks_at, recording_transfers
        from support.residency import ResidencyTracker

        self._point, self._Tracker = point_hooks_at, ResidencyTracker
        self.tracker = None
        self.marks = []
        self.safe_opens = 0
        self.file_opens = 0
        self._transfers = recording_transfers()
        self.requests = self._transfers.__enter__()

        import safetensors

        orig_safe_open = safetensors.safe_open

        def counting_safe_open(*args, **kwargs):  # lingbot_core imports it at call time
            self.safe_opens += 1
            return orig_safe_open(*args, **kwargs)

        safetensors.safe_open = counting_safe_open

        inside = os.path.realpath(package_dir) + os.sep

        def audit(event, args):  # Python-level opens (configs, tokenizer files) of anything in the package
            if event == "open" and isinstance(args[0], str) and os.path.realpath(args[0]).startswith(inside):
                self.file_opens += 1

        sys.addaudithook(audit)

        # The loader returns a lazy handle; the pack's pipeline pool hands the loaded pipeline to its
        # observer each time a stage uses it (after any offload change): instrument it there.
        loader = comfy.node_class("LoadLingbotPipeline")
        pool_observer = sys.modules[loader.__module__.rsplit(".", 1)[0] + ".comfy_memory"].pipe_pool().observer
        orig_using = pool_observer.using
        observer = self

        def using(spec, pipe):
            orig_using(spec, pipe)
            observer.instrument(pipe)

        pool_observer.using = using  # test instrumentation of the pool's observer, in this child process only
        comfy.server.listeners.append(self.on_message)

    def instrument(self, pipe):
        if self.tracker is None or self.tracker.pipe is not pipe:
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)
            self.tracker = self._Tracker(pipe).__enter__()
        self._point(pipe)  # hooks are new after every (re)load or offload change

    def current(self):
        return None if self.tracker is None else _key(self.tracker.current())

    def on_message(self, event, data):
        """A node starts (``executing``) or the prompt ends: note where the records stand."""
        if event in ("executing", "execution_success", "execution_error", "execution_interrupted"):
            self.marks.append({"event": event, "node": data.get("node"), "resident": self.current(),
                               "tracker": self.tracker,
                               "snapshots": 0 if self.tracker is None else len(self.tracker.snapshots),
                               "requests": len(self.requests)})

    def segments(self, start):
        """Per executed node since mark ``start``: probe snapshots, placements, resident set after it."""
        marks = self.marks[start:]
        out = {}
        for begin, end in zip(marks, marks[1:]):
            if begin["event"] != "executing":
                continue
            snaps = Counter()
            if begin["tracker"] is not None and begin["tracker"] is end["tracker"]:
                snaps.update(f"{probe}:{_key(s)}" for probe, s in begin["tracker"].snapshots[begin["snapshots"]:end["snapshots"]])
            placements = {}
            for mod, fn, device in self.requests[begin["requests"]:end["requests"]]:
                if "lingbot_core" in mod.split(".") and device is not None and device.type != "cpu":
                    placements.setdefault(fn, set()).add(str(device))
            out[begin["node"]] = {"snapshots": dict(snaps), "placements": {k: sorted(v) for k, v in placements.items()},
                                  "resident_after": end["resident"]}
        return out


def _frames(comfy, result, save_ids):
    """``{save node: [[width, height], ...]}`` and ``{save node: [sha1 of the RGB pixels, ...]}``."""
    from PIL import Image

    frames, digests = {}, {}
    for sid in save_ids:
        images = (result["outputs"].get(sid) or {}).get("images", [])
        frames[sid], digests[sid] = [], []
        for im in images:
            with Image.open(comfy.output_dir / im.get("subfolder", "") / im["filename"]) as f:
                frames[sid].append(list(f.size))
                digests[sid].append(hashlib.sha1(f.convert("RGB").tobytes()).hexdigest())
    return frames, digests


def _run(comfy, observer, prompt, save_ids=()):
    start = len(observer.marks)
    result = comfy.run(prompt)
    record = {k: result[k] for k in ("status", "executed", "cached", "validation")}
    err = result["error"]
    record["error"] = None if err is None else {k: err.get(k) for k in ("node_id", "node_type", "exception_type", "exception_message")}
    record["nodes"] = observer.segments(start)
    record["frames"], record["digests"] = _frames(comfy, result, save_ids) if result["status"] == "success" else ({}, {})
    record["class_types"] = {nid: node["class_type"] for nid, node in prompt.items()}
    record["texts"] = {nid: out["text"] for nid, out in (result.get("outputs") or {}).items() if "text" in out}
    return record


def main(out_path, base, package):
    t0 = time.time()
    base = Path(base)
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / "lingbot_test_any_string.py").write_text(ANY_STRING_NODE)

    from support.comfy_inprocess import InProcessComfy

    comfy = InProcessComfy(base, {MODEL: package})
    observer = Observer(comfy, package)
    obs = {"init_s": round(time.time() - t0, 2), "links": {}, "encode": {}}

    # Before any pipeline exists, so that any weight access would be the refused value's.
    values = dict(LINK_VALUES, absolute=str(Path(package).resolve()))
    for source in ("PrimitiveString", "AnyString"):
        for name, value in values.items():
            before = (observer.safe_opens, observer.file_opens)
            rec = _run(comfy, observer, link_graph(source, value))
            rec["safe_opens"] = observer.safe_opens - before[0]
            rec["file_opens"] = observer.file_opens - before[1]
            rec["value"] = value
            obs["links"][f"{source}:{name}"] = rec
    before = (observer.safe_opens, observer.file_opens)
    rec = _run(comfy, observer, link_graph("AnyString", MODEL), save_ids=("4",))
    rec.update(safe_opens=observer.safe_opens - before[0], file_opens=observer.file_opens - before[1], value=MODEL)
    obs["links"]["AnyString:listed"] = rec

    outside = (base / "outside.json").resolve()
    outside.write_text(json.dumps({"caption": {"scene": OUTSIDE_CAPTION}, "duration": 1}))
    (base / "input" / "listed.json").write_text(json.dumps({"caption": {"scene": "a listed kite"}, "duration": 1}))
    outside_opens = []
    sys.addaudithook(lambda event, args: outside_opens.append(1) if event == "open" and isinstance(args[0], str)
                     and os.path.realpath(args[0]) == str(outside) else None)
    obs["prompt_links"] = {}
    for name, value in dict(PROMPT_LINK_VALUES, absolute=str(outside)).items():
        before = len(outside_opens)
        rec = _run(comfy, observer, prompt_link_graph(value))
        rec.update(value=value, outside_opens=len(outside_opens) - before)
        obs["prompt_links"][name] = rec

    for mode in MODES:
        obs["encode"][mode] = {
            "a": _run(comfy, observer, graph_a(mode, f"{mode}_a"), save_ids=("6", "7")),
            "b": _run(comfy, observer, graph_b(mode, f"{mode}_b"), save_ids=("5", "6")),
        }
    obs["total_s"] = round(time.time() - t0, 2)
    Path(out_path).write_text(json.dumps(obs, indent=1, default=str))


if __name__ == "__main__":
    from support.child_runs import prepare

    prepare()
    main(*sys.argv[1:4])
