"""Colour match of generated frames to a reference frame (against colour drift over chained extends).

``mean-std``: per RGB channel, one affine map for the whole clip, taking the clip's mean and standard deviation
(over all its frames and pixels) to the reference frame's. One map for all frames keeps the clip's own changes
of light over time (no flicker); only its overall colour cast and contrast move to the reference's.
"""

from __future__ import annotations

import torch

COLOR_MATCH_MODES = ("off", "mean-std")
# A flat clip (std near 0) would be stretched without bound: its std counts as at least one 8-bit step.
MIN_STD = 1.0 / 255.0


def check_color_match(mode) -> str:
    if mode not in COLOR_MATCH_MODES:
        raise ValueError(f"color_match={mode!r} is not allowed: use 'off' or 'mean-std' (each channel's mean and "
                         "spread matched to the last input frame).")
    return mode


def match_color(frames: torch.Tensor, reference: torch.Tensor, mode: str) -> torch.Tensor:
    """``frames`` (T, H, W, 3) in [0, 1] with ``mode`` applied against ``reference`` (H', W', 3); "off" returns them as they are."""
    if check_color_match(mode) == "off":
        return frames
    x = frames.float()
    ref = reference.float().reshape(-1, 3)
    mean, std = x.reshape(-1, 3).mean(0), x.reshape(-1, 3).std(0).clamp_min(MIN_STD)
    ref_mean, ref_std = ref.mean(0), ref.std(0)
    return ((x - mean) * (ref_std / std) + ref_mean).clamp(0, 1)
