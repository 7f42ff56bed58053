"""Loading a LingBot-Video model package, component by component, from safetensors only.

``DiffusionPipeline.from_pretrained`` cannot load the released package (its ``model_index.json``
names the reference's own modules), and importing those would mean running code from the model
folder. So ``model_index.json`` is only checked, and each component is built from a class this pack
owns or trusts, with weights read from ``*.safetensors`` files alone.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Dict, Optional

import torch

from .offload import check_blocks_on_gpu, check_offload_mode, resolve_device
from .pipeline import LingbotPipeline
from .scheduling import load_scheduler_config
from .transformer import LingBotVideoTransformer3DModel, is_fp32_island

logger = logging.getLogger("lingbot_core")

COMPONENTS = ("transformer", "text_encoder", "vae")
TRANSFORMER_SUBFOLDERS = ("transformer", "refiner")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ModelPackageError(ValueError):
    """A model folder that is missing a component or holds invalid weights; the message says which."""


def default_dtypes(device: torch.device) -> Dict[str, torch.dtype]:
    low = torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"transformer": low, "text_encoder": low, "vae": torch.float32}


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value in DTYPES:
        return DTYPES[value]
    raise ValueError(f"dtype {value!r} is not supported; use one of {', '.join(DTYPES)} or a torch dtype.")


def safetensors_files(folder: Path, component: str, stem: str) -> list:
    """The safetensors files of a component (single file or the shards of an index); refuses pickles."""
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelPackageError(f"{component}: {index.name} is not a valid safetensors index ({e}).") from None
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if f.suffix != ".safetensors" or f.parent != folder:
                raise ModelPackageError(f"{component}: the index names {f.name}, which is not a safetensors file in {folder}.")
            if not f.is_file():
                raise ModelPackageError(f"{component}: shard {f.name} listed in {index.name} is missing from {folder}.")
        return files
    single = folder / f"{stem}.safetensors"
    if single.is_file():
        return [single]
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    if found:
        return [folder / n for n in found]
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelPackageError(
            f"{component}: {folder} holds only pickle weights ({', '.join(pickles)}); they are refused because loading "
            "them can run arbitrary code. Download the .safetensors files of the release instead."
        )
    raise ModelPackageError(f"{component}: no .safetensors weights found in {folder}.")


def load_transformer(folder: Path, dtype: torch.dtype, name: str = "transformer") -> LingBotVideoTransformer3DModel:
    """Build the DiT on ``meta`` from ``config.json`` and assign the checkpoint's tensors (one copy in RAM).

    Every name and shape is checked; fp32 islands stay fp32 whatever ``dtype`` is.
    """
    from safetensors import SafetensorError, safe_open

    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelPackageError(f"{name}: {config_path} is missing.") from None
    except ValueError as e:
        raise ModelPackageError(f"{name}: {config_path} is not valid JSON ({e}).") from None
    try:
        with torch.device("meta"):
            model = LingBotVideoTransformer3DModel.from_config(config)
    except (TypeError, ValueError) as e:
        raise ModelPackageError(f"{name}: config.json describes an invalid model: {e}") from None
    expected = {k: v.shape for k, v in model.state_dict().items()}
    seen = set()
    for path in safetensors_files(folder, name, "diffusion_pytorch_model"):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                shard = {}
                for key in f.keys():
                    if key not in expected:
                        raise ModelPackageError(f"{name}: {path.name} has tensor {key!r}, which this model config does not have.")
                    tensor = f.get_tensor(key)
                    if tuple(tensor.shape) != tuple(expected[key]):
                        raise ModelPackageError(
                            f"{name}: tensor {key!r} in {path.name} has shape {list(tensor.shape)}, but config.json "
                            f"implies {list(expected[key])}. The weights do not match the config."
                        )
                    target = torch.float32 if is_fp32_island(key) else dtype
                    shard[key] = tensor.to(target) if tensor.is_floating_point() else tensor
                    seen.add(key)
        except SafetensorError as e:
            raise ModelPackageError(f"{name}: {path.name} is not a readable safetensors file ({e}); it may be truncated, download it again.") from None
        model.load_state_dict(shard, strict=False, assign=True)
        del shard
    missing = sorted(set(expected) - seen)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelPackageError(f"{name}: the checkpoint is missing {len(missing)} tensors: {', '.join(missing[:3])}{more}.")
    return model.eval().requires_grad_(False)


def check_package(model_dir, transformer_subfolder: str = "transformer") -> Path:
    """Check the folder is a released package with safetensors weights for every component (cheap: no
    weights are read); raise a ModelPackageError naming what is missing."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelPackageError(f"model folder {root} does not exist.")
    if transformer_subfolder not in TRANSFORMER_SUBFOLDERS:
        raise ValueError(f"transformer_subfolder={transformer_subfolder!r} is not allowed; use 'transformer' or 'refiner'.")
    if not (root / "model_index.json").is_file():
        raise ModelPackageError(f"{root} has no model_index.json; point at the root of a LingBot-Video package.")
    for sub in (transformer_subfolder, "text_encoder", "processor", "vae"):
        if not (root / sub).is_dir():
            hint = " (only the MoE package ships a refiner)" if sub == "refiner" else ""
            raise ModelPackageError(f"{root} is missing the {sub}/ folder{hint}.")
    for sub, stem in ((transformer_subfolder, "diffusion_pytorch_model"), ("text_encoder", "model"), ("vae", "diffusion_pytorch_model")):
        for path in safetensors_files(root / sub, sub, stem):
            _check_readable(path, sub)
    return root


