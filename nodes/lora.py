"""LoadLingbotLoRA: a LoRA file from ComfyUI's models/loras on a LingBot-Video pipeline handle."""

from __future__ import annotations

from ..lingbot_core.model.lora import MAX_STRENGTH
from .comfy_memory import current_job
from .loader import _consumers
from .model_folders import lora_choices, resolve_lora


class LoadLingbotLoRA:
    DESCRIPTION = (
        "Applies a LoRA to the pipeline's DiT (base or refiner), e.g. LightX2V's four-step LoRA for the MoE "
        "(lightlingbot_video_moe30b_4steps_rank128_v2.safetensors: 4 steps, guidance 1.0, shift 3.0). Chain several. "
        "Nothing is read here but the file's header: the LoRA is applied when a node next uses the pipeline, and "
        "changing or removing it never reloads the model."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "apply"
    RETURN_TYPES = ("LINGBOT_PIPE",)
    RETURN_NAMES = ("pipe",)
    OUTPUT_TOOLTIPS = ("The same pipeline with this LoRA added to its stack; feed it to GenerateVideo, Refine or another LoRA node.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pipe": ("LINGBOT_PIPE", {"tooltip": "From LoadLingbotPipeline or another LoRA node."}),
                "lora_name": (lora_choices(), {"tooltip": "A .safetensors LoRA in ComfyUI/models/loras (LightX2V, DiffSynth-Studio, kohya/ComfyUI naming)."}),
                "strength": ("FLOAT", {"default": 1.0, "min": -MAX_STRENGTH, "max": MAX_STRENGTH, "step": 0.01,
                             "tooltip": "Multiplies the LoRA's change of the weights; 1.0 as trained, 0 turns it off."}),
            },
            "hidden": {"prompt": "PROMPT", "unique_id": "UNIQUE_ID"},
        }

    def apply(self, pipe, lora_name, strength, prompt=None, unique_id=None):
        handle = pipe.with_lora(resolve_lora(lora_name), strength)
        job = current_job()
        if job is not None and unique_id is not None:
            # This node passes the pipeline on: keep it for the nodes downstream, as the loader does.
            handle.pool.expect(handle.spec, job, _consumers(prompt, unique_id))
        return (handle,)
