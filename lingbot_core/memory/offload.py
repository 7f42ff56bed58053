"""CPU offload for the three components, correct under any stage order.

``none`` keeps every component on its execution device. ``model`` chains the components as
text_encoder -> transformer -> vae (:class:`HomeOffload`, accelerate's ``CpuOffload`` that keeps each
weight's CPU tensor): a component is copied to the device when its forward runs and evicts only its
predecessor; evicting drops the device copy and points the module back at the CPU tensors it never
left, so nothing is ever copied device-to-host. ``sequential`` streams each module's weights in its
own forward (accelerate ``cpu_offload``), with whole subtrees preloaded where a forward reads a
child's tensors directly (the Qwen3-VL vision tower, the MoE feed-forward that reads raw expert
weights); its VAE is placed as under ``model`` (its decoder runs once per latent frame of every
tile: streamed, its weights would cross the bus hundreds of times per decode). ``block`` places the VAE
as ``model`` does and streams the DiT block by block and the text encoder layer by layer
(:class:`~lingbot_core.memory.block_streaming.BlockStreamer`, whose ring and staging live in
:mod:`lingbot_core.memory.block_streaming`): the DiT's ``blocks_on_gpu`` blocks stay resident, every other
block is copied in just before it runs while the next one is prefetched. This module pins the streamed
units' homes within the pin budget (:class:`~lingbot_core.memory.host_memory.PinBudget`).

The chain assumes a fixed call order; a ComfyUI graph gives none. :meth:`Offloader.stage` therefore
evicts everything before and after each stage, also when the stage raises or is interrupted, so a
stage always runs with exactly its own component resident and leaves nothing behind.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, List, Optional

import torch
from torch import nn
from accelerate import cpu_offload
from accelerate.hooks import (
    AlignDevicesHook, CpuOffload, SequentialHook, UserCpuOffloadHook, add_hook_to_module, remove_hook_from_module,
)

from ..model.precision import probe_grouped_mm
from . import host_memory
from .block_streaming import BlockStreamer, StreamUnit, dit_blocks

logger = logging.getLogger("lingbot_core")

OFFLOAD_MODES = ("none", "model", "sequential", "block")
# Order in which model offload chains the components (each evicts its predecessor).
MODEL_OFFLOAD_SEQUENCE = ("text_encoder", "transformer", "vae")
# Largest ``blocks_on_gpu`` accepted (the MoE DiT has 48 blocks; more than the depth keeps every block).
MAX_BLOCKS_ON_GPU = 64


def check_offload_mode(mode: str) -> str:
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"offload={mode!r} is not a valid offload mode; choose one of {', '.join(OFFLOAD_MODES)}.")
    return mode


def check_blocks_on_gpu(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BLOCKS_ON_GPU:
        raise ValueError(f"blocks_on_gpu={value!r} is not allowed: use an integer from 0 to {MAX_BLOCKS_ON_GPU} "
                         "(DiT blocks kept on the GPU under offload 'block'; 0 = lowest VRAM).")
    return value


def resolve_device(device=None) -> torch.device:
    """The caller's device, indexed for CUDA (accelerate compares devices by equality)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        # Never "cpu:0": Parameter.to("cpu:0") is not a no-op and breaks accelerate's hooks.
        device = torch.device("cpu")
    return device


def _hooks(module: nn.Module) -> List:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(hook.hooks) if isinstance(hook, SequentialHook) else [hook]


