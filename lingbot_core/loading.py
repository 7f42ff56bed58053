"""Loading a LingBot-Video model package, component by component, from safetensors only.

``DiffusionPipeline.from_pretrained`` cannot load the released package (its ``model_index.json``
names the reference's own modules), and importing those would mean running code from the model
folder. So ``model_index.json`` is only checked, and each component is built from a class this pack
owns or trusts, with weights read from ``*.safetensors`` files alone.
"""

from __future__ import annotations

import functools
import logging
import struct
from pathlib import Path
from typing import Dict, Optional

import torch

from .files.checkpoint_files import (
    ModelPackageError, SafetensorsReader, check_readable, checkpoint_tensor, read_config, safetensors_files,
    safetensors_header,
)
from .model.dit_files import DitFile, file_checkpoint_tensor, load_dit_file, meta_model, transformer_config
from .files.fp8 import (
    FP8_COMPUTE_DTYPE, FP8_DTYPES, checkpoint_scale, dequantize, is_fp8, is_quantized_name, quantize, scale_name,
    scale_shape, stored_in_compute_dtype,
)
from .memory.offload import check_blocks_on_gpu, check_offload_mode, resolve_device
from .pipeline import LingbotPipeline
from .model.precision import auto_dtypes, fp8_compute_dtype
from .model.attention import diffusers_backend
from .memory.placement import check_component_devices
from .sampling.scheduling import load_scheduler_config
from .sampling.speed import SpeedOptions
from .model.transformer import LingBotVideoTransformer3DModel, align_islands, is_fp32_island, kernel_aligned

logger = logging.getLogger("lingbot_core")

COMPONENTS = ("transformer", "text_encoder", "vae")
TRANSFORMER_SUBFOLDERS = ("transformer", "refiner")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Choices for the DiT: the above plus fp8 weight storage (computed in bf16).
DIT_DTYPES = {**DTYPES, **FP8_DTYPES}


def default_dtypes(device: torch.device, capability=None, log: bool = False,
                   devices: Optional[dict] = None) -> Dict[str, torch.dtype]:
    """The ``auto`` dtypes for ``device`` (by compute capability on CUDA; see :mod:`lingbot_core.model.precision`).
    ``devices`` (component -> device overrides) makes the text encoder's default follow its own device."""
    chosen = auto_dtypes(device, capability, log=log)
    other = (devices or {}).get("text_encoder")
    if other is not None and torch.device(other) != torch.device(device):
        chosen["text_encoder"] = auto_dtypes(torch.device(other), log=log)["text_encoder"]
    return chosen


def _dtype(value, allowed: Dict[str, torch.dtype] = DTYPES, component: str = "") -> torch.dtype:
    if isinstance(value, torch.dtype) and (value in allowed.values() or not is_fp8(value)):
        return value
    if isinstance(value, str) and value in allowed:
        return allowed[value]
    where = f" for {component}" if component else ""
    raise ValueError(f"dtype {value!r} is not supported{where}; use one of {', '.join(allowed)} or a torch dtype.")


