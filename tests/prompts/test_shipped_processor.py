"""The Qwen3-VL processor shipped with the pack (lingbot_core/data/qwen3vl) against independent oracles: the
tokenizer against transformers' Qwen2TokenizerFast built from the host ComfyUI's own qwen25_tokenizer files
(text ids) and the published list of Qwen3-VL's added tokens; the image processor against a
Qwen2VLImageProcessorFast configured with Qwen3-VL's published settings."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from lingbot_core import load_processor
from lingbot_core.prompts.text_conditioning import (
    IMAGE_TOKENS, TEMPLATE_PREFIX, TEMPLATE_SUFFIX, processor_inputs, serialize_caption, vlm_image,
)

# Qwen3-VL's added tokens (issue 33, from the public Qwen files): id -> content. 151665-151668 are Qwen3's
# tool-response and think tokens, not the OmniGen2 tokens of some ComfyUI tokenizer_config.json files.
ADDED = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
    151646: "<|object_ref_start|>", 151647: "<|object_ref_end|>", 151648: "<|box_start|>", 151649: "<|box_end|>",
    151650: "<|quad_start|>", 151651: "<|quad_end|>", 151652: "<|vision_start|>", 151653: "<|vision_end|>",
    151654: "<|vision_pad|>", 151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>",
    151658: "</tool_call>", 151659: "<|fim_prefix|>", 151660: "<|fim_middle|>", 151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>", 151663: "<|repo_name|>", 151664: "<|file_sep|>", 151665: "<tool_response>",
    151666: "</tool_response>", 151667: "<think>", 151668: "</think>",
}

CAPTION = {"comprehensive_description": {"scene_content_description": 'A cat says "hi" \\ waves\t(slowly)',
                                         "camera_movement_description": "static"},
           "prominent_elements": [{"name": "猫", "texture": "soft \"fur\"", "actions": []}]}
PROMPTS = [
    "A ginger tabby cat sits on a sunlit wooden windowsill and watches small birds outside.",
    "一只橘猫坐在阳光明媚的木制窗台上，看着窗外的小鸟。",
    "cat 🐱🐈‍⬛ on a sofa 🛋️ with 👍🏽 and ❤️",
    serialize_caption(CAPTION),
    json.dumps(CAPTION, indent=2, ensure_ascii=False),
    "spaces:    four,        eight\n\n\nthree newlines\r\n\ttab  \n  \n",
    "  leading and trailing  ",
    "mixed: naïve café résumé, Ελληνικά, русский, العربية, 日本語のテキスト, 한국어",
]


@pytest.fixture(scope="module")
def processor():
    return load_processor(None)


@pytest.fixture(scope="module")
def oracle():
    """Qwen2TokenizerFast from the host ComfyUI's vocab.json + merges.txt (its added tokens are not used)."""
    from transformers import Qwen2TokenizerFast

    from support.comfy_host import comfyui_unavailable_reason, find_comfyui_dir

    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    folder = find_comfyui_dir() / "comfy" / "text_encoders" / "qwen25_tokenizer"
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    tok = Qwen2TokenizerFast(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token=None, pad_token=None)
    assert len(tok) == 151643 and len(merges) == 151387
    return tok


def oracle_ids(oracle, text: str) -> list:
    """Ids of ``text``: the added tokens by the published list, the text between them by the oracle BPE."""
    by_content = {v: k for k, v in ADDED.items()}
    pattern = "(" + "|".join(re.escape(t) for t in sorted(by_content, key=len, reverse=True)) + ")"
    ids = []
    for piece in re.split(pattern, text):
        if piece in by_content:
            ids.append(by_content[piece])
        elif piece:
            ids += oracle(piece, add_special_tokens=False)["input_ids"]
    return ids


def test_added_tokens_are_qwen3_vl_s(processor):
    tok = processor.tokenizer
    assert {i: tok.convert_ids_to_tokens(i) for i in ADDED} == ADDED
    assert {t: tok.convert_tokens_to_ids(t) for t in ADDED.values()} == {t: i for i, t in ADDED.items()}
    assert len(tok) == 151669  # 151643 BPE ids + 26 added tokens
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    for i, t in ADDED.items():  # each stays one token inside text
        assert tok(f"a{t}b", add_special_tokens=False)["input_ids"] == tok("a", add_special_tokens=False)["input_ids"] + [i] + tok("b", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", PROMPTS, ids=["english", "chinese", "emoji", "json", "json-indented", "whitespace",
                                               "padded", "scripts"])
def test_text_ids_equal_the_oracle(processor, oracle, text):
    got = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert got == oracle(text, add_special_tokens=False)["input_ids"]
    assert max(got) < 151643 and processor.tokenizer.decode(got) == text


