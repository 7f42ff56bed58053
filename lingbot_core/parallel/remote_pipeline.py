"""A pipeline that lives in worker processes, one per device (:mod:`.workers`), behind the interface of
:class:`~lingbot_core.pipeline.LingbotPipeline` that the :class:`~lingbot_core.pipeline_pool.PipelinePool`
and the hosts use: the stage methods, ``set_offload`` / ``set_speed`` / ``set_loras``, ``release`` and
the byte counters.

A handle asks for it with the ``parallel`` option (a :class:`WorkerSetup`: the plan and the devices);
the pool then loads a :class:`RemotePipeline` instead of a local one, whose first stage starts its workers
(each rank loads the weights and parallelizes) and which keeps them across runs until it is released.
A parallelized pipeline cannot change its offload mode, speed options or LoRAs, so a change of those
stops the workers and the next stage starts them again with the new settings (a reload). Workers that
died or failed are started again by the next stage, the same way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ..sampling.speed import SpeedOptions
from .plan import ParallelPlan
from .workers import WorkerPool

logger = logging.getLogger("lingbot_core")


def resolve_devices(gpus: str, device_count: int, on_cpu: bool) -> Tuple[str, ...]:
    """The devices of a ``gpus`` choice: "all", a count ("2": the first two) or a list ("0,2" / "cuda:0, cuda:2").

    On a CPU-only host (``on_cpu``) a count gives that many CPU ranks (gloo: the set-up can be tried and
    tested without GPUs); a list of GPUs is refused there."""
    text = str(gpus).strip().lower()
    if on_cpu:
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"gpus={gpus!r}: this ComfyUI computes on the CPU (no GPU), where only a number of "
                             "CPU worker processes can be given (e.g. 2).")
        return ("cpu",) * int(text)
    if text in ("", "all"):
        count = device_count
        chosen = list(range(device_count))
    elif text.isdigit():
        count = int(text)
        chosen = list(range(count))
    else:
        try:
            chosen = [int(part.strip().removeprefix("cuda:")) for part in text.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"gpus={gpus!r} is not a GPU count or a list of GPU indices such as 0,1 or "
                             "cuda:0,cuda:2.") from None
        count = len(chosen)
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"gpus={gpus!r} names a GPU twice; each rank needs its own GPU.")
    if count < 1:
        raise ValueError(f"gpus={gpus!r}: choose at least one GPU.")
    missing = [i for i in chosen if i >= device_count]
    if count > device_count or missing:
        raise ValueError(f"gpus={gpus!r} asks for {count} GPU(s)"
                         + (f" (index {', '.join(map(str, missing))})" if missing and count <= device_count else "")
                         + f", but this machine has {device_count} (cuda:0..cuda:{device_count - 1})."
                         if device_count else f"gpus={gpus!r} asks for {count} GPU(s), but no CUDA GPU is present.")
    return tuple(f"cuda:{i}" for i in chosen)


@dataclass(frozen=True)
class WorkerSetup:
    """How a pipeline is split over worker processes: part of its :class:`~lingbot_core.pipeline_pool.PipelineSpec`
    (so other devices or another plan are another pipeline)."""

    plan: ParallelPlan
    devices: Tuple[str, ...]

    @classmethod
    def create(cls, plan: ParallelPlan, devices: Sequence[str]) -> "WorkerSetup":
        devices = tuple(str(d) for d in devices)
        if plan.world_size != len(devices):
            raise ValueError(
                f"the plan ({plan.describe()}) needs {plan.world_size} GPU(s), one per rank, but {len(devices)} "
                f"were chosen ({', '.join(devices)}): choose degrees whose product is {len(devices)}, or "
                f"{plan.world_size} GPUs.")
        return cls(plan, devices)

    def describe(self) -> str:
        return f"{self.plan.describe()} on {', '.join(self.devices)}"

    def load(self, model_dir, *, label: str, offload: str = "none", blocks_on_gpu: int = 0, loras=(),
             device=None, **load) -> "RemotePipeline":
        """What the pool calls instead of :func:`~lingbot_core.load_pipeline` (same arguments; ``device`` is
        ignored: each rank has its own). The workers start with the first stage, after the pool has applied
        the handle's speed options (a change after the start would be a restart)."""
        load.pop("devices", None)  # per-component devices are refused for worker pipelines at the handle
        return RemotePipeline(self, label, dict(load, model_dir=model_dir), offload, blocks_on_gpu, loras)


