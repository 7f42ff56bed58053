"""A residency tracker: what *would* be on the accelerator, proven on a CPU-only machine.

On CPU, parameter devices are always ``cpu`` and outputs are identical in every offload mode, so
neither can show an offload bug. The tracker instead instruments accelerate's own hook entry points
(test-only patching) and replays accelerate's rules:

- ``CpuOffload.pre_forward``: evicts the predecessor if it is resident, then onloads its module;
- ``CpuOffload.init_hook``: the module goes to the CPU (hook attachment, ``offload()``, every reset);
- ``AlignDevicesHook.pre_forward``/``post_forward`` (sequential): a module's own tensors are loaded
  for the duration of its forward.

- ``StreamUnit.onload``/``offload`` (offload ``block``): a placement unit (the DiT's or the text
  encoder's non-block weights with the resident blocks, or one streamed block or layer) is on the device
  from its onload to its offload. Which component and which DiT blocks a unit holds is read from the
  tensors it moves, not from the streamer's bookkeeping.

``bytes_moved`` counts the weight bytes copied to the device (sequential streaming, block onloads,
model-offload onloads of a component that was not resident): the traffic a step costs.

Probes (forward pre-hooks on inner modules) snapshot the resident set when each component actually
computes, which also sees calls that bypass a top-level hook. Under sequential offload a probe fires
before its module's weights stream in, so each streaming step also takes a ``"stream"`` snapshot.

Per device (components placed on different accelerators, ``placement.py``): every onload is also
recorded with the device the hook moved the weights to (``onloads``), and every snapshot also as
``(component, device)`` pairs (``placed_snapshots``); ``resident_on(device)`` is the resident set of
one device.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import ExitStack
from unittest import mock

import torch
from accelerate.hooks import AlignDevicesHook, CpuOffload

from lingbot_core.memory.block_streaming import StreamUnit


def _nbytes(module, recurse):
    return sum(t.numel() * t.element_size() for t in module.parameters(recurse=recurse))


class ResidencyTracker:
    def __init__(self, pipe):
        self.pipe = pipe
        self.components = dict(pipe.offloader.components)
        self.by_id = {id(m): name for name, m in self.components.items()}
        self.owner = {}
        for name, module in self.components.items():
            for sub in module.modules():
                self.owner.setdefault(id(sub), name)
        self.resident = set()  # model offload: whole components
        self.streamed = defaultdict(int)  # sequential: bytes per component currently materialised
        self.events = []
        self.snapshots = []  # (probe, frozenset of resident components)
        self.peak_bytes = 0
        self.pre_forward_calls = defaultdict(int)
        self.bytes_moved = 0
        self._stack = ExitStack()
        self._component_bytes = {name: _nbytes(m, True) for name, m in self.components.items()}
        # offload "block": units on the device (id -> (bytes, DiT block indices held, component)), and per-block probes
        self.units = {}
        blocks = getattr(pipe.transformer, "blocks", [])
        self._block_of = {id(m): i for i, b in enumerate(blocks) for m in b.modules()}
        self.max_blocks_resident = 0
        self.block_snapshots = []  # (block index, blocks resident, that block resident, input device)
        self.onloads = []  # (component, device its weights were moved to)
        self.placed_snapshots = []  # (probe, frozenset of (component, device) resident)

    # -- accounting --------------------------------------------------------------------------

    def resident_bytes(self) -> int:
        if self.pipe.offload == "none":
            return sum(self._component_bytes.values())
        return (sum(self._component_bytes[n] for n in self.resident) + sum(self.streamed.values())
                + sum(b for b, _, _ in self.units.values()))

    def blocks_resident(self) -> set:
        return set().union(*(blocks for _, blocks, _ in self.units.values())) if self.units else set()

    def units_resident(self, component: str) -> int:
        return sum(1 for *_, c in self.units.values() if c == component)

    def _update_peak(self):
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes())

    def current(self) -> frozenset:
        if self.pipe.offload == "none":
            return frozenset(self.components)
        ring = {c for *_, c in self.units.values()}
        return frozenset(self.resident | {n for n, b in self.streamed.items() if b > 0} | ring)

    # -- instrumentation ---------------------------------------------------------------------

    def __enter__(self):
        tracker = self
        self._update_peak()  # under offload "none" everything is resident from the start
        orig_pre, orig_init = CpuOffload.pre_forward, CpuOffload.init_hook
        orig_align_pre, orig_align_post = AlignDevicesHook.pre_forward, AlignDevicesHook.post_forward

        def pre_forward(hook, module, *args, **kwargs):
            name = tracker.by_id.get(id(module))
            prev = hook.prev_module_hook
            prev_name = tracker.by_id.get(id(prev.model)) if prev is not None else None
            if prev_name in tracker.resident:
                tracker.resident.discard(prev_name)
                tracker.events.append(("offload_prev", prev_name))
            if name is not None:
                if name not in tracker.resident:
                    tracker.bytes_moved += tracker._component_bytes[name]
                tracker.resident.add(name)
                tracker.pre_forward_calls[name] += 1
                tracker.events.append(("onload", name))
                tracker.onloads.append((name, torch.device(hook.execution_device)))
            tracker._update_peak()
            return orig_pre(hook, module, *args, **kwargs)

        def init_hook(hook, module):
            name = tracker.by_id.get(id(module))
            if name is not None:
                tracker.resident.discard(name)
                tracker.events.append(("offload", name))
            return orig_init(hook, module)

        def align_pre(hook, module, *args, **kwargs):
            if hook.offload:
                name = tracker.owner.get(id(module))
                if name is not None:
                    tracker.streamed[name] += _nbytes(module, hook.place_submodules)
                    tracker.bytes_moved += _nbytes(module, hook.place_submodules)
                    tracker.onloads.append((name, torch.device(hook.execution_device)))
                    tracker._update_peak()
                    tracker._snap("stream")  # probes fire before a module streams in; this sees it loaded
            return orig_align_pre(hook, module, *args, **kwargs)

        def align_post(hook, module, output):
            if hook.offload:
                name = tracker.owner.get(id(module))
                if name is not None and any(p.device.type != "meta" for p in module.parameters(recurse=hook.place_submodules)):
                    tracker.streamed[name] -= _nbytes(module, hook.place_submodules)
            return orig_align_post(hook, module, output)

        orig_unit_on, orig_unit_off = StreamUnit.onload, StreamUnit.offload

        def unit_onload(unit, device, stream=None):
            blocks = {tracker._block_of[id(m)] for m, *_ in unit.slots if id(m) in tracker._block_of}
            component = next(tracker.owner[id(m)] for m, *_ in unit.slots)
            nbytes = sum(t.numel() * t.element_size() for *_, t in unit.slots)
            if not unit.on_device:
                tracker.bytes_moved += nbytes
            tracker.units[id(unit)] = (nbytes, blocks, component)
            tracker.onloads.append((component, torch.device(device)))
            tracker.events.append(("unit_onload", unit.label))
            tracker.max_blocks_resident = max(tracker.max_blocks_resident, len(tracker.blocks_resident()))
            tracker._update_peak()
            return orig_unit_on(unit, device, stream)

        def unit_offload(unit):
            if tracker.units.pop(id(unit), None) is not None:
                tracker.events.append(("unit_offload", unit.label))
            return orig_unit_off(unit)

        self._stack.enter_context(mock.patch.object(StreamUnit, "onload", unit_onload))
        self._stack.enter_context(mock.patch.object(StreamUnit, "offload", unit_offload))
        for i, block in enumerate(blocks_of(self.pipe.transformer)):
            handle = block.attn.to_q.register_forward_pre_hook(
                lambda m, a, i=i: self.block_snapshots.append(
                    (i, len(self.blocks_resident()), i in self.blocks_resident(), a[0].device)))
            self._stack.callback(handle.remove)
        self._stack.enter_context(mock.patch.object(CpuOffload, "pre_forward", pre_forward))
        self._stack.enter_context(mock.patch.object(CpuOffload, "init_hook", init_hook))
        self._stack.enter_context(mock.patch.object(AlignDevicesHook, "pre_forward", align_pre))
        self._stack.enter_context(mock.patch.object(AlignDevicesHook, "post_forward", align_post))
        probes = {
            "TE": self.pipe.text_encoder.model.language_model.embed_tokens,
            "VAE.enc": self.pipe.vae.encoder,
            "VAE.dec": self.pipe.vae.decoder,
            "DiT": self.pipe.transformer.patch_embedder,
        }
        for probe, module in probes.items():
            handle = module.register_forward_pre_hook(lambda m, a, probe=probe: self._snap(probe))
            self._stack.callback(handle.remove)
        return self

    def _snap(self, probe):
        self.snapshots.append((probe, self.current()))
        self.placed_snapshots.append((probe, self.placed()))

    def placed(self) -> frozenset:
        """The resident components with their execution devices."""
        return frozenset((name, self.pipe.offloader.execution_device(name)) for name in self.current())

    def resident_on(self, device) -> frozenset:
        return frozenset(name for name, d in self.placed() if d == torch.device(device))

    def __exit__(self, *exc):
        self._stack.close()
        return False

    # -- queries -----------------------------------------------------------------------------

    def seen(self, probe):
        return [s for p, s in self.snapshots if p == probe]

    def clear(self):
        self.snapshots.clear()
        self.events.clear()
        self.block_snapshots.clear()
        self.onloads.clear()
        self.placed_snapshots.clear()


def blocks_of(transformer):
    return list(getattr(transformer, "blocks", []))


def only(snapshots, component):
    """Every snapshot shows exactly ``component`` resident (and there was at least one)."""
    return snapshots and all(s == {component} for s in snapshots)
