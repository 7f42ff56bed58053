"""Lazy pipeline handles and the pool that loads, shares and frees their weights within a RAM budget.

A :class:`LazyPipeline` is what a host hands around (ComfyUI's LINGBOT_PIPE): a package, a DiT
subfolder, dtypes, a device and an offload mode, checked but not loaded. Its stage methods have the
signatures of :class:`~lingbot_core.pipeline.LingbotPipeline`; the first one that runs loads the
weights through the :class:`PipelinePool`. Handles with the same weights (same package, DiT,
dtypes and device) share one loaded pipeline; a different offload mode only switches its hooks.

The pool keeps loaded pipelines in least-recently-used order. Before it reads a package it makes
room: while the new weights would not fit in the available RAM (or in an optional fixed budget), it
releases the least recently used pipeline that is *idle*: not inside a stage, and not still needed
by a consumer of the running job (see :meth:`PipelinePool.expect`). If room cannot be made, it
refuses with an error that names the pipelines in the way, before reading a byte. A released
pipeline's handles stay valid and load again when next used.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, Optional, Tuple

import torch

from .model.attention import diffusers_backend
from .files.fp8 import FP8_COMPUTE_DTYPE, is_fp8
from .model.latents import LatentNormalizer
from .loading import (
    COMPONENTS, DIT_DTYPES, DTYPES, ModelPackageError, _dtype, check_loras, check_package, check_transformer,
    default_dtypes, load_pipeline,
)
from .model.lora import LoraStack, check_strength, describe_stack
from .memory.host_memory import shared_pin_budget
from .memory.budget import (
    MIB, available_ram, format_bytes, package_bytes, process_rss, return_freed_memory, trim_heap,
)
from .memory.block_streaming import ring_staging_bytes
from .memory.offload import check_blocks_on_gpu, check_offload_mode, resolve_device
from .pipeline import REFINER_CANNOT_GENERATE, LingbotPipeline
from .sampling.extend import check_extend
from .sampling.speed import SpeedOptions
from .memory.placement import check_component_devices

logger = logging.getLogger("lingbot_core")

# RAM left free for activations, the host and the OS when deciding whether a package still fits.
DEFAULT_HEADROOM = 1024 * MIB


class MemoryBudgetError(RuntimeError):
    """Loading a pipeline would exceed the RAM available and nothing idle is left to release."""


@dataclass(frozen=True)
class PipelineSpec:
    """Which weights to load: equal specs share one loaded pipeline (the offload mode is not part of it).

    ``devices`` (the text encoder's / VAE's own devices) is part of the key: a different placement is
    another pipeline (loaded when used; the old one is idle and goes first when RAM is needed), because
    the default dtypes follow each component's device."""

    model_dir: Optional[str]  # None: the three single files alone (``*_file`` options)
    transformer_subfolder: str = "transformer"
    dtypes: Tuple[Tuple[str, str], ...] = ()  # component -> dtype name, sorted; missing = the device default
    device: str = "cpu"
    options: Tuple[Tuple[str, object], ...] = field(default=())  # further load_pipeline keyword arguments
    devices: Tuple[Tuple[str, str], ...] = ()  # component -> its own device, sorted; missing = ``device``

    @classmethod
    def create(cls, model_dir, transformer_subfolder: str = "transformer", dtypes: Optional[dict] = None,
               device=None, devices: Optional[dict] = None, **options) -> "PipelineSpec":
        names = {}
        for key, value in (dtypes or {}).items():
            dt = _dtype(value, DIT_DTYPES if key == "transformer" else DTYPES, key)  # refuses unknown dtypes clearly
            names[key] = str(dt).replace("torch.", "")
        main = resolve_device(device)
        # A component placed on the pipeline's own device is the default placement (one key, one load).
        placed = tuple(sorted((k, str(v)) for k, v in check_component_devices(devices).items() if v != main))
        return cls(None if model_dir is None else str(Path(model_dir)), transformer_subfolder, tuple(sorted(names.items())),
                   str(main), tuple(sorted(options.items())), placed)

    @property
    def label(self) -> str:
        dit = self.files()["transformer"]
        return f"{Path(dit or self.model_dir).name} ({self.transformer_subfolder})"

    def files(self) -> Dict[str, Optional[str]]:
        """Single files replacing package components (``transformer_file``... options), by component."""
        options = dict(self.options)
        return {c: options.get(f"{c}_file") for c in COMPONENTS}

    def load_dtypes(self) -> Dict[str, torch.dtype]:
        chosen = default_dtypes(torch.device(self.device), log=len(self.dtypes) < len(COMPONENTS),
                                devices=dict(self.devices))
        for key, name in self.dtypes:
            chosen[key] = getattr(torch, name)
        return chosen


