"""The LingBot-Video prompt rewriter protocol: prose -> detailed caption (EXPAND) -> JSON caption (MAP).

Step 1 asks the base VLM, step 2 the same VLM with the rewriter LoRA (the server names it as its own
model). The message texts are fixed by the release (the LoRA was trained on them); the long system
prompts are the user's copy of the release's, read as data (``load_system_prompts``).
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

from PIL import Image

from .caption_checks import caption_warnings
from ..files.named_files import read_text_file
from ..net.chat_client import ChatServer, chat, image_data_url, user_content
from .text_conditioning import compact_json, frames_for_duration

MODES = ("t2v", "ti2v", "t2i")
PROMPT_NAMES = ("VIDEO_STEP1_EXPAND", "VIDEO_STEP2_MAP", "IMAGE_STEP1_EXPAND", "IMAGE_STEP2_MAP", "NEG_SYS")
_CJK = re.compile("[\u4e00-\u9fff]")
_FENCED = re.compile(r"```(?:json)?\s*(\{.*?)\s*```", re.DOTALL)  # an object in a fence, even if cut short
_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)
_PREVIEW = 300


class RewriteError(ValueError):
    """A rewrite that cannot give a caption (unusable answer, missing system prompt)."""


# ----------------------------------------------------------------------------------------------
# System prompts (data from the user's copy of the release; never imported or executed)
# ----------------------------------------------------------------------------------------------


def _read_bounded(path: Path) -> bytes:
    return read_text_file(path, what="a rewriter prompt file")


def _constants_from_python(path: Path) -> Dict[str, str]:
    """Top-level ``NAME = "literal"`` assignments (implicit concatenations are one literal in the AST)."""
    try:
        tree = ast.parse(_read_bounded(path), filename=str(path))
    except SyntaxError as e:
        raise ValueError(f"{path} is not a Python module of string constants ({e.msg}, line {e.lineno}).") from None
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            for target in targets:
                if isinstance(target, ast.Name) and target.id in PROMPT_NAMES:
                    found[target.id] = value.value
    return found


def load_system_prompts(path) -> Dict[str, str]:
    """The rewriter's system prompts found at ``path``: a ``.py`` module of string constants, or a folder
    of such modules and/or ``<NAME>.txt`` files (used verbatim). Names: ``PROMPT_NAMES``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"rewriter prompt file {path} does not exist; point system_prompts at the "
                                "release's rewriter prompt module (.py) or a folder of <NAME>.txt files.")
    sources = [path] if path.is_file() else sorted(path.glob("*.py")) + sorted(path.glob("*.txt"))
    prompts: Dict[str, str] = {}
    origin: Dict[str, Path] = {}
    for src in sources:
        if src.suffix == ".py":
            found = _constants_from_python(src)
        elif src.suffix == ".txt" and src.stem in PROMPT_NAMES:
            try:
                found = {src.stem: _read_bounded(src).decode("utf-8-sig")}
            except UnicodeDecodeError:
                raise ValueError(f"{src} is not UTF-8 text; save it as UTF-8.") from None
        else:
            continue
        for name, text in found.items():
            if name in prompts and prompts[name] != text:
                raise ValueError(f"{name} differs between {origin[name]} and {src}; keep one copy.")
            prompts[name], origin[name] = text, src
    if not prompts:
        raise ValueError(f"{path} holds none of the rewriter's system prompts ({', '.join(PROMPT_NAMES)}): a "
                         ".py module with these string constants, or <NAME>.txt files, is expected.")
    return prompts


def _prompt(prompts: Dict[str, str], name: str) -> str:
    if name not in prompts:
        raise RewriteError(f"the rewriter system prompts have no {name}; found {', '.join(sorted(prompts))}. "
                           f"Add {name} (a string constant, or {name}.txt) from the release's rewriter folder.")
    return prompts[name]


# ----------------------------------------------------------------------------------------------
# Messages (prompt-rewriter.md)
# ----------------------------------------------------------------------------------------------


