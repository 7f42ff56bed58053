"""A local LingBot-Video Videos-API server for tests: http.server on 127.0.0.1 only, two dialects.

It speaks the OpenAI-style Videos API as SGLang Diffusion and vLLM-Omni do (../shared/docs/
remote-engines.md §2), records every request (method, path, headers, parsed multipart or JSON
fields, files), and renders an mp4 encoded from known frames, so the pack's real HTTP client runs end
to end. Failures are scripted per job (:class:`Script`). Never bind another address.

Hostile behaviour, also per job: a redirect (to another server that records what reaches it), an
answer dripped one byte every 0.5 s (status line and headers included; chat_server.send_raw), a raw poll body (a JSON
nesting bomb).

Dialects:
- ``"sglang"``: JSON or multipart; ``queued`` (progress 0) -> ``completed`` (100); a failed job is
  answered 200 with ``error: {"message"}``; DELETE only forgets the record (the job "runs on").
- ``"vllm"``: multipart only; ``queued`` -> ``in_progress`` (progress rising) -> ``completed``; errors are
  ``{"error": {"code", "message"}}``; a failed job is answered with a non-200 status and the job body,
  and its content with 422; DELETE cancels the job.
"""

from __future__ import annotations

import email.parser
import functools
import email.policy
import io
import json
import threading
import time
import uuid
from dataclasses import dataclass
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional

import numpy as np

from support.chat_server import send_raw

HOST = "127.0.0.1"
# H.264 yuv420p at crf 0 is lossless in YUV, so the codec error is the RGB -> YUV 4:2:0 -> RGB round trip
# (8-bit limited range, chroma halved) of the test pattern: measured max abs 8/255 (0.0314), mean 0.0085,
# PSNR 39.6 dB at 96x64. The bound the tests hold the client to:
YUV_MAX_ABS, YUV_MIN_PSNR = 10 / 255, 37.0
STAGES = ("submit", "poll", "content", "delete")


@dataclass
class Script:
    """How the server treats the next job (defaults: a normal render)."""

    polls: int = 2  # status requests answered "running" before the job completes
    submit_status: int = 200  # e.g. 500: POST fails with an error body
    submit_delay: float = 0.0  # seconds before answering POST (slow server)
    fail: Optional[str] = None  # the job fails with this message
    content_type: str = "video/mp4"
    content: Optional[bytes] = None  # sent instead of the rendered mp4
    truncate: Optional[int] = None  # send only this many bytes (the announced length stays the full one)
    announce_length: bool = True
    lossless: bool = False  # libx264rgb crf 0: the decoded frames equal the pattern exactly
    never_finishes: bool = False
    drip: Optional[str] = None  # a stage of STAGES whose answer is dripped
    redirect: Optional[tuple] = None  # (stage, status, location): that stage answers a redirect
    poll_raw: Optional[bytes] = None  # the body of every status answer (200, application/json)
    error_message: Optional[str] = None  # the submit error's text; "{auth}" becomes the Authorization received
    length_header: Optional[str] = None  # the content answer's Content-Length value, as sent (e.g. "²")
    job_id: object = "<fresh>"  # the job's "id" as sent (any JSON value, None too); "<fresh>": "video_<hex>"
    final_fields: Optional[dict] = None  # merged into the job object when it completes
    content_headers: tuple = ()  # extra (name, value) headers of the content answer, as sent


