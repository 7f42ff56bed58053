"""Latent shapes, DiT-space normalisation, first-frame preprocessing and Wan VAE encode/decode.

The Wan 2.1 VAE compresses x4 in time and x8 in space. LingBot's "DiT space" is the per-channel
normalised VAE latent ``(z - mean) * (1 / std)`` (the same as ComfyUI's Wan21 ``process_in``).
Encodes return the posterior moments on the CPU so the caller decides when (and with which
generator) to draw the sample, which keeps the reference's RNG order however the stages are split.
"""

from __future__ import annotations

import math
import operator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

TEMPORAL_COMPRESSION = 4
SPATIAL_COMPRESSION = 8
SIZE_MULTIPLE = 16  # latent must be divisible by the DiT's 2x2 patch
# Upper bounds (the nodes' widget maxima): a larger request is a typo or a hostile workflow, and would
# otherwise allocate noise/latents without bound (a caption "duration" can also ask for any frame count).
MAX_SIDE = 4096
MAX_FRAMES = 1001
# Scale-to-cover of an extreme aspect ratio can ask for a gigantic intermediate image (a 10000x10
# image covering 832x480 would be 832000x832); refuse instead of allocating gigabytes.
MAX_COVER_PIXELS = 8192 * 8192
# The refiner's VAE tiling (25 % overlap); diffusers' own Wan defaults are smaller.
REFINER_TILE = (384, 640)
REFINER_TILE_STRIDE = (288, 480)


