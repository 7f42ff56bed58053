"""Continuing a clip, measured (issue 50): the seam and colour drift of ``pipe.extend`` on the tiny dense package (CPU).

    python -m bench.extend_seam                 # the tables below
    python -m bench.extend_seam --json /tmp/seam.json --seeds 3 --steps 4

Seam: frame-to-frame mean absolute difference (pixels in [0, 1]) across the seam (the input's last frame -> the first
new frame) against the mean of the same difference between consecutive frames within the new part, and within the
input, for ``keep_frames`` 1, 5 and 9 (``new_frames`` 16), averaged over seeds. Two inputs: ``synthetic`` (a random
texture sliding 3 px right per frame: steady, known motion) and ``generated`` (a text-to-video clip of the same
model, so the input is something the model itself makes).

Drift: mean colour (RGB, [0, 1]) per part over 3 chained extends of the synthetic input (part 0 = the input), with
``color_match`` off and mean-std, and the largest distance (L1 over the channels) of a part's mean from the input's.

The tiny package has random weights: its frames are structured noise, not a scene, so the seam ratio says how far its
output is from the input, not how well a real model continues motion. The numbers check the mechanics (what is
pinned, what is matched); the real model's seam needs a GPU run with the released weights.
"""

from __future__ import annotations

import os

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                     ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error")):
    os.environ.setdefault(_key, _value)

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

H, W, INPUT_FRAMES, NEW = 64, 96, 17, 16
PROMPT = "a red kite over green hills at sunset, the camera pans right"


def synthetic_clip(frames: int = INPUT_FRAMES) -> torch.Tensor:
    rng = np.random.default_rng(7)
    base = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
    # smooth the texture a little so a 3 px shift is a small change, as real motion is
    base = (base.astype(np.float32) + np.roll(base, 1, 0) + np.roll(base, 1, 1) + np.roll(base, 1, (0, 1))) / 4
    return torch.from_numpy(np.stack([np.roll(base, 3 * i, axis=1) for i in range(frames)]) / 255.0).float()


def step_diffs(frames: torch.Tensor) -> torch.Tensor:
    return (frames[1:] - frames[:-1]).abs().mean(dim=(1, 2, 3))


def seam(video: torch.Tensor, out: torch.Tensor) -> dict:
    t = video.shape[0]
    d = step_diffs(out)
    return {"seam": float(d[t - 1]), "within_new": float(d[t:].mean()), "within_input": float(d[: t - 1].mean())}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from lingbot_core import load_pipeline
    from lingbot_core.testing.fixtures import write_package

    torch.set_num_threads(2)
    results = {"seam": {}, "drift": {}}
    with tempfile.TemporaryDirectory(prefix="lingbot-seam-") as tmp:
        pipe = load_pipeline(write_package(Path(tmp) / "dense", fp32=True), device="cpu")
        inputs = {"synthetic": synthetic_clip(),
                  "generated": pipe.generate(PROMPT, height=H, width=W, num_frames=INPUT_FRAMES, steps=args.steps, seed=100,
                                             output_type="pt")}
        for name, video in inputs.items():
            for keep in (1, 5, 9):
                runs = [seam(video, pipe.extend(video, PROMPT, new_frames=NEW, keep_frames=keep, steps=args.steps, seed=s,
                                                output_type="pt")) for s in range(args.seeds)]
                row = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
                row["ratio"] = row["seam"] / row["within_new"]
                results["seam"][f"{name} keep {keep}"] = row
                print(f"{name:9s} keep {keep}: seam {row['seam']:.4f}  within new {row['within_new']:.4f}  "
                      f"within input {row['within_input']:.4f}  seam/within new {row['ratio']:.2f}", flush=True)
        video = inputs["synthetic"]
        for mode in ("off", "mean-std"):
            out, parts = video, [video]
            for part in range(3):
                out = pipe.extend(out, PROMPT, new_frames=NEW, keep_frames=5, steps=args.steps, seed=part, color_match=mode,
                                  output_type="pt")
                parts.append(out[-NEW:])
            means = [p.reshape(-1, 3).mean(0) for p in parts]
            drift = max(float((m - means[0]).abs().sum()) for m in means[1:])
            results["drift"][mode] = {"part_means": [[round(float(v), 4) for v in m] for m in means], "max_l1_from_input": drift}
            print(f"drift color_match {mode:8s}: part means {results['drift'][mode]['part_means']}  "
                  f"max L1 from the input {drift:.4f}", flush=True)
        pipe.release()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