class RemotePipeline:
    """The pool's loaded pipeline whose weights live in worker processes (see the module docstring)."""

    def __init__(self, setup: WorkerSetup, label: str, load: dict, offload: str, blocks_on_gpu: int, loras):
        self.setup = setup
        self.label = label
        self._load = load
        self._offload = offload
        self._blocks_on_gpu = blocks_on_gpu
        self._loras = tuple(loras)
        self.speed = SpeedOptions(load.pop("attention", "sdpa"), bool(load.pop("compile_blocks", False)),
                                  bool(load.pop("cfg_lockstep", True)))
        self._workers: Optional[WorkerPool] = None
        self._stats: dict = {}  # rank 0's byte counters after its last request
        self.start_seconds: Optional[float] = None

    # -- what the pool and the hosts read ------------------------------------------------------------

    @property
    def offload(self) -> str:
        return self._offload

    @property
    def blocks_on_gpu(self) -> int:
        return self._blocks_on_gpu

    @property
    def loras(self):
        return self._loras

    @property
    def device(self) -> torch.device:
        return torch.device(self.setup.devices[0])

    @property
    def is_refiner(self) -> bool:
        return self._load.get("transformer_subfolder") == "refiner"

    @property
    def workers(self) -> Optional[WorkerPool]:
        """The running worker pool, or None (released, not started yet, or stopped after a failure)."""
        return self._workers if self._workers is not None and self._workers.running else None

    def device_bytes(self) -> int:
        """Rank 0's weight bytes on its device after its last request (0 when no worker runs)."""
        return int(self._stats.get("device_bytes", 0)) if self.workers is not None else 0

    def pinned_bytes(self) -> int:
        return 0  # page-locked memory, if any, is the workers' own, not this process's

    # -- the workers ---------------------------------------------------------------------------------

    def start(self, interrupt=None) -> None:
        """Start the workers (each loads and parallelizes the pipeline) unless they are running; ``interrupt``
        (the host's cancel check) is polled while they load."""
        if self.workers is not None:
            return
        load = dict(self._load, offload=self._offload, blocks_on_gpu=self._blocks_on_gpu, loras=list(self._loras),
                    **vars(self.speed))
        self._workers = WorkerPool(load, self.setup.devices, vars(self.setup.plan), label=self.label)
        began = time.monotonic()
        self._workers.start(interrupt)
        self.start_seconds = time.monotonic() - began
        logger.info("LingBot-Video: %s runs in %d worker processes (%s); started in %.1f s.", self.label,
                    len(self.setup.devices), self.setup.describe(), self.start_seconds)

    def _stop(self, why: str) -> None:
        if self._workers is not None:
            if self._workers.running:
                logger.info("LingBot-Video: stopping the workers of %s (%s).", self.label, why)
            self._workers.stop()
        self._workers = None
        self._stats = {}

    def release(self) -> None:
        """Stop the workers (each frees its pipeline and exits); the next stage starts them again."""
        self._stop("released")

    def _call(self, method: str, *args, **kwargs):
        self.start(getattr(kwargs.get("callback"), "interrupt", None))
        result = self._workers.call(method, *args, **kwargs)
        self._stats = dict(self._workers.last_stats)
        return result

    # -- settings: fixed once parallelized, so a change restarts the workers ---------------------------

    def _change(self, what: str, changed: bool) -> None:
        if changed:
            self._stop(f"{what} changed; they start again with it")

    def set_offload(self, mode: str, device=None, blocks_on_gpu: Optional[int] = None, devices=None) -> None:
        blocks = self._blocks_on_gpu if blocks_on_gpu is None else blocks_on_gpu
        changed = (mode, blocks) != (self._offload, self._blocks_on_gpu)
        self._offload, self._blocks_on_gpu = mode, blocks
        self._change("the offload mode", changed)

    def set_speed(self, **changes) -> None:
        new = self.speed.updated(**changes)
        changed, self.speed = new != self.speed, new
        self._change("the speed options", changed)

    def set_loras(self, loras) -> None:
        stack = tuple(tuple(x) for x in loras)
        changed, self._loras = stack != self._loras, stack
        self._change("the LoRA stack", changed)

    # -- stages: every rank runs them, rank 0 answers ------------------------------------------------

    def encode_image(self, *args, **kwargs):
        return self._call("encode_image", *args, **kwargs)

    def encode_video(self, *args, **kwargs):
        return self._call("encode_video", *args, **kwargs)

    def decode(self, *args, **kwargs):
        return self._call("decode", *args, **kwargs)

    def generate(self, *args, **kwargs):
        return self._call("generate", *args, **kwargs)

    def refine(self, *args, **kwargs):
        return self._call("refine", *args, **kwargs)