def load_transformer(folder: Path, dtype: torch.dtype, name: str = "transformer",
                     island_copies: bool = False) -> LingBotVideoTransformer3DModel:
    """Build the DiT on ``meta`` from ``config.json`` and assign the checkpoint's tensors (one copy in RAM).

    Every name and shape is checked; fp32 islands stay fp32 whatever ``dtype`` is. With an fp8
    ``dtype`` the block Linear weights are stored in fp8 with a scale (:mod:`lingbot_core.files.fp8`), the
    other tensors in bf16 except the islands computed in fp32. fp8 checkpoints (fp8 ``weight`` + ``scale_weight``, ComfyUI's
    "fp8 scaled" convention) load under any ``dtype``.

    ``island_copies`` (a DiT computed on the CPU) reads the fp32 islands with plain file reads into
    64-byte aligned memory of their own instead of mapping them at the file's offsets (see
    :func:`~lingbot_core.model.transformer.align_islands`): their mapped pages are never touched, so
    the copies cost no RSS beyond the islands' bytes.
    """
    from safetensors import SafetensorError

    model = _transformer_on_meta(folder, name)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    fp8 = is_fp8(dtype)
    plain = FP8_COMPUTE_DTYPE if fp8 else dtype  # non-island tensors that are not quantized
    readers = [SafetensorsReader(path) for path in safetensors_files(folder, name, "diffusion_pytorch_model")]
    # Scales stored next to fp8 weights (ComfyUI convention), keyed by the weight they scale.
    stored_scales = {}
    for reader in readers:
        for key in reader.keys():
            target = _checkpoint_extra(name, reader.path, key, expected)
            if target is not None:
                stored_scales[target] = reader
    seen = set()
    scales = {}
    try:
        for reader in readers:
            shard = {}
            for key in reader.keys():
                if key not in expected:
                    continue
                shape = reader.shape(key)
                _check_tensor(name, reader.path, key, expected, tuple(shape))
                converted = fp8 and is_quantized_name(key)  # read into a reused buffer: only the fp8 copy is kept
                island_copy = island_copies and is_fp32_island(key)
                tensor = reader.get(key, scratch=converted or island_copy)
                scale = None
                if key in stored_scales:
                    try:
                        scale = checkpoint_scale(key, stored_scales[key].get(scale_name(key)), shape)
                    except ValueError as e:
                        raise ModelPackageError(f"{name}: {e}") from None
                if is_fp32_island(key):
                    target = plain if fp8 and stored_in_compute_dtype(key) else torch.float32
                elif fp8 and is_quantized_name(key):
                    target = dtype
                else:
                    target = plain
                if not tensor.is_floating_point():
                    shard[key] = tensor
                elif target == dtype and fp8:
                    if tensor.dtype == dtype and scale is not None:
                        shard[key], scales[key] = tensor.clone(), scale  # already stored as wanted
                    elif tensor.dtype == dtype:
                        shard[key], scales[key] = tensor.clone(), checkpoint_scale(key, torch.ones(()), shape)
                    else:
                        source = dequantize(tensor, scale, FP8_COMPUTE_DTYPE) if (scale is not None or is_fp8(tensor.dtype)) else tensor
                        shard[key], scales[key] = quantize(source, dtype, scale_shape(key, shape))
                elif scale is not None or is_fp8(tensor.dtype):
                    shard[key] = dequantize(tensor, scale, target)
                else:
                    shard[key] = tensor.to(target)
                if island_copy and shard[key].untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                    shard[key] = shard[key].clone()  # still the reused read buffer: a copy of its own (aligned)
                del tensor
                seen.add(key)
            model.load_state_dict(shard, strict=False, assign=True)
            del shard
    except (SafetensorError, OSError, ValueError) as e:
        if isinstance(e, ModelPackageError):
            raise
        raise ModelPackageError(f"{name}: a weights file is not a readable safetensors file ({e}); it may be truncated, download it again.") from None
    _check_complete(name, expected, seen)
    for key, scale in scales.items():
        owner, _, leaf = key.rpartition(".")
        setattr(model.get_submodule(owner), f"scale_{leaf}", scale)  # a registered (None) buffer until now
    return model.eval().requires_grad_(False)


def _transformer_on_meta(folder: Path, name: str) -> LingBotVideoTransformer3DModel:
    """The DiT described by ``config.json``, built on ``meta`` (no memory)."""
    return meta_model(read_config(folder, name), name, "config.json")


def _checkpoint_extra(name: str, path: Path, key: str, expected: dict) -> Optional[str]:
    """A checkpoint key that is not a model tensor: the weight it scales (ComfyUI's fp8 ``scale_weight``),
    None for a known marker or a model tensor, or an error for anything else."""
    if key in expected or key in IGNORED_CHECKPOINT_KEYS or key.endswith(".scale_input"):
        return None
    prefix, _, leaf = key.rpartition(".")
    target = f"{prefix}.{leaf[len('scale_'):]}" if leaf.startswith("scale_") else None
    if target not in expected:
        raise ModelPackageError(f"{name}: {path.name} has tensor {key!r}, which this model config does not have.")
    return target


def _check_tensor(name: str, path: Path, key: str, expected: dict, shape: Optional[tuple] = None) -> None:
    if key not in expected:
        raise ModelPackageError(f"{name}: {path.name} has tensor {key!r}, which this model config does not have.")
    if shape is not None and tuple(shape) != tuple(expected[key]):
        raise ModelPackageError(
            f"{name}: tensor {key!r} in {path.name} has shape {list(shape)}, but config.json "
            f"implies {list(expected[key])}. The weights do not match the config."
        )


