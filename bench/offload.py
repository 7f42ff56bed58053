"""Offload benchmark: one fixed TI2V workload in each offload mode (none, model, sequential).

    python -m bench.offload                      # full-size random weights, CUDA if available
    python -m bench.offload --device cpu         # the small CPU workload
    python -m bench.offload --size tiny --device cpu --json /tmp/bench.json   # smoke run (< 1 min)

``--size full`` builds (once, cached under ``--workdir``, default ``~/.cache/lingbot-bench``) a model
package in the released on-disk layout with FULL-SIZE randomly initialised components: the dense DiT
(1,357,171,264 params, bf16 with fp32 islands), the Qwen3-VL-4B text encoder (4,437,815,808 params,
bf16, sharded + index) and the Wan 2.1 VAE (126,892,531 params, fp32), plus the bytes tokenizer and the
tiny processor of ``lingbot_core.testing.fixtures``. Nothing is ever downloaded. ``--size tiny`` uses the tiny
fixture package instead.

Each mode runs in a fresh subprocess (so peak RSS and ``torch.cuda.max_memory_allocated`` are per
mode): ``load_pipeline(package, offload=mode, device=...)``, then one timed ``pipe.generate(...)`` TI2V
call with a deterministic test image (no warm-up). Recorded per mode: load time, generate time (and its
stages), peak RSS, on CUDA the peak allocated GPU memory, and the peak resident weight bytes from the
residency tracker of ``tests/support/residency.py`` (the weights that would sit on the accelerator; on CPU the
only meaningful memory figure for offload), plus a SHA-256 of the frames, which must be identical
across modes.
"""

from __future__ import annotations

import os

for _key, _value in (
    ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
    ("TOKENIZERS_PARALLELISM", "false"), ("TRANSFORMERS_VERBOSITY", "error"), ("DIFFUSERS_VERBOSITY", "error"),
):
    os.environ.setdefault(_key, _value)

import argparse
import contextlib
import datetime as _dt
import gc
import hashlib
import json
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "model", "sequential")  # the default run; "block" and "block:K" (K blocks on the GPU) may be added
EXTRA_MODES = ("block",)
DIT_DTYPES = ("bf16", "fp32", "fp8_e4m3fn", "fp8_e5m2")
MIB = 1024 * 1024
GIB = 1024 * MIB

# Workloads. CUDA: the published PR #6 workload (TI2V 320x192x49, 40 steps). CPU: chosen by measurement so
# that all three modes with full-size components finish in a few minutes on a 2-core runner.
CUDA_WORKLOAD = dict(height=192, width=320, frames=49, steps=40)
CPU_WORKLOAD = dict(height=64, width=96, frames=5, steps=2)
# On CPU the bytes tokenizer makes the model's default negative about 1,100 tokens (the real Qwen tokenizer: about
# 250): with it the text encoder took 68 % of a 64x96 run. The CPU workload therefore uses this short negative.
CPU_NEGATIVE = "low quality, blurry, distorted"
MODEL_DEFAULT_NEGATIVE = "@default"
PROMPT = ("A red fox trots through fresh snow in a quiet pine forest at sunrise, soft golden light, "
          "the camera slowly tracks alongside it.")

# Full-size parameter counts (docs: lingbot-video-model.md §1.3, §3; offload-lifecycle.md §7.1).
QWEN3VL_4B_PARAMS = 4_437_815_808
QWEN3VL_4B_VISION_PARAMS = 415_347_712
DIT_DENSE_PARAMS = 1_357_171_264
WAN21_VAE_PARAMS = 126_892_531
FULL_PACKAGE_VERSION = 1  # bump when the written content changes (invalidates the cache)
FULL_PACKAGE_BYTES = 12_300_000_000  # about 8.9 GB text encoder + 2.8 GB DiT + 0.5 GB VAE
INIT_STD = 0.02
TE_SHARD_BYTES = 2 * 1000**3


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Full-size package (random weights, released layout)
# ----------------------------------------------------------------------------------------------


