"""Video files: reading a server's mp4 (checked before it is decoded) and a local video (the command
line's ``--video``), and writing frames to mp4 / png and a contact sheet (CLI and demo only; ComfyUI has its
own loaders and savers)."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Optional

import numpy as np

from .mp4_boxes import ACCEPTED, VIDEO_CODECS, Mp4Refused, check_mp4

# A server that rounds the frame count, or a container whose header counts approximately, may be a
# few frames off; more than this is another video, refused before it is decoded.
FRAME_SLACK = 4
DECODERS = frozenset(VIDEO_CODECS.values())  # FFmpeg's names of the decoders a file may reach


class VideoMismatch(ValueError):
    """The mp4 is not the video that was asked for (size or length); nothing was decoded beyond the proof."""


class NotAnMp4(ValueError):
    """The answer is not an mp4 (ISO/QuickTime) file; it was refused before FFmpeg read a frame."""


# The only demuxer a file may reach: FFmpeg's mov/mp4 demuxer, forced, never probed (a probe would let
# a 146-byte ffconcat list read a local file, or a PNG decode at any size). Its data references (files
# beside the mp4) stay off, any other file or URL it might open is refused, and its edit lists are not
# applied (FFmpeg rebuilds the whole index once per edit; mp4_boxes bounds their count too).
MP4_DEMUXER = "mp4"
_DEMUXER_NAMES = "mov,mp4,m4a,3gp,3g2,mj2"
_CONTAINER_OPTIONS = {"format_whitelist": _DEMUXER_NAMES, "enable_drefs": "0", "use_absolute_path": "0",
                      "protocol_whitelist": "none", "ignore_editlist": "1"}


def _no_other_files(url, flags, options):
    raise PermissionError("an mp4 may not open other files")


@dataclass(frozen=True)
class StreamInfo:
    """What the container's header says of its first video stream (``frames`` None when it does not say)."""

    width: int
    height: int
    frames: Optional[int]
    duration_s: Optional[float]
    fps: Optional[float]


def _stream_info(stream) -> StreamInfo:
    rate = stream.average_rate or stream.guessed_rate
    fps = float(rate) if rate else None
    duration = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else None
    frames = int(stream.frames) if stream.frames else None
    if frames is None and duration is not None and fps:
        # A fragmented mp4 counts no samples in its header, but states its duration.
        frames = int(math.ceil(duration * fps - 1e-6))
    return StreamInfo(int(stream.codec_context.width), int(stream.codec_context.height), frames, duration, fps)


def _open_mp4(source, *, max_frames: int, max_pixels: int):
    """``(container, first video stream)`` of an mp4 (bytes or an open binary file), its boxes checked first
    (:func:`mp4_boxes.check_mp4`: NotAnMp4 before FFmpeg reads a byte), then opened by the mp4 demuxer alone;
    FFmpeg may not decode a picture of more than ``max_pixels`` even to read the header."""
    import av

    try:
        check_mp4(source, max_frames=max_frames)
    except Mp4Refused as e:
        raise NotAnMp4(str(e)) from None
    if isinstance(source, (bytes, bytearray)):
        stream_of = io.BytesIO(source)
    else:
        stream_of = source
        stream_of.seek(0)  # the walk left it elsewhere
    no_larger = {"max_pixels": str(int(max_pixels))}
    try:
        container = av.open(stream_of, mode="r", format=MP4_DEMUXER, options=no_larger,
                            container_options=_CONTAINER_OPTIONS, io_open=_no_other_files)
    except av.error.FFmpegError as e:
        raise NotAnMp4(f"not an mp4 file ({type(e).__name__}; only mp4 is accepted, nothing else is opened)") from None
    try:
        if not container.streams.video:
            raise NotAnMp4("an mp4 with no video stream")
        stream = container.streams.video[0]
        if stream.codec_context.name not in DECODERS:
            raise NotAnMp4(f"an mp4 whose video is {stream.codec_context.name}; only {ACCEPTED} are accepted")
        stream.codec_context.options = dict(no_larger)  # a frame larger than its header said is refused unallocated
    except BaseException:
        container.close()
        raise
    return container, stream


