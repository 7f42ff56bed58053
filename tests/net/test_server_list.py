"""The user's server list (lingbot_core.net.server_list): what a workflow may choose, and where a key may go.

Messages are checked for what a user needs (the file, the entry, how to fix it) and for what must
never be in them (a key, a password).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lingbot_core.net.server_list import (ENV, LOCAL, ServerListError, api_key_from_env, read_servers, select_server,
                                      server_names, servers_path)

SECRET = "sk-live-0123456789abcdef"
REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, servers, name="lingbot_servers.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"servers": servers}), encoding="utf-8")
    return path


GOOD = [
    {"name": "gpu-box", "kind": "video", "base_url": "https://gpu-box:8091", "model": "robbyant/lingbot-video-dense-1.3b",
     "api_key_env": "LINGBOT_TEST_GPU_KEY"},
    {"name": "lan-box", "kind": "video", "base_url": "http://192.168.1.20:8091", "api_key_env": "LINGBOT_TEST_GPU_KEY",
     "allow_http": True},
    {"name": "rewriter", "kind": "chat", "base_url": "http://127.0.0.1:8000/v1"},
]


def test_the_shipped_example_file_is_valid():
    servers = read_servers(REPO / "lingbot_servers.example.json")
    assert {e.kind for e in servers.values()} == {"video", "chat"}


def test_an_entry_gives_its_own_address_model_and_key(tmp_path, monkeypatch):
    path = write(tmp_path, GOOD)
    monkeypatch.setenv("LINGBOT_TEST_GPU_KEY", SECRET)
    assert server_names(path, "video") == ["gpu-box", "lan-box"] and server_names(path, "chat") == ["rewriter"]
    chosen = select_server("gpu-box", "http://127.0.0.1:1", kind="video", path=path)
    assert (chosen.base_url, chosen.api_key, chosen.model, chosen.name) == (
        "https://gpu-box:8091", SECRET, "robbyant/lingbot-video-dense-1.3b", "gpu-box")
    assert SECRET not in repr(chosen)
    assert select_server("lan-box", None, kind="video", path=path).allow_http is True
    chat = select_server("rewriter", None, kind="chat", path=path)
    assert chat.api_key is None and chat.base_url == "http://127.0.0.1:8000/v1"
    with pytest.raises(ServerListError, match="'rewriter' .* is a chat server; choose a video server"):
        select_server("rewriter", None, kind="video", path=path)


@pytest.mark.parametrize("url", ["http://127.0.0.1:30000", "http://127.5.6.7:1/v1", "http://[::1]:8091", "http://localhost:1"])
def test_a_workflow_url_on_this_machine_runs_without_a_key(tmp_path, url):
    chosen = select_server(LOCAL, url, kind="video", path=tmp_path / "missing.json")
    assert chosen.base_url == url and chosen.api_key is None and chosen.name is None
    # Workflows from before the list carry an empty api_key_env where server is now.
    assert select_server("", url, kind="chat", path=None).api_key is None


@pytest.mark.parametrize("url", ["http://10.0.0.5:30000", "https://gpu.example.com/v1", "http://127.0.0.1.evil.com:1",
                                 "http://0.0.0.0:30000"])
def test_a_workflow_url_on_another_machine_is_refused_with_how_to_add_it(tmp_path, url):
    path = write(tmp_path, GOOD)
    with pytest.raises(ServerListError) as info:
        select_server(LOCAL, url, kind="video", path=path)
    msg = str(info.value)
    assert f"base_url {url!r} is not on this machine" in msg and str(path) in msg
    assert f'"base_url": "{url}"' in msg and '"kind": "video"' in msg and "choose its name under server" in msg


def test_an_old_workflow_naming_a_key_variable_is_refused_without_sending_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    path = write(tmp_path, GOOD)
    with pytest.raises(ServerListError) as info:
        select_server("HF_TOKEN", "http://127.0.0.1:30000", kind="video", path=path)
    msg = str(info.value)
    assert "names the environment variable HF_TOKEN" in msg and '"api_key_env": "HF_TOKEN"' in msg
    assert "a workflow can no longer choose where a key goes" in msg and SECRET not in msg


def test_an_unknown_server_is_not_echoed(tmp_path):
    """An older workflow held api_key_env in this field, so a pasted key may be there."""
    path = write(tmp_path, GOOD)
    with pytest.raises(ServerListError) as info:
        select_server(SECRET, "http://127.0.0.1:1", kind="video", path=path)
    msg = str(info.value)
    assert SECRET not in msg and "video servers there: gpu-box, lan-box" in msg


@pytest.mark.parametrize("value", [SECRET + "\r", SECRET + "\n", " " + SECRET, SECRET + "é"])
def test_a_key_with_a_line_break_is_refused_by_its_variable(tmp_path, monkeypatch, value):
    monkeypatch.setenv("LINGBOT_TEST_GPU_KEY", value)
    with pytest.raises(ServerListError) as info:
        select_server("gpu-box", None, kind="video", path=write(tmp_path, GOOD))
    msg = str(info.value)
    assert "the environment variable LINGBOT_TEST_GPU_KEY" in msg and "line break" in msg
    assert SECRET not in msg


def test_an_unset_key_variable_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("LINGBOT_TEST_GPU_KEY", raising=False)
    with pytest.raises(ServerListError, match="names the environment variable LINGBOT_TEST_GPU_KEY, which is not set"):
        select_server("gpu-box", None, kind="video", path=write(tmp_path, GOOD))
    with pytest.raises(ServerListError, match="not the name of an environment variable"):
        api_key_from_env(SECRET, where="--api_key_env")


BAD_ENTRIES = {
    "http with a key": ({"name": "a", "kind": "video", "base_url": "http://10.0.0.5:1", "api_key_env": "K"},
                        "entry 'a': base_url 'http://10.0.0.5:1' is plain http to another machine"),
    "password": ({"name": "a", "kind": "video", "base_url": f"https://me:{SECRET}@h:1"},
                 "entry 'a': base_url 'https://me:***@h:1' holds a user name or password"),
    "a key as api_key_env": ({"name": "a", "kind": "chat", "base_url": "https://h/v1", "api_key_env": SECRET},
                             "entry 'a': \"api_key_env\" must be the NAME of an environment variable"),
    "kind": ({"name": "a", "kind": "gpu", "base_url": "https://h"}, "entry 'a': \"kind\" must be \"video\""),
    "field": ({"name": "a", "kind": "video", "base_url": "https://h", "apikey": "x"}, "unknown field(s) apikey"),
    "no name": ({"kind": "video", "base_url": "https://h"}, "entry 1: needs a \"name\""),
    "chat model": ({"name": "a", "kind": "chat", "base_url": "https://h/v1", "model": "m"}, "a chat server takes no"),
    "ftp": ({"name": "a", "kind": "video", "base_url": "ftp://h"}, "not an http(s) server address"),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_a_bad_entry_names_the_file_and_the_entry(tmp_path, case):
    entry, message = BAD_ENTRIES[case]
    path = write(tmp_path, [entry])
    with pytest.raises(ServerListError) as info:
        read_servers(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value), str(info.value)
    assert SECRET not in str(info.value)
    assert server_names(path, "video") == []  # the dropdown still lists nothing, the run says why
    with pytest.raises(ServerListError):
        select_server(LOCAL, "http://127.0.0.1:1", kind="video", path=path)


def test_a_broken_file_is_named(tmp_path):
    path = tmp_path / "lingbot_servers.json"
    path.write_text('{"servers": [ {"name": "a",, } ]}', encoding="utf-8")
    with pytest.raises(ServerListError, match=r"is not valid UTF-8 JSON \(line 1, column 28\)"):
        read_servers(path)
    path.write_text("[" * 100_000, encoding="utf-8")
    with pytest.raises(ServerListError, match="not valid UTF-8 JSON"):
        read_servers(path)
    path.write_text(json.dumps({"servers": [GOOD[0], GOOD[0]]}), encoding="utf-8")
    with pytest.raises(ServerListError, match="'gpu-box': the name is used twice"):
        read_servers(path)
    path.write_bytes(b" " * (2 << 20))
    with pytest.raises(ServerListError, match="2,097,152 bytes"):
        read_servers(path)
    assert read_servers(tmp_path / "none.json") == {}


def test_the_environment_variable_chooses_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert servers_path(tmp_path / "default.json") == tmp_path / "default.json"
    monkeypatch.setenv(ENV, str(tmp_path / "mine.json"))
    assert servers_path(tmp_path / "default.json") == tmp_path / "mine.json"


def test_cli_reads_the_key_variable_it_is_given(tmp_path, monkeypatch, capsys):
    """The command line is the user's own: --api_key_env is allowed there, and checked the same way."""
    from lingbot_core.cli import main

    monkeypatch.setenv("LINGBOT_TEST_CLI_KEY", SECRET + "\r")
    prompts = tmp_path / "p.py"
    prompts.write_text('VIDEO_STEP1_EXPAND = "e"\nVIDEO_STEP2_MAP = "m"\n', encoding="utf-8")
    assert main(["rewrite", "--prompt", "a kite", "--system_prompts", str(prompts), "--base_url",
                 "http://127.0.0.1:9/v1", "--expand_model", "a", "--map_model", "b", "--api_key_env",
                 "LINGBOT_TEST_CLI_KEY"]) == 2
    out = capsys.readouterr()
    assert "environment variable LINGBOT_TEST_CLI_KEY" in out.err and SECRET not in out.err + out.out


