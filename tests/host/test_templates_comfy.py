"""The example workflows in ComfyUI's template browser: listed, loadable, and with a thumbnail."""

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from support.comfy_host import PACK_NAME

pytestmark = pytest.mark.comfy

EXAMPLES = Path(__file__).resolve().parents[2] / "example_workflows"
WORKFLOWS = sorted(p.stem for p in EXAMPLES.glob("*.json"))


def test_every_example_workflow_is_listed_with_a_jpeg_thumbnail(comfy_server):
    assert WORKFLOWS == ["lingbot_extend_chain_refine", "lingbot_moe_4step_lora", "lingbot_moe_dmd_8step",
                         "lingbot_moe_gguf_4step_lora", "lingbot_prose_ti2v_refine", "lingbot_remote_t2v",
                         "lingbot_story_three_parts", "lingbot_t2v", "lingbot_ti2v",
                         "lingbot_ti2v_refine", "lingbot_upscale_any_video_1080p", "lingbot_v2v_restyle"]
    assert sorted(comfy_server.get("/workflow_templates")[PACK_NAME]) == WORKFLOWS
    for name in WORKFLOWS:
        # The frontend (1.32.9 and later) asks for /api/workflow_templates/<pack folder>/<name>.jpg.
        base = f"/api/workflow_templates/{PACK_NAME}/{name}"
        assert comfy_server.get(base + ".json") == json.loads((EXAMPLES / f"{name}.json").read_text(encoding="utf-8"))
        status, raw = comfy_server._request("GET", base + ".jpg")
        assert status == 200, f"{base}.jpg answered {status}: the template card would be blank"
        image = Image.open(io.BytesIO(raw))
        assert image.format == "JPEG" and 256 <= image.width <= 1024 and len(raw) < 150_000
