"""LoRA files for the DiT: recognising their keys, the arithmetic, and applying a stack to a model.

A LoRA stack is a tuple of ``(path, strength)``. For a targeted Linear the stack's change is

    W' = W + sum_i strength_i * (alpha_i / rank_i) * (up_i @ down_i)     (rank = down.shape[0]; no alpha: 1)

plus ``strength * diff`` / ``strength * diff_b`` (full-weight deltas) and the LoHa / LoKr products,
always formed in fp32. How it is applied depends on the weight's storage (see docs/lora.md, "Design"):

- bf16 / fp16 / fp32 weights are **merged**: ``(W.float() + delta).to(W.dtype)`` replaces the weight
  (one rounding, no cost per step). W is always the checkpoint's tensor, read again from the package
  for a weight that was merged before, so strength changes never compound rounding and a removal
  gives back the loaded tensor bit for bit. Only the touched weights are read, never the whole DiT,
  and no copy of the original weights is kept in RAM.
- fp8 weights are left as they are and the Linear adds ``(x down^T) up'^T`` (bf16, ``up'`` = the
  scaled up) in its forward (run time, as LightX2V's "dynamic" mode and ComfyUI's "bypass"): merging
  would round the weight to fp8 a second time, and the original bf16 weights are not in RAM.

Key formats are recognised per module (one file may mix them; the LightX2V file does): the
prefixes and suffix pairs of docs/lora.md, an optional ``.alpha``, ``.diff`` / ``.diff_b``, LoHa
(``hada_*``) and LoKr (``lokr_*``). Keys on the stacked routed experts or the router are refused:
no trainer writes them, and they are not Linears.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .transformer import ADAPTER_PARAMS, Linear

logger = logging.getLogger("lingbot_core")

# One LoRA of a stack: (file path, strength).
LoraEntry = Tuple[str, float]
LoraStack = Tuple[LoraEntry, ...]

MAX_STRENGTH = 10.0
# The adapter parameters a Linear carries (None when no LoRA touches it).
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", "lora_unet_", "")
# (down suffix, up suffix): the low-rank pairs seen across trainers (docs/lora.md section 3).
PAIRS = (
    (".lora_down.weight", ".lora_up.weight"),
    (".lora_A.default.weight", ".lora_B.default.weight"),
    (".lora_A.weight", ".lora_B.weight"),
    (".lora.down.weight", ".lora.up.weight"),
    ("_lora.down.weight", "_lora.up.weight"),
    (".lora_linear_layer.down.weight", ".lora_linear_layer.up.weight"),
    (".lora_A", ".lora_B"),
)
# Single-tensor parts: suffix -> role.
SINGLES = {
    ".alpha": "alpha", ".diff": "diff", ".diff_b": "diff_b",
    ".hada_w1_a": "hada_w1_a", ".hada_w1_b": "hada_w1_b", ".hada_w2_a": "hada_w2_a", ".hada_w2_b": "hada_w2_b",
    ".lokr_w1": "lokr_w1", ".lokr_w1_a": "lokr_w1_a", ".lokr_w1_b": "lokr_w1_b",
    ".lokr_w2": "lokr_w2", ".lokr_w2_a": "lokr_w2_a", ".lokr_w2_b": "lokr_w2_b",
}
# Parts a Linear LoRA of this pack cannot use, with the reason.
UNSUPPORTED = {
    ".lora_mid.weight": "a LoCon/Tucker middle factor (for convolutions)",
    ".dora_scale": "DoRA (weight-decomposed LoRA)",
    ".hada_t1": "LoHa with Tucker factors (for convolutions)", ".hada_t2": "LoHa with Tucker factors (for convolutions)",
    ".lokr_t2": "LoKr with a Tucker factor (for convolutions)",
}
# Parameters of the MoE layer that are not Linears (stacked experts, router): no trainer targets them.
_NON_LINEAR = re.compile(r"^blocks\.\d+\.ffn\.(experts\.w[123]|experts|router(\.weight)?)$")

# What a file that matches nothing looks like it is for: (pattern in its keys, description).
_FOREIGN = (
    ("self_attn.q", "a Wan 2.1/2.2 LoRA (its DiT names attention self_attn.q/k/v/o)"),
    ("cross_attn", "a Wan 2.1/2.2 LoRA (its DiT has cross_attn layers)"),
    ("self_attn_q", "a Wan 2.1/2.2 LoRA (its DiT names attention self_attn.q/k/v/o)"),
    ("input_blocks", "a Stable Diffusion 1.x/SDXL UNet LoRA"),
    ("down_blocks", "a Stable Diffusion 1.x/SDXL UNet LoRA"),
    ("lora_te", "a Stable Diffusion text-encoder LoRA"),
    ("double_blocks", "a Flux or HunyuanVideo LoRA"),
    ("single_blocks", "a Flux or HunyuanVideo LoRA"),
    ("transformer_blocks", "a LoRA for another diffusion transformer (transformer_blocks naming)"),
    ("layers.", "a LoRA for a language model or another transformer (layers.N naming)"),
)


class LoraError(ValueError):
    """A LoRA file that cannot be applied; the message names the file and what is wrong."""


# ----------------------------------------------------------------------------------------------
# Stacks
# ----------------------------------------------------------------------------------------------


def check_strength(strength) -> float:
    s = float(strength)
    if not math.isfinite(s) or abs(s) > MAX_STRENGTH:
        raise ValueError(f"LoRA strength {strength!r} is not allowed: use a finite value from -{MAX_STRENGTH:g} to {MAX_STRENGTH:g}.")
    return s


def normalize_stack(loras: Optional[Iterable]) -> LoraStack:
    """``[(path, strength), ...]`` (or bare paths, strength 1) -> a hashable stack; strength-0 entries are dropped."""
    out = []
    for item in loras or ():
        path, strength = (item, 1.0) if isinstance(item, (str, Path)) else item
        strength = check_strength(strength)
        if strength != 0.0:
            out.append((str(Path(path)), strength))
    return tuple(out)


def parse_lora_arg(text: str) -> LoraEntry:
    """The CLI's ``PATH[:STRENGTH]`` (a Windows drive letter is not taken for a strength)."""
    path, sep, tail = text.rpartition(":")
    if sep and path and not (len(path) == 1 and tail.startswith(("\\", "/"))):
        try:
            return path, check_strength(float(tail))
        except ValueError as e:
            if "not allowed" in str(e):
                raise
    return text, 1.0


