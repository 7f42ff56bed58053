"""GenerateVideo (T2V / T2I / TI2V) and Refine (the MoE refiner pass)."""

from __future__ import annotations

import logging

from ..lingbot_core import parse_prompt
from ..lingbot_core.model.refiner import refiner_output_fps
from ..lingbot_core.model.latents import MAX_FRAMES, MAX_SIDE, SIZE_MULTIPLE, TEMPORAL_COMPRESSION, VAE_TILING_MODES
from ..lingbot_core.sampling.context_windows import DEFAULT_OVERLAP, MAX_CONTEXT_FRAMES, REFINER_CONTEXT_FRAMES
from ..lingbot_core.sampling.scheduling import SAMPLERS, parse_sigmas
from ..lingbot_core.prompts.text_conditioning import frames_for_prompt, negative_from_widget
from .comfy_memory import free_comfy_models
from .progress import step_callback

logger = logging.getLogger("lingbot_video_nodes")

SEED_MAX = 0xFFFFFFFFFFFFFFFF


def _context_inputs(default_frames: int, off: str) -> dict:
    """The two context-window widgets (pixel frames), shared by GenerateVideo and Refine."""
    return {
        "context_frames": ("INT", {"default": default_frames, "min": 1, "max": MAX_CONTEXT_FRAMES, "step": TEMPORAL_COMPRESSION,
                           "tooltip": f"Context windows: the DiT sees the video as overlapping clips of this many frames (4n+1), "
                                      f"one at a time, so a long video needs the memory of one clip. {off} A video no longer "
                                      f"than one window is sampled exactly as without windows."}),
        "context_overlap": ("INT", {"default": DEFAULT_OVERLAP, "min": 0, "max": MAX_CONTEXT_FRAMES - 1, "step": TEMPORAL_COMPRESSION,
                            "tooltip": "Frames neighbouring windows share (a multiple of 4, below context_frames - 1); their "
                                       "results are blended linearly over the overlap. More overlap: smoother joins, more DiT runs."}),
    }


def _latent_output(pipe, latents):
    # ComfyUI's LATENT convention for Wan-style video: raw VAE space, on the CPU.
    return {"samples": pipe.normalizer.to_vae(latents).cpu()}


