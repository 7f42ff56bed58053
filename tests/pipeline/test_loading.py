"""Loading packages: errors for broken packages, no pickle, no network, dtypes, no duplicated weights
(model doc §1, §3, §4; test-fixtures §8)."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import lingbot_core
from lingbot_core import ModelPackageError, load_pipeline
from lingbot_core.testing.fixtures import BROKEN_MISSING_KEY, BROKEN_UNEXPECTED_KEY, BROKEN_WRONG_SHAPE_KEY
from lingbot_core.model.transformer import is_fp32_island

from support.alike_layout import in_file_mapping

TINY = dict(height=64, width=96, num_frames=5, steps=2, seed=0)


def _load_error(path, **kwargs) -> str:
    with pytest.raises(ModelPackageError) as e:
        load_pipeline(path, device="cpu", **kwargs)
    return str(e.value)


# ---------------------------------------------------------------------------------------------
# Broken packages
# ---------------------------------------------------------------------------------------------


def test_missing_vae(broken_packages):
    msg = _load_error(broken_packages["missing_vae"])
    assert "vae" in msg and "missing" in msg


def test_no_model_index(broken_packages):
    assert "model_index.json" in _load_error(broken_packages["no_model_index"])


def test_not_a_folder(tmp_path):
    assert "does not exist" in _load_error(tmp_path / "nope")


def test_wrong_shape(broken_packages):
    msg = _load_error(broken_packages["wrong_shape"])
    assert BROKEN_WRONG_SHAPE_KEY in msg
    assert "[63, 64]" in msg and "[64, 64]" in msg
    assert "transformer" in msg


def test_missing_key(broken_packages):
    msg = _load_error(broken_packages["missing_key"])
    assert BROKEN_MISSING_KEY in msg and "missing" in msg


def test_unexpected_key(broken_packages):
    assert BROKEN_UNEXPECTED_KEY in _load_error(broken_packages["unexpected_key"])




def test_truncated(broken_packages):
    msg = _load_error(broken_packages["truncated"])
    assert "truncated" in msg and "readable" in msg
    assert "diffusion_pytorch_model.safetensors" in msg


def test_bad_config(broken_packages):
    with pytest.raises(ValueError) as e:
        load_pipeline(broken_packages["bad_config"], device="cpu")
    msg = str(e.value)
    assert "head_dim" in msg and "axes_dims" in msg


def test_missing_refiner(broken_packages):
    # The broken fixtures are dense packages without refiner/ (the folder check comes before any weights).
    msg = _load_error(broken_packages["wrong_shape"], transformer_subfolder="refiner")
    assert "refiner" in msg and "missing" in msg


def test_unknown_transformer_subfolder(packages):
    with pytest.raises(ValueError, match="transformer_subfolder"):
        load_pipeline(packages["dense"], transformer_subfolder="unet", device="cpu")


def test_unsupported_scheduler_config(tmp_path):
    from lingbot_core.testing.fixtures import write_package

    root = write_package(tmp_path / "pkg", fp32=True, refiner=False)
    path = root / "scheduler" / "scheduler_config.json"
    cfg = json.loads(path.read_text())
    cfg["prediction_type"] = "epsilon"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="prediction_type"):
        load_pipeline(root, device="cpu")


# ---------------------------------------------------------------------------------------------
# Arguments checked before any weights load
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_weights_load(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("weights were loaded before the arguments were checked")

    monkeypatch.setattr(lingbot_core.loading, "load_transformer", fail)


def test_unknown_offload_before_weights(packages, no_weights_load):
    with pytest.raises(ValueError, match="offload"):
        load_pipeline(packages["dense"], offload="gpu", device="cpu")


@pytest.mark.parametrize("dtypes, word", [({"unet": "bf16"}, "unet"), ({"transformer": "fp8"}, "fp8")])
def test_unknown_dtype_before_weights(packages, no_weights_load, dtypes, word):
    with pytest.raises(ValueError, match=word):
        load_pipeline(packages["dense"], device="cpu", dtypes=dtypes)


# ---------------------------------------------------------------------------------------------
# dtypes (§4)
# ---------------------------------------------------------------------------------------------


def test_default_dtypes_on_cpu_are_fp32(dense_pipe):
    assert all(p.dtype == torch.float32 for p in dense_pipe.transformer.parameters())
    assert all(p.dtype == torch.float32 for p in dense_pipe.text_encoder.parameters())
    assert all(p.dtype == torch.float32 for p in dense_pipe.vae.parameters())
    assert dense_pipe.transformer.compute_dtype == torch.float32


def test_cpu_load_aligns_the_fp32_islands_and_keeps_the_big_weights_mapped(moe_pipe, packages):
    """A memory-mapped file hands tensors out at its own offsets (the fixture's at data_ptr() % 64 == 40);
    a one-row Linear may round differently there (AVX-512) and the MoE then routes another way, so a
    CPU load gives the fp32 islands (time MLPs, norms, router) 64-byte aligned copies of the same values,
    while the big weights stay file-backed (issue 28)."""
    import copy

    from safetensors import safe_open

    file = packages["moe"] / "transformer" / "diffusion_pytorch_model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        mapped = {k: f.get_tensor(k) for k in f.keys()}
    assert all(mapped[k].data_ptr() % 64 for k in ("time_embedder.linear_1.weight", "time_modulation.1.weight"))
    dit = moe_pipe.transformer
    islands = [k for k in dit.state_dict() if is_fp32_island(k)]
    assert "blocks.0.ffn.router.weight" in islands
    for name in islands:
        t = dit.state_dict()[name]
        assert t.data_ptr() % 64 == 0 and torch.equal(t, mapped[name]), name
    for name in ("blocks.0.attn.to_q.weight", "blocks.1.ffn.experts.w1"):
        assert in_file_mapping(dit.state_dict()[name], file), f"{name} was copied out of the file mapping"
    # Its numbers are those of a fresh (aligned) copy of the time MLP, bit for bit, on any CPU.
    x = torch.randn(1, dit.config.freq_dim, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dit.time_embedder(x, torch.float32), copy.deepcopy(dit.time_embedder)(x, torch.float32))


def test_bf16_transformer_keeps_islands(packages):
    pipe = load_pipeline(packages["moe"], device="cpu", dtypes={"transformer": "bf16", "text_encoder": torch.bfloat16})
    try:
        tensors = dict(pipe.transformer.named_parameters()) | dict(pipe.transformer.named_buffers())
        assert tensors["blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
        assert tensors["blocks.0.ffn.experts.w1"].dtype == torch.bfloat16
        assert tensors["blocks.0.norm1.weight"].dtype == torch.float32
        assert tensors["blocks.0.ffn.router.e_score_correction_bias"].dtype == torch.float32
        assert tensors["time_embedder.linear_1.weight"].dtype == torch.float32
        for name, t in tensors.items():
            assert t.dtype == (torch.float32 if is_fp32_island(name) else torch.bfloat16), name
        assert all(p.dtype == torch.bfloat16 for p in pipe.text_encoder.parameters())
        assert all(p.dtype == torch.float32 for p in pipe.vae.parameters())  # VAE stays fp32
        # A bf16 DiT runs on CPU.
        frames = pipe.generate("a cat", **TINY)
        assert frames.shape == (5, 64, 96, 3) and np.isfinite(frames).all()
    finally:
        pipe.release()


def test_release_like_bf16_package_upcasts_to_fp32(packages):
    root = packages["dense_bf16"]
    stored = load_file(str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert stored["blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    assert stored["blocks.0.norm1.weight"].dtype == torch.float32
    pipe = load_pipeline(root, device="cpu", dtypes={"transformer": "fp32"})
    try:
        sd = pipe.transformer.state_dict()
        for name, t in sd.items():
            assert t.dtype == torch.float32, name
            assert torch.equal(t, stored[name].float()), name
        assert pipe.transformer.compute_dtype == torch.float32
        frames = pipe.generate("a cat", **TINY)
        assert np.isfinite(frames).all()
    finally:
        pipe.release()


# ---------------------------------------------------------------------------------------------
# No network, no duplicated weights
# ---------------------------------------------------------------------------------------------




def _safetensors_payload(path) -> int:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    size = path.stat().st_size
    payload = size - 8 - header_len
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    assert max(ends) == payload
    return payload


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_transformer_weights_not_duplicated(packages, kind):
    pipe = load_pipeline(packages[kind], device="cpu")
    try:
        tensors = list(pipe.transformer.state_dict().values())
        storages = [t.untyped_storage() for t in tensors]
        assert len({s.data_ptr() for s in storages}) == len(tensors)
        # Each storage holds exactly its tensor (no tensor is a view into a larger buffer).
        assert all(s.nbytes() == t.numel() * t.element_size() for s, t in zip(storages, tensors))
        total = sum(t.numel() * t.element_size() for t in tensors)
        assert total == _safetensors_payload(packages[kind] / "transformer" / "diffusion_pytorch_model.safetensors")
    finally:
        pipe.release()
