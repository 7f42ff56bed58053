"""Which attention kernel the DiT uses: a user's choice, mapped onto diffusers' attention dispatcher.

The transformer has one dispatch point (``Attention.forward`` calls
``diffusers.models.attention_dispatch.dispatch_attention_fn`` with q, k, v as (B, S, heads, head_dim)).
This module turns a choice into a diffusers backend name and refuses a choice that cannot run, with
the ``pip install`` that fixes it:

- ``sdpa``: PyTorch's ``scaled_dot_product_attention`` (diffusers ``native``); the reference numbers;
- ``flash_attn``: the ``flash-attn`` package, FlashAttention 3 (``flash_attn_interface``) on Hopper
  when it is installed, else FlashAttention 2; CUDA, bf16/fp16 only;
- ``sage``: the ``sageattention`` package (8-bit QK); CUDA, bf16/fp16 only.
"""

from __future__ import annotations

from typing import Optional

import torch

ATTENTION_CHOICES = ("sdpa", "flash_attn", "sage")

_INSTALL = {
    "flash_attn": "pip install flash-attn --no-build-isolation (FlashAttention 2, Ampere or newer), or build "
                  "FlashAttention 3 from its hopper/ folder for H100-class GPUs",
    "sage": "pip install sageattention (SageAttention 2 needs a CUDA GPU of the Ampere generation or newer)",
}


def check_attention(choice: str) -> str:
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention={choice!r} is not available; choose one of {', '.join(ATTENTION_CHOICES)}.")
    return choice


def _usable(backend: str) -> Optional[str]:
    """None when diffusers can run ``backend`` (its own package and version check), else its reason."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(AttentionBackendName(backend))
    except RuntimeError as e:
        return str(e)
    return None


def _hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9


def diffusers_backend(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """The diffusers backend name for ``choice`` on ``device`` with compute ``dtype``; raises a
    ValueError saying what to install or change when it cannot run there."""
    check_attention(choice)
    if choice == "sdpa":
        return "native"
    if device.type != "cuda":
        raise ValueError(f"attention={choice!r} runs on CUDA GPUs only (this pipeline computes on {device}); use 'sdpa'.")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention={choice!r} needs bf16 or fp16 compute, but the DiT computes in {dtype}; "
                         "load it with dit_precision bf16 (or fp8, computed in bf16), or use 'sdpa'.")
    if choice == "flash_attn":
        candidates = (["_flash_3"] if _hopper(device) else []) + ["flash"]
    else:
        candidates = ["sage"]
    reasons = []
    for backend in candidates:
        reason = _usable(backend)
        if reason is None:
            return backend
        reasons.append(reason)
    raise ValueError(f"attention={choice!r} needs the {'flash-attn' if choice == 'flash_attn' else 'sageattention'} "
                     f"package, which is not usable here ({reasons[-1]}). Install it: {_INSTALL[choice]}; or use 'sdpa'.")
