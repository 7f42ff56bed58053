"""A minimal OpenAI-compatible chat-completions client (vLLM, SGLang, Ollama, LM Studio...).

Only ``POST {base_url}/chat/completions`` with one user message is needed. HTTP goes through
:mod:`http_transport` (one total deadline, Cancel within a fraction of a second, no redirect, a byte
limit on the answer), as the remote Videos client's. Answers are cached by request (see ``chat``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, List, Optional

from PIL import Image

from .http_transport import (CannotConnect, DeadlineExceeded, Interrupt, JSONTooDeep, TransportError, answer_text,
                             check_base_url, check_key, exchange, loads_json, scrub)

MAX_NEW_TOKENS = 6144  # the release's generation budget per step
ANSWER_CACHE_SIZE = 64
MAX_ANSWER_BYTES = 1 << 22  # 6k tokens of JSON are tens of kB
_BODY_PREVIEW = 300

# Bounded LRU of answers, keyed by URL + request body (never the API key): re-running a graph, or a
# rewrite after ComfyUI dropped its own cache, does not ask the server again. Failed calls are not kept.
_answers: "OrderedDict[str, str]" = OrderedDict()


class ChatServerError(RuntimeError):
    """The chat server could not be reached, failed, or answered something unusable."""


@dataclass(frozen=True)
class ChatServer:
    """Where and how to reach the server. ``api_key`` is the key itself (hosts read it from the user's
    server list; never in ``repr`` or a message), sent only to ``base_url``: over plain http only to
    this machine unless ``allow_http``. ``timeout`` bounds each request; ``interrupt`` is called every
    few tenths of a second while waiting, and raising from it stops the request (a host's Cancel)."""

    base_url: str
    api_key: Optional[str] = field(default=None, repr=False)
    timeout: float = 600.0
    disable_thinking: bool = True  # chat_template_kwargs.enable_thinking=false, as the release (Qwen3 family)
    allow_http: bool = False
    interrupt: Interrupt = field(default=None, repr=False, compare=False)

    def endpoint(self) -> str:
        if self.api_key:
            check_key(self.api_key, where="api_key")
        url = check_base_url(self.base_url, what="base_url", has_key=bool(self.api_key), allow_http=self.allow_http,
                             example="; use the server's OpenAI-compatible base, e.g. http://127.0.0.1:8000/v1 (vLLM) "
                                     "or http://127.0.0.1:11434/v1 (Ollama)")
        return url.rstrip("/") + "/chat/completions"


def image_data_url(image: Image.Image) -> str:
    """The image as a PNG data URL, the portable way to send an image in a chat message."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def user_content(text: str, image_url: Optional[str] = None) -> List[dict]:
    """One user turn: the image first (when given), then the text."""
    parts = [{"type": "image_url", "image_url": {"url": image_url}}] if image_url else []
    return parts + [{"type": "text", "text": text}]


def request_body(server: ChatServer, model: str, content: List[dict], *, temperature: float = 0.0,
                 seed: Optional[int] = None, max_tokens: int = MAX_NEW_TOKENS) -> dict:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                            "temperature": float(temperature), "max_tokens": int(max_tokens), "stream": False}
    if seed is not None:
        body["seed"] = int(seed)
    if server.disable_thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def chat(server: ChatServer, model: str, content: List[dict], *, temperature: float = 0.0,
         seed: Optional[int] = None, max_tokens: int = MAX_NEW_TOKENS) -> str:
    """The assistant's text for one user turn. Raises ChatServerError with the URL and what went wrong."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError("the model name is empty; use the name the server lists for the model (GET /v1/models).")
    url = server.endpoint()
    body = request_body(server, model.strip(), content, temperature=temperature, seed=seed, max_tokens=max_tokens)
    data = json.dumps(body, ensure_ascii=False).encode("utf-8")
    key = hashlib.sha256(url.encode("utf-8") + b"\0" + data).hexdigest()
    if key in _answers:
        _answers.move_to_end(key)
        return _answers[key]

    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if server.api_key:
        headers["Authorization"] = f"Bearer {server.api_key}"
    secrets = (server.api_key,) if server.api_key else ()

    def _preview(raw) -> str:  # what the server said, fit for a message: scrubbed of the key, then cut
        return answer_text(raw, secrets, _BODY_PREVIEW)

    try:
        status, _, raw = exchange("POST", url, deadline=time.monotonic() + float(server.timeout), limit=MAX_ANSWER_BYTES,
                                  headers=headers, body=data, interrupt=server.interrupt)
    except DeadlineExceeded:
        raise ChatServerError(f"the chat server at {url} did not answer within {server.timeout:g} s (model "
                              f"{model!r}); raise timeout, or check that the server is not stuck.") from None
    except CannotConnect as e:
        raise ChatServerError(f"cannot reach the chat server at {url} ({e.reason}); start the server, or fix its "
                              "address.") from None
    except TransportError as e:
        raise ChatServerError(f"the chat server (model {model!r}): {scrub(str(e), secrets)}.") from None
    if not 200 <= status < 300:
        hint = " (check that base_url ends with /v1)" if status == 404 else ""
        raise ChatServerError(f"the chat server at {url} answered HTTP {status} for model {model!r}{hint}: "
                              f"{_preview(raw)}")
    try:
        answer = loads_json(raw)
        text = answer["choices"][0]["message"]["content"]
    except JSONTooDeep as e:
        raise ChatServerError(f"the chat server at {url} answered {e} (model {model!r}); refused.") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ChatServerError(f"the chat server at {url} did not send a chat completion (model {model!r}): "
                              f"{_preview(raw)}") from None
    if not isinstance(text, str):
        raise ChatServerError(f"the chat server at {url} sent no text for model {model!r}: {_preview(raw)}")
    _answers[key] = text
    while len(_answers) > ANSWER_CACHE_SIZE:
        _answers.popitem(last=False)
    return text


def clear_cache() -> None:
    _answers.clear()
