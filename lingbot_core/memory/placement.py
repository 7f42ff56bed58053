"""Which device each component computes on: the pipeline's device, or a per-component override.

With two GPUs in one box, the text encoder (8.3 GiB in bf16) and the VAE can run on the second card
so the first one holds only the DiT. The DiT always uses the pipeline's device; ``text_encoder`` and
``vae`` may name another one (``cpu`` or a CUDA device). The offload mode keeps its meaning per
component: under ``none`` a component stays on its own device, under ``model`` it is moved there only
while it runs, and so on. Stage inputs go to the component's execution device.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional

import torch

from .offload import resolve_device

PLACEABLE = ("text_encoder", "vae")  # the DiT follows the pipeline's device
DEFAULT = "default"


def device_choices() -> List[str]:
    """What a host may offer for a component: ``default`` (the pipeline's device), ``cpu``, and each CUDA
    device present (none on a machine without CUDA, ``cuda:0`` only on a one-GPU machine)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [DEFAULT, "cpu"] + [f"cuda:{i}" for i in range(count)]


def check_component_devices(devices: Optional[Mapping[str, object]]) -> Dict[str, torch.device]:
    """``{component: device}`` overrides, resolved (``default`` / None entries are dropped)."""
    out: Dict[str, torch.device] = {}
    for name, value in (devices or {}).items():
        if name not in PLACEABLE:
            raise ValueError(f"a device can be chosen for {' and '.join(PLACEABLE)}, not {name!r} (the DiT uses the "
                             "pipeline's device).")
        if value is None or value == DEFAULT:
            continue
        try:
            device = torch.device(value)
        except (RuntimeError, TypeError):
            raise ValueError(f"{name}_device={value!r} is not a device; use {', '.join(device_choices())}.") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}_device={value!r} is not allowed; use cpu or a CUDA device ({', '.join(device_choices())}).")
        if device.type == "cuda" and device.index is not None and torch.cuda.is_available() \
                and device.index >= torch.cuda.device_count():
            raise ValueError(f"{name}_device={value!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                             f"use {', '.join(device_choices())}.")
        out[name] = resolve_device(device)
    return out
