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


def padded_frame_count(frames: int) -> int:
    """The 4n+1 frame count (at least ``frames``) a video of ``frames`` frames is sampled at: the VAE's
    latent frame 0 stands for one frame and each further one for four, so other lengths are padded."""
    return (max(int(frames), 1) - 1 + TEMPORAL_COMPRESSION - 1) // TEMPORAL_COMPRESSION * TEMPORAL_COMPRESSION + 1


def pad_frames(video: torch.Tensor, frames: int, dim: int) -> torch.Tensor:
    """``video`` extended along ``dim`` to ``frames`` frames by repeating its last frame (a held frame: the
    padded tail is a still, whose last latent frame keeps the real frames better than a reflected tail: see
    docs/video-to-video-and-long-video.md). Trim the decoded frames back to the video's own count."""
    extra = int(frames) - video.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad a video of {video.shape[dim]} frames to {frames}.")
    if extra == 0:
        return video
    last = video.narrow(dim, video.shape[dim] - 1, 1)
    return torch.cat([video, last.expand(*[extra if d == dim else -1 for d in range(video.ndim)])], dim=dim)


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


def integer_pixels(t: torch.Tensor, what: str) -> torch.Tensor:
    """The one rule for integer pixels (an image's or a video's): they are 0..255 values, not [0, 1] floats;
    returned as uint8. Booleans and values outside 0..255 are refused."""
    if t.dtype == torch.bool:
        raise ValueError(f"{what} must hold pixel values, not booleans.")
    if t.dtype != torch.uint8 and t.numel() and (t.min() < 0 or t.max() > 255):
        raise ValueError(f"integer {what} values must be in 0..255; got {int(t.min())}..{int(t.max())}.")
    return t.to(torch.uint8)


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
    if not t.is_floating_point():
        t = integer_pixels(t, "image")
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


# Frames converted at a time where a whole video would otherwise make full-size temporaries on the device
# (the decode's post-processing): 4 frames of 1088x1920 fp32 are 100 MB.
CHUNK_FRAMES = 4

# GenerateVideo's vae_tiling modes. "auto" tiles above 720p: untiled, a 1080p decode needs roughly 30-40 GB
# of VRAM (fp32 activations of 4 output frames, and the output grown by torch.cat on the device) and the encode
# about 17-22 GB (gpu-review-4, findings 1-2), while 720p x 121 decodes whole in about 15 GB.
VAE_TILING_MODES = ("auto", "on", "off")
AUTO_TILING_PIXELS = 720 * 1280


def check_vae_tiling(mode) -> None:
    """A vae_tiling mode: "auto", "on", "off", or a bool (Refine's widget: on/off)."""
    if not isinstance(mode, bool) and mode not in VAE_TILING_MODES:
        raise ValueError(f"vae_tiling={mode!r} is not allowed: use 'auto' (tiled above 720p, more than 720x1280 "
                         "pixels a frame), 'on' or 'off'.")


def tiling_enabled(mode, height: int, width: int) -> bool:
    """Whether vae_tiling ``mode`` turns the VAE's tiling on for frames of ``height x width`` pixels (the
    tiles then apply to frames larger than one tile)."""
    check_vae_tiling(mode)
    if isinstance(mode, bool):
        return mode
    return mode == "on" or (mode == "auto" and height * width > AUTO_TILING_PIXELS)


def _drives(vae) -> bool:
    """Whether the pack can call this VAE's encoder/decoder itself (diffusers' Wan 2.1 layout: no patchify)."""
    return (getattr(vae, "spatial_compression_ratio", None) is not None
            and getattr(vae.config, "patch_size", None) is None
            and all(hasattr(vae, a) for a in ("clear_cache", "quant_conv", "post_quant_conv", "encoder", "decoder")))


def _onload(vae) -> None:
    """Fire the VAE's offload hook, as ``vae.encode``/``vae.decode`` do (diffusers' ``apply_forward_hook``):
    the streamed paths call the encoder's and decoder's modules directly."""
    hook = getattr(vae, "_hf_hook", None)
    if hook is not None and hasattr(hook, "pre_forward"):
        hook.pre_forward(vae)