def describe_stack(loras: LoraStack) -> str:
    """``name.safetensors @ 0.8, other.safetensors @ 1`` for log lines; ``none`` when empty."""
    return ", ".join(f"{Path(p).name} @ {s:g}" for p, s in loras) or "none"


# ----------------------------------------------------------------------------------------------
# Recognising keys
# ----------------------------------------------------------------------------------------------


@dataclass
class ModuleParts:
    """The tensors of one file that belong to one module: role -> key in the file."""

    module: str
    keys: Dict[str, str] = field(default_factory=dict)


def _split(key: str) -> Optional[Tuple[str, str]]:
    """``key`` -> (module path as written, role), or None when the suffix is not a known part."""
    for down, up in PAIRS:
        if key.endswith(down):
            return key[: -len(down)], "down"
        if key.endswith(up):
            return key[: -len(up)], "up"
    for suffix, role in SINGLES.items():
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    for suffix in UNSUPPORTED:
        if key.endswith(suffix):
            return key[: -len(suffix)], "unsupported:" + suffix
    return None


def _resolve_module(written: str, linears: Dict[str, nn.Module], underscored: Dict[str, str]) -> Tuple[Optional[str], str]:
    """(model module name, prefix) for a module path as a file writes it; (None, "") when unknown."""
    for prefix in PREFIXES:
        if prefix and not written.startswith(prefix):
            continue
        rest = written[len(prefix):]
        if prefix == "lora_unet_":
            rest = underscored.get(rest, rest)
        if rest in linears or _NON_LINEAR.match(rest):
            return rest, prefix
    return None, ""


