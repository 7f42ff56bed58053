"""LoadLingbotPipeline (a lazy handle on a model package) and UnloadLingbotPipeline."""

from __future__ import annotations

import logging
from pathlib import Path

import comfy.model_management

from ..lingbot_core import DIT_DTYPES, MAX_BLOCKS_ON_GPU, OFFLOAD_MODES
from ..lingbot_core.files.checkpoint_files import ModelPackageError
from ..lingbot_core.loading import check_package
from ..lingbot_core.memory.placement import DEFAULT, device_choices
from .comfy_memory import current_job, guarded, pipe_pool
from .model_folders import (
    FROM_PACKAGE, NO_PACKAGE, component_file_choices, files_package_choices, package_choices, resolve_component_file,
    resolve_package,
)

logger = logging.getLogger("lingbot_video_nodes")

PRECISIONS = ["auto", "bf16", "fp16", "fp32"]
DIT_PRECISIONS = ["auto", *DIT_DTYPES]  # adds the core's fp8 storage choices
VAE_PRECISIONS = ["fp32", "bf16", "fp16"]
TRANSFORMERS = ["transformer", "refiner"]


def pipeline_handle(model, transformer, offload, dit_precision, text_encoder_precision, vae_precision,
                    blocks_on_gpu=0, speed_options=None, text_encoder_device=DEFAULT, vae_device=DEFAULT,
                    files=None, multi_gpu=None):
    """The one place that turns the loader's widgets into a handle (new loader options go here).

    Every value is checked against its list first (0.3.75 does not validate every combination) and the
    package is checked (folders, safetensors headers); no weight is read. ``files`` (component -> name
    in a ComfyUI models folder, or "(from the package)") replaces package components by single files; with
    ``files``, ``model`` may be :data:`NO_PACKAGE` (the three files alone). ``multi_gpu`` (a WorkerSetup from
    the Multi-GPU node) puts the pipeline in one worker process per GPU.
    """
    for name, value, allowed in (("offload", offload, list(OFFLOAD_MODES)),
                                 ("dit_precision", dit_precision, DIT_PRECISIONS),
                                 ("text_encoder_precision", text_encoder_precision, PRECISIONS),
                                 ("vae_precision", vae_precision, VAE_PRECISIONS),
                                 ("transformer", transformer, TRANSFORMERS),
                                 ("text_encoder_device", text_encoder_device, device_choices()),
                                 ("vae_device", vae_device, device_choices())):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(allowed)}.")
    dtypes = {"vae": vae_precision}
    if dit_precision != "auto":
        dtypes["transformer"] = dit_precision
    if text_encoder_precision != "auto":
        dtypes["text_encoder"] = text_encoder_precision
    chosen, names = {}, {}
    for component, name in (files or {}).items():
        path = resolve_component_file(component, name)
        if path is not None:
            chosen[f"{component}_file"] = path
            names[str(path)] = names[str(Path(path).resolve())] = name
    folder = None if files is not None and model == NO_PACKAGE else resolve_package(model)
    if folder is None:
        missing = [w for w, c in (("dit_file", "transformer"), ("text_encoder_file", "text_encoder"), ("vae_file", "vae"))
                   if f"{c}_file" not in chosen]
        if missing:
            raise ValueError(f"model {NO_PACKAGE!r} makes the pipeline of three files: choose a file for "
                             f"{', '.join(missing)} (or choose a package as 'model' to take it from there).")
    else:
        names[str(folder)] = names[str(Path(folder).resolve())] = f"package '{model}'"
    if multi_gpu is not None:
        check_multi_gpu(multi_gpu, offload, text_encoder_device, vae_device)
        chosen["parallel"] = multi_gpu
    try:
        return pipe_pool().handle(folder, transformer_subfolder=transformer, offload=offload,
                                  dtypes=dtypes, device=comfy_device(),
                                  blocks_on_gpu=blocks_on_gpu, speed=speed_options,
                                  devices={"text_encoder": text_encoder_device, "vae": vae_device}, **chosen)
    except ValueError as error:  # ModelPackageError and the other checks of the package and files
        # The core names folders by path; the browser shows the names the user picked instead.
        message = without_paths(str(error), names)
        if message == str(error):
            raise
        kind = type(error) if type(error) in (ValueError, ModelPackageError) else ValueError
        raise kind(message) from None


def check_multi_gpu(setup, offload, text_encoder_device, vae_device) -> None:
    """What a Multi-GPU pipeline cannot combine with, refused at the loader (before any worker starts)."""
    if text_encoder_device != DEFAULT or vae_device != DEFAULT:
        raise ValueError("text_encoder_device / vae_device must stay 'default' with Multi-GPU: each worker keeps its "
                         "whole pipeline on its own GPU (use fsdp_text_encoder to spread the text encoder).")
    setup.plan.check(offload=offload)


