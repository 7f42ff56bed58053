"""Forged mp4 files for the hostile-file tests: a real small mp4 written by PyAV, taken apart into its box
tree (this module's own parser, independent of lingbot_core.files.mp4_boxes), a box rewritten, and put back
together with every parent's size fixed."""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import numpy as np

CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"moof", b"traf", b"mvex", b"mfra"}


def encode(frames=5, width=96, height=64, codec="libx264", pix_fmt="yuv420p", metadata=None, fmt="mp4",
           options=None, seed=0, container_options=None) -> bytes:
    """A video of random-noise frames, encoded in memory by PyAV."""
    import av

    data = np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt, options=container_options or {}) as c:
        if metadata:
            c.metadata.update(metadata)
        s = c.add_stream(codec, rate=Fraction(24))
        s.width, s.height, s.pix_fmt = width, height, pix_fmt
        s.options = dict(options or {})
        for f in data:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return out.getvalue()


def parse(data: bytes, start=0, end=None):
    """[[type, payload bytes or child list], ...] (32-bit sizes only: what PyAV writes)."""
    end = len(data) if end is None else end
    out, at = [], start
    while at < end:
        size, kind = struct.unpack_from(">I4s", data, at)
        body = data[at + 8:at + size]
        out.append([kind, parse(data, at + 8, at + size) if kind in CONTAINERS else body])
        at += size
    return out


def build(tree) -> bytes:
    parts = []
    for kind, body in tree:
        raw = build(body) if isinstance(body, list) else body
        parts.append(struct.pack(">I4s", 8 + len(raw), kind) + raw)
    return b"".join(parts)


def find(tree, *path):
    """The [type, body] entry at ``path`` (types, first match at each level)."""
    node = None
    for kind in path:
        node = next(b for b in tree if b[0] == kind)
        tree = node[1]
    return node


def stco_shift(tree, delta: int):
    """Move every chunk offset by ``delta`` (the moov grew or shrank before the mdat)."""
    for trak in (b for b in find(tree, b"moov")[1] if b[0] == b"trak"):
        stco = find(trak[1], b"mdia", b"minf", b"stbl", b"stco")
        n = struct.unpack_from(">I", stco[1], 4)[0]
        offsets = struct.unpack_from(f">{n}I", stco[1], 8)
        stco[1] = stco[1][:8] + struct.pack(f">{n}I", *(o + delta for o in offsets))


def stbl(tree):
    return find(tree, b"moov", b"trak", b"mdia", b"minf", b"stbl")[1]


def index_bomb(samples: int = 85_000_000) -> bytes:
    """A few-kB mp4 whose sample table declares ``samples`` samples of one byte (one chunk, one timing
    entry): FFmpeg builds an index entry for each inside av.open."""
    tree = parse(encode(frames=1))
    table = stbl(tree)
    find(table, b"stsz")[1] = struct.pack(">IIII", 0, 1, samples, 0)[:12]
    find(table, b"stts")[1] = struct.pack(">IIII", 0, 1, samples, 1)
    find(table, b"stsc")[1] = struct.pack(">IIIII", 0, 1, 1, samples, 1)
    for kind in (b"ctts", b"stss"):
        table[:] = [b for b in table if b[0] != kind]
    tree[:] = [b for b in tree if b[0] != b"mdat"] + [[b"mdat", b"\0" * 16]]
    # the one chunk starts at the mdat's payload, now last
    head = build([b for b in tree if b[0] != b"mdat"])
    find(table, b"stco")[1] = struct.pack(">III", 0, 1, len(head) + 8)
    return build(tree)


def edit_bomb(entries: int = 100_000, samples: int = 1000) -> bytes:
    """An :func:`index_bomb` of ``samples`` samples (few enough to pass a sample bound) whose edit list
    holds ``entries`` entries, each the whole track again: FFmpeg copies the index once per entry."""
    tree = parse(index_bomb(samples))
    one = struct.pack(">IiI", samples, 0, 1 << 16)  # segment duration, media time 0, rate 1.0
    find(tree, b"moov", b"trak", b"edts", b"elst")[1] = struct.pack(">II", 0, entries) + one * entries
    mdat_at = len(build([b for b in tree if b[0] != b"mdat"]))
    find(stbl(tree), b"stco")[1] = struct.pack(">III", 0, 1, mdat_at + 8)
    return build(tree)


def polyglot(mp4: bytes, other: bytes, kind=b"junk") -> bytes:
    """``other`` (e.g. an MPEG-TS file) inside an unknown first box, then the mp4 with its chunk offsets moved."""
    tree = parse(mp4)
    stco_shift(tree, 8 + len(other))
    return build([[kind, other]]) + build(tree)


def disguised(mp4: bytes, other: bytes) -> bytes:
    """A valid mp4 in every box the pack checks, that FFmpeg's probe reads as ``other`` (e.g. MPEG-TS): its
    ftyp names the JPEG 2000 brand (the mov probe then scores 5 of 100) and a 'skip' box right after holds
    ``other``. The mp4 demuxer, forced, reads the mp4; whoever probes the bytes gets ``other``."""
    tree = parse(mp4)
    ftyp = find(tree, b"ftyp")
    ftyp[1] = b"jp2 " + ftyp[1][4:]
    stco_shift(tree, 8 + len(other))
    tree.insert(1, [b"skip", other])
    return build(tree)


def trun_bomb(samples: int = 85_000_000) -> bytes:
    """A fragmented mp4 whose first 'trun' declares ``samples`` samples of no per-sample fields (4 bytes)."""
    tree = parse(encode(frames=2, container_options={"movflags": "frag_keyframe+empty_moov"}))
    moof = find(tree, b"moof")
    trun = find(moof[1], b"traf", b"trun")
    flags = struct.unpack_from(">I", trun[1], 0)[0] & 0x5  # data offset, first sample flags: no per-sample fields
    extra = trun[1][8:8 + 4 * bool(flags & 1) + 4 * bool(flags & 4)]
    trun[1] = struct.pack(">II", flags, samples) + extra
    return build(tree)


def largesize_mdat(mp4: bytes) -> bytes:
    """The same mp4 with its mdat's size written as a 64-bit 'largesize' (header 16 bytes, not 8)."""
    tree = parse(mp4)
    kinds = [b[0] for b in tree]
    if kinds.index(b"mdat") < kinds.index(b"moov"):
        stco_shift(tree, 8)
    out = b""
    for kind, body in tree:
        raw = build(body) if isinstance(body, list) else body
        out += (struct.pack(">I4sQ", 1, kind, 16 + len(raw)) if kind == b"mdat" else struct.pack(">I4s", 8 + len(raw), kind)) + raw
    return out


def fragmented(mp4: bytes) -> bytes:
    """The same packets (a stream copy, no second encode) in a fragmented mp4 (moof + mdat per fragment)."""
    import av

    out = io.BytesIO()
    with av.open(io.BytesIO(mp4)) as src, av.open(out, mode="w", format="mp4",
                                                 options={"movflags": "frag_keyframe+empty_moov"}) as dst:
        stream = dst.add_stream_from_template(src.streams.video[0])
        for packet in src.demux(video=0):
            if packet.dts is not None:
                packet.stream = stream
                dst.mux(packet)
    return out.getvalue()
