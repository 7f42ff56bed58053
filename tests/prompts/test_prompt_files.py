"""Prompt files as artists save them: BOMs, UTF-16, odd durations, and the caption checks."""

from __future__ import annotations

import json
import re

import pytest

from lingbot_core.prompts.caption_checks import caption_warnings
from lingbot_core.prompts.text_conditioning import (
    frames_for_prompt, negative_from_widget, parse_prompt, read_prompt_file,
)

FILE = {"caption": {"scene": "a kite", "prominent_elements": [
    {"name": "kite", "actions": [{"timestamp": "[0.0s - 2.0s]", "action": "rises"}]}]}, "duration": 2}


def test_utf8_bom_loads(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(FILE).encode("utf-8"))
    text = read_prompt_file(path)
    assert text == json.dumps(FILE)  # the BOM is not part of the text
    parsed = parse_prompt(text)
    assert parsed.structured and parsed.duration == 2.0
    assert parsed.text == json.dumps(FILE["caption"], separators=(",", ":"))
    assert parse_prompt("\ufeff" + json.dumps(FILE)).text == parsed.text  # pasted with the BOM


WIDE = {"caption": {"scene": "\u98ce\u7b5d\u5728\u6d77\u8fb9\u5347\u8d77 \U0001f98a",
                    "prominent_elements": []}, "duration": 2}


