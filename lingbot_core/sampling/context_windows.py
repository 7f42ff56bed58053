"""Context windows: the DiT sees a long latent video as overlapping clips, one at a time.

At every sampling step the latent video (T latent frames) is cut into windows of ``size`` latent
frames that overlap by at least ``overlap`` frames. Each window runs through the DiT as a standalone
clip (its RoPE positions start at 0, as for a video of that length), and the velocities of the windows
are blended over the overlaps with linear weights that sum to one on every latent frame; the solver
then steps the whole latent. Only one window's activations exist at a time, so memory follows the
window, not the video; the weights stream once per window per step (offload ``block``).

Layout (written for this pack): the fewest windows that keep the asked overlap,
``n = ceil((T - overlap) / (size - overlap))``, spread evenly from frame 0 to the last frame, so every
window has the same length (one RoPE table serves them all) and the real overlaps are ``overlap`` or a
little more. In an overlap, the left window's weight falls linearly and the right one's rises (over
``m`` shared frames: ``(m - j) / (m + 1)`` and ``(j + 1) / (m + 1)``); the weights are then divided
by their sum per frame, so they sum to one even where three windows meet (an overlap above half the
window). A video no longer than one window is one window covering it: the DiT call is today's.

Sizes are given in pixel frames, as a user counts them: ``context_frames`` 4n+1 (a clip the model can
generate) and ``context_overlap`` a multiple of 4; in latent frames that is ``(frames - 1) / 4 + 1``
and ``overlap / 4``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

import torch

TEMPORAL = 4  # pixel frames per latent frame (the Wan 2.1 VAE; frame 0 alone)
REFINER_CONTEXT_FRAMES = 121  # the refiner's training clip length (5 s at 24 fps)
DEFAULT_OVERLAP = 24  # pixel frames (6 latent frames)
MAX_CONTEXT_FRAMES = 1001

Span = Tuple[int, int]


@dataclass(frozen=True)
class ContextWindows:
    """Window length and minimum overlap, in latent frames."""

    size: int
    overlap: int

    @property
    def pixel_frames(self) -> int:
        return (self.size - 1) * TEMPORAL + 1

    def spans(self, length: int) -> List[Span]:
        return list(window_spans(length, self.size, self.overlap))

    def weights(self, length: int) -> List[torch.Tensor]:
        return blend_weights(self.spans(length), length)

    def describe(self, length: int) -> str:
        spans = self.spans(length)
        return (f"{len(spans)} context windows of {min(self.size, length)} latent frames "
                f"({self.pixel_frames} pixel frames, overlap >= {self.overlap * TEMPORAL}) over {length} latent frames")


OFF = (0, 1)  # context_frames values that turn windows off


def check_context(context_frames, context_overlap) -> Optional[ContextWindows]:
    """The user's pixel-frame options -> windows in latent frames, or None (``context_frames`` 0 or 1 = off:
    ComfyUI's widget keeps 4n+1 values by stepping from its minimum, 1, so 1 is the widget's "off")."""
    def as_int(name, value):
        if isinstance(value, bool) or not float(value).is_integer():
            raise ValueError(f"{name}={value!r} must be a whole number of frames.")
        return int(value)

    frames, overlap = as_int("context_frames", context_frames), as_int("context_overlap", context_overlap)
    if frames in OFF:
        return None
    if frames < 5 or (frames - 1) % TEMPORAL or frames > MAX_CONTEXT_FRAMES:
        raise ValueError(f"context_frames={frames} is not allowed: use 0 or 1 (off) or 4n+1 frames from 5 to {MAX_CONTEXT_FRAMES} "
                         f"(e.g. {REFINER_CONTEXT_FRAMES}, the refiner's clip; 81 or 61 to save memory).")
    if overlap < 0 or overlap % TEMPORAL or overlap >= frames - 1:
        raise ValueError(f"context_overlap={overlap} is not allowed: use a multiple of {TEMPORAL} from 0 to "
                         f"{frames - 1 - TEMPORAL} (below context_frames - 1), e.g. {DEFAULT_OVERLAP}.")
    return ContextWindows((frames - 1) // TEMPORAL + 1, overlap // TEMPORAL)


@lru_cache(maxsize=64)
def window_spans(length: int, size: int, overlap: int) -> Tuple[Span, ...]:
    """``[start, end)`` latent-frame spans covering ``range(length)`` (see the module docstring)."""
    if length < 1 or size < 1 or not 0 <= overlap < size:
        raise ValueError(f"bad context windows: length {length}, size {size}, overlap {overlap}.")
    if length <= size:
        return ((0, length),)
    count = math.ceil((length - overlap) / (size - overlap))
    # Starts spread evenly from 0 to length - size: neighbours are at most size - overlap apart.
    return tuple((k * (length - size) // (count - 1), k * (length - size) // (count - 1) + size) for k in range(count))


def blend_weights(spans: List[Span], length: int) -> List[torch.Tensor]:
    """Per window, a float32 weight per latent frame of the window; over each frame the weights of the
    windows covering it sum to one."""
    raw = []
    for k, (start, end) in enumerate(spans):
        left = spans[k - 1][1] - start if k > 0 else 0  # frames shared with the previous window
        right = end - spans[k + 1][0] if k + 1 < len(spans) else 0
        w = torch.ones(end - start, dtype=torch.float64)
        j = torch.arange(end - start, dtype=torch.float64)
        if left > 0:
            w = torch.minimum(w, (j + 1) / (left + 1))
        if right > 0:
            w = torch.minimum(w, (end - start - j) / (right + 1))
        raw.append(w)
    total = torch.zeros(length, dtype=torch.float64)
    for (start, end), w in zip(spans, raw):
        total[start:end] += w
    return [(w / total[start:end]).float() for (start, end), w in zip(spans, raw)]


def centre_frame(span: Span) -> int:
    """The pixel frame at the centre of a window of latent frames ``[start, end)``: the midpoint of its first
    and last latent frames' pixel positions (latent frame j sits at pixel frame 4j), ``2 (start + end - 1)``."""
    start, end = span
    return (start + end - 1) * TEMPORAL // 2