def pattern(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Known frames (T, H, W, 3) uint8: smooth colour ramps that move with time and the seed."""
    t = np.arange(num_frames, dtype=np.float64)[:, None, None]
    y = np.arange(height, dtype=np.float64)[None, :, None] / max(height - 1, 1)
    x = np.arange(width, dtype=np.float64)[None, None, :] / max(width - 1, 1)
    phase = (seed % 97) / 97.0
    r = 0.5 + 0.4 * np.sin(2 * np.pi * (x + 0.05 * t + phase))
    g = 0.5 + 0.4 * np.cos(2 * np.pi * (y - 0.03 * t))
    b = 0.2 + 0.6 * x * y + 0.0 * t
    rgb = np.stack(np.broadcast_arrays(r, g, b), axis=-1)
    return np.round(np.clip(rgb, 0, 1) * 255).astype(np.uint8)


def encode_mp4(frames: np.ndarray, fps: float = 24.0, lossless: bool = False) -> bytes:
    """H.264 in mp4: yuv420p at crf 0 (what servers send, up to the chroma subsampling), or RGB lossless."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264rgb" if lossless else "libx264", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "rgb24" if lossless else "yuv420p"
        stream.options = {"crf": "0", "preset": "ultrafast"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@functools.lru_cache(maxsize=4)
def small_but_huge_mp4(width: int, height: int, frames: int, fps: int = 24) -> bytes:
    """Black frames at the lowest H.264 quality: a tiny file that decodes to a huge video (1920x1080 x 40
    frames is 8.8 kB, 12,000 frames of 96x64 are 171 kB). Cached: the second takes seconds to write."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "51", "preset": "ultrafast", "tune": "zerolatency"}
        black = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), dtype=np.uint8), format="rgb24")
        for _ in range(frames):
            for packet in stream.encode(black):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def parse_multipart(content_type: str, raw: bytes):
    """(fields {name: str}, files {name: (filename, content type, bytes)}) of a multipart/form-data body."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode("latin-1") + raw)
    fields, files = {}, {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        filename = part.get_param("filename", header="content-disposition")
        payload = part.get_payload(decode=True)
        if filename is not None:
            files[name] = (filename, part.get_content_type(), payload)
        else:
            fields[name] = payload.decode(part.get_content_charset() or "utf-8")
    return fields, files


class VideosServer:
    def __init__(self, dialect: str = "sglang", model: str = "robbyant/lingbot-video-moe-30b-a3b"):
        assert dialect in ("sglang", "vllm")
        self.dialect = dialect
        self.model = model
        self.requests: List[dict] = []
        self.scripts: List[Script] = []  # consumed one per job; empty = normal renders
        self.jobs: Dict[str, dict] = {}
        self.forgotten: List[str] = []  # sglang: deleted, still "running"
        self.cancelled: List[str] = []  # vllm: deleted and stopped
        self.sent: Dict[str, bytes] = {}  # job id -> the content bytes answered
        self._lock = threading.Lock()
        self._httpd: Optional[ThreadingHTTPServer] = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self._httpd.server_address[1]}"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "VideosServer":
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _record(self, fields=None, files=None, body=None):
                entry = {"method": self.command, "path": self.path, "headers": dict(self.headers),
                         "fields": fields, "files": files, "json": body}
                with owner._lock:
                    owner.requests.append(entry)

            def _send(self, status: int, data: bytes, content_type: str = "application/json",
                      length=None, script: Optional[Script] = None, stage: str = ""):
                if script is not None and script.redirect is not None and script.redirect[0] == stage:
                    _, status, location = script.redirect
                    data, content_type, length = b"", "text/plain", 0
                    extra = [("Location", location)]
                else:
                    extra = list(script.content_headers) if script is not None and stage == "content" else []
                head = [f"HTTP/1.1 {status} {self.responses.get(status, ('',))[0]}\r\n",
                        f"Content-Type: {content_type}\r\n", "Connection: close\r\n"]
                if length is not None:
                    head.append(f"Content-Length: {length}\r\n")
                head += [f"{k}: {v}\r\n" for k, v in extra]
                raw = "".join(head).encode("latin-1") + b"\r\n" + data
                self.close_connection = True
                send_raw(self.wfile, raw, drip=script is not None and script.drip == stage)

            def _json(self, status: int, value, script: Optional[Script] = None, stage: str = ""):
                data = json.dumps(value).encode("utf-8")
                self._send(status, data, length=len(data), script=script, stage=stage)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                ctype = self.headers.get("Content-Type") or ""
                fields = files = body = None
                if ctype.startswith("multipart/form-data"):
                    fields, files = parse_multipart(ctype, raw)
                elif ctype.startswith("application/json"):
                    body = json.loads(raw or b"null")
                self._record(fields, files, body)
                status, value, script = owner._create(self.path, fields if fields is not None else body, files or {},
                                                      multipart=fields is not None,
                                                      auth=self.headers.get("Authorization") or "")
                self._json(status, value, script, "submit")

            def do_GET(self):
                self._record()
                owner._get(self)

            def do_DELETE(self):
                self._record()
                status, value, script = owner._delete(self.path)
                self._json(status, value, script, "delete")

        self._httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.scripts.clear()
            self.jobs.clear()
            self.forgotten.clear()
            self.cancelled.clear()
            self.sent.clear()

    # -- the API -----------------------------------------------------------------------------

    def _error(self, status: int, message: str):
        if self.dialect == "vllm":
            return status, {"error": {"code": status, "message": message}}
        return status, {"error": {"message": message}}

    def _create(self, path: str, fields, files, multipart: bool, auth: str = ""):
        if path != "/v1/videos":
            return (*self._error(404, f"not found: {path}"), None)
        if self.dialect == "vllm" and not multipart:
            return (*self._error(400, "Request must be multipart/form-data"), None)
        if not isinstance(fields, dict) or not fields.get("prompt"):
            return (*self._error(400, "prompt is required"), None)
        if self.dialect == "vllm" and fields.get("model") != self.model:
            return (*self._error(400, f"Model mismatch: {fields.get('model')!r} is not {self.model!r}"), None)
        with self._lock:
            script = self.scripts.pop(0) if self.scripts else Script()
        if script.submit_delay:
            time.sleep(script.submit_delay)
        if script.submit_status != 200:
            message = (script.error_message or "Internal Server Error: the pipeline crashed (CUDA error)").replace(
                "{auth}", auth)
            return (*self._error(script.submit_status, message), script)
        job_id = "video_" + uuid.uuid4().hex[:12] if script.job_id == "<fresh>" else script.job_id
        job = {"id": job_id, "object": "video", "model": fields.get("model"), "status": "queued", "progress": 0,
               "created_at": int(time.time()), "size": fields.get("size"), "seconds": None}
        with self._lock:
            self.jobs[str(job_id)] = {"job": job, "script": script, "fields": dict(fields), "files": files, "polls": 0}
        return 200, job, script

    def _advance(self, entry: dict) -> dict:
        job, script = entry["job"], entry["script"]
        if job["status"] in ("completed", "failed"):
            return job
        entry["polls"] += 1
        if script.never_finishes or entry["polls"] <= script.polls:
            if self.dialect == "vllm":
                job["status"] = "in_progress"
                job["progress"] = min(99, int(100 * entry["polls"] / (script.polls + 1)))
            return job
        if script.fail is not None:
            job["status"] = "failed"
            job["error"] = ({"code": "generation_failed", "message": script.fail} if self.dialect == "vllm"
                            else {"message": script.fail})
            return job
        job.update(status="completed", progress=100, completed_at=int(time.time()), inference_time_s=12.5,
                   peak_memory_mb=20480.0)
        job.update(script.final_fields or {})
        return job

    def frames_of(self, job_id: str) -> np.ndarray:
        f = self.jobs[job_id]["fields"]
        return pattern(int(f["num_frames"]), int(f["height"]), int(f["width"]), int(f["seed"]))

    def _get(self, handler) -> None:
        parts = handler.path.split("/")
        if len(parts) < 4 or parts[1:3] != ["v1", "videos"]:
            return handler._json(*self._error(404, "not found"))
        with self._lock:
            entry = self.jobs.get(parts[3])
        if entry is None:
            return handler._json(*self._error(404, f"Video {parts[3]} not found"))
        script = entry["script"]
        if len(parts) == 4:
            with self._lock:
                job = dict(self._advance(entry))
            if script.poll_raw is not None:
                return handler._send(200, script.poll_raw, length=len(script.poll_raw), script=script, stage="poll")
            if job["status"] == "failed" and self.dialect == "vllm":
                return handler._json(500, job, script, "poll")
            return handler._json(200, job, script, "poll")
        if parts[4:] != ["content"]:
            return handler._json(*self._error(404, "not found"))
        job = entry["job"]
        if job["status"] == "failed":
            return handler._json(*self._error(422 if self.dialect == "vllm" else 400, f"Video {job['id']} failed"))
        if job["status"] != "completed":
            return handler._json(*self._error(404, "Generation is still in-progress"))
        data = script.content
        if data is None:
            data = encode_mp4(self.frames_of(job["id"]), float(entry["fields"]["fps"]), script.lossless)
        length = len(data)
        with self._lock:
            self.sent[job["id"]] = data
        if script.truncate is not None:
            data = data[: script.truncate]
        if script.length_header is not None:
            length = script.length_header
        handler._send(200, data, script.content_type, length if script.announce_length else None, script, "content")

    def _delete(self, path: str):
        parts = path.split("/")
        job_id = parts[3] if len(parts) == 4 else None
        with self._lock:
            entry = self.jobs.pop(job_id, None)
            if entry is None:
                return (*self._error(404, f"Video {job_id} not found"), None)
            (self.cancelled if self.dialect == "vllm" else self.forgotten).append(job_id)
        if self.dialect == "vllm":
            return 200, {"id": job_id, "deleted": True, "object": "video.deleted"}, entry["script"]
        return 200, {"id": job_id, "deleted": True}, entry["script"]

    # -- test helpers --------------------------------------------------------------------------

    def posts(self) -> List[dict]:
        with self._lock:
            return [r for r in self.requests if r["method"] == "POST"]

    def calls(self) -> List[tuple]:
        with self._lock:
            return [(r["method"], r["path"]) for r in self.requests]
