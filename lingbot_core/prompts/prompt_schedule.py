"""Prompt schedules: several prompts for one video, each holding from its start frame.

A schedule is a list of prompts (structured JSON captions or plain text, as any prompt) with start
frames in pixel frames: prompt k holds on frames ``starts[k]`` to ``starts[k + 1] - 1``. Without
starts the prompts are spread evenly, ``starts[k] = k * num_frames // n``. The first prompt starts at
frame 0; starts are strictly increasing and inside the video.

The DiT takes one prompt per forward, so a schedule needs context windows
(lingbot_core.sampling.context_windows): each window is one forward, conditioned on one part. The rule
for a window (also one that straddles two parts) is its centre frame's prompt. Neighbouring windows
already blend their velocities linearly over their overlap, so the change from one prompt to the next
is spread over that overlap rather than cut at a frame; and each window sees exactly one encoded
prompt, so identical prompts give exactly the single-prompt result and every embedding is one the
text encoder produced (blending embeddings of prompts of different lengths has no exact meaning).

Every part must condition at least one window; otherwise the schedule is refused with a message
that says how many windows there are and how to get more (a shorter ``context_frames``).

Node text format (``split_parts``): parts separated by a line holding only ``---``; starts as a
comma- or space-separated list of frame numbers (``parse_starts``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from .text_conditioning import parse_prompt, serialize_caption

MAX_PARTS = 64  # a story of 64 parts needs at least 64 windows; more is a mistake, not a story
MAX_SCHEDULE_CHARS = 1 << 20  # the node's text box, checked before it is split
SEPARATOR = "---"
_SEPARATOR_LINE = re.compile(r"^[ \t]*---[ \t]*$", re.MULTILINE)

Negatives = Union[None, str, Sequence[Optional[str]]]


@dataclass(frozen=True)
class PromptSchedule:
    """A checked schedule for a video of ``num_frames`` frames."""

    prompts: Tuple[str, ...]
    starts: Tuple[int, ...]  # pixel frames, starts[0] == 0, strictly increasing, < num_frames
    negatives: Tuple[Optional[str], ...]  # one per prompt (None: the mode's default negative)
    num_frames: int

    def part_at(self, frame: int) -> int:
        """The index of the prompt that holds on pixel frame ``frame``."""
        return max(k for k, s in enumerate(self.starts) if s <= frame)

    def frames(self, k: int) -> str:
        """Part ``k``'s frames, as a user reads them ("frames 48-95")."""
        end = self.starts[k + 1] if k + 1 < len(self.starts) else self.num_frames
        return f"frames {self.starts[k]}-{end - 1}"

    def describe(self) -> str:
        return "; ".join(f"part {k + 1}: {self.frames(k)}" for k in range(len(self.starts)))


def even_starts(parts: int, num_frames: int) -> List[int]:
    """``parts`` start frames spread evenly over ``num_frames`` frames: ``k * num_frames // parts``."""
    return [k * num_frames // parts for k in range(parts)]


def _as_list(value, name: str) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name} must be a list, got {type(value).__name__}.")


def check_schedule(prompts: Sequence[str], num_frames: int, starts: Optional[Sequence[int]] = None,
                   negative_prompt: Negatives = None) -> PromptSchedule:
    """Check a schedule's prompts, starts (None = evenly spread) and negatives (None or one text for all
    parts, or a list of one or one per part) against a video of ``num_frames`` frames."""
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompt must be text, or a list of texts for a prompt schedule; got {type(prompts).__name__}.")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("the prompt schedule is empty: give at least one prompt.")
    if len(prompts) > MAX_PARTS:
        raise ValueError(f"the prompt schedule has {len(prompts)} parts; at most {MAX_PARTS} are allowed.")
    for k, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"prompt schedule part {k + 1} of {len(prompts)} is empty: write its prompt, or remove the "
                             "part (and its start frame).")
        try:
            parse_prompt(p)
        except ValueError as e:
            raise ValueError(f"prompt schedule part {k + 1}: {e}") from None
    n = len(prompts)
    if n > num_frames:
        raise ValueError(f"the prompt schedule has {n} parts but the video has only {num_frames} frames.")
    if starts is None:
        starts = even_starts(n, num_frames)
    else:
        starts = _as_list(starts, "prompt_starts")
        if len(starts) != n:
            raise ValueError(f"prompt_starts has {len(starts)} start frames for {n} prompts: give one per prompt "
                             "(or none, to spread the prompts evenly).")
        for k, s in enumerate(starts):
            if isinstance(s, bool) or not isinstance(s, int):
                raise ValueError(f"prompt_starts[{k}]={s!r} must be a whole frame number.")
        if starts[0] != 0:
            raise ValueError(f"prompt_starts must begin with 0 (the first prompt holds from the first frame); got {starts[0]}.")
        for k in range(1, n):
            if starts[k] <= starts[k - 1]:
                what = "repeats" if starts[k] == starts[k - 1] else "comes before"
                raise ValueError(f"prompt_starts must be strictly increasing: part {k + 1}'s start {starts[k]} {what} "
                                 f"part {k}'s start {starts[k - 1]}.")
        if starts[-1] >= num_frames:
            raise ValueError(f"prompt_starts: part {n}'s start {starts[-1]} is past the video's last frame "
                             f"({num_frames - 1}; frames count from 0).")
    if negative_prompt is None or isinstance(negative_prompt, str):
        negatives = [negative_prompt] * n
    else:
        negatives = _as_list(negative_prompt, "negative_prompt")
        if len(negatives) == 1:
            negatives = negatives * n
        elif len(negatives) != n:
            raise ValueError(f"negative_prompt has {len(negatives)} parts for {n} prompts: give one negative for all "
                             "parts, or one per part.")
        for k, neg in enumerate(negatives):
            if neg is not None and not isinstance(neg, str):
                raise ValueError(f"negative_prompt part {k + 1} must be text or None, got {type(neg).__name__}.")
    return PromptSchedule(tuple(prompts), tuple(int(s) for s in starts), tuple(negatives), int(num_frames))


