"""The Qwen3-VL text encoder from a llama.cpp GGUF (``Qwen3-VL-4B-Instruct-Q8_0.gguf`` and the like).

llama.cpp splits Qwen3-VL in two files: the text model (architecture ``qwen3vl``: ``token_embd``,
``blk.N.attn_q/attn_k/attn_v/attn_output``, ``attn_q_norm``/``attn_k_norm``, ``attn_norm``, ``ffn_norm``,
``ffn_gate/up/down``, ``output_norm``) and the vision tower in a separate ``mmproj-*.gguf``. The text
model is what T2V needs; an ``mmproj*.gguf`` beside it that is Qwen3-VL's vision tower of the config's
shapes provides TI2V (its Linear weights mapped too, the rest dequantized once). Without one an image
prompt is refused naming the file to add.

The file stays memory-mapped. The decoder layers' Linear weights stay their GGUF block bytes and are
dequantized by the DiT's own quantized :class:`~lingbot_core.model.transformer.Linear` when they run
(:mod:`lingbot_core.files.gguf_weights`: its kernels and shift caches); the token embedding, when
quantized, stays bytes too and only the rows of a prompt's tokens are dequantized. The norms (small) are
dequantized once, to the compute dtype, as a safetensors load holds them.

No q/k permutation is undone: llama.cpp's converter permutes q/k only in ``LlamaModel.modify_tensors``
(for llama-style interleaved RoPE), and its ``Qwen3VLTextModel`` derives from ``Qwen3Model`` ->
``Qwen2Model`` -> ``TextModel``, which write the HF weights as they are (llama.cpp ``convert_hf_to_gguf.py``;
llama.cpp runs qwen3vl with the neox-style "imrope", HF's rotate-half layout). The tests check it: the
F32 file's prompt embeddings equal the safetensors model's.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import nn

from ..files import gguf_weights
from ..files.checkpoint_files import GGUFFile, ModelPackageError

ARCHITECTURE = "qwen3vl"
TEXT_PREFIX = "model.language_model."
# HF name inside the text model -> llama.cpp name (written from llama.cpp's tensor names; the tests'
# files are named by gguf-py's own TensorNameMap, so a wrong entry fails them as a missing tensor).
_TOP_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Tensors a text-model GGUF may carry that the encoder never uses (the untied output head, RoPE factors).
_UNUSED = ("output.weight", "rope_freqs.weight")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
SUPPORTED = gguf_weights.QUANTIZED_TYPE_NAMES + gguf_weights.PLAIN_TYPE_NAMES


def is_gguf(path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def is_mmproj(path) -> bool:
    """llama.cpp's vision-projector files (``mmproj-*.gguf``): not a text encoder on their own."""
    return Path(path).name.lower().startswith("mmproj")


def mmproj_candidates(text_path) -> List[Path]:
    """The ``mmproj*.gguf`` files beside a text GGUF, in name order (the first usable one serves TI2V)."""
    return [p for p in sorted(Path(text_path).parent.iterdir()) if is_mmproj(p) and is_gguf(p) and p.is_file()]


def gguf_name(hf_name: str) -> Optional[str]:
    """The llama.cpp name of a text-model tensor given under HF names (``model.language_model.*``), or
    None for a tensor the text model does not have (the vision tower, ``lm_head``)."""
    if not hf_name.startswith(TEXT_PREFIX):
        return None
    inner = hf_name[len(TEXT_PREFIX):]
    if inner in _TOP_NAMES:
        return _TOP_NAMES[inner]
    m = _LAYER.match(inner)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _expected_text_shapes(config) -> Dict[str, tuple]:
    """HF name -> shape of every text-model tensor ``config`` (a ``Qwen3VLConfig``) describes."""
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith(TEXT_PREFIX)}


