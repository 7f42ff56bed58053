"""The sampling loop: UniPC-bh2 (flow Euler, or the DMD student's sampler) over a given sigma list with
classifier-free guidance.

The two CFG branches are two batch-1 forwards. In lockstep (the default) they go through the DiT in
one call, block by block (each block runs cond, then uncond, while its weights are resident), which
halves the weight traffic of a streaming offload and gives the same bits as one forward after the other.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch

from .context_windows import ContextWindows
from .scheduling import make_sampler, model_timestep
from .step_cache import StepCache

# (step index, number of steps, current x0 estimate in DiT space). May raise to cancel the run.
# A callback may carry a ``status(text)`` attribute: it then receives short status lines per step
# (the step cache's computed / skipped counts).
StepCallback = Callable[[int, int, torch.Tensor], None]

# Runs the two CFG branches of one DiT call somewhere else (lingbot_core.parallel: one branch per rank):
# ``cfg_runner(branch, positive, negative)`` -> ``(v_cond, v_uncond)``, where ``branch(text, j)`` runs the DiT
# on branch ``j`` (0 cond, 1 uncond) and returns its fp32 velocity. Every rank gets both velocities back.
CfgRunner = Callable[[Callable[[torch.Tensor, int], torch.Tensor], torch.Tensor, torch.Tensor],
                     Tuple[torch.Tensor, torch.Tensor]]


def sample(
    transformer,
    latents: torch.Tensor,
    sigmas: np.ndarray,
    positive: torch.Tensor,
    negative: Optional[torch.Tensor],
    *,
    guidance_scale: float,
    condition_latent: Optional[torch.Tensor] = None,
    scheduler_config: Optional[dict] = None,
    callback: Optional[StepCallback] = None,
    lockstep: bool = True,
    step_cache: Optional[StepCache] = None,
    sampler: str = "unipc",
    generator: Optional[torch.Generator] = None,
    windows: Optional[ContextWindows] = None,
    interrupt: Optional[Callable[[], None]] = None,
    window_conditions: Optional[Sequence[Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None,
    cfg_runner: Optional[CfgRunner] = None,
) -> torch.Tensor:
    """Integrate the flow from ``latents`` (fp32, DiT space, on the DiT's execution device).

    Guidance is ``v_u + g (v_c - v_u)`` in fp32 with two batch-1 forwards per step, cond first. The DiT
    receives the reference's rounded timestep for its dtype; the solver uses the exact fp32 sigmas.
    ``condition_latent`` (1, C, n, h, w) is written into the first n latent frames before the first step and
    after every step: n = 1 for image-to-video's first frame, more for the tail of a clip being extended.
    ``lockstep`` runs both branches in one DiT call; ``step_cache`` (one branch state per CFG branch,
    cond first) may skip the block stack of a branch on a step. ``sampler`` is ``unipc`` (the reference),
    ``euler`` (flow Euler, :class:`FlowEulerScheduler`) or ``dmd_student`` (:class:`DMDStudentSampler`,
    which draws its ancestral noise from ``generator``, the run's CPU generator).

    ``windows`` (:mod:`.context_windows`): the DiT runs on each window of latent frames as a standalone
    clip and the guided velocities are blended; the solver steps the whole latent. ``condition_latent``
    is written into the whole latent, so only the windows holding its frames see it. With one window (a
    video no longer than a window, or ``windows`` None) the DiT gets the whole latent, as before.
    A ``step_cache`` needs one branch state per CFG branch per window (window-major).
    ``interrupt`` (the host's cancel check, a callable that raises to cancel) runs before every window's DiT
    call when there are several, so a cancel waits for one window, not for a whole step.
    ``window_conditions`` (a prompt schedule): one ``(positive, negative)`` per window, replacing
    ``positive`` / ``negative`` for that window's forwards.
    ``cfg_runner`` (:data:`CfgRunner`, None = both branches here) computes the two guidance branches, e.g. on two
    ranks at once; ``lockstep`` then does not apply.
    """
    do_cfg = guidance_scale > 1.0
    if do_cfg and negative is None:
        raise ValueError("guidance_scale > 1 needs a negative embedding; encode the prompt with the same guidance_scale.")
    scheduler = make_sampler(sampler, sigmas, scheduler_config, generator)
    dtype = transformer.compute_dtype
    x = latents.clone()
    if condition_latent is not None:
        x[:, :, :condition_latent.shape[2]] = condition_latent
    total = len(scheduler.timesteps)
    status = getattr(callback, "status", None)

    length = x.shape[2]
    spans = [(0, length)] if windows is None else windows.spans(length)
    # on the execution device once, not per step and window
    weights = None if len(spans) == 1 else [w.to(x.device).view(1, 1, -1, 1, 1) for w in windows.weights(length)]
    per_window = 2 if do_cfg else 1
    if window_conditions is not None and len(window_conditions) != len(spans):
        raise ValueError(f"{len(window_conditions)} window conditions for {len(spans)} context windows.")

    def conditions(window):
        return (positive, negative) if window_conditions is None else window_conditions[window]

    def caches(window, *branches):
        return None if step_cache is None else [step_cache.branches[window * per_window + j] for j in branches]

    def guided(xw, t_model, window):
        positive, negative = conditions(window)
        if do_cfg and cfg_runner is not None:
            v, v_uncond = cfg_runner(
                lambda text, j: transformer(xw, t_model, text, step_cache=caches(window, j)).float(), positive, negative)
        elif do_cfg and lockstep:
            v, v_uncond = (o.float() for o in transformer(xw, t_model, [positive, negative], step_cache=caches(window, 0, 1)))
        else:
            v = transformer(xw, t_model, positive, step_cache=caches(window, 0)).float()
            if do_cfg:
                v_uncond = transformer(xw, t_model, negative, step_cache=caches(window, 1)).float()
        if do_cfg:
            v = v_uncond + guidance_scale * (v - v_uncond)
        return v

    # The DiT's timesteps on the device once per stage: a per-step .to() from pageable memory is a host sync
    # each step (gpu-review-4 finding 13). model_timestep is elementwise: the same bits as one step at a time.
    t_models = model_timestep(torch.as_tensor(scheduler.timesteps).reshape(-1), dtype).to(x.device)
    for i, t in enumerate(scheduler.timesteps):
        if step_cache is not None:
            step_cache.begin_step(i, total)
        t_model = t_models[i:i + 1]
        if weights is None:
            v = guided(x, t_model, 0)
        else:
            v = torch.zeros_like(x)
            for k, ((start, end), w) in enumerate(zip(spans, weights)):
                if interrupt is not None:
                    interrupt()
                v[:, :, start:end] += guided(x[:, :, start:end], t_model, k) * w
        x0 = x - scheduler.sigmas[i].item() * v
        x = scheduler.step(v, t, x).prev_sample
        if condition_latent is not None:
            x[:, :, :condition_latent.shape[2]] = condition_latent
        if callback is not None:
            callback(i, total, x0)
        if status is not None and step_cache is not None:
            status(step_cache.summary())
    return x
