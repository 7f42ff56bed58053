"""The pack's pipelines inside ComfyUI's own model management (see docs/memory.md).

ComfyUI 0.3.75 unloads models only through ``comfy.model_management.current_loaded_models``: a list of
``LoadedModel`` wrappers around ModelPatcher-like objects, filled by ``load_models_gpu``. Its "Unload
models" button, ``POST /free``, out-of-memory recovery and a native model that needs the memory all
end in ``LoadedModel.model_unload``, which calls the patcher's ``partially_unload`` / ``detach``.
Each loaded LingBot pipeline is registered there as a :class:`PipelineEntry`: the small part of the
patcher contract that ``LoadedModel`` and ``free_memory`` use, answered for a whole pipeline.
ComfyUI never moves our modules itself (a ``.to()`` on a hooked module breaks it); ``detach`` frees
the pipeline through the pool, and the pipeline's handles load it again when next used.
"""

from __future__ import annotations

import os

import comfy.model_management as mm
import torch

from ..lingbot_core.pipeline_pool import PipelinePool, PipelineSpec


class LingbotPipelineWeights:
    """Stands for a loaded pipeline's weights in ComfyUI (its ``LoadedModel`` watches this object)."""

    def __init__(self, label: str):
        self.label = label


class PipelineEntry:
    """What ``LoadedModel`` / ``free_memory`` call on a patcher, for one loaded LingBot pipeline."""

    parent = None

    def __init__(self, pool: PipelinePool, spec: PipelineSpec, pipe, load_device: torch.device):
        self.pool = pool
        self.spec = spec
        self.pipe = pipe
        self.model = LingbotPipelineWeights(spec.label)
        self.load_device = load_device
        self.offload_device = torch.device("cpu")
        self.size = pool.weight_bytes(spec)

    # sizes: the whole pipeline counts as loaded, so ComfyUI never tries to load "more" of it
    def model_size(self) -> int:
        return self.size

    def loaded_size(self) -> int:
        return self.size

    def current_loaded_device(self):
        return self.load_device

    def model_dtype(self):
        return None

    def model_patches_to(self, device) -> None:
        pass

    def model_patches_models(self):
        return []

    def lowvram_patch_counter(self) -> int:
        return 0

    def is_clone(self, other) -> bool:
        return getattr(other, "model", None) is self.model

    def partially_load(self, device, extra_memory=0, force_patch_weights=False) -> int:
        return 0  # placement is the pipeline's own offload mode

    def partially_unload(self, device_to, memory_to_free=0) -> int:
        """ComfyUI needs ``memory_to_free`` bytes of the device. Between stages a pipeline offloaded with
        'model' or 'sequential' holds none of it, so releasing its RAM would not help: report the request
        as met here and let ComfyUI look at its other models. With offload 'none' the weights do sit on
        the device: free them (return 0, and ComfyUI calls ``detach``)."""
        if self.pipe is not None and self.pipe.offload == "none" and self.load_device.type != "cpu":
            return 0
        return memory_to_free

    def detach(self, unpatch_all: bool = True) -> None:
        """ComfyUI unloads this model (/free, "Unload models", OOM recovery, room for a native model)."""
        self.pool.release(self.spec, "released by ComfyUI's model management", by_host=True)


class ComfyMemory:
    """The pool's observer: registers loaded pipelines with ComfyUI and frees ComfyUI's models first."""

    def __init__(self, pool: PipelinePool):
        self.pool = pool
        self.entries = {}
        self._retired = []  # entries ComfyUI is still unloading (kept alive until its loop is done)

    def placing(self) -> None:
        free_comfy_models()

    def loaded(self, spec: PipelineSpec, pipe) -> None:
        self._retired.clear()
        entry = PipelineEntry(self.pool, spec, pipe, mm.get_torch_device())
        self.entries[spec] = entry
        mm.load_models_gpu([entry])

    def using(self, spec: PipelineSpec, pipe) -> None:
        self._retired.clear()
        entry = self.entries.get(spec)
        if entry is not None and not any(lm.model is entry for lm in mm.current_loaded_models):
            mm.load_models_gpu([entry])  # ComfyUI dropped it while it was running; list it again

    def released(self, spec: PipelineSpec, by_host: bool) -> None:
        entry = self.entries.pop(spec, None)
        if entry is None:
            return
        entry.pipe = None
        if by_host:
            self._retired.append(entry)  # ComfyUI pops its LoadedModel itself after detach() returns
        # otherwise dropping the entry lets ComfyUI's finalizer remove its LoadedModel


def _job_and_node():
    """(prompt id, node id) of the node running right now, from ComfyUI's execution context."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:  # older ComfyUI: no context, so no per-prompt needs (idle LRU still applies)
        return None
    ctx = get_executing_context()
    return None if ctx is None else (ctx.prompt_id, str(ctx.node_id))


_POOL = None


def pipe_pool() -> PipelinePool:
    """The pack's one pool of pipelines (documented module state, bounded by the RAM budget)."""
    global _POOL
    if _POOL is None:
        _POOL = PipelinePool(budget=_budget_from_env(), caller=_job_and_node)
        _POOL.observer = ComfyMemory(_POOL)
    return _POOL


def free_comfy_models() -> None:
    """Before weights go to the GPU: let ComfyUI unload its own models (our pipelines stay listed)."""
    ours = [lm for lm in mm.current_loaded_models if isinstance(lm.model, PipelineEntry)]
    mm.free_memory(1e30, mm.get_torch_device(), keep_loaded=ours)
    mm.soft_empty_cache()


def _budget_from_env():
    raw = os.environ.get("LINGBOT_RAM_BUDGET_GB", "").strip()
    if not raw:
        return None
    try:
        gb = float(raw)
    except ValueError:
        raise ValueError(f"LINGBOT_RAM_BUDGET_GB={raw!r} is not a number; set it to the GB of RAM LingBot "
                         "pipelines may hold (e.g. 48), or unset it to use the RAM available.") from None
    if not gb > 0:
        raise ValueError(f"LINGBOT_RAM_BUDGET_GB={raw!r} must be a positive number of GB.")
    return int(gb * 1024 ** 3)


def current_job():
    """The id of the prompt being executed, or None outside an execution."""
    who = _job_and_node()
    return None if who is None else who[0]
