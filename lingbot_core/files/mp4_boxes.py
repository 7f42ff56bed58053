"""The box tree of an mp4 (ISO BMFF / QuickTime), walked and checked before FFmpeg opens the file.

FFmpeg builds a track's whole sample index inside ``av.open``: a 1.8 kB file whose ``stsz`` box declares 85 M
samples costs gigabytes before any header check can run, and an edit list of 100 k entries as much. So the
counts that size that index are read here first, from the boxes themselves, and bounded by the frames the
caller will read: samples per track (``stsz``/``stz2``, the sums of ``stts``/``ctts``, ``stsc``'s samples per
chunk), every table's entry count (which must also fit in its box's bytes), edit-list entries, and the
samples of a fragmented mp4's ``trun`` boxes summed over the file. The walk itself is bounded (iterative,
box sizes checked against their parent, 64-bit and to-the-end sizes, a depth and a box-count limit), the
file must begin with ``ftyp`` and hold only mp4 boxes at its top level (a polyglot hides another format in
an unknown box), and its video tracks must be H.264, HEVC, AV1 or VP9 (what a video server sends: any
other decoder is never reached). Every refusal is a :class:`Mp4Refused` naming the box and the count.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, List

MAX_DEPTH = 8
MAX_BOXES = 20_000  # a fragmented 1001-frame mp4 with one fragment per frame has ~7,000
MAX_TRACKS = 16
MAX_EDITS = 16  # an edit list holds one or two entries; FFmpeg rebuilds the index once per entry
MAX_SAMPLE_ENTRIES = 4
# Audio beside the video holds about two samples per video frame (AAC at 48 kHz, 24 fps). FFmpeg keeps ~36
# bytes a sample, so this bound costs a few MiB at most; a video moderately longer than asked passes it, to
# be refused by the header checks with its frame count.
SAMPLES_PER_FRAME, SAMPLE_MARGIN = 16, 65_536

TOP_LEVEL = frozenset({b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"moof", b"mfra", b"sidx", b"styp"})
# Boxes whose payload is only boxes (descended); everything else is a leaf (read only where checked).
CONTAINERS = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"moof", b"traf", b"mvex", b"mfra"})

VIDEO_CODECS = {b"avc1": "h264", b"avc3": "h264", b"hvc1": "hevc", b"hev1": "hevc", b"av01": "av1",
                b"vp09": "vp9"}
ACCEPTED = "H.264, HEVC, AV1 and VP9"
# Names for the refusal message of sample entries a video server never sends.
_KNOWN = {b"mp4v": "MPEG-4 Part 2", b"jpeg": "MJPEG", b"mjpa": "MJPEG", b"mjpb": "MJPEG", b"png ": "PNG",
          b"mjp2": "JPEG 2000", b"apch": "ProRes", b"apcn": "ProRes", b"apcs": "ProRes", b"apco": "ProRes",
          b"ap4h": "ProRes", b"ap4x": "ProRes", b"s263": "H.263", b"h263": "H.263", b"rle ": "QuickTime RLE",
          b"raw ": "uncompressed", b"vp08": "VP8", b"avdn": "DNxHD", b"AVdn": "DNxHD", b"AVdh": "DNxHR"}


class Mp4Refused(ValueError):
    """The file is not an mp4 this pack opens, or it declares more than the caller will read; it was refused
    before FFmpeg saw it."""


def sample_bound(frames: int) -> int:
    """The most samples a track of a video of ``frames`` frames may declare (audio beside it included)."""
    return SAMPLES_PER_FRAME * int(frames) + SAMPLE_MARGIN


@dataclass
class Mp4Summary:
    """What the walk found: the video tracks' codecs (FFmpeg's names), in file order, and the track count."""

    video_codecs: List[str] = field(default_factory=list)
    tracks: int = 0


def _name(kind: bytes) -> str:
    return "'" + kind.decode("latin-1").encode("unicode_escape").decode("ascii") + "'"


def _u32(b: bytes, at: int) -> int:
    return struct.unpack_from(">I", b, at)[0]


def _reader(source) -> tuple[Callable[[int, int], bytes], int]:
    """``(read(offset, n), size)`` over bytes or an open binary file (read at positions, never whole)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source)
        return (lambda at, n: bytes(view[at:at + n])), len(view)
    def read(at: int, n: int) -> bytes:  # seek + read: os.pread does not exist on Windows
        source.seek(at)
        return source.read(n)

    return read, os.fstat(source.fileno()).st_size


class _Track:
    def __init__(self, number: int):
        self.number, self.handler, self.entry = number, None, None


