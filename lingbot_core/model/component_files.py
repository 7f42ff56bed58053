"""Single-file text encoder and VAE, as ComfyUI users have them (docs/file-formats.md).

- VAE (``models/vae``): the Wan 2.1 VAE under its original names (``decoder.middle.0.residual.0.gamma``,
  Comfy-Org's ``wan_2.1_vae.safetensors``), converted with diffusers' own
  ``convert_wan_vae_to_diffusers``, or already under diffusers' names. Its config is the package's
  ``vae/config.json`` when there is one, else the Wan 2.1 config the pack ships (``data/``).
- Text encoder (``models/text_encoders``): Qwen3-VL-4B in one safetensors file, under HF names
  (``model.language_model.layers.0...``, ``model.visual...``) or ComfyUI's internal names
  (``model.layers.0...``, ``visual...``); ``lm_head`` absent (tied to the embeddings); fp8_scaled files'
  weights are multiplied by their ComfyUI scales (``scale_weight`` / ``weight_scale``) on load; or
  llama.cpp's text-model GGUF (:mod:`lingbot_core.model.text_encoder_gguf`, T2V only). The
  Qwen3-VL config comes from the package's ``text_encoder/config.json`` when there is one, else the
  Qwen3-VL-4B config the pack ships (``data/qwen3vl/config.json``, from the official release).
- Processor: the Qwen3-VL tokenizer (Qwen2.5's byte-level BPE plus Qwen3-VL's added tokens) and image
  processor settings ship in ``data/qwen3vl/`` (Apache-2.0, see its NOTICE.md); a package's own
  ``processor/`` wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import torch

from ..files.checkpoint_files import ModelPackageError, SafetensorsReader, read_config
from ..files.fp8 import is_fp8

DATA = Path(__file__).resolve().parents[1] / "data"
WAN21_VAE_CONFIG = DATA / "wan21_vae_config.json"
QWEN3VL_DIR = DATA / "qwen3vl"  # tokenizer, processor settings and the Qwen3-VL-4B config (Apache-2.0)

_ORIGINAL_VAE_KEY = "decoder.middle.0.residual.0.gamma"
_DIFFUSERS_VAE_KEY = "decoder.mid_block.resnets.0.norm1.gamma"
_VAE_FOREIGN = (
    ("decoder.mid.block_1.norm1.weight", "a Stable Diffusion / Flux VAE (ldm layout)"),
    ("first_stage_model.", "a whole Stable Diffusion checkpoint"),
    ("encoder.down_blocks.0.resnets.0.norm1.weight", "a diffusers AutoencoderKL (SD/Flux)"),
)
_QWEN_VISUAL_KEY = "visual.deepstack_merger_list.0.norm.weight"


def vae_config(package_vae: Optional[Path], vae_file=None) -> dict:
    """The package's VAE config when it has one (it wins), else the shipped Wan 2.1 config; with a
    ``vae_file``, at the base width its first convolution has (as ComfyUI reads a Wan 2.1 VAE: the
    released file is 96 wide, the test fixtures' are smaller)."""
    if package_vae is not None and (Path(package_vae) / "config.json").is_file():
        return read_config(Path(package_vae), "vae")
    config = json.loads(WAN21_VAE_CONFIG.read_text(encoding="utf-8"))
    if vae_file is not None:
        reader = SafetensorsReader(Path(vae_file))
        keys = reader.keys()
        for key in ("encoder.conv1.weight", "encoder.conv_in.weight"):  # original, diffusers names
            if key in keys:
                config["base_dim"] = int(reader.shape(key)[0])
                break
    return config


def _what(keys, table) -> str:
    for key, what in table:
        if any(k == key or k.startswith(key) for k in keys):
            return f"; it looks like {what}"
    return ""


def load_vae_file(path, dtype: torch.dtype, config: dict):
    """The Wan 2.1 VAE of a single safetensors file (original or diffusers names), strictly checked."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    path = Path(path)
    reader = SafetensorsReader(path)
    keys = reader.keys()
    if _ORIGINAL_VAE_KEY in keys:
        state = convert_wan_vae_to_diffusers({k: reader.get(k) for k in keys})
    elif _DIFFUSERS_VAE_KEY in keys:
        state = {k: reader.get(k) for k in keys}
    else:
        raise ModelPackageError(f"vae: {path.name} is not a Wan 2.1 VAE (no {_ORIGINAL_VAE_KEY}{_what(keys, _VAE_FOREIGN)}); "
                                "expected the Wan 2.1 VAE, e.g. Comfy-Org's wan_2.1_vae.safetensors.")
    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    expected = vae.state_dict()
    z = config.get("z_dim", 16)
    conv = state.get("decoder.conv_in.weight")
    if conv is not None and conv.shape[1] != z:
        family = "a Wan 2.2 VAE (48 latent channels)" if conv.shape[1] == 48 else f"a VAE with {conv.shape[1]} latent channels"
        raise ModelPackageError(f"vae: {path.name} is {family}; LingBot-Video uses the Wan 2.1 VAE ({z} latent channels).")
    wrong = [k for k in expected if k not in state or tuple(state[k].shape) != tuple(expected[k].shape)]
    extra = [k for k in state if k not in expected]
    if wrong or extra:
        sample = ", ".join((wrong + extra)[:3])
        raise ModelPackageError(f"vae: {path.name} does not match the Wan 2.1 VAE config ({len(wrong)} tensors missing or "
                                f"of another shape, {len(extra)} unexpected: {sample}).")
    vae.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return vae.eval().requires_grad_(False)


# -- text encoder ------------------------------------------------------------------------------------


def _hf_name(key: str) -> str:
    """A Qwen3-VL checkpoint key under the HF names ``Qwen3VLForConditionalGeneration`` loads."""
    if key.startswith("model.language_model.") or key.startswith("model.visual.") or key == "lm_head.weight":
        return key
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model."):  # ComfyUI's internal text-model names: model.layers.*, model.embed_tokens, model.norm
        return "model.language_model." + key[len("model."):]
    return key


def text_encoder_state(path, dtype: torch.dtype, text_config) -> Dict[str, torch.Tensor]:
    """The file's tensors under HF names in ``dtype``, fp8 weights descaled; checked to be Qwen3-VL of the
    size ``text_config`` describes (hidden size, vision tower present)."""
    path = Path(path)
    reader = SafetensorsReader(path)
    keys = reader.keys()
    if not any(k.endswith(_QWEN_VISUAL_KEY) for k in keys):
        raise ModelPackageError(f"text_encoder: {path.name} is not a Qwen3-VL text encoder with its vision tower "
                                f"(no {_QWEN_VISUAL_KEY}); expected Qwen3-VL-4B, e.g. Comfy-Org's qwen3vl_4b_bf16.safetensors.")
    scales: Dict[str, str] = {}
    for k in keys:
        owner, _, leaf = k.rpartition(".")
        if leaf in ("scale_weight", "weight_scale"):
            scales[f"{owner}.weight"] = k
    state = {}
    for k in keys:
        leaf = k.rpartition(".")[2]
        if leaf in ("scale_weight", "weight_scale", "scale_input", "input_scale") or k in ("scaled_fp8",):
            continue
        t = reader.get(k)
        if k in scales or is_fp8(t.dtype):
            w = t.to(torch.float32)
            if k in scales:
                w = w * reader.get(scales[k]).to(torch.float32)
            t = w
        state[_hf_name(k)] = t.to(dtype) if t.is_floating_point() else t
    embed = state.get("model.language_model.embed_tokens.weight")
    hidden = text_config.hidden_size
    if embed is None or embed.shape[1] != hidden:
        got = "no embed_tokens" if embed is None else f"hidden size {embed.shape[1]}"
        raise ModelPackageError(f"text_encoder: {path.name} is a Qwen3-VL of {got}; LingBot-Video needs Qwen3-VL-4B "
                                f"(hidden size {hidden}).")
    return state


def sidecar_config(path) -> Path:
    """A config beside a single file, read in its place (as other tools read ``<model>.yaml`` beside a
    checkpoint): ``qwen3vl_small.safetensors`` -> ``qwen3vl_small.json``."""
    return Path(path).with_suffix(".json")


def text_encoder_config(config_folder: Optional[Path] = None, path=None):
    """The Qwen3-VL config of a single-file text encoder ``path``: a ``<file stem>.json`` beside the file
    when there is one, else the package's ``text_encoder/config.json`` (``config_folder``) when there is
    one, else the shipped Qwen3-VL-4B config."""
    from transformers import AutoConfig, Qwen3VLConfig

    side = None if path is None else sidecar_config(path)
    if side is not None and side.is_file():
        try:
            return Qwen3VLConfig(**json.loads(side.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as e:
            raise ModelPackageError(f"text_encoder: {side.name} (the config beside {Path(path).name}) is not a "
                                    f"Qwen3-VL config ({e}).") from None
    folder = Path(config_folder) if config_folder is not None and (Path(config_folder) / "config.json").is_file() else QWEN3VL_DIR
    return AutoConfig.from_pretrained(str(folder), local_files_only=True)


def load_text_encoder_file(path, dtype: torch.dtype, config_folder: Optional[Path] = None, config=None):
    """Qwen3-VL from one file (safetensors, or a llama.cpp text-model GGUF). Its config: ``config`` (a
    ``Qwen3VLConfig`` or its dict) when given, else
    :func:`text_encoder_config` (beside the file, the package's, else the shipped 4B). The file's shapes
    must match it."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if config is None:
        config = text_encoder_config(config_folder, path)
    elif isinstance(config, dict):
        config = Qwen3VLConfig(**config)
    from .text_encoder_gguf import is_gguf

    if is_gguf(path):  # llama.cpp's text model (see text_encoder_gguf)
        from .text_encoder_gguf import load_text_encoder_gguf

        return load_text_encoder_gguf(path, dtype, config)
    state = text_encoder_state(path, dtype, config.text_config)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Qwen3VLForConditionalGeneration(config).state_dict().items()}
    missing = [k for k in expected if k not in state and k != "lm_head.weight"]
    unexpected = [k for k in state if k not in expected]
    wrong = [k for k in state if k in expected and tuple(state[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        sample = ", ".join((missing + unexpected + wrong)[:3])
        raise ModelPackageError(f"text_encoder: {Path(path).name} does not match the Qwen3-VL config ({len(missing)} missing, "
                                f"{len(unexpected)} unexpected, {len(wrong)} of another shape: {sample}).")
    try:
        # transformers builds the model without initialising it, assigns the tensors, rebuilds the rotary
        # buffers and ties lm_head to the embeddings (the file has no lm_head, as the release).
        model = Qwen3VLForConditionalGeneration.from_pretrained(
            None, config=config, state_dict=state, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelPackageError(f"text_encoder: {Path(path).name} does not match the Qwen3-VL config ({e}).") from None
    return model
