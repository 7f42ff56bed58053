"""Fast CPU tests of lingbot_core.testing.fixtures (tiny random-weight packages in the released layout)."""

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run standalone, without a conftest

from lingbot_core.testing import fixtures as fx  # noqa: E402  (sets the offline env vars before transformers)

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from lingbot_core.model.transformer import LingBotVideoTransformer3DModel, is_fp32_island  # noqa: E402


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return fx.write_package(tmp_path_factory.mktemp("pkg") / "dense", refiner=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return fx.write_package(tmp_path_factory.mktemp("pkg") / "moe", moe=True)


@pytest.fixture(scope="module")
def dense_fp32(tmp_path_factory):
    return fx.write_package(tmp_path_factory.mktemp("pkg") / "dense_fp32", fp32=True, refiner=False)


def _dit_state(folder: Path) -> dict:
    return load_file(str(folder / fx.DIT_WEIGHTS))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _safetensors_hashes(root: Path) -> dict:
    return {str(p.relative_to(root)): _sha(p) for p in sorted(root.rglob("*.safetensors"))}


def _model_config(folder: Path) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def test_layout_and_model_index(dense, moe):
    for root, has_refiner in ((dense, False), (moe, True)):
        for rel in ("model_index.json", "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors",
                    "text_encoder/config.json", "text_encoder/generation_config.json", "text_encoder/model.safetensors",
                    "processor/processor_config.json", "processor/tokenizer.json", "processor/tokenizer_config.json",
                    "vae/config.json", "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"):
            assert (root / rel).is_file(), rel
        assert (root / "refiner" / "config.json").is_file() == has_refiner
        index = json.loads((root / "model_index.json").read_text())
        assert index == {
            "_class_name": "LingBotVideoPipeline",
            "_diffusers_version": "0.42.1",
            "processor": ["transformers", "Qwen3VLProcessor"],
            "scheduler": ["lingbot_video.scheduling_flow_unipc", "FlowUniPCMultistepScheduler"],
            "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
            "transformer": ["lingbot_video.transformer_lingbot_video", "LingBotVideoTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLWan"],
        }
        sched = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
        assert sched["_class_name"] == "FlowUniPCMultistepScheduler" and sched["shift"] == 1.0


def test_transformer_config_and_strict_load(dense, moe, dense_fp32):
    for root, moe_expected in ((dense, False), (moe, True)):
        raw = json.loads((root / "transformer" / "config.json").read_text())
        assert raw["_class_name"] == "LingBotVideoTransformer3DModel" and raw["_diffusers_version"] == "0.42.1"
        assert (raw["num_experts"] == 8) == moe_expected
        for k, v in fx.dit_config(moe_expected).items():
            assert raw[k] == v, k
    # The fp32 package loads strictly into the pack's class and gives a finite, non-trivial output.
    model = LingBotVideoTransformer3DModel(**_model_config(dense_fp32 / "transformer")).eval()
    model.load_state_dict(_dit_state(dense_fp32 / "transformer"), strict=True)
    with torch.no_grad():
        out = model(torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(0)),
                    torch.tensor([500.0]), torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1)))
    assert out.shape == (1, 16, 2, 4, 6) and torch.isfinite(out).all() and out.abs().max() > 0


def test_dtype_policy(dense, moe, dense_fp32):
    for root in (dense, moe):
        state = _dit_state(root / "transformer")
        for name, t in state.items():
            assert t.dtype == (torch.float32 if is_fp32_island(name) else torch.bfloat16), name
        assert any(t.dtype == torch.float32 for t in state.values())
        # init sanity: nothing left at zero / ones only
        assert all(t.float().std() > 0 for n, t in state.items() if t.numel() > 1)
    moe_state = _dit_state(moe / "transformer")
    assert moe_state["blocks.0.ffn.router.e_score_correction_bias"].dtype == torch.float32
    assert moe_state["blocks.0.ffn.experts.w1"].shape == (8, 32, 64)
    assert _dit_state(moe / "refiner").keys() == moe_state.keys()
    assert not torch.equal(_dit_state(moe / "refiner")["proj_out.weight"], moe_state["proj_out.weight"])
    assert all(t.dtype == torch.float32 for t in _dit_state(dense_fp32 / "transformer").values())
    te_dtypes = {k: t.dtype for k, t in load_file(str(dense / "text_encoder" / "model.safetensors")).items()}
    assert set(te_dtypes.values()) == {torch.bfloat16}
    te32 = load_file(str(dense_fp32 / "text_encoder" / "model.safetensors"))
    assert {t.dtype for t in te32.values()} == {torch.float32}
    for root in (dense, dense_fp32):
        vae = load_file(str(root / "vae" / "diffusion_pytorch_model.safetensors"))
        assert {t.dtype for t in vae.values()} == {torch.float32}


