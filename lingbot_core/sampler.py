"""The sampling loop: UniPC-bh2 (or flow Euler) over a given sigma list with sequential classifier-free guidance."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from .scheduling import make_sampler, model_timestep

# (step index, number of steps, current x0 estimate in DiT space). May raise to cancel the run.
StepCallback = Callable[[int, int, torch.Tensor], None]


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
    sampler: str = "unipc",
) -> torch.Tensor:
    """Integrate the flow from ``latents`` (fp32, DiT space, on the DiT's execution device).

    Guidance is ``v_u + g (v_c - v_u)`` in fp32 with two batch-1 forwards per step, cond first. The DiT
    receives the reference's rounded timestep for its dtype; the solver uses the exact fp32 sigmas.
    ``condition_latent`` is written into latent frame 0 before the first step and after every step.
    ``sampler`` is ``unipc`` (the reference) or ``euler`` (flow Euler, :class:`FlowEulerScheduler`).
    """
    do_cfg = guidance_scale > 1.0
    if do_cfg and negative is None:
        raise ValueError("guidance_scale > 1 needs a negative embedding; encode the prompt with the same guidance_scale.")
    scheduler = make_sampler(sampler, sigmas, scheduler_config)
    dtype = transformer.compute_dtype
    x = latents.clone()
    if condition_latent is not None:
        x[:, :, :1] = condition_latent
    total = len(scheduler.timesteps)
    for i, t in enumerate(scheduler.timesteps):
        t_model = model_timestep(t.reshape(1), dtype).to(x.device)
        v = transformer(x, t_model, positive).float()
        if do_cfg:
            v_uncond = transformer(x, t_model, negative).float()
            v = v_uncond + guidance_scale * (v - v_uncond)
        x0 = x - scheduler.sigmas[i].item() * v
        x = scheduler.step(v, t, x).prev_sample
        if condition_latent is not None:
            x[:, :, :1] = condition_latent
        if callback is not None:
            callback(i, total, x0)
    return x