def execution_device_of(module: nn.Module, placed: Optional[torch.device] = None) -> torch.device:
    """Where ``module`` computes: its offload hooks' execution device, else ``placed`` (where offload
    ``none`` put it), else its parameters' device."""
    for sub in module.modules():
        for hook in _hooks(sub):
            device = getattr(hook, "execution_device", None)
            if device is not None:
                return torch.device(device)
    if placed is not None:
        return placed
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def empty_device_cache(device: torch.device) -> None:
    """Return freed device memory, and the pinned host blocks PyTorch keeps cached after they were freed."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
        host_memory.empty_host_cache()


class Offloader:
    """Owns the placement of a set of named components (``text_encoder``, ``transformer``, ``vae``).

    ``preload`` maps a component name to class names whose instances load their whole subtree at once
    under sequential offload. ``stacks`` maps a component name to a function that returns its stack of
    blocks: under ``block`` those components are streamed by :class:`BlockStreamer` (the DiT keeps
    ``blocks_on_gpu`` of its blocks resident, others none); without one, a component other than the VAE
    streams its modules as under ``sequential``. ``pin_budget`` (bytes) bounds the pinned homes of this
    offloader alone; by default it draws from the process's budget (:func:`host_memory.shared_pin_budget`:
    ``LINGBOT_PINNED_GB`` or a quarter of RAM, shared by every pipeline).
    """

    def __init__(self, components: Dict[str, nn.Module], preload: Optional[Dict[str, List[str]]] = None,
                 blocks_on_gpu: int = 0, stacks: Optional[Dict[str, Callable]] = None,
                 pin_budget: Optional[int] = None):
        self.components = dict(components)
        self.preload = dict(preload or {})
        self.stacks = dict(stacks or {"transformer": dit_blocks})
        self.pins = host_memory.shared_pin_budget() if pin_budget is None else host_memory.PinBudget(pin_budget)
        self.blocks_on_gpu = check_blocks_on_gpu(blocks_on_gpu)  # used by mode "block"
        self.mode = "none"
        self.device = torch.device("cpu")
        self.devices: Dict[str, torch.device] = {}  # per-component execution devices (else ``device``)
        self._chain: List[UserCpuOffloadHook] = []
        self._failed: Optional[str] = None  # why the last apply() failed; stages refuse to run then
        # Pinned homes ``(buffer, budget)`` handed over by removed streamers: a re-hook over unchanged weights
        # takes them back instead of pinning again (gpu-review-4 finding 4). Held while the mode copies from
        # the homes (block, model); unlocked under none / sequential, on release, or when a weight changed.
        self._kept: List[tuple] = []
        # What pinning cost this offloader: seconds in ``_pin_homes``' copies and locks, bytes and units pinned,
        # and units that took a kept pinned home back (nothing copied, nothing locked).
        self.pin_stats = {"pin_s": 0.0, "pinned_bytes": 0, "pinned_units": 0, "kept_units": 0}

    # -- configuration --------------------------------------------------------------------------

    def apply(self, mode: str, device=None, devices: Optional[Dict[str, torch.device]] = None) -> None:
        """Install ``mode`` on ``device``; removes any previous hooks first (never ``.to()`` a hooked module).

        ``devices`` ({component: device}, see ``placement.py``) replaces the per-component devices; None
        keeps them. Each component is placed on its own device in the same mode."""
        check_offload_mode(mode)
        device = resolve_device(device)
        if devices is not None:
            self.devices = {name: resolve_device(d) for name, d in devices.items()}
        self.remove_hooks()
        if mode != "none" and device.type == "cpu":
            logger.info("offload=%s on a CPU execution device installs real hooks but saves no memory.", mode)
        try:
            self._install(mode, device)
        except BaseException as e:
            # e.g. out of memory while moving to the GPU: leave everything on the CPU, unhooked.
            self.remove_hooks()
            self._unpin_kept()
            for module in self.components.values():
                module.to("cpu")
            empty_device_cache(device)
            self._failed = f"offload={mode!r} on {device} failed ({type(e).__name__}: {e})"
            raise
        self._failed = None
        self.mode, self.device = mode, device
        # At placement, not at the first MoE call mid-forward: the probe synchronises and switches the
        # process-wide sync-debug mode (gpu-review-4 finding 12). Once per device, a no-op off CUDA.
        probe_grouped_mm(self.component_device("transformer", device))
        if mode not in ("block", "model"):  # the weights no longer copy from their homes
            self._unpin_kept()
        empty_device_cache(device)

    def component_device(self, name: str, device: Optional[torch.device] = None) -> torch.device:
        return self.devices.get(name, self.device if device is None else device)

    def _install(self, mode: str, main: torch.device) -> None:
        device = lambda name: self.component_device(name, main)  # noqa: E731
        if mode == "none":
            for name, module in self.components.items():
                module.to(device(name))
        elif mode == "model":
            prev = None
            for name in MODEL_OFFLOAD_SEQUENCE:
                module = self.components.get(name)
                if module is not None:
                    prev = self._chain_hook(module.to("cpu"), device(name), prev)
        elif mode == "block":
            prev = None
            for name in MODEL_OFFLOAD_SEQUENCE:
                module = self.components.get(name)
                if module is None:
                    continue
                module.to("cpu")
                if name in self.stacks:  # the text encoder (8.3 GiB whole) too: block's bound holds at prompt encode
                    k = self.blocks_on_gpu if name == "transformer" else 0
                    add_hook_to_module(module, BlockStreamer(device(name), k, self.stacks[name]))
                elif name == "vae":
                    prev = self._chain_hook(module, device(name), prev)
                else:
                    self._stream_layers(name, module, device(name))
        else:
            for name, module in self.components.items():
                module.to("cpu")
                if name == "vae":
                    # Placed as under model: the decoder runs once per latent frame of every tile, and
                    # streaming its weights for each call copies ~150 GB per 1080p x 121 decode for a
                    # 0.5 GB VAE (gpu-review-3 finding 8). The VAE fits where the DiT's blocks do.
                    self._chain_hook(module, device(name), None)
                else:
                    self._stream_layers(name, module, device(name))

    def _chain_hook(self, module: nn.Module, device: torch.device, prev) -> UserCpuOffloadHook:
        """accelerate's ``cpu_offload_with_hook`` with :class:`HomeOffload` instead of ``CpuOffload``."""
        hook = HomeOffload(execution_device=device, prev_module_hook=prev)
        add_hook_to_module(module, hook, append=True)
        user = UserCpuOffloadHook(module, hook)
        self._chain.append(user)
        return user

    def _stream_layers(self, name: str, module: nn.Module, device: torch.device) -> None:
        cpu_offload(module, device, offload_buffers=len(module._parameters) > 0,
                    preload_module_classes=self.preload.get(name) or None)

    def streamers(self) -> List[BlockStreamer]:
        """Offload ``block``'s streamers, the DiT's first."""
        out = []
        for name in ("transformer", *[n for n in self.components if n != "transformer"]):
            module = self.components.get(name)
            out += [h for h in (_hooks(module) if module is not None else ()) if isinstance(h, BlockStreamer)]
        return out

    def streamer(self, name: str) -> Optional[BlockStreamer]:
        """The :class:`BlockStreamer` of component ``name`` (offload ``block``), else None."""
        module = self.components.get(name)
        return next((h for h in _hooks(module) if isinstance(h, BlockStreamer)), None) if module is not None else None

    def expect_forwards(self, n: Optional[int], component: str = "transformer") -> None:
        """The forwards of ``component`` the running stage will make (None: unknown). Offload ``block``
        then does not prefetch the first block after the last forward's last block (a copy nothing would
        use)."""
        streamer = self.streamer(component)
        if streamer is not None:
            streamer.forwards_left = n

    def set_interrupt(self, check: Optional[Callable[[], None]]) -> None:
        """``check()`` (it raises to cancel, e.g. ComfyUI's interrupt) runs before each streamed DiT block of
        the running stage under offload ``block``: a long step is cancelled between blocks, not only between
        steps. The copies in flight are drained before the exception leaves; the stage's reset clears it."""
        streamer = self.streamer("transformer")
        if streamer is not None:
            streamer.interrupt = check

    def remove_hooks(self) -> None:
        """Detach every hook; sequential weights are restored to their CPU tensors by accelerate. Pinned
        homes stay locked (kept for the next hooks, see ``_kept``)."""
        for streamer in self.streamers():
            self._kept += streamer.hand_over_pinned()
        for module in self.components.values():
            remove_hook_from_module(module, recurse=True)
        self._chain = []
        self.mode = "none"

    def release(self) -> None:
        """Remove hooks and free every weight now, in any mode.

        The tensors are dropped from the modules themselves, not only the references to the modules:
        a module that something else still reaches (a reference cycle through a removed hook, a
        caller's variable) then holds no weights, so nothing waits for a later cyclic GC.
        """
        try:
            self.remove_hooks()
            self._unpin_kept()
        finally:
            for module in self.components.values():
                _drop_tensors(module)
            self.components.clear()
            self._chain = []
            empty_device_cache(self.device)

    # -- per-stage lifecycle --------------------------------------------------------------------

    def reset(self) -> None:
        """Leave no component on the execution device.

        model: offload every component of the chain (a full reset of the chain's state).
        block: the same for the VAE, and every DiT block and the DiT's other weights; the text encoder
        as under sequential.
        sequential: offload the VAE (placed as under model); put back on ``meta`` any weights that a
        forward which raised left materialised.
        none: nothing to do.
        """
        dirty = False
        if self._chain:  # model's chain, block's and sequential's VAE
            for hook in self._chain:
                hook.offload()
            dirty = True
        for streamer in self.streamers():
            streamer.offload_all()
            dirty = True
        if self.mode in ("sequential", "block"):
            for module in self.components.values():
                for sub in module.modules():
                    for hook in _hooks(sub):
                        if isinstance(hook, AlignDevicesHook) and hook.offload and _has_materialised(sub, hook):
                            hook.post_forward(sub, None)
                            dirty = True
        if dirty:
            empty_device_cache(self.device)

    @contextmanager
    def stage(self) -> Iterator[None]:
        """Run a stage with nothing resident before it and nothing left after it, even on error."""
        if self._failed:
            raise RuntimeError(f"{self._failed}; choose another offload mode (e.g. 'model' or 'sequential').")
        self.reset()
        try:
            self._give_back_pins()
            self._pin_homes()
            yield
        finally:
            self.reset()

    def _pin_homes(self) -> None:
        """Offload ``block`` on CUDA: move the homes of streamed units into page-locked memory while the pin
        budget allows, so their copies to the device need no host memcpy. Streamed blocks first (copied every
        step), the DiT's first, then the resident weights (copied once per stage); a unit is pinned whole
        or not at all. Runs once per loaded weights: a unit whose homes still lie in a pinned buffer kept
        from earlier hooks (an offload switch) takes it back; kept buffers no unit takes (a LoRA change
        replaced weights) are unlocked first. A refused lock (an OS limit) stops it for this offloader."""
        streamers = [s for s in self.streamers() if s.execution_device.type == "cuda"]
        if not streamers:
            return
        units = [u for s in streamers for u in s.streamed] + [s.core for s in streamers]
        self._take_back_kept(units)
        if self.pins.total == 0:
            return
        t0, pinned = time.perf_counter(), []
        try:
            for unit in units:
                if unit.pinned is not None or unit.on_device or not unit.nbytes or not self.pins.take(unit.span):
                    continue
                buffer = host_memory.pinned_buffer(unit.span)
                if not buffer.pinned:
                    buffer.free()
                    self.pins.give(unit.span)
                    self.pins.total = self.pins.used  # the OS's limit: no further attempt in this process
                    logger.info("offload=block: the OS refused to pin more weights (%d MiB pinned); the rest is copied "
                                "through the staging buffers.", self.pins.used >> 20)
                    return
                unit.pin_home(buffer, self.pins)
                pinned.append(unit)
        finally:
            if pinned:
                seconds, nbytes = time.perf_counter() - t0, sum(u.span for u in pinned)
                stats = self.pin_stats
                stats["pin_s"] += seconds
                stats["pinned_bytes"] += nbytes
                stats["pinned_units"] += len(pinned)
                logger.info("LingBot-Video: pinned %.2f GiB of weights (%d blocks and resident parts) in %.1f s; kept "
                            "across offload switches until the weights change.", nbytes / 2 ** 30, len(pinned), seconds)

    def _give_back_pins(self) -> None:
        """At a stage's start, unlock pinned homes while the pin budget is exceeded: the host pinned more of
        its own since they were pinned (ComfyUI's models), or RAM available fell below the headroom (gpu-review-4
        finding 11). Kept buffers go first, then the resident parts, then the streamed blocks from the last
        (the first blocks are copied most often). Nothing is copied: the weights stay where they are, pageable."""
        excess = self.pins.excess()
        if excess <= 0:
            return
        given = 0
        while self._kept and given < excess:
            buffer, budget = self._kept.pop()
            given += buffer.nbytes
            self._unpin([(buffer, budget)])
        streamers = self.streamers()
        units = [s.core for s in streamers] + [u for s in streamers for u in reversed(s.streamed)]
        for unit in units:
            if given >= excess:
                break
            if unit.pinned is not None and unit._budget is self.pins:
                given += unit.span
                unit.unpin()
        if given:
            logger.info("LingBot-Video: unlocked %.2f GiB of pinned weights: the pin budget now leaves %.2f GiB (the "
                        "host's own pinned memory or the RAM headroom changed since they were pinned).",
                        given / 2 ** 30, self.pins.limit() / 2 ** 30)

    def _take_back_kept(self, units) -> None:
        kept, self._kept = self._kept, []
        for unit in units:
            for i, (buffer, budget) in enumerate(kept):
                if unit.adopt_pinned(buffer, budget):
                    self.pin_stats["kept_units"] += 1
                    del kept[i]
                    break
        self._unpin(kept)

    def _unpin_kept(self) -> None:
        kept, self._kept = self._kept, []
        self._unpin(kept)

    @staticmethod
    def _unpin(kept) -> None:
        """Unlock kept pinned buffers; the weights that still point into them keep their values (pageable)."""
        for buffer, budget in kept:
            nbytes = buffer.nbytes
            buffer.free()
            if budget is not None:
                budget.give(nbytes)

    def execution_device(self, name: str) -> torch.device:
        module = self.components.get(name)
        if module is None:
            return self.device
        return execution_device_of(module, self.component_device(name))

    def device_bytes(self) -> int:
        """Bytes of weights on a non-CPU, non-meta device right now (what ComfyUI is told is in VRAM)."""
        seen, total = set(), 0
        for module in self.components.values():
            for t in _tensors(module):
                if t.device.type in ("cpu", "meta") or t.data_ptr() in seen:
                    continue
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def pinned_bytes(self) -> int:
        """Page-locked host bytes this offloader holds (offload ``block``: pinned homes and staging buffers; the
        pinned homes kept across a switch to ``model``)."""
        kept = sum(buffer.nbytes for buffer, _ in self._kept if buffer.pinned)
        return sum(s.pinned_bytes() for s in self.streamers()) + kept

    def resident(self) -> List[str]:
        """Names of components with weights on a non-CPU, non-meta device (diagnostics and tests)."""
        out = []
        for name, module in self.components.items():
            if any(t.device.type not in ("cpu", "meta") for t in _tensors(module)):
                out.append(name)
        return out