def _check_complete(name: str, expected: dict, seen: set) -> None:
    missing = sorted(set(expected) - seen)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelPackageError(f"{name}: the checkpoint is missing {len(missing)} tensors: {', '.join(missing[:3])}{more}.")


def check_transformer(folder: Path, name: str = "transformer") -> None:
    """Every check of :func:`load_transformer` (config, tensor names and shapes, completeness), from the
    safetensors headers alone: a lazy loader reports a broken DiT before any weight is read."""
    expected = {k: v.shape for k, v in _transformer_on_meta(folder, name).state_dict().items()}
    seen = set()
    for path in safetensors_files(folder, name, "diffusion_pytorch_model"):
        try:
            header = safetensors_header(path)
        except (OSError, ValueError, UnicodeDecodeError, struct.error) as e:
            raise ModelPackageError(
                f"{name}: {path.name} is not a readable safetensors file ({e}); it may be truncated, download it again."
            ) from None
        for key, info in header.items():
            if key not in expected:
                _checkpoint_extra(name, path, key, expected)  # fp8 scales and markers pass, anything else fails
                continue
            _check_tensor(name, path, key, expected, tuple(info.get("shape", ())))
            seen.add(key)
    _check_complete(name, expected, seen)


# Keys of community fp8 checkpoints that carry no weight (a format marker).
IGNORED_CHECKPOINT_KEYS = frozenset({"scaled_fp8"})

def _islands_aligned(read):
    """``read(key, dtype)`` with fp32 islands given aligned memory (:func:`align_islands`)."""
    def read_aligned(key: str, dtype: torch.dtype) -> torch.Tensor:
        tensor = read(key, dtype)
        return kernel_aligned(tensor) if is_fp32_island(key) else tensor
    return read_aligned


def check_package(model_dir, transformer_subfolder: str = "transformer", files: Optional[dict] = None) -> Optional[Path]:
    """Check the folder is a released package with safetensors weights for every component (cheap: no
    weights are read); raise a ModelPackageError naming what is missing.

    ``files`` (component -> single file, see :func:`load_pipeline`) replaces those components: the folder
    then need not hold them, nor ``model_index.json``. With all three files ``model_dir`` may be None (the
    processor and the Qwen3-VL config ship with the pack); returns the folder, or None."""
    files = {k: v for k, v in (files or {}).items() if v}
    if transformer_subfolder not in TRANSFORMER_SUBFOLDERS:
        raise ValueError(f"transformer_subfolder={transformer_subfolder!r} is not allowed; use 'transformer' or 'refiner'.")
    if model_dir is None:
        missing = [FILE_OPTIONS[c] for c in COMPONENTS if c not in files]
        if missing:
            raise ModelPackageError(
                "without a model package folder the pipeline is made of three files: the DiT, the Qwen3-VL-4B text "
                f"encoder and the Wan 2.1 VAE; {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing "
                "(or give the package folder that provides them).")
        return None
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelPackageError(f"model folder {root} does not exist.")
    if not files and not (root / "model_index.json").is_file():
        raise ModelPackageError(f"{root} has no model_index.json; point at the root of a LingBot-Video package.")
    folders = {"transformer": transformer_subfolder, "text_encoder": "text_encoder", "vae": "vae"}
    for sub in [folders[c] for c in COMPONENTS if c not in files] + ([] if files else ["processor"]):
        if not (root / sub).is_dir():
            hint = " (only the MoE package ships a refiner)" if sub == "refiner" else ""
            raise ModelPackageError(f"{root} is missing the {sub}/ folder{hint}.")
    for comp, stem in (("transformer", "diffusion_pytorch_model"), ("text_encoder", "model"), ("vae", "diffusion_pytorch_model")):
        if comp in files:
            continue
        sub = folders[comp]
        for path in safetensors_files(root / sub, sub, stem):
            check_readable(path, sub)
    return root


# The load_pipeline / command-line option naming each component's single file.
FILE_OPTIONS = {"transformer": "transformer_file", "text_encoder": "text_encoder_file", "vae": "vae_file"}


def load_processor(model_dir=None):
    """The Qwen3-VL processor (tokenizer + image processor): the package's own ``processor/`` when
    ``model_dir`` has one, else the one shipped with the pack (``data/qwen3vl``: Qwen3-VL's tokenizer and
    image-processor settings)."""
    from transformers import Qwen3VLProcessor

    from .model.component_files import QWEN3VL_DIR

    own = None if model_dir is None else Path(model_dir) / "processor"
    folder = own if own is not None and own.is_dir() else QWEN3VL_DIR
    try:
        return Qwen3VLProcessor.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        where = f"{folder}" if folder is own else "the processor shipped with the pack (lingbot_core/data/qwen3vl)"
        raise ModelPackageError(f"processor: could not load {where}: {e}") from None