def without_paths(message: str, names: dict) -> str:
    """``message`` with each server path in ``names`` (path -> name shown in the loader) replaced by its name,
    longest path first so a file inside a package folder keeps its own name."""
    for path in sorted(names, key=len, reverse=True):
        message = message.replace(path, names[path])
    return message


def comfy_device():
    """ComfyUI's compute device (CUDA, MPS, CPU...), or the core's own choice if ComfyUI cannot say."""
    return guarded("get_torch_device", "the pack picks the device itself", comfy.model_management.get_torch_device)


def _consumers(prompt, node_id) -> list:
    """Ids of the prompt's nodes that take this loader's output."""
    out = []
    for other, node in (prompt or {}).items():
        inputs = node.get("inputs", {}) if isinstance(node, dict) else {}
        if any(isinstance(v, list) and len(v) == 2 and str(v[0]) == str(node_id) for v in inputs.values()):
            out.append(str(other))
    return out


#: Nodes that take a pipeline and hand the same pipeline on (followed when checking where a loader's pipe goes).
PASS_THROUGH = frozenset({"LoadLingbotLoRA"})
#: Which loader role each consumer of a pipeline needs.
NEEDS = {"Refine": "refiner", "GenerateVideo": "transformer", "EncodeImageVAE": "transformer"}


def check_consumers(prompt, node_id, transformer: str) -> None:
    """Refuse a base pipeline wired into Refine, or a refiner pipeline into GenerateVideo / EncodeImageVAE.

    ComfyUI (0.3.75 and current) shows VALIDATE_INPUTS no linked value and no graph, so the link cannot be
    refused when the prompt is queued; the loader is the first node of every such chain and reads no
    weights, so refusing here stops the prompt before any sampler or encoder runs (seconds, not the
    minutes a GenerateVideo takes before Refine would find out)."""
    seen, frontier = set(), [str(node_id)]
    while frontier:
        source = frontier.pop()
        for consumer in _consumers(prompt, source):
            if consumer in seen:
                continue
            seen.add(consumer)
            class_type = prompt[consumer].get("class_type")
            if class_type in PASS_THROUGH:
                frontier.append(consumer)
            needed = NEEDS.get(class_type)
            if needed is not None and needed != transformer:
                title = (prompt[consumer].get("_meta") or {}).get("title") or class_type
                if needed == "refiner":
                    raise ValueError(
                        f"'{title}' (node {consumer}) is connected to a base pipeline (transformer='{transformer}'). "
                        "Refine needs the refiner DiT: add a second 'Load LingBot-Video Pipeline' with the MoE "
                        "package and transformer='refiner', and connect that one to Refine's pipe.")
                raise ValueError(
                    f"'{title}' (node {consumer}) is connected to a refiner pipeline (transformer='refiner'), "
                    "which only refines videos. Connect it to a loader with transformer='transformer'.")


def check_refiner_packages(prompt) -> None:
    """Refuse, when the first loader of a prompt runs, any refiner loader of the prompt whose package has no
    refiner/ (the dense package). That loader only runs when Refine first needs it, after the whole base run;
    ComfyUI's VALIDATE_INPUTS could see the values only by taking over ComfyUI's own list check of them."""
    for node_id, node in (prompt or {}).items():
        inputs = node.get("inputs", {}) if isinstance(node, dict) else {}
        if not isinstance(node, dict) or not isinstance(inputs, dict) or node.get("class_type") not in ("LoadLingbotPipeline", "LoadLingbotPipelineFiles") \
                or inputs.get("transformer") != "refiner" or inputs.get("dit_file", FROM_PACKAGE) != FROM_PACKAGE \
                or not isinstance(inputs.get("model"), str) or inputs["model"] == NO_PACKAGE:
            continue
        model = inputs["model"]
        folder = resolve_package(model)
        try:
            check_package(folder, "refiner", {"text_encoder": "-", "vae": "-"})  # the refiner's folder only
        except ValueError as error:
            title = (node.get("_meta") or {}).get("title") or node["class_type"]
            raise ValueError(
                f"'{title}' (node {node_id}): {without_paths(str(error), {folder: f'package {model!r}'})} "
                "transformer='refiner' needs the MoE package (robbyant/lingbot-video-moe-30b-a3b, with refiner/); "
                "for this package choose transformer='transformer'. Refused before anything ran.") from None


