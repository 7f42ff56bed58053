"""Shared workflows cannot steal a key, hang the server or exhaust its RAM (issue 21), in a real ComfyUI.

One headless ComfyUI runs with a server list (LINGBOT_SERVERS) that names a "home" Videos server with
a key (LINGBOT_TEST_KEY), and with HF_TOKEN set, as on a user's machine. Hostile servers on
127.0.0.1 record every header (tests/support/remote_server.py). The cases: workflows that try to send a key
elsewhere (an old workflow naming a variable, a URL on another machine, a loopback URL, a redirect),
a status answer dripped one byte every 0.5 s (timeout=5 must end within 8 s; Cancel within 2 s, as an
interrupt), and small mp4s that decode to huge videos (refused with the server's peak RSS rising less
than 100 MiB, measured from /proc after resetting VmHWM). After each case the next prompt's frames are
identical to the core client's for the same job. Heavy: run with ``flock /tmp/lingbot-heavy.lock``.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid

import numpy as np
import pytest

from support.comfy_host import (
    ComfyServer, PromptValidationError, comfyui_unavailable_reason, execution_error, workflow_to_api,
)
from lingbot_core.remote import RemoteServer
from lingbot_core.net.server_list import LOCAL
from support.remote_server import Script, VideosServer, small_but_huge_mp4
from bench.server_rss import kib
from support.comfy_graphs import load_workflow, saved_frames

pytestmark = pytest.mark.comfy

MODEL = "robbyant/lingbot-video-moe-30b-a3b"
SECRET = "sk-lingbot-" + uuid.uuid4().hex
HF_SECRET = "hf_" + uuid.uuid4().hex
JOB = dict(width=96, height=64, num_frames=5, steps=2, guidance_scale=3.0, shift=3.0)
MIB = 1 << 20
_seeds = itertools.count(100)
_LIST_FILE: list = []  # the server list the ComfyUI of this module reads


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    home, attacker = VideosServer("vllm", MODEL).start(), VideosServer("vllm", MODEL).start()
    base = tmp_path_factory.mktemp("comfy-remote-security")
    servers = base / "servers.json"
    servers.write_text(json.dumps({"servers": [
        {"name": "home", "kind": "video", "base_url": home.url, "model": MODEL, "api_key_env": "LINGBOT_TEST_KEY"},
        {"name": "home chat", "kind": "chat", "base_url": home.url + "/v1", "api_key_env": "LINGBOT_TEST_KEY"},
    ]}), encoding="utf-8")
    _LIST_FILE[:] = [servers]
    comfy = ComfyServer(base, env={"LINGBOT_SERVERS": str(servers), "LINGBOT_TEST_KEY": SECRET, "HF_TOKEN": HF_SECRET})
    comfy.start()
    yield comfy, home, attacker
    comfy.stop()
    home.stop()
    attacker.stop()


@pytest.fixture
def servers(env):
    comfy, home, attacker = env
    home.clear()
    attacker.clear()
    return env


def graph(server="home", base_url="http://127.0.0.1:1", timeout=60, seed=None, **job) -> dict:
    seed = next(_seeds) if seed is None else seed
    return {
        "1": {"class_type": "LingbotRemoteServer", "inputs": {"base_url": base_url, "model": MODEL, "server": server,
                                                              "timeout": timeout, "poll_seconds": 0.1}},
        "2": {"class_type": "LingbotRemoteGenerate", "inputs": {
            "server": ["1", 0], "prompt": "a red kite", "negative_prompt": "", "seed": seed, "fps": 24,
            "use_caption_duration": False, **{**JOB, **job}}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": f"sec_{seed}"}},
    }


def secret_free(server) -> bool:
    text = json.dumps(server.requests, default=repr)
    return SECRET not in text and HF_SECRET not in text


def next_prompt_matches_the_core_client(comfy, home):
    """A good prompt after a failure: its frames equal the core client's for the same job, exactly."""
    seed = next(_seeds)
    home.scripts.append(Script(lossless=True))
    entry = comfy.run(graph(seed=seed), timeout=120)
    home.scripts.append(Script(lossless=True))
    core = RemoteServer(home.url, MODEL, api_key=SECRET).generate("a red kite", seed=seed, fps=24, **JOB)
    assert np.array_equal(saved_frames(comfy, entry, "3"), np.round(core * 255).astype(np.uint8))
    assert [r["headers"].get("Authorization") for r in home.requests] == [f"Bearer {SECRET}"] * len(home.requests)


