"""ComfyUI adapters onto lingbot_core: the node classes and their registration."""

from . import example_inputs
from .conditioning import EncodeImageVAE, LoadLingbotPrompt
from .extend import ExtendVideo
from .loader import LoadLingbotPipeline, LoadLingbotPipelineFiles, UnloadLingbotPipeline
from .lora import LoadLingbotLoRA
from .multi_gpu import LingbotMultiGPU
from .prompting import LingbotNegativePrompt, LingbotRewritePrompt, LingbotRewriterServer
from .remote import LingbotRemoteGenerate, LingbotRemoteServer
from .sampling import GenerateVideo, Refine
from .schedule import LingbotPromptSchedule, LingbotSizePreset
from .speed import LingbotSpeedOptions
from .vae import LoadLingbotVAE

NODE_CLASS_MAPPINGS = {
    "LoadLingbotPipeline": LoadLingbotPipeline,
    "LoadLingbotPipelineFiles": LoadLingbotPipelineFiles,
    "EncodeImageVAE": EncodeImageVAE,
    "GenerateVideo": GenerateVideo,
    "Refine": Refine,
    "ExtendVideo": ExtendVideo,
    "LoadLingbotPrompt": LoadLingbotPrompt,
    "UnloadLingbotPipeline": UnloadLingbotPipeline,
    "LingbotRewriterServer": LingbotRewriterServer,
    "LingbotRewritePrompt": LingbotRewritePrompt,
    "LingbotNegativePrompt": LingbotNegativePrompt,
    "LoadLingbotVAE": LoadLingbotVAE,
    "LingbotSpeedOptions": LingbotSpeedOptions,
    "LingbotMultiGPU": LingbotMultiGPU,
    "LoadLingbotLoRA": LoadLingbotLoRA,
    "LingbotRemoteServer": LingbotRemoteServer,
    "LingbotRemoteGenerate": LingbotRemoteGenerate,
    "LingbotPromptSchedule": LingbotPromptSchedule,
    "LingbotSizePreset": LingbotSizePreset,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "LoadLingbotPipeline": "Load LingBot-Video Pipeline",
    "LoadLingbotPipelineFiles": "Load LingBot-Video Pipeline (files)",
    "EncodeImageVAE": "LingBot-Video Encode Image (VAE)",
    "GenerateVideo": "LingBot-Video Generate",
    "Refine": "LingBot-Video Refine",
    "ExtendVideo": "LingBot-Video Extend Video",
    "LoadLingbotPrompt": "LingBot-Video Load Prompt JSON",
    "UnloadLingbotPipeline": "LingBot-Video Unload Pipeline",
    "LingbotRewriterServer": "LingBot-Video Rewriter Server",
    "LingbotRewritePrompt": "LingBot-Video Rewrite Prompt",
    "LingbotNegativePrompt": "LingBot-Video Negative Prompt",
    "LoadLingbotVAE": "LingBot-Video Load VAE (native)",
    "LingbotSpeedOptions": "LingBot-Video Speed Options",
    "LingbotMultiGPU": "LingBot-Video Multi-GPU",
    "LoadLingbotLoRA": "LingBot-Video Load LoRA",
    "LingbotRemoteServer": "LingBot-Video Remote Server",
    "LingbotRemoteGenerate": "LingBot-Video Remote Generate",
    "LingbotPromptSchedule": "LingBot-Video Prompt Schedule",
    "LingbotSizePreset": "LingBot-Video Size Preset",
}

# The example workflows' Load Image / Load Video files, into ComfyUI's input folder when missing.
example_inputs.place_in_comfy_input()