class LoadLingbotPipeline:
    DESCRIPTION = (
        "Selects a LingBot-Video model package (dense 1.3B or MoE 30B-A3B) from models/diffusers or "
        "models/lingbot_video. The weights are read when a node first needs them, and freed by "
        "UnloadLingbotPipeline, by ComfyUI's 'Unload models', or when RAM is needed for another pipeline. "
        "Offload trades speed for VRAM: 'model' keeps one component on the GPU at a time, 'sequential' "
        "streams weights layer by layer (lowest VRAM, slowest)."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "load"
    RETURN_TYPES = ("LINGBOT_PIPE",)
    RETURN_NAMES = ("pipe",)
    OUTPUT_TOOLTIPS = ("The pipeline (loaded on first use); feed it to EncodeImageVAE, GenerateVideo or Refine.",)

    @classmethod
    def INPUT_TYPES(cls):
        packages = package_choices()
        return {
            "required": {
                "model": (packages, {"tooltip": "A folder with model_index.json under models/diffusers or models/lingbot_video."}),
                "transformer": (TRANSFORMERS, {"default": "transformer",
                                "tooltip": "'transformer' generates; 'refiner' (MoE package only) loads the refiner DiT for the Refine node."}),
                "offload": (list(OFFLOAD_MODES), {"default": "model",
                            "tooltip": "none: everything on the GPU (fastest, most VRAM). model: one component on the GPU at a time. sequential: weights streamed per layer (least VRAM, slowest). block: like model, but the DiT is streamed block by block with the next block prefetched (blocks_on_gpu blocks stay resident)."}),
                "dit_precision": (DIT_PRECISIONS, {"default": "auto", "tooltip": "DiT weights dtype. auto = bf16 on GPUs of compute capability 8.0+ (Ampere and newer), fp16 below, fp32 on CPU. fp8_e4m3fn / fp8_e5m2 store the block weights in fp8 (half the RAM, VRAM and transfer of bf16, computed in bf16). fp32 islands (norms, modulation, router) always stay fp32."}),
                "text_encoder_precision": (PRECISIONS, {"default": "auto", "tooltip": "Qwen3-VL text encoder dtype. auto = bf16 on GPUs of compute capability 8.0+, fp32 below and on CPU."}),
                "vae_precision": (VAE_PRECISIONS, {"default": "fp32", "tooltip": "Wan VAE dtype; fp32 is the reference setting."}),
            },
            "optional": {
                "blocks_on_gpu": ("INT", {"default": 0, "min": 0, "max": MAX_BLOCKS_ON_GPU,
                                  "tooltip": "offload 'block' only: DiT blocks kept on the GPU (the others are streamed). 0 = least VRAM; each block is about 0.1 GiB (dense, bf16) or 1.2 GiB (MoE, bf16)."}),
                "speed_options": ("LINGBOT_SPEED", {"tooltip": "From 'LingBot-Video Speed Options': attention kernel, block compile, CFG lockstep. Unconnected = sdpa, no compile, lockstep on."}),
                "text_encoder_device": (device_choices(), {"default": DEFAULT,
                                        "tooltip": "Where the Qwen3-VL text encoder (8.3 GiB bf16) runs: default = ComfyUI's GPU (with the DiT), cpu, or a second GPU so the DiT's card holds only the DiT. The offload mode applies to it on that device."}),
                "vae_device": (device_choices(), {"default": DEFAULT,
                               "tooltip": "Where the VAE runs: default = ComfyUI's GPU (with the DiT), cpu, or a second GPU. The offload mode applies to it on that device."}),
                "multi_gpu": ("LINGBOT_MULTI_GPU", {"tooltip": "From 'LingBot-Video Multi-GPU': the pipeline runs in one worker process per GPU (CFG / context parallel, FSDP). Unconnected = this process, ComfyUI's GPU."}),
            },
            "hidden": {"prompt": "PROMPT", "unique_id": "UNIQUE_ID"},
        }

    def load(self, model, transformer, offload, dit_precision, text_encoder_precision, vae_precision,
             blocks_on_gpu=0, speed_options=None, prompt=None, unique_id=None, text_encoder_device=DEFAULT,
             vae_device=DEFAULT, multi_gpu=None):
        check_refiner_packages(prompt)
        check_consumers(prompt, unique_id, transformer)
        pipe = pipeline_handle(model, transformer, offload, dit_precision, text_encoder_precision, vae_precision,
                               blocks_on_gpu, speed_options, text_encoder_device, vae_device, multi_gpu=multi_gpu)
        job = current_job()
        if job is not None and unique_id is not None:
            # Until these nodes have used it, the pipeline is not evicted to make room for another one.
            pipe.pool.expect(pipe.spec, job, _consumers(prompt, unique_id))
        return (pipe,)


class LoadLingbotPipelineFiles(LoadLingbotPipeline):
    DESCRIPTION = (
        "Like Load LingBot-Video Pipeline, with the components taken from single files in ComfyUI's model "
        "folders: a GGUF (Q3_K..Q8_0, realrebelai or stable-diffusion.cpp layout) or safetensors DiT from "
        "models/diffusion_models or models/unet, the Qwen3-VL-4B text encoder (safetensors, or llama.cpp's text "
        "GGUF with its mmproj beside it for image prompts) from models/text_encoders or models/clip, the Wan 2.1 VAE from models/vae. With 'model' set to '(none: the three files)' these three "
        "files are the whole pipeline (the Qwen3-VL tokenizer and configs ship with the pack); a package folder "
        "as 'model' provides any component left '(from the package)'. GGUF weights stay memory-mapped and are "
        "dequantized layer by layer on the GPU: with offload 'block' a Q4_K_M MoE streams about 17 GB per step "
        "instead of 56."
    )

    @classmethod
    def INPUT_TYPES(cls):
        spec = super().INPUT_TYPES()
        required = dict(spec["required"])
        required["model"] = (files_package_choices(), {"default": NO_PACKAGE, "tooltip": "'(none: the three files)': the DiT, text encoder and VAE files below are the whole pipeline. Or a package folder (models/diffusers or models/lingbot_video) that provides the components left '(from the package)' (and its own processor and configs)."})
        files = {
            "dit_file": (component_file_choices("transformer"), {"default": FROM_PACKAGE, "tooltip": "A LingBot-Video DiT file (.gguf or .safetensors) in models/diffusion_models or models/unet; it takes the role chosen in 'transformer'."}),
            "text_encoder_file": (component_file_choices("text_encoder"), {"default": FROM_PACKAGE, "tooltip": "The Qwen3-VL-4B text encoder as one file in models/text_encoders or models/clip: .safetensors (e.g. qwen3vl_4b_bf16), or llama.cpp's text GGUF (e.g. Qwen3-VL-4B-Instruct-Q8_0.gguf, its weights stay quantized; for image prompts put its mmproj-*.gguf in the same folder)."}),
            "vae_file": (component_file_choices("vae"), {"default": FROM_PACKAGE, "tooltip": "The Wan 2.1 VAE as one .safetensors file (models/vae), e.g. wan_2.1_vae.safetensors."}),
        }
        order = ["model", "dit_file", "text_encoder_file", "vae_file"]
        merged = {k: files.get(k, required.get(k)) for k in order}
        merged.update((k, v) for k, v in required.items() if k not in merged)
        return {**spec, "required": merged}

    def load(self, model, transformer, offload, dit_precision, text_encoder_precision, vae_precision,
             dit_file=FROM_PACKAGE, text_encoder_file=FROM_PACKAGE, vae_file=FROM_PACKAGE, blocks_on_gpu=0,
             speed_options=None, prompt=None, unique_id=None, text_encoder_device=DEFAULT, vae_device=DEFAULT,
             multi_gpu=None):
        check_refiner_packages(prompt)
        check_consumers(prompt, unique_id, transformer)
        pipe = pipeline_handle(model, transformer, offload, dit_precision, text_encoder_precision, vae_precision,
                               blocks_on_gpu, speed_options, text_encoder_device, vae_device,
                               files={"transformer": dit_file, "text_encoder": text_encoder_file, "vae": vae_file},
                               multi_gpu=multi_gpu)
        job = current_job()
        if job is not None and unique_id is not None:
            pipe.pool.expect(pipe.spec, job, _consumers(prompt, unique_id))
        return (pipe,)


class UnloadLingbotPipeline:
    DESCRIPTION = (
        "Frees a pipeline's weights (GPU and RAM) once `frames` exist, and passes the frames on. Put it between "
        "GenerateVideo and Refine so the base model is gone before the refiner is read. The pipeline loads "
        "again by itself the next time a node needs it."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "unload"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("frames",)
    OUTPUT_TOOLTIPS = ("The input frames, unchanged; connect them onward so this node runs before the next stage.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": ("LINGBOT_PIPE", {"tooltip": "The pipeline to free (e.g. the base pipeline after GenerateVideo)."}),
                "frames": ("IMAGE", {"tooltip": "Frames produced with that pipeline; the unload waits for them."}),
            }
        }

    def unload(self, pipe, frames):
        if not pipe.release():
            logger.info("LingBot-Video: %s was not loaded; nothing to unload.", pipe.spec.label)
        guarded("soft_empty_cache", "the CUDA cache was not emptied", comfy.model_management.soft_empty_cache)
        return (frames,)