def refused(comfy, prompt) -> str:
    with pytest.raises(PromptValidationError) as info:
        comfy.queue(prompt)
    return json.dumps(info.value.body)


def legacy_example(object_info, widgets) -> dict:
    """The example workflow as saved before the server list: widget values are positional, and the
    third one was api_key_env."""
    wf = load_workflow("lingbot_remote_t2v")
    (node,) = [n for n in wf["nodes"] if n["type"] == "LingbotRemoteServer"]
    node["widgets_values"] = widgets
    api = workflow_to_api(wf, object_info)
    for nid, n in api.items():
        if n["class_type"] == "LingbotRemoteGenerate":
            n["inputs"].update(JOB, seed=next(_seeds), use_caption_duration=False)
        if n["class_type"] == "SaveVideo":
            n["inputs"]["filename_prefix"] = f"legacy_{nid}_{time.monotonic_ns()}"
    return api


def test_a_workflow_cannot_send_a_key_anywhere_but_its_configured_server(servers):
    comfy, home, attacker = servers
    info = comfy.object_info("LingbotRemoteServer")
    assert info["input"]["optional"]["server"][0] == ["home", LOCAL]
    assert list(info["input"]["required"]) + list(info["input"]["optional"]) == [
        "base_url", "model", "server", "timeout", "poll_seconds"]  # the widgets' order of saved workflows
    # An old workflow naming a key's variable: refused at queue time (HTTP 400), saying how to add the server.
    msg = refused(comfy, legacy_example(comfy.object_info(), [attacker.url, MODEL, "HF_TOKEN", 60, 0.1]))
    assert "names the environment variable HF_TOKEN" in msg and "Add the server to" in msg and HF_SECRET not in msg
    msg = refused(comfy, {"1": {"class_type": "LingbotRewriterServer", "inputs": {
        "base_url": attacker.url + "/v1", "expand_model": "m", "map_model": "m", "system_prompts": "x",
        "server": "HF_TOKEN", "timeout": 30, "disable_thinking": True}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})
    assert "names the environment variable HF_TOKEN" in msg
    # A URL on another machine: refused, with the entry to add.
    msg = refused(comfy, graph(LOCAL, "http://10.255.0.1:30000"))
    assert "is not on this machine" in msg and "\\\"base_url\\\": \\\"http://10.255.0.1:30000\\\"" in msg
    # A server that is not in the list: refused without echoing what the workflow holds there.
    msg = refused(comfy, graph("sk-pasted-key-0123456789"))
    assert "not a video server in" in msg and "sk-pasted-key" not in msg
    # A loopback URL typed into the workflow runs, without any key.
    entry = comfy.run(graph(LOCAL, attacker.url), timeout=120)
    assert saved_frames(comfy, entry, "3").shape == (5, 64, 96, 3)
    assert attacker.posts() and all("Authorization" not in r["headers"] for r in attacker.requests)
    # The old example workflow with an empty api_key_env and its loopback URL still runs, without a key.
    attacker.clear()
    comfy.run(legacy_example(comfy.object_info(), [attacker.url, MODEL, "", 60, 0.1]), timeout=120)
    assert attacker.posts() and all("Authorization" not in r["headers"] for r in attacker.requests)
    # The configured server redirects the poll to another server: refused, nothing reaches it.
    attacker.clear()
    home.scripts.append(Script(redirect=("poll", 302, attacker.url + "/v1/videos/stolen")))
    err = execution_error(comfy.run(graph(), timeout=120, check=False))
    assert "a redirect to " + attacker.url + "/v1/videos/stolen" in err["exception_message"]
    assert attacker.requests == []
    assert secret_free(attacker) and SECRET in json.dumps(home.requests)
    next_prompt_matches_the_core_client(comfy, home)
    assert secret_free(attacker)


def run_with_timeout_5(comfy, home, drip: str, record_property, figure: str):
    """Queue a Remote Generate with timeout=5 against a server that drips at ``drip``; (its error, seconds)."""
    home.scripts.append(Script(drip=drip))
    start = time.monotonic()
    entry = comfy.run(graph(timeout=5), timeout=60, check=False)
    elapsed = time.monotonic() - start
    record_property(figure, round(elapsed, 2))
    print(f"\n{figure}: the prompt ended after {elapsed:.2f} s")
    return execution_error(entry), elapsed


def test_a_dripping_server_ends_at_the_timeout_and_cancel_ends_it_at_once(servers, record_property):
    comfy, home, _ = servers
    err, elapsed = run_with_timeout_5(comfy, home, "poll", record_property, "drip_timeout5_s")
    assert err["_event"] == "execution_error" and "timeout=5 s" in err["exception_message"]
    assert elapsed < 8.0
    next_prompt_matches_the_core_client(comfy, home)

    home.clear()
    home.scripts.append(Script(drip="poll"))
    prompt_id = comfy.queue(graph(timeout=120))
    deadline = time.monotonic() + 60
    while not any(m == "GET" for m, _ in home.calls()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # in the middle of the dripping answer
    start = time.monotonic()
    comfy.interrupt()
    entry = comfy.wait(prompt_id, timeout=60)
    elapsed = time.monotonic() - start
    record_property("cancel_during_drip_s", round(elapsed, 2))
    print(f"Cancel during a drip: the prompt ended {elapsed:.2f} s after the interrupt")
    assert execution_error(entry)["_event"] == "execution_interrupted"
    assert elapsed < 2.0
    assert any(m == "DELETE" for m, _ in home.calls())
    next_prompt_matches_the_core_client(comfy, home)


@pytest.mark.parametrize("size, what", [((1920, 1080, 40), "1920x1080"), ((96, 64, 12000), "12,000 frames")])
def test_small_but_huge_mp4s_are_refused_without_the_ram(servers, size, what, record_property):
    comfy, home, _ = servers
    data = small_but_huge_mp4(*size)
    next_prompt_matches_the_core_client(comfy, home)  # warm: codecs and buffers of a good job are in place
    pid = comfy.proc.pid
    home.scripts.append(Script(content=data))
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = kib("VmRSS", pid)
    err = execution_error(comfy.run(graph(), timeout=120, check=False))
    rise = kib("VmHWM", pid) - before
    record_property("peak_rss_rise_mib", round(rise / MIB, 1))
    print(f"\n{len(data):,}-byte mp4 of {size[0]}x{size[1]} x {size[2]} frames: refused, peak RSS rise {rise / MIB:.1f} MiB")
    assert what in err["exception_message"] and "5 frames of 96x64 were asked for" in err["exception_message"]
    assert rise < 100 * MIB
    next_prompt_matches_the_core_client(comfy, home)


# -- round two (issue 30, issue 28's remote rows, issue 33) --------------------------------------

def _peak_rise(comfy, run):
    """(what ``run()`` returned, the ComfyUI process's peak RSS rise in bytes during it)."""
    pid = comfy.proc.pid
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = kib("VmRSS", pid)
    out = run()
    return out, kib("VmHWM", pid) - before


def _png_8192() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((8192, 8192), dtype=np.uint16)).save(buf, format="PNG")
    return buf.getvalue()


ANSWERS = {  # what a server sends as video/mp4, the request's size, what the error must say
    # ComfyUI's own input/example.png (768x768), named relative to ComfyUI's working directory.
    "an ffconcat list of a local file": (b"ffconcat version 1.0\nfile 'input/example.png'\n" * 5,
                                         dict(width=768, height=768), "not an mp4 file"),
    "a flat 16-bit 8192x8192 PNG": (None, {}, "not an mp4 file"),
}


@pytest.mark.parametrize("case", list(ANSWERS))
def test_only_an_mp4_is_opened_and_before_anything_is_decoded(servers, case, record_property):
    comfy, home, _ = servers
    data, size, message = ANSWERS[case]
    data = _png_8192() if data is None else data
    next_prompt_matches_the_core_client(comfy, home)  # warm
    home.clear()
    home.scripts.append(Script(content=data))
    start = time.monotonic()
    entry, rise = _peak_rise(comfy, lambda: comfy.run(graph(**size), timeout=120, check=False))
    elapsed = time.monotonic() - start
    record_property("peak_rss_rise_mib", round(rise / MIB, 1))
    print(f"\n{case} ({len(data):,} bytes): refused in {elapsed:.2f} s, peak RSS rise {rise / MIB:.1f} MiB")
    err = execution_error(entry)
    assert err is not None and message in err["exception_message"], err
    assert "refused before decoding" in err["exception_message"]
    assert comfy.output_files(entry) == []  # no pixels of any file came back
    assert rise < 100 * MIB
    assert any(m == "DELETE" for m, _ in home.calls())  # a refused answer: the job is deleted
    next_prompt_matches_the_core_client(comfy, home)


def test_a_key_the_server_echoes_is_in_no_message_history_or_log(servers, record_property):
    comfy, home, _ = servers
    home.scripts.append(Script(submit_status=401, error_message="invalid credentials: {auth}"))
    start = time.monotonic()
    entry = comfy.run(graph(), timeout=120, check=False)
    print(f"\n401 echoing the key: refused in {time.monotonic() - start:.2f} s")
    err = execution_error(entry)
    assert "HTTP 401" in err["exception_message"] and "invalid credentials: Bearer ***" in err["exception_message"]
    assert SECRET in json.dumps(home.requests)  # it was sent, and echoed
    history = json.dumps(comfy.get("/history"))
    log = comfy.log_path.read_text(encoding="utf-8", errors="replace")
    assert SECRET not in history and SECRET not in log and SECRET not in json.dumps(entry)
    next_prompt_matches_the_core_client(comfy, home)


def test_nested_job_fields_and_hostile_job_ids_reach_no_history_or_log(servers, record_property):
    """Issue 51, findings 3 and 4: a final job with the key nested in a list and a 2 MiB field; job ids that
    are not short safe strings (a line feed that forged an ERROR line, 1 MiB, a list)."""
    comfy, home, _ = servers
    log_before = comfy.log_path.stat().st_size
    home.scripts.append(Script(final_fields={"model": [f"Bearer {SECRET}", {"k": SECRET.upper()}], "huge": "y" * (2 << 20)}))
    prompt = graph()
    prompt["4"] = {"class_type": "PreviewAny", "inputs": {"source": ["2", 2]}}  # the report, shown in the UI
    entry = comfy.run(prompt, timeout=120)
    report = json.dumps(entry["outputs"]["4"])
    record_property("nested_job_report_chars", len(report))
    print(f"\nreport of a job with a 2 MiB field and the key nested: {len(report):,} characters in /history")
    assert len(report) < 2_000 and SECRET not in report and SECRET.upper() not in report, report[:300]
    for bad, what in (("video_1\nERROR forged by the server", "line feed"), ("v" * (1 << 20), "1 MiB"), (["v"], "list")):
        home.scripts.append(Script(job_id=bad))
        err = execution_error(comfy.run(graph(), timeout=120, check=False))["exception_message"]
        assert "field 'id'" in err and len(err) < 600 and "\n" not in err.rstrip(), (what, err[:200])
    history = json.dumps(comfy.get("/history"))
    with open(comfy.log_path, "rb") as f:
        f.seek(log_before)
        log = f.read().decode("utf-8", "replace")
    assert SECRET not in history and SECRET.upper() not in history and SECRET not in log and SECRET.upper() not in log
    assert not any(line.startswith("ERROR forged") for line in log.splitlines())
    assert len(log) < 200_000, len(log)  # was 12.6 MB of log for one 1 MiB id
    record_property("log_bytes_for_four_hostile_jobs", len(log))
    next_prompt_matches_the_core_client(comfy, home)


def test_a_stalled_download_ends_at_the_timeout_and_deletes_the_job(servers, record_property):
    comfy, home, _ = servers
    err, elapsed = run_with_timeout_5(comfy, home, "content", record_property, "stalled_download_timeout5_s")
    assert "timeout=5 s" in err["exception_message"] and "The job was deleted on the server" in err["exception_message"]
    assert any(m == "DELETE" for m, _ in home.calls())
    assert elapsed < 9.0
    next_prompt_matches_the_core_client(comfy, home)


def test_a_listed_name_with_a_trailing_space_is_refused(servers):
    comfy, home, _ = servers
    msg = refused(comfy, graph("home "))
    assert "not a video server in" in msg and "home" in msg
    assert home.requests == []


@pytest.fixture
def server_list(servers):
    """A writer for the server list that moves its mtime one second on per write (whatever the
    filesystem's clock grain); the original list is restored afterwards."""
    import os

    path = _LIST_FILE[0]
    original = path.read_bytes()
    mtime = [path.stat().st_mtime]

    def write(data: bytes):
        path.write_bytes(data)
        mtime[0] += 1
        os.utime(path, (mtime[0], mtime[0]))

    yield original, write
    write(original)


def test_an_edited_list_of_the_same_size_is_read_again(servers, server_list):
    """IS_CHANGED follows the file's mtime: the same prompt after an edit that keeps the size goes to the
    server the list now names, instead of ComfyUI's cached answer."""
    comfy, home, attacker = servers
    original, write = server_list
    if len(home.url) != len(attacker.url):
        pytest.skip("the two test servers' ports differ in length")
    prompt = graph(seed=next(_seeds))
    home.scripts.append(Script(lossless=True))
    comfy.run(prompt, timeout=120)
    assert len(home.posts()) == 1 and attacker.posts() == []
    edited = original.replace(home.url.encode(), attacker.url.encode())
    assert len(edited) == len(original) and edited != original
    write(edited)
    comfy.run(prompt, timeout=120)  # the very same prompt
    assert len(attacker.posts()) == 1 and len(home.posts()) == 1


def test_a_key_pasted_into_api_key_env_is_refused_without_echo(servers, server_list):
    comfy, home, _ = servers
    original, write = server_list
    pasted = "hf_" + uuid.uuid4().hex[:16] + "AbCdEfGhIjKlMnOpQr"
    listed = json.loads(original)
    listed["servers"][0]["api_key_env"] = pasted
    write(json.dumps(listed).encode())
    msg = refused(comfy, graph())
    assert "looks like a key, not the name of an environment variable" in msg
    assert pasted not in msg and pasted not in comfy.log_path.read_text(encoding="utf-8", errors="replace")
    assert home.requests == []


OLD_API = {  # API-format workflows saved before the server list: api_key_env where server is now
    "LingbotRemoteServer": ({"base_url": "https://gpu-box:8091", "model": MODEL, "api_key_env": "MY_KEY",
                             "timeout": 60, "poll_seconds": 0.1}, "LingBot-Video Remote Server", "video"),
    "LingbotRewriterServer": ({"base_url": "https://gpu-box:8000/v1", "expand_model": "m", "map_model": "m",
                               "system_prompts": "x", "api_key_env": "MY_KEY", "timeout": 30,
                               "disable_thinking": True}, "LingBot-Video Rewriter Server", "chat"),
}


@pytest.mark.parametrize("node", list(OLD_API))
def test_an_api_workflow_without_a_server_input_is_told_which_entry_to_add(servers, node):
    comfy, home, _ = servers
    inputs, title, kind = OLD_API[node]
    msg = refused(comfy, {"1": {"class_type": node, "inputs": inputs},
                          "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}})
    assert "Required input is missing" not in msg, msg
    assert f"its {title} node has no server input" in msg and "servers.json" in msg, msg
    assert f'\\"kind\\": \\"{kind}\\", \\"base_url\\": \\"{inputs["base_url"]}\\"' in msg, msg
    assert home.requests == []
