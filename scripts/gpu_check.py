"""One-command GPU check (issues 10, 15): precision, offload rows and the MoE FFN, as JSON + Markdown.

    scripts/gpu-check                              # CUDA, full-size random weights (< 9 min on one H200)
    scripts/gpu-check --device cpu --size tiny     # the same checks on the tiny fixtures (CI smoke run)

Parts, in this order, each written to ``gpu-check.json`` / ``gpu-check.md`` in ``--out`` as soon as it
(or, for the offload rows, each row) is done, so a run that is cut off still returns what it measured:

1. **precision** (tiny fp32 fixture package, TI2V 64x96, 5 frames, 2 steps): frames with the DiT and
   text encoder in bf16, and with an fp8_e4m3fn DiT, against fp32; pass when the mean |diff| is at most
   ``MEAN_BOUND`` and the max at most ``MAX_BOUND`` (frames in [0, 1]).
2. **rows** (:data:`ROWS`, a declarative table: append a :class:`Row` to add a check). Packages, built
   in seconds and cached under ``--workdir`` (``--size full``): ``dense`` = the full-size dense package
   of ``bench.offload`` (DiT 1.36 B, Qwen3-VL-4B, Wan 2.1 VAE) with tiled random weights; ``moe`` = a
   full-width MoE DiT of ``MOE_LAYERS`` blocks (128 experts, 1.2 GB a block in bf16) sharing the dense
   package's text encoder and VAE. Rows with the same package, precision and load options share one
   load (and one untimed one-step warm-up). Before every row the prompt cache is cleared (so the text
   encoder, the largest transfer of ``model`` and ``block``, is timed), the device cache is emptied
   and the peak statistics are reset. Per row: generate seconds, of them the text encoder's
   (``text_encoder_s``: its forwards, timed between device synchronisations, with the weight copies its
   offload makes inside them; not the stage's set-up, where offload ``block`` pins homes on first use) and
   the rest (``rest_s_computed``), ``max_memory_allocated``, the pinned host bytes (the pipeline's
   ``pinned_bytes()``, ``torch.cuda.host_memory_stats()`` and the kernel's VmPin / VmLck, also after each
   load is released), RSS (now and the row's peak), and the frames' SHA-256 for each of ``repeats`` runs.
   Frames must be identical across the repeats and equal to the row named in ``same_as`` (default: the
   first row of its load with the same steps and ``generate`` options); on CUDA a block row with many
   repeats catches a copy that compute does not wait for. Rows with ``allocator="cudaMallocAsync"`` run in
   a child process started with ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` (ComfyUI's default
   allocator), and must give the frames of the native-allocator row they name.
3. **placement** (tiny fp32 package, TI2V as in 1): the text encoder and VAE on another device than the
   DiT (``cpu``; and ``cuda:1`` when a second GPU is present), offload ``none`` and ``model``, against the
   default placement on the same loaded copy: frames bit-identical on a second GPU of the same kind, within
   the precision bounds with the CPU; on CUDA the DiT device's peak memory per placement.
   **distributed** (issue 49): ``lingbot_core.parallel``'s process group at world size 1 (NCCL on CUDA, gloo on
   the CPU): all_reduce, all_gather over the mesh's "cfg" group and an FSDP2-sharded module's forward, each
   equal to the unsplit result (the multi-GPU splits themselves need 2+ GPUs: tests/parallel runs them on CPUs).
4. **speed** (CUDA only; issue 17): ``bench.speed.device_rows`` on the dense package, TI2V 320x192x49
   (``--speed-steps``, default 20): attention sdpa / flash_attn / sage (those installed), compile on /
   off, ``block`` K=0 with and without CFG lockstep, step cache 0.05 and 0.1: time and peak VRAM as
   ratios to the plain run, and the max frame difference against it.
5. **moe**: ``bench.moe_ffn`` (the MoE feed-forward variants). The per-expert loop (``slices``) must keep its
   bits; the ``torch._grouped_mm`` dispatch (the default on CUDA) is judged by a stated bound against an fp64
   product of the same bf16 operands (:data:`GROUPED_REL_RMS_BOUND`, :data:`GROUPED_MAX_ULPS`), and its bit
   identity with the loop is reported, not required (cuBLAS may reduce in another order). On CUDA: host syncs
   per layer call of each dispatch (``torch.cuda.set_sync_debug_mode``).
6. **gguf**: a MoE-shaped GGUF DiT (Q4_K, Q8_0; the files are cached in ``--workdir``) in offload block: bytes per
   step from the ring's own counter, seconds per step from step 2 on (step callbacks), on CUDA peak VRAM and the
   host syncs per step made inside the DiT forward by the thread that runs it (:class:`ForwardSyncs`; the
   solver's, the prompt encode's and the check's own syncs are outside it and listed as a caveat).
7. **decode** (CUDA only; issue 24): the refiner's tiled VAE decode of a 1088x1920 latent (``--decode-frames``
   frames, default 121 as the refiner) with the full-size random Wan VAE: seconds, ``max_memory_allocated``
   and ``max_memory_reserved``. Before ring (:data:`LATER_PARTS`): a row group that overruns the rows' window
   takes its time from the last part.
8. **ring** (CUDA only; issue 24): ``bench.ring_probe`` on the 4-layer full-width MoE at 480x832x121, block
   K=0, two lockstep CFG steps, run twice: pin budget 0 (every unit through the staging buffers) and
   :data:`RING_PINNED_GB` (every home pinned, so no host memcpy by construction). Per run: pinned-home and
   staging bytes, VmRSS / VmHWM before and after the stage; per step: wall, host copy seconds, GPU idle
   between blocks, the compute thread's wait for staging, bytes and host syncs. The two runs' last steps
   (step 0 also copies the resident weights, and the first run pays CUDA's warm-up) are set side by side,
   with their wall ratio (computed): do pinned homes remove the host memcpy from the step?

Every part runs under ``try``: a part that raises (a missing package, an out-of-memory) is recorded as
``<part>_error`` (and makes the result FAIL) and the run goes on with the next part.

Each row also reports ``per_step_s`` and ``fixed_s`` (from the step callbacks: prompt encode, image encode
and decode, which are paid once per run) and ``projected_s`` for the 40-step run the targets are stated
for, so an 8-step row's one-off transfers are not weighed five times over. ``pin_s`` (measured by the
offloader: copying the homes into page-locked memory, once per loaded weights, kept across offload switches)
is its own figure per repeat and is left out of ``fixed_s`` / ``projected_s``;
``generate_less_pin_s_computed`` is what a ratio between rows should use.

TF32 stays off (ComfyUI does not enable it). ``--budget-s`` (default 480) bounds the whole run (see
:class:`Schedule`): the packages are built first; the offload rows then get the time up to the budget minus
the later parts' reservations (:data:`PART_ESTIMATE_S`, sized to the parts' estimated times on one H200),
and at least :data:`ROWS_FLOOR_S`; a row group or part is started only while the time left covers it; what
was skipped is listed. The random packages are built once per run (and cached under ``--workdir``). Exits 1
when a check fails or a part raised.

Every figure printed is measured, except those marked "(computed)" (``projected_s``, a projection of the
measured per-step and one-off seconds to 40 steps; ``rest_s_computed``, a row's seconds besides the text
encoder's; ``generate_less_pin_s_computed``; the ring part's wall ratio of its two runs) and the GGUF bytes
"(computed)" on a CPU, where no ring copies; each part's text in the Markdown says which. ``grouped_native_kernel_probe`` is a probe (one grouped call that made no host sync).

**Packages beyond torch, transformers, accelerate, safetensors and numpy**: ``diffusers`` and ``gguf`` (both
pure Python). A bare device lacks them: put their wheels in a ``.whl/`` folder at the repository root
(``pip download diffusers==0.42.1 gguf==0.19.0 --no-deps -d .whl``) and carry it with the checkout (the device
tool's ``carry``: ``[".whl"]``); ``scripts/gpu-check`` installs every wheel there with
``pip install --no-index --no-deps`` before it starts when ``import diffusers, gguf`` fails (PyYAML and tqdm,
which ``gguf`` needs, come with transformers). Without ``gguf`` only the gguf part fails (``gguf_error``).
PyAV is not needed (no video file is written).

The exact device command (about 8 minutes on one H200, under a hard limit of 520 s)::

    scripts/gpu-check --skip speed --budget-s 420
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                     ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error")):
    os.environ.setdefault(_key, _value)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

MEAN_BOUND = 0.02
MAX_BOUND = 0.25
TINY_RUN = dict(height=64, width=96, num_frames=5, steps=2, seed=7)
CUDA_WORKLOAD = dict(height=192, width=320, frames=49, steps=8)
CPU_WORKLOAD = dict(height=64, width=96, frames=5, steps=2)
MOE_LAYERS = 4
# The ring part's second pin budget, GiB: more than the 4-layer MoE DiT (about 5 GiB), so every home is pinned.
RING_PINNED_GB = 64
MOE_PACKAGE_VERSION = 1
ASYNC_ALLOC = "backend:cudaMallocAsync"
MIB = 1024 * 1024
# Seconds a part takes on one H200 (estimates of gpu-review-3: gguf 60, moe 15-20, ring 25-40, decode 25-45 at
# 121 frames), the upper ends: a part is not started with less time left, and the rows leave them this much.
# ring runs its probe twice: 40 for the first run (CUDA warm-up included) and 15 for the second (a new ~5 GB
# DiT from the tiled pool, its homes copied into page-locked memory at the stage start, two steps). With
# precision 20 s and the package build 60 s, 10 + 60 + 20 + 55 + 45 = 190 s of reservations still leave the
# rows their 150 s floor inside the device call's 420 s budget (420 - 80 - 150 = 190).
PART_ESTIMATE_S = {"placement": 10, "distributed": 5, "speed": 150, "gguf": 60, "moe": 20, "ring": 55, "decode": 45}
# The parts after the rows, in the order they run. Decode comes before ring (gpu-review-4 finding 6): a row group
# started just before the rows' deadline runs on (a moe-bf16 group: 30-60 s), and what it overruns is taken from
# the last part; decode is the one 1080p refine-decode answer, ring has a CPU-fake counterpart.
LATER_PARTS = ("placement", "gguf", "moe", "decode", "ring")
# The offload rows get at least this long after the packages are built, whatever the later parts reserve.
ROWS_FLOOR_S = 150
DECODE_SIZE = (1088, 1920)
DECODE_FRAMES = 121  # the refiner's
# The grouped dispatch against an fp64 product of the same bf16 operands (routed experts, fp64 sums, no
# bf16 rounding of the intermediate): the relative RMS error and the largest error in bf16 ulps of the
# output row's largest magnitude. The per-expert loop measures 3.3e-3 / 1.5 ulps (tiny, 256 tokens) and
# 3.3e-3 / 1.7 ulps (full width, 512 tokens) on a CPU: the bf16 roundings of the intermediate and the output.
# Another reduction order moves these by a fraction; a wrong expert or a missing group is O(1).
GROUPED_REL_RMS_BOUND = 8e-3
GROUPED_MAX_ULPS = 4


class Schedule:
    """The run's time budget (``budget_s`` from the start), read from ``clock`` (a fake one in the tests).

    The offload rows start after the precision part and the package build; their window ends at the budget
    minus the later parts' reservations, but is at least :data:`ROWS_FLOOR_S` (bounded by the budget). A
    part starts only when the time left covers its estimate."""

    def __init__(self, budget_s: float, clock=time.perf_counter):
        self.clock = clock
        self.start = clock()
        self.deadline = self.start + budget_s

    def left(self) -> float:
        return self.deadline - self.clock()

    def rows_deadline(self, later: List[str]) -> float:
        """Called when the rows are about to start (packages built): when the last row group may start."""
        now = self.clock()
        reserved = self.deadline - sum(PART_ESTIMATE_S.get(p, 0) for p in later)
        return min(self.deadline, max(reserved, now + ROWS_FLOOR_S))

    def fits(self, part: str) -> bool:
        left = self.left()
        return left > 0 and left >= PART_ESTIMATE_S.get(part, 0)


@dataclass(frozen=True)
class Row:
    """One offload check: a load (package, DiT precision, ``load`` options) run in ``mode``.

    ``steps`` overrides the workload's; ``repeats`` runs with the same seed that must all give the same
    frames; ``same_as`` names the row whose frames these must equal (default: the first row of the same
    load); ``generate`` adds keyword arguments to ``generate`` (e.g. a LoRA or a speed option)."""

    name: str
    package: str  # "dense" | "moe"
    precision: str  # dit_precision
    mode: str
    blocks_on_gpu: int = 0
    repeats: int = 1
    steps: Optional[int] = None
    allocator: str = "native"  # or "cudaMallocAsync"
    same_as: Optional[str] = None
    load: Dict[str, object] = field(default_factory=dict)
    generate: Dict[str, object] = field(default_factory=dict)
    cuda_steps: Optional[int] = None  # steps on CUDA when they differ from the CPU smoke run's

    def load_key(self) -> tuple:
        return (self.allocator, self.package, self.precision, json.dumps(self.load, sort_keys=True))


# Most important first: --budget-s skips from the end.
ROWS: List[Row] = [
    Row("dense-bf16-none", "dense", "bf16", "none"),
    Row("dense-bf16-block", "dense", "bf16", "block"),
    Row("dense-bf16-model", "dense", "bf16", "model"),
    Row("dense-bf16-sequential", "dense", "bf16", "sequential"),
    Row("dense-bf16-block-K4", "dense", "bf16", "block", blocks_on_gpu=4),
    Row("dense-bf16-block-repeats", "dense", "bf16", "block", repeats=5, steps=2),
    Row("moe-bf16-none", "moe", "bf16", "none"),
    Row("moe-bf16-block", "moe", "bf16", "block", repeats=2),
    Row("moe-fp8-none", "moe", "fp8_e4m3fn", "none"),
    Row("moe-fp8-block", "moe", "fp8_e4m3fn", "block"),
    Row("dense-fp8-none", "dense", "fp8_e4m3fn", "none"),
    Row("dense-fp8-block", "dense", "fp8_e4m3fn", "block"),
    # Issue 16: the four-step LoRA (random, rank 128, LightX2V naming) against 40-step CFG, both in block K=0.
    Row("moe-bf16-block-lora-4step", "moe", "bf16", "block", steps=4, load={"loras": [["@moe_lora", 1.0]]},
        generate={"guidance_scale": 1.0, "shift": 3.0}),
    Row("moe-bf16-block-40step-cfg", "moe", "bf16", "block", cuda_steps=40),
    Row("async-dense-bf16-none", "dense", "bf16", "none", allocator="cudaMallocAsync", same_as="dense-bf16-none"),
    Row("async-dense-bf16-block", "dense", "bf16", "block", repeats=3, allocator="cudaMallocAsync",
        same_as="dense-bf16-none"),
    Row("async-moe-bf16-block", "moe", "bf16", "block", allocator="cudaMallocAsync", same_as="moe-bf16-none"),
]


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _image(h, w):
    from bench.offload import bench_image

    return bench_image(h, w)


def _sha(frames) -> str:
    return hashlib.sha256(np.ascontiguousarray(frames).tobytes()).hexdigest()


# -- memory probes ---------------------------------------------------------------------------------


def _status_kib(field_name: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _host_pins(device) -> dict:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.host_memory_stats()
    return {k: v for k, v in stats.items() if "bytes" in k or k.startswith("num_host")}


def _locked_mib() -> dict:
    """Page-locked memory as the kernel counts it: VmPin (pages pinned by a driver that accounts them) and
    VmLck (mlock); recorded, not judged, as drivers differ in what they account."""
    return {k: round((_status_kib(k) or 0) / 1024) for k in ("VmPin", "VmLck")}


# -- packages --------------------------------------------------------------------------------------



def dmd_student_rows() -> List[Row]:
    """Issue 22: the DMD student's own sampler on the MoE in block K=0, with the student's recipe (8 steps,
    guidance 1.0: one DiT call per step, shift 3.0). The random MoE is not a student, so the sampler is named;
    its ancestral noise comes from the CPU generator, so repeats must give the same frames on the GPU too."""
    return [Row("moe-dmd-8step", "moe", "bf16", "block", steps=8, repeats=2,
                generate={"guidance_scale": 1.0, "shift": 3.0, "sampler": "dmd_student"})]


ROWS += dmd_student_rows()

def ensure_moe_package(workdir: Path, dense: Path, layers: int = MOE_LAYERS) -> Path:
    """A MoE package: a full-width MoE DiT of ``layers`` blocks (tiled random weights, bf16 with fp32
    islands), the text encoder, VAE, processor and scheduler of ``dense`` by symlink. Cached."""
    from bench.offload import TiledFill, moe_dit_config, write_random_dit

    root = workdir / f"lingbot-gpu-check-moe{layers}-v{MOE_PACKAGE_VERSION}"
    if (root / "BUILD_INFO.json").is_file():
        return root
    partial = workdir / (root.name + ".partial")
    if partial.exists():
        import shutil

        shutil.rmtree(partial)
    t0 = time.perf_counter()
    partial.mkdir(parents=True)
    for name in ("model_index.json", "scheduler", "processor", "text_encoder", "vae"):
        (partial / name).symlink_to((dense / name).resolve())
    gen = torch.Generator().manual_seed(1)
    params = write_random_dit(partial / "transformer", gen, TiledFill(gen), **moe_dit_config(layers))
    info = {"layers": layers, "params": params, "build_s": round(time.perf_counter() - t0, 1)}
    (partial / "BUILD_INFO.json").write_text(json.dumps(info, indent=2) + "\n")
    partial.rename(root)
    log(f"built the {layers}-layer MoE package in {info['build_s']} s ({info['params']:,} DiT params)")
    return root


def packages(size: str, workdir: Path) -> Dict[str, Path]:
    if size == "tiny":
        from lingbot_core.testing.fixtures import write_package

        moe = write_package(workdir / "tiny-moe", moe=True, refiner=False, seed=1)
        return {"dense": write_package(workdir / "tiny-dense", refiner=False), "moe": moe,
                "moe_lora": moe_lora(moe, workdir)}
    from bench.offload import ensure_full_package

    dense, _, build_s = ensure_full_package(workdir, tiled=True)
    if build_s:
        log(f"built the dense package in {build_s} s")
    moe = ensure_moe_package(workdir, dense)
    return {"dense": dense, "moe": moe, "moe_lora": moe_lora(moe, workdir)}


def moe_lora(moe: Path, workdir: Path) -> Path:
    """A random rank-128 LoRA in the LightX2V four-step file's naming for ``moe``'s DiT (``bench.lora``)."""
    from bench.lora import ensure_lora, lora_specs

    cfg = json.loads((moe / "transformer" / "config.json").read_text())
    return ensure_lora(workdir / f"{moe.name}-lora-lightx2v-r128.safetensors", lora_specs(cfg, cfg["depth"], moe=True))


def resolve_load(load: dict, pkgs: Dict[str, Path]):
    """A row's load options with ``"@name"`` strings replaced by the path of that built file."""
    def one(v):
        if isinstance(v, str) and v.startswith("@"):
            return str(pkgs[v[1:]])
        return [one(x) for x in v] if isinstance(v, (list, tuple)) else v
    return {k: one(v) for k, v in load.items()}


