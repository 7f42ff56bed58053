"""Remote rendering: a LingBot-Video job sent to an SGLang Diffusion or vLLM-Omni server (lingbot_core.remote)."""

from __future__ import annotations

import io
import logging

import comfy.model_management
import comfy.utils
import torch

from ..lingbot_core.remote import MAX_POLL_SECONDS, MIN_POLL_SECONDS, RemoteServer
from ..lingbot_core.files.video_io import clean_mp4
from ..lingbot_core.prompts.text_conditioning import negative_from_widget
from .sampling import GenerateVideo
from .server_list import check_server, endpoint, list_version, server_input

logger = logging.getLogger("lingbot_video_nodes")
DEFAULT_TIMEOUT, DEFAULT_POLL = 600, 2.0


def video_output(mp4: bytes):
    """ComfyUI's VIDEO holding ``mp4`` (Save Video copies its streams, no re-encode).

    ``comfy_api.latest.InputImpl.VideoFromFile`` exists in 0.3.75 and in current ComfyUI; older hosts
    have no VIDEO type: the output is then None and only ``frames`` is usable."""
    try:
        from comfy_api.latest import InputImpl

        return InputImpl.VideoFromFile(io.BytesIO(mp4))
    except ImportError:
        try:
            from comfy_api.input_impl import VideoFromFile
        except ImportError:
            logger.warning("LingbotRemoteGenerate: this ComfyUI has no VIDEO type (comfy_api); use the frames output.")
            return None
        return VideoFromFile(io.BytesIO(mp4))


def remote_progress(node_id):
    """``callback(progress, total)`` for the client: the node's bar, and ComfyUI's cancel (the client
    deletes the remote job when this raises; between polls the client's ``interrupt`` hook does)."""
    bar = comfy.utils.ProgressBar(100, node_id=node_id)

    def callback(progress: float, total: int):
        comfy.model_management.throw_exception_if_processing_interrupted()
        bar.update_absolute(min(int(progress), total), total)

    return callback


