"""The 8-step DMD student example workflow and GenerateVideo's ``sampler="auto"`` in the real headless
ComfyUI, on a tiny MoE package whose scheduler config names DMDStudentScheduler."""

from __future__ import annotations

import numpy as np
import pytest

from lingbot_core.testing.fixtures import write_package
from support.comfy_graphs import (
    EXAMPLE_IMAGE, EXAMPLES, FRAMES, H, MOE, SHORT_CAPTION, W, check_caption, decode_video, example_as_api, generate, loader, node_files, nodes_of, patch_nodes, save_image, saved_frames,
)
from support.comfy_host import progress_events

pytestmark = pytest.mark.comfy

EXAMPLE = "lingbot_moe_dmd_8step"
STUDENT = "lingbot-tiny-student"  # no "dmd" in the name: recognised by its scheduler config alone


@pytest.fixture(scope="module")
def server(comfy_server, tmp_path_factory):
    package = write_package(tmp_path_factory.mktemp("student") / STUDENT, moe=True, fp32=True, seed=1,
                            refiner=False, dmd=True)
    comfy_server.add_model(STUDENT, package)
    comfy_server.add_input(EXAMPLES / EXAMPLE_IMAGE)
    return comfy_server


@pytest.fixture(scope="module")
def object_info(server):
    return server.object_info()


def test_dmd_example_loads_with_the_recipe_and_runs_t2v_and_ti2v(server, object_info):
    wf, api = example_as_api(EXAMPLE, object_info)
    (lid,) = nodes_of(api, "LoadLingbotPipeline")
    assert api[lid]["inputs"]["model"] == "lingbot-video-moe-dmd-30b-a3b"
    assert api[lid]["inputs"]["transformer"] == "transformer" and api[lid]["inputs"]["offload"] == "block"
    gens = nodes_of(api, "GenerateVideo")
    assert len(gens) == 2
    for gid in gens:
        g = api[gid]["inputs"]
        assert (g["steps"], g["guidance_scale"], g["shift"], g["width"], g["height"], g["num_frames"], g["sampler"],
                g["sigmas"], g["step_cache"], g["pipe"]) == (8, 1.0, 3.0, 832, 480, 121, "auto", "", 0.0, [lid, 0])
    (eid,) = nodes_of(api, "EncodeImageVAE")
    with_image = [gid for gid in gens if "image_condition" in api[gid]["inputs"]]
    assert len(with_image) == 1 and api[with_image[0]]["inputs"]["image_condition"] == [eid, 0]
    (cap,) = nodes_of(api, "PrimitiveStringMultiline")
    assert all(api[gid]["inputs"]["prompt"] == [cap, 0] for gid in gens)
    check_caption(api[cap]["inputs"]["value"], 121 / 24)
    (note,) = [n for n in wf["nodes"] if n["type"] == "Note"]
    assert "robbyant/lingbot-video-moe-dmd-30b-a3b" in note["widgets_values"][0]
    assert not nodes_of(api, "Refine")

    patch_nodes(api, "LoadLingbotPipeline", model=STUDENT)
    patch_nodes(api, "GenerateVideo", width=W, height=H, num_frames=FRAMES)
    patch_nodes(api, "EncodeImageVAE", width=W, height=H)
    saves = nodes_of(api, "SaveVideo")
    for sid in saves:
        api[sid]["inputs"]["filename_prefix"] = f"test_{EXAMPLE}_{sid}"
    entry = server.run(api, timeout=600)
    assert len(saves) == 2
    for sid in saves:
        (path,) = node_files(server, entry, sid)
        frames, rate = decode_video(path)
        assert frames.shape == (FRAMES, H, W, 3) and rate == 24 and frames.std() > 1.0
    for gid in gens:
        assert [p["value"] for p in progress_events(entry, gid)] == list(range(1, 9))


def test_auto_samples_the_student_with_dmd_student_and_other_packages_with_unipc(server):
    def frames(model, sampler, prefix):
        g = {"1": loader(model), "2": generate("1", steps=8, guidance_scale=1.0, prompt=SHORT_CAPTION, sampler=sampler),
             "3": save_image("2", prefix)}
        return saved_frames(server, server.run(g), "3")

    auto = frames(STUDENT, "auto", "dmd_auto")
    np.testing.assert_array_equal(frames(STUDENT, "dmd_student", "dmd_explicit"), auto)
    assert np.abs(frames(STUDENT, "unipc", "dmd_unipc").astype(int) - auto).max() > 2
    np.testing.assert_array_equal(frames(MOE, "auto", "moe_auto"), frames(MOE, "unipc", "moe_unipc"))
