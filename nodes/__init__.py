"""ComfyUI adapters onto lingbot_core: the node classes and their registration."""

from .conditioning import EncodeImageVAE, LoadLingbotPrompt
from .loader import LoadLingbotPipeline, UnloadLingbotPipeline
from .prompting import NODES as PROMPT_NODES
from .sampling import GenerateVideo, Refine

NODE_CLASS_MAPPINGS = {
    "LoadLingbotPipeline": LoadLingbotPipeline,
    "EncodeImageVAE": EncodeImageVAE,
    "GenerateVideo": GenerateVideo,
    "Refine": Refine,
    "LoadLingbotPrompt": LoadLingbotPrompt,
    "UnloadLingbotPipeline": UnloadLingbotPipeline,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "LoadLingbotPipeline": "Load LingBot-Video Pipeline",
    "EncodeImageVAE": "LingBot-Video Encode Image (VAE)",
    "GenerateVideo": "LingBot-Video Generate",
    "Refine": "LingBot-Video Refine",
    "LoadLingbotPrompt": "LingBot-Video Load Prompt JSON",
    "UnloadLingbotPipeline": "LingBot-Video Unload Pipeline",
}

for _key, (_cls, _name) in PROMPT_NODES.items():
    NODE_CLASS_MAPPINGS[_key] = _cls
    NODE_DISPLAY_NAME_MAPPINGS[_key] = _name
