"""LingBot-Video Multi-GPU: run one loader's pipeline in one worker process per GPU (taken by the loader)."""

from __future__ import annotations

import torch

from ..lingbot_core.parallel.plan import ParallelPlan
from ..lingbot_core.parallel.remote_pipeline import WorkerSetup, resolve_devices
from .loader import comfy_device

MAX_DEGREE = 64


class LingbotMultiGPU:
    DESCRIPTION = (
        "Runs the connected LoadLingbotPipeline on several GPUs at once, one worker process per GPU: CFG "
        "parallel (the two guidance branches on two GPUs, about 2x faster), context parallel (the video's "
        "tokens split across GPUs, faster on long videos, activations divided) and FSDP (the DiT's or text "
        "encoder's weights sharded across the GPUs: memory, not speed). The workers start when the pipeline is "
        "first used and stay until it is unloaded (Unload node, ComfyUI's 'Unload models', or a change of these "
        "options). Same seed, same frames as one GPU (up to float rounding). Context parallel and FSDP need "
        "offload 'none' on the loader. See docs/multi-gpu.md."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "options"
    RETURN_TYPES = ("LINGBOT_MULTI_GPU",)
    RETURN_NAMES = ("multi_gpu",)
    OUTPUT_TOOLTIPS = ("Connect to LoadLingbotPipeline's multi_gpu input.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "gpus": ("STRING", {"default": "all",
                         "tooltip": "Which GPUs run the pipeline, one worker process each: 'all', a count (2 = cuda:0 and "
                                    "cuda:1) or a list of indices (0,2 or cuda:0,cuda:2). The number of GPUs must equal "
                                    "cfg_degree x context_degree. On a CPU-only ComfyUI a count starts that many CPU "
                                    "workers (to try the set-up; not faster)."}),
                "cfg_degree": ("INT", {"default": 2, "min": 1, "max": 2,
                               "tooltip": "2: the cond and uncond guidance branches run on two GPUs at once (about 2x "
                                          "faster; needs guidance_scale > 1 to help). 1: both on each GPU."}),
                "context_degree": ("INT", {"default": 0, "min": 0, "max": MAX_DEGREE,
                                   "tooltip": "GPUs that split the video's tokens (Ulysses context parallel; it must divide "
                                              "the DiT's attention heads). 0 = auto: the GPUs divided by cfg_degree."}),
                "fsdp": ("BOOLEAN", {"default": False,
                         "tooltip": "Shard the DiT's weights across the GPUs (FSDP2): each keeps about 1/N of them "
                                    "(bf16 / fp32 weights only; not with step_cache). Memory, not speed."}),
                "fsdp_text_encoder": ("BOOLEAN", {"default": False,
                                      "tooltip": "Shard the Qwen3-VL text encoder's decoder layers across the GPUs the same way."}),
            }
        }

    def options(self, gpus, cfg_degree, context_degree, fsdp, fsdp_text_encoder):
        device = comfy_device()
        on_cpu = (device.type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
        devices = resolve_devices(gpus, torch.cuda.device_count(), on_cpu)
        if context_degree == 0:
            if len(devices) % cfg_degree:
                raise ValueError(f"{len(devices)} GPU(s) do not split into cfg_degree {cfg_degree} x context_degree "
                                 f"N: choose a multiple of {cfg_degree} GPUs, or cfg_degree 1.")
            context_degree = len(devices) // cfg_degree
        plan = ParallelPlan(int(cfg_degree), int(context_degree), bool(fsdp), bool(fsdp_text_encoder))
        return (WorkerSetup.create(plan, devices),)
