"""Continuing a clip that exists: what an extend request may ask, the tail that conditions the new clip, and
how the result is joined.

The new clip is sampled as image-to-video is: its first latent frames are pinned, clean, to the VAE encode of
the input's last ``keep_frames`` frames, before sampling and after every step, with the noisy frames' timestep
and no mask channel (model doc §7.5: what the model is trained on with one frame). ``keep_frames`` = 1 + 4k
pins k + 1 latent frames (the VAE's frame 0 stands for one frame, each further one for four), so a longer
tail carries the motion across the seam. The clip is ``keep_frames + new_frames`` frames (4n + 1); its first
``keep_frames`` frames (the VAE's reconstruction of the tail) are dropped: the output is the input, unchanged,
followed by ``new_frames`` new frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.latents import MAX_FRAMES, MAX_SIDE, SIZE_MULTIPLE, TEMPORAL_COMPRESSION, preprocess_first_frame

TEMPORAL = TEMPORAL_COMPRESSION


@dataclass(frozen=True)
class ExtendPlan:
    """A checked extend request: ``keep`` tail frames condition ``new`` new frames at ``height x width``."""

    keep: int
    new: int
    height: int
    width: int

    @property
    def clip_frames(self) -> int:
        """The sampled clip's length (4n + 1): the kept tail, then the new frames."""
        return self.keep + self.new

    @property
    def head_latent_frames(self) -> int:
        """Latent frames pinned at the clip's head."""
        return (self.keep - 1) // TEMPORAL + 1


def _is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def nearest_size(side: int) -> int:
    """The side length (a multiple of 16, 16..4096) nearest to ``side``; ties go up."""
    return min(max(SIZE_MULTIPLE, (side + SIZE_MULTIPLE // 2) // SIZE_MULTIPLE * SIZE_MULTIPLE), MAX_SIDE)


def check_extend(shape, keep_frames, new_frames) -> ExtendPlan:
    """Check a request against the video's shape (T, H, W, 3) before any work; the errors name the valid values."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != 4 or shape[-1] != 3:
        raise ValueError(f"the video must be frames (T, H, W, 3) (an IMAGE batch); got shape {shape}.")
    frames, height, width = shape[:3]
    if frames == 0 or height == 0 or width == 0:
        raise ValueError(f"the video to extend is empty (shape {shape}): connect a clip with at least one frame.")
    if not _is_int(keep_frames) or keep_frames < 1 or (keep_frames - 1) % TEMPORAL:
        lower = 1 + (keep_frames - 1) // TEMPORAL * TEMPORAL if _is_int(keep_frames) and keep_frames > 0 else 1
        raise ValueError(f"keep_frames={keep_frames!r} is not allowed: use 1 + 4k frames (1, 5, 9, ...), e.g. {lower} or "
                         f"{lower + TEMPORAL}.")
    if keep_frames > frames:
        longest = 1 + (frames - 1) // TEMPORAL * TEMPORAL
        raise ValueError(f"keep_frames={keep_frames} is longer than the video ({frames} frames): use at most {longest} "
                         "(1 + 4k frames, no more than the video has).")
    if not _is_int(new_frames) or new_frames < TEMPORAL or new_frames % TEMPORAL:
        value = int(new_frames) if _is_int(new_frames) else TEMPORAL
        lower = max(TEMPORAL, value // TEMPORAL * TEMPORAL)
        upper = lower + TEMPORAL if value > lower else lower
        nearest = f"{lower}" if lower == upper else f"{lower} or {upper}"
        raise ValueError(f"new_frames={new_frames!r} is not allowed: use a multiple of 4 (4, 8, ... 80 = 3.3 s at 24 fps); "
                         f"the nearest: {nearest}.")
    if keep_frames + new_frames > MAX_FRAMES:
        raise ValueError(f"keep_frames + new_frames = {keep_frames + new_frames} frames is longer than the longest clip "
                         f"({MAX_FRAMES}): use new_frames {MAX_FRAMES - keep_frames} or fewer, and chain extends for more.")
    if height % SIZE_MULTIPLE or width % SIZE_MULTIPLE or max(height, width) > MAX_SIDE:
        raise ValueError(f"the video is {width}x{height} (width x height), a size the model cannot take: both sides must be "
                         f"multiples of {SIZE_MULTIPLE}, at most {MAX_SIDE}. The nearest it takes is "
                         f"{nearest_size(width)}x{nearest_size(height)}: resize the video to it first (e.g. Upscale Image).")
    return ExtendPlan(keep_frames, new_frames, height, width)


def tail_pixels(video: torch.Tensor, plan: ExtendPlan) -> torch.Tensor:
    """The video's last ``keep`` frames as (1, 3, keep, H, W) in [0, 1], each prepared exactly as image-to-video
    prepares its image (8-bit rounding; the cover-and-crop is the identity at the video's own size)."""
    frames = video[video.shape[0] - plan.keep:]
    return torch.cat([preprocess_first_frame(f, plan.height, plan.width) for f in frames], dim=2)


def join(video: torch.Tensor, clip: torch.Tensor, plan: ExtendPlan) -> torch.Tensor:
    """The input's frames as they came, then the clip's new frames (the reconstructed tail dropped)."""
    if clip.shape[0] != plan.clip_frames:
        raise RuntimeError(f"the extension decoded to {clip.shape[0]} frames, expected {plan.clip_frames}.")
    return torch.cat([video.float(), clip[plan.keep:].float()])
