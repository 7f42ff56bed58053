"""torch.compile of the DiT, block by block ("regional compilation").

``compile_blocks`` calls diffusers' ``ModelMixin.compile_repeated_blocks``, which compiles every module
whose class the model names in ``_repeated_blocks``: here :class:`~lingbot_core.model.transformer.BlockCompute`,
one CFG branch through one block. That module holds no tensors and no offload hook (the hooks sit on
the block around it), so dynamo traces the block's math only, and since all blocks share its code
they share one compiled graph (two for the MoE: dense and MoE feed-forward). The sequence length is
marked dynamic, so a new prompt (another text length) or resolution does not recompile, and the MoE
expert loop runs eagerly (its sizes depend on the routing).

Dynamo's limits are process-wide: compiling sets at least ``RECOMPILE_LIMIT`` graphs per code object
and ``ACCUMULATED_RECOMPILE_LIMIT`` in all, so a run never falls back to eager halfway (the reported
failure mode of block compiles hitting the default limit of 8).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

logger = logging.getLogger("lingbot_core")

RECOMPILE_LIMIT = 64
ACCUMULATED_RECOMPILE_LIMIT = 256


def _units(transformer):
    names = set(transformer._repeated_blocks)
    return [m for m in transformer.modules() if type(m).__name__ in names]


def blocks_compiled(transformer) -> bool:
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in _units(transformer))


def compile_blocks(transformer) -> None:
    """Compile every block's computation (lazily: the first forward compiles)."""
    if blocks_compiled(transformer):
        return
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, ACCUMULATED_RECOMPILE_LIMIT)
    transformer.compile_repeated_blocks()
    logger.info("compile_blocks: %d blocks will be compiled by torch.compile on the first DiT forward.",
                len(_units(transformer)))


def uncompile_blocks(transformer) -> None:
    """Back to eager (the compiled graphs stay in dynamo's cache for a later compile_blocks)."""
    for module in _units(transformer):
        # nn.Module.compile() stores the compiled call here; None is its "not compiled" state.
        module._compiled_call_impl = None


class FirstStepsTimer:
    """Wraps a step callback to log how long the first step (which compiles) and the second took."""

    def __init__(self, callback=None):
        self.callback = callback
        self.status = getattr(callback, "status", None)
        self._start = time.perf_counter()
        self._first: Optional[float] = None

    def __call__(self, step, total, x0):
        now = time.perf_counter()
        if step == 0:
            self._first = now - self._start
            logger.info("compile_blocks: first step took %.1f s (torch.compile of the blocks included).", self._first)
        elif step == 1 and self._first is not None:
            second = now - self._start - self._first
            logger.info("compile_blocks: second step took %.2f s, so compiling took about %.1f s.",
                        second, max(self._first - second, 0.0))
        if self.callback is not None:
            self.callback(step, total, x0)
