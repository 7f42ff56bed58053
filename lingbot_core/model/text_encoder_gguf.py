"""The Qwen3-VL text encoder from a llama.cpp GGUF (``Qwen3-VL-4B-Instruct-Q8_0.gguf`` and the like).

llama.cpp splits Qwen3-VL in two files: the text model (architecture ``qwen3vl``: ``token_embd``,
``blk.N.attn_q/attn_k/attn_v/attn_output``, ``attn_q_norm``/``attn_k_norm``, ``attn_norm``, ``ffn_norm``,
``ffn_gate/up/down``, ``output_norm``) and the vision tower in a separate ``mmproj-*.gguf``. The text
model is what T2V needs; this pack does not read the mmproj file, so the vision tower is left out and
an image prompt (TI2V) is refused naming the safetensors file that has it.

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

import re
from pathlib import Path
from typing import Dict, Optional

import torch
from torch import nn

from ..files import gguf_weights
from ..files.checkpoint_files import GGUFFile, ModelPackageError

ARCHITECTURE = "qwen3vl"
TEXT_PREFIX = "model.language_model."
# HF name inside the text model -> llama.cpp name (written from llama.cpp's tensor names; the tests
# compare this table with gguf-py's own TensorNameMap).
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
        n = 1
        for d in file.shape(key):
            n *= int(d)
        out[hf] = file.nbytes(key) if _stays_quantized(hf, file.qtype(key)) else n * size
    return out


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
    """Stands for the vision tower a text-model GGUF does not have: an image prompt is refused by name."""

    def __init__(self, path: Path):
        super().__init__()
        self.file_name = Path(path).name

    def _refuse(self):
        return ModelPackageError(
            f"text_encoder: {self.file_name} holds Qwen3-VL's text model only; an image prompt (TI2V) needs the vision "
            "tower. Choose a Qwen3-VL-4B text encoder that includes it, e.g. Comfy-Org's qwen3vl_4b_bf16.safetensors "
            "(models/text_encoders), or the package's text_encoder/; llama.cpp's separate mmproj-*.gguf is not read by "
            "this pack. Text-to-video works with the GGUF as it is.")

    @property
    def dtype(self):  # read first by Qwen3VLModel.get_image_features
        raise self._refuse()

    def forward(self, *args, **kwargs):
        raise self._refuse()


def load_text_encoder_gguf(path, dtype: torch.dtype, config):
    """Qwen3-VL (text model only) from a llama.cpp GGUF, for the shapes ``config`` (a ``Qwen3VLConfig``) describes."""
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from .transformer import Linear

    te = TextEncoderGGUF(path, config)
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
                old = getattr(parent, leaf)
                with torch.device("meta"):
                    linear = Linear(old.in_features, old.out_features, bias=False)
                linear._parameters["weight"] = nn.Parameter(raw, requires_grad=False)
                linear.weight_qtype = qtype
                setattr(parent, leaf, linear)
                continue
            values = gguf_weights.dequantize(raw, qtype) if gguf_weights.is_block_quantized(qtype) else raw
            state[inner] = values.to(dtype)
    except (OSError, ValueError, RuntimeError) as e:
        if isinstance(e, ModelPackageError):
            raise
        raise ModelPackageError(f"text_encoder: {te.path.name} could not be read ({e}); it may be truncated, "
                                "download it again.") from None
    text.load_state_dict(state, strict=False, assign=True)
    # Built on meta, the rotary tables (buffers, not in any file) are made again from the config.
    text.rotary_emb = Qwen3VLTextRotaryEmbedding(config=config.text_config)
    model.model.visual = MissingVisionTower(te.path)
    # Only the final hidden states are used (the pack's loader sets the same head); nothing to tie.
    model.lm_head = nn.Identity()
    still_meta = [k for k, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if still_meta:
        raise ModelPackageError(f"text_encoder: {te.path.name} left {still_meta[:3]} unset.")
    return model.eval().requires_grad_(False)