def check_mp4(source, *, max_frames: int) -> Mp4Summary:
    """Walk ``source`` (bytes or an open binary file) and refuse it (:class:`Mp4Refused`) unless it is an mp4
    whose every count fits a video of at most ``max_frames`` frames (:func:`sample_bound` samples a track)."""
    read, size = _reader(source)
    max_samples = sample_bound(max_frames)
    summary, tracks = Mp4Summary(), []
    fragment_samples = 0
    boxes = 0
    moovs = 0
    # (start, end, depth, track) of the box lists still to walk; iterative, so no recursion limit applies.
    pending = [(0, size, 0, None)]
    while pending:
        start, end, depth, track = pending.pop()
        at, children = start, []
        while at < end:
            boxes += 1
            if boxes > MAX_BOXES:
                raise Mp4Refused(f"an mp4 of more than {MAX_BOXES:,} boxes")
            head = read(at, 16)
            if len(head) < 8 or end - at < 8:
                raise Mp4Refused(f"not an mp4 file (its box at byte {at:,} is cut off: {end - at} bytes left of its parent)")
            box_size, kind = _u32(head, 0), head[4:8]
            if depth == 0 and at == 0 and kind != b"ftyp":
                raise Mp4Refused(f"not an mp4 file (its first box is {_name(kind)}, not 'ftyp')")
            header = 8
            if box_size == 1:
                if len(head) < 16:
                    raise Mp4Refused(f"not an mp4 file (its box {_name(kind)} at byte {at:,} is cut off)")
                box_size, header = struct.unpack_from(">Q", head, 8)[0], 16
            elif box_size == 0:
                box_size = end - at  # to the end of the file (or of its parent)
            if box_size < header or box_size > end - at:
                raise Mp4Refused(f"not an mp4 file (its box {_name(kind)} at byte {at:,} declares {box_size:,} "
                                 f"bytes, but {end - at:,} remain in its parent)")
            if depth == 0:
                if kind not in TOP_LEVEL:
                    raise Mp4Refused(f"not an mp4 file (a top-level box {_name(kind)} at byte {at:,}, which an mp4 "
                                     "does not hold: another format may hide in it)")
                moovs += kind == b"moov"
            payload = (at + header, at + box_size)
            if kind == b"trak":
                if len(tracks) == MAX_TRACKS:
                    raise Mp4Refused(f"an mp4 of more than {MAX_TRACKS} tracks ('trak' boxes)")
                tracks.append(_Track(len(tracks) + 1))
                child_track = tracks[-1]
            else:
                child_track = track
            if kind in CONTAINERS:
                if depth + 1 >= MAX_DEPTH:
                    raise Mp4Refused(f"an mp4 whose boxes nest deeper than {MAX_DEPTH} ({_name(kind)})")
                children.append((payload[0], payload[1], depth + 1, child_track))
            else:
                fragment_samples += _check_leaf(kind, read, payload, track, max_samples, max_frames)
            at += box_size
        pending.extend(reversed(children))  # file order: the next list walked is the first child's
    if moovs != 1:
        raise Mp4Refused(f"an mp4 with {moovs} 'moov' boxes (one is expected)")
    limit = max_samples * max(1, len(tracks))
    if fragment_samples > limit:
        raise Mp4Refused(f"a fragmented mp4 whose 'trun' boxes declare {fragment_samples:,} samples in all "
                         f"(at most {limit:,} for {max_frames} frames)")
    for t in tracks:
        if t.handler != b"vide":
            continue
        codec = VIDEO_CODECS.get(t.entry)
        if codec is None:
            what = _KNOWN.get(t.entry, "an unknown codec") if t.entry else "no sample description"
            raise Mp4Refused(f"an mp4 whose video track {t.number} is {what} ({_name(t.entry or b'none')}); "
                             f"only {ACCEPTED} are accepted")
        summary.video_codecs.append(codec)
    summary.tracks = len(tracks)
    if not summary.video_codecs:
        raise Mp4Refused("an mp4 with no video track")
    return summary


# Tables: box -> (bytes before the entries after the full-box header, bytes an entry, what the entries count)
_TABLES: Dict[bytes, tuple] = {b"stts": (4, 8, "entries"), b"ctts": (4, 8, "entries"), b"stss": (4, 4, "entries"),
                               b"stsc": (4, 12, "entries"), b"stco": (4, 4, "chunks"), b"co64": (4, 8, "chunks"),
                               b"stps": (4, 4, "entries")}