# -- parts -----------------------------------------------------------------------------------------


def precision_check(device, workdir: Path) -> dict:
    from lingbot_core import load_pipeline
    from lingbot_core.testing.fixtures import write_package

    package = write_package(workdir / "tiny-fp32", fp32=True, refiner=False, seed=3)
    image = _image(TINY_RUN["height"], TINY_RUN["width"])
    frames = {}
    for label, dtypes in (("fp32", {"transformer": "fp32", "text_encoder": "fp32"}),
                          ("bf16", {"transformer": "bf16", "text_encoder": "bf16"}),
                          ("fp8_e4m3fn", {"transformer": "fp8_e4m3fn", "text_encoder": "bf16"})):
        pipe = load_pipeline(package, device=device, dtypes=dtypes)
        try:
            frames[label] = pipe.generate("a red fox in the snow", image=image, **TINY_RUN)
        finally:
            pipe.release()
    out = {"workload": dict(TINY_RUN, ti2v=True), "bounds": {"mean_abs": MEAN_BOUND, "max_abs": MAX_BOUND}}
    for label in ("bf16", "fp8_e4m3fn"):
        diff = np.abs(frames[label].astype(np.float64) - frames["fp32"].astype(np.float64))
        out[label] = {"mean_abs": float(diff.mean()), "max_abs": float(diff.max()),
                      "ok": bool(diff.mean() <= MEAN_BOUND and diff.max() <= MAX_BOUND)}
    return out


