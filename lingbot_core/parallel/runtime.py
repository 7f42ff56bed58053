"""The process group, the device mesh, and splitting a loaded pipeline across it.

Every rank runs the same program (torchrun starts them): ``init_distributed`` joins the group and names this
rank's device, the pipeline is loaded on that device as usual, ``parallelize`` installs the plan, and then
EVERY rank calls ``pipe.generate(...)`` / ``pipe.refine(...)`` with identical arguments. Every rank returns the
same frames (each decodes them); rank 0 writes them. The engines are torch's and diffusers': a ``DeviceMesh``
with dims ``("cfg", "context")``, diffusers' context-parallel hooks with Ulysses attention (the "anything"
mode, so any token count splits), FSDP2 ``fully_shard``, and one ``all_gather`` per step for CFG parallel.

Step callbacks run on every rank after the same step. A callback that raises on one rank only leaves the other
ranks waiting in their next collective until the group's timeout, so a cancel must be a collective decision:
``if ctx.any_rank(cancel_requested): raise ...`` inside the callback (every rank calls it at that step). The
same holds for a callback's ``interrupt`` check (run between context windows).

After ``parallelize`` the pipeline's LoRAs, offload mode and speed options are fixed (changing them raises
ValueError): release it, load again and parallelize again, with the same context or a new one (an initialised
group of the same size is reused). Launch several local ranks with ``torchrun --standalone`` (a static
rendezvous on ``--master_port 0`` waits forever).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .plan import ParallelPlan

logger = logging.getLogger("lingbot_core")

DEFAULT_TIMEOUT_S = 600.0  # a collective waits at most this long for a missing rank, then raises


@dataclass
class ParallelContext:
    """This process's place in the plan. ``mesh`` has dims ``("cfg", "context")``; rank =
    ``cfg_rank * context_degree + context_rank``; ``cfg_rank`` 0 runs the cond branch, 1 the uncond branch."""

    plan: ParallelPlan
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.plan.context_degree

    @property
    def context_rank(self) -> int:
        return self.rank % self.plan.context_degree

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank (one all_reduce over the world): the way to
        make a cancel a collective decision. Every rank must call it at the same point."""
        value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer (torchrun sets it).") from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(plan: ParallelPlan, *, backend: Optional[str] = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelContext:
    """Join (or reuse) the default process group for ``plan`` and build its mesh; returns this rank's context.

    Reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK (a single process without them is rank 0 of 1, on a local
    port). ``backend`` None: ``nccl`` when CUDA is present (device ``cuda:LOCAL_RANK``), else ``gloo`` (CPU).
    ``timeout_s`` bounds every collective: a rank that never arrives makes the others raise instead of hanging.
    A group that is already initialised (another plan in the same processes) is reused; its size must match.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if not 0 < float(timeout_s) <= 24 * 3600:
        raise ValueError(f"timeout_s={timeout_s} is not allowed: use seconds in (0, 86400].")
    cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
    backend = backend or ("nccl" if cuda else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not supported: use 'nccl' (CUDA) or 'gloo' (CPU).")
    plan.check(world_size=world, device_count=torch.cuda.device_count() if cuda else None)
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} has no GPU: {torch.cuda.device_count()} are visible.")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks but the plan needs {world}.")
    else:
        init_method = None
        if "MASTER_ADDR" not in os.environ and world == 1:
            init_method = f"tcp://127.0.0.1:{_free_port()}"  # a lone process (no torchrun)
        # gloo serves CPU tensors in both cases: diffusers' uneven Ulysses split exchanges its sizes on the CPU
        # when the backend names "cpu" (otherwise it asks for an accelerator).
        spec = "cpu:gloo,cuda:nccl" if backend == "nccl" else "cpu:gloo"
        dist.init_process_group(spec, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=float(timeout_s)),
                                device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (plan.cfg_degree, plan.context_degree), mesh_dim_names=("cfg", "context"))
    logger.info("LingBot-Video parallel: rank %d of %d on %s (%s, %s).", rank, world, device, plan.describe(), backend)
    return ParallelContext(plan, rank, world, local_rank, device, mesh)


def shutdown() -> None:
    """Leave the process group (nothing to do when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class CfgSplit:
    """The two CFG branches on two ranks: this rank runs its branch, one all_gather over its cfg group (the
    ranks with its context rank) brings the other's velocity; every rank then has both, bit for bit."""

    def __init__(self, ctx: ParallelContext):
        self.branch = ctx.cfg_rank
        self.group = ctx.mesh.get_group("cfg")

    def __call__(self, branch, positive: torch.Tensor, negative: torch.Tensor):
        mine = branch(positive if self.branch == 0 else negative, self.branch).contiguous()
        parts = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(parts, mine, group=self.group)
        return parts[0], parts[1]


class ParallelRun:
    """What a split pipeline consults in ``denoise`` (``LingbotPipeline.parallel``)."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx
        self.cfg_runner = CfgSplit(ctx) if ctx.plan.cfg_degree == 2 else None

    def describe(self) -> str:
        return self.ctx.plan.describe()

    def check_denoise(self, *, step_cache: float) -> None:
        if step_cache and self.ctx.plan.fsdp:
            raise ValueError("step_cache does not combine with FSDP: a rank that skips the DiT's blocks would leave "
                             "the others waiting for its share of their weights; use step_cache 0.")


def dit_cp_plan() -> dict:
    """diffusers' context-parallel plan for our DiT: every block's one-branch computation (``BlockCompute``) gets
    its slice of the RoPE table and the first block's input tokens are split (uneven splits allowed), so the
    hidden states stay split through the stack; :class:`GatherTokens` joins the last block's output. Splits along
    the joint [video, text] token axis."""
    from diffusers.models._modeling_parallel import ContextParallelInput

    return {
        "blocks.*.compute": {"freqs": ContextParallelInput(split_dim=0, expected_dims=3)},  # (S, head_dim / 2, 2)
        "blocks.0.compute": {"x": ContextParallelInput(split_dim=1, expected_dims=3)},  # (B, S, D)
    }


def _gather_tokens_hook(group):
    """A diffusers hook joining the token slices of a block's output on every context rank.

    diffusers' own gather for uneven slices passes unequal tensors to ``all_gather``, which gloo refuses; this
    pads each slice to the longest (sizes from diffusers' ``gather_size_by_comm``), gathers, and trims."""
    from diffusers.hooks.hooks import ModelHook
    from diffusers.models._modeling_parallel import gather_size_by_comm

    class GatherTokens(ModelHook):
        def post_forward(self, module, output: torch.Tensor) -> torch.Tensor:
            sizes = gather_size_by_comm(output.shape[1], group)
            longest = max(sizes)
            padded = torch.nn.functional.pad(output, (0, 0, 0, longest - output.shape[1])).contiguous()
            parts = [torch.empty_like(padded) for _ in sizes]
            dist.all_gather(parts, padded, group=group)
            return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    return GatherTokens()


def _context_parallel(dit, ctx: ParallelContext) -> None:
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.hooks.hooks import HookRegistry
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backend = dit.blocks[0].attn.backend
    if not _AttentionBackendRegistry._is_context_parallel_available(backend):
        raise ValueError(f"attention backend {backend.value!r} has no context-parallel path in diffusers; use "
                         "attention 'sdpa' with context parallel.")
    plan = ctx.plan
    # diffusers reads its groups from a mesh with "ring" and "ulysses" dims; ours adds "cfg" in front (same ranks).
    mesh = init_device_mesh(ctx.device.type, (plan.cfg_degree, 1, plan.context_degree),
                            mesh_dim_names=("cfg", "ring", "ulysses"))
    cp = ContextParallelConfig(ulysses_degree=plan.context_degree, ulysses_anything=True, mesh=mesh)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(ctx.rank, ctx.world_size, ctx.device, mesh=mesh)
    apply_context_parallel(dit, cp, dit_cp_plan())
    registry = HookRegistry.check_if_exists_or_initialize(dit.blocks[-1].compute)
    registry.register_hook(_gather_tokens_hook(mesh.get_group("ulysses")), "lingbot_gather_tokens")
    dit.set_attention_parallel(config)


def _fully_shard(units, root, mesh: DeviceMesh) -> None:
    from torch.distributed.fsdp import fully_shard

    # Explicit resharding: a root keeps its gathered weights after forward by default.
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(root, mesh=mesh, reshard_after_forward=True)


def _converted_weights(dit) -> bool:
    from ..model.transformer import Experts, Linear

    return any((isinstance(m, Linear) and m.converts) or (isinstance(m, Experts) and (m.qtypes or m.scale_w1 is not None))
               for m in dit.modules())


def local_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers this rank holds (an FSDP-sharded tensor counts its local shard)."""
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def parallelize(pipe, ctx: ParallelContext) -> None:
    """Split ``pipe`` (a loaded ``LingbotPipeline`` on ``ctx.device``) across the ranks as ``ctx.plan`` says.

    Call it on every rank, once per loaded pipeline, after LoRAs and speed options are set (they cannot change
    afterwards). Raises ValueError (on every rank alike) for a plan this pipeline cannot run: heads not divisible
    by the context degree, an offload mode other than "none" with context parallel / FSDP, compile_blocks with
    context parallel / FSDP, FSDP of fp8 / GGUF DiT weights, an attention backend without a context-parallel path.
    """
    if pipe.parallel is not None:
        raise ValueError(f"this pipeline is already split ({pipe.parallel.describe()}); load it again for another plan.")
    plan, dit = ctx.plan, pipe.transformer
    plan.check(heads=dit.config.num_attention_heads, offload=pipe.offload)
    if plan.shards and pipe.speed.compile_blocks:
        raise ValueError("compile_blocks does not combine with context parallel or FSDP here; load without it.")
    if plan.fsdp and _converted_weights(dit):
        raise ValueError("FSDP shards bf16 / fp32 DiT weights; this DiT is stored as fp8 or GGUF blocks. Load the "
                         "bf16 package (or drop --enable_fsdp_inference).")
    if plan.context_degree > 1:
        _context_parallel(dit, ctx)
    if plan.fsdp or plan.fsdp_text_encoder:
        world = DeviceMesh(ctx.device.type, torch.arange(ctx.world_size), mesh_dim_names=("fsdp",))
        if plan.fsdp:
            _fully_shard(dit.blocks, dit, world)
        if plan.fsdp_text_encoder:
            te = pipe.text_encoder
            _fully_shard(te.model.language_model.layers, te, world)
    pipe.parallel = ParallelRun(ctx)
    logger.info("LingBot-Video parallel: %s DiT split (%s); this rank holds %.1f MiB of its weights.",
                pipe.transformer_subfolder, plan.describe(), local_parameter_bytes(dit) / 2 ** 20)