def _causal_chunks(frames: int) -> Iterator[Tuple[int, int]]:
    """The Wan encoder's temporal chunks, as diffusers' encode loop takes them: frame 0 alone, then 4 frames
    each (a tail of fewer than 4 frames is not encoded)."""
    yield 0, 1
    for i in range(1, 1 + (frames - 1) // TEMPORAL_COMPRESSION):
        yield 1 + TEMPORAL_COMPRESSION * (i - 1), 1 + TEMPORAL_COMPRESSION * i


def _encode_tiled(vae, height: int, width: int) -> bool:
    """Whether diffusers' Wan VAE would encode frames of ``height x width`` in tiles."""
    return getattr(vae, "use_tiling", False) and (height > vae.tile_sample_min_height or width > vae.tile_sample_min_width)


def vae_encode(vae, pixels: torch.Tensor, device: torch.device) -> Posterior:
    """Encode (B, 3, T, H, W) pixels in [0, 1] on ``device``; returns the posterior on the CPU.

    On CUDA the encode runs under bf16 autocast although the VAE is fp32, as the reference does. The
    video stays on the host: the encoder is fed one causal chunk at a time (frame 0, then 4 frames)
    through its feature cache, each chunk moved to the device and scaled to [-1, 1] there, so the device
    holds one chunk, never the video (6 GB fp32 for 241 frames at 1088x1920). With the VAE's tiling on and
    frames larger than a tile, the chunk is one tile's: each tile runs its own causal pass, and the tiles
    are blended as diffusers' tiled encode blends them (:class:`_TileBlender`). Tiled or not, the numbers
    are diffusers' encode's.
    """
    autocast = device.type == "cuda" and torch.cuda.is_available()
    # No autocast off CUDA: a bf16/fp16 VAE needs inputs of its own dtype.
    dtype = torch.float32 if autocast else next((p.dtype for p in vae.parameters()), torch.float32)
    if not _drives(vae):  # a layout the pack does not drive itself: diffusers' encode of the whole video
        x = torch.empty(pixels.shape, dtype=dtype, device=device)
        for t in range(0, pixels.shape[2], CHUNK_FRAMES):
            x[:, :, t:t + CHUNK_FRAMES] = (pixels[:, :, t:t + CHUNK_FRAMES].to(device=device, dtype=torch.float32) - 0.5) / 0.5
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return Posterior(vae.encode(x).latent_dist.parameters.detach().to("cpu"))
    _, _, frames, height, width = pixels.shape
    ratio = vae.spatial_compression_ratio
    tiled = _encode_tiled(vae, height, width)
    tile_h, tile_w = (vae.tile_sample_min_height, vae.tile_sample_min_width) if tiled else (height, width)
    step_h, step_w = (vae.tile_sample_stride_height, vae.tile_sample_stride_width) if tiled else (height, width)
    out = []  # the host latent, allocated at the first tile part

    def put(part, y, x):
        if not out:
            out.append(torch.empty(*part.shape[:3], height // ratio, width // ratio, dtype=part.dtype))
        out[0][:, :, :, y:y + part.shape[3], x:x + part.shape[4]] = part.detach().to("cpu")

    blender = _TileBlender((step_h // ratio, step_w // ratio), ((tile_h - step_h) // ratio, (tile_w - step_w) // ratio),
                           (height // ratio, width // ratio), put)
    _onload(vae)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        for i, top in enumerate(range(0, height, step_h)):
            for j, left in enumerate(range(0, width, step_w)):
                vae.clear_cache()
                parts = []
                for t0, t1 in _causal_chunks(frames):
                    x = pixels[:, :, t0:t1, top:top + tile_h, left:left + tile_w].to(device=device, dtype=torch.float32)
                    x = ((x - 0.5) / 0.5).to(dtype)
                    vae._enc_conv_idx = [0]
                    h = vae.encoder(x, feat_cache=vae._enc_feat_map, feat_idx=vae._enc_conv_idx)
                    # diffusers' tiled encode applies quant_conv per chunk, its whole-frame encode once at the end
                    parts.append(vae.quant_conv(h) if tiled else h)
                    del x, h
                latent = torch.cat(parts, dim=2)
                del parts
                blender.add(i, j, latent if tiled else vae.quant_conv(latent))
                del latent
    vae.clear_cache()
    return Posterior(out[0])


class _TileBlender:
    """Diffusers' Wan tile blending (encode and decode), tile by tile in row-major order.

    Tile (i, j) is blended with the bottom rows of tile (i - 1, j) and the right columns of tile (i, j - 1),
    each taken after its own blends, and its top-left ``stride`` part (cropped to ``size``) goes to
    ``put(part, y, x)``. Only the blend overlap of the previous row is kept, so tiles can be dropped (or
    leave the device) as soon as they are added. Sizes are in the output's units (pixels for the decode,
    latent cells for the encode)."""

    def __init__(self, stride: Tuple[int, int], blend: Tuple[int, int], size: Tuple[int, int], put):
        self.stride, self.blend, self.size, self.put = stride, blend, size, put
        self.row, self.above, self.bottoms, self.left = None, {}, {}, None

    def add(self, i: int, j: int, tile: torch.Tensor) -> None:
        (stride_h, stride_w), (blend_h, blend_w), (out_h, out_w) = self.stride, self.blend, self.size
        if i != self.row:
            self.row, self.above, self.bottoms, self.left = i, self.bottoms, {}, None
        if j in self.above:
            _blend_rows(self.above.pop(j), tile, blend_h)
        if self.left is not None:
            _blend_cols(self.left, tile, blend_w)
        y, x = i * stride_h, j * stride_w
        self.put(tile[:, :, :, :min(stride_h, out_h - y), :min(stride_w, out_w - x)], y, x)
        if blend_h > 0:
            self.bottoms[j] = tile[:, :, :, -min(blend_h, tile.shape[3]):].clone()
        self.left = tile


def vae_decode(vae, latents_vae: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Decode VAE-space latents (1, 16, T', h, w); returns (T, H, W, 3) float32 in [0, 1] on the CPU.

    With the VAE's tiling on and a latent larger than a tile, the tiles are decoded row by row and each
    finished part leaves the device as soon as its blends are done (:func:`_tiled_decode`): the device
    holds one row of tiles and the overlap of the row above, not the whole video (about 14 GB at 1080p).
    Either way the output is post-processed ([-1, 1] -> [0, 1], channels last) in chunks of frames.
    """
    vae_dtype = next((p.dtype for p in vae.parameters()), torch.float32)
    autocast = device.type == "cuda" and vae_dtype in (torch.bfloat16, torch.float16)
    # Without autocast (fp32 VAE, or any VAE off CUDA) the input must have the VAE's own dtype.
    z = latents_vae.to(device=device, dtype=torch.float32 if autocast else vae_dtype)
    z = z.contiguous(memory_format=torch.channels_last_3d)
    with torch.autocast("cuda", dtype=vae_dtype, enabled=autocast):
        if _tiles_apply(vae, z):
            return _tiled_decode(vae, z)
        video = vae.decode(z).sample
    out = torch.empty(video.shape[2], video.shape[3], video.shape[4], 3, dtype=torch.float32)
    _to_host(video, out, 0, 0)
    return out


def _to_host(video: torch.Tensor, out: torch.Tensor, top: int, left: int) -> None:
    """Post-process (1, 3, T, h, w) decoded pixels in frame chunks into ``out[:, top:, left:]`` (host)."""
    h, w = video.shape[3], video.shape[4]
    for t in range(0, video.shape[2], CHUNK_FRAMES):
        part = ((video[:, :, t:t + CHUNK_FRAMES].float().clamp(-1, 1) + 1) / 2)[0].permute(1, 2, 3, 0)
        out[t:t + part.shape[0], top:top + h, left:left + w] = part.to("cpu")


def _tiles_apply(vae, z: torch.Tensor) -> bool:
    """Whether diffusers' Wan VAE would decode ``z`` in tiles (and the streamed decode knows its layout)."""
    if not getattr(vae, "use_tiling", False) or not _drives(vae):
        return False
    ratio = vae.spatial_compression_ratio
    return z.shape[3] > vae.tile_sample_min_height // ratio or z.shape[4] > vae.tile_sample_min_width // ratio


def _tiled_decode(vae, z: torch.Tensor) -> torch.Tensor:
    """See :func:`_tiled_decode_parts`; first fires the VAE's offload hook, as ``vae.decode`` does."""
    _onload(vae)
    return _tiled_decode_parts(vae, z)


def _tiled_decode_parts(vae, z: torch.Tensor) -> torch.Tensor:
    """The Wan VAE's tiled decode (the same tiles, causal frame loop and linear blends as
    ``AutoencoderKLWan.tiled_decode``, so the same numbers), streamed to the host: each tile's finished
    part is post-processed and copied out as soon as its blends are done (:class:`_TileBlender`)."""
    ratio = vae.spatial_compression_ratio
    _, _, frames, height, width = z.shape
    tile_h, tile_w = vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio
    step_h, step_w = vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio
    stride = (vae.tile_sample_stride_height, vae.tile_sample_stride_width)
    blend = (vae.tile_sample_min_height - stride[0], vae.tile_sample_min_width - stride[1])
    out = []  # the host frames, allocated at the first tile part

    def put(part, y, x):
        if not out:
            out.append(torch.empty(part.shape[2], height * ratio, width * ratio, 3, dtype=torch.float32))
        _to_host(part, out[0], y, x)

    blender = _TileBlender(stride, blend, (height * ratio, width * ratio), put)
    for i, top in enumerate(range(0, height, step_h)):
        for j, left in enumerate(range(0, width, step_w)):
            blender.add(i, j, _decode_tile(vae, z[:, :, :, top:top + tile_h, left:left + tile_w], frames))
    vae.clear_cache()
    return out[0]


def _decode_tile(vae, tile_latent: torch.Tensor, frames: int) -> torch.Tensor:
    vae.clear_cache()
    decoded = []
    for k in range(frames):  # the causal decoder: one latent frame at a time through its feature cache
        vae._conv_idx = [0]
        x = vae.post_quant_conv(tile_latent[:, :, k:k + 1])
        decoded.append(vae.decoder(x, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=k == 0))
    return torch.cat(decoded, dim=2)


def _blend_rows(upper: torch.Tensor, tile: torch.Tensor, extent: int) -> None:
    """Fade from ``upper``'s last rows into ``tile``'s first rows, in place (row y weighs y / extent)."""
    extent = min(upper.shape[-2], tile.shape[-2], extent)
    for y in range(extent):
        tile[:, :, :, y, :] = upper[:, :, :, -extent + y, :] * (1 - y / extent) + tile[:, :, :, y, :] * (y / extent)


def _blend_cols(left: torch.Tensor, tile: torch.Tensor, extent: int) -> None:
    """Fade from ``left``'s last columns into ``tile``'s first columns, in place."""
    extent = min(left.shape[-1], tile.shape[-1], extent)
    for x in range(extent):
        tile[:, :, :, :, x] = left[:, :, :, :, -extent + x] * (1 - x / extent) + tile[:, :, :, :, x] * (x / extent)
