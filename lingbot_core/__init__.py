"""lingbot_core: a host-independent LingBot-Video inference core (no ComfyUI imports).

Public API: :func:`load_pipeline` (a package folder, single files, or the three files alone),
:func:`load_processor` (the Qwen3-VL processor: the package's, else the one shipped with the pack) and :class:`LingbotPipeline` (stages ``encode_prompt``,
``encode_image``, ``encode_video``, ``denoise``, ``decode``; runs ``generate`` and ``refine``).

Weights are read from local folders only (``local_files_only=True`` everywhere): no hub access.
"""

from .model.latents import Posterior
from .files.checkpoint_files import ModelPackageError
from .loading import DIT_DTYPES, load_pipeline, load_processor
from .memory.offload import MAX_BLOCKS_ON_GPU, OFFLOAD_MODES
from .pipeline import ImageCondition, LingbotPipeline
from .pipeline_pool import LazyPipeline, MemoryBudgetError, PipelinePool, PipelineSpec
from .prompts.text_conditioning import PromptEmbeds, frames_for_duration, parse_prompt, serialize_caption

__all__ = [
    "load_pipeline", "load_processor", "LingbotPipeline", "ImageCondition", "PromptEmbeds", "Posterior", "ModelPackageError",
    "OFFLOAD_MODES", "MAX_BLOCKS_ON_GPU", "DIT_DTYPES", "LazyPipeline", "PipelinePool", "PipelineSpec",
    "MemoryBudgetError", "frames_for_duration", "parse_prompt", "serialize_caption",
]
__version__ = "0.1.0"
