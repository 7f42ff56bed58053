"""``LingbotPipeline``: the stages (prompt encode, image/video encode, denoise, decode) and the
end-to-end runs built from them (``generate`` for T2V/T2I/TI2V, ``extend`` to continue a clip, ``refine``
for the refiner pass).

Every stage can be called alone, in any order: each runs inside ``Offloader.stage()`` (nothing
resident before or after it, also on error), places its inputs on its component's *execution*
device, and returns its results on the CPU so cached results never pin accelerator memory.
All randomness comes from one CPU ``torch.Generator`` per run, drawn in the reference's order.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .model.latents import (
    REFINER_TILE, REFINER_TILE_STRIDE, LatentNormalizer, Posterior, check_video_size, integer_pixels, latent_shape,
    pad_frames, padded_frame_count, preprocess_first_frame, resize_frames, tiling_enabled, vae_decode, vae_encode,
    vae_tiling,
)
from .model.lora import LoraStack, apply_stack, describe_stack, lora_targets, normalize_stack, read_stack
from .memory.budget import trim_heap
from .memory.offload import Offloader, check_blocks_on_gpu, check_offload_mode, resolve_device
from .memory.placement import check_component_devices
from .model.color_match import check_color_match, match_color
from .model.refiner import first_frame_pixels, refiner_frame_indices, refiner_output_fps, start_latent
from .model.block_compile import FirstStepsTimer
from .model.transformer import converted_bytes
from .sampling.context_windows import (
    DEFAULT_OVERLAP, MAX_CONTEXT_FRAMES, REFINER_CONTEXT_FRAMES, TEMPORAL, ContextWindows, centre_frame, check_context,
)
from .sampling.extend import check_extend, join, tail_pixels
from .sampling.sampler import StepCallback, sample
from .sampling.scheduling import (
    check_sampler, check_sigmas, denoise_grid_steps, dmd_package_reason, refiner_sigmas, sampler_sigmas,
)
from .sampling.speed import SpeedOptions, apply_speed
from .sampling.step_cache import check_step_cache, make_step_cache
from .prompts.prompt_schedule import PromptSchedule, check_schedule, window_parts
from .prompts.text_conditioning import (
    PromptEmbeds, encode_text, parse_prompt, resolve_negative, template_crop_start, vlm_image,
)

logger = logging.getLogger("lingbot_core")

PROMPT_CACHE_SIZE = 16  # a few prompt schedules' parts
MAX_TI2V_ASPECT = 200  # text_conditioning.smart_resize refuses images more elongated than this
REFINER_CANNOT_GENERATE = ("this pipeline holds the refiner DiT, which only refines videos; load transformer='transformer' "
                           "to generate.")
# What extend sets itself for the run it makes (the other generate options pass through).
EXTEND_SETS = frozenset({"image", "condition", "video", "video_latent", "denoise", "height", "width", "num_frames"})


@dataclass
class ImageCondition:
    """A preprocessed TI2V first frame: its VAE posterior and the pixels the VLM sees (both CPU).

    For :meth:`LingbotPipeline.extend` the posterior is the encoded tail of the clip (1 + 4k frames: k + 1
    latent frames, all pinned at the new clip's head) and the pixels are its first frame."""

    posterior: Posterior
    pixels: torch.Tensor  # (1, 3, 1, H, W) float in [0, 1]

    @property
    def size(self) -> Tuple[int, int]:
        return int(self.pixels.shape[-2]), int(self.pixels.shape[-1])

    def fingerprint(self) -> str:
        return hashlib.sha1(self.pixels.numpy().tobytes()).hexdigest()

    def _comfy_cache_tensors(self):
        """What a host's RAM-pressure output cache (ComfyUI >= 0.4) counts for a cached condition: its
        CPU tensors, which evicting it really frees (the scanner does not look inside dataclasses)."""
        return [self.posterior.moments, self.pixels]


def _check_guidance(guidance_scale: float) -> float:
    g = float(guidance_scale)
    if not np.isfinite(g) or g < 0 or g > 100:
        raise ValueError(f"guidance_scale={guidance_scale} is not allowed: use a finite value in [0, 100] (default 3.0).")
    return g


def _check_steps(steps: int) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not (1 <= steps <= 1000):
        raise ValueError(f"steps={steps} is not allowed: use an integer from 1 to 1000.")
    return int(steps)


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not (0 <= seed < 2**64):
        raise ValueError(f"seed={seed} is not allowed: use an integer from 0 to 2^64-1.")
    return int(seed)


def check_ti2v_size(height: int, width: int) -> None:
    """A valid video size whose aspect ratio the text encoder accepts for the first frame."""
    check_video_size(1, height, width)
    if max(height, width) > MAX_TI2V_ASPECT * min(height, width):  # else the VLM refuses the crop later
        raise ValueError(
            f"image-to-video needs a video aspect ratio of at most {MAX_TI2V_ASPECT}:1 (the text encoder's image "
            f"limit); width={width} x height={height} is {max(height, width) / min(height, width):.0f}:1."
        )


def _check_text_inputs(prompt, negative_prompt, guidance_scale, num_frames) -> None:
    """Reject a bad prompt / negative / guidance up front, so no VAE encode runs for a run that will fail."""
    _check_guidance(guidance_scale)
    parse_prompt(prompt)
    if negative_prompt is not None:
        resolve_negative(negative_prompt, num_frames)


def _schedule_windows(schedule: PromptSchedule, windows: Optional[ContextWindows], length: int,
                      overlap: int) -> List[int]:
    """The schedule part of each context window over ``length`` latent frames (centre-frame rule,
    lingbot_core.prompts.prompt_schedule); without windows, an error that names a window length that fits."""
    if windows is not None:
        return window_parts(schedule, [centre_frame(span) for span in windows.spans(length)])
    fits = None
    for frames in range(min(MAX_CONTEXT_FRAMES, schedule.num_frames), 4, -1):  # the longest windows that give every part one
        if (frames - 1) % TEMPORAL == 0 and overlap < frames - 1:
            try:
                _schedule_windows(schedule, check_context(frames, overlap), length, overlap)
            except ValueError:
                continue
            fits = frames
            break
    hint = f"e.g. context_frames {fits} with context_overlap {overlap}" if fits else "shorter parts are needed"
    raise ValueError(f"a prompt schedule of {len(schedule.prompts)} parts needs context windows (each window is conditioned "
                     f"on one part): set context_frames ({hint}; on GenerateVideo's context_frames widget, or the CLI's "
                     "--context_frames).")


OUTPUT_TYPES = ("np", "pt", "latent")


def _check_output_type(output_type: str) -> str:
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type={output_type!r} is not allowed: use 'np', 'pt' or 'latent'.")
    return output_type


def _output(frames: torch.Tensor, output_type: str):
    return frames.numpy() if output_type == "np" else frames


def _check_denoise(denoise: float) -> float:
    if not isinstance(denoise, (int, float, np.floating, np.integer)):
        raise ValueError(f"denoise={denoise!r} is not allowed: use a number, a strength in (0, 1] (1.0 = plain "
                         "text-to-video, lower keeps more of the input video, e.g. 0.5).")
    d = float(denoise)
    if isinstance(denoise, bool) or not np.isfinite(d) or not 0.0 < d <= 1.0:
        raise ValueError(f"denoise={denoise} is not allowed: use a strength in (0, 1] (1.0 = plain text-to-video, "
                         "lower keeps more of the input video, e.g. 0.5).")
    return d


def _video_frames(frames, min_frames: int = 1) -> torch.Tensor:
    """An input video (T, H, W, 3), checked; returned as a tensor. Float frames are in [0, 1]; integer
    frames are 0..255 values (as for an image: latents.integer_pixels) and come back as floats in [0, 1]."""
    video = frames if isinstance(frames, torch.Tensor) else torch.as_tensor(np.asarray(frames))
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"frames must be (T, H, W, 3); got shape {tuple(video.shape)}.")
    if video.shape[0] < min_frames:
        raise ValueError(f"the video needs at least {min_frames} frames; got {video.shape[0]}.")
    if not video.is_floating_point():
        return integer_pixels(video, "video").float().div_(255.0)
    if not torch.isfinite(video.float()).all():
        raise ValueError("frames contain NaN or infinite values.")
    return video