def workload(device, steps: Optional[int]) -> dict:
    work = dict(CUDA_WORKLOAD if device.type == "cuda" else CPU_WORKLOAD)
    if steps:
        work["steps"] = steps
    return work


def run_rows(rows: List[Row], device, pkgs: Dict[str, Path], work: dict, deadline: float, emit,
             released=None) -> None:
    """Run ``rows`` in this process, one load per :meth:`Row.load_key`; ``emit(row_result)`` after each
    row, ``released(info)`` after each load's release (what stays pinned then)."""
    from bench.offload import CPU_NEGATIVE, PROMPT
    from lingbot_core import load_pipeline

    cuda = device.type == "cuda"
    image = _image(work["height"], work["width"])
    base = dict(negative_prompt=None if cuda else CPU_NEGATIVE, image=image, height=work["height"],
                width=work["width"], num_frames=work["frames"], guidance_scale=3.0, shift=3.0, seed=42)
    order: List[tuple] = []
    for r in rows:
        if r.load_key() not in order:
            order.append(r.load_key())
    for key in order:
        group = [r for r in rows if r.load_key() == key]
        if time.perf_counter() > deadline:
            for r in group:
                emit({"name": r.name, "skipped": "time budget"})
            continue
        first = group[0]
        emitted = []
        pipe = None
        try:  # a load group that fails (out of memory, a missing package) is recorded; the next one runs
            t0 = time.perf_counter()
            pipe = load_pipeline(pkgs[first.package], offload="none", device=device,
                                 dtypes={"transformer": first.precision, "text_encoder": "bf16"},
                                 **resolve_load(first.load, pkgs))
            load_s = time.perf_counter() - t0
            pipe.generate(PROMPT, **dict(base, steps=1, **first.generate))  # warm-up: context, kernels, allocator
            for r in group:
                if time.perf_counter() > deadline:
                    res = {"name": r.name, "skipped": "time budget"}
                else:
                    res = run_row(pipe, r, device, base, work, load_s, PROMPT)
                emitted.append(r.name)
                emit(res)
        except Exception as e:  # noqa: BLE001
            log(f"load group of {first.name} failed: {type(e).__name__}: {e}")
            for r in group:
                if r.name not in emitted:
                    emit({"name": r.name, "error": f"{type(e).__name__}: {e}"[:2000]})
        finally:
            if pipe is not None:
                pipe.release()
            if cuda:
                torch.cuda.empty_cache()
        if released is not None:
            released({"load": [r.name for r in group], "locked_mib": _locked_mib(), "host_memory_stats": _host_pins(device)})