def _drop_tensors(module: nn.Module) -> None:
    for sub in module.modules():
        for name in list(sub._parameters):
            sub._parameters[name] = None
        for name in list(sub._buffers):
            sub._buffers[name] = None


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _has_materialised(module: nn.Module, hook: AlignDevicesHook) -> bool:
    tensors = module.named_parameters(recurse=hook.place_submodules)
    return any(t.device.type != "meta" for _, t in tensors)


class HomeOffload(CpuOffload):
    """accelerate's ``CpuOffload`` (offload ``model``'s chain) that never copies weights back.

    ``CpuOffload`` evicts with ``module.to("cpu")``: every weight, unchanged since it was copied in, is
    copied device-to-host again into fresh pageable memory (8.3 GiB for the text encoder at every stage
    end). This hook remembers each tensor's CPU tensor (its home) while the module is on the CPU, and
    evicts by pointing the module back at the homes, which drops the device copies: PCIe carries the
    weights one way only. A tensor without a home (added while the module was on the device) still
    goes through ``module.to("cpu")``, which is a no-op for everything else.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.homes: Dict[tuple, torch.Tensor] = {}

    def _go_home(self, module: nn.Module) -> None:
        for sub in module.modules():
            for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    key = (id(sub), name)
                    home = self.homes.get(key)
                    if home is None:
                        if t.device.type == "cpu":
                            self.homes[key] = t.data
                    elif t.data_ptr() != home.data_ptr():  # a device copy (weights never change while hooked)
                        if home.shape == t.shape and home.dtype == t.dtype:
                            StreamUnit._set(sub, name, is_param, home)
                        else:  # replaced: module.to("cpu") brings it back; it is the home next time
                            del self.homes[key]

    def init_hook(self, module):
        self._go_home(module)
        return super().init_hook(module)

    def detach_hook(self, module):
        self._go_home(module)
        self.homes = {}
        return module