def duration_seconds(mode: str, duration: float) -> Optional[int]:
    """``D``: the integer seconds of the request (None for an image)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not allowed; use one of {', '.join(MODES)}.")
    if mode == "t2i":
        return None
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not math.isfinite(duration):
        raise ValueError(f"duration={duration!r} is not allowed; use a number of seconds, e.g. 5.")
    seconds = int(round(duration))
    if seconds < 1:
        raise ValueError(f"duration={duration} s rounds to {seconds} s; a video needs at least 1 s.")
    return seconds


def expand_text(system: str, mode: str, prompt: str, seconds: Optional[int]) -> str:
    if mode == "t2i":
        return system + "\n\nUser image prompt:\n" + prompt
    line = f"\n\n视频时长：{seconds} 秒" if _CJK.search(prompt) else f"\n\nVideo Duration: {seconds} seconds"
    return system + "\n\n" + prompt + line


def map_text(system: str, mode: str, detailed: str, seconds: Optional[int]) -> str:
    if mode == "t2i":
        return system + "\n\nDETAILED CAPTION:\n" + detailed
    return (system + f"\n\nVideo Duration: {seconds} seconds\n\nDETAILED CAPTION:\n" + detailed
            + "\n\nOutput the JSON now.")


def _answer_text(text: str) -> str:
    # Some servers return a reasoning block even with thinking disabled; it is not part of the answer.
    return _THINK.sub("", text, count=1).strip()


def parse_json_object(text: str) -> dict:
    """A JSON object from a model answer: inside a code fence if there is one, repaired with json_repair."""
    from json_repair import repair_json

    stripped = _answer_text(text)
    fenced = _FENCED.search(stripped)
    candidate = fenced.group(1) if fenced else stripped
    try:
        value = repair_json(candidate, return_objects=True)
    except Exception:  # json_repair raises on some inputs instead of giving up; that is a failed rewrite too
        value = None
    if not isinstance(value, dict) or not value:
        raise RewriteError(f"the rewriter's answer is not a JSON object, even after repair; it begins: "
                           f"{stripped[:_PREVIEW]!r}")
    return value


# ----------------------------------------------------------------------------------------------
# The two-step rewrite
# ----------------------------------------------------------------------------------------------


@dataclass
class Rewrite:
    caption: dict
    duration: Optional[int]  # D, None for an image
    detailed_caption: str
    warnings: Tuple[str, ...] = field(default=())

    @property
    def prompt_json(self) -> str:
        """``{"caption": ..., "duration": D}`` compact: what LoadLingbotPrompt gives for the saved file."""
        return compact_json({"caption": self.caption, "duration": self.duration})

    def num_frames(self, fps: float) -> int:
        return 1 if self.duration is None else frames_for_duration(self.duration, fps)


def rewrite(server: ChatServer, prompts: Dict[str, str], prompt: str, *, mode: str, duration: float = 5.0,
            image: Optional[Image.Image] = None, expand_model: str, map_model: str,
            temperature: float = 0.0, seed: Optional[int] = None) -> Rewrite:
    """Prose -> detailed caption (``expand_model``) -> JSON caption (``map_model``, the LoRA)."""
    seconds = duration_seconds(mode, duration)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt is empty: describe the video (or image) in a few words or sentences.")
    if mode == "ti2v" and image is None:
        raise ValueError("mode ti2v needs the first-frame image: connect image, or use mode t2v.")
    if mode != "ti2v" and image is not None:
        raise ValueError(f"an image is connected but mode is {mode}; use mode ti2v, or disconnect the image.")
    kind = "IMAGE" if mode == "t2i" else "VIDEO"
    expand_sys, map_sys = _prompt(prompts, f"{kind}_STEP1_EXPAND"), _prompt(prompts, f"{kind}_STEP2_MAP")
    image_url = image_data_url(image) if image is not None else None

    step1 = chat(server, expand_model, user_content(expand_text(expand_sys, mode, prompt, seconds), image_url),
                 temperature=temperature, seed=seed)
    detailed = _answer_text(step1)
    if not detailed:
        raise RewriteError(f"step 1 ({expand_model!r}) gave an empty detailed caption; check the model name and server.")
    step2 = chat(server, map_model, user_content(map_text(map_sys, mode, detailed, seconds), image_url),
                 temperature=temperature, seed=seed)
    caption = parse_json_object(step2)
    return Rewrite(caption, seconds, detailed, tuple(caption_warnings(caption, seconds)))


def save_prompt_file(result: Rewrite, path) -> Path:
    """Write ``prompt.json`` as the release does (readable, non-ASCII kept)."""
    path = Path(path)
    path.write_text(json.dumps({"caption": result.caption, "duration": result.duration}, ensure_ascii=False,
                               indent=2) + "\n", encoding="utf-8")
    return path