def window_parts(schedule: PromptSchedule, centres: Sequence[int]) -> List[int]:
    """The part conditioning each window, by its centre pixel frame; every part must get a window."""
    n, count = len(schedule.prompts), len(centres)
    if n > count:
        raise ValueError(f"the prompt schedule has {n} parts but the video is sampled in only {count} context "
                         f"window{'s' if count != 1 else ''}: each part needs at least one window. Lower context_frames "
                         "(e.g. 41 or 61; the overlap too if needed), or use fewer parts.")
    parts = [schedule.part_at(c) for c in centres]
    unused = [k for k in range(n) if k not in parts]
    if unused:
        k = unused[0]
        raise ValueError(f"prompt schedule part {k + 1} ({schedule.frames(k)}) is the part "
                         f"of no context window (their centre frames: {', '.join(map(str, centres))}): lengthen the "
                         "part, or lower context_frames so that windows are shorter.")
    return parts


def split_parts(text: str) -> List[str]:
    """The node's text: parts separated by a line holding only ``---`` (JSON captions may span lines)."""
    if not isinstance(text, str):
        raise ValueError(f"the schedule text must be text, got {type(text).__name__}.")
    if len(text) > MAX_SCHEDULE_CHARS:
        raise ValueError(f"the schedule text has {len(text)} characters; at most {MAX_SCHEDULE_CHARS} are read.")
    parts = [p.strip() for p in _SEPARATOR_LINE.split(text.replace("\r\n", "\n"))]
    if len(parts) > MAX_PARTS:
        raise ValueError(f"the schedule text has {len(parts)} parts; at most {MAX_PARTS} are allowed.")
    for k, p in enumerate(parts):
        if not p:
            raise ValueError(f"schedule part {k + 1} of {len(parts)} is empty: write a prompt between the '{SEPARATOR}' "
                             "lines, or remove the extra separator.")
    return parts


def parse_starts(text: str) -> Optional[List[int]]:
    """``"0, 48, 96"`` -> [0, 48, 96]; empty -> None (evenly spread)."""
    if not isinstance(text, str):
        raise ValueError(f"start frames must be text, got {type(text).__name__}.")
    fields = [f for f in re.split(r"[\s,;]+", text.strip()) if f]
    if len(fields) > MAX_PARTS:
        raise ValueError(f"{len(fields)} start frames; at most {MAX_PARTS} are allowed.")
    try:
        return [int(f) for f in fields] or None
    except ValueError:
        raise ValueError(f"start frames {text!r} must be whole frame numbers separated by commas, e.g. 0, 48, 96.") from None


def schedule_from_json(data) -> Optional[Tuple[List[str], Optional[List[int]]]]:
    """A prompt file holding a list of two or more parts -> (prompts, starts or None); anything else -> None
    (one prompt). A part is text, or an object: a caption file's object (``{"caption": ..., ...}``) with an
    optional ``"start_frame"``; give ``start_frame`` on every part or on none (then they are spread evenly)."""
    if not isinstance(data, list) or len(data) < 2:
        return None
    if len(data) > MAX_PARTS:
        raise ValueError(f"the prompt file has {len(data)} parts; at most {MAX_PARTS} are allowed.")
    prompts, starts = [], []
    for k, item in enumerate(data):
        if isinstance(item, str):
            prompts.append(item)
            continue
        if not isinstance(item, dict):
            raise ValueError(f"prompt file part {k + 1} must be text or an object, got {type(item).__name__}.")
        item = dict(item)
        if "start_frame" in item:
            starts.append(item.pop("start_frame"))
        prompts.append(serialize_caption(item))
    if starts and len(starts) != len(prompts):
        raise ValueError(f"the prompt file gives start_frame on {len(starts)} of its {len(prompts)} parts: give it on "
                         "every part, or on none (to spread the parts evenly).")
    return prompts, starts or None
