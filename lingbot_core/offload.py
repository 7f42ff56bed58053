"""CPU offload for the three components, correct under any stage order.

``none`` keeps every component on the execution device. ``model`` chains accelerate's
``cpu_offload_with_hook`` as text_encoder -> transformer -> vae: a component moves to the device when
its forward runs and evicts only its predecessor. ``sequential`` streams each module's weights in its
own forward (accelerate ``cpu_offload``), with whole subtrees preloaded where a forward reads a child's
tensors directly (the Qwen3-VL vision tower, the MoE feed-forward that reads raw expert weights).

The chain assumes a fixed call order; a ComfyUI graph gives none. :meth:`Offloader.stage` therefore
evicts everything before and after each stage, also when the stage raises or is interrupted, so a
stage always runs with exactly its own component resident and leaves nothing behind.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Dict, Iterable, Iterator, List, Optional

import torch
from torch import nn
from accelerate import cpu_offload, cpu_offload_with_hook
from accelerate.hooks import AlignDevicesHook, SequentialHook, UserCpuOffloadHook, remove_hook_from_module

logger = logging.getLogger("lingbot_core")

OFFLOAD_MODES = ("none", "model", "sequential")
# Order in which model offload chains the components (each evicts its predecessor).
MODEL_OFFLOAD_SEQUENCE = ("text_encoder", "transformer", "vae")


def check_offload_mode(mode: str) -> str:
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"offload={mode!r} is not a valid offload mode; choose one of {', '.join(OFFLOAD_MODES)}.")
    return mode


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


def execution_device_of(module: nn.Module) -> torch.device:
    """Where ``module`` computes: its offload hooks' execution device, else its parameters' device."""
    for sub in module.modules():
        for hook in _hooks(sub):
            device = getattr(hook, "execution_device", None)
            if device is not None:
                return torch.device(device)
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


class Offloader:
    """Owns the placement of a set of named components (``text_encoder``, ``transformer``, ``vae``).

    ``preload`` maps a component name to class names whose instances load their whole subtree at once
    under sequential offload.
    """

    def __init__(self, components: Dict[str, nn.Module], preload: Optional[Dict[str, List[str]]] = None):
        self.components = dict(components)
        self.preload = dict(preload or {})
        self.mode = "none"
        self.device = torch.device("cpu")
        self._chain: List[UserCpuOffloadHook] = []
        self._failed: Optional[str] = None  # why the last apply() failed; stages refuse to run then

    # -- configuration --------------------------------------------------------------------------

    def apply(self, mode: str, device=None) -> None:
        """Install ``mode`` on ``device``; removes any previous hooks first (never ``.to()`` a hooked module)."""
        check_offload_mode(mode)
        device = resolve_device(device)
        self.remove_hooks()
        if mode != "none" and device.type == "cpu":
            logger.info("offload=%s on a CPU execution device installs real hooks but saves no memory.", mode)
        try:
            self._install(mode, device)
        except BaseException as e:
            # e.g. out of memory while moving to the GPU: leave everything on the CPU, unhooked.
            self.remove_hooks()
            for module in self.components.values():
                module.to("cpu")
            empty_device_cache(device)
            self._failed = f"offload={mode!r} on {device} failed ({type(e).__name__}: {e})"
            raise
        self._failed = None
        self.mode, self.device = mode, device
        empty_device_cache(device)

    def _install(self, mode: str, device: torch.device) -> None:
        if mode == "none":
            for module in self.components.values():
                module.to(device)
        elif mode == "model":
            prev = None
            for name in MODEL_OFFLOAD_SEQUENCE:
                module = self.components.get(name)
                if module is None:
                    continue
                _, prev = cpu_offload_with_hook(module.to("cpu"), device, prev_module_hook=prev)
                self._chain.append(prev)
        else:
            for name, module in self.components.items():
                module.to("cpu")
                cpu_offload(
                    module, device, offload_buffers=len(module._parameters) > 0,
                    preload_module_classes=self.preload.get(name) or None,
                )

    def remove_hooks(self) -> None:
        """Detach every hook; sequential weights are restored to their CPU tensors by accelerate."""
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
        sequential: put back on ``meta`` any weights that a forward which raised left materialised.
        none: nothing to do.
        """
        if self.mode == "model":
            for hook in self._chain:
                hook.offload()
            empty_device_cache(self.device)
        elif self.mode == "sequential":
            dirty = False
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
            yield
        finally:
            self.reset()

    def execution_device(self, name: str) -> torch.device:
        module = self.components.get(name)
        if module is None:
            return self.device
        return execution_device_of(module)

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