def qwen3vl_4b_config(tokenizer):
    """Qwen3-VL-4B-Instruct architecture; special-token ids from the (bytes) fixture tokenizer."""
    from transformers import Qwen3VLConfig

    from lingbot_core.testing.fixtures import SPECIAL_TOKENS

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    cfg = Qwen3VLConfig(
        text_config=dict(
            vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
            max_position_embeddings=262144, rms_norm_eps=1e-6, attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                             "mrope_interleaved": True},
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, in_channels=3, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2560, num_position_embeddings=2304,
            deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh",
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    assert max(ids.values()) < cfg.text_config.vocab_size
    cfg.architectures = ["Qwen3VLForConditionalGeneration"]
    return cfg


def _is_norm_weight(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and "norm" in parts[-2] and parts[-1] in ("weight", "gamma")


def _random_tensor(name: str, shape, dtype, gen) -> "torch.Tensor":
    """N(0, 0.02); norm scales 1 + N(0, 0.02). Drawn directly in the storage dtype (no fp32 copy)."""
    import torch

    t = torch.empty(shape, dtype=dtype)
    t.normal_(1.0 if _is_norm_weight(name) else 0.0, INIT_STD, generator=gen)
    return t


class TiledFill:
    """A fast stand-in for :func:`_random_tensor` (used by ``scripts/gpu-check``, which builds its packages
    inside a device's time limit): every tensor is a window of one pool of N(0, 0.02) draws (norm scales
    1 + the same), starting at a random offset. The pool (4,194,301 values, a prime, so matrix rows do not
    line up with it) is drawn once; filling is then a memory copy, not 50-100 M normal draws a second."""

    POOL = 4_194_301

    def __init__(self, gen):
        import torch

        self.gen = gen
        self.pool = torch.empty(self.POOL, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
        self._cast = {}

    def __call__(self, name: str, shape, dtype, gen=None) -> "torch.Tensor":
        import torch

        pool = self._cast.setdefault(dtype, self.pool.to(dtype))
        t = torch.empty(shape, dtype=dtype)
        flat = t.view(-1)
        pos = int(torch.randint(0, self.POOL, (1,), generator=self.gen))
        done = 0
        while done < flat.numel():
            n = min(flat.numel() - done, self.POOL - pos)
            flat[done:done + n].copy_(pool[pos:pos + n])
            done, pos = done + n, 0
        if _is_norm_weight(name):
            t.add_(1.0)
        return t


def write_random_dit(folder: Path, gen, fill=None, **config) -> int:
    """A DiT folder (config.json + one safetensors file) of ``LingBotVideoTransformer3DModel(**config)``
    (class defaults: the released dense DiT) with random weights, bf16 with fp32 islands; returns its
    parameter count. Built on the meta device, written one tensor at a time."""
    import torch

    from lingbot_core.testing.fixtures import DIFFUSERS_VERSION
    from lingbot_core.model.transformer import LingBotVideoTransformer3DModel, is_fp32_island

    with torch.device("meta"):
        dit = LingBotVideoTransformer3DModel(**config)
    cfg = {"_class_name": "LingBotVideoTransformer3DModel", "_diffusers_version": DIFFUSERS_VERSION}
    cfg.update({k: v for k, v in dict(dit.config).items() if not k.startswith("_")})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(json.loads(json.dumps(cfg)), indent=2) + "\n")
    specs = [(k, tuple(v.shape), torch.float32 if is_fp32_island(k) else torch.bfloat16) for k, v in dit.state_dict().items()]
    _write_safetensors(folder, "diffusion_pytorch_model", specs, gen, None, fill)
    return sum(p.numel() for p in dit.parameters())


def moe_dit_config(layers: int) -> dict:
    """The released MoE DiT config with ``layers`` blocks (keyword arguments over the class defaults, which
    are the dense release's: full width; every block MoE)."""
    return dict(depth=layers, axes_lens=[4096, 512, 512], num_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=768, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                score_func="sigmoid", norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _write_safetensors(folder: Path, stem: str, specs, gen, shard_bytes: Optional[int], fill=None) -> None:
    """Write ``specs`` [(name, shape, dtype)] as one file or as shards + index, one shard in memory at a time.
    ``fill(name, shape, dtype, gen)`` makes each tensor (default :func:`_random_tensor`)."""
    from safetensors.torch import save_file

    import torch

    def nbytes(spec):
        _, shape, dtype = spec
        n = 1
        for s in shape:
            n *= s
        return n * torch.empty((), dtype=dtype).element_size()

    groups: List[list] = [[]]
    size = 0
    for spec in specs:
        if shard_bytes and groups[-1] and size + nbytes(spec) > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes(spec)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        fname = f"{stem}.safetensors" if len(groups) == 1 else f"{stem}-{i:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: (fill or _random_tensor)(name, shape, dtype, gen) for name, shape, dtype in group}
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        del tensors
        gc.collect()
        weight_map.update({name: fname for name, _, _ in group})
    if len(groups) > 1:
        total = sum(nbytes(s) for s in specs)
        (folder / f"{stem}.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def build_full_package(root: Path, seed: int = 0, fill=None) -> Dict:
    """Write the full-size package into ``root`` (which must not exist). Returns the build info.
    ``fill``: see :func:`_write_safetensors` (e.g. a :class:`TiledFill`)."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    from lingbot_core.testing.fixtures import (
        DIFFUSERS_VERSION, MODEL_INDEX, SCHEDULER_CONFIG, WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, tiny_processor,
        tiny_tokenizer,
    )
    from lingbot_core.model.transformer import LingBotVideoTransformer3DModel, is_fp32_island

    t_start = time.perf_counter()
    root.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    (root / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2) + "\n")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2) + "\n")
    tokenizer = tiny_tokenizer()
    tiny_processor(tokenizer).save_pretrained(root / "processor")
    info: Dict = {"version": FULL_PACKAGE_VERSION, "seed": seed, "init": f"normal(0, {INIT_STD}); norm scales 1 + normal(0, {INIT_STD})"}

    # DiT: class defaults = the released dense config; bf16 with fp32 islands, one file (as released).
    t0 = time.perf_counter()
    with torch.device("meta"):
        dit = LingBotVideoTransformer3DModel()
    n = sum(p.numel() for p in dit.parameters())
    assert n == DIT_DENSE_PARAMS, f"dense DiT has {n:,} params, expected {DIT_DENSE_PARAMS:,}"
    cfg = {"_class_name": "LingBotVideoTransformer3DModel", "_diffusers_version": DIFFUSERS_VERSION}
    cfg.update({k: v for k, v in dict(dit.config).items() if not k.startswith("_")})
    (root / "transformer").mkdir()
    (root / "transformer" / "config.json").write_text(json.dumps(json.loads(json.dumps(cfg)), indent=2) + "\n")
    specs = [(k, tuple(v.shape), torch.float32 if is_fp32_island(k) else torch.bfloat16) for k, v in dit.state_dict().items()]
    _write_safetensors(root / "transformer", "diffusion_pytorch_model", specs, gen, None, fill)
    info["transformer"] = {"params": n, "seconds": round(time.perf_counter() - t0, 1)}
    del dit
    log(f"  transformer: {n:,} params in {info['transformer']['seconds']} s")

    # Text encoder: Qwen3-VL-4B, bf16, sharded with an index (as released); lm_head is tied, not stored.
    t0 = time.perf_counter()
    te_cfg = qwen3vl_4b_config(tokenizer)
    with torch.device("meta"):
        te = Qwen3VLForConditionalGeneration(te_cfg)
    params = dict(te.named_parameters())  # tied lm_head listed once, under embed_tokens
    n = sum(p.numel() for p in params.values())
    assert n == QWEN3VL_4B_PARAMS, f"Qwen3-VL-4B has {n:,} params, expected {QWEN3VL_4B_PARAMS:,}"
    nv = sum(p.numel() for p in te.model.visual.parameters())
    assert nv == QWEN3VL_4B_VISION_PARAMS, f"vision tower has {nv:,} params, expected {QWEN3VL_4B_VISION_PARAMS:,}"
    persistent = set(te.state_dict()) - set(params) - {"lm_head.weight"}
    assert not persistent, f"unexpected persistent buffers {sorted(persistent)[:3]}"
    (root / "text_encoder").mkdir()
    te_cfg.dtype = torch.bfloat16
    te_cfg.save_pretrained(root / "text_encoder")
    GenerationConfig.from_model_config(te_cfg).save_pretrained(root / "text_encoder")
    specs = [(k, tuple(p.shape), torch.bfloat16) for k, p in params.items()]
    _write_safetensors(root / "text_encoder", "model", specs, gen, TE_SHARD_BYTES, fill)
    info["text_encoder"] = {"params": n, "vision_params": nv, "seconds": round(time.perf_counter() - t0, 1)}
    del te, params
    log(f"  text_encoder: {n:,} params in {info['text_encoder']['seconds']} s")

    # VAE: diffusers AutoencoderKLWan default config = Wan 2.1, with its latent mean/std; fp32 (as released).
    t0 = time.perf_counter()
    with torch.device("meta"):
        vae = AutoencoderKLWan(latents_mean=WAN21_LATENTS_MEAN, latents_std=WAN21_LATENTS_STD)
    n = sum(p.numel() for p in vae.parameters())
    assert n == WAN21_VAE_PARAMS, f"Wan 2.1 VAE has {n:,} params, expected {WAN21_VAE_PARAMS:,}"
    (root / "vae").mkdir()
    vae.save_config(root / "vae")
    specs = [(k, tuple(v.shape), torch.float32) for k, v in vae.state_dict().items()]
    _write_safetensors(root / "vae", "diffusion_pytorch_model", specs, gen, None, fill)
    info["vae"] = {"params": n, "seconds": round(time.perf_counter() - t0, 1)}
    del vae
    log(f"  vae: {n:,} params in {info['vae']['seconds']} s")

    info["bytes"] = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    info["build_s"] = round(time.perf_counter() - t_start, 1)
    return info


def ensure_full_package(workdir: Path, tiled: bool = False) -> tuple:
    """The cached full-size package (built on first use). Returns (path, info, build seconds or 0).
    ``tiled``: weights from :class:`TiledFill` (builds in seconds; a separate cache entry)."""
    root = workdir / f"lingbot-bench-dense-full-v{FULL_PACKAGE_VERSION}{'-tiled' if tiled else ''}"
    marker = root / "BUILD_INFO.json"
    if marker.is_file():
        return root, json.loads(marker.read_text()), 0.0
    workdir.mkdir(parents=True, exist_ok=True)
    partial = workdir / (root.name + ".partial")
    for stale in (root, partial):
        if stale.exists():
            shutil.rmtree(stale)
    free = shutil.disk_usage(workdir).free
    if free < FULL_PACKAGE_BYTES + 2 * GIB:
        raise SystemExit(f"error: the full-size package needs about {FULL_PACKAGE_BYTES / 1e9:.1f} GB; only "
                         f"{free / 1e9:.1f} GB free in {workdir}. Use --workdir elsewhere or --size tiny.")
    log(f"building the full-size package in {root} (once; about {FULL_PACKAGE_BYTES / 1e9:.1f} GB) ...")
    if tiled:
        import torch

        info = build_full_package(partial, fill=TiledFill(torch.Generator().manual_seed(0)))
        info["init"] += "; tiled from one pool of 4,194,301 draws (TiledFill)"
    else:
        info = build_full_package(partial)
    (partial / "BUILD_INFO.json").write_text(json.dumps(info, indent=2) + "\n")
    partial.rename(root)
    log(f"built in {info['build_s']} s, {info['bytes'] / 1e9:.2f} GB")
    gc.collect()
    return root, info, info["build_s"]


def build_tiny_package(folder: Path) -> Dict:
    from lingbot_core.testing.fixtures import write_package

    t0 = time.perf_counter()
    write_package(folder, refiner=False)  # release-like dtypes: DiT/TE bf16, VAE fp32
    return {"tiny": True, "build_s": round(time.perf_counter() - t0, 2)}


# ----------------------------------------------------------------------------------------------
# One mode (runs in its own process)
# ----------------------------------------------------------------------------------------------


def bench_image(height: int, width: int):
    """A deterministic RGB float image in [0, 1], larger than the video and of another aspect (exercises the crop)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    h0, w0 = height * 5 // 4 + 3, width * 5 // 4 + 1
    ys = torch.linspace(0, 1, h0)[:, None, None]
    xs = torch.linspace(0, 1, w0)[None, :, None]
    base = torch.cat([ys.expand(h0, w0, 1), xs.expand(h0, w0, 1), (ys * xs).expand(h0, w0, 1)], dim=-1)
    return (0.7 * base + 0.3 * torch.rand(h0, w0, 3, generator=g)).clamp(0, 1)


def _rss_mib() -> Optional[float]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import psutil

        return psutil.Process().memory_info().rss / MIB
    except ImportError:
        return None


def _peak_rss_mib() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru / MIB if sys.platform == "darwin" else ru / 1024  # bytes on macOS, KiB on Linux


def _rss_breakdown_mib() -> Dict[str, float]:
    """RssAnon / RssFile / RssShmem of this process (file-backed pages are mmap'ed safetensors)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def touch_weights(pipe) -> int:
    """Read one byte per page of every weight tensor of the pipeline; returns the bytes covered.

    safetensors weights that need no dtype cast stay memory-mapped after ``load_pipeline`` (it returns in
    under a second for 12 GB); without this, the first forward of each component pays the disk read and
    ``generate`` would time I/O, not offload. Under sequential offload the CPU weights live in the hooks'
    ``weights_map`` (the parameters are on ``meta``).
    """
    import torch

    seen, total = set(), 0

    def touch(t):
        nonlocal total
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
            return
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key in seen:
            return
        seen.add(key)
        flat = t.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        step = max(1, 4096 // flat.element_size())
        flat[::step].float().sum().item()
        total += key[1]

    for module in (pipe.transformer, pipe.text_encoder, pipe.vae):
        for t in list(module.parameters()) + list(module.buffers()):
            touch(t)
        maps = set()
        for sub in module.modules():
            hook = getattr(sub, "_hf_hook", None)
            for h in getattr(hook, "hooks", [hook]):
                wm = getattr(h, "weights_map", None)
                data = getattr(wm, "dataset", wm)
                if data is not None and id(data) not in maps:
                    maps.add(id(data))
                    for t in data.values():
                        touch(t)
    return total


def _tracker(pipe):
    """tests/support/residency.py's ResidencyTracker, or None when the tests folder is not there."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    try:
        from support.residency import ResidencyTracker
    except ImportError as e:
        log(f"residency tracker unavailable ({e}); peak resident weights not measured")
        return None
    return ResidencyTracker(pipe)


def run_mode(spec: Dict) -> Dict:
    import numpy as np
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    from transformers.utils import logging as hf_logging

    from lingbot_core import load_pipeline

    hf_logging.disable_progress_bar()  # "Loading weights" bars

    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    if cuda:
        # As the reference runner: TF32 on for fp32 matmuls/convs (the VAE is fp32).
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = spec["dtype"]
    out: Dict = {"mode": spec["mode"], "ok": False, "torch_threads": torch.get_num_threads()}
    if spec.get("build_tiny") and not Path(spec["package"]).exists():
        out["tiny_build"] = build_tiny_package(Path(spec["package"]))
    out["rss_start_mib"] = _rss_mib()

    t0 = time.perf_counter()
    mode, _, k = spec["mode"].partition(":")
    pipe = load_pipeline(spec["package"], offload=mode, device=device, blocks_on_gpu=int(k or 0),
                         dtypes={"transformer": spec.get("dit_dtype") or dtype, "text_encoder": dtype})
    sync()
    out["load_call_s"] = time.perf_counter() - t0
    out["touched_weights_mib"] = touch_weights(pipe) / MIB if spec.get("touch", True) else 0.0
    out["load_s"] = time.perf_counter() - t0
    out["touch_s"] = out["load_s"] - out["load_call_s"]
    out["rss_after_load_mib"] = _rss_mib()
    out["peak_rss_load_mib"] = _peak_rss_mib()
    if cuda:
        out["device_name"] = torch.cuda.get_device_name(device)
        out["gpu_alloc_after_load_mib"] = torch.cuda.memory_allocated(device) / MIB
        out["peak_gpu_alloc_load_mib"] = torch.cuda.max_memory_allocated(device) / MIB
    else:
        out["device_name"] = "cpu"
    log(f"{spec['mode']}: loaded in {out['load_s']:.1f} s (RSS {out['rss_after_load_mib']:.0f} MiB)")

    stages: Dict[str, float] = {}
    for name in ("encode_image", "encode_prompt", "denoise", "decode"):
        def timed(*a, _orig=getattr(pipe, name), _name=name, **k):
            t = time.perf_counter()
            try:
                return _orig(*a, **k)
            finally:
                sync()
                stages[_name] = stages.get(_name, 0.0) + time.perf_counter() - t
        setattr(pipe, name, timed)

    steps_done = []
    tracker = _tracker(pipe)
    image = bench_image(spec["height"], spec["width"])
    with tracker if tracker is not None else contextlib.nullcontext():
        resident_at_start = tracker.resident_bytes() if tracker is not None else 0  # `none`: everything, always
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t1 = time.perf_counter()
        frames = pipe.generate(
            spec["prompt"], negative_prompt=spec["negative_prompt"], image=image, height=spec["height"],
            width=spec["width"], num_frames=spec["frames"], steps=spec["steps"], guidance_scale=spec["guidance"],
            shift=spec["shift"], seed=spec["seed"], output_type="np",
            callback=lambda i, n, x0: steps_done.append(time.perf_counter()),
        )
        sync()
        out["generate_s"] = time.perf_counter() - t1
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        # CPU seconds of this process: on a shared (oversubscribed) CPU, wall time grows but this barely does.
        out["generate_cpu_s"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    out["stages_s"] = stages
    out["steps"] = len(steps_done)
    if tracker is not None:
        out["peak_resident_weights_mib"] = max(tracker.peak_bytes, resident_at_start) / MIB
        out["component_weights_mib"] = {k: v / MIB for k, v in tracker._component_bytes.items()}
    if cuda:
        out["peak_gpu_alloc_mib"] = torch.cuda.max_memory_allocated(device) / MIB
        out["peak_gpu_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MIB
    frames = np.ascontiguousarray(frames)
    out["frames_sha256"] = hashlib.sha256(frames.tobytes()).hexdigest()
    out["frames_shape"] = list(frames.shape)
    out["frames_finite"] = bool(np.isfinite(frames).all())
    out["frames_mean"] = float(frames.mean())
    out["peak_rss_mib"] = _peak_rss_mib()
    out["rss_end_mib"] = _rss_breakdown_mib()
    out["ok"] = True
    log(f"{spec['mode']}: generate {out['generate_s']:.1f} s, peak RSS {out['peak_rss_mib']:.0f} MiB")
    return out


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = run_mode(spec)
    Path(spec["result"]).write_text(json.dumps(result, indent=2) + "\n")
    return 0


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def machine_info(device: str, threads: Optional[int]) -> Dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": threads or os.cpu_count(),
        "ram_gib": round(ram, 1) if ram else None, "device": device, "python": platform.python_version(),
        "torch": ver("torch"), "diffusers": ver("diffusers"), "transformers": ver("transformers"),
        "accelerate": ver("accelerate"), "platform": platform.platform(),
    }


def run_child(spec: Dict, tmp: Path, timeout: Optional[float]) -> Dict:
    spec_path = tmp / f"spec-{spec['mode']}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.offload", "--_child", str(spec_path)], cwd=str(REPO),
                              env=env, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.perf_counter() - t0
    result_path = Path(spec["result"])
    if rc == 0 and result_path.is_file():
        result = json.loads(result_path.read_text())
    else:
        result = {"mode": spec["mode"], "ok": False, "error": f"child exited with {rc}"}
        log(f"{spec['mode']}: FAILED ({result['error']})")
    result["process_wall_s"] = wall
    return result


def _fmt(value, digits=1, thousands=True) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}" if thousands else f"{value:.{digits}f}"


def markdown(report: Dict) -> str:
    m, w, results = report["machine"], report["workload"], report["results"]
    cuda = m["device"] == "cuda"
    pkg = report["package"]
    lines = [
        f"## LingBot-Video offload benchmark ({report['size']} components, {m['device']})",
        "",
        f"- date: {report['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), "
        f"{m['ram_gib']} GiB RAM; device: {report.get('device_name') or m['device']}; 1-min load average "
        f"before/after: {m['loadavg_1m_before_after'][0]} / {m['loadavg_1m_before_after'][1]}",
        f"- software: torch {m['torch']}, diffusers {m['diffusers']}, transformers {m['transformers']}, "
        f"accelerate {m['accelerate']}, Python {m['python']}",
        f"- package: {pkg}",
        f"- workload: TI2V {w['height']}x{w['width']} (H x W), {w['frames']} frames, {w['steps']} steps, guidance "
        f"{w['guidance']}, shift {w['shift']}, seed {w['seed']}; DiT {w.get('dit_dtype') or w['dtype']}, text encoder {w['dtype']}, VAE fp32; "
        f"negative prompt: {'model default' if w['negative_prompt'] is None else repr(w['negative_prompt'])}",
        "",
    ]
    mem = "peak GPU MiB (max_memory_allocated)" if cuda else "peak resident weights MiB"
    lines += [f"| mode | load s | generate s | {mem} | peak RSS MiB | frames identical |",
              "|---|---:|---:|---:|---:|:---:|"]
    ref = next((r for r in results if r.get("ok")), None)
    for r in results:
        if not r.get("ok"):
            lines.append(f"| {r['mode']} | failed: {r.get('error', '?')} | | | | |")
            continue
        same = "reference" if r is ref else ("yes" if r["frames_sha256"] == ref["frames_sha256"] else "**NO**")
        memv = r.get("peak_gpu_alloc_mib") if cuda else r.get("peak_resident_weights_mib")
        lines.append(f"| {r['mode']} | {_fmt(r['load_s'])} | {_fmt(r['generate_s'])} | {_fmt(memv, 0 if (memv or 0) >= 100 else 3)} | "
                     f"{_fmt(r['peak_rss_mib'], 0)} | {same} |")
    ok = [r for r in results if r.get("ok")]
    lines += ["", "Stages of generate (s): text encode includes the VLM image tokens; denoise is all steps with CFG.", "",
              "| mode | VAE encode | text encode | denoise | per step | VAE decode |", "|---|---:|---:|---:|---:|---:|"]
    for r in ok:
        s = r["stages_s"]
        per = s.get("denoise", 0) / max(r.get("steps") or 1, 1)
        lines.append(f"| {r['mode']} | {_fmt(s.get('encode_image'), 2)} | {_fmt(s.get('encode_prompt'), 2)} | "
                     f"{_fmt(s.get('denoise'), 2)} | {_fmt(per, 2)} | {_fmt(s.get('decode'), 2)} |")
    extra = []
    if ok:
        extra.append(f"frames identical across modes: {'yes' if report['frames_identical'] else 'NO'} "
                     f"(sha256 {ref['frames_sha256'][:16]}…, shape {ref['frames_shape']}, "
                     f"finite: {all(r['frames_finite'] for r in ok)})")
        extra.append("generate, process CPU time (s; user + sys of the mode's process, less sensitive to other load "
                     "on a shared machine than wall time): " + ", ".join(f"{r['mode']} {_fmt(r.get('generate_cpu_s'))}" for r in ok))
        extra.append("load = load_pipeline + reading every weight page into RAM (s): " + ", ".join(
            f"{r['mode']} {_fmt(r['load_call_s'])} + {_fmt(r['touch_s'])}" for r in ok))
        extra.append("peak RSS during load (MiB): " + ", ".join(f"{r['mode']} {_fmt(r['peak_rss_load_mib'], 0)}" for r in ok))
        extra.append("RSS at the end, anonymous / file-backed (MiB): " + ", ".join(
            f"{r['mode']} {_fmt(r['rss_end_mib'].get('RssAnon'), 0)} / {_fmt(r['rss_end_mib'].get('RssFile'), 0)}" for r in ok))
        if cuda:
            extra.append("peak GPU reserved (MiB): " + ", ".join(f"{r['mode']} {_fmt(r.get('peak_gpu_reserved_mib'), 0)}" for r in ok))
            extra.append("peak resident weights (MiB, tracker): " + ", ".join(
                f"{r['mode']} {_fmt(r.get('peak_resident_weights_mib'), 0)}" for r in ok))
    if report.get("build_s"):
        cached = " (cached for later runs)" if report["size"] == "full" else ""
        extra.append(f"package build: {report['build_s']:.1f} s{cached}")
    lines += [""] + [f"- {e}" for e in extra]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.offload", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated subset of none,model,sequential,block,block:K (K DiT blocks kept on the GPU)")
    p.add_argument("--dit-dtype", choices=DIT_DTYPES, default=None, help="DiT dtype (default: --dtype); fp8 = fp8 weight storage")
    p.add_argument("--height", type=int, default=None, help="default 192 on CUDA, 64 on CPU")
    p.add_argument("--width", type=int, default=None, help="default 320 on CUDA, 96 on CPU")
    p.add_argument("--frames", type=int, default=None, help="4n+1; default 49 on CUDA, 5 on CPU")
    p.add_argument("--steps", type=int, default=None, help="default 40 on CUDA, 2 on CPU")
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--shift", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--negative-prompt", default=None,
                   help=f"default: the model's default negative on CUDA, {CPU_NEGATIVE!r} on CPU; "
                        f"{MODEL_DEFAULT_NEGATIVE!r} selects the model's default negative")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="DiT and text encoder dtype (VAE always fp32). bf16 also on CPU: with AVX512-BF16/AMX it is "
                        "about 4.5x faster than fp32, and a full-size fp32 text encoder (16.5 GiB) does not fit 24 GiB "
                        "next to the other components")
    p.add_argument("--size", choices=["full", "tiny"], default="full", help="full-size random weights or the tiny fixture")
    p.add_argument("--workdir", default=None, help="where the full-size package is cached (default ~/.cache/lingbot-bench)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per mode process (default: torch's)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per mode process")
    p.add_argument("--no-touch", dest="touch", action="store_false",
                   help="do not read the (memory-mapped) weights into RAM as part of the load; generate then "
                        "includes the disk reads")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._child:
        return child_main(args._child)
    sys.path.insert(0, str(REPO))
    device = args.device
    if device != "cpu":  # the driver imports torch only to look for CUDA (it runs no model itself)
        import torch

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("error: --device cuda but no CUDA device is available; use --device cpu.")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES + EXTRA_MODES
           and not (m.startswith("block:") and m[len("block:"):].isdigit())]
    if bad or not modes:
        raise SystemExit(f"error: --modes must be a comma-separated subset of {','.join(MODES)}; got {args.modes!r}.")
    defaults = CUDA_WORKLOAD if device == "cuda" else CPU_WORKLOAD
    workload = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    negative = args.negative_prompt
    if negative is None:
        negative = MODEL_DEFAULT_NEGATIVE if device == "cuda" else CPU_NEGATIVE
    workload.update(guidance=args.guidance, shift=args.shift, seed=args.seed, dtype=args.dtype, dit_dtype=args.dit_dtype,
                    prompt=args.prompt, negative_prompt=None if negative == MODEL_DEFAULT_NEGATIVE else negative)

    workdir = Path(args.workdir).expanduser() if args.workdir else Path(os.environ.get(
        "LINGBOT_BENCH_CACHE", Path.home() / ".cache" / "lingbot-bench"))
    with tempfile.TemporaryDirectory(prefix="lingbot-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if args.size == "full":
            package, info, build_s = ensure_full_package(workdir)
            pkg_desc = (f"full-size random weights ({QWEN3VL_4B_PARAMS:,}-param Qwen3-VL-4B bf16, "
                        f"{DIT_DENSE_PARAMS:,}-param dense DiT bf16 + fp32 islands, {WAN21_VAE_PARAMS:,}-param "
                        f"Wan 2.1 VAE fp32; bytes tokenizer), {package}")
        else:
            # Written by the first mode process (it imports transformers/diffusers anyway): saves an import here.
            package, info, build_s = tmp / "lingbot-tiny-dense", None, 0.0
            pkg_desc = "tiny fixture package (lingbot_core.testing.fixtures.write_package: bf16 DiT/TE, fp32 VAE)"
        gc.collect()
        results = []
        load_before = os.getloadavg()
        for mode in modes:
            log(f"{mode}: running in a fresh process ...")
            spec = dict(workload, package=str(package), mode=mode, device=device, threads=args.threads,
                        result=str(tmp / f"result-{mode}.json"), build_tiny=args.size == "tiny", touch=args.touch)
            results.append(run_child(spec, tmp, args.timeout))
        load_after = os.getloadavg()
    ok = [r for r in results if r.get("ok")]
    if info is None:
        info = next((r["tiny_build"] for r in ok if r.get("tiny_build")), {})
        build_s = info.get("build_s", 0.0)
    machine = machine_info(device, args.threads)
    if ok:
        machine["torch_threads"] = ok[0]["torch_threads"]
    machine["loadavg_1m_before_after"] = [round(load_before[0], 2), round(load_after[0], 2)]
    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "device_name": next((r.get("device_name") for r in ok), None),
        "size": args.size,
        "package": pkg_desc,
        "package_info": info,
        "build_s": build_s,
        "workload": workload,
        "results": results,
        "frames_identical": bool(ok) and len(ok) == len(results) and len({r["frames_sha256"] for r in ok}) == 1,
    }
    text = markdown(report)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if len(ok) == len(results) and report["frames_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
