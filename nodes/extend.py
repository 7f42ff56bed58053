"""ExtendVideo: continue a clip that exists (lingbot_core's pipe.extend)."""

from __future__ import annotations

import logging

from ..lingbot_core import parse_prompt
from ..lingbot_core.model.color_match import COLOR_MATCH_MODES
from ..lingbot_core.model.latents import MAX_FRAMES, TEMPORAL_COMPRESSION
from ..lingbot_core.sampling.context_windows import DEFAULT_OVERLAP
from ..lingbot_core.sampling.scheduling import parse_sigmas
from ..lingbot_core.prompts.text_conditioning import negative_from_widget
from .comfy_memory import free_comfy_models
from .progress import step_callback
from .sampling import GenerateVideo

logger = logging.getLogger("lingbot_video_nodes")

# GenerateVideo's widgets that mean the same here (one definition: the tooltips stay in step).
_SHARED_REQUIRED = ("steps", "guidance_scale", "shift", "seed")
_SHARED_OPTIONAL = ("step_cache", "sampler", "sigmas", "context_frames", "context_overlap", "vae_tiling")


class ExtendVideo:
    DESCRIPTION = (
        "Continues a video: generates new_frames more frames at the video's own size, conditioned on its last "
        "keep_frames frames exactly as image-to-video is on its image (keep_frames 1 = image-to-video from the last "
        "frame; 5 or 9 also carry the motion across the seam). The output is the input, unchanged, followed by the "
        "new frames (no frame twice), at the input's fps; chain it, or feed it to Refine or video-to-video."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "extend"
    RETURN_TYPES = ("IMAGE", "FLOAT")
    RETURN_NAMES = ("frames", "fps")
    OUTPUT_TOOLTIPS = (
        "The input frames, unchanged, then the new ones (input length + new_frames); connect to another Extend Video, "
        "Refine or CreateVideo.",
        "The input's frame rate (the fps input), passed on for CreateVideo or the next node.",
    )

    @classmethod
    def INPUT_TYPES(cls):
        generate = GenerateVideo.INPUT_TYPES()
        return {
            "required": {
                "pipe": ("LINGBOT_PIPE", {"tooltip": "The base pipeline (transformer='transformer'), the one that made the clip or any other."}),
                "frames": ("IMAGE", {"tooltip": "The video to continue (e.g. GenerateVideo's frames, Get Video Components' images or "
                                                "another Extend Video). Its size is kept; both sides must be multiples of 16."}),
                "prompt": ("STRING", {"multiline": True, "default": "",
                           "tooltip": "What happens next: a JSON caption (recommended) or plain text. The text encoder also "
                                      "sees the first kept frame, as it sees an image-to-video image."}),
                "negative_prompt": ("STRING", {"multiline": True, "default": "",
                                    "tooltip": "Empty = the model's default video negative."}),
                "new_frames": ("INT", {"default": 80, "min": TEMPORAL_COMPRESSION, "max": MAX_FRAMES - 1, "step": TEMPORAL_COMPRESSION,
                               "tooltip": "Frames to add, a multiple of 4 (80 = 3.3 s at 24 fps). keep_frames + new_frames is "
                                          "the clip the model samples: 81 or 121 frames are what it knows best."}),
                "keep_frames": ("INT", {"default": 1, "min": 1, "max": MAX_FRAMES - TEMPORAL_COMPRESSION, "step": TEMPORAL_COMPRESSION,
                                "tooltip": "How many of the video's last frames condition the new ones, 1 + 4k (1, 5, 9). 1 = "
                                           "image-to-video from the last frame (what the model is trained on); 5 or 9 pin 2 or "
                                           "3 latent frames and carry the motion across the seam. At most the video's length."}),
                **{name: generate["required"][name] for name in _SHARED_REQUIRED},
            },
            "optional": {
                "fps": ("FLOAT", {"default": 24.0, "min": 1.0, "max": 120.0, "step": 0.001,
                        "tooltip": "The video's frame rate (connect Get Video Components' fps or a Refine's fps); passed "
                                   "on unchanged at the fps output."}),
                "color_match": (list(COLOR_MATCH_MODES), {"default": "off",
                                "tooltip": "Against colour drift over chained extends. off: the frames as sampled. mean-std: "
                                           "each channel's mean and spread over the new frames mapped to the last input "
                                           "frame's (one map for the whole part: light changes within it are kept)."}),
                **{name: generate["optional"][name] for name in _SHARED_OPTIONAL},
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def extend(self, pipe, frames, prompt, negative_prompt, new_frames, keep_frames, steps, guidance_scale, shift, seed,
               fps=24.0, color_match="off", step_cache=0.0, sampler="auto", sigmas="", context_frames=1,
               context_overlap=DEFAULT_OVERLAP, vae_tiling="auto", unique_id=None):
        for warning in parse_prompt(prompt).warnings:
            logger.warning("ExtendVideo prompt: %s", warning)
        explicit = parse_sigmas(sigmas or "")
        free_comfy_models()
        out = pipe.extend(
            frames, prompt, new_frames=new_frames, keep_frames=keep_frames, color_match=color_match,
            negative_prompt=negative_from_widget(negative_prompt), steps=steps, guidance_scale=guidance_scale, shift=shift,
            seed=seed, callback=step_callback(unique_id, steps if explicit is None else len(explicit)),
            step_cache=step_cache, sampler=sampler, sigmas=explicit, context_frames=context_frames,
            context_overlap=context_overlap, vae_tiling=vae_tiling, output_type="pt",
        )
        return (out, float(fps))