# -- round two (issue 30; issue 28's server-list rows) ---------------------------------------------

def _read_in_a_thread(path, seconds=5.0):
    """read_servers(path) on a thread: (finished, the error or result); never hangs the test."""
    import threading

    out = []

    def run():
        try:
            out.append(read_servers(path))
        except Exception as e:  # noqa: BLE001 - returned to the test
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return (not thread.is_alive()), (out[0] if out else None)


def test_a_list_that_is_a_fifo_or_a_device_is_refused_unread(tmp_path, monkeypatch):
    import os

    fifo = tmp_path / "servers.fifo"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")  # endless: reading it whole ends in MemoryError
    for path in (fifo, zero, tmp_path):
        finished, result = _read_in_a_thread(path)
        assert finished, f"reading {path} blocked"
        assert isinstance(result, ServerListError) and "is not a regular file" in str(result), result
    # A symlink to a regular file is still fine, and the names offered come from it.
    real = write(tmp_path, GOOD, "real.json")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert server_names(link, "video") == ["gpu-box", "lan-box"]
    monkeypatch.setenv(ENV, str(fifo))
    assert server_names(servers_path(), "video") == []  # the dropdown: empty, with the reason logged


def test_a_name_that_is_used_twice_is_refused_even_across_kinds(tmp_path):
    path = write(tmp_path, [GOOD[0], {"name": "gpu-box", "kind": "chat", "base_url": "http://127.0.0.1:8000/v1"}])
    with pytest.raises(ServerListError, match="'gpu-box': the name is used twice"):
        read_servers(path)
    with pytest.raises(ServerListError, match="used twice"):
        select_server("gpu-box", None, kind="chat", path=path)


