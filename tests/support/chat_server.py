"""A real OpenAI-compatible chat-completions server for tests: http.server on 127.0.0.1 only.

It records every request (path, headers, JSON body) and answers from a per-model script, so tests
exercise the pack's real HTTP client end to end (no mocking). Never bind another address.

Like vLLM and Ollama, a request with ``"stream": true`` is answered with server-sent events (chunks of
the text), which a client expecting one JSON completion cannot read. Hostile replies: a redirect
(``headers`` with a Location), an answer dripped one byte every ``DRIP_INTERVAL`` seconds (it stops
when the client goes away, and after ``DRIP_MAX_SECONDS``), any raw body.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, List, Optional, Union

HOST = "127.0.0.1"
DRIP_INTERVAL, DRIP_MAX_SECONDS = 0.5, 20.0


@dataclass
class Reply:
    content: Optional[str] = None  # the assistant's text (a normal completion)
    status: int = 200
    raw: Optional[bytes] = None  # sent as the body instead of a completion
    delay: float = 0.0  # seconds before answering (timeouts)
    drip: bool = False  # send the whole answer (status line included) one byte at a time
    headers: Optional[Dict[str, str]] = None  # extra headers, e.g. a redirect's Location


def send_raw(wfile, raw: bytes, drip: bool = False) -> None:
    """A whole answer (status line included), at once or one byte every DRIP_INTERVAL seconds; it stops
    when the client goes away, and after DRIP_MAX_SECONDS in any case."""
    try:
        if not drip:
            wfile.write(raw)
            return
        end = time.monotonic() + DRIP_MAX_SECONDS
        for i in range(len(raw)):
            if time.monotonic() > end:
                break
            wfile.write(raw[i : i + 1])
            wfile.flush()
            time.sleep(DRIP_INTERVAL)
    except OSError:  # the client gave up (timeouts, cancels)
        pass


def _events(model, text: str) -> bytes:
    """The answer as vLLM streams it: ``data: {chunk}`` events, then ``data: [DONE]``."""
    pieces = [text[i : i + 8] for i in range(0, len(text), 8)] or [""]
    events = [json.dumps({"id": "chatcmpl-test", "object": "chat.completion.chunk", "model": model,
                          "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}) for p in pieces]
    return "".join(f"data: {e}\n\n" for e in events + ["[DONE]"]).encode("utf-8")


class ChatCompletionsServer:
    """``replies[model]`` is a Reply, a string (the answer text) or a callable(body) -> Reply | str."""

    def __init__(self):
        self.requests: List[dict] = []
        self.replies: Dict[str, Union[Reply, str, Callable[[dict], Union[Reply, str]]]] = {}
        self._lock = threading.Lock()
        self._httpd: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self._httpd.server_address[1]}/v1"

    def start(self) -> "ChatCompletionsServer":
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                with owner._lock:
                    owner.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                reply = owner._reply(self.path, body)
                if reply.delay:
                    time.sleep(reply.delay)
                content_type = "application/json"
                if reply.raw is not None:
                    data = reply.raw
                elif isinstance(body, dict) and body.get("stream") is True:
                    content_type = "text/event-stream"
                    data = _events((body or {}).get("model"), reply.content or "")
                else:
                    data = json.dumps({
                        "id": "chatcmpl-test", "object": "chat.completion", "created": 0,
                        "model": (body or {}).get("model"),
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": reply.content}}],
                    }).encode("utf-8")
                head = [f"HTTP/1.1 {reply.status} {self.responses.get(reply.status, ('',))[0]}", f"Content-Type: {content_type}",
                        f"Content-Length: {len(data)}", "Connection: close"]
                head += [f"{k}: {v}" for k, v in (reply.headers or {}).items()]
                raw = "\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + data
                self.close_connection = True
                send_raw(self.wfile, raw, drip=reply.drip)

        self._httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def _reply(self, path: str, body) -> Reply:
        if path != "/v1/chat/completions" or not isinstance(body, dict):
            return Reply(status=404, raw=b'{"error": {"message": "not found"}}')
        script = self.replies.get(body.get("model"))
        if script is None:
            return Reply(status=404, raw=json.dumps({"error": {"message": f"model {body.get('model')} does not exist"}}).encode())
        if callable(script):
            script = script(body)
        return Reply(content=script) if isinstance(script, str) else script

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None

    def bodies(self) -> List[dict]:
        with self._lock:
            return [r["body"] for r in self.requests]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