def run_row(pipe, r: Row, device, base: dict, work: dict, load_s: float, prompt: str) -> dict:
    from lingbot_core.memory.budget import reset_peak_rss

    cuda = device.type == "cuda"
    pipe.set_offload(r.mode, device, blocks_on_gpu=r.blocks_on_gpu)
    steps = (r.cuda_steps if cuda and r.cuda_steps else None) or r.steps or work["steps"]
    shas, times, step_stamps = [], [], []
    te_calls, te_spans, te_times = [], [], []

    def te_start(module, args, kwargs):
        _sync(device)  # the stage before it has finished: only the encoder is timed
        te_calls.append(time.perf_counter())

    def te_end(module, args, output):
        _sync(device)
        te_spans.append(time.perf_counter() - te_calls[-1])

    # torch's hooks run outside the offload hooks (accelerate wraps ``forward``): the copies are inside
    hooks = [pipe.text_encoder.register_forward_pre_hook(te_start, with_kwargs=True),
             pipe.text_encoder.register_forward_hook(te_end)]
    peak_alloc = 0
    rss_peak = 0
    pinned = 0
    pin_times = []
    try:
        for _ in range(r.repeats):
            pipe._prompt_cache.clear()  # the text encoder runs (and moves) in every timed run
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            reset_peak_rss()
            _sync(device)
            stamps = []
            te_before = len(te_spans)
            pin_before = pipe.offloader.pin_stats["pin_s"]
            t0 = time.perf_counter()
            frames = pipe.generate(prompt, callback=lambda i, n, x0: stamps.append(time.perf_counter()),
                                   **dict(base, steps=steps, **r.generate))
            _sync(device)
            times.append(time.perf_counter() - t0)
            pin_times.append(pipe.offloader.pin_stats["pin_s"] - pin_before)
            te_times.append(sum(te_spans[te_before:]))
            step_stamps.append(stamps)
            pinned = max(pinned, pipe.pinned_bytes())
            rss_peak = max(rss_peak, _status_kib("VmHWM") or 0)
            if cuda:
                peak_alloc = max(peak_alloc, torch.cuda.max_memory_allocated(device))
            shas.append(_sha(frames))
            finite = bool(np.isfinite(frames).all())
    finally:
        for hook in hooks:
            hook.remove()
    out = {"name": r.name, "package": r.package, "precision": r.precision, "mode": r.mode,
           "blocks_on_gpu": r.blocks_on_gpu, "allocator": r.allocator, "steps": steps, "repeats": r.repeats,
           "load_s": round(load_s, 1), "generate_s": [round(t, 2) for t in times], "text_encoder_forwards": len(te_calls),
           "text_encoder_s": [round(t, 2) for t in te_times],
           # Pinning the homes (offload block on CUDA, once per loaded weights) is timed by the offloader: its own
           # figure, and out of the step weighting and the computed generate seconds a ratio between rows uses.
           "pin_s": [round(t, 2) for t in pin_times],
           "generate_less_pin_s_computed": [round(t - p, 2) for t, p in zip(times, pin_times)],
           "rest_s_computed": [round(t - e, 2) for t, e in zip(times, te_times)],
           "frames_sha256": shas[0], "repeats_identical": len(set(shas)) == 1, "frames_finite": finite,
           "pinned_bytes": pinned, "host_memory_stats": _host_pins(device), "locked_mib": _locked_mib(),
           "rss_mib": round((_status_kib("VmRSS") or 0) / 1024), "rss_peak_mib": round(rss_peak / 1024)}
    out.update(step_weights(times[-1], step_stamps[-1], steps, pin_times[-1]))
    if cuda:
        out["max_memory_allocated_mib"] = round(peak_alloc / MIB)
    log(f"{r.name}: {', '.join(f'{t:.1f}' for t in times)} s (text encoder {', '.join(f'{t:.1f}' for t in te_times)} s)"
        + (f", {out['max_memory_allocated_mib']} MiB" if cuda else "")
        + f", pinned {pinned / MIB:.0f} MiB (pinning {', '.join(f'{t:.1f}' for t in pin_times)} s), "
        f"identical {out['repeats_identical']}")
    return out


TARGET_STEPS = 40


def step_weights(total_s: float, stamps: List[float], steps: int, pin_s: float = 0.0) -> dict:
    """Split a run into its per-step and its one-off seconds (prompt encode, image encode, decode, the
    first step's extra transfers), from the step callbacks' times, and project the 40-step run. ``pin_s``
    (pinning the homes, paid once per loaded weights, before the first step) is left out of both."""
    if len(stamps) < 2:
        return {}
    per_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    fixed = max(0.0, total_s - pin_s - steps * per_step)
    return {"per_step_s": round(per_step, 3), "fixed_s": round(fixed, 2),
            "projected_s": round(fixed + TARGET_STEPS * per_step, 1)}


def rows_in_child(rows: List[Row], args, deadline: float, emit) -> None:
    """Run ``rows`` in a child process under ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`` (the
    allocator is fixed when CUDA starts); its rows arrive through a JSON file written after each row."""
    remaining = deadline - time.perf_counter()
    if remaining <= 0:
        for r in rows:
            emit({"name": r.name, "skipped": "time budget"})
        return
    with tempfile.TemporaryDirectory(prefix="lingbot-gpu-check-child-") as tmp:
        child_out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--device", str(args.device_resolved), "--size", args.size,
               "--workdir", args.workdir, "--rows", ",".join(r.name for r in rows), "--child-rows", str(child_out),
               "--budget-s", str(int(remaining))] + (["--steps", str(args.steps)] if args.steps else [])
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=ASYNC_ALLOC)
        try:
            proc = subprocess.run(cmd, env=env, timeout=remaining + 60, cwd=str(REPO))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        got = json.loads(child_out.read_text()) if child_out.is_file() else []
        for row in got:
            emit(row)
        done = {row["name"] for row in got}
        for r in rows:
            if r.name not in done:
                emit({"name": r.name, "skipped": f"child process ended ({rc})"})


def check_rows(results: List[dict]) -> None:
    """Fill in each row's ``same_as`` comparison: the named row, else the first row of its load that ran
    the same steps and ``generate`` options."""
    by_name = {r["name"]: r for r in results if "skipped" not in r and "error" not in r}
    spec = {r.name: r for r in ROWS}
    firsts: Dict[tuple, str] = {}
    for res in results:
        if res["name"] in by_name and res["name"] in spec:
            row = spec[res["name"]]
            firsts.setdefault((row.load_key(), res["steps"], json.dumps(row.generate, sort_keys=True)), row.name)
    for res in results:
        if res["name"] not in by_name or res["name"] not in spec:
            continue
        row = spec[res["name"]]
        ref = row.same_as or firsts[(row.load_key(), res["steps"], json.dumps(row.generate, sort_keys=True))]
        if ref == res["name"] or ref not in by_name:
            res["same_as"] = {"row": ref if ref != res["name"] else None, "equal": None}
        else:
            res["same_as"] = {"row": ref, "equal": by_name[ref]["frames_sha256"] == res["frames_sha256"]}


def placement_check(device, workdir: Path) -> dict:
    from lingbot_core import load_pipeline
    from lingbot_core.testing.fixtures import write_package

    package = write_package(workdir / "tiny-placement", fp32=True, refiner=False, seed=4)
    image = _image(TINY_RUN["height"], TINY_RUN["width"])
    others = ["cpu"]
    if device.type == "cuda" and torch.cuda.device_count() > 1:  # a second GPU: the next one
        main = device.index if device.index is not None else torch.cuda.current_device()
        others.append(f"cuda:{(main + 1) % torch.cuda.device_count()}")
    pipe = load_pipeline(package, device=device, dtypes={"transformer": "fp32", "text_encoder": "fp32"})
    runs = []
    try:
        reference = pipe.generate("a red fox in the snow", image=image, **TINY_RUN)
        for other in others:
            for mode in ("none", "model"):
                pipe.set_offload(mode, devices={"text_encoder": other, "vae": other})
                pipe._prompt_cache.clear()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                frames = pipe.generate("a red fox in the snow", image=image, **TINY_RUN)
                diff = np.abs(frames.astype(np.float64) - reference.astype(np.float64))
                same_kind = other != "cpu" or device.type == "cpu"
                entry = {"other": other, "mode": mode, "max_abs": float(diff.max()), "identical": bool(diff.max() == 0),
                         "ok": bool(diff.max() == 0) if same_kind else bool(diff.mean() <= MEAN_BOUND and diff.max() <= MAX_BOUND)}
                if device.type == "cuda":
                    entry["dit_device_peak_mib"] = round(torch.cuda.max_memory_allocated(device) / MIB, 1)
                runs.append(entry)
                log(f"placement text encoder + VAE on {other}, {mode}: max |diff| {diff.max():.3g}")
    finally:
        pipe.release()
    return {"workload": dict(TINY_RUN, ti2v=True), "runs": runs}


