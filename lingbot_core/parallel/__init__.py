"""One generation split across several processes (one device each): CFG parallel, Ulysses context parallel and
FSDP2 weight sharding. :mod:`.plan` says what a split is and refuses bad ones; :mod:`.runtime` joins the process
group and splits a loaded pipeline. Command line: ``torchrun --nproc_per_node N -m lingbot_core generate ...
--context_parallel_degree C --cfg_parallel_degree G [--enable_fsdp_inference]`` (docs/multi-gpu.md).

Imports lingbot_core.model and lingbot_core.sampling only: it is handed a loaded pipeline (``parallelize``), and
reaches the top level only through the ``lingbot_core`` package's names (``from .. import load_pipeline``)."""

from .plan import ParallelPlan
from .runtime import ParallelContext, init_distributed, local_parameter_bytes, parallelize, shutdown

__all__ = ["ParallelPlan", "ParallelContext", "init_distributed", "local_parameter_bytes", "parallelize", "shutdown"]
