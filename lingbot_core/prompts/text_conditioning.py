"""Text (and TI2V image) conditioning through Qwen3-VL, plus structured-caption helpers.

The prompt goes into a fixed chat template; the encoder sees the whole sequence but only the tokens
after the template's system/user prefix ("crop_start") condition the DiT. In TI2V the first frame is
passed to the VLM as image tokens, in the positive and the negative prompt alike.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

import torch
from PIL import Image

from ..files.named_files import read_text_file
from .caption_checks import caption_warnings

# Verbatim data (see docs): 801 characters, one "{}" placeholder for the user text.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nGiven a user input that may include a text prompt alone, a text prompt with an image "
    "reference, or a text prompt with a video reference or a video reference alone, generate an \"Enhanced prompt\" "
    "that provides detailed visual descriptions suitable for video generation. Evaluate the level of detail in the "
    "user's input: if it is simple, enrich it by adding specifics about colors, shapes, sizes, textures, lighting, "
    "motion dynamics, camera movement, temporal progression, and spatial relationships to create vivid, concrete, "
    "and temporally coherent scenes to create vivid and concrete scenes. Please generate only the enhanced "
    "description for the prompt below and avoid including any additional commentary or evaluations:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_PREFIX, TEMPLATE_SUFFIX = PROMPT_TEMPLATE.split("{}")
IMAGE_TOKENS = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TEXT_TOKENS = 37698

# Default negatives, serialised with Python's default separators exactly as the reference's files load.
DEFAULT_NEGATIVE_VIDEO = json.dumps({"universal_negative": {
    "visual_quality": ["low quality", "worst quality", "blurry", "pixelated", "jpeg artifacts", "low resolution",
                       "unstable color", "color flicker", "underexposed", "overexposed", "invisible subject",
                       "subject hidden in darkness"],
    "artistic_style": ["painting", "illustration", "drawing", "cartoon", "3d render", "cgi", "sketch", "digital art"],
    "composition_and_content": ["text", "watermark", "signature", "logo", "subtitles", "pillarboxed", "side bars",
                                "portrait image in landscape frame"],
    "temporal_and_motion_stability": ["flickering", "jittery", "motion blur", "temporal inconsistency", "warping",
                                      "morphing", "incoherent motion", "unnatural movement",
                                      "static object with sudden jump", "frame-to-frame inconsistency"],
    "material_and_structure": ["plastic-like glass", "unrealistic texture", "deformed bottle",
                               "liquid freezing improperly", "distorted reflections"]}})
DEFAULT_NEGATIVE_IMAGE = json.dumps({"universal_negative": {
    "visual_quality": ["low quality", "worst quality", "blurry", "pixelated", "jpeg artifacts", "low resolution",
                       "underexposed", "overexposed", "invisible subject", "subject hidden in darkness"],
    "artistic_style": ["painting", "illustration", "drawing", "cartoon", "3d render", "cgi", "sketch", "digital art"],
    "composition_and_content": ["text", "watermark", "signature", "logo", "pillarboxed", "side bars",
                                "portrait image in landscape frame"],
    "material_and_structure": ["plastic-like glass", "unrealistic texture", "deformed bottle",
                               "distorted reflections"]}})

RUNTIME_KEYS = ("duration", "fps", "height", "width", "num_frames", "resolution", "ratio")


# ----------------------------------------------------------------------------------------------
# Structured captions
# ----------------------------------------------------------------------------------------------


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def serialize_caption(data: Any) -> str:
    """The prompt string for a rewriter prompt file (a dict, or the first dict of a list).

    ``{"caption": {...}}`` -> the caption as compact JSON (key order kept, non-ASCII kept); a string
    caption is used as is; without ``caption`` the runtime keys are dropped and the rest serialised.
    """
    if isinstance(data, list):
        data = next((d for d in data if isinstance(d, dict)), None)
        if data is None:
            raise ValueError("prompt JSON is a list without any object in it; expected {\"caption\": ...}.")
    if not isinstance(data, dict):
        raise ValueError(f"prompt JSON must be an object, got {type(data).__name__}.")
    if "caption" in data:
        caption = data["caption"]
        return caption if isinstance(caption, str) else compact_json(caption)
    return compact_json({k: v for k, v in data.items() if k not in RUNTIME_KEYS})


def frames_for_duration(duration: float, fps: float) -> int:
    """The smallest 4n+1 frame count strictly greater than ``int(duration * fps)`` (0 s -> 1 frame)."""
    if duration is None or not math.isfinite(duration) or duration < 0:
        raise ValueError(f"duration must be a finite number >= 0 seconds, got {duration}.")
    if not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a positive number, got {fps}.")
    if not math.isfinite(duration * fps):  # e.g. a caption "duration": 1e308 would overflow int()
        raise ValueError(f"duration={duration} s at {fps} fps is too long; use a caption duration of a few seconds.")
    n = int(duration * fps)
    if n == 0:
        return 1
    return ((n - 1) // 4 + 1) * 4 + 1


@dataclass
class ParsedPrompt:
    text: str  # what goes into the template
    duration: Optional[float] = None  # seconds, from a structured caption file
    structured: bool = False
    source: Optional[dict] = None  # the caption file's object (its first one, for a list)
    warnings: Tuple[str, ...] = ()  # caption checks (e.g. action timestamps past the duration)


def parse_prompt(prompt: str) -> ParsedPrompt:
    """Plain text is used verbatim. Text that starts with ``{`` or ``[`` must be a JSON caption (a
    rewriter ``prompt.json``): it is serialised compactly and its ``duration`` returned.

    Malformed JSON is rejected rather than silently encoded as prose, because raw JSON-looking text is
    far outside what the DiT was trained on.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be text, got {type(prompt).__name__}.")
    stripped = prompt.lstrip("\ufeff").strip()  # a pasted file may keep its UTF-8 byte order mark
    if not stripped:
        raise ValueError("prompt is empty: write a structured JSON caption (recommended) or a text description.")
    if stripped[0] not in "{[":
        return ParsedPrompt(prompt)
    try:
        data = json.loads(stripped)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"prompt starts with '{stripped[0]}' but is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}). "
            "Fix the JSON caption, or start the prompt with plain words to use it as text."
        ) from None
    duration = None
    first = data[0] if isinstance(data, list) and data else data
    if isinstance(first, dict) and first.get("duration") is not None:
        value = first["duration"]
        # bool is an int subclass: "duration": true would otherwise read as 1 s.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"prompt JSON: duration must be a number of seconds (or null), got {json.dumps(value)}.")
        duration = float(value)
    source = first if isinstance(first, dict) else None
    caption = source.get("caption") if source is not None and "caption" in source else source
    return ParsedPrompt(serialize_caption(data), duration, structured=True, source=source,
                        warnings=tuple(caption_warnings(caption, duration)))


# Byte order marks, longest first: UTF-32 LE's mark begins with UTF-16 LE's.
_BOMS = (
    (b"\x00\x00\xfe\xff", "UTF-32 BE", None),
    (b"\xff\xfe\x00\x00", "UTF-32 LE", None),
    (b"\xef\xbb\xbf", "UTF-8", "utf-8"),
    (b"\xff\xfe", "UTF-16 LE", "utf-16-le"),  # Notepad's "Unicode", PowerShell 5's ">"
    (b"\xfe\xff", "UTF-16 BE", "utf-16-be"),
)
_RESAVE = "save it as UTF-8 (in most editors: 'Save with encoding' -> UTF-8) and load it again."


def _utf16_without_mark(raw: bytes):
    """"UTF-16 LE" or "UTF-16 BE" when the NUL bytes fall on one parity (the high bytes of ASCII letters in
    UTF-16 without a mark), else None. UTF-8 text holds no NUL at all."""
    head = raw[:4096]
    even, odd = head[0::2].count(0), head[1::2].count(0)
    if len(head) < 4 or even + odd < len(head) // 8:
        return None
    if odd > 4 * even:
        return "UTF-16 LE"
    if even > 4 * odd:
        return "UTF-16 BE"
    return None


def read_prompt_file(path) -> str:
    """A prompt file's text, as editors save it: UTF-8 with or without a byte order mark, or UTF-16 (LE or
    BE) with one, at most ``named_files.MAX_TEXT_FILE_BYTES`` of a regular file (checked before it is read).
    Anything else is refused with a message naming the file and, where the bytes tell,
    the encoding (a raw ``UnicodeDecodeError`` names neither). Line ends are read as Python's text mode
    reads them (CRLF and CR become LF), so a file from Windows encodes as the same prompt."""
    path = Path(path)
    raw = read_text_file(path)
    name, codec, body = "UTF-8", "utf-8", raw
    for mark, mark_name, mark_codec in _BOMS:
        if raw.startswith(mark):
            if mark_codec is None:
                raise ValueError(f"{path.name} is saved as {mark_name}, which is not read; {_RESAVE}")
            name, codec, body = mark_name, mark_codec, raw[len(mark):]
            break
    else:
        unmarked = _utf16_without_mark(raw)
        if unmarked:
            raise ValueError(f"{path.name} looks like UTF-16 without a byte order mark ({unmarked}: every other "
                             f"byte is NUL); {_RESAVE}")
    try:
        text = body.decode(codec)
    except UnicodeDecodeError as e:
        at = e.start + len(raw) - len(body)
        if codec == "utf-8":
            raise ValueError(f"{path.name} is not UTF-8 text (byte {at} is 0x{raw[at]:02x}; it may be in a legacy "
                             f"code page such as Windows-1252 or GBK); {_RESAVE}") from None
        raise ValueError(f"{path.name} begins with a {name} byte order mark but is not valid {name} "
                         f"(at byte {at}); {_RESAVE}") from None
    if codec == "utf-8" and "\x00" in text:
        # ASCII saved as UTF-16 without a mark decodes as UTF-8 with a NUL after every letter.
        raise ValueError(f"{path.name} looks like UTF-16 without a byte order mark (it holds NUL characters); {_RESAVE}")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def frames_for_prompt(parsed: ParsedPrompt, num_frames: int, fps: float, use_caption_duration: bool = True) -> int:
    """The one rule for a caption's duration: it overrides ``num_frames`` (as the reference runner)
    when ``use_caption_duration`` is on and the caption has one.

    ``num_frames == 0`` is what LoadLingbotPrompt outputs for a file without a duration; it is
    explained here rather than rejected later as an invalid frame count.
    """
    if use_caption_duration and parsed.duration is not None:
        return frames_for_duration(parsed.duration, fps)
    if num_frames == 0:
        why = ("the prompt has no duration" if parsed.duration is None
               else "use_caption_duration is off")
        raise ValueError(
            f"num_frames is 0 and {why}: LoadLingbotPrompt outputs 0 frames for a prompt file with "
            "\"duration\": null. Add \"duration\": <seconds> to the prompt file, or set num_frames on "
            "GenerateVideo instead of connecting it (1 for an image, 4n+1 for a video).")
    return num_frames


def default_negative(num_frames: int) -> str:
    return DEFAULT_NEGATIVE_IMAGE if num_frames == 1 else DEFAULT_NEGATIVE_VIDEO


def resolve_negative(negative_prompt: Optional[str], num_frames: int) -> str:
    """The negative text to encode.

    None -> the mode's default (serialised with Python's default separators, as the reference's
    shipped files). JSON text -> compact JSON (as the reference's negative-prompt files), except a
    default with terms deleted (``is_default_edit``), which keeps the default's separators. Anything
    else verbatim; an empty string is kept and encodes an empty user turn (distinct from None).
    """
    if negative_prompt is None:
        return default_negative(num_frames)
    stripped = negative_prompt.strip()
    if stripped[:1] in ("{", "["):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"negative_prompt starts with '{stripped[0]}' but is not valid JSON ({e.msg} at line {e.lineno})."
            ) from None
        # A default with terms deleted (LingbotNegativePrompt) keeps the default's own serialisation,
        # so that deleting nothing encodes exactly the default.
        return json.dumps(value) if is_default_edit(value) else compact_json(value)
    return negative_prompt