class TextEncoderGGUF:
    """A Qwen3-VL text-model GGUF checked against a config: names, shapes, types, from the header alone."""

    def __init__(self, path, config):
        self.path = Path(path)
        name = self.path.name
        if not self.path.is_file():
            raise ModelPackageError(f"text_encoder: file {self.path} does not exist.")
        if is_mmproj(self.path):
            raise ModelPackageError(f"text_encoder: {name} is llama.cpp's vision projector (mmproj), not the text model; "
                                    "choose the Qwen3-VL-4B text GGUF (e.g. Qwen3-VL-4B-Instruct-Q8_0.gguf) instead.")
        self.file = GGUFFile(self.path, "text_encoder")
        arch = self.file.metadata("general.architecture")
        if arch != ARCHITECTURE:
            what = "no general.architecture" if arch is None else f"architecture {arch!r}"
            hint = " (a vision projector: it is not a text model)" if arch == "clip" else ""
            raise ModelPackageError(f"text_encoder: {name} is a GGUF of {what}{hint}; expected Qwen3-VL-4B's text model "
                                    f"in llama.cpp's layout (architecture {ARCHITECTURE!r}, e.g. "
                                    "Qwen3-VL-4B-Instruct-Q8_0.gguf).")
        self.shapes = _expected_text_shapes(config)  # HF name -> shape
        self.source = {}  # HF name -> GGUF name
        keys = set(self.file.keys())
        missing = []
        for hf, shape in self.shapes.items():
            key = gguf_name(hf)
            if key is None or key not in keys:
                missing.append(key or hf)
                continue
            got = self.file.shape(key)
            if got != shape:
                raise ModelPackageError(
                    f"text_encoder: tensor {key!r} of {name} has shape {list(got)}, but the Qwen3-VL config implies "
                    f"{list(shape)} (hidden size {config.text_config.hidden_size}, {config.text_config.num_hidden_layers} "
                    "layers); LingBot-Video needs Qwen3-VL-4B (a <file stem>.json beside the file describes another size).")
            qtype = self.file.qtype(key)
            if qtype.name not in SUPPORTED:
                raise ModelPackageError(f"text_encoder: tensor {key!r} of {name} is stored as {qtype.name}, which this "
                                        f"pack cannot dequantize; use a file quantized to one of {', '.join(SUPPORTED)}.")
            self.source[hf] = key
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ModelPackageError(f"text_encoder: {name} is missing {len(missing)} tensors of the Qwen3-VL text model: "
                                    f"{', '.join(missing[:3])}{more}; expected Qwen3-VL-4B's text GGUF in llama.cpp's layout.")
        extra = sorted(keys - set(self.source.values()) - set(_UNUSED))
        if extra:
            raise ModelPackageError(f"text_encoder: {name} has tensors the Qwen3-VL text model does not have "
                                    f"({', '.join(extra[:3])}); expected Qwen3-VL-4B's text GGUF in llama.cpp's layout.")

    def stays_quantized(self, hf: str) -> bool:
        return _stays_quantized(hf, self.file.qtype(self.source[hf]))


def _stays_quantized(hf: str, qtype) -> bool:
    """Linear weights of the decoder layers and the token embedding stay block bytes."""
    owner = hf.rsplit(".", 2)[-2]
    return gguf_weights.is_block_quantized(qtype) and (owner in _LINEARS or owner == "embed_tokens")


def hf_name(key: str) -> Optional[str]:
    """The HF name of a llama.cpp text-model tensor, or None for one the encoder does not use."""
    for inner, name in _TOP_NAMES.items():
        if key == name:
            return TEXT_PREFIX + inner
    m = re.match(r"^blk\.(\d+)\.(.+)$", key)
    if m:
        for inner, name in _LAYER_NAMES.items():
            if m.group(2) == name:
                return f"{TEXT_PREFIX}layers.{m.group(1)}.{inner}"
    return None


def loaded_bytes(path, dtype: torch.dtype) -> Dict[str, int]:
    """HF name -> bytes each tensor of a text-encoder GGUF takes once loaded at ``dtype``, from the header
    alone (no config needed): the mapped block bytes for what stays quantized, values for the rest."""
    file = GGUFFile(Path(path), "text_encoder")
    size = torch.empty(0, dtype=dtype).element_size()
    out = {}
    for key in file.keys():
        hf = hf_name(key)
        if hf is None:
            continue
        n = math.prod(int(d) for d in file.shape(key))
        out[hf] = file.nbytes(key) if _stays_quantized(hf, file.qtype(key)) else n * size
    out.update(_mmproj_bytes(Path(path), size))
    return out


