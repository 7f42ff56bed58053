"""A client for the OpenAI-style Videos API of SGLang Diffusion and vLLM-Omni serving LingBot-Video.

One job is: ``POST /v1/videos`` (multipart, every sampling parameter sent explicitly, since both
servers default to other settings than the pack), poll ``GET /v1/videos/{id}`` until ``completed``
or ``failed``, then ``GET /v1/videos/{id}/content`` (an mp4) and decode it with PyAV. Everything
runs under one deadline (``timeout``): a server that is down, stuck or slow raises instead of
hanging the caller. A job the caller abandons (its callback raised, or the deadline passed) is
deleted on the server: vLLM-Omni cancels it, SGLang only forgets it (the render runs on).

HTTP goes through :mod:`http_transport`, as the chat client's: the deadline holds for every byte, no
redirect is followed, and the key goes only to ``base_url``. The mp4's header is checked against the
request before a frame is decoded (:func:`video_io.read_mp4`).
"""

from __future__ import annotations

import io
import logging
import math
import re
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from .net.http_transport import (SLICE, AnswerTooLarge, CannotConnect, DeadlineExceeded, Interrupt, JSONTooDeep,
                                 TransportError, answer_text, check_base_url, check_key, content_length, loads_json,
                                 FIELD_CHARS, open_answer, scrub, scrub_fields)
from .model.latents import check_video_size, preprocess_first_frame
from .memory.budget import trim_heap
from .pipeline import _check_seed, _check_steps, _check_text_inputs, check_ti2v_size
from .sampling.scheduling import shifted_sigmas
from .prompts.text_conditioning import frames_for_prompt, parse_prompt, resolve_negative
from .files.video_io import NotAnMp4, VideoMismatch, read_mp4

logger = logging.getLogger("lingbot_core")

# A 121-frame 1080p H.264 render is tens of MB; anything near this is not a video of ours.
DEFAULT_MAX_VIDEO_BYTES = 1 << 30
MIN_POLL_SECONDS, MAX_POLL_SECONDS = 0.05, 60.0
# Seconds the DELETE of an abandoned job may take, even after the job's deadline. It runs on its own
# thread: a Cancel in ComfyUI returns at once (the DELETE finishes in the background), a timed-out or
# refused job waits for it at most this long to say in its message what happened.
CANCEL_SECONDS = 2.0
MAX_JSON_BYTES = 1 << 22  # a job object or an error is a few kB
VIDEO_BYTES_MARGIN = 1 << 24  # an mp4 is far smaller than its raw frames; a lossless one about as large
DONE, FAILED = "completed", "failed"
RUNNING = ("queued", "in_progress", "processing", "pending", "running")
# A job id goes into URL paths, messages and log lines: a short run of these characters, starting with a
# letter or digit (so never "." or ".."). SGLang sends "video_<hex>", vLLM-Omni "video_gen_<hex>".
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

# ``callback(progress, total)``: ``progress`` of ``total`` (100) after every poll. Raising from it (e.g.
# ComfyUI's interrupt) cancels the job on the server and re-raises. ``interrupt()`` is called every
# few tenths of a second while waiting (in a read, a sleep): raising from it does the same.
ProgressCallback = Callable[[float, int], None]


class RemoteServerError(RuntimeError):
    """The server could not be reached, refused the job, failed it, or sent something unusable.

    ``url``, ``status`` (HTTP, or None), ``job_id`` (or None) and ``server_message`` (the first 300
    characters of what the server said) are also in the message."""

    def __init__(self, message: str, *, url: str, status: Optional[int] = None, job_id: Optional[str] = None,
                 server_message: str = ""):
        super().__init__(message)
        self.url, self.status, self.job_id, self.server_message = url, status, job_id, server_message


class RemoteJobFailed(RemoteServerError):
    """The server reports the job as failed (nothing is left running there)."""


class RemoteTimeoutError(RemoteServerError):
    """The job did not finish within the client's ``timeout`` (it was cancelled on the server)."""