class PipelinePool:
    """Loaded pipelines by :class:`PipelineSpec`, evicted least-recently-used-idle-first within a budget.

    ``budget`` (bytes) caps the summed weight bytes of loaded pipelines; ``None`` leaves only the
    available-RAM check. ``headroom`` is kept free of weights. ``observer`` (optional) is told when
    weights are about to be placed, loaded and released: hosts use it to let their own memory
    manager make room and to see the pack's pipelines (see ``nodes/comfy_memory.py``).
    ``caller`` (optional) returns ``(job id, node id)`` of whoever is using a handle right now.
    """

    def __init__(self, budget: Optional[int] = None, headroom: int = DEFAULT_HEADROOM, observer=None,
                 caller: Optional[Callable[[], Optional[Tuple[str, str]]]] = None):
        self.budget = budget
        self.headroom = headroom
        self.observer = observer
        self.caller = caller
        self._loaded: "OrderedDict[PipelineSpec, LingbotPipeline]" = OrderedDict()
        self._bytes: Dict[PipelineSpec, int] = {}
        self._pins: Dict[PipelineSpec, int] = {}
        self._in_use: Dict[PipelineSpec, int] = {}
        self._job: Optional[str] = None
        self._pending: Dict[PipelineSpec, set] = {}  # consumers of the current job that have not used it yet
        self._lock = threading.RLock()

    # -- handles ---------------------------------------------------------------------------------

    def handle(self, model_dir, *, transformer_subfolder: str = "transformer", offload: str = "none",
               dtypes: Optional[dict] = None, device=None, blocks_on_gpu: int = 0, speed: Optional[SpeedOptions] = None,
               devices: Optional[dict] = None,
               **options) -> "LazyPipeline":
        """Check the package (headers only) and return a handle; no weight is read here.

        ``offload`` and ``blocks_on_gpu`` are placement, not weights: handles that differ only in them
        share one loaded pipeline, which is re-hooked when a stage runs. ``speed`` (attention, compile,
        lockstep) is applied the same way (``LingbotPipeline.set_speed``)."""
        check_offload_mode(offload)
        check_blocks_on_gpu(blocks_on_gpu)
        spec = PipelineSpec.create(model_dir, transformer_subfolder, dtypes, device, devices, **options)
        if not self.is_loaded(spec):  # a loaded pipeline needs no files: switching offload reads nothing
            files = spec.files()
            root = check_package(model_dir, transformer_subfolder, files)
            if files.get("transformer"):
                from .model.dit_files import DitFile, check_dit_file, transformer_config

                check_dit_file(DitFile(files["transformer"], transformer_subfolder),
                               transformer_config(root, transformer_subfolder, files["transformer"]), transformer_subfolder)
            else:
                check_transformer(root / transformer_subfolder, transformer_subfolder)
        if speed is not None:
            diffusers_backend(speed.attention, torch.device(spec.device), _compute_dtype(spec))  # refuse before loading
        return LazyPipeline(self, spec, offload, blocks_on_gpu, speed)

    # -- state -----------------------------------------------------------------------------------

    def loaded(self) -> Tuple[PipelineSpec, ...]:
        with self._lock:
            return tuple(self._loaded)

    def is_loaded(self, spec: PipelineSpec) -> bool:
        return spec in self._loaded

    def weight_bytes(self, spec: PipelineSpec) -> int:
        """The RAM the weights of ``spec`` take (from the safetensors headers; cached)."""
        if spec not in self._bytes:
            self._bytes[spec] = package_bytes(spec.model_dir, spec.transformer_subfolder, spec.load_dtypes(), spec.files())
        return self._bytes[spec]

    def pin_bytes(self, spec: PipelineSpec) -> int:
        """The page-locked RAM offload ``block`` takes for ``spec`` at most besides its pinned homes (its
        staging buffers; cached). Nothing is pinned off CUDA."""
        if torch.device(spec.device).type != "cuda":
            return 0
        if spec not in self._pins:
            dtypes, files = spec.load_dtypes(), spec.files()
            self._pins[spec] = ring_staging_bytes(spec.model_dir, spec.transformer_subfolder, dtypes["transformer"],
                                                files["transformer"], text_encoder_dtype=dtypes["text_encoder"],
                                                text_encoder_file=files.get("text_encoder"))
        return self._pins[spec]

    def placing_pins(self, spec: PipelineSpec) -> int:
        """Page-locked bytes offload ``block`` may take for ``spec`` on CUDA, what the host is told before
        placement (ComfyUI's ``pins_required``): the staging buffers and, within what the process's pin
        budget has left, the pinned homes (at most the weights themselves)."""
        if torch.device(spec.device).type != "cuda":
            return 0
        return self.pin_bytes(spec) + min(shared_pin_budget().left(), self.weight_bytes(spec))

    def _held(self) -> int:
        """RAM the loaded pipelines take: their weights, plus the pins of those in offload ``block``."""
        return sum(self._bytes.get(s, 0) + (self.pin_bytes(s) if p.offload == "block" else 0)
                   for s, p in self._loaded.items())

    def in_use(self, spec: PipelineSpec) -> bool:
        return self._in_use.get(spec, 0) > 0

    def needed(self, spec: PipelineSpec) -> bool:
        """True while a consumer announced for the running job has not used ``spec`` yet."""
        return bool(self._pending.get(spec))

    # -- the running job's needs -----------------------------------------------------------------

    def expect(self, spec: PipelineSpec, job: str, consumers: Iterable[str]) -> None:
        """Announce that ``consumers`` (node ids) of job ``job`` will use ``spec``: until each of them has
        used it (or the job changes, or it is released on purpose), it is not evicted to make room."""
        with self._lock:
            self._enter_job(job)
            self._pending.setdefault(spec, set()).update(str(c) for c in consumers)

    def _enter_job(self, job: Optional[str]) -> None:
        if job != self._job:
            self._job = job
            self._pending.clear()

    def _note_caller(self, spec: PipelineSpec) -> None:
        who = self.caller() if self.caller is not None else None
        if who is None:
            return
        job, node = who
        self._enter_job(job)
        pending = self._pending.get(spec)
        if pending is not None:
            pending.discard(str(node))

    # -- loading and using -----------------------------------------------------------------------

    @contextmanager
    def use(self, handle: "LazyPipeline") -> Iterator[LingbotPipeline]:
        """The loaded pipeline for ``handle`` (loaded now if needed), placed in the handle's offload mode.
        It cannot be evicted while the block runs."""
        spec = handle.spec
        with self._lock:
            self._note_caller(spec)
            pipe = self._loaded.get(spec)
            if pipe is None:
                pipe = self._load(spec, handle.offload, handle.blocks_on_gpu, handle.loras)
            else:
                self._loaded.move_to_end(spec)
            self._in_use[spec] = self._in_use.get(spec, 0) + 1
            if handle.offload == "block" and pipe.offload != "block":
                try:  # switching into block pins its staging buffers: make room for them first
                    self._make_room(spec, self.pin_bytes(spec), "switching to offload 'block' (pinned staging buffers)")
                except BaseException:
                    self._in_use[spec] -= 1
                    raise
        try:
            if pipe.offload != handle.offload or (handle.offload == "block" and pipe.blocks_on_gpu != handle.blocks_on_gpu):
                self._placing(self.placing_pins(spec) if handle.offload == "block" else 0)
                pipe.set_offload(handle.offload, blocks_on_gpu=handle.blocks_on_gpu)
            if pipe.speed != handle.speed:
                pipe.set_speed(**vars(handle.speed))
            if pipe.loras != handle.loras:  # the one place a handle's LoRA stack reaches the weights
                pipe.set_loras(handle.loras)
            if self.observer is not None:
                self.observer.using(spec, pipe)
            yield pipe
        finally:
            with self._lock:
                self._in_use[spec] -= 1
            trim_heap()  # a stage's freed activations would otherwise stay in the process's RSS

    def _placing(self, pins: int = 0) -> None:
        """Weights are about to go to the device; ``pins``: page-locked bytes that placement will take."""
        if self.observer is not None:
            self.observer.placing(pins)

    def _load(self, spec: PipelineSpec, offload: str, blocks_on_gpu: int = 0, loras: LoraStack = ()) -> LingbotPipeline:
        pins = self.pin_bytes(spec) if offload == "block" else 0
        need = self.weight_bytes(spec) + pins
        self._make_room(spec, need, "loading its weights" + (" and offload 'block''s pinned staging buffers" if pins else ""))
        self._placing(self.placing_pins(spec) if pins else 0)
        logger.info("LingBot-Video: loading %s (%s of weights, offload=%s, LoRA: %s).", spec.label, format_bytes(need),
                    offload, describe_stack(loras))
        options = dict(spec.options)
        parallel = options.pop("parallel", None)  # a WorkerSetup: the pipeline lives in one process per device
        load = load_pipeline if parallel is None else partial(parallel.load, label=spec.label)
        try:
            pipe = load(spec.model_dir, transformer_subfolder=spec.transformer_subfolder, offload=offload,
                        device=spec.device, dtypes=spec.load_dtypes(), blocks_on_gpu=blocks_on_gpu,
                        loras=loras, devices=dict(spec.devices), **options)
        except BaseException:
            return_freed_memory()  # whatever was read before the failure
            raise
        self._loaded[spec] = pipe
        if self.observer is not None:
            self.observer.loaded(spec, pipe)
        return pipe

    def _fits(self, need: int) -> Tuple[bool, str]:
        if self.budget is not None:
            held = self._held()
            if held + need > self.budget:
                return False, f"the RAM budget of {format_bytes(self.budget)} ({format_bytes(held)} already loaded)"
        avail = available_ram()
        if avail is not None and need + self.headroom > avail:
            return False, f"the {format_bytes(avail)} of RAM available (keeping {format_bytes(self.headroom)} free)"
        return True, ""

    def _make_room(self, spec: PipelineSpec, need: int, what: str) -> None:
        fits, why = self._fits(need)
        while not fits:
            victim = next((s for s in self._loaded if not self.in_use(s) and not self.needed(s)), None)
            if victim is None:
                break
            self._release(victim, f"to make room for {spec.label}")
            fits, why = self._fits(need)
        if fits:
            return
        blocking = [f"{s.label}, {format_bytes(self._bytes.get(s))}"
                    + (" (running)" if self.in_use(s) else f" (still needed by node(s) {', '.join(sorted(self._pending[s]))})")
                    for s in self._loaded]
        held = ("; loaded and still needed by this run: " + "; ".join(blocking)) if blocking else ""
        raise MemoryBudgetError(
            f"{spec.label}: {what} needs about {format_bytes(need)} of RAM, which exceeds {why}{held}. "
            "Put an UnloadLingbotPipeline after the last node that uses a pipeline, choose a lower precision "
            "(dit_precision / text_encoder_precision), or close other programs."
            + (" The budget comes from LINGBOT_RAM_BUDGET_GB." if self.budget is not None else "")
        )

    # -- releasing -------------------------------------------------------------------------------

    def release(self, spec: PipelineSpec, reason: str = "released", by_host: bool = False) -> bool:
        """Free the weights of ``spec`` now (handles stay valid and reload). False if it was not loaded
        or is inside a stage right now (then nothing is freed)."""
        with self._lock:
            if spec not in self._loaded:
                return False
            if self.in_use(spec):
                logger.info("LingBot-Video: %s is running; not released.", spec.label)
                return False
            self._release(spec, reason, by_host)
            return True

    def release_idle(self, reason: str = "released", by_host: bool = False) -> int:
        """Free every pipeline that is not inside a stage; returns how many were freed."""
        with self._lock:
            idle = [s for s in self._loaded if not self.in_use(s)]
            for spec in idle:
                self._release(spec, reason, by_host)
            return len(idle)

    def _release(self, spec: PipelineSpec, reason: str, by_host: bool = False) -> None:
        before = process_rss()
        pipe = self._loaded.pop(spec)
        pipe.release()  # hooks removed, tensors dropped, garbage collected, heap trimmed
        del pipe
        if self.observer is not None:
            self.observer.released(spec, by_host)
        after = process_rss()
        logger.info("LingBot-Video: %s %s: %s of weights freed; process RSS %s -> %s.", reason, spec.label,
                    format_bytes(self._bytes.get(spec)), format_bytes(before), format_bytes(after))


