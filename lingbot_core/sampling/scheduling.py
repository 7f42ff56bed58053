"""Sigma grids, integer timesteps, the UniPC-bh2 solver used by LingBot-Video, flow Euler (for
distilled students trained on a fixed sigma list) and the DMD student's own few-step sampler.

The reference uses Wan 2.1's FlowUniPC scheduler. Its solver is the same as diffusers'
``UniPCMultistepScheduler`` in flow-prediction mode; only the sigma grid differs. We therefore build
the reference grid here and hand it to diffusers' scheduler as an explicit sigma list (with
``flow_shift=1.0`` so the shift is not applied twice).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

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


def cut_sigmas(grid: np.ndarray, start: float) -> np.ndarray:
    """An SDEdit start: the grid's sigmas at or below ``start`` (within 1e-6), with ``start`` itself
    prepended unless the first kept value is within 1e-6 of it (the refiner's ``t_thresh`` rule)."""
    grid = np.asarray(grid, dtype=np.float64)
    kept = grid[grid <= start + 1e-6]
    if len(kept) == 0 or abs(kept[0] - start) > 1e-6:
        kept = np.concatenate([[start], kept])
    return kept


MAX_DENOISE_GRID = 100_000  # steps of the full grid a low denoise samples the tail of


def denoise_grid_steps(steps: int, denoise: float) -> int:
    """The length of the full grid whose last ``steps`` a video-to-video run samples: ``int(steps /
    denoise)`` (ComfyUI KSampler's rule), ``steps`` itself at ``denoise`` 1."""
    if not np.isfinite(denoise) or not 0.0 < denoise <= 1.0:
        raise ValueError(f"denoise={denoise} must be in (0, 1] (1.0 is plain text-to-video).")
    total = max(int(steps), int(steps / denoise))
    if total > MAX_DENOISE_GRID:
        raise ValueError(f"denoise={denoise} with steps={steps} would sample the tail of a {total:,}-step grid; use "
                         f"denoise >= {steps / MAX_DENOISE_GRID:.2g} (or fewer steps).")
    return total


def denoise_sigmas(grid_of: Callable[[int], np.ndarray], steps: int, denoise: float) -> np.ndarray:
    """A video-to-video schedule: ``steps`` sigmas, the last ``steps`` of the ``int(steps / denoise)``-step
    grid ``grid_of(n)`` (the run's own grid rule: FlowUniPC or the DMD student's), in that grid's precision.

    This is ComfyUI KSampler's ``denoise``: ``steps`` steps run whatever the strength, on the points a full
    run of that length visits, and ``denoise`` is the fraction of that run that is sampled (so with shift 3,
    denoise 0.5 starts at sigma ~0.75). ``denoise`` 1 is ``grid_of(steps)`` itself. The latent is re-noised to
    the first value."""
    total = denoise_grid_steps(steps, denoise)
    kept = np.asarray(grid_of(total))[total - steps:]
    if len(kept) != steps or not np.all(np.isfinite(kept)) or kept.min() <= 0 or np.any(np.diff(kept) >= 0):
        raise ValueError(f"invalid video-to-video sigma schedule {kept.tolist()} (steps={steps}, denoise={denoise}).")
    return kept


def refiner_sigmas(steps: int, shift: float, t_thresh: float, tail_steps: int) -> np.ndarray:
    """The refiner's schedule: the normal grid cut at ``t_thresh``, started at it, plus tail points.

    Returned as float32, as the reference hands it to the scheduler (whose timesteps are then
    computed in float32: t_thresh 0.9 -> 900, where float64 arithmetic would give 899).
    """
    if not (0.0 < t_thresh <= 1.0) or not np.isfinite(t_thresh):
        raise ValueError(f"t_thresh must be in (0, 1], got {t_thresh}.")
    if tail_steps < 0:
        raise ValueError(f"tail_steps must be >= 0, got {tail_steps}.")
    kept = cut_sigmas(shifted_sigmas(steps, shift), t_thresh)
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


# "auto" is the package's own sampler (LingbotPipeline.own_sampler): dmd_student for a DMD-distilled
# student, unipc for every other package and for the refiner.
SAMPLERS = ("auto", "unipc", "euler", "dmd_student")


def check_sampler(sampler: str) -> str:
    if sampler not in SAMPLERS:
        raise ValueError(
            f"sampler={sampler!r} is not allowed: use 'auto' (the package's own sampler), 'unipc' (the reference "
            "solver), 'euler' (flow Euler, for distilled models) or 'dmd_student' (the DMD-distilled MoE student's sampler)."
        )
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


# -- the DMD student ------------------------------------------------------------------------------

DMD_SCHEDULER_CLASS = "DMDStudentScheduler"  # the reference's class, named in a DMD package's scheduler config
DMD_THRESHOLD = 0.5  # ancestral steps while the warped sigma is at least this
DMD_ETA = 1.0  # DDIM eta of the ancestral steps (1 = full ancestral)
TRAIN_TIMESTEPS = 1000


def dmd_sigmas(steps: int, shift: float) -> np.ndarray:
    """The DMD student's grid (float64, no trailing zero): the flow-sigma grid of diffusers' UniPC.

    ``linspace(1, 1/1000)`` warped by ``shift``, its first value pulled 1e-6 below 1. It is not the
    FlowUniPC grid of :func:`shifted_sigmas` (which starts from 0.999): for 8 steps shift 3 its 7th
    sigma is 0.500999 (an ancestral step) where that grid has 0.499667.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}.")
    if not np.isfinite(shift) or shift <= 0:
        raise ValueError(f"shift must be a positive finite number, got {shift}.")
    base = np.linspace(1.0, 1.0 / TRAIN_TIMESTEPS, steps + 1)[:-1]
    grid = shift * base / (1 + (shift - 1) * base)
    if abs(grid[0] - 1.0) < 1e-6:
        grid[0] -= 1e-6  # diffusers' guard: the first DiT timestep is 999 (in the trained range), not 1000
    return grid


def ddim_ancestral_std(sigma: torch.Tensor, sigma_next: torch.Tensor, eta: float) -> torch.Tensor:
    """The fresh-noise std of a DDIM eta-ancestral step from ``sigma`` to ``sigma_next``, in flow units.

    A flow point ``(1 - s) x0 + s eps`` is the variance-preserving point with ``alpha = (1 - s) / r``,
    ``beta = s / r`` scaled by ``r = sqrt((1 - s)^2 + s^2)``. DDIM's std there is
    ``eta * (beta' / beta) * sqrt(1 - (alpha / alpha')^2)``; times ``r'`` it is in flow units. It is capped
    at ``sigma_next``: the step keeps ``sqrt(sigma_next^2 - std^2)`` of the predicted noise, which must
    stay real (eta > 1 would exceed it; at eta 1 rounding alone could).
    """
    r = torch.sqrt((1 - sigma) ** 2 + sigma ** 2)
    r_next = torch.sqrt((1 - sigma_next) ** 2 + sigma_next ** 2)
    alpha_ratio = ((1 - sigma) / r) / ((1 - sigma_next) / r_next)
    std = eta * ((sigma_next / r_next) / (sigma / r)) * torch.sqrt((1 - alpha_ratio ** 2).clamp(min=0)) * r_next
    return torch.minimum(std, sigma_next)


class DMDStudentSampler:
    """The DMD-distilled student's sampler: DDIM eta-ancestral steps while sigma >= ``threshold``, then
    Euler to 0 (the geometry it was distilled on; docs/en/dmd_student_sampling.md of the reference).

    An ancestral step splits the state into the predicted clean latent ``x0 = x - s v`` and noise
    ``x1 = x + (1 - s) v`` (flow prediction ``v = eps - x0``) and lands on
    ``(1 - s') x0 + sqrt(s'^2 - std^2) x1 + std z``, with ``z`` one fresh ``randn`` of the latent's shape
    from ``generator`` (the run's CPU generator, so a seed gives one video on every device). The gate
    compares the fp32 (warped) sigma. All step math is fp32. The DiT gets the truncated integer timesteps.
    """

    def __init__(self, sigmas: np.ndarray, generator: Optional[torch.Generator], *,
                 threshold: float = DMD_THRESHOLD, eta: float = DMD_ETA):
        if generator is None:
            raise ValueError("sampler='dmd_student' draws fresh noise on its ancestral steps: pass the run's generator.")
        sig = np.asarray(sigmas, dtype=np.float64)
        self.generator = generator
        self.timesteps = torch.from_numpy(timesteps_from_sigmas(sig))
        self.sigmas = torch.from_numpy(np.append(sig, 0.0).astype(np.float32))
        self.stochastic = self.sigmas[:-1] >= threshold
        std = ddim_ancestral_std(self.sigmas[:-1], self.sigmas[1:], eta)
        self.ancestral_std = torch.where(self.stochastic, std, torch.zeros_like(std))
        self._index = 0

    def transition(self, i: int, velocity: torch.Tensor, sample: torch.Tensor,
                   noise: Optional[torch.Tensor]) -> torch.Tensor:
        """Step ``i`` from ``sample`` with the model's ``velocity``; ``noise`` on ancestral steps only."""
        v, x = velocity.float(), sample.float()
        sigma, sigma_next = (s.to(x.device) for s in (self.sigmas[i], self.sigmas[i + 1]))
        if not self.stochastic[i]:
            return x + (sigma_next - sigma) * v
        std = self.ancestral_std[i].to(x.device)
        x0 = x - sigma * v
        x1 = x + (1 - sigma) * v
        return (1 - sigma_next) * x0 + torch.sqrt(sigma_next ** 2 - std ** 2) * x1 + std * noise.to(x.device)

    def step(self, velocity: torch.Tensor, timestep, sample: torch.Tensor) -> _Step:
        i = self._index
        noise = None
        if self.stochastic[i]:
            noise = torch.randn(sample.shape, generator=self.generator, dtype=torch.float32)
        self._index += 1
        return _Step(self.transition(i, velocity, sample, noise))


def dmd_settings(config: Optional[dict]) -> dict:
    """``threshold`` / ``eta`` for :class:`DMDStudentSampler`: the reference's defaults, or those a
    ``DMDStudentScheduler`` config of the package states (a student distilled with other values)."""
    config = config or {}
    if config.get("_class_name") != DMD_SCHEDULER_CLASS:
        return dict(threshold=DMD_THRESHOLD, eta=DMD_ETA)
    threshold = float(config.get("high_noise_threshold", DMD_THRESHOLD))
    eta = float(config.get("ddim_eta", DMD_ETA))
    if not (0.0 <= threshold <= 1.0) or not (0.0 <= eta <= 2.0):
        raise ValueError(f"scheduler/scheduler_config.json: high_noise_threshold={threshold} must be in [0, 1] and "
                         f"ddim_eta={eta} in [0, 2].")
    return dict(threshold=threshold, eta=eta)


def dmd_package_reason(config: Optional[dict], model_dir, dit_file=None) -> Optional[str]:
    """Why a package is a DMD-distilled student (its scheduler config names DMDStudentScheduler, or its
    folder name, or the name of the single DiT file loaded in its place, contains "dmd"), or None for any
    other package."""
    if (config or {}).get("_class_name") == DMD_SCHEDULER_CLASS:
        return f"its scheduler/scheduler_config.json names {DMD_SCHEDULER_CLASS}"
    name = os.path.basename(os.path.normpath(str(model_dir))) if model_dir else ""
    if "dmd" in name.lower():
        return f"its folder name {name!r} contains 'dmd'"
    file_name = os.path.basename(str(dit_file)) if dit_file else ""
    if "dmd" in file_name.lower():
        return f"its DiT file name {file_name!r} contains 'dmd'"
    return None


def sampler_sigmas(sampler: str, steps: int, shift: float, sigmas=None, denoise: float = 1.0) -> np.ndarray:
    """The grid a run samples: the DMD student's own grid for ``dmd_student`` (which refuses explicit
    ``sigmas``: the student was distilled on its grid), else the checked ``sigmas`` or the FlowUniPC grid.

    ``denoise`` < 1 (video-to-video): the last ``steps`` of that grid rule's ``int(steps / denoise)``-step grid
    (:func:`denoise_sigmas`). Explicit ``sigmas`` are run as given (the video is re-noised to their first value)."""
    if sampler == "dmd_student":
        if sigmas is not None:
            raise ValueError("sigmas cannot be used with sampler='dmd_student': the DMD student was distilled on its own "
                             "grid; leave sigmas empty and set steps (8) and shift (3.0).")
        grid_of = lambda n: dmd_sigmas(n, shift)  # noqa: E731
    elif sigmas is None:
        grid_of = lambda n: shifted_sigmas(n, shift)  # noqa: E731
    else:
        return check_sigmas(sigmas)
    return grid_of(steps) if denoise >= 1.0 else denoise_sigmas(grid_of, steps, denoise)


def make_sampler(sampler: str, sigmas: np.ndarray, config: Optional[dict] = None,
                 generator: Optional[torch.Generator] = None):
    """The solver stepping through ``sigmas`` (then 0): UniPC-bh2 (reference), flow Euler or the DMD
    student's sampler (which draws its ancestral noise from ``generator``). ``auto`` must be resolved
    by the caller (it depends on the package)."""
    if check_sampler(sampler) == "euler":
        return FlowEulerScheduler(sigmas)
    if sampler == "dmd_student":
        return DMDStudentSampler(sigmas, generator, **dmd_settings(config))
    if sampler != "unipc":
        raise ValueError(f"sampler={sampler!r} must be resolved to the package's own sampler before sampling.")
    return make_scheduler(sigmas, config)
