"""Offload mode ``block``: a model made of a stack of blocks streamed block by block through a fixed ring.

:class:`BlockStreamer` (an accelerate hook on the DiT, and on the text encoder's decoder layers) keeps the
non-block weights and the first ``blocks_on_gpu`` blocks resident for the stage and copies every other
block in just before it runs, while the next one is prefetched. The copies go through a
:class:`BlockRing`: two device buffers of one block each, filled by a staging thread on a side stream
(:class:`CudaStreams`) while the GPU computes, from a unit's pinned home where the pin budget allowed one
(:meth:`StreamUnit.pin_home`), else through two exact-size pinned staging buffers. Events order the copy
before the compute that reads it and the compute before the refill that overwrites it.

:mod:`lingbot_core.memory.offload` owns the modes and the stage lifecycle and installs these hooks; this
module owns the ring, its staging and what the staging buffers will take (:func:`ring_staging_bytes`).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn
from accelerate.hooks import ModelHook, add_hook_to_module
from accelerate.utils import send_to_device

from . import host_memory
from .budget import loaded_tensor_bytes, text_encoder_file_bytes


# Byte alignment of each tensor inside a ring buffer (vectorised kernels want at least 16; PyTorch's own
# CUDA allocations are 512-aligned, CPU ones 64).
RING_ALIGN = 256
# Device buffers (and as many pinned staging buffers) that the streamed blocks take turns in: the
# block that runs and the next one, so at most ``blocks_on_gpu + 2`` blocks are on the device.
RING_SLOTS = 2


def _aligned(n: int) -> int:
    return -(-n // RING_ALIGN) * RING_ALIGN


class StreamUnit:
    """The tensors of one placement unit (a streamed block, or the non-block weights plus the resident
    blocks) with their CPU home tensors. ``onload`` points the modules at device copies (views into a
    buffer of its streamer's :class:`BlockRing`), ``offload`` back at the homes. The homes never move
    and are copied on the host only into the ring's staging buffers, except once: :meth:`pin_home`
    moves them into a page-locked buffer laid out as in the ring, from which the device then copies
    directly (one copy per unit, no host memcpy)."""

    def __init__(self, label: str, modules: Iterable[nn.Module], ring: Optional["BlockRing"] = None,
                 whole: bool = False):
        self.label = label
        self.ring = ring
        self.whole = whole  # a buffer of its own for the stage (resident weights), not a ring slot
        self.slots = []  # (module, name, is_parameter, cpu tensor)
        self.offsets = []  # byte offset of each tensor in a ring buffer
        span = 0
        for module in modules:
            for name, t in list(module._parameters.items()) + list(module._buffers.items()):
                if t is None:
                    continue
                home = t.data
                self.slots.append((module, name, name in module._parameters, home))
                self.offsets.append(span)
                span += _aligned(home.numel() * home.element_size())
        self.nbytes = sum(t.numel() * t.element_size() for *_, t in self.slots)
        self.span = span  # bytes this unit takes in a ring buffer
        self.on_device = False
        self.buffer: Optional["_DeviceSlot"] = None  # the device buffer holding this unit while on the device
        self.pinned = None  # host_memory.PinnedBuffer holding the homes (ring layout), or None
        self._budget = None  # the host_memory.PinBudget that granted ``pinned``

    @staticmethod
    def _set(module: nn.Module, name: str, is_param: bool, tensor: torch.Tensor) -> None:
        if is_param:
            module._parameters[name].data = tensor
        else:
            module._buffers[name] = tensor

    def views(self, flat: torch.Tensor):
        """``(module, name, is_param, home, view)``: each tensor's place in ``flat`` (a ring buffer)."""
        for (module, name, is_param, home), off in zip(self.slots, self.offsets):
            n = home.numel() * home.element_size()
            yield module, name, is_param, home, flat[off:off + n].view(home.dtype).view(home.shape)

    def fill(self, staging: torch.Tensor, lo: int = 0, hi: Optional[int] = None) -> None:
        """Copy bytes ``[lo, hi)`` of this unit's ring layout from the homes into ``staging[:hi - lo]``
        (alignment padding is left as it is)."""
        hi = self.span if hi is None else hi
        for (*_, home), off in zip(self.slots, self.offsets):
            n = home.numel() * home.element_size()
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                src = home.reshape(-1).view(torch.uint8)  # a non-contiguous home is gathered first
                staging[a - lo:b - lo].copy_(src[a - off:b - off])

    def pin_home(self, buffer, budget=None) -> None:
        """Move the homes into ``buffer`` (a host_memory.PinnedBuffer of ``span`` bytes; ``budget``
        granted it): from now on the modules, when home, point into it."""
        self.fill(buffer.tensor)
        moved = []
        for module, name, is_param, home, view in self.views(buffer.tensor):
            moved.append((module, name, is_param, view))
            if not self.on_device:
                self._set(module, name, is_param, view)
        self.slots, self.pinned, self._budget = moved, buffer, budget

    def adopt_pinned(self, buffer, budget=None) -> bool:
        """Take ``buffer`` (a pinned buffer an earlier unit over the same modules pinned) as this unit's
        pinned home if the homes still lie in it exactly as :meth:`pin_home` laid them out; False when a
        weight was replaced since (a LoRA change, other blocks in the unit): then it must be pinned anew."""
        if buffer.tensor is None or buffer.nbytes != self.span or self.pinned is not None:
            return False
        base = buffer.tensor.data_ptr()
        for (*_, home), off in zip(self.slots, self.offsets):
            if home.data_ptr() != base + off or not home.is_contiguous():
                return False
        self.pinned, self._budget = buffer, budget
        return True

    def hand_over_pinned(self):
        """``(buffer, budget)`` of the pinned home, which this unit no longer owns (None when unpinned): the
        offloader keeps it across a re-hook and gives it to the next unit over the same homes."""
        if self.pinned is None:
            return None
        kept, self.pinned, self._budget = (self.pinned, self._budget), None, None
        return kept

    def unpin(self) -> None:
        """Unlock the pinned homes. They stay where they are, as pageable memory: nothing is copied and
        the modules keep their weights."""
        if self.pinned is None:
            return
        self.pinned.free()
        if self._budget is not None:
            self._budget.give(self.span)
        self.pinned, self._budget = None, None

    def onload(self, device: torch.device, streams: Optional["CudaStreams"] = None) -> None:
        """Copy to ``device``: through the ring (asynchronously when ``streams`` is given: the staging
        thread copies from the pinned home, or fills a pinned staging buffer, and starts the copy on the
        side stream), else in order with compute."""
        if self.on_device:
            return
        if self.ring is not None and device.type != "cpu":
            if self.whole:
                self.ring.load_whole(self, device, streams)
            else:
                self.ring.load(self, device, streams)
        else:
            for module, name, is_param, home in self.slots:
                self._set(module, name, is_param, home.to(device))
        self.on_device = True

    def wait(self) -> None:
        """Make the compute stream wait until this unit's asynchronous copy has landed."""
        if self.buffer is not None and self.ring is not None:
            self.ring.wait(self.buffer)

    def offload(self) -> None:
        """Point back at the CPU homes; a ring buffer is reused once compute has passed this point."""
        if not self.on_device:
            return
        for module, name, is_param, home in self.slots:
            self._set(module, name, is_param, home)
        if self.ring is not None:
            self.ring.left(self)
        self.on_device = False


class CudaStreams:
    """The CUDA stream and event calls of the ring, in one place: the compute stream is the current
    stream of the thread that runs the DiT, ``side`` the copy stream. Tests substitute an object with
    the same methods that records the calls in order (``tests/support/fake_accelerator.py``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    def event(self):
        return torch.cuda.Event()

    def record_compute(self, event) -> None:
        event.record(torch.cuda.current_stream(self.device))

    def record_side(self, event) -> None:
        event.record(self.side)

    def compute_waits(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def side_waits(self, event) -> None:
        self.side.wait_event(event)

    def host_waits(self, event) -> None:
        event.synchronize()

    def copy_on_side(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        self.side.synchronize()


class _DeviceSlot:
    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.unit: Optional[StreamUnit] = None
        self.ready = None  # event on the side stream: the copy into the buffer has landed
        self.done = None  # event on the compute stream: the block that used the buffer has run
        self.pending: Optional[Future] = None  # the staging thread's job filling this buffer

    def settle(self, reraise: bool) -> None:
        """Wait for the staging job filling this buffer, if any: its failure is re-raised for a block about
        to run (``reraise``), dropped for a prefetch nothing will use.

        The job is forgotten only once it has finished: an exception raised *into* the wait (Ctrl-C on
        the CLI's main thread) leaves it pending, so the stage's :meth:`BlockRing.drain` still waits for
        it before the buffer is dropped (its late copy would otherwise land in freed memory)."""
        job = self.pending
        if job is None:
            return
        try:
            if reraise:
                job.result()
            else:
                job.exception()
        finally:
            if job.done():
                self.pending = None


class _HostSlot:
    def __init__(self, pinned):
        self.pinned = pinned  # host_memory.PinnedBuffer
        self.copied = None  # event: the last copy out of this staging buffer has finished


class BlockRing:
    """Fixed memory for the streamed blocks of offload ``block``.

    ``slots`` device buffers of ``slot_bytes`` (the largest block) that the blocks take in turn, and as
    many pinned staging buffers of the same, exact size. A block goes home (mmap'd or pageable) ->
    staging buffer (a host copy) -> device buffer (an asynchronous copy on the side stream); a block
    with a pinned home (:meth:`StreamUnit.pin_home`) skips the staging buffer. The resident weights
    (:meth:`load_whole`) get a device buffer of their own for the stage and go through the same
    staging buffers in slot-size chunks, on the same thread and stream. With streams, both copies run
    on one staging thread, so the Python thread that queues the model's kernels never copies weights
    and stays ahead of the GPU: while block j computes, the thread fills the next staging buffer and
    starts its copy. Events keep each buffer from being overwritten early:

    - the side stream waits for the block that last used a device buffer (``done``) before copying
      the next block into it, so the device holds at most ``slots`` streamed blocks whatever the
      allocator and however far the host runs ahead;
    - the staging thread waits for the last copy out of a staging buffer (``copied``) before refilling
      it;
    - compute waits for the staging job (on the host) and then for the copy into the buffer (``ready``,
      on the GPU) before the block runs.

    Device buffers are allocated at a stage's first load and dropped at its end; staging buffers
    (allocated at the first load that needs one) and the staging thread live as long as the hook.
    """

    def __init__(self, slot_bytes: int, slots: int):
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.device_slots: List[_DeviceSlot] = []
        self.whole_slots: List[_DeviceSlot] = []  # the resident weights' buffers (this stage)
        self.host_slots: List[_HostSlot] = []
        self.running: Optional[StreamUnit] = None  # the block computing now: its buffer is never taken
        self.streams = None  # the CudaStreams of the last asynchronous load
        # What the ring did (bench/ring_probe.py reports it): host seconds spent filling staging buffers,
        # bytes and blocks copied to the device, seconds the compute thread waited for staging jobs.
        self.stats = {"host_copy_s": 0.0, "bytes": 0, "copies": 0, "compute_wait_s": 0.0}
        self._worker: Optional[ThreadPoolExecutor] = None
        self._next_device = 0
        self._next_host = 0

    def pinned_bytes(self) -> int:
        return sum(h.pinned.nbytes for h in self.host_slots if h.pinned.pinned)

    def _device_slot(self, device: torch.device, streams) -> _DeviceSlot:
        if not self.device_slots:
            self.device_slots = [_DeviceSlot(torch.empty(self.slot_bytes, dtype=torch.uint8, device=device))
                                 for _ in range(self.slots)]
            if streams is not None:
                # The allocator may hand out memory that kernels queued on the compute stream still read
                # (stream-ordered reuse): the side stream must not write into it before they have run.
                allocated = streams.event()
                streams.record_compute(allocated)
                for slot in self.device_slots:
                    slot.done = allocated
        for _ in range(self.slots):
            slot = self.device_slots[self._next_device]
            self._next_device = (self._next_device + 1) % self.slots
            if slot.unit is None or slot.unit is not self.running:
                if slot.unit is not None:  # a prefetched block that did not run: it is fetched again later
                    slot.unit.offload()
                return slot
        raise RuntimeError("offload=block: every device buffer of the ring is in use (a block ran inside another).")

    def _host_slots(self) -> List[_HostSlot]:
        if not self.host_slots:  # on the compute thread, before any job that uses them is submitted
            self.host_slots = [_HostSlot(host_memory.pinned_buffer(self.slot_bytes)) for _ in range(self.slots)]
        return self.host_slots

    def _host_slot(self) -> _HostSlot:
        host = self._host_slots()[self._next_host]
        self._next_host = (self._next_host + 1) % self.slots
        return host

    def _submit(self, streams, fn, *args) -> Future:
        self.streams = streams
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lingbot-staging")
        return self._worker.submit(fn, self, streams, *args)

    def load(self, unit: StreamUnit, device: torch.device, streams=None) -> None:
        slot = self._device_slot(device, streams)  # allocated here, on the compute stream's thread
        host = self._host_slot() if unit.pinned is None else None
        if streams is None:  # no streams (a CPU run on the fake device): copy now, in order with compute
            slot.buffer[:unit.span].copy_(_source(self, unit, host))
        else:
            done, slot.done = slot.done, None
            slot.pending = self._submit(streams, _stage, unit, host, slot, done)
        self._point(unit, slot)

    def load_whole(self, unit: StreamUnit, device: torch.device, streams=None) -> None:
        """``unit`` into a device buffer of its own (until the stage ends), copied in chunks of
        ``slot_bytes`` through the staging buffers, or at once from its pinned home; with ``streams``
        on the staging thread, as the blocks are (the per-tensor copies it replaces were synchronous)."""
        slot = _DeviceSlot(torch.empty(unit.span, dtype=torch.uint8, device=device))
        self.whole_slots.append(slot)
        if unit.pinned is None:
            self._host_slots()
        if streams is None:
            _stage_whole(self, None, unit, slot, None)
        else:
            allocated = streams.event()  # memory the compute stream may still be reading (stream-ordered reuse)
            streams.record_compute(allocated)
            slot.pending = self._submit(streams, _stage_whole, unit, slot, allocated)
        self._point(unit, slot)

    @staticmethod
    def _point(unit: StreamUnit, slot: _DeviceSlot) -> None:
        for module, name, is_param, _, view in unit.views(slot.buffer):
            StreamUnit._set(module, name, is_param, view)
        slot.unit, unit.buffer = unit, slot

    def wait(self, slot: _DeviceSlot) -> None:
        """Compute may read ``slot`` once its staging job has run (host) and its copy has landed (GPU)."""
        t0 = time.perf_counter()
        try:
            slot.settle(reraise=True)  # a failed staging job fails the stage here
        finally:
            # The compute thread's wait on the staging thread: a host wait no sync-debug mode reports.
            self.stats["compute_wait_s"] += time.perf_counter() - t0
        if slot.ready is not None:
            self.streams.compute_waits(slot.ready)
            slot.ready = None

    def drain(self) -> None:
        """Wait for every staging job and every copy on the side stream (a stage's end).

        A barrier: besides each buffer's own job, a no-op is run through the single staging thread, so every
        job submitted before it has queued its copy (also one whose handle was lost), and only then is the
        side stream synchronised."""
        for slot in self.device_slots + self.whole_slots:
            slot.settle(reraise=False)
        if self._worker is not None:
            self._worker.submit(_barrier).result()
        if self.streams is not None:
            self.streams.synchronize()

    def left(self, unit: StreamUnit) -> None:
        """``unit`` went home: its buffer may be refilled once the compute stream has passed here."""
        slot, unit.buffer = unit.buffer, None
        if slot is None:
            return
        slot.settle(reraise=False)  # a prefetch that never ran must finish before the buffer is reused
        if slot in self.whole_slots:  # not reused within the stage; dropped by release_device
            slot.ready, slot.unit = None, None
            return
        if self.streams is not None:
            done = self.streams.event()
            self.streams.record_compute(done)
            slot.done = done
        slot.ready = None
        slot.unit = None
        if self.running is unit:
            self.running = None

    def release_device(self) -> None:
        """Drop the device buffers (stage end; the side stream has been synchronised)."""
        for slot in self.device_slots + self.whole_slots:
            if slot.unit is not None:
                slot.unit.offload()
        self.device_slots, self.whole_slots = [], []
        self._next_device = 0

    def release_host(self) -> None:
        """Stop the staging thread, unpin and drop the staging buffers (hook removed)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        for host in self.host_slots:
            if host.copied is not None:
                self.streams.host_waits(host.copied)
            host.pinned.free()
        self.host_slots = []
        self._next_host = 0


def _barrier() -> None:
    """A staging-thread job that does nothing: once it has run, every job submitted before it has."""


def _counted(ring: BlockRing, unit: StreamUnit) -> None:
    ring.stats["bytes"] += unit.nbytes
    ring.stats["copies"] += 1


def _staged(ring: BlockRing, unit: StreamUnit, host: _HostSlot, lo: int, hi: int) -> torch.Tensor:
    """``host``'s staging buffer filled with bytes ``[lo, hi)`` of ``unit`` (the host memcpy, timed)."""
    t0 = time.perf_counter()
    unit.fill(host.pinned.tensor, lo, hi)
    ring.stats["host_copy_s"] += time.perf_counter() - t0
    return host.pinned.tensor[:hi - lo]


def _source(ring: BlockRing, unit: StreamUnit, host: Optional[_HostSlot]) -> torch.Tensor:
    """The host bytes to copy ``unit`` from: its pinned home, or ``host``'s staging buffer filled now."""
    _counted(ring, unit)
    if host is None:
        return unit.pinned.tensor[:unit.span]
    return _staged(ring, unit, host, 0, unit.span)


def _stage(ring: BlockRing, streams, unit: StreamUnit, host: Optional[_HostSlot], slot: _DeviceSlot, done) -> None:
    """The staging thread's job: copy ``unit`` into ``slot`` on the side stream, from its pinned home or
    through ``host``'s staging buffer. Jobs run one at a time, in submission order."""
    if host is not None and host.copied is not None:
        streams.host_waits(host.copied)  # the copy out of this staging buffer, two blocks ago, has finished
        host.copied = None
    src = _source(ring, unit, host)
    if done is not None:
        streams.side_waits(done)  # the block that used this device buffer has run
    streams.copy_on_side(slot.buffer[:unit.span], src)
    ready = streams.event()
    streams.record_side(ready)
    slot.ready = ready
    if host is not None:
        host.copied = ready


def _stage_whole(ring: BlockRing, streams, unit: StreamUnit, slot: _DeviceSlot, done) -> None:
    """:meth:`BlockRing.load_whole`'s job (``streams`` None: a synchronous copy, in order with compute).
    Chunks alternate between the staging buffers, each refilled once its last copy has finished."""
    if streams is not None and done is not None:
        streams.side_waits(done)
    if unit.pinned is not None:
        chunks = [(0, unit.span, None)]
    else:
        step = ring.slot_bytes
        chunks = [(lo, min(lo + step, unit.span), ring.host_slots[i % len(ring.host_slots)])
                  for i, lo in enumerate(range(0, unit.span, step))]
    ready = None
    for lo, hi, host in chunks:
        if host is None:
            src = unit.pinned.tensor[lo:hi]
        else:
            if host.copied is not None and streams is not None:
                streams.host_waits(host.copied)
                host.copied = None
            src = _staged(ring, unit, host, lo, hi)
        if streams is None:
            slot.buffer[lo:hi].copy_(src)
            continue
        streams.copy_on_side(slot.buffer[lo:hi], src)
        ready = streams.event()
        streams.record_side(ready)
        if host is not None:
            host.copied = ready
    _counted(ring, unit)
    slot.ready = ready


def dit_blocks(module: nn.Module) -> Sequence[nn.Module]:
    return module.blocks


class BlockStreamer(ModelHook):
    """Offload mode ``block`` for a model made of a stack of blocks, as an accelerate hook on the model:
    the DiT (its ``blocks``) and the text encoder (its decoder layers).

    At the model's forward, its non-block weights and the first ``blocks_on_gpu`` blocks (the core unit)
    go to the execution device, through the ring's staging path (they stay until the stage ends). Each
    other block has its own hook: before it runs, its copy is awaited (or made) and the next streamed
    block's copy is started by the ring's staging thread; after it runs, it goes home. Streamed blocks
    live in the fixed buffers of a :class:`BlockRing`, so at most ``blocks_on_gpu + 2`` blocks are
    resident. After the last block the first streamed block is prefetched for the next forward (the next
    CFG branch or step) unless the stage said this was its last forward (``forwards_left``,
    :meth:`~lingbot_core.memory.offload.Offloader.expect_forwards`); :meth:`offload_all` (every stage reset)
    drops everything on the device. Units whose homes were pinned
    (:meth:`~lingbot_core.memory.offload.Offloader.stage`, within its :class:`PinBudget`) are
    copied from there directly; :meth:`unpin_homes` (hook removed) unlocks them.

    On a CPU execution device the "copies" are the CPU tensors themselves and neither the ring nor a
    stream is used, so the numbers are those of the unhooked model. ``streams`` is None off CUDA
    (the fake device of the tests then copies in order, or the tests set a recording stand-in).
    """

    def __init__(self, execution_device: torch.device, blocks_on_gpu: int,
                 blocks: Callable[[nn.Module], Sequence[nn.Module]] = dit_blocks):
        self.execution_device = execution_device
        self.blocks_on_gpu = blocks_on_gpu
        self.blocks = blocks
        self.core: Optional[StreamUnit] = None
        self.streamed: List[StreamUnit] = []
        self.ring: Optional[BlockRing] = None
        self.streams = None
        self.forwards_left: Optional[int] = None  # forwards the stage still makes (None: unknown)
        # Called before each streamed block (the host's cancel check, e.g. ComfyUI's interrupt): it raises to
        # stop the stage. Set per stage (Offloader.set_interrupt), cleared at every reset.
        self.interrupt: Optional[Callable[[], None]] = None

    def init_hook(self, module):
        blocks = list(self.blocks(module))
        k = min(self.blocks_on_gpu, len(blocks))
        in_blocks = {id(m) for b in blocks for m in b.modules()}
        outside = [m for m in module.modules() if id(m) not in in_blocks]
        resident = outside + [m for b in blocks[:k] for m in b.modules()]
        units = [StreamUnit(f"block{i}", b.modules()) for i, b in enumerate(blocks)]
        self.streamed = units[k:]
        # The ring's buffers are one block each (the largest); its staging buffers also carry the core.
        slot = max((u.span for u in units), default=0)
        self.ring = BlockRing(slot, max(1, min(RING_SLOTS, len(self.streamed)))) if slot else None
        self.core = StreamUnit("core", resident, ring=self.ring, whole=True)
        for unit in self.streamed:
            unit.ring = self.ring
        for j, block in enumerate(blocks[k:]):
            add_hook_to_module(block, _StreamedBlockHook(self, j))
        return module

    def units(self) -> List[StreamUnit]:
        return [u for u in (self.core, *self.streamed) if u is not None]

    def device_buffer_bytes(self) -> int:
        """Device bytes this streamer's weights take at most during a stage: the resident part's buffer and
        the ring's buffers (what is converted from them while a block runs comes on top)."""
        ring = self.ring.slots * self.ring.slot_bytes if self.ring is not None and self.streamed else 0
        return (self.core.span if self.core is not None else 0) + ring

    def pinned_bytes(self) -> int:
        homes = sum(u.pinned.nbytes for u in self.units() if u.pinned is not None and u.pinned.pinned)
        return homes + (self.ring.pinned_bytes() if self.ring is not None else 0)

    def unpin_homes(self) -> None:
        for unit in self.units():
            unit.unpin()

    def hand_over_pinned(self) -> list:
        """The units' pinned homes as ``(buffer, budget)``, no longer owned by this hook (removing it then
        unlocks nothing): see :meth:`StreamUnit.hand_over_pinned`."""
        return [kept for kept in (u.hand_over_pinned() for u in self.units()) if kept is not None]

    def _streams(self):
        if self.streams is None and self.execution_device.type == "cuda" and torch.cuda.is_available():
            self.streams = CudaStreams(self.execution_device)
        return self.streams

    def pre_forward(self, module, *args, **kwargs):
        if self.forwards_left is not None:
            self.forwards_left -= 1
        self.core.onload(self.execution_device, self._streams())
        if self.streamed:
            self.streamed[0].onload(self.execution_device, self._streams())
        self.core.wait()
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)

    def before_block(self, j: int) -> None:
        if self.interrupt is not None:
            try:
                self.interrupt()
            except BaseException:
                if self.ring is not None:  # no copy may still be landing when the stage drops the buffers
                    self.ring.drain()
                raise
        unit = self.streamed[j]
        unit.onload(self.execution_device, self._streams())  # no-op when prefetched
        unit.wait()
        self.ring.running = unit
        last = j + 1 == len(self.streamed)
        if last and self.forwards_left is not None and self.forwards_left <= 0:
            return  # the stage's last forward: block 0 would be copied for nothing
        nxt = self.streamed[(j + 1) % len(self.streamed)]
        if nxt is not unit:
            nxt.onload(self.execution_device, self._streams())

    def after_block(self, j: int) -> None:
        self.streamed[j].offload()

    def offload_all(self) -> None:
        if self.ring is not None:
            self.ring.drain()
        for unit in self.units():
            unit.offload()
        self.forwards_left = None
        self.interrupt = None
        if self.ring is not None:
            self.ring.running = None
            self.ring.release_device()

    def detach_hook(self, module):
        self.offload_all()
        if self.ring is not None:
            self.ring.release_host()
        self.unpin_homes()
        return module


class _StreamedBlockHook(ModelHook):
    def __init__(self, streamer: BlockStreamer, index: int):
        self.streamer = streamer
        self.index = index

    def pre_forward(self, module, *args, **kwargs):
        self.streamer.before_block(self.index)
        return args, kwargs

    def post_forward(self, module, output):
        self.streamer.after_block(self.index)
        return output


# -- what the staging buffers will take, from the checkpoints' headers ------------------------------


def ring_staging_bytes(model_dir, transformer_subfolder: str, dtype: torch.dtype, transformer_file=None, *,
                       text_encoder_dtype: Optional[torch.dtype] = None, text_encoder_file=None) -> int:
    """Pinned host bytes offload ``block``'s staging buffers take on a CUDA device at most (headers only,
    no weights read): two per streamer, each as large as its largest block (tensors aligned as in the
    ring), for the DiT and, with ``text_encoder_dtype``, the text encoder's decoder layers. A GGUF DiT's
    blocks stream their quantized bytes. Pinned homes (within their own budget) take the homes' place
    and add nothing."""
    from ..files.checkpoint_files import safetensors_files
    from ..model.transformer import is_fp32_island

    root = None if model_dir is None else Path(model_dir)  # None: the three files alone
    if transformer_file:
        from ..model.dit_files import DitFile, loaded_bytes, transformer_config

        dit = DitFile(transformer_file)
        tables = [loaded_bytes(dit, dtype, transformer_config(root, transformer_subfolder, transformer_file, dit))]
    else:
        folder = root / transformer_subfolder
        tables = [loaded_tensor_bytes(path, dtype, is_fp32_island)
                  for path in safetensors_files(folder, transformer_subfolder, "diffusion_pytorch_model")]
    total = RING_SLOTS * _largest_block(tables, _DIT_BLOCK)
    if text_encoder_dtype is not None:
        if text_encoder_file:  # a GGUF's layers stream their quantized bytes
            tables = [text_encoder_file_bytes(text_encoder_file, text_encoder_dtype)]
        else:
            tables = [loaded_tensor_bytes(p, text_encoder_dtype)
                      for p in safetensors_files(root / "text_encoder", "text_encoder", "model")]
        total += RING_SLOTS * _largest_block(tables, _TEXT_LAYER)
    return total


_DIT_BLOCK = re.compile(r"^blocks\.(\d+)\.")
_TEXT_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")  # not the vision blocks


def _largest_block(tables, pattern) -> int:
    """The ring bytes of the largest block whose tensor names match ``pattern`` (group 1: its index)."""
    per_block: Dict[str, int] = {}
    for table in tables:
        for name, n in table.items():
            m = pattern.match(name)
            if m:
                per_block[m.group(1)] = per_block.get(m.group(1), 0) + -(-n // RING_ALIGN) * RING_ALIGN
    return max(per_block.values(), default=0)
