"""HTTP for the pack's two clients (the remote Videos API and the chat/rewriter API).

urllib is not enough for a server the user does not control: its timeout applies to each socket
read (a server that sends one byte every half second never times out), and its opener follows
redirects to any origin with the ``Authorization`` header. Here one exchange runs against one
total deadline: connect, TLS, sending, the status line, every header and every byte of the body
wait in slices of at most ``SLICE`` seconds, and before each slice the deadline and the caller's
``interrupt`` hook (ComfyUI's Cancel) are checked. No redirect is ever followed; answers are read
up to a byte limit. http.client parses the answer (status, headers, chunked bodies), reading from
a file object whose every read obeys the deadline.

URL rules that protect a key also live here: only http(s), never ``user:pass@``, and a key travels
in clear (``http://``) only to this machine unless the user's own server entry allows it.
"""

from __future__ import annotations

import errno
import http.client
import io
import ipaddress
import json
import os
import re
import select
import socket
import ssl
import time
import urllib.parse
from typing import Callable, Iterable, Mapping, Optional

SLICE = 0.1  # seconds: the longest a blocked step waits before checking the deadline and the interrupt
_SEND_PIECE = 1 << 16
_READ_PIECE = 1 << 16
LOOPBACK_NAMES = ("localhost",)
_IN_PROGRESS = (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN, errno.EALREADY)

Interrupt = Optional[Callable[[], None]]  # raises to stop (e.g. ComfyUI's interrupt); called every slice


class TransportError(Exception):
    """An exchange failed; the message is a full sentence naming the URL (never a key)."""

    def __init__(self, message: str, *, url: str, status: Optional[int] = None, reason: str = ""):
        super().__init__(message)
        self.url, self.status, self.reason = url, status, reason or message


class DeadlineExceeded(TransportError):
    """The deadline passed before the exchange finished."""


class CannotConnect(TransportError):
    """The server could not be reached (refused, unknown host, TLS failure)."""


class BrokenAnswer(TransportError):
    """The connection broke off, or the answer is not HTTP."""


class AnswerTooLarge(TransportError):
    """The answer is longer than the caller's byte limit."""


class RedirectRefused(TransportError):
    """The server answered with a redirect; none is followed (``target`` is its redacted Location)."""

    def __init__(self, message: str, *, url: str, status: int, target: str):
        super().__init__(message, url=url, status=status)
        self.target = target


# -- URLs ------------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """``url`` safe to show: a password is masked, a query string elided (it may hold a token)."""
    try:
        parts = urllib.parse.urlsplit(str(url))
    except ValueError:
        return "<an unparsable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = (f"{user}:***@" if ":" in userinfo else f"{user}@") + hostport
    query = "?…" if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")) + query


def is_loopback_host(host: Optional[str]) -> bool:
    """127.0.0.0/8, ::1 or localhost: a server on this machine."""
    host = (host or "").strip("[]").rstrip(".").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def check_base_url(url: str, *, what: str, has_key: bool, allow_http: bool = False, example: str = "") -> str:
    """``url`` stripped, after the rules that protect a key; ValueError (password masked) otherwise."""
    url = (url or "").strip()
    shown = redact_url(url)
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"{what} {shown!r} is not a valid URL{example}.") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} {shown!r} is not an http(s) server address{example}.")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{what} {shown!r} holds a user name or password; remove it from the URL (a key belongs in "
                         "an environment variable named by api_key_env in the server list).")
    if parts.query or parts.fragment:
        raise ValueError(f"{what} {shown!r} has a query or fragment; use the server's address only{example}.")
    if port == 0:
        raise ValueError(f"{what} {shown!r} has port 0{example}.")
    if has_key and parts.scheme == "http" and not is_loopback_host(parts.hostname) and not allow_http:
        raise ValueError(f"{what} {shown!r} is plain http to another machine, and the key would travel in clear: use "
                         "https, or (on a network you trust) add \"allow_http\": true to this server's entry in the "
                         "server list.")
    return url


def check_key(value: str, *, where: str) -> str:
    """``value`` if it can be sent as a bearer key; the refusal names ``where``, never the value."""
    if not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
        raise ValueError(f"{where} holds a line break, a space, a control or a non-ASCII character, so it cannot be "
                         "sent as a key (a .env file saved with CRLF line ends adds a CR); set it to the bare key.")
    return value


