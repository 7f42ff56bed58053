"""Checks on a structured caption that the DiT cannot report itself.

The release warns that a caption's duration must cover its action timestamps: actions described
past the end of the video are not rendered, or get squeezed into it. These checks return warnings
(the caption is still usable), each naming the element and the timestamp.
"""

from __future__ import annotations

import math
import re
from typing import Any, List, Optional

# "[0.0s - 0.5s]" in the shipped captions; the brackets, the "s" and the spaces are optional.
_TIMESTAMP = re.compile(r"^\[?\s*(\d+(?:\.\d+)?)\s*s?\s*-\s*(\d+(?:\.\d+)?)\s*s?\s*\]?$")
_TOLERANCE = 1e-6


def _element_label(index: int, element: dict) -> str:
    name = element.get("name")
    return f"prominent_elements[{index}] {name!r}" if isinstance(name, str) and name else f"prominent_elements[{index}]"


def caption_warnings(caption: Any, duration: Optional[float]) -> List[str]:
    """Warnings for malformed action timestamps, and (with a duration) for actions that end after it."""
    if not isinstance(caption, dict):
        return []
    elements = caption.get("prominent_elements")
    if not isinstance(elements, list):
        return []
    warnings = []
    for i, element in enumerate(elements):
        if not isinstance(element, dict) or not isinstance(element.get("actions"), list):
            continue
        label = _element_label(i, element)
        for action in element["actions"]:
            stamp = action.get("timestamp") if isinstance(action, dict) else None
            match = _TIMESTAMP.match(stamp.strip()) if isinstance(stamp, str) else None
            start, end = (float(match.group(1)), float(match.group(2))) if match else (math.nan, math.nan)
            if not match or not start < end:
                warnings.append(f"{label}: action timestamp {stamp!r} is malformed; write it as "
                                "\"[start s - end s]\" with start < end, e.g. \"[0.0s - 2.5s]\".")
            elif duration is not None and end > duration + _TOLERANCE:
                warnings.append(f"{label}: action timestamp {stamp!r} ends at {end:g} s, after the duration "
                                f"{duration:g} s; set \"duration\" to at least {math.ceil(end - _TOLERANCE)} or "
                                "shorten the action.")
    return warnings
