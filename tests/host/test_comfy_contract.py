"""The contract between ComfyUI's memory manager and ``PipelineEntry`` (docs/memory.md, "The contract").

:data:`CONTRACT` is the table of docs/memory.md as data: every member that ComfyUI 0.3.75 or the current
source (0.46.0, read) uses on a model listed in ``current_loaded_models``. The child run
(tests/support/contract_runner.py) calls each with the arguments the current source passes, on an entry of a
loaded pipeline in each offload mode and on a released one, then drives the entries through this tree's
real ``LoadedModel``, ``load_models_gpu``, ``free_memory`` and ``unload_all_models``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfy

REPO = Path(__file__).resolve().parents[2]

# (member as the runner records it, who calls it)
CONTRACT = [
    ("load_device", "LoadedModel.__init__; load_models_gpu"),
    ("offload_device", "LoadedModel.model_unload -> partially_unload"),
    ("parent", "LoadedModel._set_model"),
    ("model", "LoadedModel.model_load (weakref + finalizer); log lines"),
    ("clone_base_uuid", "unload_model_and_clones (0.4x)"),
    ("is_dynamic()", "load_models_gpu, free_memory, models_for_pin_eviction, reset_cast_buffers (0.4x)"),
    ("model_size()", "LoadedModel.model_memory / model_offloaded_memory; pins_required (0.4x)"),
    ("loaded_size()", "LoadedModel.model_loaded_memory / model_unload"),
    ("loaded_ram_size()", "load_models_gpu for dynamic models (0.4x)"),
    ("current_loaded_device()", "LoadedModel.model_memory_required"),
    ("model_dtype()", "LoadedModel.model_load"),
    ("model_patches_to(device)", "LoadedModel.model_load"),
    ("model_patches_to(dtype)", "LoadedModel.model_load"),
    ("model_patches_models()", "load_models_gpu; PromptModelTracker (0.4x)"),
    ("get_nested_additional_models()", "unload_model_and_clones; PromptModelTracker (0.4x)"),
    ("lowvram_patch_counter()", "LoadedModel.should_reload_model"),
    ("is_clone(self)", "load_models_gpu"),
    ("is_clone(other)", "load_models_gpu"),
    ("partially_load(device, 1e32, force_patch_weights=False)", "LoadedModel.model_use_more_vram"),
    ("partially_unload(offload_device, 1024)", "LoadedModel.model_unload"),
]
MODES = ("none", "model", "sequential", "block")


@pytest.fixture(scope="module")
def report(packages, tmp_path_factory):
    from support.comfy_host import comfyui_unavailable_reason
    from support.contract_runner import contract_report

    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    return contract_report(packages["dense"], tmp_path_factory.getbasetemp() / "contract")


def value(obs, member):
    got = obs[member]
    assert "error" not in got, f"{member}: {got['error']}\n{got.get('trace', '')}"
    return got["value"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("member", [m for m, _ in CONTRACT])
def test_every_member_answers_as_the_current_source_calls_it(report, mode, member):
    value(report["modes"][mode], member)


@pytest.mark.parametrize("member", [m for m, _ in CONTRACT])
def test_a_released_pipeline_answers_too(report, member):
    value(report["released"], member)


@pytest.mark.parametrize("mode", MODES)
def test_values_are_honest(report, mode):
    obs = report["modes"][mode]
    assert value(obs, "is_dynamic()") is False
    # CPU host: nothing is on an accelerator, so ComfyUI is told no VRAM is held ...
    assert value(obs, "loaded_size()") == 0 and value(obs, "model_size()") == 0
    # ... and the RAM is the pipeline's weights as loaded (headers, counted independently).
    assert value(obs, "loaded_ram_size()") == report["header_bytes"] == obs["pool_weight_bytes"]
    assert value(obs, "partially_unload(offload_device, 1024)") == 0  # nothing on the device: freed nothing
    assert obs["still_loaded_after_partially_unload"]
    assert value(obs, "partially_load(device, 1e32, force_patch_weights=False)") == 0
    assert value(obs, "is_clone(self)") is True and value(obs, "is_clone(other)") is False
    assert value(obs, "clone_base_uuid unique") is True
    assert value(obs, "model_patches_models()") == "[]"
    assert obs["listed"] is True


def test_vram_pressure_moves_a_none_pipeline_off_the_gpu_and_reports_what_it_freed(report):
    """partially_unload returns the bytes really freed: under 'none' all of them (the weights go to RAM,
    model offload), so ComfyUI does not detach the pipeline; the next stage puts it back in 'none'."""
    v = report["vram_pressure_none"]
    assert v["held"] == report["header_bytes"] and v["after"] == 0
    assert v["model_unload_returned"] is False  # freed >= requested: ComfyUI keeps it listed ...
    assert v["offload_after"] == "model" and v["still_loaded"] and v["still_listed"]  # ... and loaded
    assert v["offload_at_next_use"] == "none"


def test_released_entry_reports_nothing(report):
    obs = report["released"]
    assert value(obs, "loaded_size()") == 0 and value(obs, "loaded_ram_size()") == 0
    assert value(obs, "partially_unload(offload_device, 1024)") == 0


def test_the_real_loaded_model_sees_one_honest_entry(report):
    lm = report["loaded_model"]
    assert lm["count"] == 1 and lm["is_dead"] is False
    assert lm["model_memory"] == lm["model_loaded_memory"] == 0
    assert lm["model_offloaded_memory"] == 0 and lm["model_memory_required"] == 0
    assert report["after_load_models_gpu"] == 1  # ComfyUI's own load request finds it listed ...
    assert report["loaded_after_load_models_gpu"] is True  # ... replaces it without releasing the pipeline
    assert report["loaded_after_free_memory_keep_loaded"] is True


def test_unload_all_models_releases_and_the_next_use_lists_again(report):
    u = report["unload_all_models"]
    assert u["loaded_before"] is True and u["loaded_after"] is False and u["still_listed"] == 0
    assert report["relisted_after_reload"] == 1
    assert report["listed_after_pool_release"] == 0  # the Unload node's path: ComfyUI's finalizer cleans up


def test_docs_table_lists_every_member():
    """docs/memory.md's contract table and this test's table name the same members."""
    text = (REPO / "docs" / "memory.md").read_text()
    table = text.split("## The contract", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)", table, flags=re.M))
    wanted = {m.split("(")[0].split(" ")[0] for m, _ in CONTRACT}
    assert wanted <= documented, f"missing from docs/memory.md: {sorted(wanted - documented)}"


def test_the_entry_class_has_every_member():
    """Static half of the contract, independent of ComfyUI being importable."""
    src = (REPO / "nodes" / "comfy_memory.py").read_text()
    body = src.split("class PipelineEntry", 1)[1].split("\ndef register", 1)[0]
    for member in {m.split("(")[0].split(" ")[0] for m, _ in CONTRACT}:
        assert re.search(rf"(def {member}\(|self\.{member} =|^    {member} =)", body, flags=re.M), member