def _check_leaf(kind: bytes, read, payload, track, max_samples: int, max_frames: int) -> int:
    """Check one leaf box's counts; returns the samples a ``trun`` declares (0 for every other box)."""
    start, end = payload
    length = end - start
    where = f" of track {track.number}" if track is not None else ""
    bound = f"at most {max_samples:,} for {max_frames} frames"

    def need(n: int) -> bytes:
        if length < n:
            raise Mp4Refused(f"an mp4 whose {_name(kind)} box{where} is {length} bytes, too short for its header")
        return read(start, n)

    def fits(count: int, entry: int, before: int, what: str):
        if count > max_samples:
            raise Mp4Refused(f"an mp4 whose {_name(kind)} box{where} declares {count:,} {what} ({bound})")
        if before + count * entry > length:
            raise Mp4Refused(f"an mp4 whose {_name(kind)} box{where} declares {count:,} {what}, more than its "
                             f"{length:,} bytes hold")

    if kind == b"hdlr" and track is not None and track.handler is None:  # mdia's (a mov's minf has another)
        track.handler = need(12)[8:12]
    elif kind == b"stsd":
        head = need(8)
        count = _u32(head, 4)
        if not 1 <= count <= MAX_SAMPLE_ENTRIES:
            raise Mp4Refused(f"an mp4 whose 'stsd' box{where} declares {count:,} sample descriptions "
                             f"(1 to {MAX_SAMPLE_ENTRIES} are accepted)")
        if track is not None and length >= 16:
            track.entry = read(start + 12, 4)
    elif kind in (b"stsz", b"stz2"):
        head = need(12)
        count = _u32(head, 8)
        if kind == b"stsz":
            entry = 4 if _u32(head, 4) == 0 else 0
            fits(count, entry, 12, "samples")
        else:
            bits = head[7]
            if bits not in (4, 8, 16):
                raise Mp4Refused(f"an mp4 whose 'stz2' box{where} has {bits}-bit sample sizes (4, 8 or 16)")
            fits(count, 0, 12, "samples")
            if 12 + (count * bits + 7) // 8 > length:
                raise Mp4Refused(f"an mp4 whose 'stz2' box{where} declares {count:,} samples, more than its "
                                 f"{length:,} bytes hold")
    elif kind in _TABLES:
        before, entry, what = _TABLES[kind]
        count = _u32(need(8), 4)
        fits(count, entry, 4 + before, what)
        if kind in (b"stts", b"ctts", b"stsc"):
            table = read(start + 8, count * entry)
            if kind == b"stsc":  # samples per chunk (the second field of each entry)
                largest = max(struct.unpack_from(f">{3 * count}I", table)[1::3], default=0)
                if largest > max_samples:
                    raise Mp4Refused(f"an mp4 whose 'stsc' box{where} declares {largest:,} samples in one chunk "
                                     f"({bound})")
            else:
                total = sum(struct.unpack_from(f">{2 * count}I", table)[0::2])
                if total > max_samples:
                    raise Mp4Refused(f"an mp4 whose {_name(kind)} box{where} counts {total:,} samples ({bound})")
    elif kind == b"elst":
        head = need(8)
        count = _u32(head, 4)
        entry = 20 if head[0] == 1 else 12
        if count > MAX_EDITS:
            raise Mp4Refused(f"an mp4 whose 'elst' box{where} declares {count:,} edit-list entries "
                             f"(at most {MAX_EDITS})")
        if 8 + count * entry > length:
            raise Mp4Refused(f"an mp4 whose 'elst' box{where} declares {count:,} edits, more than its "
                             f"{length:,} bytes hold")
    elif kind == b"trun":
        head = need(8)
        flags = _u32(head, 0) & 0xFFFFFF
        count = _u32(head, 4)
        before = 8 + 4 * bool(flags & 0x1) + 4 * bool(flags & 0x4)
        entry = 4 * sum(bool(flags & bit) for bit in (0x100, 0x200, 0x400, 0x800))
        fits(count, entry, before, "samples")
        return count
    elif kind == b"tfra":
        head = need(16)
        sizes = _u32(head, 8)
        entry = (16 if head[0] == 1 else 8) + sum(((sizes >> shift) & 3) + 1 for shift in (4, 2, 0))
        fits(_u32(head, 12), entry, 16, "entries")
    elif kind == b"sidx":  # references follow the times (32- or 64-bit) and a 16-bit count
        before = 12 + (16 if need(4)[0] == 1 else 8) + 4
        fits(struct.unpack_from(">H", need(before), before - 2)[0], 12, before, "references")
    return 0