def _mmproj_bytes(text_path: Path, size: int) -> Dict[str, int]:
    """Bytes of the first Qwen3-VL vision projector beside the text GGUF (name order), by its tensor names:
    Linear weights at their mapped size, the rest as values of ``size`` bytes (header only)."""
    for candidate in mmproj_candidates(text_path):
        try:
            file = GGUFFile(candidate, "text_encoder")
        except ModelPackageError:
            continue
        if (file.metadata("general.architecture"), file.metadata("clip.projector_type")) != (VISION_ARCHITECTURE, PROJECTOR_TYPE):
            continue
        out = {}
        for key in file.keys():
            n = math.prod(int(d) for d in file.shape(key))
            linear = len(file.shape(key)) == 2 and key.endswith(".weight") and "position_embd" not in key
            out[f"{candidate.name}:{key}"] = file.nbytes(key) if linear else n * size
        return out
    return {}


class QuantizedEmbedding(nn.Module):
    """The token embedding as its GGUF block bytes (one row per token): a lookup dequantizes only the rows
    of the tokens asked for, on the device the bytes are on."""

    def __init__(self, raw: torch.Tensor, qtype, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(raw, requires_grad=False)
        self.weight_qtype = qtype
        self.compute_dtype = dtype
        self.num_embeddings = raw.shape[0]
        self.embedding_dim = gguf_weights.logical_shape(raw.shape, qtype)[-1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[ids.reshape(-1).to(self.weight.device)]
        return gguf_weights.dequantize(rows, self.weight_qtype, self.compute_dtype).reshape(*ids.shape, self.embedding_dim)


class MissingVisionTower(nn.Module):
    """Stands for the vision tower when no usable mmproj file lies beside the text GGUF: an image prompt is
    refused naming the file to add."""

    def __init__(self, path: Path, why: str = ""):
        super().__init__()
        self.file_name = Path(path).name
        self.why = why

    def _refuse(self):
        return ModelPackageError(
            f"text_encoder: {self.file_name} holds Qwen3-VL's text model only; an image prompt (TI2V) needs the vision "
            f"tower{self.why}. Put llama.cpp's vision projector of Qwen3-VL-4B (mmproj-Qwen3-VL-4B-Instruct-F16.gguf or "
            "-Q8_0.gguf, from the same release) in the same folder and load again, or choose a text encoder that "
            "includes it (Comfy-Org's qwen3vl_4b_bf16.safetensors, or the package's text_encoder/). Text-to-video "
            "works without it.")

    @property
    def dtype(self):  # read first by Qwen3VLModel.get_image_features
        raise self._refuse()

    def forward(self, *args, **kwargs):
        raise self._refuse()


# -- the vision tower: llama.cpp's mmproj file -------------------------------------------------------
#
# Names as llama.cpp's converter writes Qwen3-VL's vision tower (convert_hf_to_gguf.py, Qwen3VLVisionModel):
# blocks through gguf-py's tensor map (v.blk.N.ln1/ln2/attn_qkv/attn_out/ffn_up/ffn_down), the Conv3d
# patch kernel split along time into v.patch_embd.weight and .weight.1, the merger as v.post_ln, mm.0 and
# mm.2, deepstack mergers as v.deepstack.<vision layer index>.{norm,fc1,fc2}; architecture "clip",
# projector type "qwen3vl_merger".

VISION_ARCHITECTURE = "clip"
PROJECTOR_TYPE = "qwen3vl_merger"
VISION_PREFIX = "model.visual."
_VISION_BLOCK = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
                 "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
_MERGER = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def mmproj_names(hf: str, deepstack_indexes) -> Optional[tuple]:
    """The mmproj tensor(s) of a vision-tower tensor under HF names (two for the patch kernel), or None."""
    if not hf.startswith(VISION_PREFIX):
        return None
    inner = hf[len(VISION_PREFIX):]
    owner, _, leaf = inner.rpartition(".")
    if inner == "patch_embed.proj.weight":
        return ("v.patch_embd.weight", "v.patch_embd.weight.1")
    if inner == "patch_embed.proj.bias":
        return ("v.patch_embd.bias",)
    if inner == "pos_embed.weight":
        return ("v.position_embd.weight",)
    m = re.match(r"^blocks\.(\d+)\.(.+)$", owner)
    if m and m.group(2) in _VISION_BLOCK:
        return (f"v.blk.{m.group(1)}.{_VISION_BLOCK[m.group(2)]}.{leaf}",)
    if owner.startswith("merger.") and owner[len("merger."):] in _MERGER:
        return (f"{_MERGER[owner[len('merger.'):]]}.{leaf}",)
    m = re.match(r"^deepstack_merger_list\.(\d+)\.(.+)$", owner)
    if m and m.group(2) in _DEEPSTACK and int(m.group(1)) < len(deepstack_indexes):
        return (f"v.deepstack.{deepstack_indexes[int(m.group(1))]}.{_DEEPSTACK[m.group(2)]}.{leaf}",)
    return None


class VisionProjectorGGUF:
    """An mmproj file checked to be Qwen3-VL's vision tower of ``config``'s shapes (header only)."""

    def __init__(self, path, config):
        from transformers import Qwen3VLForConditionalGeneration

        self.path = Path(path)
        self.file = GGUFFile(self.path, "text_encoder")
        name = self.path.name
        arch, projector = self.file.metadata("general.architecture"), self.file.metadata("clip.projector_type")
        if arch != VISION_ARCHITECTURE or projector != PROJECTOR_TYPE:
            raise ModelPackageError(f"{name} is not Qwen3-VL's vision projector (architecture {arch!r}, projector "
                                    f"{projector!r}; expected {VISION_ARCHITECTURE!r}, {PROJECTOR_TYPE!r})")
        with torch.device("meta"):
            state = Qwen3VLForConditionalGeneration(config).state_dict()
        indexes = list(config.vision_config.deepstack_visual_indexes)
        keys = set(self.file.keys())
        self.source = {}
        for hf, ref in state.items():
            if not hf.startswith(VISION_PREFIX):
                continue
            sources = mmproj_names(hf, indexes)
            missing = [k for k in (sources or (hf,)) if k not in keys]
            if sources is None or missing:
                raise ModelPackageError(f"{name} lacks {missing[0]} of Qwen3-VL's vision tower")
            want = tuple(ref.shape) if len(sources) == 1 else (ref.shape[0], ref.shape[1], *ref.shape[3:])
            for k in sources:
                if self.file.shape(k) != want:
                    raise ModelPackageError(f"{name}: tensor {k!r} has shape {list(self.file.shape(k))}, but the "
                                            f"Qwen3-VL config implies {list(want)} (another model size)")
                if self.file.qtype(k).name not in SUPPORTED:
                    raise ModelPackageError(f"{name}: tensor {k!r} is stored as {self.file.qtype(k).name}, which this "
                                            "pack cannot dequantize")
            self.source[hf] = sources


def find_mmproj(text_path: Path, config):
    """The first ``mmproj*.gguf`` beside the text GGUF (name order) that is Qwen3-VL's vision tower of
    ``config``'s shapes, and why the others were passed over."""
    why = []
    for candidate in mmproj_candidates(text_path):
        try:
            return VisionProjectorGGUF(candidate, config), why
        except ModelPackageError as e:
            why.append(str(e).removeprefix("text_encoder: "))
    return None, why


def _linear_bytes(raw: torch.Tensor, qtype) -> torch.Tensor:
    """A Linear weight as the bytes the quantized Linear takes: block bytes as they are, float values as
    their bytes (still the mapped file; cast to the compute dtype per call)."""
    return raw if gguf_weights.is_block_quantized(qtype) else raw.contiguous().view(torch.uint8)


def _quantized_linear(old: nn.Linear, raw: torch.Tensor, qtype) -> nn.Module:
    from .transformer import Linear

    with torch.device("meta"):
        linear = Linear(old.in_features, old.out_features, bias=old.bias is not None)
    linear._parameters["weight"] = nn.Parameter(raw, requires_grad=False)
    linear.weight_qtype = qtype
    return linear


def _values(raw: torch.Tensor, qtype, dtype: torch.dtype) -> torch.Tensor:
    return (gguf_weights.dequantize(raw, qtype) if gguf_weights.is_block_quantized(qtype) else raw).to(dtype)


def _load_vision(visual: nn.Module, proj: VisionProjectorGGUF, dtype: torch.dtype, vision_config) -> None:
    """The vision tower's tensors from the mmproj file: Linear weights stay mapped bytes (dequantized or cast
    per call), the rest (norms, biases, position table, patch kernel) become ``dtype`` values once."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionRotaryEmbedding

    state = {}
    for hf, sources in proj.source.items():
        inner = hf[len(VISION_PREFIX):]
        owner_name, _, leaf = inner.rpartition(".")
        owner = visual.get_submodule(owner_name)
        parts = [(proj.file.get(k), proj.file.qtype(k)) for k in sources]
        if isinstance(owner, nn.Linear) and leaf == "weight":
            parent_name, _, attr = owner_name.rpartition(".")
            raw, qtype = parts[0]
            setattr(visual.get_submodule(parent_name), attr, _quantized_linear(owner, _linear_bytes(raw, qtype), qtype))
            continue
        values = [_values(raw, qtype, dtype) for raw, qtype in parts]
        state[inner] = values[0] if len(values) == 1 else torch.stack(values, dim=2)  # the kernel's time axis
    visual.load_state_dict(state, strict=False, assign=True)
    visual.rotary_pos_emb = Qwen3VLVisionRotaryEmbedding(vision_config)


def load_text_encoder_gguf(path, dtype: torch.dtype, config):
    """Qwen3-VL from a llama.cpp text GGUF, for the shapes ``config`` (a ``Qwen3VLConfig``) describes; the
    vision tower from an ``mmproj*.gguf`` beside it when there is one (else an image prompt is refused)."""
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    te = TextEncoderGGUF(path, config)
    proj, why = find_mmproj(te.path, config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(config)
    text = model.model.language_model
    state = {}
    try:
        for hf, key in te.source.items():
            raw, qtype = te.file.get(key), te.file.qtype(key)
            inner = hf[len(TEXT_PREFIX):]
            if te.stays_quantized(hf):
                owner_name = inner.rpartition(".")[0]
                if owner_name == "embed_tokens":
                    text.embed_tokens = QuantizedEmbedding(raw, qtype, dtype)
                    continue
                parent_name, _, leaf = owner_name.rpartition(".")
                parent = text.get_submodule(parent_name)
                setattr(parent, leaf, _quantized_linear(getattr(parent, leaf), raw, qtype))
                continue
            state[inner] = _values(raw, qtype, dtype)
        if proj is not None:
            _load_vision(model.model.visual, proj, dtype, config.vision_config)
    except (OSError, ValueError, RuntimeError) as e:
        if isinstance(e, ModelPackageError):
            raise
        raise ModelPackageError(f"text_encoder: {te.path.name} could not be read ({e}); it may be truncated, "
                                "download it again.") from None
    text.load_state_dict(state, strict=False, assign=True)
    # Built on meta, the rotary tables (buffers, not in any file) are made again from the config.
    text.rotary_emb = Qwen3VLTextRotaryEmbedding(config=config.text_config)
    if proj is None:
        model.model.visual = MissingVisionTower(te.path, f" ({'; '.join(why)})" if why else "")
    # Only the final hidden states are used (the pack's loader sets the same head); nothing to tie.
    model.lm_head = nn.Identity()
    still_meta = [k for k, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if still_meta:
        raise ModelPackageError(f"text_encoder: {te.path.name} left {still_meta[:3]} unset.")
    return model.eval().requires_grad_(False)
