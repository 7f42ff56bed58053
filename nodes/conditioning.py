"""EncodeImageVAE (TI2V first frame) and LoadLingbotPrompt (a rewriter prompt.json)."""

from __future__ import annotations

import logging
import os

import folder_paths

from ..lingbot_core import frames_for_duration, parse_prompt
from ..lingbot_core.files.named_files import inside
from ..lingbot_core.model.latents import MAX_SIDE, SIZE_MULTIPLE
from ..lingbot_core.pipeline import MAX_TI2V_ASPECT
from ..lingbot_core.prompts.text_conditioning import compact_json, read_prompt_file

logger = logging.getLogger("lingbot_video_nodes")


class EncodeImageVAE:
    DESCRIPTION = (
        "Prepares the first frame for image-to-video: scales the image to cover width x height, centre-crops "
        "it and encodes it with the pipeline's VAE. The result stays on the CPU and can be reused by any "
        "number of GenerateVideo nodes; it is safe to run before or after any other branch."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "encode"
    RETURN_TYPES = ("LINGBOT_IMAGE_COND",)
    RETURN_NAMES = ("image_condition",)
    OUTPUT_TOOLTIPS = ("First-frame condition (VAE posterior + the pixels the text encoder sees); connect to GenerateVideo.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": ("LINGBOT_PIPE", {"tooltip": "The base pipeline from LoadLingbotPipeline."}),
                "image": ("IMAGE", {"tooltip": "The first frame. For a batch, the first image is used."}),
                "width": ("INT", {"default": 832, "min": SIZE_MULTIPLE, "max": MAX_SIDE, "step": SIZE_MULTIPLE,
                          "tooltip": f"Video width in pixels (multiple of {SIZE_MULTIPLE}); must match GenerateVideo. The longer side may be at most {MAX_TI2V_ASPECT} times the shorter."}),
                "height": ("INT", {"default": 480, "min": SIZE_MULTIPLE, "max": MAX_SIDE, "step": SIZE_MULTIPLE,
                           "tooltip": f"Video height in pixels (multiple of {SIZE_MULTIPLE}); must match GenerateVideo. The longer side may be at most {MAX_TI2V_ASPECT} times the shorter."}),
            }
        }

    def encode(self, pipe, image, width, height):
        if image.ndim != 4 or image.shape[0] < 1:
            raise ValueError(f"image must be an IMAGE batch (B, H, W, C); got shape {tuple(image.shape)}.")
        if image.shape[0] > 1:
            logger.warning("EncodeImageVAE: got %d images; using the first as the first frame.", image.shape[0])
        return (pipe.encode_image(image[0], height, width),)


def _prompt_files():
    root = folder_paths.get_input_directory()
    out = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.lower().endswith(".json"):
                out.append(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
    return sorted(out)


class LoadLingbotPrompt:
    DESCRIPTION = (
        "Loads a structured caption saved by the LingBot-Video prompt rewriter (prompt.json: "
        "{\"caption\": {...}, \"duration\": seconds}) from ComfyUI's input folder. The DiT is trained on these "
        "JSON captions; plain prose works but is out of distribution."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "load"
    RETURN_TYPES = ("STRING", "INT", "FLOAT")
    RETURN_NAMES = ("prompt", "num_frames", "duration")
    OUTPUT_TOOLTIPS = (
        "The prompt file's object as compact JSON ({\"caption\": ..., \"duration\": ...}), ready for GenerateVideo's "
        "and Refine's prompt: they encode only the caption, and GenerateVideo takes the frame count from the duration "
        "when use_caption_duration is on.",
        "Frames for the caption's duration at fps (4n+1); 0 when the file has no duration.",
        "The caption's duration in seconds (0 when absent).",
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "prompt_file": (_prompt_files() or ["(no .json file in input/)"], {"tooltip": "A prompt.json in ComfyUI's input folder."}),
                "fps": ("INT", {"default": 24, "min": 1, "max": 120, "tooltip": "Frame rate used to turn the duration into a frame count."}),
            }
        }

    @classmethod
    def IS_CHANGED(cls, prompt_file, fps):
        try:
            path = cls._path(prompt_file)
        except ValueError:
            return float("nan")  # load() names the problem
        return os.path.getmtime(path) if os.path.isfile(path) else float("nan")

    @staticmethod
    def _path(prompt_file):
        if prompt_file not in _prompt_files():
            raise ValueError(f"prompt_file {prompt_file!r} is not a .json file in ComfyUI's input folder.")
        # a listed name may still be a link to a file elsewhere: refused, never read
        return str(inside(folder_paths.get_input_directory(), prompt_file, what="prompt_file"))

    def load(self, prompt_file, fps):
        raw = read_prompt_file(self._path(prompt_file))
        try:
            parsed = parse_prompt(raw)
        except ValueError as e:
            raise ValueError(f"{prompt_file}: {e}") from None
        for warning in parsed.warnings:
            logger.warning("LoadLingbotPrompt %s: %s", prompt_file, warning)
        if not parsed.structured:
            raise ValueError(f"{prompt_file} is not valid JSON: a prompt file holds {{\"caption\": ..., \"duration\": seconds}}.")
        num_frames = frames_for_duration(parsed.duration, fps) if parsed.duration is not None else 0
        # Keep the duration with the caption: GenerateVideo's parse_prompt encodes exactly the caption and
        # reads the duration from it (use_caption_duration), as when the file is pasted into its prompt box.
        text = compact_json(parsed.source) if parsed.source is not None else parsed.text
        return (text, num_frames, float(parsed.duration or 0.0))
