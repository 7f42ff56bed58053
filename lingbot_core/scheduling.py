"""Sigma grids, integer timesteps, the UniPC-bh2 solver used by LingBot-Video, and flow Euler (for
distilled students trained on a fixed sigma list).

The reference uses Wan 2.1's FlowUniPC scheduler. Its solver is the same as diffusers'
``UniPCMultistepScheduler`` in flow-prediction mode; only the sigma grid differs. We therefore build
the reference grid here and hand it to diffusers' scheduler as an explicit sigma list (with
``flow_shift=1.0`` so the shift is not applied twice).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler

SIGMA_MAX = float(np.float32(0.999))  # 0.9990000128746033, the reference's fp32 sigma_max
SIGMA_MIN = 0.0


def shifted_sigmas(steps: int, shift: float) -> np.ndarray:
    """The ``steps`` shifted sigmas of the FlowUniPC grid (float64, no trailing zero)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}.")
    if not np.isfinite(shift) or shift <= 0:
        raise ValueError(f"shift must be a positive finite number, got {shift}.")
    base = np.linspace(SIGMA_MAX, SIGMA_MIN, steps + 1)[:-1]
    return shift * base / (1 + (shift - 1) * base)


def timesteps_from_sigmas(sigmas: np.ndarray) -> np.ndarray:
    """Integer timesteps as the reference computes them: ``int64(sigma * 1000)`` (truncation), in the
    sigmas' own precision (float64 for the base grid, float32 for the refiner's explicit list)."""
    sigmas = np.asarray(sigmas)
    return (sigmas * sigmas.dtype.type(1000)).astype(np.int64)


def refiner_sigmas(steps: int, shift: float, t_thresh: float, tail_steps: int) -> np.ndarray:
    """The refiner's schedule: the normal grid cut at ``t_thresh``, started at it, plus tail points.

    Returned as float32, as the reference hands it to the scheduler (whose timesteps are then
    computed in float32: t_thresh 0.9 -> 900, where float64 arithmetic would give 899).
    """
    if not (0.0 < t_thresh <= 1.0) or not np.isfinite(t_thresh):
        raise ValueError(f"t_thresh must be in (0, 1], got {t_thresh}.")
    if tail_steps < 0:
        raise ValueError(f"tail_steps must be >= 0, got {tail_steps}.")
    grid = shifted_sigmas(steps, shift)
    kept = grid[grid <= t_thresh + 1e-6]
    if len(kept) == 0 or abs(kept[0] - t_thresh) > 1e-6:
        kept = np.concatenate([[t_thresh], kept])
    if tail_steps:
        last = kept[-1]
        tail = np.linspace(last, min(SIGMA_MIN, last), tail_steps + 2)[1:-1]
        kept = np.concatenate([kept, tail])
    if (
        len(kept) == 0 or not np.all(np.isfinite(kept)) or kept.min() < 0 or kept.max() > 1
        or np.any(np.diff(kept) >= 0) or abs(kept[0] - t_thresh) > 1e-6
    ):
        raise ValueError(f"invalid refiner sigma schedule {kept.tolist()} (steps={steps}, t_thresh={t_thresh}).")
    return kept.astype(np.float32)