def match_keys(keys: Sequence[str], linears: Dict[str, nn.Module], path: str) -> Tuple[Dict[str, ModuleParts], List[str]]:
    """Group a file's keys by the DiT Linear they target. Returns (parts by module, unmatched keys).

    Raises for keys on the routed experts or the router, and for adapter kinds this pack does not run.
    """
    underscored = {name.replace(".", "_"): name for name in linears}
    parts: Dict[str, ModuleParts] = {}
    unmatched = []
    for key in keys:
        split = _split(key)
        module = None
        if split is not None:
            module, _ = _resolve_module(split[0], linears, underscored)
        if module is None:
            unmatched.append(key)
            continue
        role = split[1]
        if _NON_LINEAR.match(module):
            raise LoraError(
                f"LoRA {Path(path).name}: key {key!r} targets {module}, the MoE layer's stacked routed experts or router. "
                "No known trainer writes LoRA there and this pack does not apply it; use a LoRA trained on the attention "
                "and shared-expert Linears (as LightX2V's and DiffSynth-Studio's)."
            )
        if role.startswith("unsupported:"):
            raise LoraError(f"LoRA {Path(path).name}: key {key!r} is {UNSUPPORTED[role.split(':', 1)[1]]}, which this pack does not support.")
        entry = parts.setdefault(module, ModuleParts(module))
        if role in entry.keys:
            raise LoraError(f"LoRA {Path(path).name}: module {module} has two {role} tensors ({entry.keys[role]!r} and {key!r}).")
        entry.keys[role] = key
    return parts, unmatched


def _looks_like(keys: Sequence[str]) -> str:
    text = " ".join(keys[:2000])
    for pattern, what in _FOREIGN:
        if pattern in text:
            return what
    return "not a LoRA for the LingBot-Video DiT"


def _no_match_error(path: str, keys: Sequence[str]) -> LoraError:
    examples = ", ".join(repr(k) for k in sorted(keys)[:3])
    return LoraError(
        f"LoRA {Path(path).name} has {len(keys)} tensors and none of them targets a LingBot-Video DiT layer "
        f"(e.g. {examples}). It looks like {_looks_like(list(keys))}. LingBot-Video LoRAs name layers such as "
        "'blocks.0.attn.to_q' (LightX2V's four-step LoRA, DiffSynth-Studio, kohya/ComfyUI 'diffusion_model.' files)."
    )


# ----------------------------------------------------------------------------------------------
# Reading and the arithmetic
# ----------------------------------------------------------------------------------------------


def _open(path: str):
    """A header-checked reader (offsets inside the file, known dtypes); nothing is executed."""
    from ..files.checkpoint_files import ModelPackageError, SafetensorsReader, is_safetensors

    p = Path(path)
    if not is_safetensors(p):
        raise LoraError(f"LoRA {p.name}: only .safetensors LoRA files are loaded (pickle formats can run code).")
    if not p.is_file():
        raise LoraError(f"LoRA file {p} does not exist.")
    try:
        return SafetensorsReader(p)
    except ModelPackageError as e:
        raise LoraError(f"LoRA {e}") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise LoraError(f"LoRA {p.name} is not a readable safetensors file ({e}); download it again.") from None


def _expected_shapes(role: str, module: nn.Module) -> Optional[tuple]:
    out_f, in_f = module.out_features, module.in_features
    return {"diff": (out_f, in_f), "diff_b": (out_f,)}.get(role)


