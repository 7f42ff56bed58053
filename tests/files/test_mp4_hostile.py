"""Hostile mp4 files (issue 51): index bombs refused from their boxes before FFmpeg opens them, a file
that probes as another format handed on as a clean mp4 of the checked stream only, the server's metadata
stripped, and only the codecs a video server sends decoded. Every file is forged here (support.mp4_forge).
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

from lingbot_core.files.video_io import NotAnMp4, VideoMismatch, clean_mp4, read_mp4, read_video_file
from support import mp4_forge as forge
from bench.hostile_mp4 import measure

ASK = dict(frames=5, height=64, width=96)
MIB = 1 << 20

BOMBS = {  # forged file, what the message must name
    "sample table of 85 M samples": (lambda: forge.index_bomb(85_000_000), ["'stts'", "85,000,000 samples"]),
    "edit list of 100 k entries": (lambda: forge.edit_bomb(100_000), ["'elst'", "100,000 edit-list entries"]),
    "trun of 85 M samples": (lambda: forge.trun_bomb(85_000_000), ["'trun'", "85,000,000 samples"]),
}


def test_index_bombs_are_refused_from_their_boxes_before_ffmpeg_reads_them(tmp_path, record_property):
    """On main these cost +2,980 MiB (85 M samples, 837 bytes), +2,052 MiB (100 k edits, 1.2 MB), +2,981 MiB (trun) of RSS
    inside av.open (bench/hostile_mp4.py); here each is refused naming its box and count, RSS flat."""
    files = {}
    for name, (make, _) in BOMBS.items():
        path = tmp_path / (name.replace(" ", "_") + ".mp4")
        path.write_bytes(make())
        files[name] = str(path)
    seen = measure(files.values())  # one child process: FFmpeg's index is built in C, out of tracemalloc's reach
    for name, (_, parts) in BOMBS.items():
        got = seen[files[name]]
        record_property(f"{name}: peak_rss_rise_mib", round(got["rise"] / MIB, 1))
        assert got["outcome"] and got["outcome"].startswith("NotAnMp4"), (name, got)
        for part in parts:
            assert part in got["outcome"], (name, got)
        assert got["rise"] < 16 * MIB, (name, got)


@pytest.fixture(scope="module")
def mpegts():
    """12 frames of 320x176 H.264 in MPEG-TS: the video a polyglot hides."""
    return forge.encode(frames=12, width=320, height=176, fmt="mpegts", options={"preset": "ultrafast"})


def _probed(data: bytes):
    """What FFmpeg's probe (as ComfyUI's VIDEO reader does) finds: (format, decoded (T, H, W, 3) shape)."""
    import av

    with av.open(io.BytesIO(data)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        return c.format.name, np.stack(frames).shape, len(c.streams)


def test_an_unknown_first_box_is_refused(mpegts):
    data = forge.polyglot(forge.encode(frames=5), mpegts, kind=b"zzzz")
    assert _probed(data)[:2] == ("mpegts", (12, 176, 320, 3))  # what main handed on as "the video"
    with pytest.raises(NotAnMp4, match=r"not an mp4 file \(its first box is 'zzzz', not 'ftyp'\)"):
        read_mp4(data, **ASK)


def test_a_disguised_mp4_is_read_as_mp4_and_handed_on_as_its_checked_stream_alone(mpegts):
    """ftyp + a 'skip' box holding MPEG-TS: every box is an mp4 one, but FFmpeg's probe reads MPEG-TS. The
    forced mp4 demuxer reads the 5 frames asked for, and the copy handed on probes as that mp4."""
    plain = forge.encode(frames=5)
    data = forge.disguised(plain, mpegts)
    assert _probed(data)[:2] == ("mpegts", (12, 176, 320, 3))
    frames = read_mp4(data, **ASK)  # fails if the demuxer is probed: the whitelist refuses mpegts
    assert np.array_equal(frames, read_mp4(plain, **ASK))
    copy = clean_mp4(data, **ASK)
    assert _probed(copy) == ("mov,mp4,m4a,3gp,3g2,mj2", (5, 64, 96, 3), 1)
    assert np.array_equal(read_mp4(copy, **ASK), frames)
    assert len(copy) < len(plain) + 1024  # none of the hidden bytes


def test_the_servers_metadata_and_other_streams_do_not_reach_the_copy():
    import av

    key = "sk-hostile-0123456789"
    meta = {"comment": f"Bearer {key}", "workflow": '{"nodes": ["LingbotRemoteGenerate"]}', "title": "leak"}
    data = forge.encode(frames=5, metadata=meta)
    out = io.BytesIO()
    with av.open(io.BytesIO(data)) as src, av.open(out, mode="w", format="mp4",
                                                     options={"movflags": "use_metadata_tags"}) as dst:  # + AAC
        dst.metadata.update(meta)
        video = dst.add_stream_from_template(src.streams.video[0])
        audio = dst.add_stream("aac", rate=48000)
        for packet in src.demux(video=0):
            if packet.dts is not None:
                packet.stream = video
                dst.mux(packet)
        samples = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        samples.sample_rate = 48000
        for packet in [*audio.encode(samples), *audio.encode()]:
            dst.mux(packet)
    data = out.getvalue()
    assert key.encode() in data and b"workflow" in data
    copy = clean_mp4(data, **ASK)
    for secret in (key.encode(), b"Bearer", b"workflow", b"LingbotRemoteGenerate", b"leak"):
        assert secret not in copy
    with av.open(io.BytesIO(copy)) as c:
        assert [s.type for s in c.streams] == ["video"]
        assert not {"comment", "workflow", "title"} & set(c.metadata)
    assert np.array_equal(read_mp4(copy, **ASK), read_mp4(data, **ASK))


def _encoded(codec, fmt, pix_fmt):
    return forge.encode(frames=1, width=96, height=64, codec=codec, pix_fmt=pix_fmt, fmt=fmt)


@pytest.mark.parametrize("codec, fmt, pix_fmt, named", [
    ("mpeg4", "mp4", "yuv420p", "MPEG-4 Part 2 ('mp4v')"),
    ("mjpeg", "mov", "yuvj420p", "MJPEG ('jpeg')"),
    ("png", "mov", "rgb24", "PNG ('png ')"),
    ("jpeg2000", "mov", "rgb24", "JPEG 2000 ('mjp2')"),
    ("prores_ks", "mov", "yuv422p10le", "ProRes ('apch')"),
])
def test_only_the_codecs_a_video_server_sends_are_decoded(codec, fmt, pix_fmt, named):
    with pytest.raises(NotAnMp4) as info:
        read_mp4(_encoded(codec, fmt, pix_fmt), **ASK)
    assert f"video track 1 is {named}" in str(info.value)
    assert "only H.264, HEVC, AV1 and VP9 are accepted" in str(info.value)


def test_64_bit_sizes_and_fragments_within_bounds_are_read():
    plain = forge.encode(frames=5)
    want = read_mp4(plain, **ASK)
    assert np.array_equal(read_mp4(forge.largesize_mdat(plain), **ASK), want)
    assert np.array_equal(read_mp4(forge.fragmented(plain), **ASK), want)


@pytest.mark.parametrize("size, named", [((98, 64), "98x64 (its header)"), ((96, 66), "96x66 (its header)")])
def test_each_side_of_the_header_is_checked(size, named):
    with pytest.raises(VideoMismatch, match=re.escape(f"a video of {named} but 5 frames of 96x64 were asked for")):
        read_mp4(forge.encode(frames=5, width=size[0], height=size[1]), **ASK)


def test_a_box_larger_than_its_parent_is_refused():
    data = bytearray(forge.encode(frames=5))
    data[32 + 8:32 + 12] = (10 ** 9).to_bytes(4, "big")  # the box after ftyp (32 bytes) and free (8)
    with pytest.raises(NotAnMp4, match=r"its box 'mdat' at byte 40 declares 1,000,000,000 bytes"):
        read_mp4(bytes(data), **ASK)


# -- the command line's --video (a local file) --------------------------------------------------

def test_a_png_renamed_mp4_is_refused(tmp_path):
    from PIL import Image

    path = tmp_path / "picture.mp4"
    Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8)).save(path, format="PNG")
    with pytest.raises(ValueError, match=r"picture.mp4 is not an mp4 file \(its first box is "):
        read_video_file(path, max_frames=1001, max_side=4096)


def test_a_tiny_mpeg4_part2_file_is_refused_by_its_codec(tmp_path):
    path = tmp_path / "old.mp4"
    path.write_bytes(_encoded("mpeg4", "mp4", "yuv420p"))
    with pytest.raises(ValueError, match=r"video track 1 is MPEG-4 Part 2 \('mp4v'\)"):
        read_video_file(path, max_frames=1001, max_side=4096)


@pytest.mark.parametrize("size", [(96, 80), (80, 96)])
def test_a_local_video_larger_than_max_side_either_way_is_refused(tmp_path, size):
    path = tmp_path / "big.mp4"
    path.write_bytes(forge.encode(frames=2, width=size[0], height=size[1]))
    with pytest.raises(ValueError, match=rf"big.mp4 is {size[0]}x{size[1]}; at most 88 pixels a side"):
        read_video_file(path, max_frames=10, max_side=88)


def test_a_local_video_longer_than_max_frames_is_refused(tmp_path):
    path = tmp_path / "long.mp4"
    path.write_bytes(forge.encode(frames=12))
    with pytest.raises(ValueError, match=r"long.mp4 has more than 6 frames"):
        read_video_file(path, max_frames=6, max_side=4096)
    frames, fps = read_video_file(path, max_frames=12, max_side=4096)
    assert frames.shape == (12, 64, 96, 3) and fps == 24.0
