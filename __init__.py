"""lingbot-video-nodes: LingBot-Video text/image-to-video and refiner nodes for ComfyUI."""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

# Served at /extensions/<pack folder>/: only the generated help pages (docs/), no scripts.
WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
