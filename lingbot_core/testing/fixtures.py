"""Tiny random-weight LingBot-Video packages in the released on-disk layout.

Used by tests, the demo and benchmarks so the pack's real loader runs end to end without a model hub.
Configs follow ``docs/test-fixtures.md`` (shared docs); every tensor is drawn from a seeded generator so
two writes with the same arguments give byte-identical safetensors files.

CLI: ``python -m lingbot_core.testing.fixtures --out DIR [--moe] [--seed N] [--fp32] [--sharded] [--no-refiner] [--dmd]``
"""

from __future__ import annotations

import os

# Offline and quiet before transformers/diffusers are imported; setdefault so callers can override.
for _key, _value in (
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("HF_HUB_DISABLE_TELEMETRY", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
):
    os.environ.setdefault(_key, _value)

import argparse
import contextlib
import json
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from diffusers import AutoencoderKLWan
from tokenizers.pre_tokenizers import ByteLevel
from transformers import Qwen2Tokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
from transformers.utils import logging as hf_logging
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from lingbot_core.model.transformer import LingBotVideoTransformer3DModel, is_fp32_island

DIFFUSERS_VERSION = "0.42.1"

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Wan 2.1 VAE latent statistics (stored in vae/config.json; the pack must read them from there).
WAN21_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]

TEXT_HIDDEN = 64  # tiny Qwen3-VL hidden size == DiT text_dim

TINY_DENSE_CONFIG = {
    "patch_size": [1, 2, 2], "in_channels": 16, "out_channels": 16, "hidden_size": 64,
    "num_attention_heads": 2, "depth": 2, "intermediate_size": 128, "text_dim": TEXT_HIDDEN,
    "freq_dim": 32, "norm_eps": 1e-6, "rope_theta": 256.0, "axes_dims": [8, 12, 12],
    "axes_lens": [8192, 1024, 1024], "qkv_bias": False, "out_bias": True,
    "patch_embed_bias": True, "timestep_mlp_bias": True, "num_experts": 0,
}
TINY_MOE_EXTRA = {
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
    "topk_group": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "score_func": "sigmoid",
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}

# model_index.json as released: the custom classes are recorded by module paths the pack cannot import,
# which catches loaders that accidentally go through DiffusionPipeline.from_pretrained.
MODEL_INDEX = {
    "_class_name": "LingBotVideoPipeline",
    "_diffusers_version": DIFFUSERS_VERSION,
    "processor": ["transformers", "Qwen3VLProcessor"],
    "scheduler": ["lingbot_video.scheduling_flow_unipc", "FlowUniPCMultistepScheduler"],
    "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
    "transformer": ["lingbot_video.transformer_lingbot_video", "LingBotVideoTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLWan"],
}

SCHEDULER_CONFIG = {
    "_class_name": "FlowUniPCMultistepScheduler", "_diffusers_version": DIFFUSERS_VERSION,
    "num_train_timesteps": 1000, "solver_order": 2, "prediction_type": "flow_prediction",
    "shift": 1.0, "use_dynamic_shifting": False, "thresholding": False, "predict_x0": True,
    "solver_type": "bh2", "lower_order_final": True, "disable_corrector": [],
    "final_sigmas_type": "zero",
}

# A DMD-distilled student's scheduler (the reference's DMDStudentScheduler with its defaults): the pack
# recognises the class name and samples such a package with sampler "dmd_student" under "auto".
DMD_SCHEDULER_CONFIG = {
    "_class_name": "DMDStudentScheduler", "_diffusers_version": DIFFUSERS_VERSION,
    "num_train_timesteps": 1000, "flow_shift": 3.0, "high_noise_threshold": 0.5, "ddim_eta": 1.0,
    "prediction_type": "flow_prediction",
}
DMD_MODEL_INDEX_SCHEDULER = ["lingbot_video.scheduling_dmd_student", "DMDStudentScheduler"]

DIT_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIT_INDEX = "diffusion_pytorch_model.safetensors.index.json"

