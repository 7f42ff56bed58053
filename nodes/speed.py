"""LingBot-Video Speed Options: the pipeline's speed levers in one node, taken by the loader."""

from __future__ import annotations

from ..lingbot_core.model.attention import ATTENTION_CHOICES
from ..lingbot_core.sampling.speed import SpeedOptions


class LingbotSpeedOptions:
    DESCRIPTION = (
        "Speed options for LoadLingbotPipeline (connect to its speed_options input). They change how the loaded "
        "weights compute, never which weights are read: switching them needs no reload. The step cache is a "
        "per-run setting on GenerateVideo / Refine."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "options"
    RETURN_TYPES = ("LINGBOT_SPEED",)
    RETURN_NAMES = ("speed_options",)
    OUTPUT_TOOLTIPS = ("Connect to LoadLingbotPipeline's speed_options.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "attention": (list(ATTENTION_CHOICES), {"default": "sdpa",
                              "tooltip": "sdpa: PyTorch attention (the reference numbers). flash_attn: FlashAttention 2/3 "
                                         "(pip install flash-attn). sage: SageAttention, 8-bit QK, fastest on RTX 40xx / H100 "
                                         "(pip install sageattention). flash_attn and sage need a CUDA GPU and bf16/fp16/fp8 "
                                         "dit_precision."}),
                "compile_blocks": ("BOOLEAN", {"default": False,
                                   "tooltip": "torch.compile each DiT block (needs a working Triton / C++ compiler). The first "
                                              "step compiles (a minute or more); later runs reuse it."}),
                "cfg_lockstep": ("BOOLEAN", {"default": True,
                                 "tooltip": "Run the cond and uncond passes through each DiT block together: same frames, half "
                                            "the weight copies per step under offload 'block' / 'sequential'."}),
            }
        }

    def options(self, attention, compile_blocks, cfg_lockstep):
        return (SpeedOptions(attention, bool(compile_blocks), bool(cfg_lockstep)),)
