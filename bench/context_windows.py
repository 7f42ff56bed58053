"""Context windows, measured (issue 34): a long refine in windows against one pass, on the tiny refiner (CPU).

    python -m bench.context_windows                   # the three runs below, each in a fresh subprocess
    python -m bench.context_windows --json /tmp/cw.json

Runs (``refine`` on the tiny MoE fixture package's refiner, ``--height`` x ``--width``, 3 steps, guidance 3
with lockstep CFG, offload ``block`` with ``blocks_on_gpu`` 0):

- ``short_1_window``: a 9-frame video (3 latent frames), one window;
- ``long_4_windows``: a 33-frame video (9 latent frames) with ``context_frames`` 9, ``context_overlap`` 4
  (windows of 3 latent frames sharing 1: 4 windows);
- ``long_no_windows``: the same 33 frames in one pass (``context_frames`` 0).

Per run: peak RSS of the process during the denoise steps (sampled every 2 ms from ``/proc/self/statm``)
and over the whole run (``ru_maxrss``), the DiT forwards per step, the bytes the ``block`` ring copied to
the device per step and the mean step time. On a CPU the device is the tests' fake ``cuda:3``
(``tests/support/fake_accelerator.py``, recorded streams of ``tests/support/fake_streams.py``): the ring, its staging
thread and its copies run for real into host buffers, so the byte counts are those a GPU would get.
The tiny DiT (hidden 64) is far from the real one: times and RSS say how the cost scales with windows,
not what a GPU takes.
"""

from __future__ import annotations

import os

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                     ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error")):
    os.environ.setdefault(_key, _value)

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {
    "short_1_window": dict(frames=9, context_frames=0, context_overlap=0),
    "long_4_windows": dict(frames=33, context_frames=9, context_overlap=4),
    "long_no_windows": dict(frames=33, context_frames=0, context_overlap=0),
}
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1024 * 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.active, self.peak, self.stop = False, 0, False

    def run(self):
        while not self.stop:
            if self.active:
                self.peak = max(self.peak, _rss())
            time.sleep(0.002)


def run_one(package: str, name: str, height: int, width: int, steps: int) -> dict:
    import torch

    for p in (str(REPO), str(REPO / "tests")):
        if p not in sys.path:
            sys.path.insert(0, p)
    from support.fake_accelerator import fake_accelerator
    from support.fake_streams import RecordingStreams
    from lingbot_core import load_pipeline

    torch.set_num_threads(1)
    cfg = RUNS[name]
    video = torch.rand(cfg["frames"], height, width, 3, generator=torch.Generator().manual_seed(0))
    pipe = load_pipeline(package, transformer_subfolder="refiner", offload="block", blocks_on_gpu=0, device="cpu")
    sampler = _Sampler()
    sampler.start()
    marks = []
    with fake_accelerator(pipe):
        streamer = pipe.transformer._hf_hook
        streamer.streams = RecordingStreams()
        ring = streamer.ring
        forwards = []
        pipe.transformer.register_forward_pre_hook(lambda *_: forwards.append(1))

        def callback(i, total, x0):
            marks.append((time.perf_counter(), ring.stats["bytes"], len(forwards)))

        start = [time.perf_counter(), ring.stats["bytes"], 0]
        orig_denoise = pipe.denoise

        def denoise(*args, **kwargs):  # the denoise stage: start the RSS sampling and the clocks here
            start[:] = [time.perf_counter(), ring.stats["bytes"], len(forwards)]
            sampler.active = True
            try:
                return orig_denoise(*args, **kwargs)
            finally:
                sampler.active = False

        pipe.denoise = denoise
        frames = pipe.refine(video, "a cat", height=height, width=width, steps=steps, tail_steps=0,
                             context_frames=cfg["context_frames"], context_overlap=cfg["context_overlap"],
                             callback=callback)
    sampler.stop = True
    points = [tuple(start)] + marks
    step_s = [b[0] - a[0] for a, b in zip(points, points[1:])]
    step_bytes = [b[1] - a[1] for a, b in zip(points, points[1:])]
    step_forwards = [b[2] - a[2] for a, b in zip(points, points[1:])]
    block_bytes = sum(t.numel() * t.element_size() for t in list(pipe.transformer.blocks[0].parameters()))
    result = {
        "run": name, **cfg, "size": [height, width], "steps": len(step_s), "frames_out": int(frames.shape[0]),
        "dit_forwards_per_step": step_forwards, "ring_bytes_per_step": step_bytes, "block_bytes": block_bytes,
        "mean_step_s": round(sum(step_s) / len(step_s), 4), "first_step_s": round(step_s[0], 4),
        "denoise_peak_rss_mib": round(sampler.peak / MIB, 1),
        "run_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    pipe.release()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.context_windows", description=__doc__.split("\n\n")[0])
    ap.add_argument("--height", type=int, default=128)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--package", help=argparse.SUPPRESS)
    ap.add_argument("--run", choices=sorted(RUNS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run:  # the child: one run, its JSON on stdout's last line
        print(json.dumps(run_one(args.package, args.run, args.height, args.width, args.steps)))
        return 0
    sys.path.insert(0, str(REPO))
    from lingbot_core.testing.fixtures import write_package

    with tempfile.TemporaryDirectory(prefix="lingbot-cw-") as tmp:
        package = write_package(Path(tmp) / "lingbot-tiny-moe", moe=True, fp32=True, seed=1)
        results = []
        for name in RUNS:
            out = subprocess.run([sys.executable, "-m", "bench.context_windows", "--package", str(package), "--run", name,
                                  "--height", str(args.height), "--width", str(args.width), "--steps", str(args.steps)],
                                 cwd=REPO, capture_output=True, text=True, check=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    by = {r["run"]: r for r in results}
    w4, one, whole = by["long_4_windows"], by["short_1_window"], by["long_no_windows"]
    summary = {
        "bytes_per_step_ratio_4w_vs_1w": round(sum(w4["ring_bytes_per_step"]) / max(1, sum(one["ring_bytes_per_step"])), 2),
        "step_time_ratio_4w_vs_1w": round(w4["mean_step_s"] / one["mean_step_s"], 2),
        "step_time_ratio_4w_vs_one_pass": round(w4["mean_step_s"] / whole["mean_step_s"], 2),
        "denoise_peak_rss_mib": {r["run"]: r["denoise_peak_rss_mib"] for r in results},
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