@pytest.mark.parametrize("image", [False, True], ids=["t2v", "ti2v"])
def test_the_full_prompt_template_equals_the_oracle(processor, oracle, image):
    user = (IMAGE_TOKENS if image else "") + serialize_caption(CAPTION)
    text = TEMPLATE_PREFIX + user + TEMPLATE_SUFFIX
    got = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    want = oracle_ids(oracle, text)
    assert got == want
    assert got[0] == 151644 and (151655 in got) == image and (151652 in got) == image


def _ti2v_image(h=70, w=100):
    g = torch.Generator().manual_seed(5)
    pixel = torch.rand(1, 3, 1, h, w, generator=g)
    return vlm_image(pixel)  # the pack's own TI2V pre-resize (multiples of 32)


@pytest.mark.parametrize("do_resize", [False, True], ids=["pack-call", "processor-resize"])
def test_image_processor_equals_qwen3_vl_settings(processor, do_resize):
    from transformers import Qwen2VLImageProcessorFast

    oracle = Qwen2VLImageProcessorFast(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                       image_std=[0.5] * 3, size={"shortest_edge": 65536, "longest_edge": 16777216})
    image = _ti2v_image()
    want = oracle(images=[image], do_resize=do_resize, return_tensors="pt")
    got = processor.image_processor(images=[image], do_resize=do_resize, return_tensors="pt")
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"])
    assert got["pixel_values"].shape == want["pixel_values"].shape
    assert torch.equal(got["pixel_values"], want["pixel_values"])
    if not do_resize:
        assert image.size == (96, 64) and got["image_grid_thw"].tolist() == [[1, 4, 6]]
    else:  # below 65,536 pixels: scaled up by the processor's own smart resize
        t, h, w = got["image_grid_thw"][0].tolist()
        assert h * w * 256 >= 65536


def test_the_pack_s_processor_call_expands_the_image_tokens(processor):
    """What the pipeline sends the text encoder for a TI2V prompt: one <|image_pad|> per merged patch."""
    from transformers import Qwen2VLImageProcessorFast

    image = _ti2v_image()
    inputs = processor_inputs(processor, "a cat", image)
    oracle = Qwen2VLImageProcessorFast(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                       image_std=[0.5] * 3, size={"shortest_edge": 65536, "longest_edge": 16777216})
    want = oracle(images=[image], do_resize=False, return_tensors="pt")
    assert torch.equal(inputs["pixel_values"], want["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], want["image_grid_thw"])
    assert int((inputs["input_ids"] == 151655).sum()) == 4 * 6 // 4


def test_a_package_s_own_processor_wins(tmp_path, processor):
    from lingbot_core.testing.fixtures import tiny_processor

    tiny_processor().save_pretrained(tmp_path / "processor")
    own = load_processor(tmp_path)
    assert len(own.tokenizer) == 263 and len(processor.tokenizer) == 151669
    assert len(load_processor(tmp_path / "elsewhere").tokenizer) == 151669  # no processor/ there: the shipped one


def test_shipped_files_and_licence(processor):
    from lingbot_core.model.component_files import QWEN3VL_DIR
    from lingbot_core.testing.file_fixtures import QWEN3VL_VOCAB

    names = {p.name for p in QWEN3VL_DIR.iterdir()}
    assert {"vocab.json", "merges.txt", "tokenizer_config.json", "preprocessor_config.json", "config.json",
            "LICENSE", "NOTICE.md"} <= names
    assert "Apache License" in (QWEN3VL_DIR / "LICENSE").read_text() and "Apache" in (QWEN3VL_DIR / "NOTICE.md").read_text()
    cfg = json.loads((QWEN3VL_DIR / "config.json").read_text())
    assert "Qwen3-VL-4B" in cfg["_source"]
    t, v = cfg["text_config"], cfg["vision_config"]
    assert (t["hidden_size"], t["num_hidden_layers"], t["vocab_size"], v["out_hidden_size"], v["deepstack_visual_indexes"]) == (
        2560, 36, QWEN3VL_VOCAB, 2560, [5, 11, 17])
    assert (cfg["image_token_id"], cfg["video_token_id"], cfg["vision_start_token_id"]) == (151655, 151656, 151652)


def test_the_registry_archive_ships_the_qwen3vl_files():
    from support.registry_archive import archive_files

    files, _ = archive_files()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "preprocessor_config.json",
                 "video_preprocessor_config.json", "config.json", "LICENSE", "NOTICE.md"):
        assert f"lingbot_core/data/qwen3vl/{name}" in files, name