def _check_readable(path: Path, component: str) -> None:
    """Open a safetensors file's header only (no tensor is read); a truncated file fails here."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu"):
            pass
    except (SafetensorError, OSError) as e:
        raise ModelPackageError(
            f"{component}: {path.name} is not a readable safetensors file ({e}); it may be truncated, download it again."
        ) from None


def load_pipeline(model_dir, *, transformer_subfolder: str = "transformer", offload: str = "none",
                  device=None, dtypes: Optional[dict] = None, blocks_on_gpu: int = 0) -> LingbotPipeline:
    """Load a LingBot-Video package from ``model_dir`` and place it per ``offload``.

    ``dtypes`` maps component names (``transformer``, ``text_encoder``, ``vae``) to torch dtypes or
    ``"bf16"``/``"fp16"``/``"fp32"``; missing keys default to bf16 DiT and text encoder on CUDA (fp32 on
    CPU) and an fp32 VAE.
    """
    from diffusers import AutoencoderKLWan
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    check_offload_mode(offload)
    check_blocks_on_gpu(blocks_on_gpu)
    device = resolve_device(device)
    chosen = default_dtypes(device)
    for key, value in (dtypes or {}).items():
        if key not in chosen:
            raise ValueError(f"dtypes has unknown component {key!r}; use {', '.join(chosen)}.")
        chosen[key] = _dtype(value)
    root = check_package(model_dir, transformer_subfolder)

    transformer = load_transformer(root / transformer_subfolder, chosen["transformer"], transformer_subfolder)
    common = dict(local_files_only=True, use_safetensors=True)
    try:
        text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(
            root, subfolder="text_encoder", dtype=chosen["text_encoder"], attn_implementation="sdpa", **common
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelPackageError(f"text_encoder: could not load {root / 'text_encoder'}: {e}") from None
    # Only the final hidden states are used; an Identity head makes the hooked top-level call return them.
    text_encoder.lm_head = torch.nn.Identity()
    text_encoder.eval().requires_grad_(False)
    try:
        processor = Qwen3VLProcessor.from_pretrained(root, subfolder="processor", local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ModelPackageError(f"processor: could not load {root / 'processor'}: {e}") from None
    try:
        vae = AutoencoderKLWan.from_pretrained(root, subfolder="vae", torch_dtype=chosen["vae"], **common)
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelPackageError(f"vae: could not load {root / 'vae'}: {e}") from None
    vae.eval().requires_grad_(False)
    scheduler_config = load_scheduler_config(str(root / "scheduler" / "scheduler_config.json"))
    if float(scheduler_config.get("shift", 1.0)) != 1.0:
        logger.info("scheduler_config.json has shift=%s; ignored (the shift is a sampling argument).", scheduler_config["shift"])
    return LingbotPipeline(
        transformer, text_encoder, processor, vae, scheduler_config, model_dir=str(root),
        transformer_subfolder=transformer_subfolder, offload=offload, device=device, blocks_on_gpu=blocks_on_gpu,
    )
