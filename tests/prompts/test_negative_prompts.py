"""Delete-only negative-prompt editing and the auto negative (against the local chat server)."""

from __future__ import annotations

import hashlib
import json

import pytest

from lingbot_core.net import chat_client
from lingbot_core.net.chat_client import ChatServer
from lingbot_core.prompts.negative_prompts import auto_negative, edit_negative, serialize_negative
from lingbot_core.prompts.text_conditioning import resolve_negative

# Pinned in lingbot-video-model.md §6.7 (independent of the code's constants).
VIDEO_SHA = "43704d85b3951aed0e1d31d2679c3ced979fc11b3c16658bd21286d086b8ea69"
IMAGE_SHA = "7e277788a8bb3d2fb0a2a4109316c544345fefff1c22868861c90741b0c47e7b"
NEG_SYS = "Delete the negative terms that contradict the caption."
MODEL = "base-vlm"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.mark.parametrize("mode, num_frames, sha", [("video", 5, VIDEO_SHA), ("image", 1, IMAGE_SHA)])
def test_nothing_removed_is_the_default_byte_for_byte(mode, num_frames, sha):
    text = serialize_negative(edit_negative(mode))
    assert _sha(text) == sha
    assert _sha(resolve_negative(text, num_frames)) == sha  # what the DiT encodes


def test_categories_off_and_terms_removed():
    text = serialize_negative(edit_negative("image", ["visual_quality", "material_and_structure"], "Cartoon,\n 3d render , text"))
    assert text == ('{"universal_negative": {"artistic_style": ["painting", "illustration", "drawing", "cgi", "sketch", '
                    '"digital art"], "composition_and_content": ["watermark", "signature", "logo", "pillarboxed", '
                    '"side bars", "portrait image in landscape frame"]}}')
    assert resolve_negative(text, 1) == text  # an edited default keeps the default's serialisation


def test_other_json_negatives_are_still_compacted():
    added = '{"universal_negative": {"artistic_style": ["painting", "watercolour"]}}'
    assert resolve_negative(added, 5) == '{"universal_negative":{"artistic_style":["painting","watercolour"]}}'


@pytest.mark.parametrize("args, match", [
    (("video", [], "blury"), r"remove_terms: 'blury' not in the default video negative"),
    (("image", [], "flickering"), r"'flickering' not in the default image negative"),
    (("image", ["temporal_and_motion_stability"], ""), "no category 'temporal_and_motion_stability'"),
    (("sound", [], ""), "mode='sound' is not allowed"),
])
def test_bad_edits_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        edit_negative(*args)


@pytest.fixture
def server(chat_server):
    chat_client.clear_cache()
    chat_server.clear()
    chat_server.replies.clear()
    return chat_server


def _auto(server, answer, caption, mode="video", base=None):
    server.replies[MODEL] = answer
    return auto_negative(ChatServer(server.url, timeout=10), NEG_SYS, MODEL, caption, mode, base=base)


def test_auto_is_delete_only(server):
    answer = "```json\n" + json.dumps({"universal_negative": {
        # reordered, one added term, one reworded ("Blurry"), two deleted
        "visual_quality": ["worst quality", "low quality", "Blurry", "ugly hands", "pixelated", "jpeg artifacts",
                           "low resolution", "unstable color", "color flicker", "underexposed", "overexposed",
                           "invisible subject"],
        "artistic_style": ["painting", "illustration", "drawing", "3d render", "cgi", "sketch", "digital art"],
        "composition_and_content": [],  # deleted whole: allowed, no guard
        # temporal_and_motion_stability missing: kept whole
        "material_and_structure": ["plastic-like glass"],
        "invented_category": ["anything"]}}) + "\n```"
    caption = '{"scene": "a person walks on a beach at noon"}'
    out = _auto(server, answer, caption)
    default = edit_negative("video")
    assert out == {
        "visual_quality": ["low quality", "worst quality", "pixelated", "jpeg artifacts", "low resolution",
                           "unstable color", "color flicker", "underexposed", "overexposed", "invisible subject"],
        "artistic_style": ["painting", "illustration", "drawing", "3d render", "cgi", "sketch", "digital art"],
        "composition_and_content": [],
        "temporal_and_motion_stability": default["temporal_and_motion_stability"],
        "material_and_structure": ["plastic-like glass"],
    }
    (body,) = server.bodies()
    text = body["messages"][0]["content"][-1]["text"]
    assert text.startswith(NEG_SYS + "\n\n") and caption in text and body["model"] == MODEL
    assert body["temperature"] == 0


def test_whole_style_category_needs_a_hint(server):
    drop_style = json.dumps({"universal_negative": {"artistic_style": []}})
    realistic = _auto(server, drop_style, "a photo of a cat on a sofa")
    assert realistic["artistic_style"] == edit_negative("video")["artistic_style"]  # restored
    chat_client.clear_cache()
    cartoon = _auto(server, drop_style, "a cartoon cat on a sofa")
    assert cartoon["artistic_style"] == []


def test_dark_and_motion_blur_scenes_prune_terms(server):
    keep_all = json.dumps({"universal_negative": edit_negative("video")})
    out = _auto(server, keep_all, "a car at night, long exposure light trails")
    flat = [t for ts in out.values() for t in ts]
    assert "underexposed" not in flat and "overexposed" not in flat and "motion blur" not in flat
    assert len(flat) == sum(len(t) for t in edit_negative("video").values()) - 3


def test_unparseable_answer_keeps_the_base(server):
    base = edit_negative("image", ["artistic_style"])
    assert _auto(server, "I think you should remove cartoon.", "a cartoon fox", mode="image", base=base) == base


def test_guard_words_match_whole_words_only(server):
    # "knight" holds "night" and "sunlight" is bright: the model kept every term and no guard applies.
    keep_all = json.dumps({"universal_negative": edit_negative("video")})
    out = _auto(server, keep_all, "a knight in sunlight rides past a candle shop")
    flat = [t for ts in out.values() for t in ts]
    assert "underexposed" in flat and "overexposed" in flat
    assert out == edit_negative("video")