def negative_from_widget(text: str) -> Optional[str]:
    """A node's negative box: empty or whitespace-only means the mode's default (None)."""
    return text if isinstance(text, str) and text.strip() else None


def is_default_edit(value: Any) -> bool:
    """Whether ``value`` is a default negative (video or image) with zero or more terms or categories
    deleted: same categories and terms, verbatim, in the default's order."""
    if not isinstance(value, dict) or list(value) != ["universal_negative"]:
        return False
    edit = value["universal_negative"]
    if not isinstance(edit, dict):
        return False
    for default in (DEFAULT_NEGATIVE_VIDEO, DEFAULT_NEGATIVE_IMAGE):
        cats = json.loads(default)["universal_negative"]
        if not set(edit) <= set(cats) or [c for c in cats if c in edit] != list(edit):
            continue
        if all(isinstance(edit[c], list) and _is_subsequence(edit[c], cats[c]) for c in edit):
            return True
    return False


def _is_subsequence(items: list, of: list) -> bool:
    it = iter(of)
    return all(isinstance(x, str) and any(x == y for y in it) for x in items)


# ----------------------------------------------------------------------------------------------
# VLM image
# ----------------------------------------------------------------------------------------------


def smart_resize(height: int, width: int, factor: int = 32, min_pixels: int = 4 * 32 * 32, max_pixels: int = 16384 * 32 * 32):
    """Round each side to a multiple of ``factor`` and bring the area inside [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.1f} is above 200; use a less extreme image.")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def vlm_image(pixel: torch.Tensor) -> Image.Image:
    """The first-frame pixels (1, 3, 1, H, W) in [0, 1] as the PIL image the VLM sees."""
    arr = (pixel[0, :, 0].clamp(0, 1) * 255).to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    img = Image.fromarray(arr, "RGB")
    h, w = smart_resize(arr.shape[0], arr.shape[1])
    return img.resize((w, h), Image.BICUBIC)


# ----------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------


def template_crop_start(processor) -> int:
    """Number of tokens of the template prefix (system turn + ``<|im_start|>user\\n``) tokenised alone."""
    return int(processor(text=[TEMPLATE_PREFIX], return_tensors="pt")["input_ids"].shape[1])


def processor_inputs(processor, text: str, image: Optional[Image.Image]) -> dict:
    user = (IMAGE_TOKENS + text) if image is not None else text
    return processor(
        text=[TEMPLATE_PREFIX + user + TEMPLATE_SUFFIX], images=[image] if image is not None else None, videos=None,
        do_resize=False, truncation=True, max_length=MAX_TEXT_TOKENS, padding="longest", return_tensors="pt",
    )


def encode_text(text_encoder, processor, text: str, image: Optional[Image.Image], device: torch.device, crop_start: int) -> torch.Tensor:
    """Hidden states (1, L, hidden) of the user turn (and trailing template tokens), on the CPU.

    The top-level module is called (its ``lm_head`` is an Identity, so ``logits`` are the final
    hidden states) so that an offload hook on it fires.
    """
    inputs = processor_inputs(processor, text, image)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    out = text_encoder(**inputs, use_cache=False)
    states = out.logits[:, crop_start:]
    mask = inputs["attention_mask"][:, crop_start:].bool()
    return states[mask][None].detach().to("cpu")


@dataclass
class PromptEmbeds:
    """Encoded conditioning, on the CPU. ``negative`` is None when guidance is off."""

    positive: torch.Tensor  # (1, L, hidden)
    negative: Optional[torch.Tensor]
    with_image: bool = False

    def to_device(self, device, dtype) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        neg = None if self.negative is None else self.negative.to(device=device, dtype=dtype)
        return self.positive.to(device=device, dtype=dtype), neg