# Text shaped like a credential: a bearer token, or a key with a well-known prefix (OpenAI, Hugging Face,
# GitHub, GitLab, Slack, AWS). Servers echo them in 401 bodies; a message must never carry one.
_TOKEN_SHAPES = re.compile(
    r"(?P<head>(?i:bearer\s+|(?:authorization|token|api[_-]?key|access[_-]?key|secret)[\"']?\s*[:=]\s*[\"']?"
    r"(?:(?i:bearer|token|basic)\s+)?))(?=[^\s\"',;)}\]]*[0-9])[^\s\"',;)}\]]{8,}"
    r"|\b(?:sk|hf|ghp|gho|ghu|ghs|ghr|github_pat|glpat|xox[abprs])[-_][A-Za-z0-9_\-]{8,}"
    r"|\bAKIA[0-9A-Z]{16}\b")
SCRUBBED = "***"
# The shortest run of a key's characters that is still scrubbed where a server re-encoded the key (base64
# from an unaligned start keeps only the key's whole 3-byte groups).
_MIN_FORM_CHARS = 6
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def secret_forms(secret: str) -> list:
    """The texts a server may echo ``secret`` as: the key itself (in any case), percent-encoded, JSON- and
    HTML-escaped, and base64 (standard and URL-safe, from each of the three byte alignments at which the
    key can start inside an encoded run, so ``base64("Bearer <key>")`` is caught too). Longest first."""
    import base64
    import html

    forms = {secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret, safe=""),
             json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1], html.escape(secret)}
    raw = secret.encode("utf-8")
    for skip in range(3):  # bytes of the key that share a base64 group with whatever came before it
        body = raw[skip:]
        body = body[: len(body) - len(body) % 3]
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            form = encode(body).decode("ascii")
            if len(form) >= _MIN_FORM_CHARS:
                forms.add(form)
    return sorted(forms, key=len, reverse=True)


def _secret_pattern(secrets: Iterable[Optional[str]]) -> Optional["re.Pattern"]:
    forms = [f for s in secrets if s and len(s) >= 4 for f in secret_forms(s)]
    if not forms:
        return None
    # Letters in any case: a server that upper-cases a header or a message upper-cases the key with it
    # (a base64 form matched in another case only scrubs a little more).
    return re.compile("|".join(f"(?i:{re.escape(f)})" for f in forms))


def scrub(text: str, secrets: Iterable[Optional[str]] = ()) -> str:
    """``text`` that came from a server (an error body, a ``detail``, a header) with every configured
    key in ``secrets`` (as the key, in any case, and in the encodings of :func:`secret_forms`), and
    anything shaped like a bearer token or a known key, replaced by ``***``.

    The one filter between an answer and an exception message, a log line or a host's error: both
    clients pass every text they build from an answer through it."""
    text = str(text)
    pattern = _secret_pattern(secrets)
    if pattern is not None:
        text = pattern.sub(SCRUBBED, text)
    return _TOKEN_SHAPES.sub(lambda m: (m.group("head") or "") + SCRUBBED, text)


def one_line(text: str) -> str:
    """``text`` with line breaks and other control characters shown as escapes, so a server's text can
    never start a line of its own in a log (a forged ``ERROR`` line)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def answer_text(raw, secrets: Iterable[Optional[str]] = (), limit: int = 300) -> str:
    """A server's answer (bytes or text) as a short, scrubbed, one-line text for a message: scrubbed
    first, then cut (a key across the cut is gone before it could be halved)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    return one_line(scrub(text, secrets))[:limit]


# Caps on what a report carries from a server's structure (a job object): a field is a short text, a
# structure a few levels and items; the rest is summarised, never copied.
FIELD_CHARS, STRUCT_DEPTH, STRUCT_ITEMS = 200, 4, 32


def scrub_fields(value, secrets: Iterable[Optional[str]] = (), *, depth: int = STRUCT_DEPTH):
    """A server's JSON ``value`` fit for a report or a log: every string (keys too) scrubbed, made one line
    and cut to FIELD_CHARS, lists and objects cut to STRUCT_ITEMS entries and STRUCT_DEPTH levels (a
    deeper part becomes a short summary). Numbers, booleans and None pass as they are."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        cut = one_line(scrub(value, secrets))
        return cut if len(cut) <= FIELD_CHARS else cut[:FIELD_CHARS] + f"… ({len(value):,} characters)"
    if isinstance(value, (list, tuple, dict)):
        if depth <= 0:
            return f"<{type(value).__name__} of {len(value):,} items, not shown>"
        items = list(value.items() if isinstance(value, dict) else enumerate(value))
        shown = [(scrub_fields(str(k), secrets), scrub_fields(v, secrets, depth=depth - 1))
                 for k, v in items[:STRUCT_ITEMS]]
        out = dict(shown) if isinstance(value, dict) else [v for _, v in shown]
        if len(items) > STRUCT_ITEMS:
            more = f"{len(items) - STRUCT_ITEMS:,} more items, not shown"
            if isinstance(out, dict):
                out["…"] = more
            else:
                out.append(more)
        return out
    return f"<{type(value).__name__}, not shown>"


def bearer_secrets(headers: Optional[Mapping[str, str]]) -> tuple:
    """The keys a request's ``Authorization`` header sends (to scrub them from what comes back)."""
    for name, value in (headers or {}).items():
        if name.lower() == "authorization" and value:
            return (value, value.split(" ", 1)[-1])
    return ()


