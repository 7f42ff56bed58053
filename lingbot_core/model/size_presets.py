"""The release's size buckets: (height, width) per resolution and ratio, as the reference runner's
``--resolution`` / ``--ratio``. One table for the CLI and the nodes.

The ratio is the reference's **H:W**: "9:16" is the landscape frame (480p 9:16 = 480 high, 832 wide).
Every size is a multiple of 32 (the text encoder's image patch grid), so TI2V first frames need no rounding.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

RATIOS = ("1:1", "9:16", "16:9", "3:4", "4:3")
BUCKETS: Dict[str, Dict[str, Tuple[int, int]]] = {
    "192p": {"1:1": (192, 192), "9:16": (192, 320), "16:9": (320, 192), "3:4": (192, 256), "4:3": (256, 192)},
    "480p": {"1:1": (480, 480), "9:16": (480, 832), "16:9": (832, 480), "3:4": (480, 640), "4:3": (640, 480)},
    "720p": {"1:1": (736, 736), "9:16": (736, 1280), "16:9": (1280, 736), "3:4": (736, 960), "4:3": (960, 736)},
    "1080p": {"1:1": (1088, 1088), "9:16": (1088, 1920), "16:9": (1920, 1088), "3:4": (1088, 1440), "4:3": (1440, 1088)},
    "2k": {"1:1": (1440, 1440), "9:16": (1440, 2560), "16:9": (2560, 1440), "3:4": (1440, 1920), "4:3": (1920, 1440)},
    "4k": {"1:1": (2176, 2176), "9:16": (2176, 3840), "16:9": (3840, 2176), "3:4": (2176, 2880), "4:3": (2880, 2176)},
}


def preset_size(resolution: str, ratio: str) -> Tuple[int, int]:
    """(height, width) of a bucket; an unknown name is refused with the known ones."""
    if resolution not in BUCKETS:
        raise ValueError(f"resolution {resolution!r} is not a size preset; use one of {', '.join(BUCKETS)}.")
    if ratio not in RATIOS:
        raise ValueError(f"ratio {ratio!r} is not a size preset ratio; use one of {', '.join(RATIOS)} (H:W).")
    return BUCKETS[resolution][ratio]


def preset_label(resolution: str, ratio: str) -> str:
    """A preset as a node lists it, with the size it gives, e.g. ``480p 9:16 - 832x480 (landscape)``."""
    height, width = preset_size(resolution, ratio)
    shape = "square" if height == width else "landscape" if width > height else "portrait"
    return f"{resolution} {ratio} - {width}x{height} ({shape})"


def preset_labels() -> List[str]:
    return [preset_label(r, q) for r in BUCKETS for q in RATIOS]


def size_from_label(label: str) -> Tuple[int, int]:
    """(height, width) of a :func:`preset_label`."""
    resolution, ratio = (label.split(" - ")[0].split() + ["", ""])[:2]
    size = preset_size(resolution, ratio)
    if preset_label(resolution, ratio) != label:
        raise ValueError(f"size preset {label!r} is not one of the listed presets.")
    return size