GGUF_STEPS = 3  # step 1 sets up the ring and the kernels: steps 2 and 3 are timed
GGUF_FILES_VERSION = 1  # the cached GGUF files' name carries it: bump when write_random_gguf_dit's output changes
# Host syncs a sampling step makes outside the DiT forward (the GGUF row counts only inside it): what a reader
# of "host syncs per step" should not look for there (gpu-review-4 finding 13; harmless at seconds per step).
SYNCS_OUTSIDE_THE_FORWARD = ("UniPC's torch.tensor(rks, device=...) and its small linalg.solve (1-2 per step)",
                             "encode_text's boolean-mask indexing (a nonzero, once per prompt encode)",
                             "with the MoE per-expert loop (sm80/89 above 8,192 tokens) one per MoE layer call: "
                             "inside the forward, counted")


class ForwardSyncs:
    """Host synchronisations the compute thread makes inside ``module``'s forwards, as CUDA's sync-debug mode
    reports them (gpu-review-4 finding 5): the mode is switched to "warn" in a forward pre-hook and back in
    the post-hook, and a warning counts only when it comes from the thread that runs the forward (the
    warnings filter is process-wide: the staging thread's waits would land here too). Callbacks, the
    solver and the check's own ``synchronize`` between steps are outside. ``set_mode`` stands in for
    ``torch.cuda.set_sync_debug_mode`` in the tests (a fake sync source); ``counting`` can be cleared to
    leave out early forwards (the ring's and kernels' set-up)."""

    def __init__(self, module, set_mode=None):
        import threading

        self.module = module
        self.set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self.count = 0
        self.counting = True
        self._thread = None
        self._inside = False
        self._handles = []
        self._catch = None
        self._threading = threading

    def _pre(self, module, args, kwargs):
        self._thread, self._inside = self._threading.get_ident(), True
        self.set_mode("warn")

    def _post(self, module, args, kwargs, output):
        self.set_mode("default")
        self._inside = False
        return output

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            if self._inside and self.counting and self._threading.get_ident() == self._thread:
                self.count += 1
            return
        self._previous(message, category, filename, lineno, file, line)

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._previous = warnings.showwarning
        warnings.showwarning = self._show
        self._handles = [self.module.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.module.register_forward_hook(self._post, with_kwargs=True, always_call=True)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        if self._inside:  # a forward that raised past the post-hook
            self.set_mode("default")
            self._inside = False
        self._catch.__exit__(*exc)
        return False


def gguf_check(device, workdir: Path, size: str) -> dict:
    """Issue 23: a MoE-shaped GGUF DiT (Q4_K and Q8_0, random valid blocks) in offload block: bytes copied
    per step (the ring's counter; on a CPU, where no ring copies, the streamed units' sizes, computed), seconds
    per step from step 2 on, and on CUDA host syncs per step and peak VRAM. ``full``: the 30B-A3B width
    with 8 of its 48 blocks; ``tiny``: a 256-wide, 2-block MoE with 128 experts (the code path only)."""
    from bench.gguf import ensure_side_package, moe_config
    from lingbot_core import load_pipeline
    from lingbot_core.testing.gguf_fixtures import write_random_gguf_dit
    from lingbot_core.memory.block_streaming import BlockStreamer
    from lingbot_core.memory.offload import _hooks
    from lingbot_core.sampling.scheduling import shifted_sigmas
    from lingbot_core.prompts.text_conditioning import PromptEmbeds

    side = ensure_side_package(workdir)
    if size == "full":
        config, latent = moe_config(8), (1, 16, 5, 60, 104)
    else:
        config = {**moe_config(2), "hidden_size": 256, "num_attention_heads": 2, "moe_intermediate_size": 256}
        latent = (1, 16, 2, 16, 16)
    rows = []
    for qtype in ("Q4_K", "Q8_0"):
        path = workdir / f"gguf-check-{size}-{qtype}-v{GGUF_FILES_VERSION}.gguf"
        if not path.is_file():  # cached in --workdir: 2.8 + 5.2 GB at full size, written once
            partial = path.with_name(path.name + ".partial")
            write_random_gguf_dit(partial, config, qtype, layout="rebel", seed=0)
            partial.rename(path)
        # no transformer/config.json in the side folder: the config comes from the file's shapes
        pipe = load_pipeline(side, transformer_file=path, offload="block", device=device,
                             dtypes={"transformer": "bf16", "text_encoder": "bf16", "vae": "fp32"})
        try:
            streamer = next(h for h in _hooks(pipe.transformer) if isinstance(h, BlockStreamer))
            per_forward = sum(u.nbytes for u in streamer.streamed)  # computed: the streamed units' sizes
            gen = torch.Generator().manual_seed(0)
            embeds = PromptEmbeds(torch.randn(1, 64, 2560, generator=gen), None)
            latents = torch.randn(*latent, generator=gen)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            marks = []  # per step: (time, ring bytes so far, syncs inside the DiT forwards so far)
            syncs = ForwardSyncs(pipe.transformer, None if device.type == "cuda" else (lambda mode: None))
            syncs.counting = False  # from step 2 on (step 1 sets up the ring and the kernels)

            def stamp(i, n, x0):
                _sync(device)
                ring = streamer.ring
                marks.append((time.perf_counter(), ring.stats["bytes"] if ring is not None else 0, syncs.count))
                syncs.counting = True

            with syncs:
                out = pipe.denoise(embeds, latents, sigmas=list(shifted_sigmas(GGUF_STEPS, 3.0)), guidance_scale=1.0,
                                   callback=stamp)
            _sync(device)
            (t_a, b_a, s_a), (t_b, b_b, s_b) = marks[0], marks[-1]
            n = len(marks) - 1
            row = {"type": qtype, "blocks": config["depth"], "file_bytes": path.stat().st_size,
                   "steps": GGUF_STEPS, "step_s": round((t_b - t_a) / n, 3),  # measured, steps 2.. only
                   "streamed_bytes_per_forward_computed": per_forward, "finite": bool(torch.isfinite(out).all())}
            if streamer.ring is not None and streamer.ring.stats["copies"]:  # the ring's own counter (CUDA)
                row["ring_bytes_per_step"] = (b_b - b_a) // n
            if device.type == "cuda":  # measured, inside the DiT forwards only (ForwardSyncs)
                row["host_syncs_per_step_in_forward"] = round((s_b - s_a) / n, 1)
                row["peak_vram_mib"] = round(torch.cuda.max_memory_allocated(device) / MIB, 1)
            rows.append(row)
            measured = row.get("ring_bytes_per_step")
            log(f"GGUF {qtype} {config['depth']} blocks: "
                + (f"{measured / MIB:.0f} MiB copied per step" if measured is not None else f"{per_forward / MIB:.0f} MiB per forward (computed)")
                + f", {row['step_s']:.2f} s/step")
        finally:
            pipe.release()
    return {"latent": list(latent), "rows": rows, "syncs_outside_the_forward": list(SYNCS_OUTSIDE_THE_FORWARD)}


def distributed_check(device) -> dict:
    """Issue 49: the multi-GPU path at world size 1 (the lent machine has one GPU): lingbot_core.parallel's process
    group (NCCL on CUDA, gloo on the CPU) with its bounded timeout, the collectives it uses (all_reduce for a
    collective cancel, all_gather for CFG parallel, over the mesh's "cfg" group) and an FSDP2-sharded module's
    forward against the same module unsharded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from lingbot_core.parallel import ParallelPlan, init_distributed, shutdown

    t0 = time.perf_counter()
    ctx = init_distributed(ParallelPlan(), backend="nccl" if device.type == "cuda" else "gloo", timeout_s=120)
    try:
        x = torch.arange(6.0, device=ctx.device)
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x, group=ctx.mesh.get_group("cfg"))
        gen = torch.Generator().manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(ctx.device)
        inp = torch.randn(4, 64, generator=gen).to(ctx.device)
        with torch.no_grad():
            ref = model(inp)
            mesh = DeviceMesh(ctx.device.type, torch.arange(1), mesh_dim_names=("fsdp",))
            for unit in (model[0], model[2], model):
                fully_shard(unit, mesh=mesh, reshard_after_forward=True)
            out = model(inp)
        result = {"backend": str(dist.get_backend()), "device": str(ctx.device), "world_size": ctx.world_size,
                  "any_rank": ctx.any_rank(True), "all_gather_equal": bool(torch.equal(parts[0], x)),
                  "fsdp_equal": bool(torch.equal(out, ref))}
    finally:
        shutdown()
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["ok"] = result["any_rank"] and result["all_gather_equal"] and result["fsdp_equal"]
    return result


def moe_check(device, size: str) -> dict:
    """``bench.moe_ffn``'s variants, each against an fp64 product of the same bf16 operands (judged by
    :func:`grouped_within_bound`); on CUDA the host syncs of one layer call per dispatch."""
    from bench.moe_ffn import run
    from lingbot_core.model.precision import grouped_mm_supported, probe_grouped_mm

    probe = probe_grouped_mm(device)  # as placement does; bench.moe_ffn's layers are not placed by an Offloader
    tokens = 256 if size == "tiny" else 3400
    out = run(str(device), tokens=tokens, repeats=1, tiny=True) if size == "tiny" else run(str(device), tokens=tokens, repeats=3)
    out["grouped_is_default"] = grouped_mm_supported(device)
    # On CUDA a probe (one grouped call, no host sync = native); elsewhere False. The fallback-kernel rule
    # (loop above FALLBACK_GROUPED_MAX_TOKENS off the native kernel) cannot be seen on an H200: unmeasured.
    out["grouped_native_kernel_probe"] = probe
    out["unmeasured"] = "grouped fallback vs loop at 48k tokens (needs an sm80/89 device)"
    out["bound"] = {"rel_rms": GROUPED_REL_RMS_BOUND, "max_ulps": GROUPED_MAX_ULPS,
                    "against": "fp64 product of the same bf16 operands (routed experts)"}
    out["within_bound"] = {k: grouped_within_bound(v) for k, v in out.get("vs_fp64", {}).items()}
    if device.type == "cuda":
        out["host_syncs_per_call"] = moe_syncs(device, size, tokens)
    return out


def grouped_within_bound(err: dict) -> bool:
    return err["rel_rms"] <= GROUPED_REL_RMS_BOUND and err["max_ulps"] <= GROUPED_MAX_ULPS


def count_syncs(device, fn) -> int:
    """Host synchronisations ``fn()`` makes on CUDA, as ``torch.cuda.set_sync_debug_mode("warn")`` reports
    them (a measure, narrower than every wait: a Python thread blocked on another is not seen)."""
    import warnings

    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    return sum("synchroniz" in str(w.message) for w in caught)


def moe_syncs(device, size: str, tokens: int) -> dict:
    from unittest import mock

    from bench.moe_ffn import MOE_CFG, TINY_CFG, TINY_DIM, DIM, build

    tiny = size == "tiny"
    ffn = build(device, 0, TINY_CFG if tiny else MOE_CFG, TINY_DIM if tiny else DIM)
    f = torch.randn(1, tokens, TINY_DIM if tiny else DIM, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(device)
    out = {}
    with torch.no_grad():
        for name, grouped in (("slices", False), ("grouped", True)):
            with mock.patch("lingbot_core.model.transformer._use_grouped_mm", return_value=grouped):
                ffn(f, torch.bfloat16)  # warm-up
                out[name] = count_syncs(device, lambda: ffn(f, torch.bfloat16))
    return out


RING_COMPARED = ("wall_s", "host_copy_s", "gpu_idle_between_blocks_s", "compute_wait_s")


def ring_check(device, layers: int = MOE_LAYERS, height: int = 480, width: int = 832, frames: int = 121,
               experts: int = 128) -> dict:
    """``bench.ring_probe`` with pin budget 0 (``staging``) and :data:`RING_PINNED_GB` (``pinned_homes``), each
    on its own DiT. ``last_step``: the two runs' last steps side by side, staging then pinned homes (measured;
    step 0 also copies the resident weights, and the first run pays CUDA's warm-up), and
    ``last_step_wall_ratio_computed``, pinned homes over staging."""
    from bench.ring_probe import probe

    runs = {}
    for label, gb in (("staging", 0), ("pinned_homes", RING_PINNED_GB)):
        run = probe(str(device), layers=layers, height=height, width=width, frames=frames, steps=2, pinned_gb=gb,
                    experts=experts)
        runs[label] = run
        last = run["per_step"][-1]
        log(f"ring {label} (pin budget {gb} GiB): pinned homes {run['pinned_homes_bytes'] / MIB:.0f} MiB, staging "
            f"{run['staging_bytes'] / MIB:.0f} MiB; last step {last['wall_s']} s, host copy {last['host_copy_s']} s, "
            f"compute wait {last['compute_wait_s']} s (measured)")
    a, b = runs["staging"]["per_step"][-1], runs["pinned_homes"]["per_step"][-1]
    runs["last_step"] = {k: [a[k], b[k]] for k in RING_COMPARED}
    runs["last_step_wall_ratio_computed"] = round(b["wall_s"] / a["wall_s"], 3) if a["wall_s"] else None
    return runs


def decode_check(device, pkgs: Dict[str, Path], frames: int) -> dict:
    """The refiner's tiled decode of a 1088x1920 latent with the full-size random Wan VAE."""
    from diffusers import AutoencoderKLWan

    from lingbot_core.model.latents import latent_shape, vae_decode, vae_tiling

    vae = AutoencoderKLWan.from_pretrained(pkgs["dense"] / "vae", torch_dtype=torch.float32).to(device).eval()
    z = torch.randn(latent_shape(frames, *DECODE_SIZE), generator=torch.Generator().manual_seed(0))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    with torch.no_grad(), vae_tiling(vae, True):
        video = vae_decode(vae, z, device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    del vae
    torch.cuda.empty_cache()
    return {"size": list(DECODE_SIZE), "frames": frames, "seconds": round(seconds, 1),
            "max_memory_allocated_mib": round(peak / MIB),
            "max_memory_reserved_mib": round(reserved / MIB), "vae_weights_mib": round(base / MIB),
            "above_weights_mib": round((peak - base) / MIB), "finite": bool(torch.isfinite(video).all()),
            "shape": list(video.shape)}


# -- report ----------------------------------------------------------------------------------------


def verdict(report: dict) -> bool:
    checks = []
    if "precision" in report:
        checks += [report["precision"][k]["ok"] for k in ("bf16", "fp8_e4m3fn")]
    checks += [False for k in report if k.endswith("_error")]  # a part that raised answered nothing
    for res in report.get("rows", []):
        if "error" in res:
            checks.append(False)
        if "skipped" in res or "error" in res:
            continue
        checks += [res["repeats_identical"], res["frames_finite"]]
        if res.get("same_as", {}).get("equal") is not None:
            checks.append(res["same_as"]["equal"])
    if "placement" in report:
        checks += [r["ok"] for r in report["placement"]["runs"]]
    if "distributed" in report:
        checks.append(report["distributed"]["ok"])
    if "moe" in report:
        moe = report["moe"]
        checks.append(moe["bit_identical_to_before"].get("slices", False))  # the loop keeps its bits
        # grouped: within the stated bound of the fp64 product (its bit identity is reported, not required)
        checks += list(moe.get("within_bound", {}).values()) or [False]
    return bool(checks) and all(checks)


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"## gpu-check ({report['size']} components, {m['device_name']})", "",
             f"- date: {report['date']}; torch {m['torch']}, CUDA {m['cuda']}, Python {m['python']}; TF32 matmul "
             f"{m['tf32_matmul']}; {report.get('seconds', '?')} s", ""]
    p = report.get("precision")
    if p:
        lines += [f"Precision (tiny fp32 package, TI2V {p['workload']['height']}x{p['workload']['width']}, "
                  f"{p['workload']['num_frames']} frames, {p['workload']['steps']} steps), frames vs fp32; bound: mean |diff| "
                  f"<= {MEAN_BOUND}, max <= {MAX_BOUND}; measured:", "",
                  "| DiT / text encoder | mean abs diff | max abs diff | within bound |", "|---|---:|---:|:---:|"]
        for label in ("bf16", "fp8_e4m3fn"):
            x = p[label]
            lines.append(f"| {label} / bf16 | {x['mean_abs']:.5f} | {x['max_abs']:.5f} | {'yes' if x['ok'] else 'NO'} |")
        lines.append("")
    rows = report.get("rows")
    if rows:
        w = report["workload"]
        lines += [f"Rows (TI2V {w['width']}x{w['height']} (W x H), {w['frames']} frames, {w['steps']} steps unless "
                  "stated; text encoder bf16, VAE fp32; prompt cache cleared before every run); every figure measured "
                  "(pin s: the offloader's seconds pinning the homes, inside generate s and out of the per-step "
                  "weighting below):", "",
                  "| row | package | DiT | mode | alloc | steps | generate s | text encoder s | pin s | max alloc MiB "
                  "| pinned MiB | host-cache pinned MiB | RSS peak MiB | repeats identical | same as | equal |",
                  "|---|---|---|---|---|---:|---|---|---|---:|---:|---:|---:|:---:|---|:---:|"]
        for r in rows:
            if "skipped" in r or "error" in r:
                why = f"skipped: {r['skipped']}" if "skipped" in r else f"ERROR: {r['error'][:200]}"
                lines.append(f"| {r['name']} | {why} |" + " |" * 14)
                continue
            mode = r["mode"] + (f" K={r['blocks_on_gpu']}" if r["mode"] == "block" else "")
            host = r["host_memory_stats"].get("allocated_bytes.current")
            same = r.get("same_as") or {}
            eq = {True: "yes", False: "NO", None: "—"}[same.get("equal")]
            lines.append(
                f"| {r['name']} | {r['package']} | {r['precision']} | {mode} | {r['allocator']} | {r['steps']} | "
                f"{', '.join(str(t) for t in r['generate_s'])} | {', '.join(str(t) for t in r.get('text_encoder_s', []))} | "
                f"{', '.join(str(t) for t in r.get('pin_s', []))} | {r.get('max_memory_allocated_mib', '—')} | "
                f"{r['pinned_bytes'] / MIB:.0f} | {'—' if host is None else round(host / MIB)} | {r['rss_peak_mib']} | "
                f"{'yes' if r['repeats_identical'] else 'NO'} | {same.get('row') or '—'} | {eq} |")
        lines.append("")
    rel = report.get("after_release")
    if rel:
        lines += ["Locked host memory after each load was released (VmPin / VmLck MiB, measured): "
                  + "; ".join(f"{x['load'][0]}...: {x['locked_mib']['VmPin']} / {x['locked_mib']['VmLck']}" for x in rel), ""]
    pl = report.get("placement")
    if pl:
        lines += ["Placement (text encoder and VAE on another device, tiny fp32 TI2V), frames vs the default placement; "
                  "measured:", "",
                  "| text encoder + VAE on | mode | max abs diff | DiT device peak MiB | ok |", "|---|---|---:|---:|:---:|"]
        for r in pl["runs"]:
            lines.append(f"| {r['other']} | {r['mode']} | {r['max_abs']:.3g} | {r.get('dit_device_peak_mib', '—')} | "
                         f"{'yes' if r['ok'] else 'NO'} |")
        lines.append("")
    dd = report.get("distributed")
    if dd:
        lines += [f"Distributed at world size 1 ({dd['backend']} on {dd['device']}, {dd['seconds']} s), measured: all_reduce "
                  f"{'ok' if dd['any_rank'] else 'WRONG'}, all_gather {'equal' if dd['all_gather_equal'] else 'NOT equal'}, "
                  f"FSDP2 forward {'equal' if dd['fsdp_equal'] else 'NOT equal'} to the unsharded module.", ""]
    gg = report.get("gguf")
    if gg:
        lines += ["GGUF MoE DiT in offload block (latent " + "x".join(map(str, gg["latent"])) + "; s/step from step 2); "
                  "measured unless marked (computed); host syncs: made inside the DiT forward by its thread:", "",
                  "| type | blocks | file | copied per step | s/step | host syncs per step in the forward | peak VRAM |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['type']} | {r['blocks']} | {r['file_bytes'] / MIB:.0f} MiB | "
                  + (f"{r['ring_bytes_per_step'] / MIB:.0f} MiB" if "ring_bytes_per_step" in r
                     else f"{r['streamed_bytes_per_forward_computed'] / MIB:.0f} MiB (computed)")
                  + f" | {r['step_s']} | {r.get('host_syncs_per_step_in_forward', '-')} | {r.get('peak_vram_mib', '-')} MiB |"
                  for r in gg["rows"]]
        lines += ["", "Caveat (not measured here): the host syncs a step makes outside the DiT forward, not counted above: "
                  + "; ".join(gg.get("syncs_outside_the_forward", [])) + ".", ""]
    moe = report.get("moe")
    if moe:
        lines += [f"MoE FFN ({moe['tokens']} tokens, {moe['size']}-size block; measured), median s: "
                  + ", ".join(f"{k} {v}" for k, v in moe["median_s"].items())
                  + "; bit-identical to before: " + ", ".join(f"{k} {v}" for k, v in moe["bit_identical_to_before"].items())
                  + f"; against the fp64 product (bound rel-RMS <= {GROUPED_REL_RMS_BOUND}, max <= {GROUPED_MAX_ULPS} bf16 ulps): "
                  + ", ".join(f"{k} {v['rel_rms']:.2e} / {v['max_ulps']:.2f} ulps ({'ok' if moe['within_bound'][k] else 'OUT'})"
                              for k, v in moe.get("vs_fp64", {}).items())
                  + (f"; host syncs per layer call: {moe['host_syncs_per_call']}" if "host_syncs_per_call" in moe else "")
                  + f"; grouped runs here: {moe['grouped_is_default']}; torch's native grouped kernel (probe): "
                  f"{moe['grouped_native_kernel_probe']}; unmeasured: {moe['unmeasured']}", ""]
    ring = report.get("ring")
    if ring:
        lines += ring_markdown(ring)
    dec = report.get("decode")
    if dec:
        lines += [f"Refine decode {dec['size'][0]}x{dec['size'][1]}, {dec['frames']} frames (tiled, fp32 Wan VAE; measured): "
                  f"{dec['seconds']} s, peak {dec['max_memory_allocated_mib']} MiB allocated ({dec['above_weights_mib']} MiB above the "
                  f"weights), {dec['max_memory_reserved_mib']} MiB reserved", ""]
    timed = [r for r in report.get("rows", []) if "projected_s" in r]
    if timed:
        lines += ["Per-step weighting (measured s/step and one-off seconds, pinning left out; projected_s to 40 steps is "
                  "computed): "
                  + "; ".join(f"{r['name']} {r['per_step_s']} s/step + {r['fixed_s']} s -> {r['projected_s']} s (computed)" for r in timed), ""]
    errors = [f"{k[:-6]}: {v}" for k, v in report.items() if k.endswith("_error")]
    if errors:
        lines += ["Errors (the part raised; the run went on): " + "; ".join(errors), ""]
    skipped = [f"{k[:-8]}: {v}" for k, v in report.items() if k.endswith("_skipped")]
    if skipped:
        lines += ["Skipped (nothing measured): " + "; ".join(skipped), ""]
    lines.append(f"Result: {'PASS' if report.get('ok') else 'FAIL'}" + (" (partial)" if report.get("partial") else ""))
    return "\n".join(lines) + "\n"


