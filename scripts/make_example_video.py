#!/usr/bin/env python3
"""Write example_workflows/lingbot_example_input.mp4: a slow push-in on the example image.

The video-to-video and upscale examples load it through ComfyUI's Load Video. 17 frames (4n+1, the
frame counts the model takes) at 24 fps and 832x480 (the V2V example's size), H.264 in yuv420p so
every browser previews it; about 30 KB. Re-run after changing the example image::

    .venv/bin/python scripts/make_example_video.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import av
import numpy as np
from PIL import Image

EXAMPLES = Path(__file__).resolve().parents[1] / "example_workflows"
FRAMES, FPS, WIDTH, HEIGHT = 17, 24, 832, 480


def frames(image: Image.Image):
    """A crop of the image's 832:480 band that narrows by 12 % over the clip, scaled to 832x480."""
    w, h = image.size
    band = w * HEIGHT / WIDTH
    for i in range(FRAMES):
        zoom = 1.0 - 0.12 * i / (FRAMES - 1)
        cw, ch = w * zoom, band * zoom
        x0, y0 = (w - cw) / 2, (h - ch) / 2
        crop = image.resize((WIDTH, HEIGHT), Image.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch))
        yield np.asarray(crop, dtype=np.uint8)


def main() -> int:
    image = Image.open(EXAMPLES / "lingbot_example_input.png").convert("RGB")
    out = EXAMPLES / "lingbot_example_input.mp4"
    with av.open(str(out), "w") as container:
        stream = container.add_stream("libx264", rate=FPS, options={"crf": "30", "preset": "veryslow"})
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for array in frames(image):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        container.mux(stream.encode())
    print(f"wrote {out} ({out.stat().st_size} bytes, {FRAMES} frames, {WIDTH}x{HEIGHT}, {FPS} fps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
