"""The two-step prompt rewriter against a real local chat-completions server (tests/support/chat_server.py).

Expected message texts are written out here from prompt-rewriter.md, not taken from the code.
"""

from __future__ import annotations

import base64
import io
import json
import socket

import numpy as np
import pytest
from PIL import Image

from support.chat_server import Reply
from lingbot_core.net import chat_client
from lingbot_core.net.chat_client import ChatServer, ChatServerError
from lingbot_core.prompts.rewriter import RewriteError, load_system_prompts, rewrite
from lingbot_core.prompts.text_conditioning import parse_prompt

EXPAND, MAP = "base-vlm", "base-vlm-rewriter-lora"
SYS = {
    "VIDEO_STEP1_EXPAND": "You expand video prompts.",
    "VIDEO_STEP2_MAP": "You map a video caption to JSON.",
    "IMAGE_STEP1_EXPAND": "You expand image prompts.",
    "IMAGE_STEP2_MAP": "You map an image caption to JSON.",
}
# The release's module layout: constants among code that must never run (ast only).
PROMPT_MODULE = '''"""Rewriter prompts."""
import os
raise SystemExit("this file was executed")
VIDEO_STEP1_EXPAND = "You expand video prompts."
VIDEO_STEP2_MAP = ("You map a video caption "
                   "to JSON.")
IMAGE_STEP1_EXPAND: str = """You expand image prompts."""
IMAGE_STEP2_MAP = 'You map an image caption to JSON.'
OTHER = "not a rewriter prompt"
NUMBER = 3
'''
DETAILED = "  A red kite climbs over green hills; at 3 s it dips, then rises again.  \n"
CAPTION = {"comprehensive_description": {"scene_content_description": "A red kite over hills.",
                                         "camera_movement_description": "Static."},
           "prominent_elements": [{"name": "kite", "actions": [{"timestamp": "[0.0s - 3.0s]", "action": "climbs"}]}]}
# A fenced answer with a trailing comma and a missing closing brace: json_repair's job.
BROKEN_ANSWER = "Here it is:\n```json\n" + json.dumps(CAPTION)[:-1] + ',\n```\n'


@pytest.fixture
def server(chat_server):
    chat_client.clear_cache()
    chat_server.clear()
    chat_server.replies.clear()
    chat_server.replies.update({EXPAND: DETAILED, MAP: BROKEN_ANSWER})
    return chat_server


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewriter") / "prompts.py"
    path.write_text(PROMPT_MODULE, encoding="utf-8")
    return path


def _run(server, prompt_file, prompt="a red kite over hills", **kw):
    kw.setdefault("mode", "t2v")
    return rewrite(ChatServer(server.url, timeout=kw.pop("timeout", 10)), load_system_prompts(prompt_file), prompt,
                   expand_model=EXPAND, map_model=MAP, **kw)


def _texts(body):
    return [p["text"] for p in body["messages"][0]["content"] if p["type"] == "text"]


def _images(body):
    return [p["image_url"]["url"] for p in body["messages"][0]["content"] if p["type"] == "image_url"]


def test_prompt_module_is_read_as_data(prompt_file):
    assert load_system_prompts(prompt_file) == SYS  # raise SystemExit never ran; OTHER/NUMBER ignored


def test_t2v_two_requests_exact_texts_and_repaired_json(server, prompt_file):
    result = _run(server, prompt_file, duration=4.6, seed=7)
    bodies = server.bodies()
    assert [b["model"] for b in bodies] == [EXPAND, MAP]
    assert [r["path"] for r in server.requests] == ["/v1/chat/completions"] * 2
    for b in bodies:
        assert len(b["messages"]) == 1 and b["messages"][0]["role"] == "user"
        assert b["temperature"] == 0 and b["seed"] == 7 and b["max_tokens"] == 6144
        assert b["chat_template_kwargs"] == {"enable_thinking": False}
        assert _images(b) == []
    assert _texts(bodies[0]) == ["You expand video prompts.\n\na red kite over hills\n\nVideo Duration: 5 seconds"]
    assert _texts(bodies[1]) == [
        "You map a video caption to JSON.\n\nVideo Duration: 5 seconds\n\nDETAILED CAPTION:\n"
        "A red kite climbs over green hills; at 3 s it dips, then rises again.\n\nOutput the JSON now."]
    assert result.caption == CAPTION and result.duration == 5
    assert result.detailed_caption == DETAILED.strip()
    # The prompt output is what LoadLingbotPrompt gives for the saved prompt.json.
    assert result.prompt_json == json.dumps({"caption": CAPTION, "duration": 5}, separators=(",", ":"))
    parsed = parse_prompt(result.prompt_json)
    assert parsed.text == json.dumps(CAPTION, separators=(",", ":")) and parsed.duration == 5.0
    assert result.num_frames(24) == 121 and result.warnings == ()


def test_cjk_prompt_gets_the_chinese_duration_line(server, prompt_file):
    _run(server, prompt_file, prompt="一只红色的风筝", duration=3.2)
    first, second = server.bodies()
    assert _texts(first) == ["You expand video prompts.\n\n一只红色的风筝\n\n视频时长：3 秒"]
    assert _texts(second)[0].startswith("You map a video caption to JSON.\n\nVideo Duration: 3 seconds\n\n")


