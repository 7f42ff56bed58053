"""A key a server echoes in any form, nested job fields, job ids and header values (issue 51, findings 3, 4, 7, 8).

Every case is a hostile Videos or chat server on 127.0.0.1 (tests/support/remote_server.py,
tests/support/chat_server.py), bounded by the client's timeout. What a user would see is asserted: the
exception message, the server message it carries, the node's report and job, and every log line. The
key's encodings are computed here with the standard library, not with the pack's scrub.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import time
import urllib.parse
import uuid

import pytest

from support.chat_server import ChatCompletionsServer, Reply
from lingbot_core.net.chat_client import ChatServer, ChatServerError, chat, user_content
from lingbot_core.net.server_list import ServerListError, api_key_from_env
from lingbot_core.remote import CANCEL_SECONDS, RemoteServer, RemoteServerError
from support.remote_server import Script, VideosServer

MODEL = "robbyant/lingbot-video-moe-30b-a3b"
JOB = dict(width=96, height=64, num_frames=5, steps=2, guidance_scale=3.0, shift=3.0, seed=7, fps=24)
# No well-known prefix, and mixed case: only the configured key's own match can catch it (a token-shaped
# pattern cannot), and a server that changes its case changes what it echoes.
KEY = "LbK" + uuid.uuid4().hex[:12] + uuid.uuid4().hex[:12].upper() + "Zq"


def pieces(text: str, n: int = 8):
    """Every n-character run of ``text``: none may survive in anything a user sees."""
    return {text[i:i + n] for i in range(len(text) - n + 1)}


def leaked(shown: str, key: str = KEY, n: int = 8) -> list:
    low = shown.lower()
    return sorted(p for p in pieces(key.lower(), n) if p in low)


@pytest.fixture(scope="module")
def videos():
    server = VideosServer("vllm", MODEL).start()
    yield server
    server.stop()


@pytest.fixture
def home(videos):
    videos.clear()
    return videos


def client(server, **kw) -> RemoteServer:
    kw.setdefault("timeout", 20)
    kw.setdefault("poll_seconds", 0.05)
    kw.setdefault("api_key", KEY)
    return RemoteServer(server.url, MODEL, **kw)


def refused(home, script, caplog, key=KEY) -> tuple:
    """(the error, everything a user can see of it: message, server message and the log lines)."""
    home.scripts.append(script)
    with caplog.at_level(logging.DEBUG, logger="lingbot_core"):
        with pytest.raises(RemoteServerError) as info:
            client(home, api_key=key).generate("a kite", **JOB)
        time.sleep(CANCEL_SECONDS / 4)  # the DELETE's log line, if any
    return info.value, " ".join([str(info.value), info.value.server_message or "", caplog.text])


def _b64(text: str, prefix: str = "") -> str:
    return base64.b64encode((prefix + text).encode()).decode()


ECHO_FORMS = {
    "as sent": f"Bearer {KEY}",
    "upper-cased": KEY.upper(),
    "lower-cased": KEY.lower(),
    "percent-encoded": urllib.parse.quote(f"Bearer {KEY}", safe=""),
    "form-encoded": urllib.parse.urlencode({"authorization": f"Bearer {KEY}"}),
    "JSON-escaped": json.dumps(json.dumps({"auth": f"Bearer {KEY}"})),
    "HTML-escaped": html.escape(f"<b>{KEY}</b>"),
    "base64 of the key": _b64(KEY),
    "base64 of the header value": _b64(KEY, "Bearer "),
    "base64 of the header line": _b64(KEY, "Authorization: Bearer "),
    "URL-safe base64, one byte in": base64.urlsafe_b64encode(("x" + KEY).encode()).decode(),
}


@pytest.mark.parametrize("form", list(ECHO_FORMS))
def test_a_key_the_server_transforms_is_scrubbed(home, form, caplog):
    echoed = ECHO_FORMS[form]
    error, shown = refused(home, Script(submit_status=401, error_message=f"invalid credentials: {echoed}"), caplog)
    assert "HTTP 401" in str(error), str(error)
    assert echoed not in shown and "***" in shown, shown
    if form.startswith(("base64", "URL-safe")):  # no 8 characters of the key's encoding, at any byte alignment
        for skip in range(3):
            for encode in (base64.b64encode, base64.urlsafe_b64encode):
                core = encode(b"\0" * skip + KEY.encode()).decode()[4:-4]
                assert not [p for p in pieces(core) if p in shown], (skip, shown)
    else:
        assert not leaked(shown), (leaked(shown), shown)
    assert len(home.posts()) == 1


def test_a_short_key_is_scrubbed_too(home, caplog):
    short = "Qz7k9"
    error, shown = refused(home, Script(submit_status=403, error_message=f"key {short} is not allowed here"), caplog,
                           key=short)
    assert "HTTP 403" in str(error) and short not in shown, shown


def test_a_key_across_the_300_character_cut_leaves_no_part_of_it(home, caplog):
    for offset in (290, 296, 299):
        home.clear()
        error, shown = refused(home, Script(submit_status=401, error_message="x" * offset + KEY + " tail"), caplog)
        assert not leaked(error.server_message, n=4), (offset, error.server_message[-20:])
        assert not leaked(shown), (offset, leaked(shown))


def test_a_redirect_location_that_carries_the_key_is_scrubbed(home, caplog):
    for location in (f"http://127.0.0.1:9/{KEY}/v1/videos", f"http://127.0.0.1:9/{urllib.parse.quote(KEY.upper())}/x"):
        home.clear()
        error, shown = refused(home, Script(redirect=("submit", 307, location)), caplog)
        assert "redirect" in str(error), str(error)
        assert not leaked(shown), (location, shown)


def test_the_transport_itself_scrubs_a_location_that_carries_the_key(home):
    """The chat and Videos clients scrub again; the transport's own message and ``target`` must already be clean."""
    from lingbot_core.net.http_transport import RedirectRefused, open_answer
    from lingbot_core.remote import encode_multipart

    home.scripts.append(Script(redirect=("submit", 302, f"http://127.0.0.1:9/{KEY.upper()}/v1")))
    body, content_type = encode_multipart([("prompt", "a kite"), ("model", MODEL)], [])
    with pytest.raises(RedirectRefused) as info:
        open_answer("POST", home.url + "/v1/videos", deadline=time.monotonic() + 10, body=body,
                    headers={"Authorization": f"Bearer {KEY}", "Content-Type": content_type})
    assert not leaked(str(info.value)) and not leaked(info.value.target), str(info.value)
    assert "***" in info.value.target


