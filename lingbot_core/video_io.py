"""Writing frames to mp4 / png and a contact sheet (CLI and demo only; ComfyUI has its own savers)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np


def to_uint8(frames) -> np.ndarray:
    """(T, H, W, 3) float in [0, 1] -> uint8 by truncation, as the reference's exporter does."""
    return (np.clip(np.asarray(frames, dtype=np.float32), 0, 1) * 255).astype(np.uint8)


def write_video(frames, path, fps: float = 24.0, crf: int = 18) -> Path:
    """H.264 mp4 (yuv420p) through PyAV."""
    import av

    data = to_uint8(frames)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = data.shape[2], data.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in data:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_png(image, path) -> Path:
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(to_uint8(np.asarray(image)[None])[0]).save(path)
    return path


def contact_sheet(frames, columns: int = 4, max_frames: int = 16) -> np.ndarray:
    """Up to ``max_frames`` evenly spaced frames tiled in a grid, (H', W', 3) float."""
    frames = np.asarray(frames, dtype=np.float32)
    idx = np.linspace(0, len(frames) - 1, min(max_frames, len(frames))).round().astype(int)
    picked = frames[idx]
    rows = -(-len(picked) // columns)
    cols = min(columns, len(picked))
    h, w = picked.shape[1:3]
    sheet = np.ones((rows * h, cols * w, 3), dtype=np.float32)
    for i, f in enumerate(picked):
        r, c = divmod(i, cols)
        sheet[r * h : (r + 1) * h, c * w : (c + 1) * w] = f
    return sheet
