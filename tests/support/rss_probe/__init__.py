"""A test-only ComfyUI node: records the server's RSS at the moment it runs (inside a prompt).

Linked into ``custom_nodes`` by tests/host/test_memory_comfy.py only. Each run appends one JSON line
``{"label", "rss", "hwm"}`` (bytes, from /proc/self/status) to the file named by ``LINGBOT_RSS_LOG``.
"""

import json
import os


def _status():
    out = {}
    with open("/proc/self/status", "r", encoding="ascii") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


class LingbotTestRSSProbe:
    CATEGORY = "testing"
    FUNCTION = "probe"
    RETURN_TYPES = ("IMAGE",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",), "label": ("STRING", {"default": ""})}}

    @classmethod
    def IS_CHANGED(cls, images, label):
        return float("nan")  # always measure

    def probe(self, images, label):
        status = _status()
        with open(os.environ["LINGBOT_RSS_LOG"], "a", encoding="utf-8") as f:
            f.write(json.dumps({"label": label, "rss": status["VmRSS"], "hwm": status["VmHWM"]}) + "\n")
        return (images,)


NODE_CLASS_MAPPINGS = {"LingbotTestRSSProbe": LingbotTestRSSProbe}
