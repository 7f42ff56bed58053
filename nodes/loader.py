"""LoadLingbotPipeline: a model package -> LINGBOT_PIPE, with a bounded cache of loaded pipelines."""

from __future__ import annotations

import logging
from collections import OrderedDict

import comfy.model_management

from ..lingbot_core import DIT_DTYPES, MAX_BLOCKS_ON_GPU, OFFLOAD_MODES, load_pipeline
from ..lingbot_core.loading import check_package
from .model_folders import list_packages, resolve_package
from .progress import free_comfy_models

logger = logging.getLogger("lingbot_video_nodes")

PRECISIONS = ["auto", "bf16", "fp16", "fp32"]
DIT_PRECISIONS = ["auto", *DIT_DTYPES]  # adds the core's fp8 storage choices
VAE_PRECISIONS = ["fp32", "bf16", "fp16"]


class PipelineCache:
    """Loaded pipelines by (folder, transformer, precisions): at most ``capacity`` live at once.

    The offload mode is not part of the key: changing it switches the hooks on the loaded weights
    instead of loading a second copy. The least recently used pipeline is released (hooks removed,
    weights freed) before a new one is loaded past capacity. Capacity 2 fits the TI2V + Refine graph
    (base and refiner pipelines), which cannot share hooked modules.
    """

    def __init__(self, capacity: int = 2):
        self.capacity = capacity
        self._items: "OrderedDict[tuple, object]" = OrderedDict()
        self._releases = {}  # key -> how many pipelines for that key were released so far

    def get(self, key):
        pipe = self._items.get(key)
        if pipe is not None:
            self._items.move_to_end(key)
        return pipe

    def put(self, key, pipe) -> None:
        self._items[key] = pipe

    def make_room(self) -> None:
        while len(self._items) >= self.capacity:
            key = next(iter(self._items))
            logger.info("LingBot-Video: releasing %s to make room for another pipeline.", key[0])
            self._release(key)

    def release(self, pipe) -> bool:
        """Release ``pipe`` if this cache holds it (the Unload node); False when it was already gone."""
        for key, held in list(self._items.items()):
            if held is pipe:
                self._release(key)
                return True
        return False

    def _release(self, key) -> None:
        pipe = self._items.pop(key)
        self._releases[key] = self._releases.get(key, 0) + 1
        pipe.release()

    def token(self, key) -> int:
        """Changes exactly when a pipeline for ``key`` was released (so ComfyUI's cached loader
        output, which may be that released object, is re-run). It must not change on the first
        load or on a reload: IS_CHANGED is evaluated before the loader runs, so a token that
        changed on load made the next identical prompt re-run the whole graph once."""
        return self._releases.get(key, 0)


PIPELINES = PipelineCache()


def _key(model, transformer, dit_precision, text_encoder_precision, vae_precision):
    return (resolve_package(model), transformer, dit_precision, text_encoder_precision, vae_precision)


