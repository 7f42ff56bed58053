"""The node widgets take their limits from the core, which is what refuses larger values."""

import pytest

from lingbot_core.model.latents import MAX_FRAMES, MAX_SIDE, SIZE_MULTIPLE, TEMPORAL_COMPRESSION
from lingbot_core.pipeline import MAX_TI2V_ASPECT

pytestmark = pytest.mark.comfy


def _spec(info, name):
    inputs = dict(info["input"]["required"], **info["input"].get("optional", {}))
    return inputs[name][1]


@pytest.mark.parametrize("node", ["GenerateVideo", "Refine", "EncodeImageVAE"])
def test_size_widgets_allow_exactly_what_the_core_accepts(comfy_server, node):
    info = comfy_server.object_info(node)
    for side in ("width", "height"):
        spec = _spec(info, side)
        assert (spec["min"], spec["max"], spec["step"]) == (SIZE_MULTIPLE, MAX_SIDE, SIZE_MULTIPLE)
        assert f"multiple of {SIZE_MULTIPLE}" in spec["tooltip"]
    if node == "GenerateVideo":
        frames = _spec(info, "num_frames")
        assert (frames["min"], frames["max"], frames["step"]) == (1, MAX_FRAMES, TEMPORAL_COMPRESSION)
    if node == "EncodeImageVAE":
        assert f"at most {MAX_TI2V_ASPECT} times" in _spec(info, "width")["tooltip"]
