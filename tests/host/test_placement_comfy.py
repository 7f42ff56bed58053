"""The loader's text_encoder_device / vae_device inputs in a real headless ComfyUI (CPU).

The choices list only the devices this machine has; a workflow without the inputs (every older one)
runs as before; placing a component on the device it already uses is the same pipeline and the same
frames; a device the machine does not have is refused when the prompt is queued.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support.comfy_host import PromptValidationError
from support.comfy_graphs import DENSE, loader, saved_frames, t2v_graph

comfy = pytest.mark.comfy


@comfy
def test_device_choices_and_placement_on_the_same_device(comfy_server):
    info = comfy_server.object_info("LoadLingbotPipeline")
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    for name in ("text_encoder_device", "vae_device"):
        choices, opts = info["input"]["optional"][name]
        assert choices == ["default", "cpu", *cuda] and opts["default"] == "default" and opts["tooltip"]
    old = t2v_graph(DENSE, "placement_old")  # no device inputs: as every workflow saved before them
    assert "text_encoder_device" not in old["1"]["inputs"]
    frames_old = saved_frames(comfy_server, comfy_server.run(old), "3")
    placed = t2v_graph(DENSE, "placement_cpu")
    placed["1"] = loader(DENSE, text_encoder_device="cpu", vae_device="cpu")  # = ComfyUI's device here
    frames_cpu = saved_frames(comfy_server, comfy_server.run(placed), "3")
    np.testing.assert_array_equal(frames_cpu, frames_old)


@comfy
def test_a_device_that_is_not_there_is_refused_at_queue_time(comfy_server):
    graph = t2v_graph(DENSE, "placement_missing")
    graph["1"] = loader(DENSE, text_encoder_device="cuda:7")
    with pytest.raises(PromptValidationError) as err:
        comfy_server.queue(graph)
    (error,) = err.value.node_errors["1"]["errors"]
    assert error["type"] == "value_not_in_list" and "text_encoder_device" in error["details"]
