"""The video-to-video and 1080p-upscale example workflows in the real headless ComfyUI (issue 34): a video
file through ComfyUI's own Load Video / Get Video Components, into GenerateVideo (denoise) and Refine
(context windows), out as an mp4, on the tiny packages."""

from __future__ import annotations

import numpy as np
import pytest

from support.comfy_graphs import DENSE, H, MOE, W, decode_video, example_as_api, node_files, nodes_of, patch_nodes

pytestmark = pytest.mark.comfy

VIDEO_NAME = "lingbot_example_input.mp4"
SOURCE_FRAMES = 22  # not 4n+1 (sampled as 25: 7 latent frames, 3 windows of 9 frames sharing 4), every frame kept
SOURCE_FPS = 30  # faster than the refiner's 24: Refine resamples, keeping the duration


def write_mp4(path, frames: int, height: int = 48, width: int = 80, fps: int = 24) -> None:
    import av

    rng = np.random.default_rng(3)
    base = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 2 * i, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.fixture(scope="module")
def server(comfy_server, tmp_path_factory):
    path = tmp_path_factory.mktemp("video") / VIDEO_NAME
    write_mp4(path, SOURCE_FRAMES, fps=SOURCE_FPS)
    comfy_server.add_input(path)
    return comfy_server


@pytest.fixture(scope="module")
def object_info(server):
    return server.object_info()


def _saved(server, entry, api):
    (sid,) = nodes_of(api, "SaveVideo")
    (path,) = node_files(server, entry, sid)
    return decode_video(path)


def test_upscale_example_refines_a_video_file_in_windows(server, object_info):
    wf, api = example_as_api("lingbot_upscale_any_video_1080p", object_info)
    (rid,) = nodes_of(api, "Refine")
    r = api[rid]["inputs"]
    assert (r["width"], r["height"], r["context_frames"], r["context_overlap"]) == (1920, 1088, 121, 24)
    (vid,) = nodes_of(api, "LoadVideo")
    (gid,) = nodes_of(api, "GetVideoComponents")
    assert api[vid]["inputs"]["file"] == VIDEO_NAME and r["frames"] == [gid, 0]
    (cid,) = nodes_of(api, "CreateVideo")
    assert r["fps"] == [gid, 2] and api[cid]["inputs"]["fps"] == [rid, 1]  # the source's rate in, the refined rate out
    (lid,) = nodes_of(api, "LoadLingbotPipeline")
    assert api[lid]["inputs"]["transformer"] == "refiner" and api[lid]["inputs"]["offload"] == "block"

    patch_nodes(api, "LoadLingbotPipeline", model=MOE)
    patch_nodes(api, "Refine", width=128, height=64, steps=3, context_frames=9, context_overlap=4)
    patch_nodes(api, "SaveVideo", filename_prefix="test_upscale_any_video")
    frames, rate = _saved(server, server.run(api, timeout=900), api)
    # int(22 / 30 * 24) = 17 frames at 24 fps: the source's duration (0.73 s against 0.71 s, the rounding)
    assert frames.shape == (17, 64, 128, 3) and rate == 24 and frames.std() > 1.0


def test_v2v_restyle_example_runs_on_a_video_file(server, object_info):
    wf, api = example_as_api("lingbot_v2v_restyle", object_info)
    (gid,) = nodes_of(api, "GenerateVideo")
    g = api[gid]["inputs"]
    (cid,) = nodes_of(api, "GetVideoComponents")
    assert g["video"] == [cid, 0] and "video_latent" not in g
    assert (g["denoise"], g["context_frames"], g["context_overlap"], g["steps"]) == (0.7, 121, 24, 40)

    patch_nodes(api, "LoadLingbotPipeline", model=DENSE)
    patch_nodes(api, "GenerateVideo", width=W, height=H, steps=4, context_frames=9, context_overlap=4)
    patch_nodes(api, "SaveVideo", filename_prefix="test_v2v_restyle")
    frames, rate = _saved(server, server.run(api, timeout=900), api)
    assert frames.shape == (SOURCE_FRAMES, H, W, 3) and rate == SOURCE_FPS and frames.std() > 1.0