def _compute_dtype(spec: PipelineSpec) -> torch.dtype:
    dtype = spec.load_dtypes()["transformer"]
    return FP8_COMPUTE_DTYPE if is_fp8(dtype) else dtype


class LazyPipeline:
    """A pipeline that loads its weights the first time a stage needs them (see the module docstring).

    The stage and run methods take the arguments of :class:`~lingbot_core.pipeline.LingbotPipeline`.
    """

    def __init__(self, pool: PipelinePool, spec: PipelineSpec, offload: str, blocks_on_gpu: int = 0,
                 speed: Optional[SpeedOptions] = None, loras: LoraStack = ()):
        self.pool = pool
        self.spec = spec
        self.offload = check_offload_mode(offload)
        self.blocks_on_gpu = check_blocks_on_gpu(blocks_on_gpu)
        self.speed = speed or SpeedOptions()
        self.loras: LoraStack = tuple(loras)  # applied to the shared pipeline whenever this handle uses it
        self._normalizer: Optional[LatentNormalizer] = None

    def _comfy_cache_tensors(self):
        """What a host's RAM-pressure output cache counts for a cached handle: nothing. The weights
        belong to the pool, not to the handle, so evicting a handle frees no RAM (the pool's budget
        and release() do); counting them would make the cache evict other outputs for nothing."""
        return []

    def __repr__(self) -> str:
        state = "loaded" if self.loaded else "not loaded"
        return f"LazyPipeline({self.spec.label}, offload={self.offload}, LoRA: {describe_stack(self.loras)}, {state})"

    def with_lora(self, path, strength: float = 1.0) -> "LazyPipeline":
        """A new handle on the same weights whose LoRA stack is this one's plus ``path`` at ``strength``.
        The file is checked against the DiT from headers and config.json only (no weight is read)."""
        strength = check_strength(strength)
        stack = check_loras([*self.loras, (path, strength)], self.spec.model_dir, self.spec.transformer_subfolder,
                            self.spec.files()["transformer"])
        return LazyPipeline(self.pool, self.spec, self.offload, self.blocks_on_gpu, self.speed, stack)

    @property
    def loaded(self) -> bool:
        return self.pool.is_loaded(self.spec)

    @property
    def is_refiner(self) -> bool:
        return self.spec.transformer_subfolder == "refiner"

    @property
    def device(self) -> torch.device:
        return torch.device(self.spec.device)

    @property
    def normalizer(self) -> LatentNormalizer:
        """VAE <-> DiT latent space, from ``vae/config.json`` (no weights needed)."""
        if self._normalizer is None:
            from .model.component_files import vae_config

            folder = None if self.spec.model_dir is None else Path(self.spec.model_dir) / "vae"
            path = folder / "config.json" if folder is not None else "the shipped Wan 2.1 VAE config"
            try:
                cfg = vae_config(folder)  # the shipped Wan 2.1 config when a VAE file stands in
            except (OSError, ValueError) as e:
                raise ModelPackageError(f"vae: could not read {path}: {e}") from None
            self._normalizer = LatentNormalizer(cfg.get("latents_mean"), cfg.get("latents_std"))
        return self._normalizer

    def set_offload(self, mode: str, blocks_on_gpu: Optional[int] = None) -> None:
        """Use ``mode`` from the next stage on; loaded weights are re-hooked, not reloaded.
        ``blocks_on_gpu`` (mode ``block``) keeps its current value when ``None``."""
        self.offload = check_offload_mode(mode)
        if blocks_on_gpu is not None:
            self.blocks_on_gpu = check_blocks_on_gpu(blocks_on_gpu)

    def set_speed(self, **changes) -> None:
        """Use these speed options (``LingbotPipeline.set_speed`` keywords) from the next stage on; no reload."""
        self.speed = self.speed.updated(**changes)

    def release(self) -> bool:
        """Free the weights now; the next stage loads them again. False when nothing was loaded."""
        self.pool._note_caller(self.spec)
        return self.pool.release(self.spec, "unloaded")

    def _run(self, method: str, *args, **kwargs):
        with self.pool.use(self) as pipe:
            return getattr(pipe, method)(*args, **kwargs)

    def encode_prompt(self, *args, **kwargs):
        return self._run("encode_prompt", *args, **kwargs)

    def encode_image(self, *args, **kwargs):
        return self._run("encode_image", *args, **kwargs)

    def encode_video(self, *args, **kwargs):
        return self._run("encode_video", *args, **kwargs)

    def denoise(self, *args, **kwargs):
        return self._run("denoise", *args, **kwargs)

    def decode(self, *args, **kwargs):
        return self._run("decode", *args, **kwargs)

    def generate(self, *args, **kwargs):
        if self.is_refiner:  # refuse before loading anything
            raise ValueError(REFINER_CANNOT_GENERATE)
        return self._run("generate", *args, **kwargs)

    def extend(self, video, *args, new_frames: int, keep_frames: int = 1, **kwargs):
        if self.is_refiner:  # refuse before loading anything
            raise ValueError(REFINER_CANNOT_GENERATE)
        check_extend(video.shape, keep_frames, new_frames)  # bad lengths and sizes too
        return self._run("extend", video, *args, new_frames=new_frames, keep_frames=keep_frames, **kwargs)

    def refine(self, *args, **kwargs):
        if not self.is_refiner:
            raise ValueError("Refine needs the refiner DiT: load the MoE package with transformer='refiner'.")
        return self._run("refine", *args, **kwargs)
