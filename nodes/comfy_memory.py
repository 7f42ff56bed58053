"""The pack's pipelines inside ComfyUI's own model management (the contract: docs/memory.md).

ComfyUI unloads models only through ``comfy.model_management.current_loaded_models``: a list of
``LoadedModel`` wrappers around ModelPatcher-like objects. Its "Unload models" button, ``POST /free``,
out-of-memory recovery and a native model that needs VRAM all end in ``LoadedModel.model_unload``,
which calls the patcher's ``partially_unload`` / ``detach``. Each loaded LingBot pipeline is listed
there as a :class:`PipelineEntry`, a duck-typed patcher that answers every member ComfyUI 0.3.75 and
the current source (0.46) call on a listed model, for a whole pipeline.

ComfyUI never moves our modules itself (a ``.to()`` on a hooked module breaks it): ``detach`` frees
the pipeline through the pool, and the pipeline's handles load it again when next used.

Every call into ``comfy.model_management`` goes through :func:`guarded`: if ComfyUI changes under us,
the node still runs on the pack's own pool (which keeps its RAM budget), and the log says once what
was skipped.
"""

from __future__ import annotations

import inspect
import logging
import uuid

import comfy.model_management as mm
import torch

from ..lingbot_core.memory.budget import ram_budget_from_env
from ..lingbot_core.memory.host_memory import shared_pin_budget
from ..lingbot_core.parallel.remote_pipeline import RemotePipeline
from ..lingbot_core.pipeline_pool import PipelinePool, PipelineSpec

logger = logging.getLogger("lingbot_video_nodes")


def comfyui_version() -> str:
    try:
        from comfyui_version import __version__
    except Exception:  # older trees have no version module
        return "unknown"
    return str(__version__)


# The ComfyUI calls that have failed once in this process (bounded: one entry per call site), so a
# changed ComfyUI gets one warning per call site instead of one per node.
_FAILED_CALLS: set = set()


def guarded(what: str, skipped: str, fn, *args, default=None, **kwargs):
    """``fn(*args, **kwargs)``, or ``default`` if ComfyUI's code raises (logged once per ``what``)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # not BaseException: ComfyUI's interrupt must still propagate
        if what not in _FAILED_CALLS:
            _FAILED_CALLS.add(what)
            logger.warning(
                "LingBot-Video: ComfyUI %s's %s failed (%s: %s); %s. The pack's own pipeline pool and its RAM "
                "budget keep managing LingBot pipelines; please report this with your ComfyUI version.",
                comfyui_version(), what, type(e).__name__, e, skipped)
        return default


class LingbotPipelineWeights:
    """Stands for a loaded pipeline's weights in ComfyUI (its ``LoadedModel`` watches this object)."""

    def __init__(self, label: str):
        self.label = label


