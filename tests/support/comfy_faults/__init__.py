"""A test-only ComfyUI node that makes ComfyUI's own memory manager fail for part of a prompt.

Linked into ``custom_nodes`` by tests/host/test_comfy_isolation.py only. ``LingbotTestComfyFaults`` passes
its images through; with ``enabled`` it replaces the named ``comfy.model_management`` functions by
ones that raise ``AttributeError`` (what a changed ComfyUI raises on a missing member), without it
it puts the originals back. Links order it inside the prompt: faults on before a stage, off after.
"""

import comfy.model_management as mm

_ORIGINALS = {}


def _raiser(name):
    def fail(*args, **kwargs):
        raise AttributeError(f"'PipelineEntry' object has no attribute 'injected_by_test_{name}'")
    return fail


class LingbotTestComfyFaults:
    CATEGORY = "testing"
    FUNCTION = "run"
    RETURN_TYPES = ("IMAGE",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",), "calls": ("STRING", {"default": "load_models_gpu,free_memory"}),
                             "enabled": ("BOOLEAN", {"default": True})}}

    @classmethod
    def IS_CHANGED(cls, images, calls, enabled):
        return float("nan")

    def run(self, images, calls, enabled):
        for name in [c.strip() for c in calls.split(",") if c.strip()]:
            if enabled:
                _ORIGINALS.setdefault(name, getattr(mm, name))
                setattr(mm, name, _raiser(name))
            elif name in _ORIGINALS:
                setattr(mm, name, _ORIGINALS.pop(name))
        return (images,)


NODE_CLASS_MAPPINGS = {"LingbotTestComfyFaults": LingbotTestComfyFaults}