def _check_shapes(path: str, parts: ModuleParts, shapes: Dict[str, tuple], module: nn.Module) -> None:
    """Every shape a module's parts must have (from the header: no tensor is read)."""
    name = Path(path).name
    weight = (module.out_features, module.in_features)

    def fail(role, want):
        raise LoraError(f"LoRA {name}: tensor {parts.keys[role]!r} has shape {list(shapes[role])}, but layer "
                        f"{parts.module} needs {list(want)} (its weight is {list(weight)}). The LoRA is for another model size.")

    k = parts.keys
    if ("down" in k) != ("up" in k):
        missing = "up" if "down" in k else "down"
        raise LoraError(f"LoRA {name}: layer {parts.module} has {k.get('down') or k.get('up')!r} but no {missing} tensor.")
    if "down" in k:
        down, up = shapes["down"], shapes["up"]
        if len(down) != 2 or down[1] != module.in_features:
            fail("down", ["rank", module.in_features])
        if len(up) != 2 or up[0] != module.out_features or up[1] != down[0]:
            fail("up", [module.out_features, down[0]])
    if "alpha" in k and math.prod(shapes["alpha"]) != 1:
        fail("alpha", [])
    for role in ("diff", "diff_b"):
        if role in k and tuple(shapes[role]) != _expected_shapes(role, module):
            fail(role, _expected_shapes(role, module))
    hada = [r for r in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b") if r in k]
    if hada and len(hada) != 4:
        raise LoraError(f"LoRA {name}: layer {parts.module} has LoHa tensors {sorted(hada)} but needs all four hada_w1_a/b, hada_w2_a/b.")
    if hada:
        for a, b in (("hada_w1_a", "hada_w1_b"), ("hada_w2_a", "hada_w2_b")):
            if len(shapes[a]) != 2 or len(shapes[b]) != 2 or (shapes[a][0], shapes[b][1]) != weight or shapes[a][1] != shapes[b][0]:
                fail(a, [weight[0], "rank"])
    lokr = [r for r in k if r.startswith("lokr_")]
    if lokr:
        for w in ("lokr_w1", "lokr_w2"):
            if w not in k and not (f"{w}_a" in k and f"{w}_b" in k):
                raise LoraError(f"LoRA {name}: layer {parts.module} has LoKr tensors but no {w} (or {w}_a and {w}_b).")
        def dims(w):
            if w in k:
                return tuple(shapes[w])
            return (shapes[f"{w}_a"][0], shapes[f"{w}_b"][-1])
        d1, d2 = dims("lokr_w1"), dims("lokr_w2")
        if len(d1) != 2 or len(d2) != 2 or (d1[0] * d2[0], d1[1] * d2[1]) != weight:
            role = "lokr_w1" if "lokr_w1" in k else "lokr_w1_a"
            fail(role, [f"a x c = {weight[0]}", f"b x d = {weight[1]}"])
    if not ({"down", "diff", "diff_b"} & set(k)) and not hada and not lokr:
        raise LoraError(f"LoRA {name}: layer {parts.module} has only {sorted(k.values())}, no weights to apply.")


@dataclass
class LoraFile:
    """A checked LoRA file: which modules it touches (from its header alone)."""

    path: str
    parts: Dict[str, ModuleParts]
    shapes: Dict[str, tuple]
    unmatched: List[str]
    total_keys: int
    nbytes: int = 0  # bytes of the tensors that will be read


def inspect_lora(path: str, linears: Dict[str, nn.Module]) -> LoraFile:
    """Check a LoRA file against a model's Linears from its header alone (names and shapes; no tensor
    is read). Raises :class:`LoraError` when nothing matches or a shape is wrong; warns on a partial match."""
    reader = _open(path)
    keys = reader.keys()
    if not keys:
        raise LoraError(f"LoRA {Path(path).name} holds no tensors.")
    parts, unmatched = match_keys(keys, linears, path)
    if not parts:
        raise _no_match_error(path, keys)
    shapes = {}
    for module, mp in parts.items():
        s = {role: tuple(reader.shape(key)) for role, key in mp.keys.items()}
        _check_shapes(path, mp, s, linears[module])
        shapes.update({mp.keys[role]: shape for role, shape in s.items()})
    if unmatched:
        examples = ", ".join(repr(k) for k in unmatched[:3])
        logger.warning("LoRA %s: %d of its %d tensors match no DiT layer and are ignored (e.g. %s); %d layers get the LoRA.",
                       Path(path).name, len(unmatched), len(keys), examples, len(parts))
    return LoraFile(str(path), parts, shapes, unmatched, len(keys), sum(reader.nbytes(k) for k in keys))


@dataclass
class LoadedLora:
    """One file of a stack, read and checked: its tensors in fp32 by module and role."""

    path: str
    strength: float
    modules: Dict[str, Dict[str, torch.Tensor]]

    def coefficient(self, module: str) -> float:
        """``strength * alpha / rank`` for a module's factors (``strength`` without an alpha)."""
        t = self.modules[module]
        if "alpha" not in t:
            return self.strength
        if "down" in t:
            rank = t["down"].shape[0]
        elif "hada_w1_b" in t:
            rank = t["hada_w1_b"].shape[0]
        else:
            rank = next((t[w].shape[0] for w in ("lokr_w2_b", "lokr_w1_b") if w in t), None)
        return self.strength * (float(t["alpha"].reshape(())) / rank) if rank else self.strength


def read_stack(loras: LoraStack, linears: Dict[str, nn.Module]) -> List[LoadedLora]:
    """Read and check every file of a stack (fp32 tensors). Nothing of the model is touched, so an
    error here (a truncated file, a lying header, a wrong shape, NaNs) leaves the pipeline as it was."""
    from safetensors import SafetensorError

    out = []
    for path, strength in loras:
        info = inspect_lora(path, linears)
        reader = _open(path)
        name = Path(path).name
        modules = {}
        for module, mp in info.parts.items():
            try:
                tensors = {role: reader.get(key) for role, key in mp.keys.items()}
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                raise LoraError(f"LoRA {name}: could not read the tensors of {module} ({e}); the file may be damaged, download it again.") from None
            for role, tensor in tensors.items():
                if not tensor.is_floating_point():
                    raise LoraError(f"LoRA {name}: tensor {mp.keys[role]!r} has dtype {tensor.dtype}, not a float type.")
                if not torch.isfinite(tensor).all():
                    raise LoraError(f"LoRA {name}: tensor {mp.keys[role]!r} contains NaN or infinite values; the file is damaged.")
            modules[module] = {role: t.float() for role, t in tensors.items()}
        out.append(LoadedLora(str(path), strength, modules))
    return out


def _full(t: Dict[str, torch.Tensor], w: str) -> torch.Tensor:
    return t[w] if w in t else t[f"{w}_a"] @ t[f"{w}_b"]


def weight_delta(module: str, stack: Sequence[LoadedLora], device=None) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The stack's fp32 (weight delta, bias delta) for one module, each None when nothing touches it:
    the sum over files of ``strength * (alpha / rank) * (up @ down)`` (LoHa: ``(w1a @ w1b) * (w2a @ w2b)``,
    LoKr: ``kron(w1, w2)``) plus ``strength * diff`` and ``strength * diff_b``."""
    dw = db = None

    def add(acc, x):
        return x if acc is None else acc + x

    for lora in stack:
        t = lora.modules.get(module)
        if t is None:
            continue
        t = {k: v.to(device) for k, v in t.items()} if device is not None else t
        c = lora.coefficient(module)
        if "down" in t:
            dw = add(dw, c * (t["up"] @ t["down"]))
        if "hada_w1_a" in t:
            dw = add(dw, c * ((t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])))
        if any(r.startswith("lokr_") for r in t):
            dw = add(dw, c * torch.kron(_full(t, "lokr_w1"), _full(t, "lokr_w2")))
        if "diff" in t:
            dw = add(dw, lora.strength * t["diff"])
        if "diff_b" in t:
            db = add(db, lora.strength * t["diff_b"])
    return dw, db


def run_time_adapters(module: str, stack: Sequence[LoadedLora], dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """A module's run-time adapter tensors in ``dtype``: the files' low-rank factors concatenated along
    the rank (each ``up`` scaled by its coefficient in fp32), full-weight parts summed densely."""
    downs, ups, rest = [], [], []
    for lora in stack:
        t = lora.modules.get(module)
        if t is None:
            continue
        if "down" in t:
            downs.append(t["down"])
            ups.append(t["up"] * lora.coefficient(module))
        others = {r: v for r, v in t.items() if r not in ("down", "up")}
        if others:
            rest.append(LoadedLora(lora.path, lora.strength, {module: others}))
    dw, db = weight_delta(module, rest)
    out = {}
    if downs:
        out["lora_down"] = torch.cat(downs, dim=0).to(dtype)
        out["lora_up"] = torch.cat(ups, dim=1).to(dtype)
    if dw is not None:
        out["lora_diff"] = dw.to(dtype)
    if db is not None:
        out["lora_diff_b"] = db.to(dtype)
    return out


# ----------------------------------------------------------------------------------------------
# The model side
# ----------------------------------------------------------------------------------------------


def lora_targets(model: nn.Module) -> Dict[str, nn.Module]:
    """The DiT's Linears a LoRA may target, by module name (the checkpoint's names)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