# Tensors touched by the negative fixtures (exported so loader tests can assert on the names).
BROKEN_WRONG_SHAPE_KEY = "blocks.0.attn.to_q.weight"
BROKEN_MISSING_KEY = "proj_out.bias"
BROKEN_UNEXPECTED_KEY = "blocks.0.attn.to_q.bias"  # plausible-looking, but qkv_bias is false
BROKEN_VARIANTS = ("missing_vae", "no_model_index", "wrong_shape", "missing_key", "unexpected_key",
                   "pickle_only", "truncated", "bad_config", "symlink_escape")


# ----------------------------------------------------------------------------------------------
# Components
# ----------------------------------------------------------------------------------------------


def tiny_tokenizer() -> Qwen2Tokenizer:
    """Bytes-only byte-level BPE: <|endoftext|> + the 256 byte symbols, no merges (263 tokens)."""
    vocab = {"<|endoftext|>": 0}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<|endoftext|>", eos_token="<|im_end|>",
                          pad_token="<|endoftext|>", extra_special_tokens=SPECIAL_TOKENS, model_max_length=65536)


def tiny_processor(tokenizer: Optional[Qwen2Tokenizer] = None, patch: int = 16, merge: int = 2,
                   temporal: int = 2) -> Qwen3VLProcessor:
    # patch 16 x merge 2 -> the pipeline's smart-resize factor of 32.
    tokenizer = tokenizer or tiny_tokenizer()
    f = patch * merge
    common = dict(patch_size=patch, temporal_patch_size=temporal, merge_size=merge,
                  image_mean=[0.5] * 3, image_std=[0.5] * 3)
    ip = Qwen2VLImageProcessor(size={"shortest_edge": 4 * f * f, "longest_edge": 16384 * f * f}, **common)
    vp = Qwen3VLVideoProcessor(size={"shortest_edge": 4 * f * f, "longest_edge": 256 * f * f}, **common)
    return Qwen3VLProcessor(image_processor=ip, tokenizer=tokenizer, video_processor=vp)


def _fill_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Re-draw every floating parameter: norm weights ~ 1 + N(0, .05), everything else N(0, .05)."""
    with torch.no_grad():
        for name, p in module.named_parameters():  # tied weights are listed once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.05
            is_norm = p.ndim == 1 and "norm" in name and name.endswith("weight")
            p.copy_(noise + 1.0 if is_norm else noise)


def tiny_text_encoder(tokenizer: Optional[Qwen2Tokenizer] = None, seed: int = 0) -> Qwen3VLForConditionalGeneration:
    tokenizer = tokenizer or tiny_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    hidden = TEXT_HIDDEN
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=65536,
                         # sum(mrope_section) must be head_dim / 2
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                          "mrope_section": [4, 2, 2], "mrope_interleaved": True},
                         tie_word_embeddings=True),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=hidden, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    return text_encoder_from_config(cfg, seed)


def text_encoder_from_config(cfg, seed: int = 0) -> Qwen3VLForConditionalGeneration:
    """A Qwen3-VL model of config ``cfg`` with SDPA attention and the fixtures' random weights of ``seed``."""
    cfg._attn_implementation = "sdpa"
    # Construction draws from the global RNG; fork it so callers' RNG streams are untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(cfg).eval()
    _fill_(model, torch.Generator().manual_seed(seed))
    return model


def tiny_vae(seed: int = 0) -> AutoencoderKLWan:
    # dim_mult keeps 4 entries (x8 spatial); temperal_downsample [F, T, T] gives x4 in time.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                                temperal_downsample=[False, True, True],
                                latents_mean=WAN21_LATENTS_MEAN, latents_std=WAN21_LATENTS_STD).eval()