def video_noise_seed(seed: int) -> int:
    """The seed of a video-to-video run's second generator (the input video's VAE posterior draw).

    Its own stream, so the run's main generator draws exactly what text-to-video draws; derived by
    hashing, so the posterior's numbers are not the noise's (same seed, same shape would repeat them)."""
    digest = hashlib.sha256(b"lingbot-video v2v posterior " + int(seed).to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little")


class LingbotPipeline:
    """A loaded LingBot-Video model package. Build it with :func:`lingbot_core.load_pipeline`."""

    def __init__(self, transformer, text_encoder, processor, vae, scheduler_config: dict, *,
                 model_dir: Optional[str] = None, transformer_subfolder: str = "transformer",
                 offload: str = "none", device=None, blocks_on_gpu: int = 0, attention: str = "sdpa",
                 compile_blocks: bool = False, cfg_lockstep: bool = True, devices=None,
                 checkpoint_weight: Optional[Callable[[str, torch.dtype], torch.Tensor]] = None,
                 transformer_file: Optional[str] = None):
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.processor = processor
        self.vae = vae
        self.scheduler_config = dict(scheduler_config)
        self.model_dir = model_dir
        # Why this package is a DMD-distilled student (sampler "auto" -> dmd_student), or None.
        self.dmd_reason = dmd_package_reason(self.scheduler_config, model_dir, transformer_file)
        self.transformer_subfolder = transformer_subfolder
        # (key, dtype) -> the DiT tensor as loaded, read again from its file: LoRA changes restore from it.
        self._checkpoint_weight = checkpoint_weight
        self.normalizer = LatentNormalizer(vae.config.latents_mean, vae.config.latents_std)
        self.crop_start = template_crop_start(processor)
        self._prompt_cache: "OrderedDict[tuple, PromptEmbeds]" = OrderedDict()
        self._loras: Optional[LoraStack] = ()  # None: a change failed part-way (the next set_loras repairs it)
        self._merged: set = set()  # DiT parameter keys holding LoRA-merged weights
        self.offloader = Offloader(
            {"text_encoder": text_encoder, "transformer": transformer, "vae": vae},
            preload={
                # Qwen3-VL's vision tower reads its position-embedding weight directly (older transformers).
                "text_encoder": [type(text_encoder.model.visual).__name__],
                # Whole DiT blocks: a block's forward runs every CFG branch (lockstep), so its weights
                # stream in once per step; this also covers the MoE feed-forward's raw expert weights.
                "transformer": ["TransformerBlock"],
            },
            blocks_on_gpu=blocks_on_gpu,
            # Offload "block" streams these stacks through its ring: the DiT's blocks, the text encoder's
            # decoder layers (36 x 0.2 GiB; the vision tower and the token embedding are its resident part).
            stacks={"transformer": lambda dit: dit.blocks,
                    "text_encoder": lambda te: te.model.language_model.layers},
        )
        # ``devices``: optional {"text_encoder"/"vae": device} overrides (placement.py); the DiT uses ``device``.
        self.offloader.apply(offload, resolve_device(device), check_component_devices(devices))
        self._log_vram_bound()
        self.speed = SpeedOptions()
        self._compile_pending = False
        # Set by lingbot_core.parallel.parallelize when one generation is split across processes: its
        # ``cfg_runner`` (the CFG branches on two ranks, or None) and ``check_denoise``; None = all of it here.
        self.parallel = None
        self.set_speed(attention=attention, compile_blocks=compile_blocks, cfg_lockstep=cfg_lockstep)

    # -- placement -------------------------------------------------------------------------------

    @property
    def offload(self) -> str:
        return self.offloader.mode

    @property
    def blocks_on_gpu(self) -> int:
        """DiT blocks kept resident under offload ``block``."""
        return self.offloader.blocks_on_gpu

    @property
    def device(self) -> torch.device:
        """The execution device (where stages compute), whatever the offload mode."""
        return self.offloader.device

    @property
    def is_refiner(self) -> bool:
        return self.transformer_subfolder == "refiner"

    @property
    def own_sampler(self) -> str:
        """What ``sampler="auto"`` runs: ``dmd_student`` for a DMD-distilled student, else ``unipc``
        (the refiner always keeps UniPC)."""
        return "dmd_student" if self.dmd_reason and not self.is_refiner else "unipc"

    def _resolve_sampler(self, sampler: str) -> str:
        return self.own_sampler if check_sampler(sampler) == "auto" else sampler

    def device_bytes(self) -> int:
        """Weight bytes resident on the execution device right now (0 between stages when offloaded)."""
        return 0 if self.transformer is None else self.offloader.device_bytes()

    def pinned_bytes(self) -> int:
        """Page-locked host bytes held for this pipeline's weights."""
        return 0 if self.transformer is None else self.offloader.pinned_bytes()

    def set_offload(self, mode: str, device=None, blocks_on_gpu: Optional[int] = None, devices=None) -> None:
        """Switch offload mode on the loaded weights (old hooks are removed first; no reload).
        ``blocks_on_gpu`` (mode ``block``) and ``devices`` (per-component devices) keep their current
        values when ``None``."""
        self._require_loaded()
        self._require_unsplit("change the offload mode")
        check_offload_mode(mode)
        if blocks_on_gpu is not None:
            self.offloader.blocks_on_gpu = check_blocks_on_gpu(blocks_on_gpu)
        self.offloader.apply(mode, self.offloader.device if device is None else resolve_device(device),
                             None if devices is None else check_component_devices(devices))
        self._log_vram_bound()

    def vram_bound(self) -> Optional[int]:
        """Under offload ``block``: the most device bytes the DiT's weights take while it denoises: its
        resident part, the ring's buffers, and the largest block's converted copies (GGUF dequantized expert
        stacks and workspace, fp8 casts: :func:`converted_bytes`). Activations come on top. None otherwise."""
        streamer = self.offloader.streamer("transformer")
        if streamer is None:
            return None
        dtype = self.transformer.compute_dtype
        converted = max((converted_bytes(b, dtype) for b in self.transformer.blocks), default=0)
        return streamer.device_buffer_bytes() + converted

    def _log_vram_bound(self) -> None:
        if self.offloader.execution_device("transformer").type != "cuda":
            return
        bound = self.vram_bound()
        if bound is not None:
            logger.info("LingBot-Video: offload 'block' (%d blocks on the GPU): the DiT's weights take at most "
                        "%.2f GiB of VRAM while it denoises (activations come on top).", self.blocks_on_gpu, bound / 2 ** 30)

    def set_speed(self, *, attention: Optional[str] = None, compile_blocks: Optional[bool] = None,
                  cfg_lockstep: Optional[bool] = None) -> None:
        """Change the speed options on the loaded weights (no reload); ``None`` keeps a value.

        ``attention``: "sdpa" (default, the reference numbers), "flash_attn" or "sage" (CUDA, bf16/fp16;
        the package must be installed). ``compile_blocks``: torch.compile each DiT block (in every
        offload mode; the first step compiles). ``cfg_lockstep``: both CFG branches through each block while it is
        resident (default on; same frames).
        """
        self._require_loaded()
        self._require_unsplit("change the speed options")
        new = self.speed.updated(attention=attention, compile_blocks=compile_blocks, cfg_lockstep=cfg_lockstep)
        compiling = new.compile_blocks and not self.speed.compile_blocks
        self.speed = apply_speed(self.transformer, self.speed, new, self.device)
        self._compile_pending = self._compile_pending or compiling

    # -- LoRA ------------------------------------------------------------------------------------

    @property
    def loras(self) -> LoraStack:
        """The LoRA stack applied to the DiT: ``((path, strength), ...)``."""
        return self._loras

    def set_loras(self, loras) -> None:
        """Make the DiT's LoRA set exactly ``loras`` (``[(path, strength), ...]``; ``[]`` removes every LoRA).

        The files are read and checked first; an error there leaves the pipeline as it was. Touched
        weights are merged from their checkpoint values (read again from the package when a LoRA was
        merged before), so changes never drift and ``[]`` restores the loaded weights bit for bit;
        fp8 weights get run-time adapters instead (see :mod:`lingbot_core.model.lora`).
        """
        self._require_loaded()
        stack = normalize_stack(loras)
        if stack == self._loras:
            return
        self._require_unsplit("change the LoRA stack")
        loaded = read_stack(stack, lora_targets(self.transformer))
        mode, device = self.offloader.mode, self.offloader.device
        self.offloader.remove_hooks()  # weights are replaced on their home device, then re-hooked
        self._loras = None
        try:
            # On an accelerator the fp32 deltas are formed there (one weight at a time), not on the CPU.
            work = device if device.type != "cpu" else None
            report = apply_stack(self.transformer, loaded, self._merged, self._checkpoint_tensor, work)
            self._loras = stack
        finally:
            self.offloader.apply(mode, device)
            trim_heap()  # the replaced weights' pages
        logger.info("LingBot-Video: %s DiT LoRA: %s (%d weights merged, %d restored, %d fp8/GGUF layers with run-time adapters).",
                    self.transformer_subfolder, describe_stack(stack), report.merged, report.restored, report.run_time)

    def _checkpoint_tensor(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        if self._checkpoint_weight is None:
            raise RuntimeError("this pipeline was not loaded from a package; its original weights cannot be restored.")
        return self._checkpoint_weight(key, dtype)

    def release(self) -> None:
        """Remove hooks and drop every component; the pipeline is unusable afterwards."""
        self.offloader.release()
        self.transformer = self.text_encoder = self.vae = self.processor = None
        self._prompt_cache.clear()
        trim_heap()  # the tensors are already freed (no garbage collection needed); return their pages

    def _require_loaded(self):
        if self.transformer is None:
            raise RuntimeError("this pipeline was released; load the model again.")

    def _require_unsplit(self, what: str) -> None:
        if self.parallel is not None:  # its weights are sharded / hooked across the ranks
            raise ValueError(f"cannot {what} on a pipeline split across processes ({self.parallel.describe()}): "
                             "set it when loading, before lingbot_core.parallel.parallelize, or load the model again.")

    # -- stages ----------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompt(self, prompt: str, negative_prompt: Optional[str] = None, *,
                      condition: Optional[ImageCondition] = None, num_frames: int = 121,
                      guidance_scale: float = 3.0, null_negative: bool = False) -> PromptEmbeds:
        """Encode the prompt (and the negative, when guidance is on) with the text encoder.

        ``condition`` adds the TI2V first frame as image tokens to both prompts. ``null_negative``
        replaces the negative by zeros with the positive's length (the refiner's default). Results are
        kept in a small per-pipeline LRU cache, so re-running with another seed skips the encoder.
        """
        return self.encode_prompts([(prompt, negative_prompt)], condition=condition, num_frames=num_frames,
                                   guidance_scale=guidance_scale, null_negative=null_negative)[0]

    @torch.no_grad()
    def encode_prompts(self, pairs: Sequence[Tuple[str, Optional[str]]], *, condition: Optional[ImageCondition] = None,
                       num_frames: int = 121, guidance_scale: float = 3.0, null_negative: bool = False) -> List[PromptEmbeds]:
        """:meth:`encode_prompt` for several ``(prompt, negative)`` pairs (a prompt schedule's parts): pairs not in
        the cache are encoded in one stage, each distinct text once (one negative shared by all parts is
        encoded once)."""
        self._require_loaded()
        do_cfg = _check_guidance(guidance_scale) > 1.0
        fingerprint = condition.fingerprint() if condition is not None else None
        keys = []
        for prompt, negative_prompt in pairs:
            neg_text = None if (not do_cfg or null_negative) else resolve_negative(negative_prompt, num_frames)
            keys.append((parse_prompt(prompt).text, neg_text, do_cfg, null_negative, fingerprint))
        found = {}
        for key in keys:
            if key in self._prompt_cache:
                self._prompt_cache.move_to_end(key)
                found[key] = self._prompt_cache[key]
        missing = [k for k in dict.fromkeys(keys) if k not in found]
        if missing:
            texts = list(dict.fromkeys([k[0] for k in missing] + [k[1] for k in missing if k[1] is not None]))
            image = vlm_image(condition.pixels) if condition is not None else None
            with self.offloader.stage():
                # One forward per prompt, as the reference encodes them (B = 1): in a padded two-prompt batch the
                # shorter prompt's states come out different (measured: up to one bf16 step).
                self.offloader.expect_forwards(len(texts), "text_encoder")
                device = self.offloader.execution_device("text_encoder")
                states = {t: encode_text(self.text_encoder, self.processor, t, image, device, self.crop_start) for t in texts}
            for key in missing:
                positive = states[key[0]]
                negative = (torch.zeros_like(positive) if null_negative else states[key[1]]) if do_cfg else None
                found[key] = self._prompt_cache[key] = PromptEmbeds(positive, negative, with_image=condition is not None)
            while len(self._prompt_cache) > PROMPT_CACHE_SIZE:
                self._prompt_cache.popitem(last=False)
        return [found[key] for key in keys]

    @torch.no_grad()
    def encode_image(self, image, height: int, width: int) -> ImageCondition:
        """TI2V first frame: scale-to-cover + centre crop to ``height x width``, then VAE encode."""
        self._require_loaded()
        check_ti2v_size(height, width)
        pixels = preprocess_first_frame(image, height, width)
        with self.offloader.stage():
            posterior = vae_encode(self.vae, pixels, self.offloader.execution_device("vae"))
        return ImageCondition(posterior, pixels)

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor, *, tiling=False,
                     tile_size: Tuple[int, int] = REFINER_TILE, tile_stride: Tuple[int, int] = REFINER_TILE_STRIDE) -> Posterior:
        """VAE-encode pixels (1, 3, T, H, W) in [0, 1]; returns the posterior (draw it with a generator).

        The pixels stay where they are (the host): they reach the device one 4-frame chunk at a time (one
        tile's, when tiled). ``tiling`` as in :meth:`decode`."""
        self._require_loaded()
        tiling = tiling_enabled(tiling, video.shape[-2], video.shape[-1])
        with self.offloader.stage(), vae_tiling(self.vae, tiling, tile_size, tile_stride):
            return vae_encode(self.vae, video, self.offloader.execution_device("vae"))

    @torch.no_grad()
    def denoise(self, embeds: Union[PromptEmbeds, Sequence[PromptEmbeds]], latents: torch.Tensor, *, sigmas: Sequence[float],
                guidance_scale: float = 3.0, condition_latent: Optional[torch.Tensor] = None,
                callback: Optional[StepCallback] = None, step_cache: float = 0.0,
                sampler: str = "unipc", generator: Optional[torch.Generator] = None,
                windows: Optional[ContextWindows] = None) -> torch.Tensor:
        """Run the sampler (``unipc``, ``euler``, ``dmd_student`` or ``auto``: the package's own) from ``latents``
        (DiT space) through ``sigmas``; returns the final latent (CPU).

        ``condition_latent`` (1, 16, 1, h, w) is written into frame 0 before sampling and after every step.
        ``step_cache`` > 0 skips the DiT's block stack on steps whose input barely changed
        (lingbot_core.sampling.step_cache); 0 = off. ``generator`` (CPU) feeds the ancestral noise of ``dmd_student``.
        ``windows`` (lingbot_core.sampling.context_windows.check_context) runs the DiT on overlapping windows of
        latent frames, each a standalone clip, and blends their velocities; None = the whole latent at once.
        ``callback.interrupt``, when the callback has one (a callable that raises to cancel), also runs before
        each context window's DiT call and before each streamed DiT block under offload ``block``, so a long
        step can be cancelled between windows and blocks (the stage then ends: nothing stays resident).
        ``embeds`` may be a list with one entry per context window (a prompt schedule, see :meth:`generate`).
        """
        self._require_loaded()
        g = _check_guidance(guidance_scale)
        sampler = self._resolve_sampler(sampler)
        if sampler == "dmd_student" and g > 1.0:
            logger.warning("guidance_scale=%g with sampler='dmd_student': the DMD student has classifier-free guidance "
                           "distilled in, so guidance above 1.0 applies it twice (and runs the DiT twice per step); "
                           "its recipe is 1.0.", g)
        n_windows = 1 if windows is None else len(windows.spans(latents.shape[2]))
        if n_windows > 1:
            logger.info("LingBot-Video: %s.", windows.describe(latents.shape[2]))
        cfg_runner = None
        if self.parallel is not None:
            self.parallel.check_denoise(step_cache=step_cache)
            cfg_runner = self.parallel.cfg_runner
        cache = make_step_cache(step_cache, len(sigmas), (2 if g > 1.0 else 1) * n_windows)
        interrupt = getattr(callback, "interrupt", None)  # the host's cancel check, also run between blocks
        if self._compile_pending:
            callback, self._compile_pending = FirstStepsTimer(callback), False
        with self.offloader.stage():
            two_calls = g > 1.0 and not self.speed.cfg_lockstep and cfg_runner is None  # a CFG runner: one branch here
            self.offloader.expect_forwards(len(sigmas) * n_windows * (2 if two_calls else 1))
            self.offloader.set_interrupt(interrupt)
            device = self.offloader.execution_device("transformer")
            parts = [embeds] if isinstance(embeds, PromptEmbeds) else list(embeds)
            on_device = {id(e): e.to_device(device, self.transformer.compute_dtype) for e in parts}  # each part once
            per_window = None if isinstance(embeds, PromptEmbeds) else [on_device[id(e)] for e in parts]
            positive, negative = on_device[id(parts[0])]
            cond = None if condition_latent is None else condition_latent.to(device=device, dtype=torch.float32)
            try:
                x = sample(
                    self.transformer, latents.to(device=device, dtype=torch.float32), np.asarray(sigmas), positive,
                    negative if g > 1.0 else None, guidance_scale=g, condition_latent=cond,
                    scheduler_config=self.scheduler_config, callback=callback,
                    lockstep=self.speed.cfg_lockstep, step_cache=cache, sampler=sampler, generator=generator,
                    windows=windows, interrupt=interrupt, window_conditions=per_window, cfg_runner=cfg_runner,
                )
            finally:
                self.transformer.clear_rope_cache()  # its tables live on the device only during the stage
            if cache is not None:
                logger.info("%s.", cache.summary())
            x = x.to("cpu")
        if not torch.isfinite(x).all():
            # Otherwise a black video and no error: overflowing LoRA factors are the usual cause.
            lora = f" with the LoRA stack {describe_stack(self._loras)}" if self._loras else ""
            raise FloatingPointError(
                f"sampling produced NaN or infinite values{lora}; no frames were decoded. "
                + ("Lower the LoRA strengths, or remove the LoRA whose factors or alpha are out of range."
                   if self._loras else "Check the model package (download it again) and the inputs."))
        return x

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, tiling=False, tile_size: Tuple[int, int] = REFINER_TILE,
               tile_stride: Tuple[int, int] = REFINER_TILE_STRIDE, num_frames: Optional[int] = None) -> torch.Tensor:
        """DiT-space latents (1, 16, T', h, w) -> frames (T, H, W, 3) float32 in [0, 1] on the CPU.

        ``tiling`` (True/False, or a vae_tiling mode: "auto" = tiled above 720p, "on", "off") decodes in
        overlapping spatial tiles (``tile_size`` pixels, ``tile_stride`` apart, blended over the overlap), as the
        reference's refiner does, streamed to the host tile by tile; only frames larger than a tile are tiled.
        ``num_frames`` keeps the first that many frames (a video whose length is not 4n+1 was sampled with its
        tail padded: this trims the padding off); None keeps all 4(T' - 1) + 1."""
        self._require_loaded()
        decoded = (latents.shape[2] - 1) * 4 + 1
        if num_frames is not None and not 1 <= int(num_frames) <= decoded:
            raise ValueError(f"num_frames={num_frames} is not allowed: this latent decodes to {decoded} frames (1 to {decoded}).")
        tiling = tiling_enabled(tiling, latents.shape[3] * 8, latents.shape[4] * 8)
        with self.offloader.stage(), vae_tiling(self.vae, tiling, tile_size, tile_stride):
            frames = vae_decode(self.vae, self.normalizer.to_vae(latents), self.offloader.execution_device("vae"))
        return frames if num_frames is None else frames[: int(num_frames)]

    # -- runs ------------------------------------------------------------------------------------

    def generate(self, prompt: Union[str, Sequence[str]], *, negative_prompt=None, image=None,
                 height: int = 480, width: int = 832, num_frames: int = 121, steps: int = 40,
                 guidance_scale: float = 3.0, shift: float = 3.0, seed: int = 42, output_type: str = "np",
                 condition: Optional[ImageCondition] = None, callback: Optional[StepCallback] = None,
                 step_cache: float = 0.0, sampler: str = "auto", sigmas: Optional[Sequence[float]] = None,
                 video=None, video_latent: Optional[torch.Tensor] = None, denoise: float = 1.0,
                 context_frames: int = 0, context_overlap: int = DEFAULT_OVERLAP, vae_tiling="auto",
                 prompt_starts: Optional[Sequence[int]] = None):
        """T2V (num_frames 4n+1), T2I (num_frames 1), TI2V (``image`` or a precomputed ``condition``) and
        video-to-video (``video`` or ``video_latent`` with ``denoise`` < 1).

        ``sampler``: ``auto`` (the package's own: :attr:`own_sampler`), ``unipc`` (the reference), ``euler``
        (flow Euler) or ``dmd_student`` (the DMD-distilled student's sampler: its own grid, ancestral
        noise from the run's generator; 8 steps, guidance 1.0, shift 3.0). ``sigmas`` (optional, not with
        ``dmd_student``) is an explicit strictly decreasing list ending above 0 that replaces the
        ``steps`` / ``shift`` grid (a final 0 is appended), for distilled students trained on a fixed list.
        Returns frames (T, H, W, 3) float32 in [0, 1], or the final DiT-space latent for ``output_type="latent"``.
        ``step_cache``: a threshold (0 = off) for skipping the DiT's block stack on easy steps (lingbot_core.sampling.step_cache).

        Video-to-video: ``video`` (T, H, W, 3) in [0, 1], any length, is resized (bicubic, stretched) to
        ``height x width``; its length replaces ``num_frames`` and the frames come back with exactly that length
        (it is sampled at the next 4n+1 length, its last frame repeated, and trimmed after decoding; a
        ``"latent"`` output keeps the padded length). ``video_latent`` (1, 16, T', h, w) in
        Wan 2.1 VAE space (ComfyUI's LATENT, e.g. GenerateVideo's latent output) is an already encoded video (its
        size replaces height/width/num_frames; no posterior draw). ``denoise`` in (0, 1) is ComfyUI KSampler's
        strength: ``steps`` steps run, the last ``steps`` of the ``int(steps / denoise)``-step grid of the run's
        sampler (lingbot_core.sampling.scheduling.denoise_sigmas); the encoded video is re-noised to that grid's
        first sigma, ``(1 - s) x + s noise``, and denoised with the prompt. Explicit ``sigmas`` run as given, from
        their first value. ``denoise`` 1.0 is plain T2V/TI2V (the video is not used, only its length).
        With an ``image``, frame 0 is pinned to it as in TI2V.

        RNG order: the run's generator (seeded with ``seed``) draws the TI2V first-frame posterior, the
        noise (the whole latent's shape), then ``dmd_student``'s ancestral noise, exactly as text-to-video;
        the input video's posterior is drawn from a second generator seeded with :func:`video_noise_seed`.

        ``context_frames`` (pixel frames, 4n+1; 0 = off) and ``context_overlap`` (a multiple of 4): the DiT runs
        on overlapping windows of that length (lingbot_core.sampling.context_windows); a video no longer than
        one window is sampled exactly as without windows.

        A prompt schedule (lingbot_core.prompts.prompt_schedule): ``prompt`` a list of prompts, ``prompt_starts`` their
        start frames (pixel frames, from 0, strictly increasing; None = evenly spread), ``negative_prompt`` None, one
        text, or a list of one or one per part. It needs context windows; each window is conditioned on the part
        holding its centre frame, and every part must condition at least one window. Each distinct text is encoded
        once. A one-element list is the plain prompt; identical parts give exactly the single-prompt result.

        ``vae_tiling`` (``auto``, ``on``, ``off``) applies to the video's encode and the decode: ``on`` uses the
        refiner's spatial tiles (384x640, 288x480 apart) for frames larger than a tile, ``auto`` does so above 720p
        (more than 720x1280 pixels a frame, where an untiled 24 GB card runs out of memory), ``off`` never tiles.
        Tiles blend over their overlap, so tiled frames differ slightly from untiled ones. Either way the video
        reaches the device one 4-frame chunk at a time, never whole.
        """
        self._require_loaded()
        if self.is_refiner:
            raise ValueError(REFINER_CANNOT_GENERATE)
        if video is not None and video_latent is not None:
            raise ValueError("give either video (frames) or video_latent, not both.")
        denoise = _check_denoise(denoise)
        keep = None  # the input video's own frame count: the decoded frames are trimmed back to it
        if video is not None:
            video = _video_frames(video)
            keep = int(video.shape[0])
            num_frames = padded_frame_count(keep)  # sampled at 4n+1: the tail is padded, then trimmed
        if video_latent is not None:
            video_latent = self.normalizer.to_dit(self._check_video_latent(video_latent))
            _, _, t_lat, h_lat, w_lat = video_latent.shape
            num_frames, height, width = (t_lat - 1) * 4 + 1, h_lat * 8, w_lat * 8
        check_video_size(num_frames, height, width)
        tiling = tiling_enabled(vae_tiling, height, width)
        windows = check_context(context_frames, context_overlap)
        schedule = window_part = None
        if not isinstance(prompt, str):
            schedule = check_schedule(prompt, num_frames, prompt_starts, negative_prompt)
            if len(schedule.prompts) == 1:
                prompt, negative_prompt, schedule = schedule.prompts[0], schedule.negatives[0], None
            else:
                window_part = _schedule_windows(schedule, windows, latent_shape(num_frames, height, width)[2], context_overlap)
                logger.info("LingBot-Video prompt schedule: %s; the windows' parts: %s.", schedule.describe(),
                            ", ".join(str(k + 1) for k in window_part))
        elif prompt_starts is not None:
            raise ValueError("prompt_starts needs a list of prompts (a prompt schedule); with one prompt, leave it out.")
        steps, seed = _check_steps(steps), _check_seed(seed)
        check_step_cache(step_cache)
        sampler = self._resolve_sampler(sampler)
        explicit = sigmas is not None
        v2v = (video is not None or video_latent is not None) and denoise < 1.0
        if (video is not None or video_latent is not None) and not v2v:
            logger.info("LingBot-Video: denoise 1.0 is plain text-to-video; the input video is not used.")
        elif denoise < 1.0 and not v2v:
            logger.warning("LingBot-Video: denoise %g has no effect without a video (it is a video-to-video strength); "
                           "the whole schedule runs. Connect a video, or set denoise to 1.0.", denoise)
        sigmas = sampler_sigmas(sampler, steps, float(shift), sigmas, denoise if v2v else 1.0)
        if v2v:
            logger.info("LingBot-Video V2V: %d steps from sigma %.4f (denoise %g%s).", len(sigmas), float(sigmas[0]), denoise,
                        " ignored: the explicit sigmas run as given" if explicit else
                        f": the last {steps} of a {denoise_grid_steps(steps, denoise)}-step grid")
        _check_output_type(output_type)
        parts = [(prompt, negative_prompt)] if schedule is None else list(zip(schedule.prompts, schedule.negatives))
        for part_prompt, part_negative in parts:
            _check_text_inputs(part_prompt, part_negative, guidance_scale, num_frames)  # before the image is VAE-encoded
        if condition is None and image is not None:
            condition = self.encode_image(image, height, width)
        if condition is not None and condition.size != (height, width):
            raise ValueError(f"the image condition was encoded at {condition.size[0]}x{condition.size[1]} but the video is {height}x{width}; encode it at the video size.")
        if condition is not None and condition.posterior.latent_frames > latent_shape(num_frames, height, width)[2]:
            raise ValueError(f"the condition pins {condition.posterior.latent_frames} latent frames but a {num_frames}-frame video "
                             "has fewer; make the video longer.")
        source = None
        if v2v:
            if video_latent is None:
                pixels = pad_frames(resize_frames(video.float().clamp(0, 1), height, width), num_frames, dim=2)
                posterior = self.encode_video(pixels, tiling=tiling)
                video_latent = self.normalizer.to_dit(posterior.sample(torch.Generator("cpu").manual_seed(video_noise_seed(seed))))
            source = video_latent.float()
        encoded = self.encode_prompts(parts, condition=condition, num_frames=num_frames, guidance_scale=guidance_scale)
        embeds = encoded[0] if schedule is None else [encoded[k] for k in window_part]
        generator = torch.Generator("cpu").manual_seed(seed)
        # RNG order: TI2V first-frame posterior draw, the initial noise, then (dmd_student) one draw per ancestral step.
        cond_latent = None
        if condition is not None:
            cond_latent = self.normalizer.to_dit(condition.posterior.sample(generator)).float()
        noise = torch.randn(latent_shape(num_frames, height, width, self.transformer.config.in_channels), generator=generator, dtype=torch.float32)
        start = noise if source is None else start_latent(source, noise, float(sigmas[0]))
        latents = self.denoise(embeds, start, sigmas=sigmas, guidance_scale=guidance_scale, condition_latent=cond_latent,
                               callback=callback, step_cache=step_cache, sampler=sampler, generator=generator,
                               windows=windows)
        if output_type == "latent":
            return latents
        return _output(self.decode(latents, num_frames=keep, tiling=tiling), output_type)

    def extend(self, video, prompt: str, *, new_frames: int, keep_frames: int = 1, color_match: str = "off",
               vae_tiling="auto", output_type: str = "np", **options):
        """Continue a clip: ``video`` (T, H, W, 3) in [0, 1] followed by ``new_frames`` (4n) new frames, at the video's size.

        The new frames are the tail of an image-to-video run of ``keep_frames + new_frames`` frames whose first
        ``keep_frames`` (1 + 4k) frames are the video's last ones, encoded and pinned as clean latent frames before
        sampling and after every step (lingbot_core.sampling.extend). ``keep_frames`` 1 is image-to-video from the
        last frame (the same frames, bit for bit); 5 or 9 carry the motion across the seam. The text encoder sees
        the pinned head's first frame, as it sees a TI2V image. The input's frames come back unchanged, then the new
        ones: no frame twice. ``color_match`` ("off", "mean-std": lingbot_core.model.color_match) maps the new
        frames' colour statistics to the last input frame's. ``output_type`` "np" or "pt".

        ``options`` are :meth:`generate`'s (steps, guidance_scale, shift, seed, negative_prompt, sampler, sigmas,
        step_cache, context_frames, context_overlap, callback); the size, the length and the conditioning are
        extend's own. RNG order as TI2V: the tail's posterior draw, then the noise. ``vae_tiling`` as in
        :meth:`generate`, also for the tail's encode when it is longer than one frame (one frame never tiles, as
        TI2V's image).
        """
        self._require_loaded()
        if self.is_refiner:
            raise ValueError(REFINER_CANNOT_GENERATE)
        taken = sorted(EXTEND_SETS & set(options))
        if taken:
            raise ValueError(f"extend sets {', '.join(taken)} itself (the video's size, keep_frames + new_frames frames, "
                             "its tail as the condition); leave them out.")
        if output_type not in ("np", "pt"):
            raise ValueError(f"output_type={output_type!r} is not allowed for extend: use 'np' or 'pt' (the joined frames).")
        check_color_match(color_match)
        video = video if isinstance(video, torch.Tensor) else torch.as_tensor(np.asarray(video))
        plan = check_extend(video.shape, keep_frames, new_frames)
        video = _video_frames(video)
        check_ti2v_size(plan.height, plan.width)
        parse_prompt(prompt)  # a bad prompt fails before the tail's VAE encode
        pixels = tail_pixels(video, plan)
        # One frame is image-to-video's own encode (never tiled), so keep_frames 1 equals TI2V at every size.
        tiling = plan.keep > 1 and tiling_enabled(vae_tiling, plan.height, plan.width)
        condition = ImageCondition(self.encode_video(pixels, tiling=tiling), pixels[:, :, :1])
        clip = self.generate(prompt, condition=condition, height=plan.height, width=plan.width,
                             num_frames=plan.clip_frames, vae_tiling=vae_tiling, output_type="pt", **options)
        joined = join(video, clip, plan)
        joined[video.shape[0]:] = match_color(joined[video.shape[0]:], video[-1], color_match)
        return _output(joined, output_type)

    def _check_video_latent(self, latent: torch.Tensor) -> torch.Tensor:
        channels = self.transformer.config.in_channels
        if not isinstance(latent, torch.Tensor) or latent.ndim != 5 or latent.shape[0] != 1 or latent.shape[1] != channels:
            shape = tuple(latent.shape) if isinstance(latent, torch.Tensor) else type(latent).__name__
            raise ValueError(f"video_latent must be a LingBot-Video / Wan 2.1 latent (1, {channels}, T, h, w) (GenerateVideo's "
                             f"latent output); got {shape}.")
        if latent.shape[3] % 2 or latent.shape[4] % 2:
            raise ValueError(f"video_latent's height and width ({latent.shape[3]}x{latent.shape[4]}) must be even (pixel "
                             "sizes a multiple of 16).")
        if not torch.isfinite(latent).all():
            raise ValueError("video_latent contains NaN or infinite values.")
        return latent.float().cpu()

    def refine(self, frames, prompt: str, *, negative_prompt: Optional[str] = None, first_frame=None,
               height: int = 1088, width: int = 1920, steps: int = 8, guidance_scale: float = 3.0,
               shift: float = 3.0, t_thresh: float = 0.85, tail_steps: int = 2, seed: int = 42,
               fps: float = 24.0, max_frames: Optional[int] = None, vae_tiling: bool = True,
               tile_size: Tuple[int, int] = REFINER_TILE, tile_stride: Tuple[int, int] = REFINER_TILE_STRIDE,
               output_type: str = "np", callback: Optional[StepCallback] = None, step_cache: float = 0.0,
               sampler: str = "unipc", sigmas: Optional[Sequence[float]] = None,
               context_frames: int = REFINER_CONTEXT_FRAMES, context_overlap: int = DEFAULT_OVERLAP):
        """The refiner pass: base frames (T, H, W, 3) in [0, 1] -> frames at ``height x width``.

        ``sampler``: ``unipc`` (the refiner's own, also what ``auto`` means here) or ``euler``; ``dmd_student`` is
        refused (the refiner keeps flow UniPC). ``sigmas`` as in :meth:`generate`; explicit ``sigmas`` replace
        the cut grid and the video is re-noised to their first value (instead of ``t_thresh``).
        ``negative_prompt=None`` uses the zeroed negative (the refiner default); a string is encoded.
        ``first_frame`` (the TI2V input image) is re-pinned as the clean first latent frame.
        ``vae_tiling`` tiles the VAE encode and the decode (``tile_size`` / ``tile_stride`` in pixels).
        ``context_frames`` / ``context_overlap`` (pixel frames): a video longer than ``context_frames`` (default
        121, the refiner's clip) is denoised in overlapping windows (lingbot_core.sampling.context_windows), so any
        length fits the memory of one clip; 0 = the whole video as one clip.
        """
        self._require_loaded()
        if not self.is_refiner:
            raise ValueError("Refine needs the refiner DiT: load the MoE package with transformer='refiner'.")
        sampler = self._resolve_sampler(sampler)
        if sampler == "dmd_student":
            raise ValueError("sampler='dmd_student' is the DMD student's base-model sampler; the refiner keeps flow UniPC: "
                             "use sampler 'unipc' (or 'auto') for Refine.")
        video = _video_frames(frames)
        # The minimum holds for what the refiner sees: the frames left after resampling to its rate (and max_frames).
        indices = refiner_frame_indices(video.shape[0], fps, max_frames)
        if len(indices) < 5:
            after = (f"; at {fps:g} fps they are resampled to {len(indices)} at the refiner's {refiner_output_fps(fps):g} fps"
                     + (f" (max_frames={max_frames})" if max_frames else "") if len(indices) != video.shape[0] else "")
            raise ValueError(f"Refine needs a video of at least 5 frames; got {video.shape[0]}{after} (the refiner is not "
                             "trained on images).")
        check_video_size(1, height, width)
        windows = check_context(context_frames, context_overlap)
        steps, seed = _check_steps(steps), _check_seed(seed)
        check_step_cache(step_cache)
        if sigmas is None:
            sigmas = refiner_sigmas(steps, float(shift), float(t_thresh), int(tail_steps))
        else:
            sigmas = check_sigmas(sigmas)
            t_thresh = float(sigmas[0])
        base_h, base_w = int(video.shape[1]), int(video.shape[2])

        _check_output_type(output_type)
        _check_text_inputs(prompt, negative_prompt, guidance_scale, video.shape[0])  # before the video is VAE-encoded
        # Every kept frame is refined: the tail is padded to 4n+1 for the VAE and trimmed after decoding.
        lowres = pad_frames(resize_frames(video[indices].float().clamp(0, 1), height, width), padded_frame_count(len(indices)), dim=2)
        tiling = dict(tiling=vae_tiling, tile_size=tile_size, tile_stride=tile_stride)
        # RNG order (fresh generator): video posterior, TI2V first-frame posterior, then the noise.
        generator = torch.Generator("cpu").manual_seed(seed)
        z = self.encode_video(lowres, **tiling).sample(generator)
        x_up = self.normalizer.to_dit(z).to(z.dtype)  # the video path keeps the latent's dtype
        cond_latent = None
        if first_frame is not None:
            pixels = first_frame_pixels(first_frame, base_h, base_w, height, width)
            cond_latent = self.normalizer.to_dit(self.encode_video(pixels, **tiling).sample(generator)).float()
            x_up[:, :, 0:1] = cond_latent.to(x_up.dtype)
        noise = torch.randn(x_up.shape, generator=generator, dtype=x_up.dtype)
        latent0 = start_latent(x_up, noise, t_thresh)

        embeds = self.encode_prompt(prompt, negative_prompt, guidance_scale=guidance_scale,
                                    num_frames=video.shape[0], null_negative=negative_prompt is None)
        latents = self.denoise(embeds, latent0, sigmas=sigmas, guidance_scale=guidance_scale, condition_latent=cond_latent,
                               callback=callback, step_cache=step_cache, sampler=sampler, windows=windows)
        if output_type == "latent":
            return latents
        return _output(self.decode(latents, num_frames=len(indices), **tiling), output_type)
