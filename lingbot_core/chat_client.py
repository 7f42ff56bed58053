"""A minimal OpenAI-compatible chat-completions client (vLLM, SGLang, Ollama, LM Studio...).

Only ``POST {base_url}/chat/completions`` with one user message is needed, so this is the standard
library's urllib rather than another dependency. Answers are cached by request (see ``chat``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, List, Optional

from PIL import Image

MAX_NEW_TOKENS = 6144  # the release's generation budget per step
ANSWER_CACHE_SIZE = 64
_BODY_PREVIEW = 300

# Bounded LRU of answers, keyed by URL + request body (never the API key): re-running a graph, or a
# rewrite after ComfyUI dropped its own cache, does not ask the server again. Failed calls are not kept.
_answers: "OrderedDict[str, str]" = OrderedDict()


class ChatServerError(RuntimeError):
    """The chat server could not be reached, failed, or answered something unusable."""


@dataclass(frozen=True)
class ChatServer:
    """Where and how to reach the server. ``api_key_env`` names an environment variable (empty: no key)."""

    base_url: str
    api_key_env: str = ""
    timeout: float = 600.0
    disable_thinking: bool = True  # chat_template_kwargs.enable_thinking=false, as the release (Qwen3 family)

    def endpoint(self) -> str:
        url = (self.base_url or "").strip()
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"base_url {url!r} is not an http(s) URL; use the server's OpenAI-compatible base, "
                             "e.g. http://127.0.0.1:8000/v1 (vLLM) or http://127.0.0.1:11434/v1 (Ollama).")
        return url.rstrip("/") + "/chat/completions"

    def api_key(self) -> Optional[str]:
        return api_key_from_env(self.api_key_env)


def api_key_from_env(name: Optional[str]) -> Optional[str]:
    """The key held by the environment variable ``name`` (None for an empty name); the key itself is
    never part of a workflow."""
    name = (name or "").strip()
    if not name:
        return None
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"api_key_env names the environment variable {name!r}, which is not set. Set it "
                         "before starting ComfyUI, or clear api_key_env for a server without a key.")
    return value


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


def _preview(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return text[:_BODY_PREVIEW]


def chat(server: ChatServer, model: str, content: List[dict], *, temperature: float = 0.0,
         seed: Optional[int] = None, max_tokens: int = MAX_NEW_TOKENS) -> str:
    """The assistant's text for one user turn. Raises ChatServerError with the URL and what went wrong."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError("the model name is empty; use the name the server lists for the model (GET /v1/models).")
    url = server.endpoint()
    body = request_body(server, model.strip(), content, temperature=temperature, seed=seed, max_tokens=max_tokens)
    data = json.dumps(body, ensure_ascii=False).encode("utf-8")
    api_key = server.api_key()
    key = hashlib.sha256(url.encode("utf-8") + b"\0" + data).hexdigest()
    if key in _answers:
        _answers.move_to_end(key)
        return _answers[key]

    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=server.timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as e:
        detail = _preview(e.read() or b"")
        hint = " (check that base_url ends with /v1)" if e.code == 404 else ""
        raise ChatServerError(f"the chat server at {url} answered HTTP {e.code} for model {model!r}{hint}: "
                              f"{detail}") from None
    except (socket.timeout, TimeoutError):
        raise ChatServerError(f"the chat server at {url} did not answer within {server.timeout:g} s (model "
                              f"{model!r}); raise timeout, or check that the server is not stuck.") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise ChatServerError(f"the chat server at {url} did not answer within {server.timeout:g} s (model "
                                  f"{model!r}); raise timeout, or check that the server is not stuck.") from None
        raise ChatServerError(f"cannot reach the chat server at {url} ({e.reason}); start the server, or fix "
                              "base_url.") from None
    except (ConnectionError, OSError) as e:  # e.g. the connection reset mid-answer
        raise ChatServerError(f"the connection to the chat server at {url} failed ({e}); check the server.") from None

    try:
        answer = json.loads(raw)
        text = answer["choices"][0]["message"]["content"]
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
