"""The pipeline's prompt cache in TI2V: its key includes the image, a seed change reuses the encoding.

Runs on the vendored reference package, so the conditioning the DiT receives is checked against the
reference implementation's embedding of the same prompt and image (tests/data/reference/README.md).
"""

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from lingbot_core import load_pipeline
from support.reference import PACKAGE, PROMPT, TOL, assert_matches, first_frame, vectors

H, W = 64, 96
RUN = dict(height=H, width=W, num_frames=5, steps=1, guidance_scale=1.0, shift=3.0, output_type="latent")


@pytest.fixture(scope="module")
def pipe():
    p = load_pipeline(PACKAGE, device="cpu")
    yield p
    p.release()


def _other_image() -> Image.Image:
    """Another picture of exactly the same size as the reference first frame."""
    img = ImageOps.mirror(first_frame().convert("RGB"))
    assert img.size == first_frame().size and np.asarray(img).tobytes() != np.asarray(first_frame().convert("RGB")).tobytes()
    return img


def test_second_image_of_same_size_gets_its_own_tokens(pipe):
    expected = torch.from_numpy(vectors("components_text")["ti2v_prompt.embeds"])
    encoder_calls, dit_text = [], []
    handles = [
        pipe.text_encoder.register_forward_pre_hook(lambda m, a, k: encoder_calls.append(1), with_kwargs=True),
        pipe.transformer.register_forward_hook(lambda m, a, o: dit_text.append(a[2].clone())),
    ]
    try:
        first = pipe.generate(PROMPT, image=_other_image(), seed=1, **RUN)
        second = pipe.generate(PROMPT, image=first_frame(), seed=1, **RUN)
        assert len(encoder_calls) == 2  # a new image is a new encoding, not a cache hit
        # The DiT of the second run was conditioned on the second image's tokens, as the reference encodes them.
        assert_matches(dit_text[1], expected.numpy(), "second run's prompt embeddings")
        assert (dit_text[0] - dit_text[1]).abs().max() > 100 * TOL  # the images' tokens really differ
        assert (first - second).abs().max() > 100 * TOL
        # Back to the first image: served from the cache, and still the first image's tokens.
        again = pipe.encode_prompt(PROMPT, condition=pipe.encode_image(_other_image(), H, W), guidance_scale=1.0)
        assert len(encoder_calls) == 2
        assert torch.equal(again.positive, dit_text[0])
    finally:
        for h in handles:
            h.remove()


def test_seed_change_reuses_the_prompt_encoding(pipe):
    """GenerateVideo's call (a precomputed TI2V condition from EncodeImageVAE) with a new seed: the text
    encoder does not run again, and the video changes."""
    condition = pipe.encode_image(first_frame(), H, W)
    calls = []
    handle = pipe.text_encoder.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    try:
        # A negative no other test uses, so the first run always encodes.
        kw = dict(RUN, guidance_scale=3.0, condition=condition, negative_prompt="blurry, seed test")
        a = pipe.generate(PROMPT, seed=1, **kw)
        encoded = len(calls)
        b = pipe.generate(PROMPT, seed=2, **kw)
    finally:
        handle.remove()
    assert encoded == 2  # positive and negative, both with the image tokens
    assert len(calls) == encoded
    assert (a - b).abs().max() > 100 * TOL