class PipelineEntry:
    """What ComfyUI's memory manager calls on a listed model, for one loaded LingBot pipeline.

    Sizes are what is true right now: ``loaded_size()`` is the weight bytes on the device (0 between
    stages under model / sequential / block offload), and ``model_size()`` equals it, so ComfyUI never
    tries to load "more" of a pipeline whose placement is the pack's own. RAM is not ComfyUI's to
    manage: ``loaded_ram_size()`` reports it, and the pack's RAM budget governs it.
    """

    parent = None

    def __init__(self, pool: PipelinePool, spec: PipelineSpec, pipe, load_device: torch.device):
        self.pool = pool
        self.spec = spec
        self.pipe = pipe
        self.model = LingbotPipelineWeights(spec.label)
        self.load_device = load_device
        self.offload_device = torch.device("cpu")
        self.clone_base_uuid = uuid.uuid4()  # unload_model_and_clones matches clones by this

    # -- what kind of model this is ----------------------------------------------------------------

    def is_dynamic(self) -> bool:
        return False  # no dynamic-VRAM pins or cast buffers: placement is the pipeline's offload mode

    def is_clone(self, other) -> bool:
        """Whether ``other`` stands for the same pipeline's weights (an entry is its own clone, as a
        ModelPatcher is: ``load_models_gpu`` relies on that to replace the listed copy)."""
        return getattr(other, "model", None) is self.model

    def model_patches_models(self) -> list:
        return []

    def get_nested_additional_models(self) -> list:
        return []

    def model_dtype(self):
        return None

    def lowvram_patch_counter(self) -> int:
        return 0

    # -- sizes --------------------------------------------------------------------------------------

    def loaded_size(self) -> int:
        pipe = self.pipe
        return 0 if pipe is None else pipe.device_bytes()

    def model_size(self) -> int:
        return self.loaded_size()

    def loaded_ram_size(self) -> int:
        """Weight bytes in RAM: all of them under the offload modes (their home copies), none under
        'none' on a GPU (moved there)."""
        pipe = self.pipe
        if pipe is None:
            return 0
        if pipe.offload == "none" and pipe.device.type != "cpu":
            return 0
        return self.pool.weight_bytes(self.spec)

    def pinned_bytes(self) -> int:
        pipe = self.pipe
        return 0 if pipe is None else pipe.pinned_bytes()

    def current_loaded_device(self):
        return self.load_device

    # -- loading and unloading ----------------------------------------------------------------------

    def model_patches_to(self, device_or_dtype) -> None:
        pass  # no patches

    def partially_load(self, device, extra_memory=0, force_patch_weights=False) -> int:
        return 0  # placement is the pipeline's own offload mode

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False) -> int:
        """ComfyUI needs ``memory_to_free`` bytes of the device: free what can be freed without a
        reload and return the bytes actually freed. Under offload 'none' the weights leave the GPU and
        stay loaded (model offload; the next stage puts them back); under the offload modes nothing
        of ours is on the device between stages, and inside a stage nothing may move."""
        pipe = self.pipe
        before = self.loaded_size()
        if pipe is None or before == 0 or self.pool.in_use(self.spec) or pipe.offload != "none":
            return 0
        if isinstance(pipe, RemotePipeline):
            return 0  # worker processes: their placement is fixed by the plan; ComfyUI then detaches (stops) them
        try:
            pipe.set_offload("model")
        except Exception as e:  # e.g. not enough RAM for the CPU copies: ComfyUI then detaches it
            logger.warning("LingBot-Video: could not move %s off the GPU (%s); releasing it instead.",
                           self.spec.label, e)
            return 0
        freed = before - self.loaded_size()
        logger.info("LingBot-Video: %s moved off the GPU for ComfyUI (%.0f MiB freed); it stays loaded in RAM.",
                    self.spec.label, freed / 2 ** 20)
        return freed

    def detach(self, unpatch_all: bool = True) -> None:
        """ComfyUI unloads this model (/free, "Unload models", OOM recovery, room for a native model).

        ``unpatch_all=False`` is ``load_models_gpu`` replacing a listed clone of a model it is about to
        list again (here: this very pipeline): the pipeline stays loaded."""
        if not unpatch_all:
            return
        self.pool.release(self.spec, "released by ComfyUI's model management", by_host=True)


def register(entry: PipelineEntry) -> None:
    """List ``entry`` in ComfyUI's loaded models, so /free, "Unload models" and OOM recovery reach it.

    Not through ``load_models_gpu``: the pipeline has already placed itself, and a load request would
    make ComfyUI free VRAM for it and reserve pinned RAM for all of its bytes (current ComfyUI adds a
    non-dynamic model's size to ``pins_required``). A ``LoadedModel`` is built and listed as
    ``load_models_gpu`` does at its end; if that internal changed, ``load_models_gpu`` is the fallback.
    """
    def direct():
        loaded = mm.LoadedModel(entry)
        loaded.model_load()
        mm.current_loaded_models.insert(0, loaded)

    if guarded("LoadedModel registration", "falling back to load_models_gpu", _call_ok, direct, default=False):
        return
    guarded("load_models_gpu", "this pipeline is not listed in ComfyUI's loaded models (its /free and "
            "'Unload models' will not free it; the Unload node and the RAM budget still do)",
            mm.load_models_gpu, [entry])


