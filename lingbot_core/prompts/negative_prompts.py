"""Delete-only editing of the DiT's default negative prompt, by hand or by a VLM ("auto negative").

Only deletions are allowed: every surviving term is verbatim, in its category, in the default's
order. Serialised like the default (Python's default separators), so deleting nothing gives the
default byte for byte, and ``resolve_negative`` keeps that serialisation.
"""

from __future__ import annotations

import json
import re
from typing import Dict, Iterable, List, Optional

from PIL import Image

from ..net.chat_client import ChatServer, chat, image_data_url, user_content
from .rewriter import RewriteError, parse_json_object
from .text_conditioning import DEFAULT_NEGATIVE_IMAGE, DEFAULT_NEGATIVE_VIDEO

NEGATIVE_MODES = ("video", "image")

# Whole categories the model may only drop when the caption gives a reason (prompt-rewriter.md).
# physical_plausibility is in the release's broader list, not in the DiT default; kept for such input.
CATEGORY_HINTS = {
    "physical_plausibility": ("fantasy", "surreal", "zero-gravity", "zero gravity", "weightless", "levitat",
                              "magic", "dream", "supernatural", "impossible", "sci-fi"),
    "artistic_style": ("painting", "painted", "cartoon", "anime", "cgi", "3d render", "illustration", "drawing",
                       "sketch", "watercolor", "digital art", "animated", "comic", "pixel art"),
}
# Scene words that make some default terms wrong for the sample, whatever the model answered.
DARK_SCENE_WORDS = ("dark", "night", "dim", "low light", "low-light", "moonlit", "candlelit", "shadowy", "unlit")
MOTION_BLUR_WORDS = ("motion blur", "motion-blur", "long exposure", "speed blur", "light trails", "blurred motion")


def default_negative_terms(mode: str) -> Dict[str, List[str]]:
    """``{category: [terms]}`` of the DiT default for ``mode`` ('video' or 'image'), in order."""
    if mode not in NEGATIVE_MODES:
        raise ValueError(f"mode={mode!r} is not allowed; use 'video' (t2v, ti2v) or 'image' (t2i).")
    default = DEFAULT_NEGATIVE_VIDEO if mode == "video" else DEFAULT_NEGATIVE_IMAGE
    return json.loads(default)["universal_negative"]


def serialize_negative(categories: Dict[str, List[str]]) -> str:
    """The negative text, serialised as the default (empty categories dropped)."""
    return json.dumps({"universal_negative": {c: t for c, t in categories.items() if t}})


def _split_terms(text: str) -> List[str]:
    return [t.strip() for t in re.split(r"[,\n]", text or "") if t.strip()]


def edit_negative(mode: str, drop_categories: Iterable[str] = (), remove_terms: Iterable[str] | str = ()) -> Dict[str, List[str]]:
    """The default for ``mode`` without ``drop_categories`` and without ``remove_terms`` (exact terms,
    case-insensitive; a comma- or newline-separated string is accepted). Unknown names are errors."""
    cats = default_negative_terms(mode)
    drop = list(drop_categories)
    unknown = [c for c in drop if c not in cats]
    if unknown:
        raise ValueError(f"the default {mode} negative has no category {', '.join(map(repr, unknown))}; "
                         f"categories: {', '.join(cats)}.")
    terms = _split_terms(remove_terms) if isinstance(remove_terms, str) else [t.strip() for t in remove_terms]
    known = {t.lower() for ts in cats.values() for t in ts}
    unknown = [t for t in terms if t.lower() not in known]
    if unknown:
        raise ValueError(f"remove_terms: {', '.join(map(repr, unknown))} not in the default {mode} negative; "
                         f"remove only listed terms, e.g. {', '.join(repr(t) for t in list(cats.values())[0][:4])}.")
    removed = {t.lower() for t in terms}
    return {c: [t for t in ts if t.lower() not in removed] for c, ts in cats.items() if c not in drop}


# ----------------------------------------------------------------------------------------------
# Auto negative
# ----------------------------------------------------------------------------------------------


def enforce_delete_only(answer: object, default: Dict[str, List[str]]) -> Dict[str, List[str]]:
    """Keep only the default's own terms that the answer kept: added or reworded terms are dropped, a
    category missing from the answer is kept whole, anything that is not an object gives the default."""
    if isinstance(answer, dict) and isinstance(answer.get("universal_negative"), dict):
        answer = answer["universal_negative"]
    if not isinstance(answer, dict):
        return {c: list(t) for c, t in default.items()}
    out = {}
    for cat, terms in default.items():
        if cat not in answer:
            out[cat] = list(terms)
            continue
        kept = answer[cat] if isinstance(answer[cat], list) else []
        kept_set = {k for k in kept if isinstance(k, str)}
        out[cat] = [t for t in terms if t in kept_set]
    return out


def _mentions(text: str, words: Iterable[str]) -> bool:
    return any(re.search(r"(?<![a-z])" + re.escape(w), text) for w in words)


def apply_guards(pruned: Dict[str, List[str]], default: Dict[str, List[str]], caption: str) -> Dict[str, List[str]]:
    """Rule-based corrections of the model's pruning (prompt-rewriter.md, "Auto negative")."""
    text = caption.lower()
    out = {c: list(t) for c, t in pruned.items()}
    for cat, hints in CATEGORY_HINTS.items():
        if cat in default and not out.get(cat) and not _mentions(text, hints):
            out[cat] = list(default[cat])  # a whole category needs a reason in the caption
    drop = set()
    if _mentions(text, DARK_SCENE_WORDS):
        drop |= {t for ts in default.values() for t in ts if "exposed" in t}
    if _mentions(text, MOTION_BLUR_WORDS):
        drop.add("motion blur")
    return {c: [t for t in ts if t not in drop] for c, ts in out.items()}


def auto_negative_text(system: str, mode: str, caption: str) -> str:
    """The pack's own user text for the auto-negative request (the release documents no exact text)."""
    return (system + f"\n\nMode: {mode}\n\nDEFAULT NEGATIVE:\n" + serialize_negative(default_negative_terms(mode))
            + "\n\nCAPTION:\n" + caption.strip() + "\n\nOutput the pruned negative JSON now.")


def auto_negative(server: ChatServer, system: str, model: str, caption: str, mode: str, *,
                  image: Optional[Image.Image] = None, base: Optional[Dict[str, List[str]]] = None,
                  seed: Optional[int] = None) -> Dict[str, List[str]]:
    """Ask the base VLM which terms of ``base`` (default: the mode's default) do not fit the caption,
    then enforce delete-only and the guards. An unparseable answer leaves ``base`` unchanged."""
    default = default_negative_terms(mode)
    base = default if base is None else base
    if not isinstance(caption, str) or not caption.strip():
        raise ValueError("auto negative needs the caption: connect the rewritten prompt (or type it) to caption.")
    answer_text = chat(server, model, user_content(auto_negative_text(system, mode, caption),
                                                   image_data_url(image) if image is not None else None),
                       temperature=0.0, seed=seed)
    try:
        answer = parse_json_object(answer_text)
    except RewriteError:
        return {c: list(t) for c, t in base.items()}
    return apply_guards(enforce_delete_only(answer, base), base, caption)
