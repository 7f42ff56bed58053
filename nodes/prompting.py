"""Prompt tools: the rewriter's chat server, the two-step rewrite, and the negative-prompt editor.

The rewriter's system prompts are the user's copy of the release's (never shipped with the pack).
They are listed from ComfyUI's ``models/lingbot_rewriter/`` folder (a ``.py`` module of string
constants, or a folder of modules and/or ``<NAME>.txt`` files) and only listed entries are read,
as data, so a shared workflow cannot point the pack at an arbitrary file.
"""

from __future__ import annotations

import logging
import os
from typing import Dict

import comfy.model_management
import folder_paths
import numpy as np
from PIL import Image

from ..lingbot_core.net.chat_client import ChatServer
from ..lingbot_core.prompts.negative_prompts import auto_negative, default_negative_terms, edit_negative, serialize_negative
from ..lingbot_core.prompts.rewriter import MODES, PROMPT_NAMES, load_system_prompts, rewrite
from .server_list import check_server, endpoint, list_version, server_input

logger = logging.getLogger("lingbot_video_nodes")

PROMPTS_KEY = "lingbot_rewriter"
SEED_MAX = 0xFFFFFFFFFFFFFFFF
NO_PROMPTS = "(no rewriter prompts in models/lingbot_rewriter)"
# The DiT default's categories (video has all five; the image default has no temporal one).
CATEGORIES = tuple(default_negative_terms("video"))

folder_paths.add_model_folder_path(PROMPTS_KEY, os.path.join(folder_paths.models_dir, PROMPTS_KEY))


def list_system_prompts() -> Dict[str, str]:
    """``{name: path}``: .py modules, and folders holding modules or <NAME>.txt files (one level)."""
    found: Dict[str, str] = {}
    names = {f"{n}.txt" for n in PROMPT_NAMES}
    for root in folder_paths.get_folder_paths(PROMPTS_KEY):
        if not os.path.isdir(root):
            continue
        for entry in sorted(os.listdir(root)):
            path = os.path.join(root, entry)
            if os.path.isfile(path) and entry.endswith(".py"):
                found.setdefault(entry, path)
            elif os.path.isdir(path) and not entry.startswith("."):
                files = os.listdir(path)
                if any(f.endswith(".py") or f in names for f in files):
                    found.setdefault(entry + "/", path)
    return found


def _system_prompt_path(name: str) -> str:
    listed = list_system_prompts()
    if name not in listed:
        raise ValueError(f"system_prompts {name!r} is not in models/{PROMPTS_KEY} ({', '.join(listed) or 'empty'}). "
                         "Copy the release's rewriter prompt module (or its rewriter/ folder) there and refresh.")
    return listed[name]


def _pil(image) -> Image.Image:
    if image.ndim != 4 or image.shape[0] < 1:
        raise ValueError(f"image must be an IMAGE batch (B, H, W, C); got shape {tuple(image.shape)}.")
    arr = (image[0, ..., :3].clamp(0, 1) * 255).round().to("cpu").numpy().astype(np.uint8)
    return Image.fromarray(arr, "RGB")