@dataclass
class RemoteVideo:
    """A finished job: the decoded frames, the server's mp4 exactly as sent, and the final job object."""

    frames: np.ndarray  # (T, H, W, 3) float32 in [0, 1]
    mp4: bytes
    job: dict
    url: str
    elapsed_s: float

    def report(self) -> str:
        job = self.job  # scrubbed and capped (RemoteServer._scrubbed_job); each field is cut again as shown

        def field(name, default="not reported", show=str):
            text = show(job.get(name, default))
            return text if len(text) <= FIELD_CHARS else text[:FIELD_CHARS] + "…"

        parts = [f"job {field('id')} on {self.url} (model {field('model', None, repr)}): {field('status')}",
                 f"{self.frames.shape[0]} frames {self.frames.shape[2]}x{self.frames.shape[1]}, {len(self.mp4):,} bytes of mp4",
                 f"inference_time_s={field('inference_time_s')}",
                 f"peak_memory_mb={field('peak_memory_mb')}",
                 f"round trip {self.elapsed_s:.1f} s"]
        return "; ".join(parts)


def _server_message(raw: bytes, secrets=()) -> str:
    """The human part of an error answer: OpenAI/vLLM ``{"error": {"code", "message"}}``, SGLang
    ``{"error": {"message"}}``, a failed job's ``error``, FastAPI ``{"detail": ...}``, else the text;
    scrubbed of ``secrets`` and anything shaped like a key."""
    def _preview(text) -> str:
        return answer_text(text, secrets)

    try:
        body = loads_json(raw)
    except ValueError:
        return _preview(raw)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            code = err.get("code")
            return _preview((f"[{code}] " if code not in (None, "") else "") + str(err["message"]))
        if isinstance(err, str) and err:
            return _preview(err)
        detail = body.get("detail")
        if isinstance(detail, str):
            return _preview(detail)
        if isinstance(detail, list):
            return _preview("; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in detail))
        if isinstance(body.get("message"), str):
            return _preview(body["message"])
    return _preview(raw)


def _job_body(raw: bytes, url: str, job_id: Optional[str]) -> Optional[dict]:
    """A video object, when ``raw`` is one (vLLM-Omni sends the job with a non-200 status for a failed job)."""
    try:
        body = loads_json(raw)
    except JSONTooDeep as e:
        raise RemoteServerError(f"{url} answered {e}; refused.", url=url, job_id=job_id) from None
    except ValueError:
        return None
    if isinstance(body, dict) and isinstance(body.get("status"), str) and ("id" in body or body.get("object") == "video"):
        return body
    return None


def check_job_id(value, url: str, secrets=()) -> str:
    """The server's job ``id`` if it is a string of at most 128 safe characters; RemoteServerError naming the
    field otherwise (its value shown only as a short, scrubbed, escaped prefix)."""
    if isinstance(value, str) and _JOB_ID.fullmatch(value):
        return value
    if isinstance(value, str):
        shown = f"{len(value):,} characters starting {ascii(scrub(value[:40], secrets))}"
    else:
        shown = f"a JSON {type(value).__name__ if value is not None else 'null'}"
    raise RemoteServerError(f"{url} answered a job whose field 'id' is {shown}; a job id is 1 to 128 letters, digits "
                            "and . _ : - (starting with a letter or digit). Refused: is base_url a LingBot-Video "
                            "server?", url=url, status=200)


def encode_multipart(fields: List[Tuple[str, str]], files: List[Tuple[str, str, str, bytes]]) -> Tuple[bytes, str]:
    """``multipart/form-data`` (RFC 7578) for text ``fields`` and ``files`` (name, filename, type, data);
    returns the body and its Content-Type."""
    boundary = "lingbot-" + uuid.uuid4().hex
    out = io.BytesIO()
    for name, value in fields:
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n'
                  'Content-Type: text/plain; charset=utf-8\r\n\r\n'.encode("utf-8"))
        out.write(value.encode("utf-8") + b"\r\n")
    for name, filename, content_type, data in files:
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                  f"Content-Type: {content_type}\r\n\r\n".encode("utf-8"))
        out.write(data + b"\r\n")
    out.write(f"--{boundary}--\r\n".encode("utf-8"))
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def _png(pixels) -> bytes:
    """(1, 3, 1, H, W) float in [0, 1] (already uint8 values) -> PNG bytes."""
    from PIL import Image

    arr = (pixels[0, :, 0].permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _number(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class RemoteServer:
    """Where a LingBot-Video Videos-API server is, and how long to wait for it.

    ``base_url`` is the server's root (``http://host:30000`` for SGLang, ``http://host:8091`` for
    vLLM-Omni; a trailing ``/v1`` is accepted). ``model`` is the served name (vLLM-Omni refuses
    another). ``api_key`` is the key itself (hosts read it from the user's server list; it is never
    part of ``repr`` or of a message) and is sent only to ``base_url``: over plain http only to this
    machine, unless ``allow_http``. ``timeout`` bounds a whole job, from submit to the last byte of
    the mp4; ``poll_seconds`` is the interval between status requests.
    """

    def __init__(self, base_url: str, model: str, api_key: Optional[str] = None, timeout: float = 600,
                 poll_seconds: float = 2, *, max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES, allow_http: bool = False):
        url = check_base_url(base_url, what="base_url", has_key=bool(api_key), allow_http=allow_http,
                             example="; use the server's root, e.g. http://127.0.0.1:30000 (SGLang) or "
                                     "http://127.0.0.1:8091 (vLLM-Omni)").rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        if not isinstance(model, str) or not model.strip():
            raise ValueError("model is empty; use the name the server serves, e.g. robbyant/lingbot-video-moe-30b-a3b "
                             "(vLLM-Omni answers 'Model mismatch' to any other).")
        timeout, poll_seconds = float(timeout), float(poll_seconds)
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout={timeout} is not allowed: use a positive number of seconds.")
        if not math.isfinite(poll_seconds) or not MIN_POLL_SECONDS <= poll_seconds <= MAX_POLL_SECONDS:
            raise ValueError(f"poll_seconds={poll_seconds} is not allowed: use {MIN_POLL_SECONDS} to {MAX_POLL_SECONDS:g} s.")
        self.base_url = url
        self.model = model.strip()
        self._api_key = check_key(api_key, where="api_key") if api_key else None
        self._secrets = (self._api_key,) if self._api_key else ()
        self.timeout = timeout
        self.poll_seconds = poll_seconds
        self.max_video_bytes = int(max_video_bytes)

    def __repr__(self) -> str:
        key = ", api_key=<set>" if self._api_key else ""
        return f"RemoteServer({self.base_url!r}, model={self.model!r}{key}, timeout={self.timeout:g})"

    # -- one job -----------------------------------------------------------------------------

    def generate(self, prompt: str, *, negative_prompt: Optional[str] = None, image=None, width: int, height: int,
                 num_frames: int, steps: int, guidance_scale: float, shift: float, seed: int, fps: int,
                 callback: Optional[ProgressCallback] = None, interrupt: Interrupt = None) -> np.ndarray:
        """Render on the server; returns frames (T, H, W, 3) float32 in [0, 1] (see :meth:`run`)."""
        return self.run(prompt, negative_prompt=negative_prompt, image=image, width=width, height=height,
                        num_frames=num_frames, steps=steps, guidance_scale=guidance_scale, shift=shift, seed=seed,
                        fps=fps, callback=callback, interrupt=interrupt).frames

    def run(self, prompt: str, *, negative_prompt: Optional[str] = None, image=None, width: int, height: int,
            num_frames: int, steps: int, guidance_scale: float, shift: float, seed: int, fps: int,
            callback: Optional[ProgressCallback] = None, use_caption_duration: bool = False,
            interrupt: Interrupt = None) -> RemoteVideo:
        """Submit, wait and download; returns the frames, the mp4 bytes and the final job.

        The inputs are checked with the local pipeline's rules before anything is sent. ``negative_prompt``
        None sends the model's default negative (the servers' defaults may differ). ``image`` (the TI2V
        first frame, any size) is scaled to cover and centre-cropped to ``width x height`` exactly as for
        local generation, and sent as the ``input_reference`` PNG. With ``use_caption_duration`` a JSON
        caption's ``duration`` sets ``num_frames`` (the local rule). ``interrupt`` (see ProgressCallback)
        is how a host's Cancel stops a read or a wait within a fraction of a second.
        """
        fields, files = self.request_fields(prompt, negative_prompt=negative_prompt, image=image, width=width,
                                            height=height, num_frames=num_frames, steps=steps,
                                            guidance_scale=guidance_scale, shift=shift, seed=seed, fps=fps,
                                            use_caption_duration=use_caption_duration)
        frames_asked = int(dict(fields)["num_frames"])
        start = time.monotonic()
        deadline = start + self.timeout
        body, content_type = encode_multipart(fields, files)
        try:
            job = self._submit(body, content_type, deadline, interrupt)
        except RemoteServerError as e:
            raise self._scrubbed(e)
        job_id = job["id"]  # checked by _submit (check_job_id)
        seen = {"in_progress": job.get("status") == "in_progress"}
        try:
            job = self._wait(job, deadline, callback, seen, interrupt)
            mp4 = self._download(job_id, deadline, frames_asked * height * width * 3 + VIDEO_BYTES_MARGIN, interrupt)
            frames = self._decode(mp4, job_id, frames_asked, height, width)
        except RemoteJobFailed as e:
            raise self._scrubbed(e)  # nothing is left running on the server
        except BaseException as e:  # Cancel, the deadline, a lost connection, a refused answer: free the server
            self._give_up(job_id, seen["in_progress"], e)
            raise
        out = frames.astype(np.float32)
        out /= np.float32(255.0)
        return RemoteVideo(out, mp4, self._scrubbed_job({**job, "id": job_id}), self.base_url, time.monotonic() - start)

    def _decode(self, mp4: bytes, job_id: str, frames_asked: int, height: int, width: int) -> np.ndarray:
        """The mp4's frames; refused (nothing decoded) unless it is an mp4 whose header matches the request."""
        url = self._url(f"/v1/videos/{job_id}/content")
        try:
            return read_mp4(mp4, frames=frames_asked, height=height, width=width)
        except (VideoMismatch, NotAnMp4) as e:
            trim_heap()  # the decoder's buffers are freed; give their pages back
            hint = ("The server may not honour num_frames/width/height (check its version and model)."
                    if isinstance(e, VideoMismatch) else "Is base_url a LingBot-Video server?")
            raise RemoteServerError(f"job {job_id} on {self.base_url} sent {e}; refused before decoding it. {hint}",
                                    url=url, status=200, job_id=job_id) from None
        except Exception as e:  # av.error.InvalidDataError and friends
            trim_heap()
            detail = answer_text(str(e), self._secrets)
            raise RemoteServerError(
                f"the video of job {job_id} from {url} is not a readable mp4 ({type(e).__name__}: {detail}); "
                f"{len(mp4):,} bytes arrived. The file may be truncated: check the server's disk and logs, then queue again.",
                url=url, status=200, job_id=job_id, server_message=detail) from None

    def _scrubbed_job(self, job: dict) -> dict:
        """The final job object fit for the node's report, ComfyUI's history and its log: every string at every
        depth scrubbed of the key and made one line, every field and structure capped (:func:`scrub_fields`)."""
        return scrub_fields(job, self._secrets)

    def _give_up(self, job_id: str, saw_progress: bool, error: BaseException) -> None:
        """Delete an abandoned job on its own thread and deadline (CANCEL_SECONDS). A Cancel (any error that
        is not the server's) returns at once; a RemoteServerError waits for the DELETE, at most
        CANCEL_SECONDS, to say what happened, and leaves with its texts scrubbed of the key."""
        result: List[str] = []
        worker = threading.Thread(target=lambda: result.append(self.cancel(job_id, saw_progress=saw_progress)),
                                  name=f"lingbot-delete-{job_id[:40]}", daemon=True)
        worker.start()
        if not isinstance(error, RemoteServerError):
            return
        worker.join(CANCEL_SECONDS + 0.25)
        note = result[0] if result else f"a DELETE of job {job_id} was sent; the server has not answered it yet"
        error.args = (error.args[0] + f" The job was deleted on the server ({note}).",)
        self._scrubbed(error)

    def _scrubbed(self, error: RemoteServerError) -> RemoteServerError:
        """``error`` with its message, server message and job id scrubbed of the key (a server may echo it anywhere)."""
        error.args = (scrub(error.args[0], self._secrets),)
        error.server_message = scrub(error.server_message, self._secrets)
        if error.job_id is not None:
            error.job_id = scrub(error.job_id, self._secrets)
        return error

    def request_fields(self, prompt: str, *, negative_prompt: Optional[str] = None, image=None, width: int,
                       height: int, num_frames: int, steps: int, guidance_scale: float, shift: float, seed: int,
                       fps: int, use_caption_duration: bool = False):
        """The multipart text fields and files for one job, after the local checks (nothing is sent)."""
        parsed = parse_prompt(prompt)
        for warning in parsed.warnings:
            logger.warning("remote prompt: %s", warning)
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
            raise ValueError(f"fps={fps!r} is not allowed: use a positive number of frames per second (24 is the default).")
        num_frames = frames_for_prompt(parsed, num_frames, fps, use_caption_duration)
        check_video_size(num_frames, height, width)
        steps, seed = _check_steps(steps), _check_seed(seed)
        shifted_sigmas(steps, float(shift))  # refuses a shift that is not finite and > 0
        _check_text_inputs(prompt, negative_prompt, guidance_scale, num_frames)
        files = []
        if image is not None:
            check_ti2v_size(height, width)
            files.append(("input_reference", "first_frame.png", "image/png",
                          _png(preprocess_first_frame(image, height, width))))
        fields = [("model", self.model), ("prompt", parsed.text),
                  ("negative_prompt", resolve_negative(negative_prompt, num_frames)),
                  ("width", str(int(width))), ("height", str(int(height))), ("size", f"{int(width)}x{int(height)}"),
                  ("num_frames", str(int(num_frames))), ("fps", _number(fps)), ("seed", str(seed)),
                  ("num_inference_steps", str(steps)), ("guidance_scale", _number(float(guidance_scale))),
                  ("flow_shift", _number(float(shift)))]
        return fields, files

    # -- HTTP ---------------------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _open(self, method: str, path: str, deadline: float, *, data: Optional[bytes] = None,
              headers: Optional[dict] = None, job_id: Optional[str] = None, interrupt: Interrupt = None):
        """The open answer (status and headers read; the caller reads the body with :meth:`_read`).
        Non-2xx answers are returned, not raised; anything else that goes wrong raises RemoteServerError."""
        url = self._url(path)
        all_headers = {"Accept": "application/json"}
        if self._api_key:
            all_headers["Authorization"] = f"Bearer {self._api_key}"
        all_headers.update(headers or {})
        try:
            return open_answer(method, url, deadline=deadline, headers=all_headers, body=data, interrupt=interrupt)
        except TransportError as e:
            raise self._transport_error(e, url, job_id) from None

    def _read(self, answer, url: str, job_id: Optional[str], limit: int = MAX_JSON_BYTES) -> bytes:
        try:
            return answer.read(limit)
        except TransportError as e:
            raise self._transport_error(e, url, job_id) from None

    def _transport_error(self, e: TransportError, url: str, job_id: Optional[str]) -> RemoteServerError:
        job = f" (job {job_id})" if job_id else ""
        if isinstance(e, DeadlineExceeded):
            return self._timed_out(url, job_id)
        if isinstance(e, AnswerTooLarge):
            return RemoteServerError(f"{e}{job}. If a video really is that large, render fewer frames or a smaller size.",
                                     url=url, status=e.status, job_id=job_id)
        if isinstance(e, CannotConnect):
            return RemoteServerError(f"cannot reach the video server at {url} ({e.reason}){job}; start the server (see "
                                     "docs/remote-engines.md in this pack), or fix its address.", url=url, job_id=job_id,
                                     server_message=e.reason)
        detail = answer_text(str(e), self._secrets)
        return RemoteServerError(f"the video server: {answer_text(str(e), self._secrets, 1000)}{job}.", url=url,
                                 status=e.status, job_id=job_id, server_message=detail)

    def _exchange(self, method: str, path: str, deadline: float, *, job_id: Optional[str] = None,
                  interrupt: Interrupt = None, **kw):
        answer = self._open(method, path, deadline, job_id=job_id, interrupt=interrupt, **kw)
        return answer.status, self._read(answer, self._url(path), job_id)

    def _timed_out(self, url: str, job_id: Optional[str]) -> RemoteTimeoutError:
        what = f"job {job_id}" if job_id else "the request"
        return RemoteTimeoutError(
            f"the video server at {url} did not finish {what} within timeout={self.timeout:g} s; raise timeout on the "
            "Remote Server node (a 30B MoE render takes minutes), or check that the server is not stuck.",
            url=url, job_id=job_id)

    def _error(self, what: str, url: str, status: int, raw: bytes, job_id: Optional[str], hint: str = "") -> RemoteServerError:
        message = _server_message(raw, self._secrets)
        job = f" (job {job_id})" if job_id else ""
        return RemoteServerError(f"{what}: {url} answered HTTP {status}{job}: {message}{hint}",
                                 url=url, status=status, job_id=job_id, server_message=message)

    def _submit(self, body: bytes, content_type: str, deadline: float, interrupt: Interrupt) -> dict:
        url = self._url("/v1/videos")
        status, raw = self._exchange("POST", "/v1/videos", deadline, data=body, headers={"Content-Type": content_type},
                                     interrupt=interrupt)
        if not 200 <= status < 300:
            hint = " (is base_url the video server, and does it serve LingBot-Video?)" if status == 404 else ""
            raise self._error("the video server refused the job", url, status, raw, None, hint)
        job = _job_body(raw, url, None)
        if job is None or "id" not in job:
            shown = answer_text(raw, self._secrets)
            raise RemoteServerError(f"{url} answered HTTP {status} without a video job: {shown}",
                                    url=url, status=status, server_message=shown)
        job_id = check_job_id(job["id"], url, self._secrets)
        if job["status"] == FAILED:
            raise self._failed(url, status, job, job_id)
        return job

    def _failed(self, url: str, status: int, job: dict, job_id: str) -> RemoteJobFailed:
        """``job_id`` is the id this client checked and uses, never an id a later answer claims."""
        err = job.get("error")
        if isinstance(err, dict):
            code = err.get("code")
            message = (f"[{code}] " if code not in (None, "") else "") + str(err.get("message", ""))
        else:
            message = str(err or "no error message")
        message = answer_text(message, self._secrets)
        return RemoteJobFailed(f"the video server failed job {job_id}: {url} answered HTTP {status} with "
                               f"status 'failed': {message}", url=url, status=status, job_id=job_id,
                               server_message=message)

    def _sleep(self, seconds: float, interrupt: Interrupt) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if interrupt is not None:
                interrupt()
            time.sleep(min(left, SLICE))

    def _wait(self, job: dict, deadline: float, callback: Optional[ProgressCallback], seen: dict,
              interrupt: Interrupt) -> dict:
        job_id = job["id"]
        path = f"/v1/videos/{urllib.parse.quote(job_id, safe='')}"
        url = self._url(path)
        while True:  # bounded by ``deadline``: every request and every sleep stops at it
            status = job.get("status")
            progress = job.get("progress")
            if callback is not None:
                callback(float(progress) if isinstance(progress, (int, float)) and not isinstance(progress, bool)
                         and math.isfinite(progress) else (100.0 if status == DONE else 0.0), 100)
            if status == DONE:
                return job
            if status == FAILED:
                raise self._failed(url, 200, job, job_id)
            if status not in RUNNING:
                raise RemoteServerError(f"{url} reports job {job_id} with status "
                                        f"{answer_text(repr(status), self._secrets)}, which is neither queued, in "
                                        "progress, completed nor failed.", url=url, status=200, job_id=job_id,
                                        server_message=answer_text(repr(job), self._secrets))
            pause = min(self.poll_seconds, deadline - time.monotonic())
            if pause <= 0:
                raise self._timed_out(url, job_id)
            self._sleep(pause, interrupt)
            code, raw = self._exchange("GET", path, deadline, job_id=job_id, interrupt=interrupt)
            polled = _job_body(raw, url, job_id)
            if polled is None or not 200 <= code < 300:
                if polled is not None and polled.get("status") in (FAILED, DONE, *RUNNING):
                    # vLLM-Omni answers a failed job with a non-200 status and the job body.
                    raise self._failed(url, code, polled, job_id)
                raise self._error(f"could not read the state of job {job_id}", url, code, raw, job_id,
                                  " (the server may have restarted and lost the job; queue again)" if code == 404 else "")
            job = polled
            seen["in_progress"] = seen["in_progress"] or job.get("status") == "in_progress"

    def _download(self, job_id: str, deadline: float, limit: int, interrupt: Interrupt) -> bytes:
        """The mp4, at most ``min(limit, max_video_bytes)`` bytes (``limit``: the asked frames' raw size
        and a margin: no honest mp4 of them is larger)."""
        path = f"/v1/videos/{urllib.parse.quote(job_id, safe='')}/content"
        url = self._url(path)
        limit = min(limit, self.max_video_bytes)
        answer = self._open("GET", path, deadline, job_id=job_id, headers={"Accept": "video/mp4"}, interrupt=interrupt)
        with answer:
            status, headers = answer.status, answer.headers
            if not 200 <= status < 300:
                raw = self._read(answer, url, job_id)
                raise self._error(f"could not download the video of job {job_id}", url, status, raw, job_id)
            sent_type = headers.get("Content-Type") or ""
            if sent_type.split(";")[0].strip().lower() != "video/mp4":
                shown = answer_text(sent_type, self._secrets, 80)  # as sent: scrubbed before any other change
                raise RemoteServerError(f"{url} (job {job_id}) sent Content-Type {shown or 'none'!r}, not video/mp4 "
                                        "(only mp4 is accepted); is base_url a LingBot-Video server?", url=url,
                                        status=status, job_id=job_id, server_message=shown)
            length = content_length(headers, url)  # ASCII digits: checked by the transport when the answer came
            if length is not None and length > limit:
                raise RemoteServerError(f"{url} (job {job_id}) announced {length:,} bytes of video, more than the "
                                        f"limit of {limit:,}; refused.", url=url, status=status, job_id=job_id)
            data = self._read(answer, url, job_id, limit=limit)
        if length is not None and len(data) != length:
            raise RemoteServerError(f"the video of job {job_id} from {url} is truncated: {len(data):,} of {length:,} "
                                    "bytes arrived. Queue again.", url=url, status=status, job_id=job_id)
        return data

    def cancel(self, job_id: str, *, saw_progress: bool = False, seconds: float = CANCEL_SECONDS) -> str:
        """Delete the job on the server within ``seconds`` (never raises); returns and logs what happened.

        vLLM-Omni stops a deleted job; SGLang only removes its record and the render runs to its end, so
        its GPU stays busy. The API does not say which one answered: a server that reported
        ``in_progress`` (only vLLM-Omni does) is taken to cancel."""
        path = f"/v1/videos/{urllib.parse.quote(job_id, safe='')}"
        url = self._url(path)
        try:
            status, raw = self._exchange("DELETE", path, time.monotonic() + seconds, job_id=job_id)
        except RemoteTimeoutError:
            note = f"could not delete job {job_id} at {url}: the server did not answer the DELETE within {seconds:g} s"
            logger.warning("LingBot-Video remote: %s", note)
            return note
        except RemoteServerError as e:
            note = scrub(f"could not delete job {job_id} at {url}: {e}", self._secrets)
            logger.warning("LingBot-Video remote: %s", note)
            return note
        if status == 409:
            note = f"job {job_id}: {url} is already cancelling it (HTTP 409)"
        elif not 200 <= status < 300:
            note = f"job {job_id}: DELETE {url} answered HTTP {status}: {_server_message(raw, self._secrets)}"
        elif saw_progress:
            note = f"job {job_id} cancelled on {url}"
        else:
            note = (f"job {job_id} deleted on {url}; an SGLang Diffusion server only forgets a deleted job and keeps "
                    "rendering it until it is done (vLLM-Omni cancels it)")
        note = scrub(note, self._secrets)
        logger.warning("LingBot-Video remote: %s.", note)
        return note