@pytest.mark.parametrize("typed", ["gpu-box ", " gpu-box", "gpu-box\t", "GPU-box"])
def test_server_names_match_exactly(tmp_path, monkeypatch, typed):
    path = write(tmp_path, GOOD)
    monkeypatch.setenv("LINGBOT_TEST_GPU_KEY", SECRET)
    with pytest.raises(ServerListError, match="not a video server in") as info:
        select_server(typed, "http://127.0.0.1:1", kind="video", path=path)
    assert "gpu-box" in str(info.value)  # offered, as the list's own name
    assert select_server("gpu-box", "http://127.0.0.1:1", kind="video", path=path).api_key == SECRET


PASTED = ["hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567", "ghp_" + "0123456789abcdefABCDEF0123456789abcd",
          "a3F9kQ2mZ7xW1pL8vB4nT6yR0sD5hJ2c"]


@pytest.mark.parametrize("pasted", PASTED)
def test_a_key_pasted_into_api_key_env_is_refused_without_echo(tmp_path, monkeypatch, pasted):
    path = write(tmp_path, [{**GOOD[0], "api_key_env": pasted}])
    for attempt in (lambda: read_servers(path), lambda: api_key_from_env(pasted)):
        with pytest.raises(ServerListError) as info:
            attempt()
        assert "looks like a key, not the name of an environment variable" in str(info.value)
        assert pasted not in str(info.value) and pasted[:12] not in str(info.value)
    # Ordinary variable names still work.
    monkeypatch.setenv("LINGBOT_GPU_KEY_2026", SECRET)
    assert api_key_from_env("LINGBOT_GPU_KEY_2026") == SECRET


@pytest.mark.parametrize("kind, node", [("video", "Remote Server"), ("chat", "Rewriter Server")])
def test_a_workflow_without_a_server_input_is_told_which_entry_to_add(tmp_path, kind, node):
    """An API-format workflow saved before the server list has no server input at all (issue 33)."""
    path = write(tmp_path, GOOD)
    with pytest.raises(ServerListError) as info:
        select_server(None, "https://gpu-box:8091", kind=kind, path=path)
    msg = str(info.value)
    assert f"its LingBot-Video {node} node has no server input" in msg and str(path) in msg, msg
    assert f'"kind": "{kind}", "base_url": "https://gpu-box:8091"' in msg and "then set the node's server" in msg, msg
