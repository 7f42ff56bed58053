"""The ComfyUI memory-manager contract of ``PipelineEntry``, checked in a child process with ComfyUI loaded.

Parent side: :func:`contract_report` runs this file once per session (importing ComfyUI parses
``sys.argv`` and sets process-wide state) and returns its JSON. Child side
(``python contract_runner.py OUT BASE PACKAGE``): loads the pack through ComfyUI's own custom-node
loader, builds a ``PipelineEntry`` for a loaded and for a released pipeline, calls every member of
:data:`test_comfy_contract.CONTRACT` with the arguments the current ComfyUI source passes, then drives
the entries through this tree's real ``LoadedModel``, ``load_models_gpu``, ``free_memory`` and
``unload_all_models``. Every observation is a plain value; the parent asserts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

_CACHE: dict = {}


def contract_report(package, workdir: Path, timeout: float = 300) -> dict:
    key = (str(package), str(workdir))
    if key not in _CACHE:
        out = Path(workdir) / "contract.json"
        cmd = [sys.executable, __file__, str(out), str(Path(workdir) / "base"), str(package)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"contract runner failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        _CACHE[key] = json.loads(out.read_text())
    return _CACHE[key]


def _call(obs: dict, name: str, fn):
    try:
        value = fn()
    except Exception as e:  # recorded, the parent names the member
        obs[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        return None
    obs[name] = {"value": value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)}
    return value


def probe_members(entry, other_entry, device) -> dict:
    """Every member of the contract, called as the current source calls it."""
    obs = {}
    for attr in ("load_device", "offload_device", "parent", "model", "clone_base_uuid"):
        _call(obs, attr, lambda a=attr: getattr(entry, a))
    _call(obs, "is_dynamic()", entry.is_dynamic)
    _call(obs, "model_size()", entry.model_size)
    _call(obs, "loaded_size()", entry.loaded_size)
    _call(obs, "loaded_ram_size()", entry.loaded_ram_size)
    _call(obs, "current_loaded_device()", lambda: str(entry.current_loaded_device()))
    _call(obs, "model_dtype()", entry.model_dtype)
    _call(obs, "model_patches_to(device)", lambda: entry.model_patches_to(device))
    _call(obs, "model_patches_to(dtype)", lambda: entry.model_patches_to(entry.model_dtype()))
    _call(obs, "model_patches_models()", lambda: list(entry.model_patches_models()))
    _call(obs, "get_nested_additional_models()", lambda: list(entry.get_nested_additional_models()))
    _call(obs, "lowvram_patch_counter()", entry.lowvram_patch_counter)
    _call(obs, "is_clone(self)", lambda: entry.is_clone(entry))
    _call(obs, "is_clone(other)", lambda: entry.is_clone(other_entry))
    _call(obs, "partially_load(device, 1e32, force_patch_weights=False)",
          lambda: entry.partially_load(device, 1e32, force_patch_weights=False))
    _call(obs, "partially_unload(offload_device, 1024)", lambda: entry.partially_unload(entry.offload_device, 1024))
    _call(obs, "clone_base_uuid unique", lambda: entry.clone_base_uuid != other_entry.clone_base_uuid)
    return obs


def main(out: str, base: str, package: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the support package
    import importlib

    from support.comfy_inprocess import InProcessComfy
    from support.header_bytes import fp32_weight_bytes

    package = Path(package)
    comfy = InProcessComfy(base, models={"lingbot-tiny-dense": package})
    import comfy.model_management as mm
    pack_nodes = comfy.node_class("LoadLingbotPipeline").__module__.rsplit(".", 1)[0]
    cm = importlib.import_module(pack_nodes + ".comfy_memory")
    pool = cm.pipe_pool()
    device = mm.get_torch_device()
    report = {"comfyui_version": cm.comfyui_version(), "header_bytes": fp32_weight_bytes(package), "modes": {}}

    # A loaded pipeline per offload mode (one copy of the weights, re-hooked), and a released one.
    for mode in ("none", "model", "sequential", "block"):
        handle = pool.handle(package, offload=mode, dtypes={"vae": "fp32"}, device="cpu")
        handle.normalizer  # reads the VAE config only
        with pool.use(handle):
            pass  # loads (first mode) or re-hooks (the others)
        entry = pool.observer.entries[handle.spec]
        other = cm.PipelineEntry(pool, handle.spec, None, device)
        report["modes"][mode] = probe_members(entry, other, device)
        report["modes"][mode]["listed"] = cm.is_registered(entry)
        report["modes"][mode]["pool_weight_bytes"] = pool.weight_bytes(handle.spec)
        report["modes"][mode]["still_loaded_after_partially_unload"] = pool.is_loaded(handle.spec)
    spec = handle.spec

    # Offload 'none' on a GPU, the one case where a pipeline holds VRAM between stages. A CPU cannot
    # hold VRAM, so only the meter is simulated (weights "on the device" while the mode is 'none');
    # the move itself (set_offload) and ComfyUI's LoadedModel.model_unload are real.
    none_handle = pool.handle(package, offload="none", dtypes={"vae": "fp32"}, device="cpu")
    with pool.use(none_handle):
        pass
    entry = pool.observer.entries[spec]
    pipe = entry.pipe
    pipe.device_bytes = lambda: pool.weight_bytes(spec) if pipe.offload == "none" else 0
    lm = next(x for x in mm.current_loaded_models if x.model is entry)
    held = entry.loaded_size()
    unloaded = lm.model_unload(1024)  # ComfyUI needs 1 KiB of VRAM
    report["vram_pressure_none"] = {
        "held": held, "after": entry.loaded_size(), "model_unload_returned": unloaded,
        "offload_after": pipe.offload, "still_loaded": pool.is_loaded(spec),
        "still_listed": any(x.model is entry for x in mm.current_loaded_models),
    }
    with pool.use(none_handle):
        report["vram_pressure_none"]["offload_at_next_use"] = pipe.offload
    del pipe.device_bytes

    # The real LoadedModel around the loaded entry, as ComfyUI computes with it.
    entry = pool.observer.entries[spec]
    listed = [lm for lm in mm.current_loaded_models if lm.model is entry]
    lm = listed[0] if listed else None
    report["loaded_model"] = {
        "count": len(listed),
        "model_memory": lm.model_memory() if lm else None,
        "model_loaded_memory": lm.model_loaded_memory() if lm else None,
        "model_offloaded_memory": lm.model_offloaded_memory() if lm else None,
        "model_memory_required": lm.model_memory_required(device) if lm else None,
        "is_dead": lm.is_dead() if lm else None,
        "device": str(lm.device) if lm else None,
    }
    # unload_model_and_clones (current source) reads clone_base_uuid of every listed model.
    if hasattr(mm, "unload_model_and_clones"):
        report["unload_model_and_clones"] = "present in this tree"

    # load_models_gpu with the entry again: ComfyUI finds it listed (LoadedModel.__eq__) and keeps one.
    mm.load_models_gpu([entry])
    report["after_load_models_gpu"] = sum(1 for x in mm.current_loaded_models if x.model is entry)
    report["loaded_after_load_models_gpu"] = pool.is_loaded(spec)

    # free_memory with our entry kept: ComfyUI's own unload path leaves it.
    mm.free_memory(1e30, device, keep_loaded=[x for x in mm.current_loaded_models if x.model is entry])
    report["loaded_after_free_memory_keep_loaded"] = pool.is_loaded(spec)

    # A released pipeline: its entry reports nothing and detach is harmless.
    released = cm.PipelineEntry(pool, spec, None, device)
    report["released"] = probe_members(released, entry, device)

    # unload_all_models (what /free and OOM recovery call): the pipeline is released, ComfyUI's list is clean.
    before = pool.is_loaded(spec)
    mm.unload_all_models()
    report["unload_all_models"] = {
        "loaded_before": before,
        "loaded_after": pool.is_loaded(spec),
        "still_listed": sum(1 for x in mm.current_loaded_models if isinstance(x.model, cm.PipelineEntry)),
    }
    # The next use loads again and lists again.
    with pool.use(handle):
        pass
    report["relisted_after_reload"] = sum(1 for x in mm.current_loaded_models if isinstance(x.model, cm.PipelineEntry))
    # The Unload node's path: our pool releases; ComfyUI's finalizer drops the LoadedModel.
    handle.release()
    import gc

    gc.collect()
    report["listed_after_pool_release"] = sum(1 for x in mm.current_loaded_models
                                              if x.model is not None and isinstance(x.model, cm.PipelineEntry))
    Path(out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:4])