def test_a_content_type_that_carries_the_key_is_scrubbed_before_it_is_lowered(home, caplog):
    error, shown = refused(home, Script(content_type=f"Text/Plain; note={KEY}"), caplog)
    assert "not video/mp4" in str(error) and "Text/Plain" in str(error), str(error)
    assert not leaked(shown), shown


def test_a_content_length_that_carries_the_key_is_not_echoed(home, caplog):
    error, shown = refused(home, Script(length_header=KEY + KEY), caplog)
    assert "invalid Content-Length" in str(error) and f"a {2 * len(KEY)}-character value" in str(error), str(error)
    assert not leaked(shown, n=6), shown


def test_two_different_content_lengths_are_refused(home, caplog):
    error, shown = refused(home, Script(content_headers=(("Content-Length", "7"),)), caplog)
    assert "2 different Content-Length headers" in str(error), str(error)


# -- the final job: nested fields, sizes ------------------------------------------------------------


def test_the_key_in_nested_job_fields_reaches_no_report_and_every_field_is_capped(home, caplog):
    home.scripts.append(Script(final_fields={
        "model": [f"Bearer {KEY}", {"echo": {"deeper": [KEY.upper()]}}],
        "metadata": {"request": {"headers": {"authorization": f"Bearer {KEY}"}}},
        "huge": "y" * (2 << 20),
        "many": list(range(100_000)),
        "deep": json.loads("[" * 50 + "]" * 50),
    }))
    with caplog.at_level(logging.DEBUG, logger="lingbot_core"):
        out = client(home).run("a kite", **JOB)
    report, job_text = out.report(), json.dumps(out.job)
    assert out.frames.shape == (5, 64, 96, 3)
    for shown in (report, job_text, caplog.text):
        assert not leaked(shown), leaked(shown)
    assert len(report) < 1_000, len(report)  # was 2 MiB with "huge" in the model field
    assert len(job_text) < 20_000, len(job_text)
    assert "(2,097,152 characters)" in job_text and "99,968 more items" in job_text
    assert out.job["inference_time_s"] == 12.5 and out.job["status"] == "completed"