@pytest.mark.parametrize("mark, codec", [(b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be"),
                                         (b"\xef\xbb\xbf", "utf-8"), (b"", "utf-8")])
def test_utf8_and_utf16_with_a_mark_read_as_the_same_prompt(tmp_path, mark, codec):
    # Notepad's "Unicode" and PowerShell 5's ">" write UTF-16 LE with a mark and CRLF line ends.
    expected = json.dumps(WIDE, ensure_ascii=False, indent=2)
    path = tmp_path / "wide.json"
    path.write_bytes(mark + expected.replace("\n", "\r\n").encode(codec))
    text = read_prompt_file(path)
    assert text == expected  # the mark dropped, CRLF read as LF (Python's text mode)
    assert parse_prompt(text).text == json.dumps(WIDE["caption"], ensure_ascii=False, separators=(",", ":"))


def test_plain_text_line_ends_are_read_as_lf(tmp_path):
    path = tmp_path / "plain.txt"
    path.write_bytes(b"\xff\xfe" + "a kite\r\nover the sea\rat dusk\n".encode("utf-16-le"))
    assert read_prompt_file(path) == "a kite\nover the sea\nat dusk\n"


@pytest.mark.parametrize("data, message", [
    ("x".encode("utf-32"), r"u32\.json is saved as UTF-32 LE, which is not read; save it as UTF-8"),
    (b"\x00\x00\xfe\xff" + "x".encode("utf-32-be"), r"u32\.json is saved as UTF-32 BE, which is not read"),
    (json.dumps(FILE).encode("utf-16-le"), r"u32\.json looks like UTF-16 without a byte order mark"),
    (b"\xff\xfe" + "ab".encode("utf-16-le") + b"\x00", r"u32\.json begins with a UTF-16 LE byte order mark but is "
                                                      r"not valid UTF-16 LE \(at byte 6\)"),
    (b"\xfe\xff\xdc\x00\x00a", r"not valid UTF-16 BE \(at byte 2\)"),  # a lone low surrogate
])
def test_unreadable_encodings_are_named(tmp_path, data, message):
    path = tmp_path / "u32.json"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        read_prompt_file(path)


def test_other_encodings_name_the_file(tmp_path):
    path = tmp_path / "latin.json"
    path.write_bytes('{"caption": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.json is not UTF-8 text \(byte 16 is 0xe9; it may be in a legacy "
                                         r"code page such as Windows-1252 or GBK\); save it as UTF-8"):
        read_prompt_file(path)


@pytest.mark.parametrize("value", ["true", "false", '"5"', "[5]", "{}"])
def test_non_number_durations_are_refused(value):
    with pytest.raises(ValueError, match=r"duration must be a number of seconds \(or null\), got " + re.escape(value)):
        parse_prompt('{"caption": {"a": 1}, "duration": %s}' % value)


@pytest.mark.parametrize("text", ["   ", "\n\t ", ""])
def test_whitespace_negative_is_the_default(text):
    assert negative_from_widget(text) is None
    assert negative_from_widget(" blurry ") == " blurry "


def test_caption_duration_rule():
    with_duration = parse_prompt(json.dumps(FILE))
    assert frames_for_prompt(with_duration, 121, 24) == 49  # 2 s at 24 fps overrides 121
    assert frames_for_prompt(with_duration, 121, 24, use_caption_duration=False) == 121
    assert frames_for_prompt(parse_prompt("a kite"), 9, 24) == 9
    null = parse_prompt('{"caption": {"a": 1}, "duration": null}')
    with pytest.raises(ValueError, match=r"num_frames is 0 and the prompt has no duration.*\"duration\": null"):
        frames_for_prompt(null, 0, 24)
    with pytest.raises(ValueError, match="num_frames is 0 and use_caption_duration is off"):
        frames_for_prompt(with_duration, 0, 24, use_caption_duration=False)


def test_timestamps_past_the_duration_or_malformed_warn():
    caption = {"prominent_elements": [
        {"name": "kite", "actions": [{"timestamp": "[0.0s - 2.0s]"}, {"timestamp": "[2.0s - 5.5s]"}]},
        {"name": "dog", "actions": [{"timestamp": "soon"}, {"timestamp": "[3s-1s]"}, {"action": "no stamp"}]},
        {"actions": [{"timestamp": "[4.0 - 5.0]"}]},
    ]}
    assert caption_warnings(caption, 5.0) == [
        "prominent_elements[0] 'kite': action timestamp '[2.0s - 5.5s]' ends at 5.5 s, after the duration 5 s; "
        "set \"duration\" to at least 6 or shorten the action.",
        "prominent_elements[1] 'dog': action timestamp 'soon' is malformed; write it as \"[start s - end s]\" with "
        "start < end, e.g. \"[0.0s - 2.5s]\".",
        "prominent_elements[1] 'dog': action timestamp '[3s-1s]' is malformed; write it as \"[start s - end s]\" "
        "with start < end, e.g. \"[0.0s - 2.5s]\".",
        "prominent_elements[1] 'dog': action timestamp None is malformed; write it as \"[start s - end s]\" with "
        "start < end, e.g. \"[0.0s - 2.5s]\".",
    ]
    assert len(caption_warnings(caption, None)) == 3  # no duration: only the malformed ones
    assert caption_warnings(caption, 6.0)[0].startswith("prominent_elements[1] 'dog'")
    # parse_prompt (LoadLingbotPrompt, GenerateVideo) carries the same warnings
    assert parse_prompt(json.dumps({"caption": caption, "duration": 5})).warnings == tuple(caption_warnings(caption, 5.0))


# -- files a stranger names (issue 51): one reader, one path rule (lingbot_core.files.named_files) ----------

@pytest.mark.parametrize("codec, named", [("utf-16-le", "UTF-16 LE"), ("utf-16-be", "UTF-16 BE")])
def test_utf16_without_a_mark_is_named_even_when_it_is_not_ascii(tmp_path, codec, named):
    path = tmp_path / "wide.json"
    path.write_bytes(json.dumps(WIDE, ensure_ascii=False).encode(codec))  # CJK: not decodable as UTF-8
    with pytest.raises(ValueError, match=rf"wide\.json looks like UTF-16 without a byte order mark \({named}: "
                                         r"every other byte is NUL\); save it as UTF-8"):
        read_prompt_file(path)


def test_a_prompt_file_larger_than_the_bound_is_refused_before_it_is_read(tmp_path):
    """A 200 MB caption (sparse here) is refused from fstat's size: the bytes read stay 0 (peak +800 MiB on main)."""
    import tracemalloc

    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(200_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"huge\.json is 200,000,000 bytes; a prompt file is at most 4 MiB"):
            read_prompt_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("kind", ["folder", "fifo", "/dev/zero"])
def test_only_a_regular_file_is_read(tmp_path, kind):
    import os

    if kind == "folder":
        path, named = tmp_path, "a folder"
    elif kind == "fifo":
        path, named = tmp_path / "pipe.json", r"a FIFO \(named pipe\)"
        os.mkfifo(path)  # nobody writes: a plain open would block for ever
    else:
        path, named = "/dev/zero", "a character device"
    with pytest.raises(ValueError, match=rf"is {named}, not a prompt file; only a regular file is read"):
        read_prompt_file(path)


def test_the_rewriters_prompt_files_share_the_reader(tmp_path):
    from lingbot_core.prompts.rewriter import load_system_prompts

    path = tmp_path / "VIDEO_STEP1_EXPAND.txt"
    with open(path, "wb") as f:
        f.truncate(5 << 20)
    with pytest.raises(ValueError, match=r"is 5,242,880 bytes; a rewriter prompt file is at most 4 MiB"):
        load_system_prompts(tmp_path)


@pytest.mark.parametrize("name", ["../secret.json", "/etc/passwd", "a/../../secret.json", "link.json", "dirlink/x.json"])
def test_a_name_must_stay_inside_its_folder_links_resolved(tmp_path, name):
    from lingbot_core.files.named_files import inside

    root, outside = tmp_path / "input", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (outside / "x.json").write_text("{}")
    (root / "link.json").symlink_to(outside / "x.json")
    (root / "dirlink").symlink_to(outside)
    with pytest.raises(ValueError, match=re.escape(f"prompt_file {name!r} ")):
        inside(root, name, what="prompt_file")
    (root / "sub").mkdir()
    (root / "sub" / "ok.json").write_text("{}")
    (root / "inner.json").symlink_to(root / "sub" / "ok.json")  # a link that stays inside is fine
    assert inside(root, "inner.json") == (root / "sub" / "ok.json").resolve()