def check_loras(loras, model_dir, transformer_subfolder: str = "transformer", transformer_file=None):
    """Check a LoRA stack against a package's DiT (or a single-file DiT) from headers and configs alone (no
    weight is read); returns the normalized stack. Raises :class:`~lingbot_core.model.lora.LoraError` naming the file."""
    from .model.lora import inspect_lora, lora_targets, normalize_stack

    stack = normalize_stack(loras)
    if stack:
        root = Path(model_dir) if model_dir is not None else None
        targets = lora_targets(meta_model(transformer_config(root, transformer_subfolder, transformer_file),
                                          transformer_subfolder))
        for path, _ in stack:
            inspect_lora(path, targets)
    return stack


def load_pipeline(model_dir=None, *, transformer_subfolder: str = "transformer", offload: str = "none",
                  device=None, dtypes: Optional[dict] = None, blocks_on_gpu: int = 0, attention: str = "sdpa",
                  compile_blocks: bool = False, cfg_lockstep: bool = True, loras=None,
                  devices: Optional[dict] = None, transformer_file=None, text_encoder_file=None,
                  vae_file=None, text_encoder_config=None) -> LingbotPipeline:
    """Load a LingBot-Video package from ``model_dir`` and place it per ``offload``.

    ``transformer_file`` / ``text_encoder_file`` / ``vae_file`` replace that component of the package by
    a single file as ComfyUI users have them (see :mod:`lingbot_core.model.dit_files` and
    :mod:`lingbot_core.model.component_files`): a GGUF or safetensors DiT (loaded as the ``transformer_subfolder``
    role; the package's own ``config.json`` wins over the config its shapes imply), the Qwen3-VL-4B text
    encoder file (safetensors, or llama.cpp's text GGUF with an optional ``mmproj*.gguf`` beside it: see
    :mod:`lingbot_core.model.text_encoder_gguf`), the Wan 2.1 VAE file. With all three files ``model_dir`` may be None: the processor
    (tokenizer) and the Qwen3-VL-4B config ship with the pack, the scheduler takes the release's defaults
    and the DiT's config comes from its shapes. A package's own ``processor/``, ``text_encoder/config.json``
    and ``vae/config.json`` win when ``model_dir`` is given. ``text_encoder_config`` (a ``Qwen3VLConfig``
    or its dict) replaces the Qwen3-VL config of a ``text_encoder_file`` (a smaller test model).

    ``dtypes`` maps component names (``transformer``, ``text_encoder``, ``vae``) to torch dtypes or
    ``"bf16"``/``"fp16"``/``"fp32"`` (the transformer also ``"fp8_e4m3fn"``/``"fp8_e5m2"``: fp8 weight
    storage, computed in ``auto``'s DiT dtype for the device: bf16, fp16 below sm80); missing keys default to bf16 DiT and text encoder on CUDA (fp32 on CPU) and
    an fp32 VAE. ``blocks_on_gpu`` is the number of DiT blocks kept resident under ``offload="block"``.
    ``attention``, ``compile_blocks`` and ``cfg_lockstep`` are the speed options of
    :meth:`LingbotPipeline.set_speed` (checked before any weight is read).
    ``loras`` (``[(path, strength), ...]``) is applied to the DiT (see :meth:`LingbotPipeline.set_loras`);
    the files are checked before any weight is read.
    ``devices`` optionally puts the text encoder and/or the VAE on another device than the DiT
    (``{"text_encoder": "cuda:1"}``; see ``placement.py``); their default dtype follows their device.
    """
    from diffusers import AutoencoderKLWan
    from transformers import Qwen3VLForConditionalGeneration

    check_offload_mode(offload)
    check_blocks_on_gpu(blocks_on_gpu)
    device = resolve_device(device)
    devices = check_component_devices(devices)
    chosen = default_dtypes(device, log=not set(dtypes or {}) >= set(COMPONENTS), devices=devices)  # log what auto chose
    for key, value in (dtypes or {}).items():
        if key not in chosen:
            raise ValueError(f"dtypes has unknown component {key!r}; use {', '.join(chosen)}.")
        chosen[key] = _dtype(value, DIT_DTYPES if key == "transformer" else DTYPES, key)
    SpeedOptions(attention, compile_blocks, cfg_lockstep)  # checked before any weight is read
    dit_compute = fp8_compute_dtype(device) if is_fp8(chosen["transformer"]) else chosen["transformer"]
    diffusers_backend(attention, device, dit_compute)
    files = {"transformer": transformer_file, "text_encoder": text_encoder_file, "vae": vae_file}
    root = check_package(model_dir, transformer_subfolder, files)
    dit_file = None
    if transformer_file is not None:
        dit_file = DitFile(transformer_file, transformer_subfolder)
    loras = check_loras(loras, root, transformer_subfolder, transformer_file)

    if dit_file is not None:
        config = transformer_config(root, transformer_subfolder, transformer_file, dit_file)
        transformer = load_dit_file(transformer_file, chosen["transformer"], config, transformer_subfolder, dit_file)
        checkpoint_weight = functools.partial(file_checkpoint_tensor, transformer_file, transformer_subfolder)
    else:
        transformer = load_transformer(root / transformer_subfolder, chosen["transformer"], transformer_subfolder,
                                       island_copies=device.type == "cpu")
        checkpoint_weight = functools.partial(checkpoint_tensor, root / transformer_subfolder, transformer_subfolder)
    if device.type == "cpu":
        align_islands(transformer)  # the file's offsets must not change a CPU run's numbers (mapped single files)
        checkpoint_weight = _islands_aligned(checkpoint_weight)  # an island restored after a LoRA, too
    if is_fp8(chosen["transformer"]):
        transformer.stored_compute_dtype = fp8_compute_dtype(device)  # bf16, or fp16 below sm80 (precision)
    common = dict(local_files_only=True, use_safetensors=True)
    if text_encoder_file is not None:
        from .model.component_files import load_text_encoder_file

        text_encoder = load_text_encoder_file(text_encoder_file, chosen["text_encoder"],
                                              None if root is None else root / "text_encoder", text_encoder_config)
    else:
        try:
            text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(
                root, subfolder="text_encoder", dtype=chosen["text_encoder"], attn_implementation="sdpa", **common
            )
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelPackageError(f"text_encoder: could not load {root / 'text_encoder'}: {e}") from None
    # Only the final hidden states are used; an Identity head makes the hooked top-level call return them.
    text_encoder.lm_head = torch.nn.Identity()
    text_encoder.eval().requires_grad_(False)
    processor = load_processor(root)
    if vae_file is not None:
        from .model.component_files import load_vae_file, vae_config

        vae = load_vae_file(vae_file, chosen["vae"], vae_config(None if root is None else root / "vae", vae_file))
    else:
        try:
            vae = AutoencoderKLWan.from_pretrained(root, subfolder="vae", torch_dtype=chosen["vae"], **common)
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelPackageError(f"vae: could not load {root / 'vae'}: {e}") from None
    vae.eval().requires_grad_(False)
    # Without a package: the release's defaults (load_scheduler_config reads no file and returns {}).
    scheduler_config = load_scheduler_config(None if root is None else str(root / "scheduler" / "scheduler_config.json"))
    if float(scheduler_config.get("shift", 1.0)) != 1.0:
        logger.info("scheduler_config.json has shift=%s; ignored (the shift is a sampling argument).", scheduler_config["shift"])
    pipe = LingbotPipeline(
        transformer, text_encoder, processor, vae, scheduler_config, model_dir=None if root is None else str(root),
        transformer_subfolder=transformer_subfolder, offload=offload, device=device, blocks_on_gpu=blocks_on_gpu,
        attention=attention, compile_blocks=compile_blocks, cfg_lockstep=cfg_lockstep, devices=devices,
        checkpoint_weight=checkpoint_weight, transformer_file=None if transformer_file is None else str(transformer_file),
    )
    if pipe.own_sampler == "dmd_student":
        logger.info("%s is a DMD-distilled student (%s): sampler 'auto' runs dmd_student (recipe: 8 steps, guidance 1.0, "
                    "shift 3.0).", Path(transformer_file).name if transformer_file else root.name, pipe.dmd_reason)
    if loras:
        try:
            pipe.set_loras(loras)
        except BaseException:
            pipe.release()
            raise
    return pipe
