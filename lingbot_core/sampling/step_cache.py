"""Step cache: skip the DiT's whole block stack on "easy" steps and reuse its last residual.

The rule is EasyCache's (Zhou et al. 2025, "Less is Enough: Training-Free Video Diffusion Acceleration
via Runtime-Adaptive Caching"), which needs no per-model calibration. Per CFG branch, in token space
(the block stack's input ``x`` and output ``y``, text tokens included):

- on a computed step, the transformation rate ``k = mean|y - y_prev| / mean|x - x_prev|`` is learned
  from this and the previous computed step, and the residual ``y - x`` is kept;
- on a later step, ``k * mean|x - x_last| / mean|y_prev|`` is added to an accumulator (``x_last`` is
  the previous step's input); while the sum stays below the threshold the block stack is skipped and
  ``y = x + residual``; once it reaches the threshold the step is computed and the sum restarts at 0;
- the first ``warmup`` fraction of the steps (20 %: EasyCache computes 10 of 50) and the last step are
  always computed.

Each branch has its own state (cond and uncond see different inputs). Threshold 0 means off. Published
figures (Wan 2.1 1.3B, 480p x 81 frames, 50 steps): 2.54x at PSNR 25.24 with EasyCache's default 0.05;
about 2x at 0.1 and 3x at 0.2 (docs/speed.md in the shared facts; quality is not judged on the pack's
random-weight fixtures). Few-step (distilled) schedules have no easy steps to skip: below
``MIN_STEPS`` steps the cache warns.

Why not diffusers' cache hooks (FirstBlockCache, MagCache...) or cache-dit: both wrap each block's
forward and expect it to take and return ``hidden_states``; here a block takes a list of CFG branches
in one call (lockstep), so a per-branch decision cannot be made inside a block hook.

Memory: up to three token-sized tensors per branch on the execution device (last computed input,
residual, last input): about 0.6 GB per branch at 480 x 832 x 121 in bf16.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import numpy as np
import torch

logger = logging.getLogger("lingbot_core")

WARMUP_FRACTION = 0.2
MIN_STEPS = 10
MAX_THRESHOLD = 1.0


def check_step_cache(threshold) -> float:
    value = float(threshold)
    if isinstance(threshold, bool) or not np.isfinite(value) or not 0.0 <= value <= MAX_THRESHOLD:
        raise ValueError(f"step_cache={threshold!r} is not allowed: use a threshold from 0 (off) to {MAX_THRESHOLD} "
                         "(EasyCache's default 0.05; about 0.1 = 2x, 0.2 = 3x fewer block-stack runs).")
    return value


def _mean_abs(t: torch.Tensor) -> float:
    return t.float().abs().mean().item()


class BranchCache:
    """One CFG branch's state; the transformer asks it per step (see the module docstring)."""

    def __init__(self, run: "StepCache"):
        self.run = run
        self.k: Optional[float] = None
        self.computed_input: Optional[torch.Tensor] = None
        self.residual: Optional[torch.Tensor] = None
        self.output_scale = 0.0  # mean|y| of the last computed step
        self.last_input: Optional[torch.Tensor] = None
        self.accumulated = 0.0

    def should_compute(self, x: torch.Tensor) -> bool:
        run = self.run
        if run.forced() or self.k is None or self.residual is None or self.residual.shape != x.shape:
            return True
        self.accumulated += self.k * _mean_abs(x - self.last_input) / max(self.output_scale, 1e-12)
        if self.accumulated < run.threshold:
            self.last_input = x
            return False
        return True

    def store(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A computed step: learn k, keep the residual; returns ``y`` unchanged."""
        if self.computed_input is not None and self.computed_input.shape == x.shape:
            d_in = _mean_abs(x - self.computed_input)
            d_out = _mean_abs(y - (self.computed_input + self.residual))
            self.k = d_out / d_in if d_in > 0 else None
        self.computed_input = self.last_input = x
        self.residual = y - x
        self.output_scale = _mean_abs(y)
        self.accumulated = 0.0
        self.run.computed += 1
        return y

    def reuse(self, x: torch.Tensor) -> torch.Tensor:
        self.run.skipped += 1
        return x + self.residual


class StepCache:
    """The cache of one sampling run: one :class:`BranchCache` per CFG branch, and the counts."""

    def __init__(self, threshold: float, steps: int, branches: int):
        self.threshold = check_step_cache(threshold)
        self.steps = steps
        self.warmup = max(1, math.ceil(WARMUP_FRACTION * steps))
        self.step = 0
        self.computed = 0
        self.skipped = 0
        self.branches = [BranchCache(self) for _ in range(branches)]

    def begin_step(self, index: int, total: int) -> None:
        self.step, self.steps = index, total
        self.warmup = max(1, math.ceil(WARMUP_FRACTION * total))

    def forced(self) -> bool:
        return self.step < self.warmup or self.step >= self.steps - 1

    def summary(self) -> str:
        total = self.computed + self.skipped
        return (f"step cache {self.threshold:g}: {self.computed} of {total} DiT forwards computed, "
                f"{self.skipped} skipped")


def make_step_cache(threshold, steps: int, branches: int) -> Optional[StepCache]:
    """A run's cache, or None when ``threshold`` is 0 (off). Warns for few-step schedules."""
    threshold = check_step_cache(threshold)
    if threshold == 0.0:
        return None
    if steps < MIN_STEPS:
        logger.warning("step_cache=%g with %d steps: caching is meant for %d+ steps; few-step or distilled "
                       "schedules lose quality with it (the first %d%% and the last step are always computed).",
                       threshold, steps, MIN_STEPS, int(WARMUP_FRACTION * 100))
    logger.info("step cache on: threshold %g, %d CFG branch(es), first %d of %d steps always computed.",
                threshold, branches, max(1, math.ceil(WARMUP_FRACTION * steps)), steps)
    return StepCache(threshold, steps, branches)