class LoadLingbotPipeline:
    DESCRIPTION = (
        "Loads a LingBot-Video model package (dense 1.3B or MoE 30B-A3B) from models/diffusers or "
        "models/lingbot_video. Offload trades speed for VRAM: 'model' keeps one component on the GPU at "
        "a time, 'sequential' streams weights layer by layer (lowest VRAM, slowest)."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "load"
    RETURN_TYPES = ("LINGBOT_PIPE",)
    RETURN_NAMES = ("pipe",)
    OUTPUT_TOOLTIPS = ("The loaded pipeline; feed it to EncodeImageVAE, GenerateVideo or Refine.",)

    @classmethod
    def INPUT_TYPES(cls):
        packages = list(list_packages()) or ["(no LingBot-Video package found)"]
        return {
            "required": {
                "model": (packages, {"tooltip": "A folder with model_index.json under models/diffusers or models/lingbot_video."}),
                "transformer": (["transformer", "refiner"], {"default": "transformer",
                                "tooltip": "'transformer' generates; 'refiner' (MoE package only) loads the refiner DiT for the Refine node."}),
                "offload": (list(OFFLOAD_MODES), {"default": "model",
                            "tooltip": "none: everything on the GPU (fastest, most VRAM). model: one component on the GPU at a time. sequential: weights streamed per layer (least VRAM, slowest). block: like model, but the DiT is streamed block by block with the next block prefetched (blocks_on_gpu blocks stay resident)."}),
                "dit_precision": (DIT_PRECISIONS, {"default": "auto", "tooltip": "DiT weights dtype. auto = bf16 on GPU, fp32 on CPU. fp8_e4m3fn / fp8_e5m2 store the block weights in fp8 (half the RAM, VRAM and transfer of bf16, computed in bf16). fp32 islands (norms, modulation, router) always stay fp32."}),
                "text_encoder_precision": (PRECISIONS, {"default": "auto", "tooltip": "Qwen3-VL text encoder dtype. auto = bf16 on GPU, fp32 on CPU."}),
                "vae_precision": (VAE_PRECISIONS, {"default": "fp32", "tooltip": "Wan VAE dtype; fp32 is the reference setting."}),
            },
            "optional": {
                "blocks_on_gpu": ("INT", {"default": 0, "min": 0, "max": MAX_BLOCKS_ON_GPU,
                                  "tooltip": "offload 'block' only: DiT blocks kept on the GPU (the others are streamed). 0 = least VRAM; each block is about 0.1 GiB (dense, bf16) or 1.2 GiB (MoE, bf16)."}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, model, transformer, offload, dit_precision, text_encoder_precision, vae_precision, blocks_on_gpu=0):
        # Re-run when the cached pipeline for these settings was released (e.g. evicted for another model).
        try:
            key = _key(model, transformer, dit_precision, text_encoder_precision, vae_precision)
        except ValueError:
            return float("nan")
        return f"{PIPELINES.token(key)}:{offload}:{blocks_on_gpu}"

    def load(self, model, transformer, offload, dit_precision, text_encoder_precision, vae_precision, blocks_on_gpu=0):
        if offload not in OFFLOAD_MODES:  # 0.3.75 does not validate every combo itself
            raise ValueError(f"offload={offload!r} is not valid; choose one of {', '.join(OFFLOAD_MODES)}.")
        for name, value, allowed in (("dit_precision", dit_precision, DIT_PRECISIONS),
                                     ("text_encoder_precision", text_encoder_precision, PRECISIONS),
                                     ("vae_precision", vae_precision, VAE_PRECISIONS),
                                     ("transformer", transformer, ["transformer", "refiner"])):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(allowed)}.")
        key = _key(model, transformer, dit_precision, text_encoder_precision, vae_precision)
        device = comfy.model_management.get_torch_device()
        pipe = PIPELINES.get(key)
        if pipe is not None:
            if pipe.offload != offload or (offload == "block" and pipe.blocks_on_gpu != blocks_on_gpu):
                free_comfy_models()
                pipe.set_offload(offload, device, blocks_on_gpu=blocks_on_gpu)
            return (pipe,)
        check_package(key[0], transformer)  # a broken folder must not cost a working pipeline its place
        PIPELINES.make_room()
        free_comfy_models()
        dtypes = {"vae": vae_precision}
        if dit_precision != "auto":
            dtypes["transformer"] = dit_precision
        if text_encoder_precision != "auto":
            dtypes["text_encoder"] = text_encoder_precision
        pipe = load_pipeline(key[0], transformer_subfolder=transformer, offload=offload, device=device, dtypes=dtypes,
                             blocks_on_gpu=blocks_on_gpu)
        PIPELINES.put(key, pipe)
        return (pipe,)


class UnloadLingbotPipeline:
    DESCRIPTION = (
        "Frees a pipeline (hooks removed, weights released from GPU and RAM) once `frames` exist, and passes "
        "the frames on. Put it between GenerateVideo and Refine to drop the base model before the refiner "
        "loads, as the reference recommends. The loader reloads the model the next time it is needed."
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
        if not PIPELINES.release(pipe):
            logger.info("LingBot-Video: the pipeline to unload was already released.")
        comfy.model_management.soft_empty_cache()
        return (frames,)
