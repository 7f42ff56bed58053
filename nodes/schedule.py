"""LingBot-Video Prompt Schedule (a prompt per part of a long video) and Size Preset (the release's buckets).

The schedule is one text box with one prompt per block, blocks separated by a line holding only ``---``,
and one line of start frames: a story reads top to bottom in a single node, JSON captions can span
lines, and any number of parts fits without a widget per part. The math (even starts, the window rule,
the checks) is lingbot_core.prompts.prompt_schedule's; GenerateVideo applies the schedule.
"""

from __future__ import annotations

import logging

from ..lingbot_core.model.latents import MAX_FRAMES, TEMPORAL_COMPRESSION
from ..lingbot_core.model.size_presets import preset_label, preset_labels, size_from_label
from ..lingbot_core.prompts.prompt_schedule import check_schedule, parse_starts, split_parts
from ..lingbot_core.prompts.rewriter import rewrite
from ..lingbot_core.prompts.text_conditioning import negative_from_widget

logger = logging.getLogger("lingbot_video_nodes")

SEED_MAX = 0xFFFFFFFFFFFFFFFF


class LingbotPromptSchedule:
    DESCRIPTION = (
        "A prompt per part of a long video: write one prompt per block, separated by a line with only '---', and "
        "(optionally) the frame each part starts at. Connect to GenerateVideo's prompt_schedule and set its "
        "context_frames: each context window is conditioned on the part holding its centre frame. Connect a "
        "rewriter to turn prose parts into JSON captions, each written for its own part's length."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "build"
    RETURN_TYPES = ("LINGBOT_PROMPT_SCHEDULE",)
    RETURN_NAMES = ("prompt_schedule",)
    OUTPUT_TOOLTIPS = ("The parts, their start frames and negatives; connect to GenerateVideo's prompt_schedule "
                       "(it replaces GenerateVideo's prompt).",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "parts": ("STRING", {"multiline": True, "default": "",
                          "tooltip": "One prompt per part, in story order, separated by a line holding only '---'. "
                                     "Each part is a JSON caption (may span lines) or plain text."}),
                "start_frames": ("STRING", {"default": "",
                                 "tooltip": "The frame each part starts at, e.g. '0, 48, 96' (the first is 0; strictly "
                                            "increasing; frames count from 0). Empty = the parts spread evenly over the video."}),
            },
            "optional": {
                "negative_prompt": ("STRING", {"multiline": True, "default": "",
                                    "tooltip": "Empty = GenerateVideo's negative_prompt (its default when that is empty too). "
                                               "One text for every part, or one per part separated by '---' lines."}),
                "rewriter": ("LINGBOT_REWRITER", {"tooltip": "Optional: rewrite every prose part into a structured JSON caption "
                                                  "(LingbotRewriterServer), written for the part's own duration. Parts that "
                                                  "are already JSON are kept."}),
                "num_frames": ("INT", {"default": 121, "min": 1, "max": MAX_FRAMES, "step": TEMPORAL_COMPRESSION,
                               "tooltip": "Only with a rewriter: the video's length (the same as GenerateVideo's num_frames), "
                                          "to give each part its duration."}),
                "fps": ("INT", {"default": 24, "min": 1, "max": 120, "tooltip": "Only with a rewriter: frames per second of the video."}),
                "seed": ("INT", {"default": 0, "min": 0, "max": SEED_MAX, "tooltip": "Only with a rewriter: sent to the server (matters with temperature > 0)."}),
            },
        }

    def build(self, parts, start_frames, negative_prompt="", rewriter=None, num_frames=121, fps=24, seed=0):
        prompts = split_parts(parts)
        starts = parse_starts(start_frames)
        if starts is not None and len(starts) != len(prompts):
            raise ValueError(f"start_frames lists {len(starts)} frames for {len(prompts)} parts: give one per part "
                             "(or none, to spread them evenly).")
        negatives = None
        if negative_from_widget(negative_prompt) is not None:
            negatives = split_parts(negative_prompt)
            if len(negatives) not in (1, len(prompts)):
                raise ValueError(f"negative_prompt has {len(negatives)} parts for {len(prompts)} prompts: give one negative "
                                 "for every part, or one per part.")
        if rewriter is not None:
            prompts = self._rewrite(rewriter, check_schedule(prompts, num_frames, starts), fps, seed)
        return ({"prompts": prompts, "starts": starts, "negatives": negatives},)

    @staticmethod
    def _rewrite(rewriter, schedule, fps, seed):
        ends = list(schedule.starts[1:]) + [schedule.num_frames]
        out = []
        for k, (prompt, start, end) in enumerate(zip(schedule.prompts, schedule.starts, ends)):
            if prompt.lstrip()[:1] in ("{", "["):
                out.append(prompt)  # already a caption
                continue
            try:
                result = rewrite(rewriter["server"], rewriter["prompts"], prompt, mode="t2v", duration=(end - start) / fps,
                                 expand_model=rewriter["expand_model"], map_model=rewriter["map_model"], seed=seed)
            except ValueError as e:
                raise ValueError(f"LingbotPromptSchedule part {k + 1} ({schedule.frames(k)}): {e}") from None
            for warning in result.warnings:
                logger.warning("LingbotPromptSchedule part %d: %s", k + 1, warning)
            out.append(result.prompt_json)
        return out


class LingbotSizePreset:
    DESCRIPTION = ("The release's size buckets (the CLI's --resolution / --ratio): pick one and connect width and height to "
                   "GenerateVideo. The ratio is the release's H:W name, so '9:16' is the landscape frame; the list says the "
                   "size and its shape.")
    CATEGORY = "LingBot-Video"
    FUNCTION = "size"
    RETURN_TYPES = ("INT", "INT")
    RETURN_NAMES = ("width", "height")
    OUTPUT_TOOLTIPS = ("Width in pixels; connect to GenerateVideo's width.", "Height in pixels; connect to GenerateVideo's height.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"preset": (preset_labels(), {"default": preset_label("480p", "9:16"),
                                        "tooltip": "Resolution and the release's H:W ratio, with the width x height it gives. "
                                                   "480p 9:16 (832x480) is the reference scripts' size; 2k and 4k are the "
                                                   "runner's buckets beyond what the base model is trained for."})}}

    def size(self, preset):
        height, width = size_from_label(preset)
        return (width, height)