def check_video_size(num_frames: int, height: int, width: int) -> None:
    """Raise a ValueError naming the bad value and the allowed ones (any integer type is accepted)."""
    num_frames, height, width = (_as_int(v) for v in (num_frames, height, width))

    def near(value, step, lo, hi):  # a valid value at or below ``value``, for the message
        v = value if isinstance(value, (int, float)) and math.isfinite(value) else lo
        return int(min(max(lo, ((max(v, lo) - lo) // step) * step + lo), hi - step))

    if not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % TEMPORAL_COMPRESSION or num_frames > MAX_FRAMES:
        lo = near(num_frames, TEMPORAL_COMPRESSION, 1, MAX_FRAMES)
        raise ValueError(
            f"num_frames={num_frames} is not allowed: use 1 (an image) or 4n+1 frames, at most {MAX_FRAMES} "
            f"(e.g. {lo} or {lo + 4})."
        )
    for name, value in (("height", height), ("width", width)):
        if not isinstance(value, int) or value < SIZE_MULTIPLE or value % SIZE_MULTIPLE or value > MAX_SIDE:
            lo = near(value, SIZE_MULTIPLE, SIZE_MULTIPLE, MAX_SIDE)
            raise ValueError(
                f"{name}={value} is not allowed: use a multiple of {SIZE_MULTIPLE} pixels, from {SIZE_MULTIPLE} to "
                f"{MAX_SIDE} (e.g. {lo} or {lo + SIZE_MULTIPLE})."
            )


def _as_int(value):
    """numpy/torch integers -> int; anything else (floats, strings, bools) is left to be rejected."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def latent_shape(num_frames: int, height: int, width: int, channels: int = 16) -> Tuple[int, ...]:
    return (1, channels, (num_frames - 1) // TEMPORAL_COMPRESSION + 1, height // SPATIAL_COMPRESSION, width // SPATIAL_COMPRESSION)


class LatentNormalizer:
    """VAE space <-> DiT space with the per-channel mean/std from ``vae/config.json``."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        if mean is None or std is None or len(mean) != len(std):
            raise ValueError("vae/config.json must define latents_mean and latents_std of equal length.")
        self.mean = torch.tensor(list(mean), dtype=torch.float32).view(1, -1, 1, 1, 1)
        # Multiply by the fp32 reciprocal, as the reference does (dividing by std differs in the last bit).
        self.inv_std = 1.0 / torch.tensor(list(std), dtype=torch.float32).view(1, -1, 1, 1, 1)

    def to_dit(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self.mean.to(z.device)) * self.inv_std.to(z.device)

    def to_vae(self, z: torch.Tensor) -> torch.Tensor:
        return z.float() / self.inv_std.to(z.device) + self.mean.to(z.device)


@dataclass
class Posterior:
    """The VAE posterior ``N(mean, exp(logvar))`` of an encode, kept on the CPU."""

    moments: torch.Tensor  # (B, 2*z, T', h, w): mean then logvar, as diffusers stores them

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        """One posterior draw (consumes ``generator``), in the moments' dtype."""
        return DiagonalGaussianDistribution(self.moments).sample(generator=generator)

    def mode(self) -> torch.Tensor:
        return DiagonalGaussianDistribution(self.moments).mode()

    @property
    def latent_frames(self) -> int:
        return self.moments.shape[2]


# ----------------------------------------------------------------------------------------------
# Image preprocessing
# ----------------------------------------------------------------------------------------------


def image_to_uint8(image) -> torch.Tensor:
    """PIL image, (H, W, C) float array/tensor in [0, 1] or integer array in 0..255 -> (H, W, 3) uint8.

    Float pixels are rounded (``round(x * 255)``), which recovers the original bytes of an image that
    came from uint8, as a ComfyUI IMAGE does. Grayscale is repeated to RGB; alpha is dropped.
    """
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL
        image = np.array(image.convert("RGB"))
    t = torch.as_tensor(np.asarray(image) if not isinstance(image, torch.Tensor) else image)
    if t.ndim == 2:
        t = t[..., None]
    if t.ndim != 3:
        raise ValueError(f"image must be (H, W, C); got shape {tuple(t.shape)}.")
    if t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(f"image is empty (shape {tuple(t.shape)}); it needs at least 1x1 pixels.")
    if t.shape[-1] == 1:
        t = t.expand(*t.shape[:2], 3)
    elif t.shape[-1] == 4:
        t = t[..., :3]
    elif t.shape[-1] != 3:
        raise ValueError(f"image must have 1, 3 or 4 channels; got {t.shape[-1]}.")
    if t.dtype == torch.bool:
        raise ValueError("image must hold pixel values, not booleans.")
    if not t.is_floating_point() and t.dtype != torch.uint8:
        # Integer pixels are 0..255 values (not [0, 1] floats).
        if t.numel() and (t.min() < 0 or t.max() > 255):
            raise ValueError(f"integer image values must be in 0..255; got {int(t.min())}..{int(t.max())}.")
        t = t.to(torch.uint8)
    if t.dtype != torch.uint8:
        t = t.float()
        if not torch.isfinite(t).all():
            raise ValueError("image contains NaN or infinite values.")
        t = torch.round(t.clamp(0, 1) * 255).to(torch.uint8)
    return t.contiguous()


def preprocess_first_frame(image, height: int, width: int) -> torch.Tensor:
    """Scale to cover ``height x width``, centre crop; returns (1, 3, 1, H, W) float in [0, 1].

    The resize is bilinear on the uint8 tensor (rounded back to uint8, no antialias), as the reference.
    """
    img = image_to_uint8(image)
    h0, w0 = img.shape[:2]
    scale = max(height / h0, width / w0)
    new_h, new_w = max(math.ceil(h0 * scale), height), max(math.ceil(w0 * scale), width)
    if new_h * new_w > MAX_COVER_PIXELS:
        raise ValueError(
            f"image of {w0}x{h0} pixels would have to be scaled to {new_w}x{new_h} to cover the {width}x{height} "
            "video; crop it closer to the video's aspect ratio first."
        )
    # torch's uint8 kernel (fixed-point) rounds differently from float + round; use it as the reference does.
    x = F.interpolate(img.permute(2, 0, 1)[None], size=(new_h, new_w), mode="bilinear", align_corners=False)
    top, left = round((new_h - height) / 2), round((new_w - width) / 2)
    x = x[:, :, top : top + height, left : left + width]
    return (x.float() / 255.0)[:, :, None]


def crop_to_aspect(image, aspect: float) -> torch.Tensor:
    """Centre-crop an image (H, W, 3 uint8) to width/height = ``aspect`` (the refiner's first frame)."""
    img = image_to_uint8(image)
    h, w = img.shape[:2]
    if w / h > aspect:
        cw = max(1, round(h * aspect))
        left = round((w - cw) / 2)
        return img[:, left : left + cw]
    ch = max(1, round(w / aspect))
    top = round((h - ch) / 2)
    return img[top : top + ch]


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(T, H, W, 3) float in [0, 1] -> (1, 3, T, height, width), bicubic, clamped (the refiner's input)."""
    x = frames.permute(0, 3, 1, 2).float()
    x = F.interpolate(x, size=(height, width), mode="bicubic", align_corners=False).clamp(0, 1)
    return x.permute(1, 0, 2, 3)[None]


# ----------------------------------------------------------------------------------------------
# VAE calls
# ----------------------------------------------------------------------------------------------


@contextmanager
def vae_tiling(vae, enabled: bool, tile: Tuple[int, int] = REFINER_TILE, stride: Tuple[int, int] = REFINER_TILE_STRIDE) -> Iterator[None]:
    """Temporarily set the VAE's tiling; restores the previous settings (the VAE is shared)."""
    keys = ("use_tiling", "tile_sample_min_height", "tile_sample_min_width", "tile_sample_stride_height", "tile_sample_stride_width")
    saved = {k: getattr(vae, k) for k in keys if hasattr(vae, k)}
    try:
        if enabled:
            vae.enable_tiling(
                tile_sample_min_height=tile[0], tile_sample_min_width=tile[1],
                tile_sample_stride_height=stride[0], tile_sample_stride_width=stride[1],
            )
        else:
            vae.use_tiling = False
        yield
    finally:
        for k, v in saved.items():
            setattr(vae, k, v)


def vae_encode(vae, pixels: torch.Tensor, device: torch.device) -> Posterior:
    """Encode (B, 3, T, H, W) pixels in [0, 1] on ``device``; returns the posterior on the CPU.

    On CUDA the encode runs under bf16 autocast although the VAE is fp32, as the reference does.
    """
    x = (pixels.to(device=device, dtype=torch.float32) - 0.5) / 0.5
    autocast = device.type == "cuda" and torch.cuda.is_available()
    if not autocast:  # no autocast off CUDA: a bf16/fp16 VAE needs inputs of its own dtype
        x = x.to(next((p.dtype for p in vae.parameters()), torch.float32))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        moments = vae.encode(x).latent_dist.parameters
    return Posterior(moments.detach().to("cpu"))


def vae_decode(vae, latents_vae: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Decode VAE-space latents (1, 16, T', h, w); returns (T, H, W, 3) float32 in [0, 1] on the CPU."""
    vae_dtype = next((p.dtype for p in vae.parameters()), torch.float32)
    autocast = device.type == "cuda" and vae_dtype in (torch.bfloat16, torch.float16)
    # Without autocast (fp32 VAE, or any VAE off CUDA) the input must have the VAE's own dtype.
    z = latents_vae.to(device=device, dtype=torch.float32 if autocast else vae_dtype)
    z = z.contiguous(memory_format=torch.channels_last_3d)
    with torch.autocast("cuda", dtype=vae_dtype, enabled=autocast):
        video = vae.decode(z).sample
    video = ((video.float().clamp(-1, 1) + 1) / 2)[0].permute(1, 2, 3, 0)
    return video.to("cpu").contiguous()
