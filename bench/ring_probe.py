"""The offload ``block`` ring, probed (issue 24): what one denoising step costs the host and the GPU.

    python -m bench.ring_probe --device cuda                     # 4-layer full-width MoE, 480x832x121
    python -m bench.ring_probe --device cuda --pinned-gb 64      # the same with every home pinned
    python -m bench.ring_probe --device cpu --layers 2 --height 64 --width 96 --frames 5   # fake device

A MoE DiT of ``--layers`` full-width blocks (128 experts of 768, about 1.2 GB a block in bf16; random
weights, ``bench.offload.TiledFill``) runs ``--steps`` CFG steps in lockstep (one DiT forward per
step, two branches) under offload ``block`` with ``blocks_on_gpu`` 0, on random text embeddings (no
text encoder or VAE: the ring is all that is measured).

``--pinned-gb G`` is the offloader's pin budget (``Offloader(pin_budget=G GiB)``): at the stage start the
homes of as many units as fit (the streamed blocks first, then the resident weights) move into page-locked
buffers, and those units are copied to the device straight from there. The default 0 pins no home: every
unit goes through the ring's two pinned staging buffers (a host memcpy, then the DMA). A budget of at least
the DiT's size (with RAM to spare: ``PinBudget`` keeps 4 GiB available) pins every home; no staging buffer
is then allocated, and **host copy s** is 0 by construction (nothing is memcpy'd on the host).

Top level: ``pinned_homes_bytes`` (the units' pinned homes), ``staging_bytes`` (the ring's staging
buffers, allocated at the first unit that needs one), ``pinned_units`` of ``units``, ``pinned_bytes``
(the offloader's page-locked total: pinned homes plus the staging buffers that are locked),
``stage_enter_s`` (entering the stage, where the homes are pinned), and ``memory_mib``: VmRSS and VmHWM
(``/proc/self/status``) before the stage and after it, VmHWM reset at the stage start where Linux allows
(``hwm_reset``), so the host RAM the pinned homes or the staging buffers cost is visible. All are measured.
Per step:

- **host copy s**: seconds the staging thread spent filling staging buffers (home -> staging); 0 for a
  unit copied from its pinned home;
- **bytes**: weight bytes the ring copied to the device;
- **GPU idle between blocks** (CUDA): the time from the end of one streamed block's kernels to the start
  of the next block's, summed over a forward (CUDA events on the compute stream; 0 when every copy
  overlapped the previous block);
- **host syncs**: on CUDA, what ``torch.cuda.set_sync_debug_mode("warn")`` reports (every call that made
  the host wait for the GPU); on CPU, the reads back to the host (``.item()``, ``.tolist()``,
  ``bincount``, ``nonzero``) counted by a dispatch mode. Neither sees the compute thread waiting for the
  staging thread (a Python future), so:
- **compute wait s**: seconds the thread that runs the DiT spent waiting for staging jobs (the ring's
  ``compute_wait_s``): a host-side stall the sync counts miss.

Step 0 also copies the resident weights (and, in a fresh process, pays CUDA's warm-up); from step 1 on
only the streamed blocks move.

On a CPU the device is the tests' fake ``cuda:3`` (``tests/support/fake_accelerator.py``: device buffers are
host memory) with the tests' recorded streams (``tests/support/fake_streams.py``), so the ring, its staging
thread and its events run for real; there is no GPU time to measure, and no page can be locked: host
buffers are pretend-pinned as in the tests (``"pinned": "pretend (CPU fake device)"``), so the pin budget
decides which units skip the staging buffers exactly as on CUDA. The CPU figures show which path each unit
took and what it cost the host (memcpy seconds, the staging buffers' RAM); they say nothing about DMA speed
or overlap, and VmHWM there also counts the fake device's buffers and the recorded streams' copies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
GIB = 1024 * MIB


def moe_dit(layers: int, seed: int = 1, experts: int = 128):
    """A full-width MoE DiT of ``layers`` blocks in memory (bf16 with fp32 islands), random weights; ``experts``
    below the release's 128 shrinks each block (the smoke tests' size)."""
    from bench.offload import TiledFill, moe_dit_config
    from lingbot_core.model.transformer import LingBotVideoTransformer3DModel, is_fp32_island

    gen = torch.Generator().manual_seed(seed)
    fill = TiledFill(gen)
    with torch.device("meta"):
        dit = LingBotVideoTransformer3DModel(**dict(moe_dit_config(layers), num_experts=experts))
    state = {k: fill(k, tuple(v.shape), torch.float32 if is_fp32_island(k) else torch.bfloat16)
             for k, v in dit.state_dict().items()}
    dit.load_state_dict(state, assign=True)
    return dit.eval().requires_grad_(False)


class _CpuHostReads:
    SYNCING = ("_local_scalar_dense", "bincount", "nonzero")

    def __init__(self):
        self.count = 0

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        probe, orig_tolist = self, torch.Tensor.tolist

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket.__name__ in _CpuHostReads.SYNCING:
                    probe.count += 1
                return func(*args, **(kwargs or {}))

        def tolist(t):
            probe.count += 1
            return orig_tolist(t)

        self._stack = ExitStack()
        from unittest import mock

        self._stack.enter_context(mock.patch.object(torch.Tensor, "tolist", tolist))
        self._stack.enter_context(Mode())
        return self

    def __exit__(self, *exc):
        self._stack.close()


class PretendPinned:
    """A host buffer that reports itself page-locked (the tests' ``PinCounter`` buffers): on the CPU fake
    device a real :class:`~lingbot_core.memory.host_memory.PinnedBuffer` reports ``pinned=False`` and the
    offloader then pins no home at all."""

    def __init__(self, nbytes: int):
        self.nbytes, self.tensor, self.pinned = int(nbytes), torch.empty(int(nbytes), dtype=torch.uint8), True

    def free(self) -> None:
        self.tensor, self.pinned = None, False


def _memory_mib() -> dict:
    """VmRSS and VmHWM of this process, MiB (None where /proc is absent)."""
    from bench.server_rss import kib

    try:
        return {key: round(kib(key) / MIB) for key in ("VmRSS", "VmHWM")}
    except OSError:
        return {"VmRSS": None, "VmHWM": None}


def _mark(events):
    def hook(*_):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        events.append(event)
    return hook


def probe(device: str = "cuda", layers: int = 4, height: int = 480, width: int = 832, frames: int = 121,
          steps: int = 2, text_tokens: int = 120, pinned_gb: float = 0.0, experts: int = 128) -> dict:
    from lingbot_core.model.latents import latent_shape
    from lingbot_core.memory import host_memory
    from lingbot_core.memory.budget import reset_peak_rss
    from lingbot_core.memory.offload import Offloader

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)  # this probe's peak, also when a caller runs it twice
    t0 = time.perf_counter()
    dit = moe_dit(layers, experts=experts)
    build_s = time.perf_counter() - t0
    offloader = Offloader({"transformer": dit}, blocks_on_gpu=0, pin_budget=int(pinned_gb * GIB))
    stack = ExitStack()
    gen = torch.Generator().manual_seed(2)
    latents = torch.randn(latent_shape(frames, height, width), generator=gen)
    texts = [torch.randn(1, text_tokens, dit.config.text_dim, generator=gen).to(torch.bfloat16) for _ in range(2)]
    if cuda:
        offloader.apply("block", device)
        run_device = offloader.execution_device("transformer")
    else:
        from unittest import mock

        tests = str(REPO / "tests")
        if tests not in sys.path:
            sys.path.insert(0, tests)
        from support.fake_accelerator import FAKE, recording_transfers
        from support.fake_streams import RecordingStreams

        offloader.apply("block", "cpu")
        streamer = dit._hf_hook
        streamer.execution_device, streamer.streams = FAKE, RecordingStreams()
        stack.enter_context(recording_transfers())
        stack.enter_context(mock.patch.object(host_memory, "pinned_buffer", PretendPinned))
        run_device = torch.device("cpu")
    streamer = dit._hf_hook
    ring = streamer.ring
    starts, ends = [], []
    if cuda:
        for block in dit.blocks:
            block.compute.register_forward_pre_hook(_mark(starts))  # after the block's copy was awaited
            block.register_forward_hook(_mark(ends))
    block_bytes = sum(t.numel() * t.element_size() for t in list(dit.blocks[0].parameters()) + list(dit.blocks[0].buffers()))
    per_step = []
    with stack, torch.no_grad():
        memory = {"before_stage": _memory_mib()}
        hwm_reset = reset_peak_rss()
        with ExitStack() as in_stage:
            t0 = time.perf_counter()
            in_stage.enter_context(offloader.stage())  # the homes are pinned here, within the budget
            stage_enter_s = time.perf_counter() - t0
            offloader.expect_forwards(steps)
            x = latents.to(run_device)
            ts = [torch.tensor([1000.0 * (1 - i / steps)], device=run_device) for i in range(steps)]
            txt = [t.to(run_device) for t in texts]
            for i in range(steps):
                before = dict(ring.stats)
                starts.clear(), ends.clear()
                if cuda:
                    torch.cuda.synchronize()
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        torch.cuda.set_sync_debug_mode("warn")
                        t1 = time.perf_counter()
                        dit(x, ts[i], txt)
                        torch.cuda.set_sync_debug_mode("default")
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - t1
                    syncs = sum("synchroniz" in str(w.message) for w in caught)
                    # first branch's start per block (lockstep: two compute calls per block)
                    first = starts[::2]
                    idle = sum(max(0.0, ends[j].elapsed_time(first[j + 1])) for j in range(len(ends) - 1)) / 1000
                else:
                    with _CpuHostReads() as reads:
                        t1 = time.perf_counter()
                        dit(x, ts[i], txt)
                        wall = time.perf_counter() - t1
                    syncs, idle = reads.count, None
                per_step.append({
                    "step": i, "wall_s": round(wall, 3),
                    "host_copy_s": round(ring.stats["host_copy_s"] - before["host_copy_s"], 4),
                    "bytes": ring.stats["bytes"] - before["bytes"], "blocks_copied": ring.stats["copies"] - before["copies"],
                    "gpu_idle_between_blocks_s": None if idle is None else round(idle, 4), "host_syncs": syncs,
                    "compute_wait_s": round(ring.stats["compute_wait_s"] - before["compute_wait_s"], 4),
                })
        memory["after_stage"] = _memory_mib()
        units = streamer.units()
        homes = sum(u.pinned.nbytes for u in units if u.pinned is not None)
        staging = sum(h.pinned.nbytes for h in ring.host_slots)
        pinned_units = sum(u.pinned is not None for u in units)
        pinned = offloader.pinned_bytes()
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
    offloader.release()
    return {"device": device, "layers": layers, "size": [height, width, frames], "steps": steps, "build_s": round(build_s, 1),
            "block_bytes": block_bytes, "pinned_gb": pinned_gb,
            "pinned": "page-locked (cudaHostRegister)" if cuda else "pretend (CPU fake device)",
            "pinned_homes_bytes": homes, "staging_bytes": staging, "pinned_units": pinned_units, "units": len(units),
            "pinned_bytes": pinned, "stage_enter_s": round(stage_enter_s, 3), "memory_mib": memory, "hwm_reset": hwm_reset,
            "max_memory_allocated": peak, "per_step": per_step}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ring_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--frames", type=int, default=121)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--experts", type=int, default=128, help="experts per block (the release's 128; fewer for a smoke run)")
    p.add_argument("--pinned-gb", type=float, default=0.0,
                   help="pin budget for the units' homes, GiB (0: every unit through the staging buffers)")
    args = p.parse_args(argv)
    if args.pinned_gb < 0:
        p.error("--pinned-gb must be >= 0")
    print(json.dumps(probe(args.device, args.layers, args.height, args.width, args.frames, args.steps,
                           pinned_gb=args.pinned_gb, experts=args.experts), indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
