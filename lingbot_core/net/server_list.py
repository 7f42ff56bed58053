"""The user's server list: which servers the pack may send work to, and with which key.

Workflows are shared and opened from strangers, so a workflow must not choose where a key goes. The
servers that are not on this machine, and their keys, come from a JSON file the user writes (by
default ``lingbot_servers.json`` in ComfyUI's user directory, or the path in ``LINGBOT_SERVERS``)::

    {"servers": [
      {"name": "gpu-box", "kind": "video", "base_url": "https://gpu-box:8091",
       "model": "robbyant/lingbot-video-moe-30b-a3b", "api_key_env": "LINGBOT_GPU_KEY"},
      {"name": "rewriter", "kind": "chat", "base_url": "http://127.0.0.1:8000/v1"}
    ]}

A key is read only from the variable an entry names, and sent only to that entry's origin. A URL
typed into a workflow may only be a server on this machine (loopback), and never gets a key.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from .http_transport import check_base_url, check_key, is_loopback_host, redact_url

logger = logging.getLogger("lingbot_core")

ENV = "LINGBOT_SERVERS"
FILE_NAME = "lingbot_servers.json"
KINDS = ("video", "chat")
LOCAL = "(this machine: base_url, no key)"
MAX_FILE_BYTES = 1 << 20
_FIELDS = {"name", "kind", "base_url", "model", "api_key_env", "allow_http"}
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_EXAMPLE_URL = {"video": "https://gpu-box:8091", "chat": "https://gpu-box:8000/v1"}


# Keys that are also valid variable names (letters, digits and _): Hugging Face hf_..., GitHub ghp_... and
# github_pat_..., GitLab glpat_..., Slack xoxb_... A pasted key must be refused without being echoed.
_KEY_PREFIXES = ("hf_", "ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_", "glpat_", "xoxb_", "xoxp_", "sk_")


class ServerListError(ValueError):
    """The server list, or the choice of a server, is not usable; the message says how to fix it."""


def looks_like_key(name: str) -> bool:
    """Whether an ``api_key_env`` value is a key pasted in place of a variable's name: a known key prefix, or
    long, mixed-case and digit-rich as tokens are (variable names are words: LINGBOT_GPU_KEY)."""
    if name.lower().startswith(_KEY_PREFIXES):
        return True
    digits = sum(c.isdigit() for c in name)
    return len(name) > 64 or (len(name) >= 24 and digits >= 4 and any(c.islower() for c in name)
                              and any(c.isupper() for c in name))


_PASTED_KEY = ("this looks like a key, not the name of an environment variable; put the key itself in an "
               "environment variable (e.g. LINGBOT_GPU_KEY) and write that variable's name here. If it was a real "
               "key, it may be in files or logs now: consider replacing it.")


def api_key_from_env(name: Optional[str], *, where: str = "api_key_env") -> Optional[str]:
    """The key held by the environment variable ``name`` (None for no name). The message of any
    refusal names the variable, never its value (nor a key pasted in its place)."""
    name = (name or "").strip()
    if not name:
        return None
    if looks_like_key(name):
        raise ServerListError(f"{where}: {_PASTED_KEY}")
    if not _VARIABLE.fullmatch(name):
        raise ServerListError(f"{where} is not the name of an environment variable (letters, digits and _); put the "
                              "key itself in an environment variable and write that variable's name here.")
    value = os.environ.get(name)
    if not value:
        raise ServerListError(f"{where} names the environment variable {name}, which is not set (or empty). Set it "
                              "before starting ComfyUI, or remove api_key_env for a server without a key.")
    try:
        return check_key(value, where=f"the environment variable {name} ({where})")
    except ValueError as e:
        raise ServerListError(str(e)) from None


@dataclass(frozen=True)
class ServerEntry:
    name: str
    kind: str
    base_url: str
    model: Optional[str] = None
    api_key_env: Optional[str] = None
    allow_http: bool = False


@dataclass(frozen=True)
class Endpoint:
    """Where one node sends its work: ``name`` is the entry's (None for a URL on this machine)."""

    base_url: str
    api_key: Optional[str] = field(default=None, repr=False)
    allow_http: bool = False
    model: Optional[str] = None
    name: Optional[str] = None