def _call_ok(fn) -> bool:
    fn()
    return True


def is_registered(entry: PipelineEntry) -> bool:
    return bool(guarded("current_loaded_models", "the pipeline is listed again", _listed, entry, default=False))


def _listed(entry) -> bool:
    return any(lm.model is entry for lm in mm.current_loaded_models)


class ComfyMemory:
    """The pool's observer: lists loaded pipelines in ComfyUI and frees ComfyUI's models first."""

    def __init__(self, pool: PipelinePool):
        self.pool = pool
        self.entries = {}
        self._retired = []  # entries ComfyUI is still unloading (kept alive until its loop is done)

    def placing(self, pins: int = 0) -> None:
        free_comfy_models(pins)

    def loaded(self, spec: PipelineSpec, pipe) -> None:
        self._retired.clear()
        device = guarded("get_torch_device", "the pipeline is listed on its own device", mm.get_torch_device,
                         default=pipe.device)
        entry = PipelineEntry(self.pool, spec, pipe, device)
        self.entries[spec] = entry
        register(entry)

    def using(self, spec: PipelineSpec, pipe) -> None:
        self._retired.clear()
        entry = self.entries.get(spec)
        if entry is not None and not is_registered(entry):
            register(entry)  # ComfyUI dropped it (e.g. detach inside a stage); list it again

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
    ctx = guarded("get_executing_context", "no per-prompt protection for this node", get_executing_context)
    return None if ctx is None else (ctx.prompt_id, str(ctx.node_id))


def comfy_pinned_bytes() -> int:
    """Host bytes ComfyUI has page-locked for its own models (``TOTAL_PINNED_MEMORY``, in 0.3.75 and the
    current source); 0 where ComfyUI has no such counter or reading it fails."""
    return guarded("TOTAL_PINNED_MEMORY", "the pack's pin budget does not count ComfyUI's own pinned memory",
                   _read_pinned, default=0)


def _read_pinned() -> int:
    return max(0, int(getattr(mm, "TOTAL_PINNED_MEMORY", 0) or 0))


_POOL = None


def pipe_pool() -> PipelinePool:
    """The pack's one pool of pipelines (documented module state, bounded by the RAM budget). The process's
    pin budget is lowered by what ComfyUI pins itself: ComfyUI does not count our pins, so each side
    keeping to its own cap could lock more RAM together than either allows (gpu-review-4 finding 11)."""
    global _POOL
    if _POOL is None:
        _POOL = PipelinePool(budget=ram_budget_from_env(), caller=_job_and_node)
        _POOL.observer = ComfyMemory(_POOL)
        shared_pin_budget().pinned_elsewhere = comfy_pinned_bytes
    return _POOL


def _ours():
    return [lm for lm in mm.current_loaded_models if isinstance(lm.model, PipelineEntry)]


def free_comfy_models(pins: int = 0) -> None:
    """Before weights go to the GPU: let ComfyUI unload its own models (our pipelines stay listed).

    ``pins``: page-locked bytes the pack is about to allocate; current ComfyUI then evicts its own
    pins to leave that much RAM (0.3.75's ``free_memory`` has no such parameter)."""
    ours = guarded("current_loaded_models", "ComfyUI's models were not unloaded first", _ours)
    if ours is None:
        return
    device = guarded("get_torch_device", "ComfyUI's models were not unloaded first", mm.get_torch_device)
    if device is None:
        return
    skipped = "ComfyUI's own models were not unloaded before LingBot weights went to the device"
    if pins > 0 and _accepts(mm.free_memory, "pins_required"):
        guarded("free_memory", skipped, mm.free_memory, 1e30, device, keep_loaded=ours, pins_required=int(pins))
    else:
        guarded("free_memory", skipped, mm.free_memory, 1e30, device, keep_loaded=ours)
    guarded("soft_empty_cache", "the CUDA cache was not emptied", mm.soft_empty_cache)


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def current_job():
    """The id of the prompt being executed, or None outside an execution."""
    who = _job_and_node()
    return None if who is None else who[0]