def tiny_wan21_vae(seed: int = 0) -> AutoencoderKLWan:
    """The released Wan 2.1 VAE architecture (dim_mult [1, 2, 4, 4], 2 residual blocks) at base width 4,
    the form ComfyUI's own Wan 2.1 VAE builds; ``tiny_vae`` is smaller but has no ComfyUI equivalent."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKLWan(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                temperal_downsample=[False, True, True],
                                latents_mean=WAN21_LATENTS_MEAN, latents_std=WAN21_LATENTS_STD).eval()


def dit_config(moe: bool = False) -> dict:
    return {**TINY_DENSE_CONFIG, **(TINY_MOE_EXTRA if moe else {})}


def dit_state_dict(config: dict, seed: int = 0, fp32: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """Random DiT weights under the checkpoint names, in storage dtype. Returns (state_dict, full config).

    The model is built on ``meta`` (no memory, no global RNG) only to get names, shapes and the config;
    every tensor is then drawn from one seeded generator in state_dict order.
    """
    with torch.device("meta"):
        model = LingBotVideoTransformer3DModel(**config)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, ref in model.state_dict().items():
        noise = torch.randn(ref.shape, generator=gen, dtype=torch.float32)
        leaf_module = name.split(".")[-2] if "." in name else ""
        if name.endswith("scale_shift_table"):
            t = noise * 0.1  # non-zero gates, so blocks are not identity maps
        elif leaf_module.startswith("norm") and name.endswith(".weight"):
            t = 1.0 + noise * 0.05
        else:  # weights, biases, expert tensors, router weight, e_score_correction_bias
            t = noise * 0.05
        out[name] = t if fp32 or is_fp32_island(name) else t.to(torch.bfloat16)
    return out, dict(model.config)


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()  # never follow a symlink into someone else's folder
    elif path.exists():
        shutil.rmtree(path)


def _fresh_dir(path: Path) -> Path:
    """Empty ``path`` (a stale single file next to new shards would confuse the loader)."""
    _remove(path)
    path.mkdir(parents=True)
    return path


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' save_pretrained draws a "Writing model shards" bar; keep fixture writes quiet."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_dit(folder: Path, config: dict, seed: int, fp32: bool = False, sharded: bool = False) -> Path:
    folder = _fresh_dir(Path(folder))
    state, full_config = dit_state_dict(config, seed, fp32)
    cfg = {"_class_name": "LingBotVideoTransformer3DModel", "_diffusers_version": DIFFUSERS_VERSION}
    cfg.update({k: v for k, v in full_config.items() if not k.startswith("_")})
    cfg = json.loads(json.dumps(cfg))  # tuples -> lists, as the released JSON
    _write_json(folder / "config.json", cfg)
    if not sharded:
        save_file(state, str(folder / DIT_WEIGHTS), metadata={"format": "pt"})
        return folder
    names = list(state)
    half = len(names) // 2
    shards = [names[:half], names[half:]]
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in shard}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    _write_json(folder / DIT_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return folder


def write_package(out_dir, *, moe: bool = False, seed: int = 0, fp32: bool = False, sharded: bool = False,
                  refiner: bool = True, scheduler_shift: float = 1.0, dit: Optional[dict] = None,
                  dmd: bool = False) -> Path:
    """Write a tiny LingBot-Video package into ``out_dir`` and return its path.

    Release-like dtypes by default (DiT bf16 with fp32 islands, text encoder bf16, VAE fp32);
    ``fp32=True`` stores everything in fp32 for exact CPU comparisons. ``dit`` overrides DiT config
    entries (e.g. ``{"hidden_size": 1024, "depth": 8}`` for a package big enough to measure memory with;
    ``text_dim`` must stay the tiny text encoder's width). ``dmd=True`` writes a DMD student's scheduler
    config (``DMD_SCHEDULER_CONFIG``, naming DMDStudentScheduler; ``scheduler_shift`` is then unused).
    """
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    _write_json(root / "model_index.json", dict(MODEL_INDEX, scheduler=DMD_MODEL_INDEX_SCHEDULER) if dmd else MODEL_INDEX)

    config = {**dit_config(moe), **(dit or {})}
    write_dit(root / "transformer", config, seed, fp32, sharded)
    if refiner:
        write_dit(root / "refiner", config, seed + 1, fp32, sharded)  # same names, different weights
    else:
        _remove(root / "refiner")

    tokenizer = tiny_tokenizer()
    te = tiny_text_encoder(tokenizer, seed)
    if not fp32:
        te = te.to(torch.bfloat16)
    with _no_progress_bars():
        te.save_pretrained(_fresh_dir(root / "text_encoder"))  # safetensors; tied lm_head kept
    tiny_processor(tokenizer).save_pretrained(_fresh_dir(root / "processor"))
    tiny_vae(seed).save_pretrained(_fresh_dir(root / "vae"))  # always fp32, as the release

    sched = dict(DMD_SCHEDULER_CONFIG) if dmd else dict(SCHEDULER_CONFIG, shift=float(scheduler_shift))
    _write_json(_fresh_dir(root / "scheduler") / "scheduler_config.json", sched)
    return root


def write_broken_packages(out_root) -> dict[str, Path]:
    """Negative fixtures: copies of a valid tiny dense package, each broken in one way (see BROKEN_VARIANTS).

    ``symlink_escape`` points ``transformer/`` at ``<out_root>_outside/transformer``, a sibling of out_root.
    """
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    base = write_package(_fresh_dir(out_root / ".base"), refiner=False)
    result = {}
    for variant in BROKEN_VARIANTS:
        dst = out_root / variant
        _remove(dst)
        shutil.copytree(base, dst)
        result[variant] = dst
        tdir = dst / "transformer"
        weights = tdir / DIT_WEIGHTS
        if variant == "missing_vae":
            shutil.rmtree(dst / "vae")
        elif variant == "no_model_index":
            (dst / "model_index.json").unlink()
        elif variant in ("wrong_shape", "missing_key", "unexpected_key"):
            state = load_file(str(weights))
            if variant == "wrong_shape":
                state[BROKEN_WRONG_SHAPE_KEY] = state[BROKEN_WRONG_SHAPE_KEY][:-1].clone()
            elif variant == "missing_key":
                del state[BROKEN_MISSING_KEY]
            else:
                state[BROKEN_UNEXPECTED_KEY] = torch.zeros(TINY_DENSE_CONFIG["hidden_size"], dtype=torch.bfloat16)
            save_file(state, str(weights), metadata={"format": "pt"})
        elif variant == "pickle_only":
            torch.save(load_file(str(weights)), tdir / "diffusion_pytorch_model.bin")
            weights.unlink()
        elif variant == "truncated":
            data = weights.read_bytes()
            weights.write_bytes(data[: len(data) // 2])
        elif variant == "bad_config":
            cfg = json.loads((tdir / "config.json").read_text())
            cfg["hidden_size"] = 65  # 65 / 2 heads: head_dim does not divide
            _write_json(tdir / "config.json", cfg)
        elif variant == "symlink_escape":
            outside = out_root.parent / f"{out_root.name}_outside"
            target = _fresh_dir(outside) / "transformer"
            shutil.move(str(tdir), str(target))
            tdir.symlink_to(target.resolve(), target_is_directory=True)
    shutil.rmtree(base)
    return result


def main(argv: Optional[Sequence[str]] = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m lingbot_core.testing.fixtures", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="package folder to write")
    p.add_argument("--moe", action="store_true", help="MoE DiT instead of dense")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp32", action="store_true", help="store every component in fp32")
    p.add_argument("--sharded", action="store_true", help="write the DiT as 2 shards + index")
    p.add_argument("--no-refiner", dest="refiner", action="store_false", help="omit refiner/")
    p.add_argument("--shift", type=float, default=1.0, help="scheduler shift")
    p.add_argument("--dmd", action="store_true", help="a DMD student's scheduler config (DMDStudentScheduler)")
    a = p.parse_args(argv)
    root = write_package(a.out, moe=a.moe, seed=a.seed, fp32=a.fp32, sharded=a.sharded, refiner=a.refiner,
                         scheduler_shift=a.shift, dmd=a.dmd)
    print(root)
    return root


if __name__ == "__main__":
    main()
