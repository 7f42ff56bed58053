"""A pipeline's speed options (attention kernel, block compile, CFG lockstep), applied without a reload.

The step cache is not here: it is a per-run argument (``generate(..., step_cache=...)``), see
:mod:`lingbot_core.sampling.step_cache`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from ..model.attention import check_attention, diffusers_backend
from ..model.block_compile import compile_blocks, uncompile_blocks

logger = logging.getLogger("lingbot_core")


@dataclass(frozen=True)
class SpeedOptions:
    """``attention``: sdpa | flash_attn | sage (lingbot_core.model.attention). ``compile_blocks``: torch.compile
    each DiT block (lingbot_core.model.block_compile). ``cfg_lockstep``: run the two CFG branches through
    the DiT block by block in one call (same frames; half the weight traffic of a streaming offload)."""

    attention: str = "sdpa"
    compile_blocks: bool = False
    cfg_lockstep: bool = True

    def __post_init__(self):
        check_attention(self.attention)
        for name in ("compile_blocks", "cfg_lockstep"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed: use True or False.")

    def updated(self, **changes) -> "SpeedOptions":
        """A copy with the given options changed; ``None`` keeps the current value."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def apply_speed(transformer, current: SpeedOptions, new: SpeedOptions, device: torch.device) -> SpeedOptions:
    """Put ``new`` into effect on ``transformer`` (switching from ``current``); returns ``new``.
    Works under every offload mode: the compiled unit never contains an offload hook."""
    backend = diffusers_backend(new.attention, device, transformer.compute_dtype)  # raises before any change
    transformer.set_attention_backend(backend)
    if new.compile_blocks:
        compile_blocks(transformer)
    else:
        uncompile_blocks(transformer)
    if new != current:
        logger.info("speed options: attention=%s (diffusers %s), compile_blocks=%s, cfg_lockstep=%s.",
                    new.attention, backend, new.compile_blocks, new.cfg_lockstep)
    return new