def servers_path(default: Optional[os.PathLike | str] = None) -> Optional[Path]:
    """``$LINGBOT_SERVERS`` when set, else ``default`` (the host's user directory file)."""
    env = os.environ.get(ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return Path(default) if default is not None else None


def _entry_error(path: Path, index: int, name: object, message: str) -> ServerListError:
    which = f"entry {name!r}" if isinstance(name, str) and name else f"entry {index + 1}"
    return ServerListError(f"{path}: {which}: {message}")


def _entry(path: Path, index: int, raw: object) -> ServerEntry:
    if not isinstance(raw, dict):
        raise _entry_error(path, index, None, "is not a JSON object with name, kind and base_url.")
    name = raw.get("name")
    unknown = sorted(str(k) for k in raw if k not in _FIELDS)
    if unknown:
        raise _entry_error(path, index, name, f"unknown field(s) {', '.join(unknown)}; the fields are "
                           f"{', '.join(sorted(_FIELDS))}.")
    if not isinstance(name, str) or not name.strip() or name.strip() == LOCAL:
        raise _entry_error(path, index, None, "needs a \"name\" (the text shown in the node's server list).")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise _entry_error(path, index, name, "\"kind\" must be \"video\" (Remote Server) or \"chat\" (Rewriter Server).")
    model = raw.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise _entry_error(path, index, name, "\"model\" must be the served model's name.")
    if model is not None and kind == "chat":
        raise _entry_error(path, index, name, "a chat server takes no \"model\": the Rewriter Server node names its "
                           "expand_model and map_model.")
    key_env = raw.get("api_key_env")
    if isinstance(key_env, str) and looks_like_key(key_env.strip()):
        raise _entry_error(path, index, name, f"\"api_key_env\": {_PASTED_KEY}")
    if key_env is not None and (not isinstance(key_env, str) or not _VARIABLE.fullmatch(key_env.strip())):
        raise _entry_error(path, index, name, "\"api_key_env\" must be the NAME of an environment variable (letters, "
                           "digits and _) that holds the key, not the key itself.")
    allow_http = raw.get("allow_http", False)
    if not isinstance(allow_http, bool):
        raise _entry_error(path, index, name, "\"allow_http\" must be true or false.")
    base_url = raw.get("base_url")
    if not isinstance(base_url, str):
        raise _entry_error(path, index, name, "needs a \"base_url\" (the server's address).")
    try:
        base_url = check_base_url(base_url, what="base_url", has_key=bool(key_env), allow_http=allow_http)
    except ValueError as e:
        raise _entry_error(path, index, name, str(e)) from None
    return ServerEntry(name.strip(), kind, base_url, model.strip() if model else None,
                       key_env.strip() if key_env else None, allow_http)


def read_servers(path: Optional[os.PathLike | str]) -> Dict[str, ServerEntry]:
    """``{name: entry}`` of the file (empty when there is no file); ServerListError naming the file."""
    if path is None:
        return {}
    path = Path(path)
    data = _read_list_file(path)
    if data is None:
        return {}
    try:
        raw = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise ServerListError(f"the server list {path} is not valid UTF-8 JSON{where}; see "
                              "lingbot_servers.example.json for the format.") from None
    entries = raw.get("servers") if isinstance(raw, dict) else raw
    if not isinstance(entries, list):
        raise ServerListError(f"the server list {path} must be {{\"servers\": [...]}} (see lingbot_servers.example.json).")
    servers: Dict[str, ServerEntry] = {}
    for index, item in enumerate(entries):
        entry = _entry(path, index, item)
        if entry.name in servers:
            raise _entry_error(path, index, entry.name, "the name is used twice; names must be unique.")
        servers[entry.name] = entry
    return servers


def _read_list_file(path: Path) -> Optional[bytes]:
    """The file's bytes (None when there is none): only a regular file (a symlink to one is fine), at most
    MAX_FILE_BYTES, and never blocking: a FIFO, a device (``/dev/zero``) or a socket is refused unread."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ServerListError(f"cannot read the server list {path} ({e.strerror or e}).") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ServerListError(f"the server list {path} is not a regular file (a pipe, a device or a folder); "
                                  "point LINGBOT_SERVERS at a JSON file.")
        if info.st_size > MAX_FILE_BYTES:
            raise ServerListError(f"the server list {path} is {info.st_size:,} bytes; a list of servers is far "
                                  f"smaller (limit {MAX_FILE_BYTES:,}).")
        chunks, total = [], 0
        while total <= MAX_FILE_BYTES:
            piece = os.read(fd, MAX_FILE_BYTES + 1 - total)
            if not piece:
                break
            chunks.append(piece)
            total += len(piece)
        if total > MAX_FILE_BYTES:  # it grew while being read
            raise ServerListError(f"the server list {path} is larger than {MAX_FILE_BYTES:,} bytes; a list of "
                                  "servers is far smaller.")
        return b"".join(chunks)
    except OSError as e:
        raise ServerListError(f"cannot read the server list {path} ({e.strerror or e}).") from None
    finally:
        os.close(fd)


def server_names(path: Optional[os.PathLike | str], kind: str) -> List[str]:
    """The names a node's dropdown offers (never raises: a broken file is reported when a prompt runs)."""
    try:
        servers = read_servers(path)
    except ServerListError as e:
        logger.warning("LingBot-Video: %s", e)
        return []
    return [name for name, entry in servers.items() if entry.kind == kind]


def _example(kind: str, base_url: Optional[str], key_env: Optional[str] = None) -> str:
    entry = {"name": "my-server", "kind": kind, "base_url": base_url or _EXAMPLE_URL[kind]}
    if kind == "video":
        entry["model"] = "robbyant/lingbot-video-moe-30b-a3b"
    entry["api_key_env"] = key_env or "MY_SERVER_KEY"
    return json.dumps(entry)


_NODE = {"video": "LingBot-Video Remote Server", "chat": "LingBot-Video Rewriter Server"}


def _shown_url(base_url) -> Optional[str]:
    if not isinstance(base_url, str) or not base_url.strip():
        return None
    shown = redact_url(base_url.strip())
    return None if "?" in shown or "@" in shown else shown


def _where(path: Optional[Path]) -> str:
    return str(path) if path is not None else f"a server list ({ENV} or the ComfyUI user directory's {FILE_NAME})"


def local_url(base_url: str, kind: str, path: Optional[Path] = None) -> str:
    """A URL typed into a workflow: a server on this machine only (it never gets a key)."""
    url = check_base_url(base_url, what="base_url", has_key=False)
    host = urllib.parse.urlsplit(url).hostname
    if not is_loopback_host(host):
        raise ServerListError(
            f"base_url {redact_url(url)!r} is not on this machine: a workflow may only name a server on this machine "
            f"(127.0.0.1, ::1, localhost), so that a shared workflow cannot choose where your prompts and keys go. To "
            f"use this server, add it to {_where(path)}, e.g. {_example(kind, redact_url(url))} (api_key_env only if "
            "it needs a key), and choose its name under server.")
    return url


def select_server(server: str, base_url: Optional[str], *, kind: str, path: Optional[Path]) -> Endpoint:
    """The endpoint a node uses: the entry named ``server`` in the user's list, or (``LOCAL``) the
    workflow's ``base_url`` on this machine without a key.

    Workflows saved before the list existed carry the name of a key's environment variable (or
    nothing) where ``server`` is now: nothing means the local URL; a variable's name is refused with
    how to move the server into the list."""
    if server is None:
        # An API-format workflow from before the server list: the node has no server input at all.
        raise ServerListError(
            f"this workflow was saved before the server list: its {_NODE[kind]} node has no server input (it had "
            f"api_key_env). A workflow can no longer choose where a key goes: add the server to {_where(path)}, e.g. "
            f"{_example(kind, _shown_url(base_url))} (api_key_env only if it needs a key), then set the node's "
            f"server to its name (\"server\": \"my-server\" in an API-format workflow), or to {LOCAL!r} for a "
            "server on this machine without a key.")
    servers = read_servers(path)
    server = server if isinstance(server, str) else str(server)
    entry = servers.get(server)  # names match exactly: "gpu-box " is not "gpu-box"
    if entry is not None:
        if entry.kind != kind:
            raise ServerListError(f"server {server!r} in {path} is a {entry.kind} server; choose a {kind} server.")
        key = api_key_from_env(entry.api_key_env, where=f"api_key_env of server {entry.name!r} in {path}")
        return Endpoint(entry.base_url, key, entry.allow_http, entry.model, entry.name)
    if server in ("", LOCAL):
        return Endpoint(local_url(base_url or "", kind, path))
    offered = ", ".join(name for name, e in servers.items() if e.kind == kind) or "none"
    if _VARIABLE.fullmatch(server) and server in os.environ:
        # A workflow from before the server list: this was api_key_env. Naming the variable is safe.
        raise ServerListError(
            f"this workflow names the environment variable {server} for an API key; a workflow can no longer choose "
            f"where a key goes. Add the server to {_where(path)}, e.g. "
            f"{_example(kind, redact_url(base_url) if base_url else None, server)}, then choose its name under server.")
    # Not echoed: in an older workflow this field held api_key_env, and a key may have been pasted there.
    raise ServerListError(f"server is not a {kind} server in {_where(path)} ({kind} servers there: {offered}). Choose one "
                          f"of them, or {LOCAL!r} for a server on this machine; add servers to the file, e.g. "
                          f"{_example(kind, None)}.")
