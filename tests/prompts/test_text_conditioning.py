"""Prompt template, default negatives, crop_start, caption serialisation, durations, negative-prompt
semantics, the VLM image size and the prompt cache (model doc §6; test-fixtures §2-§4)."""

import hashlib
import json

import pytest
import torch

from lingbot_core import frames_for_duration, parse_prompt, serialize_caption
from lingbot_core.prompts.text_conditioning import (
    DEFAULT_NEGATIVE_IMAGE, DEFAULT_NEGATIVE_VIDEO, IMAGE_TOKENS, PROMPT_TEMPLATE, smart_resize, vlm_image,
)

SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _bytes_token_count(text: str) -> int:
    """Tokens of ``text`` under the fixture's bytes-only tokenizer: one per UTF-8 byte, specials atomic."""
    n = len(text.encode("utf-8"))
    for sp in SPECIALS:
        n -= text.count(sp) * (len(sp) - 1)
    return n


def _hidden_states(pipe, user_text: str, image=None) -> torch.Tensor:
    """Run the encoder the way the doc describes (Qwen3VLModel, last_hidden_state) on the filled template."""
    filled = PROMPT_TEMPLATE.format((IMAGE_TOKENS + user_text) if image is not None else user_text)
    inputs = pipe.processor(text=[filled], images=[image] if image is not None else None, do_resize=False,
                            return_tensors="pt")
    with torch.no_grad():
        return pipe.text_encoder.model(**inputs, use_cache=False).last_hidden_state


# ---------------------------------------------------------------------------------------------
# Verbatim data
# ---------------------------------------------------------------------------------------------


def test_prompt_template_verbatim():
    assert len(PROMPT_TEMPLATE) == 801
    assert _sha(PROMPT_TEMPLATE) == "abef50e4c35c4dc72f96165cd271b98308522f84462f4c371dc320c282742f12"
    assert PROMPT_TEMPLATE.count("{}") == 1
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    assert len(prefix) == 766 and prefix.endswith("<|im_start|>user\n")


def test_default_negatives_verbatim():
    assert len(DEFAULT_NEGATIVE_VIDEO) == 896
    assert _sha(DEFAULT_NEGATIVE_VIDEO) == "43704d85b3951aed0e1d31d2679c3ced979fc11b3c16658bd21286d086b8ea69"
    assert len(DEFAULT_NEGATIVE_IMAGE) == 585
    assert _sha(DEFAULT_NEGATIVE_IMAGE) == "7e277788a8bb3d2fb0a2a4109316c544345fefff1c22868861c90741b0c47e7b"


# ---------------------------------------------------------------------------------------------
# crop_start and the kept tokens
# ---------------------------------------------------------------------------------------------


def test_crop_start_is_template_prefix_length(dense):
    prefix = PROMPT_TEMPLATE.split("{}")[0]
    assert _bytes_token_count(prefix) == 735
    assert dense.crop_start == 735


def test_positive_keeps_user_text_and_trailing_template_tokens(dense):
    emb = dense.encode_prompt("a cat", guidance_scale=1.0, num_frames=5)
    # 5 bytes of "a cat" + <|im_end|>, "\n", <|im_start|>, "assistant" (9 bytes), "\n" = 18 with the bytes tokenizer.
    suffix = PROMPT_TEMPLATE.split("{}")[1]
    assert _bytes_token_count("a cat" + suffix) == 18
    assert emb.positive.shape == (1, 753 - 735, 64)
    assert emb.negative is None
    # The encoder sees the whole sequence; the kept states are its rows from crop_start on.
    full = _hidden_states(dense, "a cat")
    assert full.shape[1] == 753
    torch.testing.assert_close(emb.positive, full[:, 735:], rtol=0, atol=0)


