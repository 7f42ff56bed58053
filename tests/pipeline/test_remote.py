"""The remote-render client against a real local Videos-API server in both dialects (tests/support/remote_server.py).

Expected fields are written out from remote-engines.md §2; expected frames are the server's known
pattern (independent of the client), compared within the codec bound stated in remote_server.py.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import time

import numpy as np
import pytest
from PIL import Image

from lingbot_core.remote import RemoteServer, RemoteServerError, RemoteTimeoutError
from lingbot_core.prompts.text_conditioning import DEFAULT_NEGATIVE_IMAGE, DEFAULT_NEGATIVE_VIDEO
from support.remote_server import YUV_MAX_ABS, YUV_MIN_PSNR, Script, VideosServer, pattern

MODEL = "robbyant/lingbot-video-moe-30b-a3b"
JOB = dict(width=96, height=64, num_frames=9, steps=4, guidance_scale=3.5, shift=5.0, seed=1234, fps=16)
CAPTION = {"caption": {"comprehensive_description": {"scene_content_description": "A red kite rises."}},
           "duration": 1}


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def server(request):
    srv = VideosServer(request.param, MODEL).start()
    yield srv
    srv.stop()


@pytest.fixture
def videos(server):
    server.clear()
    return server


def client(server, **kw) -> RemoteServer:
    kw.setdefault("timeout", 20)
    kw.setdefault("poll_seconds", 0.05)
    return RemoteServer(server.url, MODEL, **kw)


def assert_frames_match(frames, expected_uint8):
    ref = expected_uint8.astype(np.float32) / 255
    assert frames.dtype == np.float32 and frames.shape == ref.shape
    err = np.abs(frames - ref)
    psnr = 10 * np.log10(1 / float(np.mean((frames - ref) ** 2)))
    assert err.max() <= YUV_MAX_ABS and psnr >= YUV_MIN_PSNR, (err.max(), psnr)


def test_every_parameter_is_sent_as_multipart(videos):
    frames = client(videos, api_key="sk-test-123").generate("a red kite", negative_prompt="blurry", **JOB)
    (post,) = videos.posts()
    assert post["headers"]["Content-Type"].startswith("multipart/form-data; boundary=")
    assert post["headers"]["Authorization"] == "Bearer sk-test-123"
    assert post["fields"] == {
        "model": MODEL, "prompt": "a red kite", "negative_prompt": "blurry", "width": "96", "height": "64",
        "size": "96x64", "num_frames": "9", "fps": "16", "seed": "1234", "num_inference_steps": "4",
        "guidance_scale": "3.5", "flow_shift": "5.0",
    }
    assert post["files"] == {}
    assert_frames_match(frames, pattern(9, 64, 96, 1234))
    calls = videos.calls()
    assert calls[0] == ("POST", "/v1/videos") and calls[-1][1].endswith("/content")
    job_id = calls[-1][1].split("/")[3]
    assert calls[1:-1] == [("GET", f"/v1/videos/{job_id}")] * 3  # 2 running polls, then completed


def test_caption_and_default_negative_are_sent_as_the_local_pipeline_encodes_them(videos):
    remote = client(videos)
    remote.generate(json.dumps(CAPTION, indent=2), **JOB)
    remote.generate("a lighthouse", **{**JOB, "num_frames": 1})
    video, image = (p["fields"] for p in videos.posts())
    # The compact caption without its runtime keys, and the mode's default negative, both explicit.
    assert video["prompt"] == '{"comprehensive_description":{"scene_content_description":"A red kite rises."}}'
    assert video["negative_prompt"] == DEFAULT_NEGATIVE_VIDEO
    assert image["negative_prompt"] == DEFAULT_NEGATIVE_IMAGE and image["num_frames"] == "1"


def test_caption_duration_sets_num_frames_when_asked(videos):
    out = client(videos).run(json.dumps(CAPTION), use_caption_duration=True, **{**JOB, "num_frames": 121})
    assert videos.posts()[0]["fields"]["num_frames"] == "17"  # 1 s at 16 fps -> 17 (4n+1)
    assert out.frames.shape[0] == 17


def test_first_frame_is_sent_as_input_reference_cropped_to_the_video(videos):
    rng = np.random.default_rng(0)
    exact = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
    client(videos).generate("a kite", image=exact.astype(np.float32) / 255, **JOB)
    wide = np.zeros((64, 192, 3), dtype=np.uint8)
    wide[:, 48:144] = exact  # the centre crop of a 2:1 image at the video's height is ``exact``
    client(videos).generate("a kite", image=wide.astype(np.float32) / 255, **JOB)
    for post in videos.posts():
        name, ctype, data = post["files"]["input_reference"]
        assert ctype == "image/png" and name.endswith(".png")
        sent = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        assert sent.shape == (64, 96, 3)
        assert np.array_equal(sent, exact)


def test_frames_equal_a_lossless_server_mp4_exactly(videos):
    videos.scripts.append(Script(lossless=True))
    out = client(videos).run("a kite", **JOB)
    assert np.array_equal(out.frames, pattern(9, 64, 96, 1234).astype(np.float32) / 255)


def test_progress_and_report(videos):
    seen = []
    out = client(videos).run("a kite", **JOB, callback=lambda p, total: seen.append((p, total)))
    assert all(total == 100 for _, total in seen) and seen[-1][0] == 100
    assert seen == sorted(seen)
    if videos.dialect == "vllm":
        assert [p for p, _ in seen] == [0, 33, 66, 100]  # in_progress with rising progress
    else:
        assert [p for p, _ in seen] == [0, 0, 0, 100]  # SGLang jumps from 0 to 100
    assert "inference_time_s=12.5" in out.report() and "peak_memory_mb=20480.0" in out.report()
    assert out.mp4[4:8] == b"ftyp" and out.job["status"] == "completed"


@pytest.mark.parametrize("bad, message", [
    (dict(num_frames=6), "num_frames=6"), (dict(width=100), "width=100"), (dict(height=8), "height=8"),
    (dict(steps=0), "steps=0"), (dict(seed=-1), "seed=-1"), (dict(guidance_scale=float("nan")), "guidance_scale"),
    (dict(shift=0.0), "shift"), (dict(fps=0), "fps=0"), (dict(prompt="{not json"), "not valid JSON"),
    (dict(prompt="   "), "prompt is empty"), (dict(negative_prompt="[1,"), "negative_prompt"),
])
def test_bad_inputs_are_refused_before_anything_is_sent(videos, bad, message):
    args = {**JOB, "prompt": "a kite", **bad}
    with pytest.raises(ValueError, match=message):
        client(videos).generate(args.pop("prompt"), **args)
    assert videos.requests == []


def test_client_settings_are_checked():
    with pytest.raises(ValueError, match="base_url"):
        RemoteServer("ftp://host", MODEL)
    with pytest.raises(ValueError, match="model is empty"):
        RemoteServer("http://127.0.0.1:1", " ")
    with pytest.raises(ValueError, match="poll_seconds"):
        RemoteServer("http://127.0.0.1:1", MODEL, poll_seconds=0)
    with pytest.raises(ValueError, match="timeout"):
        RemoteServer("http://127.0.0.1:1", MODEL, timeout=float("inf"))
    assert RemoteServer("http://h:30000/v1/", MODEL).base_url == "http://h:30000"
    assert "sk-secret" not in repr(RemoteServer("https://h:1", MODEL, api_key="sk-secret"))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cancelled(Exception):
    pass


def _cancel_after_first_poll():
    calls = []

    def callback(progress, total):  # the first call is the submit's answer, the second the first poll's
        calls.append(progress)
        if len(calls) == 2:
            raise Cancelled("user pressed cancel")
    return callback


# (script, client keywords, expected error type, message parts, whether a DELETE must reach the server: every
# job the client gives up after submitting it is deleted; a failed job, or one never created, is not)
FAILURES = {
    "500": (Script(submit_status=500), {}, RemoteServerError, ["HTTP 500", "the pipeline crashed"], False),
    "failed job": (Script(fail="CUDA out of memory at step 3"), {}, RemoteServerError,
                   ["failed job", "CUDA out of memory at step 3"], False),
    "wrong content type": (Script(content_type="text/html", content=b"<html>proxy login</html>"), {},
                           RemoteServerError, ["text/html", "not video/mp4"], True),
    "truncated, length announced": (Script(truncate=3000), {}, RemoteServerError, ["3,000", "bytes"], True),
    "truncated, short file": (Script(content=b"\x00\x00\x00\x20ftypisom" + b"\x00" * 200), {}, RemoteServerError,
                              ["not an mp4", "refused before decoding"], True),
    "oversized, announced": (Script(), dict(max_video_bytes=4000), RemoteServerError, ["more than the limit", "4,000"], True),
    "oversized, unannounced": (Script(announce_length=False), dict(max_video_bytes=4000), RemoteServerError,
                               ["larger than 4,000 bytes"], True),
    "timeout while rendering": (Script(never_finishes=True), dict(timeout=1.0), RemoteTimeoutError,
                                ["timeout=1 s", "did not finish job"], True),
    "slow submit": (Script(submit_delay=2.5), dict(timeout=1.0), RemoteTimeoutError, ["timeout=1 s"], False),
    "cancel mid-job": (Script(polls=50), dict(callback=_cancel_after_first_poll), Cancelled, ["user pressed cancel"], True),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_failure_is_named_and_the_next_prompt_succeeds(videos, case, caplog):
    script, kw, error, parts, deletes = FAILURES[case]
    kw = dict(kw)
    callback = kw.pop("callback")() if "callback" in kw else None
    videos.scripts.append(script)
    remote = client(videos, **kw)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lingbot_core"):
        with pytest.raises(error) as info:
            remote.generate("a kite", callback=callback, **JOB)
        assert time.monotonic() - start < remote.timeout + 2  # never hangs past the timeout
        end = time.monotonic() + 3  # a Cancel's DELETE finishes on its own thread
        while deletes and "LingBot-Video remote: job" not in caplog.text and time.monotonic() < end:
            time.sleep(0.02)
    text = str(info.value)
    for part in parts:
        assert part in text, text
    posts = videos.posts()
    if isinstance(info.value, RemoteServerError):
        assert videos.url in text  # the URL is named
        if script.submit_status == 200 and not script.submit_delay:
            job_id = videos.calls()[1][1].split("/")[3]
            assert info.value.job_id == job_id and job_id in text
    deleted = [path for method, path in videos.calls() if method == "DELETE"]
    assert bool(deleted) == deletes
    if deletes:
        job_id = deleted[0].split("/")[3]
        if videos.dialect == "vllm":
            assert videos.cancelled == [job_id]
            assert f"job {job_id} cancelled" in caplog.text
        else:
            assert videos.forgotten == [job_id]
            assert "only forgets" in caplog.text
    # The server keeps working, and the next prompt succeeds (on a client with default limits).
    assert len(posts) == 1
    frames = client(videos).generate("a kite", **JOB)
    assert_frames_match(frames, pattern(9, 64, 96, 1234))


def test_refused_connection_is_named():
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(RemoteServerError, match="cannot reach the video server") as info:
        RemoteServer(url, MODEL, timeout=5).generate("a kite", **JOB)
    assert url in str(info.value) and info.value.status is None


def test_failed_job_shapes_per_dialect(videos):
    videos.scripts.append(Script(fail="bad latent"))
    with pytest.raises(RemoteServerError) as info:
        client(videos).generate("a kite", **JOB)
    if videos.dialect == "vllm":  # non-200 with the job body, error {code, message}
        assert info.value.status == 500 and info.value.server_message == "[generation_failed] bad latent"
    else:  # 200 with status failed, error {message}
        assert info.value.status == 200 and info.value.server_message == "bad latent"


def test_model_mismatch_and_json_only_requests(videos):
    if videos.dialect == "vllm":
        with pytest.raises(RemoteServerError, match="Model mismatch") as info:
            RemoteServer(videos.url, "another-model", timeout=5).generate("a kite", **JOB)
        assert info.value.status == 400 and "HTTP 400" in str(info.value)
    # The dialect itself: SGLang also accepts JSON, vLLM-Omni refuses it (the client always sends multipart).
    import urllib.error
    import urllib.request
    req = urllib.request.Request(videos.url + "/v1/videos", data=json.dumps({"prompt": "x", "model": MODEL}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        status = urllib.request.urlopen(req, timeout=5).status
    except urllib.error.HTTPError as e:
        status = e.code
    assert status == (400 if videos.dialect == "vllm" else 200)