def ring_markdown(ring: dict) -> List[str]:
    runs = [(label, ring[label]) for label in ("staging", "pinned_homes") if label in ring]
    first = runs[0][1]
    lines = [f"Ring probe ({first['layers']}-layer full-width MoE, {'x'.join(map(str, first['size']))}, block K=0, lockstep "
             f"CFG; block {first['block_bytes'] / MIB:.0f} MiB), per pin budget; measured (pinning: {first['pinned']}):", "",
             "| run | pin budget GiB | pinned homes MiB | staging buffers MiB | units pinned | stage start s "
             "| VmRSS before -> after stage MiB | VmHWM in the stage MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in runs:
        mem = r["memory_mib"]
        lines.append(f"| {label} | {r['pinned_gb']} | {r['pinned_homes_bytes'] / MIB:.0f} | {r['staging_bytes'] / MIB:.0f} | "
                     f"{r['pinned_units']}/{r['units']} | {r['stage_enter_s']} | {mem['before_stage']['VmRSS']} -> "
                     f"{mem['after_stage']['VmRSS']} | {mem['after_stage']['VmHWM']}{'' if r['hwm_reset'] else ' (process peak)'} |")
    lines += ["", "Per step, measured:", "",
              "| run | step | wall s | host copy s | GPU idle between blocks s | compute thread waited s | bytes "
              "| host syncs (sync-debug mode) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, r in runs:
        for x in r["per_step"]:
            lines.append(f"| {label} | {x['step']} | {x['wall_s']} | {x['host_copy_s']} | {x['gpu_idle_between_blocks_s']} | "
                         f"{x['compute_wait_s']} | {x['bytes']:,} | {x['host_syncs']} |")
    cmp = ring.get("last_step")
    if cmp:
        lines += ["", "Last step, staging -> pinned homes (measured): " + "; ".join(f"{k} {a} -> {b}" for k, (a, b) in cmp.items())
                  + f"; wall pinned homes / staging {ring['last_step_wall_ratio_computed']} (computed)"]
    return lines + [""]


def write(report: dict, out: Path, t_start: float, partial: bool = True) -> None:
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    report["partial"] = partial
    if "rows" in report:
        check_rows(report["rows"])
    report["ok"] = verdict(report)
    tmp = out / "gpu-check.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out / "gpu-check.json")
    (out / "gpu-check.md").write_text(markdown(report))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--size", choices=["full", "tiny"], default="full")
    p.add_argument("--out", default=str(REPO / "out" / "gpu-check"))
    p.add_argument("--workdir", default=os.environ.get("LINGBOT_BENCH_CACHE", str(Path.home() / ".cache" / "lingbot-bench")))
    p.add_argument("--steps", type=int, default=None, help="override the workload's steps (default 8 on CUDA, 2 on CPU)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: precision, rows, placement, distributed, "
                                              "speed, gguf, moe, ring, decode")
    p.add_argument("--decode-frames", type=int, default=DECODE_FRAMES, help="frames of the decode part's 1088x1920 video (CUDA; default: the refiner's 121)")
    p.add_argument("--speed-steps", type=int, default=20, help="steps of the speed part's workload (CUDA)")
    p.add_argument("--rows", default="", help="comma-separated row names to run (default: all)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="seconds for the whole run (package build included): no row or part starts that would not fit")
    p.add_argument("--child-rows", default=None, help=argparse.SUPPRESS)  # internal: the allocator child's output
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    schedule = Schedule(args.budget_s)
    deadline = schedule.deadline
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is available; use --device cpu.")
    args.device_resolved = device
    wanted = {s.strip() for s in args.rows.split(",") if s.strip()}
    unknown = wanted - {r.name for r in ROWS}
    if unknown:
        raise SystemExit(f"error: unknown row(s) {', '.join(sorted(unknown))}; rows: {', '.join(r.name for r in ROWS)}")
    rows = [r for r in ROWS if not wanted or r.name in wanted]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    workdir_full = Path(args.workdir).expanduser()
    work = workload(device, args.steps)

    if args.child_rows:  # the cudaMallocAsync child: rows only, written after each
        results: List[dict] = []
        out_path = Path(args.child_rows)

        def emit_child(res):
            results.append(res)
            out_path.write_text(json.dumps(results, indent=2) + "\n")

        with tempfile.TemporaryDirectory(prefix="lingbot-gpu-check-") as tmp:
            pkgs = packages(args.size, workdir_full if args.size == "full" else Path(tmp))
            run_rows(rows, device, pkgs, work, deadline, emit_child)
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    try:
        import diffusers

        diffusers_version = diffusers.__version__
    except ImportError:  # recorded; the parts that need it record their own error
        diffusers_version = None
    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "size": args.size,
        "machine": {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers_version,
                    "transformers": transformers.__version__, "python": platform.python_version(),
                    "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                    "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")},
        "workload": work, "budget_s": args.budget_s,
    }
    write(report, out, t_start)

    def attempt(name: str, fn) -> bool:
        """Run part ``name``; a failure is recorded as ``<name>_error`` and the run goes on."""
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 -- one part's failure must not cost the others' answers
            report[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
            report.setdefault("errors_traceback", {})[name] = traceback.format_exc()[-4000:]
            log(f"{name} failed: {type(e).__name__}: {e}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return False
        finally:
            write(report, out, t_start)

    with tempfile.TemporaryDirectory(prefix="lingbot-gpu-check-") as tmp:
        built: Dict[str, Path] = {}

        def cached_packages() -> Dict[str, Path]:
            """The random packages, built (or found under --workdir) once for every part of the run."""
            if not built:
                built.update(packages(args.size, workdir_full if args.size == "full" else Path(tmp)))
            return built

        if "precision" not in skip:
            log("precision check (tiny) ...")
            attempt("precision", lambda: report.__setitem__("precision", precision_check(device, Path(tmp))))
        if "rows" not in skip and rows:
            def rows_part():
                pkgs = cached_packages()  # built first: the rows' window starts after the build
                report["packages"] = {k: str(v) for k, v in pkgs.items()}
                report["rows"] = []

                def emit(res):
                    report["rows"].append(res)
                    write(report, out, t_start)

                here = [r for r in rows if r.allocator == "native"]
                child = [r for r in rows if r.allocator == "cudaMallocAsync"]
                report["after_release"] = []

                def released(info):
                    report["after_release"].append(info)
                    write(report, out, t_start)

                later = [p for p in LATER_PARTS
                         if p not in skip and (p in ("placement", "gguf", "moe") or device.type == "cuda")]
                rows_deadline = schedule.rows_deadline(later)
                report["rows_window_s"] = round(rows_deadline - schedule.clock(), 1)
                run_rows(here, device, pkgs, work, rows_deadline, emit, released)
                if child and device.type == "cuda":
                    log(f"rows under PYTORCH_CUDA_ALLOC_CONF={ASYNC_ALLOC} (child process) ...")
                    rows_in_child(child, args, rows_deadline, emit)
                for r in child if device.type != "cuda" else []:
                    emit({"name": r.name, "skipped": "CUDA only"})

            attempt("rows", rows_part)

        def part(name: str, cuda_only: Optional[str] = None) -> bool:
            """Whether to run part ``name`` now; records why not."""
            if name in skip:
                return False
            if cuda_only and device.type != "cuda":
                report[f"{name}_skipped"] = f"CUDA only ({cuda_only})"
                return False
            if not schedule.fits(name):
                left = schedule.left()
                report[f"{name}_skipped"] = f"time budget ({max(0, round(left))} s left, needs about {PART_ESTIMATE_S.get(name, 0)} s)"
                write(report, out, t_start)
                return False
            log(f"{name} ...")
            return True

        if part("placement"):
            attempt("placement", lambda: report.__setitem__("placement", placement_check(device, Path(tmp))))

        if part("distributed"):
            attempt("distributed", lambda: report.__setitem__("distributed", distributed_check(device)))

        def gguf_part():  # the GGUF files (and their side package) are cached in --workdir at full size
            report["gguf"] = gguf_check(device, workdir_full if args.size == "full" else Path(tmp), args.size)

        if part("gguf"):
            attempt("gguf", gguf_part)
        if part("moe"):
            attempt("moe", lambda: report.__setitem__("moe", moe_check(device, args.size)))
        if part("decode", "a 1088x1920 decode on a CPU takes minutes"):
            attempt("decode", lambda: report.__setitem__("decode", decode_check(device, cached_packages(), args.decode_frames)))
        if part("ring", "bench.ring_probe --device cpu runs it on the fake device"):
            attempt("ring", lambda: report.__setitem__("ring", ring_check(device)))
        if part("speed", "flash/sage kernels and compile gains are GPU questions"):
            def speed_part():
                from bench.speed import device_rows

                report["speed"] = device_rows(str(cached_packages()["dense"]), str(device), args.speed_steps, 192, 320, 49)

            attempt("speed", speed_part)
    write(report, out, t_start, partial=False)
    print(markdown(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