def test_processor_tokenizes_atomically(dense):
    from transformers import Qwen3VLProcessor

    proc = Qwen3VLProcessor.from_pretrained(dense, subfolder="processor")
    tok = proc.tokenizer
    assert len(tok) == 263
    ids = proc(text=["<|im_start|>user\na cat<|im_end|>"], return_tensors="pt")["input_ids"][0].tolist()
    assert ids[0] == 258 and ids[-1] == 257
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "u", "s", "e", "r", "Ċ", "a", "Ġ", "c", "a", "t",
                                              "<|im_end|>"]
    assert tok.decode(ids) == "<|im_start|>user\na cat<|im_end|>"
    for t, i in {"<|vision_start|>": 259, "<|vision_end|>": 260, "<|image_pad|>": 261, "<|video_pad|>": 262}.items():
        assert tok.convert_tokens_to_ids(t) == i


def test_text_encoder_reloads(dense):
    from transformers import Qwen3VLForConditionalGeneration

    te, info = Qwen3VLForConditionalGeneration.from_pretrained(
        dense, subfolder="text_encoder", dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert te.config.text_config.hidden_size == 64 and te.config.image_token_id == 261
    with torch.no_grad():
        h = te.model(input_ids=torch.tensor([[258, 86, 84, 70, 257]]), use_cache=False).last_hidden_state
    assert h.shape == (1, 5, 64) and torch.isfinite(h).all()


def test_vae_reloads(dense):
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(dense, subfolder="vae")
    assert list(vae.config.latents_mean) == fx.WAN21_LATENTS_MEAN
    assert list(vae.config.latents_std) == fx.WAN21_LATENTS_STD
    assert vae.config.z_dim == 16


def test_deterministic_and_rng_neutral(tmp_path, dense):
    rng = torch.get_rng_state()
    again = fx.write_package(tmp_path / "again", refiner=False)
    assert torch.equal(rng, torch.get_rng_state())  # global RNG untouched
    assert _safetensors_hashes(again) == _safetensors_hashes(dense)
    other = fx.write_package(tmp_path / "other", seed=1, refiner=False)
    assert _sha(other / "transformer" / fx.DIT_WEIGHTS) != _sha(dense / "transformer" / fx.DIT_WEIGHTS)
    # overwrite in place: a dense package rewritten as sharded leaves no stale single file
    fx.write_package(again, sharded=True, refiner=False, scheduler_shift=3.0)
    assert not (again / "transformer" / fx.DIT_WEIGHTS).exists()
    assert json.loads((again / "scheduler" / "scheduler_config.json").read_text())["shift"] == 3.0


def test_sharded_index(tmp_path, dense_fp32):
    root = fx.write_package(tmp_path / "sharded", fp32=True, sharded=True, refiner=False)
    folder = root / "transformer"
    index = json.loads((folder / fx.DIT_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["diffusion_pytorch_model-00001-of-00002.safetensors",
                     "diffusion_pytorch_model-00002-of-00002.safetensors"]
    merged, total = {}, 0
    for f in files:
        with safe_open(str(folder / f), "pt") as sf:
            for k in sf.keys():
                assert index["weight_map"][k] == f
                merged[k] = sf.get_tensor(k)
                total += merged[k].numel() * merged[k].element_size()
    assert index["metadata"]["total_size"] == total
    single = _dit_state(dense_fp32 / "transformer")  # same seed and dtype -> same tensors
    assert merged.keys() == single.keys() == index["weight_map"].keys()
    assert all(torch.equal(merged[k], single[k]) for k in single)


def test_broken_packages(tmp_path):
    out = fx.write_broken_packages(tmp_path / "broken")
    assert set(out) == set(fx.BROKEN_VARIANTS)
    for p in out.values():
        assert p.is_dir() and p.parent == tmp_path / "broken"
    assert not (out["missing_vae"] / "vae").exists()
    assert not (out["no_model_index"] / "model_index.json").exists()
    good = _dit_state(out["missing_vae"] / "transformer")
    wrong = _dit_state(out["wrong_shape"] / "transformer")
    assert wrong[fx.BROKEN_WRONG_SHAPE_KEY].shape != good[fx.BROKEN_WRONG_SHAPE_KEY].shape
    assert set(good) - set(_dit_state(out["missing_key"] / "transformer")) == {fx.BROKEN_MISSING_KEY}
    assert set(_dit_state(out["unexpected_key"] / "transformer")) - set(good) == {fx.BROKEN_UNEXPECTED_KEY}
    pk = out["pickle_only"] / "transformer"
    assert (pk / "diffusion_pytorch_model.bin").is_file() and not list(pk.glob("*.safetensors"))
    with pytest.raises(Exception):
        _dit_state(out["truncated"] / "transformer")
    with pytest.raises(ValueError):
        LingBotVideoTransformer3DModel(**_model_config(out["bad_config"] / "transformer"))
    link = out["symlink_escape"] / "transformer"
    assert link.is_symlink() and (link / "config.json").is_file()
    assert (tmp_path / "broken").resolve() not in link.resolve().parents
    assert not (tmp_path / "broken" / ".base").exists()


def test_cli(tmp_path, capsys):
    root = fx.main(["--out", str(tmp_path / "cli"), "--moe", "--seed", "3", "--sharded", "--no-refiner"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (root / "transformer" / fx.DIT_INDEX).is_file() and not (root / "refiner").exists()
