"""Video in, the same video out (issue 39), measured on the tiny packages (CPU): frame counts in and out of
video-to-video and Refine with and without context windows, the steps a ``denoise`` runs, and the latency of a
cancel in a windowed run (from the request, made as window 1 of step 1 starts: the worst case, to the run's
return; without offload ``block`` it waits for that window, under ``block`` for one streamed block).

``python -m bench.every_frame [--lengths 17 20 121 300] [--json out.json]``. Tiny random weights at 64x96 /
64x128: the counts and step numbers are the real rules; the latency is the tiny DiT's (a real window takes
seconds to minutes: the cancel waits for the one window running).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time

import torch

from lingbot_core import load_pipeline
from lingbot_core.sampling.scheduling import sampler_sigmas
from lingbot_core.testing.fixtures import write_package


class Cancelled(Exception):
    pass


def _video(frames: int) -> torch.Tensor:
    return torch.rand(frames, 48, 80, 3, generator=torch.Generator().manual_seed(frames))


def frame_counts(dense, refiner, lengths) -> list:
    rows = []
    for n in lengths:
        for windows in (False, True):
            ctx = dict(context_frames=9, context_overlap=4) if windows else dict(context_frames=0)
            v2v = dense.generate("a cat", video=_video(n), denoise=0.5, steps=1, height=64, width=96, guidance_scale=1.0, **ctx)
            ref = refiner.refine(_video(n), "a cat", height=64, width=128, steps=1, tail_steps=0, guidance_scale=1.0,
                                 vae_tiling=False, **ctx)
            rows.append({"frames_in": n, "windows": windows, "v2v_out": int(v2v.shape[0]), "refine_out": int(ref.shape[0])})
            print(f"{n:4d} frames in, windows {'9/4' if windows else 'off'}: V2V {v2v.shape[0]:4d} out, Refine {ref.shape[0]:4d} out")
    return rows


def steps_run(steps: int = 20) -> list:
    rows = []
    for denoise in (0.3, 0.5, 0.9, 1.0):
        sig = sampler_sigmas("unipc", steps, 3.0, None, denoise)
        rows.append({"denoise": denoise, "steps": len(sig), "first_sigma": float(sig[0])})
        print(f"steps {steps}, denoise {denoise}: {len(sig)} steps from sigma {sig[0]:.4f}")
    return rows


def cancel_latency(dense, repeats: int = 5) -> dict:
    out = {}
    for offload in ("none", "block"):
        dense.set_offload(offload, blocks_on_gpu=0) if offload == "block" else dense.set_offload(offload)
        latencies, window_s = [], []
        for _ in range(repeats):
            state = {"t": None, "calls": 0}

            def starts(module, args, state=state):  # the worst case: cancel pressed as window 1 starts
                state["calls"] += 1
                if state["t"] is None:
                    state["t"] = time.perf_counter()

            def interrupt(state=state):
                if state["t"] is not None:
                    raise Cancelled()

            def callback(i, total, x0):
                interrupt()

            callback.interrupt = interrupt
            handle = dense.transformer.register_forward_pre_hook(starts)
            try:
                dense.generate("a cat", num_frames=121, steps=4, height=64, width=96, context_frames=33,
                               context_overlap=8, callback=callback, output_type="latent")
            except Cancelled:
                latencies.append(time.perf_counter() - state["t"])
            finally:
                handle.remove()
            assert state["calls"] == 1, state
        # one uncancelled windowed step, for scale
        t0 = time.perf_counter()
        dense.generate("a cat", num_frames=121, steps=1, height=64, width=96, context_frames=33, context_overlap=8,
                       output_type="latent")
        window_s.append(time.perf_counter() - t0)
        out[offload] = {"cancel_latency_ms": sorted(1000 * x for x in latencies), "one_step_run_s": window_s[0]}
        print(f"cancel latency ({offload}): {', '.join(f'{1000 * x:.1f}' for x in sorted(latencies))} ms "
              f"(a whole uncancelled 1-step run of 5 windows: {window_s[0] * 1000:.0f} ms)")
    dense.set_offload("none")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.every_frame")
    parser.add_argument("--lengths", type=int, nargs="+", default=[17, 20, 121, 300])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        dense = load_pipeline(write_package(f"{tmp}/dense", fp32=True), device="cpu")
        refiner = load_pipeline(write_package(f"{tmp}/moe", moe=True, fp32=True), device="cpu", transformer_subfolder="refiner")
        report = {"frame_counts": frame_counts(dense, refiner, args.lengths), "steps": steps_run(),
                  "cancel": cancel_latency(dense)}
        dense.release()
        refiner.release()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
