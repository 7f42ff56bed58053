"""Attention backends (issue 17 item 1): one dispatch point through diffusers' dispatcher.

``sdpa`` must give today's bits; ``flash_attn`` and ``sage`` must reach their kernels with q, k, v laid
out as (B, S, heads, head_dim). The kernels need CUDA, so the tests stand in recorders for the
functions diffusers calls (``flash_attn_func``, ``sageattn``) that compute attention from the layout
they are documented to take: a wrong layout changes the output.
"""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from diffusers.models import attention_dispatch

from lingbot_core import load_pipeline
from lingbot_core.model.attention import ATTENTION_CHOICES, diffusers_backend
from lingbot_core.testing.fixtures import dit_config, dit_state_dict
from lingbot_core.model.transformer import Attention, LingBotVideoTransformer3DModel, apply_rope, rope_frequencies, rope_position_ids

CUDA = torch.device("cuda", 0)  # only named: nothing runs on it


def _random_attention(dtype):
    attn = Attention(64, 2, 1e-6, qkv_bias=False, out_bias=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if name.startswith("norm") else 0.0))
    return attn.to(dtype), g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_is_bit_identical_to_direct_sdpa(dtype):
    attn, g = _random_attention(dtype)
    grid, text_len = (2, 2, 3), 5
    a = torch.randn(1, 12 + text_len, 64, generator=g).to(dtype)
    freqs = rope_frequencies(rope_position_ids(grid, text_len), (8, 12, 12), 256.0)
    with torch.no_grad():
        out = attn(a, freqs, dtype)
        # The pack's attention before the dispatcher, written out on the same module.
        q = apply_rope(attn.norm_q(attn.to_q(a, dtype).view(1, 17, 2, -1)), freqs)
        k = apply_rope(attn.norm_k(attn.to_k(a, dtype).view(1, 17, 2, -1)), freqs)
        v = attn.to_v(a, dtype).view(1, 17, 2, -1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        ref = attn.to_out(o.transpose(1, 2).reshape(1, 17, -1), dtype)
    assert torch.equal(out, ref)


def _bshd_attention(calls, layout_kw=None):
    """A kernel stand-in: attention of q, k, v taken as (B, S, heads, D), recording each call."""

    def kernel(q, k, v, **kwargs):
        calls.append((tuple(q.shape), kwargs.get(layout_kw) if layout_kw else None))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return o.transpose(1, 2)

    return kernel


@pytest.fixture(scope="module")
def dit_and_inputs():
    weights, config = dit_state_dict(dit_config(), seed=4, fp32=True)
    dit = LingBotVideoTransformer3DModel.from_config(config).eval()
    dit.load_state_dict(weights)
    g = torch.Generator().manual_seed(1)
    latent = torch.randn(1, 16, 2, 4, 6, generator=g)
    texts = [torch.randn(1, 7, 64, generator=g), torch.randn(1, 11, 64, generator=g)]
    t = torch.tensor([500.0])
    with torch.no_grad():
        ref = dit(latent, t, texts)
    return dit, latent, t, texts, ref


@pytest.mark.parametrize("backend, target, layout_kw, layout", [
    ("flash", "flash_attn_func", None, None),
    ("sage", "sageattn", "tensor_layout", "NHD"),
])
def test_backend_reaches_its_kernel_with_bshd_layout(dit_and_inputs, backend, target, layout_kw, layout):
    dit, latent, t, texts, ref = dit_and_inputs
    calls = []
    dit.set_attention_backend(backend)
    try:
        with mock.patch.object(attention_dispatch, target, _bshd_attention(calls, layout_kw)), torch.no_grad():
            out = dit(latent, t, texts)
    finally:
        dit.set_attention_backend("native")
    heads, head_dim = dit.config.num_attention_heads, dit.config.hidden_size // dit.config.num_attention_heads
    n_video = 2 * 2 * 3
    expected = [(1, n_video + text.shape[1], heads, head_dim) for text in texts for _ in range(dit.config.depth)]
    assert sorted(shape for shape, _ in calls) == sorted(expected)  # every attention, (B, S, heads, D)
    assert {kw for _, kw in calls} == {layout}
    for o, r in zip(out, ref):
        assert torch.equal(o, r)


def test_choices_map_to_diffusers_backends():
    assert ATTENTION_CHOICES == ("sdpa", "flash_attn", "sage")
    assert diffusers_backend("sdpa", torch.device("cpu"), torch.float32) == "native"
    with mock.patch.object(attention_dispatch, "_CAN_USE_FLASH_ATTN", True):
        assert diffusers_backend("flash_attn", CUDA, torch.bfloat16) == "flash"
    with mock.patch.object(attention_dispatch, "_CAN_USE_SAGE_ATTN", True):
        assert diffusers_backend("sage", CUDA, torch.float16) == "sage"


@pytest.mark.parametrize("choice, package", [("flash_attn", "pip install flash-attn"), ("sage", "pip install sageattention")])
def test_absent_package_names_the_pip_install(choice, package):
    flags = dict(_CAN_USE_FLASH_ATTN=False, _CAN_USE_FLASH_ATTN_3=False, _CAN_USE_SAGE_ATTN=False)
    with mock.patch.multiple(attention_dispatch, **flags), pytest.raises(ValueError, match=package):
        diffusers_backend(choice, CUDA, torch.bfloat16)


def test_unusable_choices_are_refused_before_loading(packages):
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        load_pipeline(packages["dense"], device="cpu", attention="flash_attn")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        diffusers_backend("sage", CUDA, torch.float32)
    with pytest.raises(ValueError, match="sdpa, flash_attn, sage"):
        load_pipeline(packages["dense"], device="cpu", attention="xformers")


def test_set_speed_switches_attention_without_reload(dense_pipe):
    weight = dense_pipe.transformer.blocks[0].attn.to_q.weight
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        dense_pipe.set_speed(attention="sage")
    assert dense_pipe.speed.attention == "sdpa"  # a refused change changes nothing
    dense_pipe.set_speed(attention="sdpa")
    assert dense_pipe.transformer.blocks[0].attn.to_q.weight is weight
    assert {m.backend.value for m in dense_pipe.transformer.modules() if isinstance(m, Attention)} == {"native"}


@pytest.mark.parametrize("fa3, expected", [(False, "flash"), (True, "_flash_3")])
def test_hopper_takes_flash_attention_3_when_installed_else_2(fa3, expected):
    # An H100 (compute capability 9.0) with only flash-attn 2 installed still runs attention=flash_attn.
    hopper = dict(is_available=mock.DEFAULT, get_device_capability=mock.DEFAULT)
    with mock.patch.multiple(torch.cuda, **hopper) as cuda, \
            mock.patch.multiple(attention_dispatch, _CAN_USE_FLASH_ATTN=True, _CAN_USE_FLASH_ATTN_3=fa3):
        cuda["is_available"].return_value = True
        cuda["get_device_capability"].return_value = (9, 0)
        assert diffusers_backend("flash_attn", CUDA, torch.bfloat16) == expected
        cuda["get_device_capability"].return_value = (8, 0)  # A100: FlashAttention 2 only
        assert diffusers_backend("flash_attn", CUDA, torch.bfloat16) == "flash"
