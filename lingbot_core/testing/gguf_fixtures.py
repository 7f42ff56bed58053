"""GGUF DiT files for tests and benchmarks, written with gguf-py in the two layouts found in the wild.

- ``"rebel"`` (realrebelai's MoE GGUFs): official names, no prefix, every routed expert its own 2-D
  tensor ``blocks.N.ffn.experts.w1.<e>.weight``; a ``general.architecture`` key is present.
- ``"sdcpp"`` (stable-diffusion.cpp): official names, optionally prefixed ``model.diffusion_model.``,
  experts stacked as one 3-D tensor per block, no key/value metadata; norms and ``scale_shift_table``
  quantized too when their rows are whole blocks.

gguf-py quantizes only Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 in Python; the K-quants are written as *valid random
blocks* (random quants and sub-scales, finite fp16 super-scales of a chosen size). Either way the values
a file holds are what gguf-py's numpy ``gguf.quants.dequantize`` reads back from the written bytes;
:func:`write_gguf_dit` returns them, so a test can build a package holding exactly those values.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch

LAYOUTS = ("rebel", "sdcpp")
PREFIX = "model.diffusion_model."

# Types gguf-py's Python quantizer supports; the others get valid random blocks.
_PY_QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# Byte offsets of the fp16 fields of one block: (scale fields, min fields), and the largest magnitude the
# integer part of a value can reach (so the super-scale can be chosen for a target amplitude).
_FP16_FIELDS = {
    "Q8_0": ((0,), (), 127), "Q4_0": ((0,), (), 8), "Q4_1": ((0,), (2,), 15), "Q5_0": ((0,), (), 16),
    "Q5_1": ((0,), (2,), 31), "Q2_K": ((80,), (82,), 45), "Q3_K": ((108,), (), 128),
    "Q4_K": ((0,), (2,), 945), "Q5_K": ((0,), (2,), 1953), "Q6_K": ((208,), (), 4064),
    "IQ4_NL": ((0,), (), 127),  # a type the pack does not dequantize (files of it must be refused)
}
_EXPERT = re.compile(r"^(blocks\.\d+\.ffn\.experts\.w[123])$")


def random_blocks(qtype_name: str, rows: int, cols: int, rng: np.random.Generator, amplitude: float = 0.05) -> np.ndarray:
    """``rows`` rows of ``cols`` values as valid random ``qtype_name`` blocks (uint8, ``(rows, row_bytes)``).

    Every byte is random except the fp16 super-scales (finite, about ``amplitude / max integer``), so the
    values are finite, of about ``amplitude``, and every bit of the quants and sub-scales is exercised.
    """
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype_name}: {cols} values per row are not whole blocks of {block}.")
    n = rows * (cols // block)
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    scales, mins, top = _FP16_FIELDS[qtype_name]
    for off in scales:
        d = (amplitude / top * rng.uniform(0.25, 1.0, n)).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n, 2)
    for off in mins:
        m = (amplitude / (63 if qtype_name.endswith("_K") else 1) * rng.uniform(0.0, 1.0, n)).astype(np.float16)
        if not qtype_name.endswith("_K"):
            m = -m  # Q4_1/Q5_1 add m: centre the values
        raw[:, off:off + 2] = m.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def encode(values: np.ndarray, qtype_name: str, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes for a 2-D/3-D float array: gguf-py's quantizer where it has one, else valid random
    blocks of the array's amplitude (K-quants); rows are the last dimension."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype_name in _PY_QUANTIZABLE:
        return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)
    rows = int(np.prod(values.shape[:-1]))
    amplitude = float(np.abs(values).mean() * 2) or 0.05
    raw = random_blocks(qtype_name, rows, values.shape[-1], rng, amplitude)
    return raw.reshape(*values.shape[:-1], -1)


def _quantizable(name: str, shape, block: int, layout: str) -> bool:
    from lingbot_core.model.transformer import is_fp32_island

    if shape[-1] % block:
        return False  # sd.cpp too keeps rows that are not whole blocks unquantized
    if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
        return False
    if is_fp32_island(name):
        # sd.cpp quantizes norms and scale_shift_table too; the router and time MLPs stay float in both.
        return layout == "sdcpp" and ("norm" in name or name.endswith("scale_shift_table")) and len(shape) >= 1
    return len(shape) >= 2


def write_gguf_dit(path, state: Dict[str, torch.Tensor], qtype_name: str, *, layout: str = "rebel",
                   prefix: bool = False, seed: int = 0, plain: str = "F32",
                   expert_order: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Write the DiT ``state`` (checkpoint names) as a GGUF file in ``layout``; return the fp32 values the
    file holds (official names, stacked experts), as gguf-py dequantizes them.

    ``plain`` is the type of the tensors that are not quantized (``F32``, ``F16`` or ``BF16``; the
    e_score_correction_bias always F32). ``expert_order="reversed"`` writes a rebel file's expert tensors
    in reverse order (the loader must not rely on file order).
    """
    import gguf

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: use one of {LAYOUTS}.")
    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "lingbot_video")
    if layout == "sdcpp":
        writer.kv_data[0].clear()  # sd.cpp writes no key/value metadata at all
    pre = PREFIX if prefix else ""
    held: Dict[str, torch.Tensor] = {}

    def add(name: str, arr: np.ndarray, raw_dtype=None):
        writer.add_tensor(pre + name, arr, raw_dtype=raw_dtype)

    for name, tensor in state.items():
        values = tensor.detach().float().numpy()
        if values.ndim == 0:
            values = values.reshape(1)
        if _quantizable(name, values.shape, block, layout):
            raw = encode(values, qtype_name, rng)
            held[name] = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(values.shape).copy())
            if layout == "rebel" and _EXPERT.match(name):
                order = range(values.shape[0])
                if expert_order == "reversed":
                    order = reversed(order)
                for e in order:
                    add(f"{name}.{e}.weight", np.ascontiguousarray(raw[e]), qtype)
            else:
                add(name, raw, qtype)
            continue
        kind = "F32" if name.endswith("e_score_correction_bias") else plain
        if kind == "F16":
            arr = values.astype(np.float16)
            held[name] = torch.from_numpy(arr.astype(np.float32))
            add(name, arr)
        elif kind == "BF16":
            raw = gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType.BF16)
            held[name] = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.BF16).reshape(values.shape).copy())
            add(name, raw, gguf.GGMLQuantizationType.BF16)
        else:
            arr = values.astype(np.float32)
            held[name] = torch.from_numpy(arr.copy())
            add(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {k: v.reshape(state[k].shape) for k, v in held.items()}


def write_oracle_package(source_pkg, out_dir, values: Dict[str, torch.Tensor]) -> Path:
    """A copy of package ``source_pkg`` whose ``transformer/`` holds ``values`` in fp32 (the numbers a GGUF
    file holds), with the source's config; the other components are linked, not copied."""
    from safetensors.torch import save_file

    src, out = Path(source_pkg), Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for entry in src.iterdir():
        if entry.name in ("transformer", "refiner"):
            continue
        (out / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    (out / "transformer").mkdir()
    shutil.copy(src / "transformer" / "config.json", out / "transformer" / "config.json")
    save_file({k: v.contiguous() for k, v in values.items()}, str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    return out


def package_state(pkg, sub: str = "transformer") -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = Path(pkg) / sub
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def package_config(pkg, sub: str = "transformer") -> dict:
    return json.loads((Path(pkg) / sub / "config.json").read_text())


def write_random_gguf_dit(path, config: dict, qtype_name: str, *, layout: str = "rebel", seed: int = 0,
                          amplitude: float = 0.02) -> int:
    """A GGUF DiT of ``config`` written straight from random blocks (no float weights are ever formed, so
    full-width MoE blocks cost only their quantized size): Linear weights and experts as valid random
    ``qtype_name`` blocks, fp32 islands and biases as F32 (norm scales 1 + noise, small modulation table).
    Returns the file's size in bytes."""
    import gguf

    from lingbot_core.model.transformer import LingBotVideoTransformer3DModel, is_fp32_island

    with torch.device("meta"):
        model = LingBotVideoTransformer3DModel(**config)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "lingbot_video")
    if layout == "sdcpp":
        writer.kv_data[0].clear()
    for name, ref in model.state_dict().items():
        shape = tuple(ref.shape)
        if len(shape) >= 2 and shape[-1] % block == 0 and not is_fp32_island(name):
            rows = int(np.prod(shape[:-1]))
            raw = random_blocks(qtype_name, rows, shape[-1], rng, amplitude).reshape(*shape[:-1], -1)
            if layout == "rebel" and _EXPERT.match(name):
                for e in range(shape[0]):
                    writer.add_tensor(f"{name}.{e}.weight", np.ascontiguousarray(raw[e]), raw_dtype=qtype)
            else:
                writer.add_tensor(name, raw, raw_dtype=qtype)
            continue
        leaf_module = name.split(".")[-2] if "." in name else ""
        noise = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("scale_shift_table"):
            values = noise * 0.1
        elif leaf_module.startswith("norm") and name.endswith(".weight"):
            values = 1.0 + noise * 0.05
        else:
            values = noise * amplitude
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path).stat().st_size


# -- the Qwen3-VL text encoder in llama.cpp's layout ---------------------------------------------------


def write_text_encoder_gguf(path, model, qtype_name: str, *, seed: int = 0, embed: Optional[str] = None,
                            arch: str = "qwen3vl", drop: tuple = ()) -> Dict[str, torch.Tensor]:
    """The text model of the Qwen3-VL ``model`` as llama.cpp writes it (architecture ``arch``, tensors
    named by gguf-py's own ``TensorNameMap``, the vision tower left out as it goes to the mmproj file);
    return the fp32 values the file holds under HF names (gguf-py's ``quants.dequantize`` of the bytes).

    ``qtype_name`` is the type of the decoder layers' 2-D weights (``F32`` keeps everything float), or
    F32 where a row is not whole blocks (as llama.cpp falls back); ``embed`` the token embedding's type
    (default: ``qtype_name``); norms are F32. K-quants are valid random blocks of the weight's amplitude
    (gguf-py has no K-quant quantizer). ``drop`` leaves those HF names out (an incomplete file).
    """
    import gguf

    text = model.config.text_config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3VL, text.num_hidden_layers)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(text.num_hidden_layers)
    writer.add_embedding_length(text.hidden_size)
    held: Dict[str, torch.Tensor] = {}
    for hf, tensor in model.state_dict().items():
        if not hf.startswith("model.language_model.") or hf in drop:
            continue
        short = "model." + hf[len("model.language_model."):]  # the names llama.cpp's converter maps
        key = names.get_name(short, try_suffixes=(".weight", ".bias"))
        values = tensor.detach().float().numpy()
        kind = (embed or qtype_name) if key.startswith("token_embd") else qtype_name
        if values.ndim == 2 and kind not in ("F32", "F16", "BF16"):
            block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
            if values.shape[-1] % block == 0:
                qtype = gguf.GGMLQuantizationType[kind]
                raw = encode(values, kind, rng)
                held[hf] = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(values.shape).copy())
                writer.add_tensor(key, raw, raw_dtype=qtype)
                continue
        if values.ndim == 2 and kind == "F16":
            arr = values.astype(np.float16)
            held[hf] = torch.from_numpy(arr.astype(np.float32))
            writer.add_tensor(key, arr)
            continue
        held[hf] = torch.from_numpy(values.copy())
        writer.add_tensor(key, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def write_mmproj_gguf(path, model, qtype_name: str = "F16", *, seed: int = 0) -> Dict[str, torch.Tensor]:
    """The vision tower of the Qwen3-VL ``model`` as llama.cpp's mmproj file (architecture ``clip``,
    projector ``qwen3vl_merger``): blocks named by gguf-py's ``TensorNameMap``, and as llama.cpp's converter
    writes the rest (docs: the Conv3d patch kernel split along time into ``v.patch_embd.weight`` and
    ``.weight.1``, the merger as ``v.post_ln``/``mm.0``/``mm.2``, deepstack mergers as
    ``v.deepstack.<vision layer>.{norm,fc1,fc2}``). 2-D Linear weights in ``qtype_name`` (F16 or a block
    type), the rest F32. Returns the fp32 values held, under HF names."""
    import gguf

    vision = model.config.vision_config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.depth)
    indexes = list(vision.deepstack_visual_indexes)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_clip_projector_type("qwen3vl_merger")
    held: Dict[str, torch.Tensor] = {}
    merger = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
    deepstack = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}

    def add(key, values, linear):
        if linear and qtype_name == "F16":
            arr = values.astype(np.float16)
            writer.add_tensor(key, arr)
            return torch.from_numpy(arr.astype(np.float32))
        if linear and qtype_name != "F32":
            qtype = gguf.GGMLQuantizationType[qtype_name]
            raw = encode(values, qtype_name, rng)
            writer.add_tensor(key, raw, raw_dtype=qtype)
            return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(values.shape).copy())
        writer.add_tensor(key, values.astype(np.float32))
        return torch.from_numpy(values.astype(np.float32).copy())

    for hf, tensor in model.state_dict().items():
        if not hf.startswith("model.visual."):
            continue
        inner = hf[len("model.visual."):]
        owner, _, leaf = inner.rpartition(".")
        values = tensor.detach().float().numpy()
        if inner == "patch_embed.proj.weight":
            a = add("v.patch_embd.weight", np.ascontiguousarray(values[:, :, 0]), False)
            b = add("v.patch_embd.weight.1", np.ascontiguousarray(values[:, :, 1]), False)
            held[hf] = torch.stack([a, b], dim=2)
            continue
        if inner == "patch_embed.proj.bias":
            key = "v.patch_embd.bias"
        elif owner.startswith("merger."):
            key = f"{merger[owner[len('merger.'):]]}.{leaf}"
        elif owner.startswith("deepstack_merger_list."):
            i, part = owner[len("deepstack_merger_list."):].split(".", 1)
            key = f"v.deepstack.{indexes[int(i)]}.{deepstack[part]}.{leaf}"
        else:
            key = names.get_name("visual." + inner, try_suffixes=(".weight", ".bias"))
        linear = values.ndim == 2 and leaf == "weight" and "pos_embed" not in inner
        held[hf] = add(key, values, linear)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
