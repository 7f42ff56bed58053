"""The refiner pass's own rules: frame budget, first-frame crop and the SDEdit start latent."""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch
from PIL import Image

from .latents import crop_to_aspect

REFINER_FPS = 24.0


def refiner_frame_indices(num_frames: int, src_fps: float = REFINER_FPS, max_frames: Optional[int] = None) -> List[int]:
    """Which source frames the refiner sees: every frame, or resampled to 24 fps (the refiner's rate) when
    the source is faster, spread over the whole clip so its duration is kept (``refiner_output_fps``).

    Any count is kept (the pipeline pads it to 4n+1 for the VAE and trims the result); the reference rounds
    down to 4n+1 instead, dropping up to three frames. ``max_frames`` caps the count afterwards.
    """
    if not np.isfinite(src_fps) or src_fps <= 0:
        raise ValueError(f"fps must be a positive number, got {src_fps}.")
    count = int(num_frames / src_fps * REFINER_FPS) if src_fps > REFINER_FPS else num_frames
    if max_frames is not None and max_frames > 0:
        count = min(count, int(max_frames))
    if count < 1:
        raise ValueError(f"{num_frames} frames at {src_fps} fps leave no frame for the refiner.")
    return np.linspace(0, num_frames - 1, count).astype(np.int64).tolist()


def refiner_output_fps(src_fps: float) -> float:
    """The frame rate of the refined frames: the source's, or 24 when it was faster (resampled)."""
    return min(float(src_fps), REFINER_FPS)


def first_frame_pixels(image, base_height: int, base_width: int, height: int, width: int) -> torch.Tensor:
    """The TI2V input image cropped to the base video's aspect, PIL-bicubic resized; (1, 3, 1, H, W) in [0, 1]."""
    cropped = crop_to_aspect(image, base_width / base_height)
    pil = Image.fromarray(cropped.numpy(), "RGB").resize((width, height), Image.BICUBIC)
    pixels = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1).float() / 255.0
    return pixels[None, :, None]


def start_latent(x_up: torch.Tensor, noise: torch.Tensor, t_thresh: float) -> torch.Tensor:
    """``(1 - t) x_up + t noise`` computed in x_up's dtype (bf16 on CUDA, as the reference), returned fp32."""
    return ((1 - t_thresh) * x_up + t_thresh * noise).float()