def test_ti2v_sends_the_image_first_in_both_steps(server, prompt_file):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)
    _run(server, prompt_file, mode="ti2v", image=Image.fromarray(pixels, "RGB"), duration=2)
    bodies = server.bodies()
    assert len(bodies) == 2
    for b in bodies:
        content = b["messages"][0]["content"]
        assert [p["type"] for p in content] == ["image_url", "text"]
        url = content[0]["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        sent = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
        assert np.array_equal(sent, pixels)
    assert _texts(bodies[0])[0].endswith("\n\nVideo Duration: 2 seconds")


def test_t2i_uses_the_image_prompts_and_no_duration(server, prompt_file):
    result = _run(server, prompt_file, mode="t2i", prompt="a kite")
    first, second = server.bodies()
    assert _texts(first) == ["You expand image prompts.\n\nUser image prompt:\na kite"]
    assert _texts(second) == ["You map an image caption to JSON.\n\nDETAILED CAPTION:\n" + DETAILED.strip()]
    assert result.duration is None and result.num_frames(24) == 1
    assert json.loads(result.prompt_json) == {"caption": CAPTION, "duration": None}


def test_folder_of_text_files(server, tmp_path):
    for name, text in SYS.items():
        (tmp_path / f"{name}.txt").write_text(text, encoding="utf-8")
    (tmp_path / "notes.txt").write_text("ignored", encoding="utf-8")
    assert load_system_prompts(tmp_path) == SYS
    _run(server, tmp_path)
    assert _texts(server.bodies()[0])[0].startswith("You expand video prompts.\n\n")


def test_missing_or_incomplete_prompt_files(server, tmp_path):
    with pytest.raises(FileNotFoundError, match="rewriter prompt file .*missing.py does not exist"):
        load_system_prompts(tmp_path / "missing.py")
    (tmp_path / "empty.py").write_text("X = 'y'\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds none of the rewriter's system prompts"):
        load_system_prompts(tmp_path / "empty.py")
    (tmp_path / "video.py").write_text("VIDEO_STEP1_EXPAND = 'a'\nVIDEO_STEP2_MAP = 'b'\n", encoding="utf-8")
    with pytest.raises(RewriteError, match="no IMAGE_STEP1_EXPAND"):
        _run(server, tmp_path / "video.py", mode="t2i")
    assert server.requests == []


def test_http_500_reports_status_and_first_300_characters(server, prompt_file):
    body = "E" * 300 + "TAIL-NOT-SHOWN"
    server.replies[EXPAND] = Reply(status=500, raw=body.encode())
    with pytest.raises(ChatServerError) as err:
        _run(server, prompt_file)
    msg = str(err.value)
    assert f"{server.url}/chat/completions answered HTTP 500" in msg and "E" * 300 in msg
    assert "TAIL" not in msg and len(server.requests) == 1


@pytest.mark.parametrize("answer", [
    "Here is {the} caption:\n```json\n" + json.dumps(CAPTION) + "\n```",  # braces outside the fence
    "```\n" + json.dumps(CAPTION)[:-2] + "\n```\nI kept {the order}.",  # cut short inside the fence
])
def test_fenced_and_broken_answers(server, prompt_file, answer):
    server.replies[MAP] = answer
    assert _run(server, prompt_file).caption == CAPTION


def test_a_reasoning_block_is_not_part_of_the_detailed_caption(server, prompt_file):
    server.replies[EXPAND] = "<think>\nThe user wants a kite.\n</think>\n\n" + DETAILED
    result = _run(server, prompt_file)
    assert result.detailed_caption == DETAILED.strip()
    assert "think" not in _texts(server.bodies()[1])[0]


def test_answer_that_is_not_an_object_shows_its_start(server, prompt_file):
    server.replies[MAP] = "Sorry, I cannot help with that. " + "x" * 400
    with pytest.raises(RewriteError, match=r"not a JSON object.*Sorry, I cannot help with that\. x+'$") as err:
        _run(server, prompt_file)
    assert "x" * 268 in str(err.value) and "x" * 269 not in str(err.value)


def test_timeout(server, prompt_file):
    server.replies[EXPAND] = Reply(content="late", delay=1.5)
    with pytest.raises(ChatServerError, match=r"did not answer within 0\.3 s"):
        _run(server, prompt_file, timeout=0.3)


def test_unreachable_port(prompt_file):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(ChatServerError, match=f"cannot reach the chat server at {url}/chat/completions"):
        rewrite(ChatServer(url, timeout=5), load_system_prompts(prompt_file), "a kite", mode="t2v",
                expand_model=EXPAND, map_model=MAP)


def test_cached_rewrite_sends_no_request(server, prompt_file):
    first = _run(server, prompt_file, seed=1)
    assert len(server.requests) == 2
    again = _run(server, prompt_file, seed=1)
    assert len(server.requests) == 2 and again.prompt_json == first.prompt_json
    _run(server, prompt_file, seed=2)  # another input, another answer
    assert len(server.requests) == 4


def test_switching_server_url_asks_the_new_server(server, prompt_file):
    """The answer cache is keyed by the server too: after base_url changes, the old server's cached
    answer must not come back (a second real server answers differently)."""
    from support.chat_server import ChatCompletionsServer

    other = ChatCompletionsServer().start()
    try:
        other_caption = {"comprehensive_description": {"scene_content_description": "A blue boat at sea."}}
        other.replies.update({EXPAND: "A blue boat on a calm sea.", MAP: json.dumps(other_caption)})
        first = _run(server, prompt_file, seed=1)
        switched = rewrite(ChatServer(other.url, timeout=10), load_system_prompts(prompt_file), "a red kite over hills",
                           mode="t2v", expand_model=EXPAND, map_model=MAP, seed=1)
        assert len(other.requests) == 2  # both steps went to the new server
        assert json.loads(switched.prompt_json)["caption"] == other_caption
        assert json.loads(first.prompt_json)["caption"] == CAPTION
    finally:
        other.stop()


def test_api_key_is_sent_as_a_bearer_header(server, prompt_file):
    rewrite(ChatServer(server.url, api_key="sk-test-123"), load_system_prompts(prompt_file), "a kite",
            mode="t2v", expand_model=EXPAND, map_model=MAP)
    assert [r["headers"].get("Authorization") for r in server.requests] == ["Bearer sk-test-123"] * 2
    assert "sk-test-123" not in repr(ChatServer(server.url, api_key="sk-test-123"))


@pytest.mark.parametrize("kw, match", [
    (dict(mode="ti2v"), "ti2v needs the first-frame image"),
    (dict(duration=0.4), "rounds to 0 s"),
    (dict(duration=True), "duration=True is not allowed"),
    (dict(mode="t2x"), "mode='t2x' is not allowed"),
    (dict(prompt="   "), "prompt is empty"),
])
def test_bad_inputs_send_nothing(server, prompt_file, kw, match):
    with pytest.raises(ValueError, match=match):
        _run(server, prompt_file, **kw)
    assert server.requests == []


def test_caption_timestamps_past_the_duration_warn(server, prompt_file):
    result = _run(server, prompt_file, duration=2)
    assert result.warnings == ("prominent_elements[0] 'kite': action timestamp '[0.0s - 3.0s]' ends at 3 s, after "
                               "the duration 2 s; set \"duration\" to at least 3 or shorten the action.",)


def test_cli_rewrite_writes_prompt_json(server, prompt_file, tmp_path, capsys):
    from lingbot_core.cli import main

    out = tmp_path / "prompt.json"
    image = tmp_path / "first.png"
    Image.new("RGB", (16, 8), (200, 30, 30)).save(image)
    argv = ["rewrite", "--prompt", "a red kite", "--mode", "ti2v", "--image", str(image), "--duration", "3",
            "--system_prompts", str(prompt_file), "--base_url", server.url, "--expand_model", EXPAND,
            "--map_model", MAP, "--output", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text(encoding="utf-8")) == {"caption": CAPTION, "duration": 3}
    assert [len(_images(b)) for b in server.bodies()] == [1, 1]
    # Generate reads it back through the same parser as LoadLingbotPrompt.
    parsed = parse_prompt(out.read_text(encoding="utf-8"))
    assert parsed.duration == 3.0 and parsed.text == json.dumps(CAPTION, separators=(",", ":"))
    capsys.readouterr()
    bad = argv[:argv.index("--base_url") + 1] + ["http://127.0.0.1:9/v1"] + argv[argv.index("--base_url") + 2:]
    assert main(bad[:1] + ["--prompt", "another kite"] + bad[3:]) == 2
    assert "cannot reach the chat server at http://127.0.0.1:9/v1/chat/completions" in capsys.readouterr().err


@pytest.mark.parametrize("prompt", ["3D动画：一只红色的风筝", "“风筝”在山上飞", "2 只风筝在山上飞"])
def test_chinese_prompt_not_starting_with_a_cjk_character_gets_the_chinese_duration_line(server, prompt_file, prompt):
    _run(server, prompt_file, prompt=prompt, duration=3)
    first, _ = server.bodies()
    assert _texts(first) == [f"You expand video prompts.\n\n{prompt}\n\n视频时长：3 秒"]


@pytest.mark.parametrize("name", ["VIDEO_STEP1_EXPAND.txt", "prompts.py"])
def test_huge_prompt_file_is_refused_before_it_is_read(tmp_path, name):
    # 16 MiB (sparse: no disk, no memory unless read) that would otherwise load as a valid prompt.
    path = tmp_path / name
    path.write_text("VIDEO_STEP1_EXPAND = 'a'\n" if name.endswith(".py") else "You expand video prompts.\n",
                    encoding="utf-8")
    with open(path, "r+b") as f:
        f.truncate(16 << 20)
    for where in (path, tmp_path):
        with pytest.raises(ValueError, match=r"prompts?\.py|VIDEO_STEP1_EXPAND\.txt") as e:
            load_system_prompts(where)
        assert "is 16,777,216 bytes; a rewriter prompt file is at most 4 MiB" in str(e.value)