class LingbotRemoteServer:
    DESCRIPTION = (
        "A GPU server that renders LingBot-Video over the OpenAI-style Videos API: SGLang Diffusion "
        "(sglang serve, port 30000) or vLLM-Omni (vllm serve --omni, port 8091). Servers on other machines, "
        "and their keys, come from your server list (lingbot_servers.json in ComfyUI's user directory), so a "
        "shared workflow cannot choose where your prompts and keys go."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "configure"
    RETURN_TYPES = ("LINGBOT_REMOTE",)
    RETURN_NAMES = ("server",)
    OUTPUT_TOOLTIPS = ("The server settings; connect to LingBot-Video Remote Generate.",)

    @classmethod
    def INPUT_TYPES(cls):
        # The order keeps workflows saved before the server list loading (widget values are positional):
        # ``server`` sits where ``api_key_env`` was.
        return {
            "required": {
                "base_url": ("STRING", {"default": "http://127.0.0.1:30000",
                             "tooltip": "Used only when server is '(this machine: ...)': a server on this machine (127.0.0.1, ::1, localhost), http://127.0.0.1:30000 for SGLang Diffusion, :8091 for vLLM-Omni; never sent a key."}),
                "model": ("STRING", {"default": "robbyant/lingbot-video-moe-30b-a3b",
                          "tooltip": "The model name the server serves (vLLM-Omni refuses any other: 'Model mismatch'). A server list entry with its own \"model\" uses that one."}),
            },
            # Optional only so that an API-format workflow from before the server list (no server input) gets
            # the pack's message naming the entry to add; the widgets keep their order (required, then these).
            "optional": {
                "server": server_input("video", "Videos-API server"),
                "timeout": ("INT", {"default": DEFAULT_TIMEOUT, "min": 5, "max": 86400,
                            "tooltip": "Seconds a whole job may take, from submit to the downloaded mp4, every byte included; past it the job is cancelled and the node fails. The MoE takes minutes per video on one GPU."}),
                "poll_seconds": ("FLOAT", {"default": DEFAULT_POLL, "min": MIN_POLL_SECONDS, "max": MAX_POLL_SECONDS, "step": 0.5,
                                 "tooltip": "Seconds between status requests (ComfyUI's cancel works at any moment)."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, server=None, base_url=None):
        return check_server(server, base_url, "video")

    @classmethod
    def IS_CHANGED(cls, **_):
        return list_version()

    def configure(self, base_url, model, server=None, timeout=None, poll_seconds=None):
        # The server list, a URL that is not on this machine, or a missing key are reported here, on this node.
        chosen = endpoint(server, base_url, "video")
        return (RemoteServer(chosen.base_url, chosen.model or model, chosen.api_key,
                             timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
                             poll_seconds=DEFAULT_POLL if poll_seconds is None else poll_seconds,
                             allow_http=chosen.allow_http),)


def _remote_inputs() -> dict:
    """GenerateVideo's widgets (same names, defaults and limits), with a server instead of a pipe."""
    local = GenerateVideo.INPUT_TYPES()
    required = {"server": ("LINGBOT_REMOTE", {"tooltip": "The server from LingBot-Video Remote Server."})}
    required.update((k, v) for k, v in local["required"].items() if k != "pipe")
    seed_type, seed_opts = required["seed"]
    required["seed"] = (seed_type, {**seed_opts, "tooltip": "Sent to the server; the same seed on the same server gives the same video (servers draw noise their own way, so it differs from a local render)."})
    optional = {"image": ("IMAGE", {"tooltip": "Image-to-video: the first frame (the first image of a batch), scaled to cover width x height and centre-cropped as for local generation, then sent as input_reference."})}
    # Only what a server takes: the pipe-side controls (image_condition, step_cache, sampler, sigmas) stay
    # on GenerateVideo; the browser would queue their values and generate() takes no such argument.
    optional.update((k, v) for k, v in local["optional"].items() if k in ("use_caption_duration", "fps"))
    return {"required": required, "optional": optional, "hidden": {"unique_id": "UNIQUE_ID"}}


class LingbotRemoteGenerate:
    DESCRIPTION = (
        "Text-to-video, text-to-image (num_frames 1) and image-to-video (connect image) rendered on a GPU server "
        "(LingBot-Video Remote Server). Every parameter is sent, so the server's own defaults never apply. "
        "Cancelling in ComfyUI cancels the job on the server (SGLang only forgets it: its render runs on)."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "generate"
    RETURN_TYPES = ("IMAGE", "VIDEO", "STRING")
    RETURN_NAMES = ("frames", "video", "report")
    OUTPUT_TOOLTIPS = (
        "The server's video decoded to an IMAGE batch (T, H, W, 3).",
        "The server's video stream as it was sent and checked, in a clean mp4 (no other stream, none of the "
        "server's metadata); Save Video stores it without re-encoding.",
        "What the server reported: job id, inference_time_s, peak_memory_mb, and the round-trip time.",
    )

    @classmethod
    def INPUT_TYPES(cls):
        return _remote_inputs()

    def generate(self, server, prompt, negative_prompt, width, height, num_frames, steps, guidance_scale, shift,
                 seed, image=None, use_caption_duration=True, fps=24, unique_id=None):
        first = None
        if image is not None:
            if image.ndim != 4 or image.shape[0] < 1:
                raise ValueError(f"image must be an IMAGE batch (B, H, W, C); got shape {tuple(image.shape)}.")
            if image.shape[0] > 1:
                logger.warning("LingbotRemoteGenerate: got %d images; using the first as the first frame.", image.shape[0])
            first = image[0]
        out = server.run(prompt, negative_prompt=negative_from_widget(negative_prompt), image=first,
                         width=width, height=height, num_frames=num_frames, steps=steps,
                         guidance_scale=guidance_scale, shift=shift, seed=seed, fps=fps,
                         use_caption_duration=use_caption_duration, callback=remote_progress(unique_id),
                         interrupt=comfy.model_management.throw_exception_if_processing_interrupted)
        logger.info("LingbotRemoteGenerate: %s", out.report())
        # Only the stream that was checked and decoded goes on: ComfyUI probes the bytes it is given (a
        # polyglot's other format), and Save Video would keep the server's metadata (a key, a workflow).
        t, h, w = out.frames.shape[:3]
        return (torch.from_numpy(out.frames), video_output(clean_mp4(out.mp4, frames=t, height=h, width=w)),
                out.report())