class LingbotRewriterServer:
    DESCRIPTION = (
        "Where the prompt rewriter runs: an OpenAI-compatible chat server (vLLM, SGLang, Ollama, LM Studio) "
        "serving the base VLM and, under its own model name, the base VLM with the rewriter LoRA. "
        "Servers on other machines, and their keys, come from your server list (lingbot_servers.json in "
        "ComfyUI's user directory), so a shared workflow cannot choose where your prompts and keys go."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "configure"
    RETURN_TYPES = ("LINGBOT_REWRITER",)
    RETURN_NAMES = ("rewriter",)
    OUTPUT_TOOLTIPS = ("The server settings; connect to LingbotRewritePrompt and LingbotNegativePrompt's auto input.",)

    @classmethod
    def INPUT_TYPES(cls):
        # The order keeps workflows saved before the server list loading (widget values are positional):
        # ``server`` sits where ``api_key_env`` was.
        return {
            "required": {
                "base_url": ("STRING", {"default": "http://127.0.0.1:8000/v1",
                             "tooltip": "Used only when server is '(this machine: ...)': a server on this machine (127.0.0.1, ::1, localhost), its OpenAI-compatible base URL ending in /v1 (vLLM/SGLang :8000, Ollama :11434, LM Studio :1234); never sent a key."}),
                "expand_model": ("STRING", {"default": "Qwen/Qwen3.6-27B",
                                 "tooltip": "Step 1 (EXPAND): the base VLM's model name on the server, with no adapter. A stronger VLM may be used here."}),
                "map_model": ("STRING", {"default": "lingbot-video-rewriter",
                              "tooltip": "Step 2 (MAP): the base VLM with the rewriter LoRA, under the name the server gives it (e.g. vLLM --lora-modules NAME=PATH)."}),
                "system_prompts": (sorted(list_system_prompts()) or [NO_PROMPTS],
                                   {"tooltip": "The release's rewriter system prompts, from models/lingbot_rewriter: its prompt module (.py, read as data, never run) or a folder with it and/or VIDEO_STEP1_EXPAND.txt-style files."}),
            },
            # Optional only so that an API-format workflow from before the server list (no server input) gets
            # the pack's message naming the entry to add; the widgets keep their order (required, then these).
            "optional": {
                "server": server_input("chat", "chat server"),
                "timeout": ("INT", {"default": 600, "min": 1, "max": 7200, "tooltip": "Seconds each answer may take, every byte included (a 27B model writing 6k tokens can take minutes)."}),
                "disable_thinking": ("BOOLEAN", {"default": True,
                                     "tooltip": "Send chat_template_kwargs.enable_thinking=false, as the release (Qwen3-family servers). Turn off for a server that rejects unknown fields."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, server=None, base_url=None):
        return check_server(server, base_url, "chat")

    @classmethod
    def IS_CHANGED(cls, system_prompts, **_):
        # The prompt file and the server list may be edited on disk; anything else is in the inputs.
        listed = list_system_prompts()
        path = listed.get(system_prompts)
        if path is None:
            return float("nan")
        files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in sorted(os.listdir(path))]
        return tuple(os.path.getmtime(f) for f in files) + (list_version(),)

    def configure(self, base_url, expand_model, map_model, system_prompts, server=None, timeout=600,
                  disable_thinking=True):
        # The server list, a URL that is not on this machine, or a missing key are reported here, on this node.
        chosen = endpoint(server, base_url, "chat")
        server = ChatServer(chosen.base_url, chosen.api_key, float(timeout), bool(disable_thinking),
                            allow_http=chosen.allow_http,
                            interrupt=comfy.model_management.throw_exception_if_processing_interrupted)
        server.endpoint()
        return ({"server": server, "expand_model": expand_model, "map_model": map_model,
                 "prompts": load_system_prompts(_system_prompt_path(system_prompts))},)


class LingbotRewritePrompt:
    DESCRIPTION = (
        "Turns a prose prompt into the structured JSON caption the LingBot-Video DiT is trained on, with the "
        "release's two-step rewriter: the base VLM writes a detailed caption (EXPAND), then the VLM with the "
        "rewriter LoRA maps it to JSON (MAP). Results are cached: re-queueing does not ask the server again."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "rewrite"
    RETURN_TYPES = ("STRING", "STRING", "INT")
    RETURN_NAMES = ("prompt", "detailed_caption", "num_frames")
    OUTPUT_TOOLTIPS = (
        "{\"caption\": ..., \"duration\": D} as compact JSON, exactly what LoadLingbotPrompt gives for the saved "
        "prompt.json; connect to GenerateVideo's and Refine's prompt.",
        "Step 1's detailed prose caption (to read, or to check what the VLM understood).",
        "Frames for the duration at fps (4n+1); 1 for t2i.",
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "rewriter": ("LINGBOT_REWRITER", {"tooltip": "The chat server settings from LingbotRewriterServer."}),
                "prompt": ("STRING", {"multiline": True, "default": "",
                           "tooltip": "What should happen, in your own words (any language; a Chinese prompt gets the duration line in Chinese, as the release)."}),
                "mode": (list(MODES), {"default": "t2v", "tooltip": "t2v: text to video; ti2v: image to video (connect image); t2i: an image."}),
                "duration": ("FLOAT", {"default": 5.0, "min": 1.0, "max": 40.0, "step": 1.0,
                             "tooltip": "Video length in seconds (rounded to whole seconds); the caption's action timestamps are written for it. Ignored for t2i."}),
                "temperature": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 2.0, "step": 0.05, "tooltip": "0 = greedy, as the release."}),
                "seed": ("INT", {"default": 0, "min": 0, "max": SEED_MAX, "tooltip": "Sent to the server (matters only with temperature > 0)."}),
                "fps": ("INT", {"default": 24, "min": 1, "max": 120, "tooltip": "Frame rate used to turn the duration into num_frames."}),
            },
            "optional": {
                "image": ("IMAGE", {"tooltip": "The first frame (ti2v only); sent to the VLM in both steps."}),
            },
        }

    def rewrite(self, rewriter, prompt, mode, duration, temperature, seed, fps, image=None):
        result = rewrite(rewriter["server"], rewriter["prompts"], prompt, mode=mode, duration=duration,
                         image=None if image is None else _pil(image), expand_model=rewriter["expand_model"],
                         map_model=rewriter["map_model"], temperature=temperature, seed=seed)
        for warning in result.warnings:
            logger.warning("LingbotRewritePrompt: %s", warning)
        return (result.prompt_json, result.detailed_caption, result.num_frames(fps))


class LingbotNegativePrompt:
    DESCRIPTION = (
        "The model's default negative prompt, with delete-only editing: switch categories off, or list terms to "
        "remove (e.g. 'cartoon' for a cartoon). With everything on and nothing listed it is exactly the default. "
        "Connect a rewriter to auto to let the VLM prune terms that contradict the caption (delete-only, guarded)."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "build"
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("negative_prompt",)
    OUTPUT_TOOLTIPS = ("The negative as JSON; connect to GenerateVideo's negative_prompt.",)

    @classmethod
    def INPUT_TYPES(cls):
        required = {"mode": (["video", "image"], {"default": "video", "tooltip": "Which default: video (t2v, ti2v) or image (t2i)."})}
        for cat in CATEGORIES:
            note = " (video only)" if cat not in default_negative_terms("image") else ""
            terms = ", ".join(default_negative_terms("video")[cat])
            required[cat] = ("BOOLEAN", {"default": True, "tooltip": f"Keep the {cat.replace('_', ' ')} terms{note}: {terms}."})
        required["remove_terms"] = ("STRING", {"multiline": True, "default": "",
                                    "tooltip": "Terms of the default to delete, comma- or line-separated (e.g. 'cartoon, drawing'). Only listed default terms are accepted."})
        return {
            "required": required,
            "optional": {
                "auto": ("LINGBOT_REWRITER", {"tooltip": "Optional: ask this server's base VLM (expand_model, NEG_SYS prompt) which terms contradict the caption."}),
                "caption": ("STRING", {"forceInput": True, "tooltip": "The caption for auto (e.g. LingbotRewritePrompt's prompt)."}),
                "image": ("IMAGE", {"tooltip": "The first frame for auto (ti2v)."}),
            },
        }

    def build(self, mode, remove_terms, auto=None, caption=None, image=None, **keep):
        drop = [cat for cat in CATEGORIES if not keep.get(cat, True)]
        if mode == "image":
            drop = [cat for cat in drop if cat in default_negative_terms("image")]
        terms = edit_negative(mode, drop, remove_terms)
        if auto is not None:
            if "NEG_SYS" not in auto["prompts"]:
                raise ValueError("auto needs NEG_SYS, the release's auto-negative system prompt: add the auto-negative "
                                 "script (or NEG_SYS.txt) to the rewriter's system_prompts folder, or disconnect auto.")
            terms = auto_negative(auto["server"], auto["prompts"]["NEG_SYS"], auto["expand_model"], caption or "", mode,
                                  image=None if image is None else _pil(image), base=terms)
        return (serialize_negative(terms),)