_ASCII_DIGITS = re.compile(r"[0-9]{1,18}")


def content_length(headers, url: str) -> Optional[int]:
    """The answer's Content-Length: None when absent; BrokenAnswer naming ``url`` unless it is one run
    of ASCII digits (``²`` or ``１２`` are digits to Python's ``int``, not to HTTP), or two disagree."""
    values = headers.get_all("Content-Length") or []
    if not values:
        return None
    if len(set(v.strip() for v in values)) > 1:
        raise BrokenAnswer(f"{url} sent {len(values)} different Content-Length headers; an answer has one length. The "
                           "server or a proxy in between is broken", url=url)
    if not _ASCII_DIGITS.fullmatch(values[0].strip()):
        # Its text is not shown: a header a server fills with anything may hold the key it was sent.
        raise BrokenAnswer(f"{url} sent an invalid Content-Length (a {len(values[0]):,}-character value that is not "
                           "ASCII digits); it must be ASCII digits. The server or a proxy in between is broken", url=url)
    return int(values[0].strip())


class JSONTooDeep(ValueError):
    """JSON nested deeper than Python's parser goes (a nesting bomb)."""


def loads_json(raw: bytes):
    """``json.loads`` that refuses a nesting bomb with JSONTooDeep (json raises RecursionError)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise JSONTooDeep(f"JSON nested too deeply to be an answer ({len(raw):,} bytes)") from None


# -- one exchange ----------------------------------------------------------------------------


class _Clock:
    def __init__(self, deadline: float, interrupt: Interrupt, url: str, timeout_note: str):
        self.deadline, self.interrupt, self.url, self.timeout_note = deadline, interrupt, url, timeout_note

    def slice(self) -> float:
        """Seconds the next blocked step may wait; raises at the deadline or when interrupted."""
        if self.interrupt is not None:
            self.interrupt()
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"{self.url} did not answer in time{self.timeout_note}.", url=self.url)
        return min(remaining, SLICE)


class _DeadlineReader(io.RawIOBase):
    """The socket as a raw file whose reads wait in slices, checking the clock between them."""

    def __init__(self, sock: socket.socket, clock: _Clock):
        self._sock, self._clock = sock, clock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            self._sock.settimeout(self._clock.slice())
            try:
                return self._sock.recv_into(buffer)
            except (socket.timeout, ssl.SSLWantReadError):
                continue


class _SocketFile:
    """What http.client.HTTPResponse needs of a socket: ``makefile``."""

    def __init__(self, sock: socket.socket, clock: _Clock):
        self._file = io.BufferedReader(_DeadlineReader(sock, clock))

    def makefile(self, mode: str, *args, **kwargs):
        return self._file


def _wait(sock: socket.socket, clock: _Clock, *, write: bool) -> None:
    select.select([] if write else [sock], [sock] if write else [], [], clock.slice())


def _connect(host: str, port: int, https: bool, clock: _Clock) -> socket.socket:
    url = clock.url
    try:
        # Name resolution cannot be cut short; a local resolver answers in milliseconds.
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        reason = f"unknown host: {e.strerror or e}"
        raise CannotConnect(f"cannot reach {url} ({reason})", url=url, reason=reason) from None
    last: Optional[OSError] = None
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            err = sock.connect_ex(address)
            while err in _IN_PROGRESS:
                _, writable, _ = select.select([], [sock], [], clock.slice())
                if writable:
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, os.strerror(err))
        except OSError as e:
            sock.close()
            last = e
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if https:
            sock = _tls(sock, host, clock)
        return sock
    reason = (last.strerror if last is not None and last.strerror else str(last)) or "no address"
    raise CannotConnect(f"cannot reach {url} ({reason})", url=url, reason=reason)


def _tls(raw: socket.socket, host: str, clock: _Clock) -> socket.socket:
    context = ssl.create_default_context()
    sock = context.wrap_socket(raw, server_hostname=host, do_handshake_on_connect=False)
    try:
        while True:
            try:
                sock.do_handshake()
                return sock
            except ssl.SSLWantReadError:
                _wait(sock, clock, write=False)
            except ssl.SSLWantWriteError:
                _wait(sock, clock, write=True)
    except ssl.SSLError as e:
        sock.close()
        reason = f"TLS handshake failed: {e.reason or e}; check the certificate and that the server speaks https"
        raise CannotConnect(f"cannot reach {clock.url} ({reason})", url=clock.url, reason=reason) from None
    except BaseException:
        sock.close()
        raise


def _header_line(name: str, value: str) -> bytes:
    # The value is never echoed: it may be a key (the server list refuses such keys by variable name first).
    if any(c in value for c in "\r\n\0") or not value.isascii():
        raise ValueError(f"the {name} header would hold a line break or a non-ASCII character; refused.")
    return f"{name}: {value}\r\n".encode("ascii")


class Answer:
    """An open answer: ``status``, ``headers``; read the body with :meth:`read` (or close it)."""

    def __init__(self, response: http.client.HTTPResponse, sock: socket.socket, url: str):
        self._response, self._sock, self.url = response, sock, url
        self.status, self.headers = response.status, response.headers

    def read(self, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes (AnswerTooLarge beyond it); then closes."""
        chunks, total = [], 0
        try:
            while True:
                piece = self._response.read(min(_READ_PIECE, limit + 1 - total))
                if not piece:
                    break
                chunks.append(piece)
                total += len(piece)
                if total > limit:
                    raise AnswerTooLarge(f"the answer of {self.url} is larger than {limit:,} bytes; refused",
                                         url=self.url, status=self.status)
        except (http.client.HTTPException, OSError) as e:
            raise BrokenAnswer(f"the answer of {self.url} broke off after {total:,} bytes ({type(e).__name__}); the "
                               "server or the network dropped the connection", url=self.url, status=self.status) from None
        finally:
            self.close()
        return b"".join(chunks)

    def close(self) -> None:
        self._response.close()
        self._sock.close()

    def __enter__(self) -> "Answer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_answer(method: str, url: str, *, deadline: float, headers: Optional[Mapping[str, str]] = None,
                body: Optional[bytes] = None, interrupt: Interrupt = None, timeout_note: str = "") -> Answer:
    """Send one request and read the status line and headers, all before ``deadline`` (monotonic).

    A redirect (3xx with a Location) raises RedirectRefused naming the target; other statuses are
    returned. ``timeout_note`` ends the DeadlineExceeded message (e.g. how to raise the timeout)."""
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    host, port = parts.hostname or "", parts.port or (443 if https else 80)
    clock = _Clock(deadline, interrupt, url, timeout_note)
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    host_header = parts.netloc.rpartition("@")[2]
    head = [f"{method} {target} HTTP/1.1\r\n".encode("ascii"), _header_line("Host", host_header),
            b"User-Agent: lingbot-video-nodes\r\n", b"Accept-Encoding: identity\r\n", b"Connection: close\r\n"]
    for name, value in (headers or {}).items():
        head.append(_header_line(name, value))
    if body is not None or method in ("POST", "PUT"):
        head.append(f"Content-Length: {len(body or b'')}\r\n".encode("ascii"))
    data = memoryview(b"".join(head) + b"\r\n" + (body or b""))

    sock = _connect(host, port, https, clock)
    try:
        try:
            while data:
                sock.settimeout(clock.slice())
                try:
                    sent = sock.send(data[:_SEND_PIECE])
                except (socket.timeout, ssl.SSLWantWriteError):
                    continue
                data = data[sent:]
            response = http.client.HTTPResponse(_SocketFile(sock, clock), method=method)
            response.begin()
        except (http.client.HTTPException, OSError) as e:
            raise BrokenAnswer(f"{url} did not send a valid HTTP answer ({type(e).__name__}: "
                               f"{answer_text(str(e), bearer_secrets(headers), 120)})", url=url) from None
        content_length(response.headers, url)
        answer = Answer(response, sock, url)
    except BaseException:
        sock.close()
        raise
    if 300 <= answer.status < 400 and answer.status != 304:
        location = answer.headers.get("Location") or ""
        answer.close()
        shown = answer_text(redact_url(urllib.parse.urljoin(url, location)), bearer_secrets(headers), 400) if location else "nowhere"
        raise RedirectRefused(
            f"{url} answered HTTP {answer.status}, a redirect to {shown}; redirects are never followed (a key, the "
            "prompt or the image would go to an address you did not configure). Use the final address as base_url",
            url=url, status=answer.status, target=shown)
    return answer


def exchange(method: str, url: str, *, deadline: float, limit: int, headers: Optional[Mapping[str, str]] = None,
             body: Optional[bytes] = None, interrupt: Interrupt = None, timeout_note: str = ""):
    """``(status, headers, body)`` of one request, body read up to ``limit`` bytes; see :func:`open_answer`."""
    answer = open_answer(method, url, deadline=deadline, headers=headers, body=body, interrupt=interrupt,
                         timeout_note=timeout_note)
    return answer.status, answer.headers, answer.read(limit)