@dataclass
class ApplyReport:
    merged: int = 0  # weights replaced by merged copies
    restored: int = 0  # weights put back to the checkpoint's
    run_time: int = 0  # fp8 or GGUF-quantized Linears given run-time adapters
    adapter_bytes: int = 0


def apply_stack(model: nn.Module, stack: Sequence[LoadedLora], merged: set, original, compute_device=None) -> ApplyReport:
    """Make the model's LoRA state exactly ``stack``.

    Linears stored in bf16/fp16/fp32 get merged weights ``(W.float() + delta).to(W.dtype)``, where W
    is the checkpoint's tensor: the current one if it was never merged, else ``original(key, dtype)``
    read again from the package (so no change ever compounds rounding, and a removal gives back the
    loaded tensor bit for bit). fp8-stored and GGUF-quantized Linears keep their weights and get run-time
    adapters in the DiT's compute dtype (bf16 for fp8). ``merged`` (the parameter keys currently merged) is updated as each weight is written, so an
    error part-way (a package file that vanished) leaves it true for the next call to repair.
    ``compute_device`` (e.g. the CUDA execution device) forms the deltas and merged weights there, one
    weight at a time, and puts the result back on the weight's home device.
    The model must be unhooked (weights on their home device); the caller re-installs offload.
    """
    from ..files.fp8 import FP8_COMPUTE_DTYPE, is_fp8

    touched = {m for lora in stack for m in lora.modules}
    report = ApplyReport()
    adapter_dtype = getattr(model, "compute_dtype", FP8_COMPUTE_DTYPE)

    def refuse_non_finite(key: str, dtype: torch.dtype) -> LoraError:
        # Finite factors can still overflow (1e30 x 1e30, alpha 3e38): a black video without this.
        shown = describe_stack(tuple((lora.path, lora.strength) for lora in stack))
        return LoraError(f"the LoRA stack {shown} makes {key} NaN or infinite in {str(dtype).replace('torch.', '')} "
                         "(its factors or alpha are out of range, or the strength is too high); lower the strength or "
                         "remove that LoRA. The other weights are restored when the stack changes.")

    for name, module in lora_targets(model).items():
        run_time = is_fp8(module.weight.dtype) or module.weight_qtype is not None
        entry = run_time_adapters(name, stack, adapter_dtype) if run_time and name in touched else {}
        for param, t in entry.items():
            if not torch.isfinite(t).all():
                raise refuse_non_finite(f"{name}.{param}", t.dtype)
        device = module.weight.device
        for param in ADAPTER_PARAMS:
            t = entry.get(param)
            setattr(module, param, None if t is None else nn.Parameter(t.to(device), requires_grad=False))
        if entry:
            report.run_time += 1
            report.adapter_bytes += sum(t.numel() * t.element_size() for t in entry.values())
        if run_time:
            continue
        keys = [f"{name}.{leaf}" for leaf in ("weight", "bias") if getattr(module, leaf) is not None]
        if name not in touched and not any(k in merged for k in keys):
            continue
        work = device if compute_device is None else torch.device(compute_device)
        dw, db = weight_delta(name, stack, work) if name in touched else (None, None)
        for key, delta in zip(keys, (dw, db)):
            leaf = key.rsplit(".", 1)[1]
            param = getattr(module, leaf)
            if delta is None and key not in merged:
                continue
            base = original(key, param.dtype) if key in merged else param.data
            if delta is None:
                param.data = base.to(device)
                merged.discard(key)
                report.restored += 1
            else:
                value = (base.to(work).float() + delta).to(param.dtype)
                if not torch.isfinite(value).all():
                    raise refuse_non_finite(key, param.dtype)
                param.data = value.to(device)
                merged.add(key)
                report.merged += 1
    return report