class GenerateVideo:
    DESCRIPTION = (
        "Text-to-video, text-to-image (num_frames 1) and image-to-video (connect image_condition) with "
        "LingBot-Video. Changing only the seed re-uses the encoded prompt."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "generate"
    RETURN_TYPES = ("IMAGE", "LATENT")
    RETURN_NAMES = ("frames", "latent")
    OUTPUT_TOOLTIPS = (
        "The frames (T, H, W, 3) as an IMAGE batch; connect to CreateVideo / SaveVideo or Refine.",
        "The final latent in Wan 2.1 VAE space, on the CPU. To decode it with ComfyUI's VAE Decode, connect it to 'samples' "
        "and 'LingBot-Video Load VAE (native)' (same package) to 'vae'. Load VAE cannot read the package's vae/ file "
        "(only one converted with 'python -m lingbot_core convert-vae').",
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": ("LINGBOT_PIPE", {"tooltip": "The base pipeline (transformer='transformer')."}),
                "prompt": ("STRING", {"multiline": True, "default": "",
                           "tooltip": "A structured JSON caption (recommended; the model is trained on them, e.g. from LoadLingbotPrompt) or plain text. Text starting with '{' must be valid JSON."}),
                "negative_prompt": ("STRING", {"multiline": True, "default": "",
                                    "tooltip": "Empty = the model's default negative (video or image). JSON text is used as a compact JSON caption."}),
                "width": ("INT", {"default": 832, "min": SIZE_MULTIPLE, "max": MAX_SIDE, "step": SIZE_MULTIPLE, "tooltip": f"Width in pixels, a multiple of {SIZE_MULTIPLE} (480p 16:9 = 832)."}),
                "height": ("INT", {"default": 480, "min": SIZE_MULTIPLE, "max": MAX_SIDE, "step": SIZE_MULTIPLE, "tooltip": f"Height in pixels, a multiple of {SIZE_MULTIPLE}."}),
                "num_frames": ("INT", {"default": 121, "min": 1, "max": MAX_FRAMES, "step": TEMPORAL_COMPRESSION,
                               "tooltip": "1 (an image) or 4n+1 frames; 121 = 5 s at 24 fps. A caption's duration overrides it when use_caption_duration is on."}),
                "steps": ("INT", {"default": 40, "min": 1, "max": 200, "tooltip": "Sampling steps; 40 is the reference setting (8 for the DMD student)."}),
                "guidance_scale": ("FLOAT", {"default": 3.0, "min": 0.0, "max": 30.0, "step": 0.1, "tooltip": "Classifier-free guidance; 3.0 is the reference setting, <= 1 disables it (twice as fast)."}),
                "shift": ("FLOAT", {"default": 3.0, "min": 0.1, "max": 20.0, "step": 0.1, "tooltip": "Sigma shift of the flow schedule; 3.0 is the reference setting."}),
                "seed": ("INT", {"default": 42, "min": 0, "max": SEED_MAX, "tooltip": "Same seed, same video in every offload mode on the same device and precision. Noise is drawn on the CPU, so the start is the same everywhere, but auto precision is fp32 on a CPU and bf16 on a GPU (fp16 below sm80), so frames from different devices differ slightly."}),
            },
            "optional": {
                "image_condition": ("LINGBOT_IMAGE_COND", {"tooltip": "First frame from EncodeImageVAE (image-to-video). Its size must match width x height."}),
                "use_caption_duration": ("BOOLEAN", {"default": True, "tooltip": "When the prompt is a JSON caption with a duration, derive num_frames from it (as the reference runner)."}),
                "fps": ("INT", {"default": 24, "min": 1, "max": 120, "tooltip": "Frame rate used with a caption's duration."}),
                "step_cache": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
                               "tooltip": "Skip the DiT on steps whose input barely changed and reuse its last residual (EasyCache rule). 0 = off (exact); 0.05 EasyCache's default, about 0.1 = 2x, 0.2 = 3x fewer DiT runs. Not for few-step / distilled schedules."}),
                "sampler": (list(SAMPLERS), {"default": "auto", "tooltip": "auto: the package's own sampler (dmd_student for the DMD-distilled MoE student, unipc for every other package). unipc: the reference solver (also what LightX2V runs its four-step LoRA with). euler: flow Euler, for distilled models trained with it. dmd_student: the 8-step DMD student's sampler (use 8 steps, guidance 1.0, shift 3.0)."}),
                "sigmas": ("STRING", {"default": "", "tooltip": "Optional explicit noise levels, strictly decreasing in (0, 1], e.g. 1.0, 0.9, 0.75, 0.5 (a final 0 is added). They replace steps and shift. Empty = the steps/shift grid. Not with dmd_student (it keeps its own grid)."}),
                "video": ("IMAGE", {"tooltip": "Video-to-video: the input video (e.g. from Get Video Components), any length, stretched to width x height; its length replaces num_frames and the frames come back with the same count. Used when denoise is below 1."}),
                "video_latent": ("LATENT", {"tooltip": "Video-to-video from a latent instead of frames: a LingBot-Video / Wan 2.1 latent (GenerateVideo's latent output); its size sets width, height and num_frames."}),
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.01, "max": 1.0, "step": 0.01,
                            "tooltip": "Video-to-video strength, as in KSampler: `steps` steps run, the last ones of a grid of steps/denoise steps, so the video is re-noised to that point (the log says the sigma). 1.0 = plain text/image-to-video (the video is ignored); lower keeps more of the video (with shift 3: 0.3 starts at sigma 0.57, 0.5 at 0.75, 0.7 at 0.88)."}),
                **_context_inputs(1, "1 (the minimum) = off: the whole video in one pass."),
                # A link, not a widget: it takes no place among the widget values.
                "prompt_schedule": ("LINGBOT_PROMPT_SCHEDULE", {"tooltip": "A prompt per part of the video (LingBot-Video Prompt Schedule). It replaces prompt (leave it empty) and, when it has negatives, negative_prompt; num_frames sets the length (caption durations are not used). Needs context_frames: each window is conditioned on the part at its centre frame, and every part needs a window."}),
                # Last, so that a saved workflow's widget values keep their places.
                "vae_tiling": (list(VAE_TILING_MODES), {"default": "auto", "tooltip": "Tiled VAE encode (video-to-video) and decode, with the refiner's 384x640 tiles. auto: tiled above 720p (more than 720x1280 pixels a frame), where an untiled 1080p decode needs 30-40 GB of VRAM; on: always; off: never. Tiles blend over their overlap, so frames differ slightly from untiled ones."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def generate(self, pipe, prompt, negative_prompt, width, height, num_frames, steps, guidance_scale, shift, seed,
                 image_condition=None, use_caption_duration=True, fps=24, step_cache=0.0, sampler="auto", sigmas="",
                 video=None, video_latent=None, denoise=1.0, context_frames=1, context_overlap=DEFAULT_OVERLAP,
                 vae_tiling="auto", prompt_schedule=None, unique_id=None):
        negative, starts = negative_from_widget(negative_prompt), None
        if prompt_schedule is not None:
            if prompt.strip():
                logger.info("GenerateVideo: prompt_schedule is connected; the prompt box is not used.")
            prompt, starts = list(prompt_schedule["prompts"]), prompt_schedule["starts"]
            negative = prompt_schedule["negatives"] or negative
        else:
            parsed = parse_prompt(prompt)
            for warning in parsed.warnings:
                logger.warning("GenerateVideo prompt: %s", warning)
            num_frames = frames_for_prompt(parsed, num_frames, fps, use_caption_duration)
        explicit = parse_sigmas(sigmas or "")
        if video is not None and video_latent is not None:
            raise ValueError("GenerateVideo: connect either video or video_latent, not both.")
        samples = None if video_latent is None else video_latent.get("samples") if isinstance(video_latent, dict) else video_latent
        free_comfy_models()
        latents = pipe.generate(
            prompt, negative_prompt=negative, prompt_starts=starts, condition=image_condition, height=height, width=width,
            num_frames=num_frames, steps=steps, guidance_scale=guidance_scale, shift=shift, seed=seed,
            output_type="latent", callback=step_callback(unique_id, steps if explicit is None else len(explicit)),
            step_cache=step_cache, sampler=sampler, sigmas=explicit, video=video, video_latent=samples, denoise=denoise,
            context_frames=context_frames, context_overlap=context_overlap, vae_tiling=vae_tiling,
        )
        keep = None if video is None else int(video.shape[0])  # the video's own length (sampled padded to 4n+1)
        return (pipe.decode(latents, num_frames=keep, tiling=vae_tiling), _latent_output(pipe, latents))


class Refine:
    DESCRIPTION = (
        "The LingBot-Video refiner: re-noises the base video to t_thresh at the refiner resolution and "
        "denoises it with the refiner DiT (MoE package, LoadLingbotPipeline transformer='refiner')."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "refine"
    RETURN_TYPES = ("IMAGE", "FLOAT")
    RETURN_NAMES = ("frames", "fps")
    OUTPUT_TOOLTIPS = ("The refined frames (T, H, W, 3) at the refiner size: as many as came in (at 24 fps or slower), or the "
                       "same duration resampled to 24 fps.",
                       "The refined frames' frame rate: fps, or 24 when fps was faster. Connect it to CreateVideo's fps so "
                       "picture and sound keep the same length.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": ("LINGBOT_PIPE", {"tooltip": "The refiner pipeline (LoadLingbotPipeline with transformer='refiner'). A base pipeline here stops the run at its loader, before anything is sampled."}),
                "frames": ("IMAGE", {"tooltip": "The base video frames (at least 5), e.g. GenerateVideo's frames."}),
                "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "The same caption as the base run (text only; no image tokens)."}),
                "negative_prompt": ("STRING", {"multiline": True, "default": "",
                                    "tooltip": "Empty = the refiner's default zeroed negative. Text here is encoded instead."}),
                "width": ("INT", {"default": 1920, "min": SIZE_MULTIPLE, "max": MAX_SIDE, "step": SIZE_MULTIPLE, "tooltip": f"Refiner output width (multiple of {SIZE_MULTIPLE})."}),
                "height": ("INT", {"default": 1088, "min": SIZE_MULTIPLE, "max": MAX_SIDE, "step": SIZE_MULTIPLE, "tooltip": f"Refiner output height (multiple of {SIZE_MULTIPLE})."}),
                "steps": ("INT", {"default": 8, "min": 1, "max": 200, "tooltip": "Steps of the full grid before it is cut at t_thresh (8 -> 6 + tail steps)."}),
                "guidance_scale": ("FLOAT", {"default": 3.0, "min": 0.0, "max": 30.0, "step": 0.1, "tooltip": "Classifier-free guidance (3.0 reference)."}),
                "shift": ("FLOAT", {"default": 3.0, "min": 0.1, "max": 20.0, "step": 0.1, "tooltip": "Sigma shift (3.0 reference)."}),
                "t_thresh": ("FLOAT", {"default": 0.85, "min": 0.01, "max": 1.0, "step": 0.01, "tooltip": "Noise level the refinement starts from (0.85 reference); lower keeps more of the base video."}),
                "tail_steps": ("INT", {"default": 2, "min": 0, "max": 20, "tooltip": "Extra low-noise steps appended after the grid (2 reference)."}),
                "seed": ("INT", {"default": 42, "min": 0, "max": SEED_MAX, "tooltip": "Seed of the refiner's own generator."}),
                "vae_tiling": ("BOOLEAN", {"default": True, "tooltip": "Tiled VAE encode and decode (384x640 tiles, 288x480 stride, as the reference refiner); keeps 1080p within VRAM. Tiles blend over their overlap, so frames differ slightly from an untiled decode."}),
            },
            "optional": {
                "first_frame": ("IMAGE", {"tooltip": "Image-to-video only: the original input image, re-pinned as the clean first frame."}),
                "fps": ("FLOAT", {"default": 24.0, "min": 1.0, "max": 120.0, "step": 0.001, "tooltip": "Frame rate of the base video (connect Get Video Components' fps); faster videos are resampled to 24 fps, keeping their duration."}),
                "step_cache": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
                               "tooltip": "Skip the DiT on steps whose input barely changed and reuse its last residual (EasyCache rule). 0 = off (exact); 0.05 EasyCache's default, about 0.1 = 2x, 0.2 = 3x fewer DiT runs. Not for few-step / distilled schedules."}),
                **_context_inputs(REFINER_CONTEXT_FRAMES, "121 = the refiner's clip (5 s); 1 (the minimum) = off: the whole video as one clip, only for short videos."),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def refine(self, pipe, frames, prompt, negative_prompt, width, height, steps, guidance_scale, shift, t_thresh,
               tail_steps, seed, vae_tiling, first_frame=None, fps=24, step_cache=0.0,
               context_frames=REFINER_CONTEXT_FRAMES, context_overlap=DEFAULT_OVERLAP, unique_id=None):
        free_comfy_models()
        out = pipe.refine(
            frames, prompt, negative_prompt=negative_from_widget(negative_prompt),
            first_frame=None if first_frame is None else first_frame[0], height=height, width=width, steps=steps,
            guidance_scale=guidance_scale, shift=shift, t_thresh=t_thresh, tail_steps=tail_steps, seed=seed,
            fps=fps, vae_tiling=vae_tiling, output_type="pt", callback=step_callback(unique_id), step_cache=step_cache,
            context_frames=context_frames, context_overlap=context_overlap,
        )
        return (out, refiner_output_fps(fps))