def test_ti2v_embeds_include_image_tokens(dense, test_image):
    cond = dense.encode_image(test_image, 64, 96)
    plain = dense.encode_prompt("a cat", num_frames=5)
    with_image = dense.encode_prompt("a cat", num_frames=5, condition=cond)
    # <|vision_start|> + (64/32)*(96/32) = 6 image pads + <|vision_end|>
    assert with_image.positive.shape[1] == plain.positive.shape[1] + 8
    assert with_image.negative.shape[1] == plain.negative.shape[1] + 8
    assert with_image.with_image and not plain.with_image
    # The VLM sees the first-frame pixels, as uint8 (truncated), at a multiple of 32.
    img = vlm_image(cond.pixels)
    assert img.size == (96, 64)
    full = _hidden_states(dense, "a cat", image=img)
    torch.testing.assert_close(with_image.positive, full[:, 735:], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Structured captions and durations
# ---------------------------------------------------------------------------------------------


def test_serialize_caption_compact_keeps_order_and_unicode():
    assert serialize_caption({"caption": {"b": "é", "a": [1, 2]}}) == '{"b":"é","a":[1,2]}'


def test_serialize_caption_string_caption_verbatim():
    assert serialize_caption({"caption": "  A cat, {on} a mat.  ", "duration": 5}) == "  A cat, {on} a mat.  "


def test_serialize_caption_list_uses_first_object():
    assert serialize_caption([{"caption": {"x": 1}}, {"caption": {"y": 2}}]) == '{"x":1}'


def test_serialize_caption_without_caption_drops_runtime_keys():
    data = {"scene": "ä", "duration": 5, "fps": 24, "height": 480, "width": 832, "num_frames": 121,
            "resolution": "480p", "ratio": "9:16", "items": [1, {"k": None}]}
    assert serialize_caption(data) == '{"scene":"ä","items":[1,{"k":null}]}'


@pytest.mark.parametrize("seconds, frames", [(5, 121), (10, 241), (2, 49), (1, 25), (0, 1), (0.3, 9)])
def test_frames_for_duration(seconds, frames):
    assert frames_for_duration(seconds, 24) == frames


def test_frames_for_duration_rejects_negative():
    with pytest.raises(ValueError, match="duration"):
        frames_for_duration(-1, 24)


def test_parse_prompt_plain_text_verbatim():
    p = parse_prompt("  A cat on a mat.\n")
    assert p.text == "  A cat on a mat.\n"
    assert p.duration is None and not p.structured


def test_parse_prompt_json_caption():
    raw = json.dumps({"caption": {"b": "é", "a": [1, 2]}, "duration": 5}, indent=2, ensure_ascii=True)
    p = parse_prompt(raw)
    assert p.text == '{"b":"é","a":[1,2]}'
    assert p.duration == 5.0 and p.structured


def test_parse_prompt_malformed_json_names_position():
    with pytest.raises(ValueError) as e:
        parse_prompt('{"caption": {"a": 1,}\n}')
    msg = str(e.value)
    assert "line 1" in msg and "column" in msg


@pytest.mark.parametrize("text", ["", "   \n\t"])
def test_parse_prompt_empty(text):
    with pytest.raises(ValueError, match="empty"):
        parse_prompt(text)


# ---------------------------------------------------------------------------------------------
# Negative prompt semantics through encode_prompt
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_frames, default", [(5, DEFAULT_NEGATIVE_VIDEO), (1, DEFAULT_NEGATIVE_IMAGE)],
                         ids=["video", "image"])
def test_none_negative_is_mode_default(dense, num_frames, default):
    emb = dense.encode_prompt("a cat", None, num_frames=num_frames, guidance_scale=3.0)
    suffix = PROMPT_TEMPLATE.split("{}")[1]
    assert emb.negative.shape == (1, _bytes_token_count(default + suffix), 64)  # 909 / 598
    torch.testing.assert_close(emb.negative, _hidden_states(dense, default)[:, 735:], rtol=0, atol=0)


def test_empty_negative_is_kept_distinct_from_none(dense):
    empty = dense.encode_prompt("a cat", "", num_frames=5)
    default = dense.encode_prompt("a cat", None, num_frames=5)
    assert empty.negative.shape == (1, 13, 64)  # only the trailing template tokens
    assert default.negative.shape[1] == 909
    torch.testing.assert_close(empty.negative, _hidden_states(dense, "")[:, 735:], rtol=0, atol=0)
    torch.testing.assert_close(empty.positive, default.positive, rtol=0, atol=0)