def model_timestep(t_int: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The timestep value fed to the DiT, as the reference computes it for a DiT of ``dtype``.

    ``t / 1000`` is cast to the DiT dtype and multiplied by 1000 *in that dtype*, so a bf16/fp16 DiT
    sees a value rounded twice (999 -> 1000, 991 -> 992). For fp32 this is the integer itself.
    """
    sigma = (t_int.to(torch.float32) / 1000).to(dtype)
    return (sigma * 1000).float()


def load_scheduler_config(path: Optional[str]) -> dict:
    """Read ``scheduler_config.json`` and check it describes the solver we implement."""
    cfg = {}
    if path and os.path.isfile(path):
        with open(path, "r", encoding="utf-8") as f:
            cfg = json.load(f)
    expected = {"prediction_type": "flow_prediction", "solver_type": "bh2", "predict_x0": True}
    for key, want in expected.items():
        if key in cfg and cfg[key] != want:
            raise ValueError(f"scheduler/scheduler_config.json: {key}={cfg[key]!r} is not supported (expected {want!r}).")
    return cfg


def make_scheduler(sigmas: np.ndarray, config: Optional[dict] = None) -> UniPCMultistepScheduler:
    """A fresh diffusers UniPC-bh2 scheduler stepping exactly through ``sigmas`` (then 0).

    Integer timesteps are ``int64(sigma * 1000)`` computed in the array's own precision (float64 base
    grid, float32 refiner list), solver sigmas are stored as float32: both as the reference.
    ``config`` is the package's scheduler config; its ``shift`` is ignored on purpose: the shift is
    already inside ``sigmas`` (the reference passes it at ``set_timesteps`` time).
    """
    config = config or {}
    scheduler = UniPCMultistepScheduler(
        num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
        solver_order=int(config.get("solver_order", 2)),
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=1.0,
        predict_x0=True,
        solver_type="bh2",
        lower_order_final=bool(config.get("lower_order_final", True)),
        disable_corrector=list(config.get("disable_corrector", [])),
        final_sigmas_type="zero",
    )
    sigmas = np.asarray(sigmas)
    if sigmas.dtype not in (np.float32, np.float64):
        sigmas = sigmas.astype(np.float64)
    scheduler.set_timesteps(sigmas=sigmas.copy())
    # Two equal leading integer timesteps (e.g. refiner t_thresh 0.8479 next to grid point 0.847457)
    # would make diffusers start at the second one; the loop always starts at index 0.
    scheduler.set_begin_index(0)
    return scheduler


SAMPLERS = ("unipc", "euler")


def check_sampler(sampler: str) -> str:
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r} is not allowed: use 'unipc' (the reference solver) or 'euler' (flow Euler, for distilled models).")
    return sampler


def check_sigmas(sigmas) -> np.ndarray:
    """An explicit sigma list (float64): finite, in (0, 1], strictly decreasing, ending above 0 (the
    final 0 is appended by the solver)."""
    try:
        arr = np.asarray([float(s) for s in sigmas], dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"sigmas must be a list of numbers, got {sigmas!r}.") from None
    if arr.ndim != 1 or len(arr) == 0 or len(arr) > 1000:
        raise ValueError(f"sigmas must list 1 to 1000 values, got {len(arr)}.")
    if not np.all(np.isfinite(arr)) or arr.max() > 1.0 or arr.min() <= 0.0 or np.any(np.diff(arr) >= 0):
        raise ValueError(
            f"sigmas {arr.tolist()} are not allowed: use a strictly decreasing list in (0, 1] that ends above 0 "
            "(the final 0 is added), e.g. 1.0, 0.9, 0.75, 0.5."
        )
    return arr


def parse_sigmas(text: str) -> Optional[np.ndarray]:
    """``"1.0, 0.9, 0.75, 0.5"`` (commas or spaces) -> checked sigmas; empty text -> None."""
    parts = text.replace(",", " ").split()
    if not parts:
        return None
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"sigmas {text!r} are not numbers; write them like 1.0, 0.9, 0.75, 0.5.") from None
    return check_sigmas(values)


class _Step:
    def __init__(self, prev_sample: torch.Tensor):
        self.prev_sample = prev_sample


class FlowEulerScheduler:
    """Flow Euler over ``sigmas`` then 0: ``x <- x + (sigma_next - sigma) * v``, in fp32.

    The scheduler interface the sampling loop uses (``timesteps``, ``sigmas``, ``step``). The DiT gets
    ``sigma * 1000`` unrounded (a student trained on a fixed list sees its own values, e.g. 1000, 900,
    750, 500 for lightx2v_train's 1.0, 0.9, 0.75, 0.5), rounded for its dtype as every timestep is.
    """

    def __init__(self, sigmas: np.ndarray):
        sig = np.asarray(sigmas, dtype=np.float64)
        self.timesteps = torch.from_numpy(sig * 1000).to(torch.float32)
        self.sigmas = torch.from_numpy(np.append(sig, 0.0)).to(torch.float32)
        self._index = 0

    def step(self, velocity: torch.Tensor, timestep, sample: torch.Tensor) -> _Step:
        i = self._index
        dt = self.sigmas[i + 1] - self.sigmas[i]
        self._index += 1
        return _Step(sample.float() + dt.to(sample.device) * velocity.float())


def make_sampler(sampler: str, sigmas: np.ndarray, config: Optional[dict] = None):
    """The solver stepping through ``sigmas`` (then 0): UniPC-bh2 (reference) or flow Euler."""
    if check_sampler(sampler) == "euler":
        return FlowEulerScheduler(sigmas)
    return make_scheduler(sigmas, config)
