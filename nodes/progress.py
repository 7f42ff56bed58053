"""ComfyUI progress bar, cancel point and live preview for the core's per-step callback."""

from __future__ import annotations

import comfy.model_management
import comfy.utils
import latent_preview
from comfy import latent_formats

from .comfy_memory import guarded



def step_callback(node_id=None, total: int = 1):
    """A ``callback(i, total, x0)`` for ``lingbot_core``: advances the node's progress bar (which is
    also ComfyUI's cancel point) and sends a latent2rgb / TAE preview when previews are on. Its
    ``interrupt`` attribute is ComfyUI's cancel check, which the core also runs between streamed blocks.

    The bar takes its length from the core's callback, so nodes need not recompute the schedule.
    """
    bar = comfy.utils.ProgressBar(total, node_id=node_id)
    device = guarded("get_torch_device", "no live preview", comfy.model_management.get_torch_device)
    previewer = None if device is None else guarded(
        "latent_preview.get_previewer", "no live preview", latent_preview.get_previewer, device, latent_formats.Wan21())

    def callback(step: int, steps: int, x0):
        comfy.model_management.throw_exception_if_processing_interrupted()
        preview = None
        if previewer is not None:
            # Previewers show latent frame 0, which in TI2V is the pinned input image: show the middle frame.
            mid = x0.shape[2] // 2
            preview = previewer.decode_latent_to_preview_image("JPEG", x0[:, :, mid : mid + 1].float())
        bar.update_absolute(step + 1, steps, preview)

    def status(text: str) -> None:  # e.g. the step cache's computed / skipped counts, shown under the node
        from server import PromptServer

        server = getattr(PromptServer, "instance", None)
        if node_id is not None and server is not None and hasattr(server, "send_progress_text"):
            server.send_progress_text(text, node_id)

    callback.status = status
    # The core also runs this before each streamed DiT block under offload "block" (a 1080p MoE step takes
    # tens of seconds), draining the block copies in flight before the cancel leaves the stage.
    callback.interrupt = comfy.model_management.throw_exception_if_processing_interrupted
    return callback