def test_custom_negative_text_is_encoded(dense):
    emb = dense.encode_prompt("a cat", "blurry", num_frames=5)
    torch.testing.assert_close(emb.negative, _hidden_states(dense, "blurry")[:, 735:], rtol=0, atol=0)


@pytest.mark.parametrize("guidance", [1.0, 0.5, 0.0])
def test_no_negative_without_guidance(dense, guidance):
    emb = dense.encode_prompt("a cat", "blurry", num_frames=5, guidance_scale=guidance)
    assert emb.negative is None


def test_null_negative_is_zeros_like_positive(dense):
    emb = dense.encode_prompt("a cat", "blurry", num_frames=5, null_negative=True)
    assert emb.negative.shape == emb.positive.shape
    assert emb.negative.dtype == emb.positive.dtype
    assert torch.count_nonzero(emb.negative) == 0
    assert torch.count_nonzero(emb.positive) > 0


def test_bad_guidance_rejected(dense):
    with pytest.raises(ValueError, match="guidance_scale"):
        dense.encode_prompt("a cat", guidance_scale=float("nan"))


# ---------------------------------------------------------------------------------------------
# smart_resize (§6.8)
# ---------------------------------------------------------------------------------------------


def test_smart_resize_rounds_half_to_even():
    # 464 = 14.5 * 32 -> 14 * 32; 496 = 15.5 * 32 -> 16 * 32.
    assert smart_resize(464, 496) == (448, 512)
    assert smart_resize(64, 96) == (64, 96)
    assert smart_resize(70, 100) == (64, 96)


def test_smart_resize_minimum_side_32():
    assert smart_resize(10, 1000) == (32, 992)


def test_smart_resize_small_area_grows():
    # 40x40 rounds to 32x32 (1024 px) < 4*32^2: scale up by sqrt(4096/1600) = 1.6 and ceil.
    assert smart_resize(40, 40) == (64, 64)


def test_smart_resize_large_area_shrinks():
    h, w = smart_resize(4000, 8000)
    assert (h, w) == (2880, 5792)
    assert h * w <= 16384 * 32 * 32
    assert h % 32 == 0 and w % 32 == 0


def test_smart_resize_extreme_aspect_raises():
    with pytest.raises(ValueError, match="aspect"):
        smart_resize(10, 2010)
    smart_resize(10, 2000)  # exactly 200 is allowed


# ---------------------------------------------------------------------------------------------
# Prompt cache
# ---------------------------------------------------------------------------------------------


def test_prompt_cache_skips_encoder(dense_pipe):
    dense = dense_pipe
    calls = []
    handle = dense.text_encoder.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        first = dense.encode_prompt("a dog", num_frames=5)
        assert len(calls) == 2  # positive + negative
        again = dense.encode_prompt("a dog", num_frames=5)
        assert len(calls) == 2
        assert again.positive is first.positive
        dense.encode_prompt("a bird", num_frames=5)
        assert len(calls) == 4
        # Another negative, or no guidance, is another cache entry.
        dense.encode_prompt("a dog", "", num_frames=5)
        assert len(calls) == 6
        dense.encode_prompt("a dog", num_frames=5, guidance_scale=1.0)
        assert len(calls) == 7
    finally:
        handle.remove()


def test_prompt_cache_is_bounded_lru(dense_pipe):
    dense = dense_pipe
    from lingbot_core.pipeline import PROMPT_CACHE_SIZE

    calls = []
    handle = dense.text_encoder.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        prompts = [f"p{i}" for i in range(PROMPT_CACHE_SIZE + 1)]
        for p in prompts[:PROMPT_CACHE_SIZE]:
            dense.encode_prompt(p, guidance_scale=1.0)
        dense.encode_prompt(prompts[0], guidance_scale=1.0)  # refresh p0: p1 is now the oldest
        assert len(calls) == PROMPT_CACHE_SIZE
        dense.encode_prompt(prompts[-1], guidance_scale=1.0)  # evicts p1
        dense.encode_prompt(prompts[0], guidance_scale=1.0)
        assert len(calls) == PROMPT_CACHE_SIZE + 1
        dense.encode_prompt(prompts[1], guidance_scale=1.0)
        assert len(calls) == PROMPT_CACHE_SIZE + 2
    finally:
        handle.remove()
