"""What pinned homes cost in RAM and save in host copies (offload ``block``, issue 31 finding 10).

    python -m bench.pinned_homes                      # 0.5 GiB fp32 DiT (memory-mapped), tiny text encoder
    python -m bench.pinned_homes --dit medium --json /tmp/pinned.json   # a 45 MiB DiT (the smoke test's)

A dense package whose DiT is about 0.5 GiB in fp32 (``tests/conftest.py``'s ``MEMORY_DIT``; loaded without a
cast, so its weights stay memory-mapped, the path a release package takes) is loaded with offload ``block``.
Each budget runs in a fresh process: ``LINGBOT_PINNED_GB=0`` (every copy through the staging buffers) and a
budget larger than the weights (every home pinned). Recorded from ``/proc/self/status``: VmRSS, RssAnon,
RssFile and VmHWM after loading, after pinning (one empty stage: pinning happens at a stage's start), and
after one generate; the seconds pinning took (the stage's wall time and the offloader's ``pin_stats``); the
rings' host-copy seconds, bytes and copies over the generate; ``pinned_bytes()``; then an offload switch
block -> model -> block on the same weights and its stage: ``after_switch_pin_stats`` shows the units taken
back (``kept_units``) and that nothing was pinned again.

No GPU here: the streamers point at the tests' fake ``cuda:3`` (``tests/support/fake_accelerator.py``: device buffers
are host memory) and host buffers are *pretend*-pinned: plain memory that the ring treats as pinned, since a
CPU-only torch cannot lock pages. So the figures show what moving the homes costs in RAM (a memory-mapped
home becomes anonymous memory) and which copies disappear; they cannot show the lock itself or the DMA speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


def _status() -> dict:
    """VmRSS, RssAnon, RssFile and VmHWM of this process, MiB."""
    from bench.server_rss import kib, status

    out = {key: n // MIB for key, n in status("self").items()}
    out["VmHWM"] = kib("VmHWM") // MIB
    return out


def child(package: str, pinned_gb: str) -> dict:
    """One budget, in this (fresh) process."""
    os.environ["LINGBOT_PINNED_GB"] = pinned_gb
    sys.path.insert(0, str(REPO / "tests"))
    import torch
    from support.fake_accelerator import FAKE, recording_transfers

    from bench.ring_probe import PretendPinned
    from lingbot_core import load_pipeline
    from lingbot_core.memory import host_memory

    host_memory.pinned_buffer = PretendPinned  # the bench's stand-in for page locking (see the docstring)
    torch.set_num_threads(2)
    pipe = load_pipeline(package, offload="block", device="cpu")
    streamers = pipe.offloader.streamers()
    for s in streamers:
        s.execution_device = FAKE
    run = dict(height=64, width=64, num_frames=5, steps=2, seed=1, guidance_scale=3.0, output_type="latent")
    out = {"pinned_gb": pinned_gb, "after_load": _status()}
    with recording_transfers():
        t0 = time.perf_counter()
        with pipe.offloader.stage():  # pins at the stage's start, computes nothing
            pass
        out["pin_s"] = round(time.perf_counter() - t0, 3)
        out["after_pin"] = _status()
        before = [dict(s.ring.stats) for s in streamers]
        t0 = time.perf_counter()
        pipe.generate("a cat", **run)
        out["generate_s"] = round(time.perf_counter() - t0, 2)
    out["after_generate"] = _status()
    out["pin_stats"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in pipe.offloader.pin_stats.items()}
    # what the stage pinned, staged and copied: read before the switch replaces the streamers
    out["pinned_mib"] = pipe.pinned_bytes() // MIB
    out["homes_pinned_mib"] = sum(u.pinned.nbytes for s in streamers for u in s.units() if u.pinned is not None) // MIB
    out["staging_mib"] = sum(h.pinned.nbytes for s in streamers for h in s.ring.host_slots) // MIB
    out["rings"] = [{"model": name,
                     "host_copy_s": round(s.ring.stats["host_copy_s"] - b["host_copy_s"], 4),
                     "bytes_mib": (s.ring.stats["bytes"] - b["bytes"]) // MIB,
                     "copies": s.ring.stats["copies"] - b["copies"]}
                    for name, s, b in zip(("transformer", "text_encoder"), streamers, before)]
    with recording_transfers():  # an offload switch on unchanged weights: the pinned homes are taken back
        pipe.set_offload("model")
        pipe.set_offload("block", device=FAKE)
        t0 = time.perf_counter()
        with pipe.offloader.stage():
            pass
        out["after_switch_stage_s"] = round(time.perf_counter() - t0, 3)
    out["after_switch_pin_stats"] = {k: round(v, 3) if isinstance(v, float) else v
                                     for k, v in pipe.offloader.pin_stats.items()}
    pipe.release()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pinned_homes", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--dit", choices=("memory", "medium"), default="memory",
                   help="the DiT's size: memory (about 0.5 GiB in fp32) or medium (about 45 MiB)")
    p.add_argument("--child", nargs=2, metavar=("PACKAGE", "PINNED_GB"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    sys.path.insert(0, str(REPO / "tests"))
    from support.sizes import MEMORY_DIT, MEMORY_DIT_MEDIUM

    from lingbot_core.testing.fixtures import write_package

    dit = MEMORY_DIT if args.dit == "memory" else MEMORY_DIT_MEDIUM
    with tempfile.TemporaryDirectory(prefix="lingbot-pinned-") as tmp:
        package = write_package(Path(tmp) / "pkg", fp32=True, seed=3, dit=dit, refiner=False)
        results = []
        for budget in ("0", "64"):
            proc = subprocess.run([sys.executable, "-m", "bench.pinned_homes", "--child", str(package), budget],
                                  cwd=REPO, capture_output=True, text=True, timeout=900)
            if proc.returncode:
                raise SystemExit(proc.stderr[-4000:])
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