def read_mp4(data: bytes, *, frames: int, height: int, width: int) -> np.ndarray:
    """The first video stream as (frames, height, width, 3) uint8. Only an mp4 of H.264, HEVC, AV1 or VP9
    whose boxes declare no more than ``frames`` allows is opened (NotAnMp4 for anything else, before
    FFmpeg reads it). Its header is checked against the request before any frame is decoded
    (VideoMismatch), FFmpeg may not decode a picture larger than the asked size even to read the header,
    and frames are then decoded one at a time into an array allocated for the request."""
    asked = f"{frames} frames of {width}x{height}"
    # Twice the pixels: the H.264 decoder checks its padded size, which exceeds width x height.
    container, stream = _open_mp4(data, max_frames=frames + FRAME_SLACK, max_pixels=2 * int(width) * int(height))
    with container:
        info = _stream_info(stream)
        if (info.width, info.height) != (width, height):
            raise VideoMismatch(f"a video of {info.width}x{info.height} (its header) but {asked} were asked for")
        if info.frames is None:
            raise VideoMismatch(f"an mp4 whose header gives neither a frame count nor a duration, but {asked} were "
                                "asked for")
        if abs(info.frames - frames) > FRAME_SLACK:
            raise VideoMismatch(f"{info.frames:,} frames (its header) but {asked} were asked for")
        out = np.empty((frames, height, width, 3), dtype=np.uint8)
        count = 0
        for frame in container.decode(stream):
            if (frame.width, frame.height) != (width, height):
                raise VideoMismatch(f"a frame of {frame.width}x{frame.height} but {asked} were asked for")
            if count < frames:
                out[count] = frame.to_ndarray(format="rgb24")
            count += 1
            if count > frames + FRAME_SLACK:
                raise VideoMismatch(f"more than {frames + FRAME_SLACK} frames (its header said "
                                    f"{info.frames}) but {asked} were asked for")
    if count == 0:
        raise ValueError("the video stream has no frames")
    if count != frames:
        raise VideoMismatch(f"{count} frames of {width}x{height} but {asked} were asked for")
    return out


def clean_mp4(data: bytes, *, frames: int, height: int, width: int) -> bytes:
    """A new mp4 holding only the video stream :func:`read_mp4` decodes from ``data`` (same checks, same
    demuxer, same first video stream), its packets copied as they are: no other stream, none of the
    server's metadata (a comment, a workflow), and nothing outside the mp4 boxes (a polyglot's other
    format) reaches whoever probes the bytes next. Call it on an answer read_mp4 accepted."""
    import av

    container, stream = _open_mp4(data, max_frames=frames + FRAME_SLACK, max_pixels=2 * int(width) * int(height))
    out = io.BytesIO()
    with container, av.open(out, mode="w", format=MP4_DEMUXER) as copy:
        target = copy.add_stream_from_template(stream)
        target.metadata.clear()
        for packet in container.demux(stream):
            if packet.dts is None:
                continue  # the demuxer's flush packet
            packet.stream = target
            copy.mux(packet)
    return out.getvalue()


def read_video_file(path, *, max_frames: int, max_side: int):
    """A local mp4's first video stream as ((T, H, W, 3) uint8, fps), for the command line.

    The file's boxes are checked first (an mp4 of H.264, HEVC, AV1 or VP9 declaring no more samples than
    ``max_frames`` allows), then its header (size at most ``max_side``, at most ``max_frames`` frames when it
    says), and decoding stops with an error past ``max_frames`` frames, so a huge file is refused before it
    fills RAM."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no video file at {path}")
    too_long = (f"{path} has more than {max_frames} frames; cut it (e.g. ffmpeg -i in.mp4 -frames:v {max_frames} "
                "out.mp4) or refine it in parts.")
    with open(path, "rb") as f:
        try:
            container, stream = _open_mp4(f, max_frames=max_frames + FRAME_SLACK, max_pixels=max_side * max_side)
        except NotAnMp4 as e:
            raise ValueError(f"{path} is {e}. Only mp4 (or mov) files of {ACCEPTED} video are read; convert "
                             "others with e.g. ffmpeg -i in.mkv -c:v libx264 out.mp4.") from None
        with container:
            info = _stream_info(stream)
            if max(info.width, info.height) > max_side:
                raise ValueError(f"{path} is {info.width}x{info.height}; at most {max_side} pixels a side are accepted.")
            if info.frames is not None and info.frames > max_frames + FRAME_SLACK:
                raise ValueError(too_long)
            frames = []
            for frame in container.decode(stream):
                if len(frames) == max_frames:
                    raise ValueError(too_long)
                frames.append(frame.to_ndarray(format="rgb24"))
    if not frames:
        raise ValueError(f"{path} has no video frames.")
    if info.fps is None:
        raise ValueError(f"{path} does not state its frame rate.")
    return np.stack(frames), info.fps


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