BAD_IDS = {
    "null": None, "list": ["video_1"], "object": {"id": "video_1"}, "true": True, "number": 17,
    "empty": "", "line feed": "video_1\nERROR forged line", "dot dot": "..", "dot": ".",
    "slash": "a/../../etc", "1 MiB": "v" * (1 << 20), "space": "video 1",
}


@pytest.mark.parametrize("case", list(BAD_IDS))
def test_a_job_id_that_is_not_a_short_safe_string_is_refused_naming_the_field(home, case, caplog):
    error, shown = refused(home, Script(job_id=BAD_IDS[case]), caplog)
    message = str(error)
    assert "field 'id'" in message and "Refused" in message, message
    assert len(message) < 600 and "\n" not in message, message[:300]
    assert "ERROR forged" not in caplog.text.replace("\\n", "")
    assert [m for m, _ in home.calls()] == ["POST"], home.calls()  # nothing sent to a path built from it


def test_a_well_formed_job_id_still_works(home):
    home.scripts.append(Script(job_id="video_gen_0123456789abcdef.v1-x"))
    out = client(home).run("a kite", **JOB)
    assert out.job["id"] == "video_gen_0123456789abcdef.v1-x" and out.frames.shape == (5, 64, 96, 3)


def test_a_server_message_cannot_forge_a_log_line(home, caplog):
    error, shown = refused(home, Script(fail="boom\nERROR:root:forged by the server\r\nmore"), caplog)
    assert "failed job" in str(error) and "\n" not in str(error)
    assert not any(line.startswith("ERROR:root:forged") for line in caplog.text.splitlines()), caplog.text


# -- the chat client ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_home():
    server = ChatCompletionsServer().start()
    yield server
    server.stop()


@pytest.mark.parametrize("form", ["as sent", "upper-cased", "percent-encoded", "base64 of the header value"])
def test_a_key_the_chat_server_transforms_never_reaches_the_message(chat_home, form):
    chat_home.replies.clear()
    chat_home.replies["m"] = Reply(status=401, raw=json.dumps({"error": {"message": f"bad key {ECHO_FORMS[form]}"}}).encode())
    server = ChatServer(chat_home.url, api_key=KEY, timeout=10)
    with pytest.raises(ChatServerError) as info:
        chat(server, "m", user_content("describe a kite"))
    assert "HTTP 401" in str(info.value) and ECHO_FORMS[form] not in str(info.value), str(info.value)
    assert not leaked(str(info.value)), str(info.value)


# -- a key pasted where a variable's name goes --------------------------------------------------------


@pytest.mark.parametrize("length", [24, 28, 31, 40])
def test_a_pasted_token_of_24_or_more_characters_is_refused_without_echo(length, monkeypatch):
    token = ("aB3" + uuid.uuid4().hex + uuid.uuid4().hex.upper())[:length]
    monkeypatch.setenv(token, "irrelevant")  # even a set variable of that name: a key is never a name
    with pytest.raises(ServerListError) as info:
        api_key_from_env(token)
    assert "looks like a key" in str(info.value) and token not in str(info.value)
