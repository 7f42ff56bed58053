"""``ParallelPlan``: how one generation is split across processes (one device each), and which plans are refused.

The world is ``cfg_degree x context_degree`` ranks, rank ``r`` = ``cfg_rank * context_degree + context_rank``:

- ``cfg_degree`` 2 runs the two classifier-free-guidance branches (cond on cfg rank 0, uncond on cfg rank 1)
  on two groups of ranks at once; the velocities are exchanged with one all-gather per step. About 2x faster,
  no memory saved (each rank holds the whole model).
- ``context_degree`` C splits the DiT's token sequence across C ranks (Ulysses: each rank computes every
  linear layer on 1/C of the tokens and attention on 1/C of the heads, two all-to-alls per attention). About
  Cx faster on long videos, activations / C; it needs ``num_attention_heads % C == 0``. Any sequence length
  works (uneven splits).
- ``fsdp`` shards the DiT's weights over the whole world (FSDP2): each rank keeps about 1/world of them
  and gathers one block's weights while it runs. ``fsdp_text_encoder`` does the same for Qwen3-VL's decoder.
  Memory, not speed.

Offload: plans that only split CFG allow every offload mode on each rank (each rank is a whole pipeline);
context parallel and FSDP need offload ``none`` (their hooks own the weights' placement).

T2V, TI2V and the refiner split alike: TI2V's image tokens are part of both prompts' embeddings and its first
latent frame is pinned on every rank, so the cond and uncond branches stay independent computations (the
reference's image-to-video pipeline also takes a CFG-parallel group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

CFG_DEGREES = (1, 2)
CP_OFFLOAD_MODES = ("none",)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed: use an integer >= 1.")
    return value


@dataclass(frozen=True)
class ParallelPlan:
    """One generation's split: ``cfg_degree`` (1 or 2) x ``context_degree`` ranks, optional FSDP2 sharding."""

    cfg_degree: int = 1
    context_degree: int = 1
    fsdp: bool = False
    fsdp_text_encoder: bool = False

    def __post_init__(self):
        _positive_int("context_parallel_degree", self.context_degree)
        if isinstance(self.cfg_degree, bool) or self.cfg_degree not in CFG_DEGREES:
            raise ValueError(f"cfg_parallel_degree={self.cfg_degree!r} is not allowed: use 1 or 2 (there are two "
                             "guidance branches, cond and uncond).")
        if self.world_size == 1 and (self.fsdp or self.fsdp_text_encoder):
            raise ValueError("FSDP shards the weights over the plan's ranks, and cfg 1 x context 1 is one rank: add "
                             "--context_parallel_degree N (or --cfg_parallel_degree 2) to shard over N ranks.")

    @property
    def world_size(self) -> int:
        return self.cfg_degree * self.context_degree

    @property
    def shards(self) -> bool:
        """Whether the plan installs hooks that own weight placement (context parallel or FSDP)."""
        return self.context_degree > 1 or self.fsdp or self.fsdp_text_encoder

    def describe(self) -> str:
        parts = [f"cfg {self.cfg_degree} x context {self.context_degree} = {self.world_size} ranks"]
        if self.fsdp:
            parts.append("DiT FSDP")
        if self.fsdp_text_encoder:
            parts.append("text-encoder FSDP")
        return ", ".join(parts)

    def check(self, *, world_size: Optional[int] = None, heads: Optional[int] = None, offload: Optional[str] = None,
              device_count: Optional[int] = None) -> "ParallelPlan":
        """Refuse a plan that cannot run here; returns the plan. Each argument left None is not checked.

        ``world_size``: the launched processes (torchrun's WORLD_SIZE); ``heads``: the DiT's attention heads;
        ``offload``: the pipeline's offload mode; ``device_count``: accelerators present (CUDA)."""
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"cfg_parallel_degree {self.cfg_degree} x context_parallel_degree {self.context_degree} needs "
                f"{self.world_size} processes, but {world_size} were launched: start torchrun with "
                f"--nproc_per_node {self.world_size}, or choose degrees whose product is {world_size}.")
        if heads is not None and heads % self.context_degree:
            raise ValueError(
                f"context_parallel_degree {self.context_degree} does not divide the DiT's {heads} attention heads "
                f"({heads} % {self.context_degree} = {heads % self.context_degree}): Ulysses gives each rank whole "
                f"heads; use a degree that divides {heads}.")
        if offload is not None and self.shards and offload not in CP_OFFLOAD_MODES:
            raise ValueError(
                f"offload {offload!r} does not combine with context parallel or FSDP ({self.describe()}): their hooks "
                "place the weights themselves; use offload 'none' (FSDP already keeps only 1/N of the weights per "
                "rank), or a CFG-only plan, which allows every offload mode.")
        if device_count is not None and self.world_size > device_count:
            raise ValueError(f"the plan needs {self.world_size} devices (one per rank) but {device_count} are present.")
        return self
