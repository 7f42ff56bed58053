"""Single-file DiTs: the GGUF and safetensors files ComfyUI users download, recognised and loaded.

What a file may look like (docs/file-formats.md, "GGUF DiTs" and "DiT single files"):

- official checkpoint names, optionally under ``model.diffusion_model.`` (or ``diffusion_model.``);
- routed experts either stacked (one 3-D ``blocks.N.ffn.experts.w1``, optionally with ``.weight``:
  stable-diffusion.cpp) or one 2-D tensor per expert (``blocks.N.ffn.experts.w1.<e>.weight``:
  realrebelai's MoE GGUFs); per-expert tensors are matched by their index, never by file order;
- GGUF: any of the block types of :mod:`lingbot_core.files.gguf_weights` or F32/F16/BF16, metadata optional
  (sd.cpp writes none), so the file is recognised by its tensors (``patch_embedder.weight``) and the DiT
  config is inferred from tensor shapes (:func:`config_from_shapes`) unless a package config is given;
- safetensors: fp8 weights with an fp32 ``<key>_scale`` (ALX-CODE) or ComfyUI's ``scale_weight``.

GGUF loading keeps the file mapped: the Linear weights and expert stacks stay as their block bytes
(views of the map; per-expert tensors lying at even strides become one strided view, without a copy) and
are dequantized by the layer when it runs; every other quantized tensor (norms, ``scale_shift_table``,
router, time MLPs: the fp32 islands) is dequantized once here, to fp32.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Dict, Optional

import torch
from torch import nn

from ..files import gguf_weights
from ..files.checkpoint_files import GGUFFile, ModelPackageError, SafetensorsReader, read_config
from ..files.fp8 import FP8_COMPUTE_DTYPE, checkpoint_scale, dequantize, is_fp8, is_quantized_name, quantize, scale_shape
from .transformer import Experts, Linear, LingBotVideoTransformer3DModel, is_fp32_island

logger = logging.getLogger("lingbot_core")

DIT_SUFFIXES = (".gguf", ".safetensors", ".sft")
NAME_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_PER_EXPERT = re.compile(r"^(blocks\.\d+\.ffn\.experts\.w[123])\.(\d+)\.weight$")
_STACKED = re.compile(r"^(blocks\.\d+\.ffn\.experts\.w[123])\.weight$")
_BLOCK = re.compile(r"^blocks\.(\d+)\.")

# The released configs' fields that tensor shapes cannot show (lingbot-video-model.md, section 2).
_AXES_DIMS_BY_HEAD_DIM = {128: [32, 48, 48]}
_MOE_ROUTING = {  # by number of routed experts
    128: {"num_experts_per_tok": 8, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
          "score_func": "sigmoid", "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
          "axes_lens": [4096, 512, 512]},
}

# What a file of another model looks like: (a key it has, what it is).
_FOREIGN = (
    ("patch_embedding.weight", "a Wan 2.1/2.2 DiT"),
    ("blocks.0.self_attn.q.weight", "a Wan 2.1/2.2 DiT"),
    ("double_blocks.0.img_attn.qkv.weight", "a Flux or HunyuanVideo DiT"),
    ("transformer_blocks.0.attn.to_q.weight", "a diffusers-format DiT of another model (Flux, Qwen-Image, LTX...)"),
    ("input_blocks.0.0.weight", "a Stable Diffusion UNet"),
    ("token_embd.weight", "a language model (llama.cpp GGUF)"),
    ("model.language_model.layers.0.self_attn.q_proj.weight", "a Qwen3-VL text encoder (it goes in models/text_encoders)"),
    ("decoder.middle.0.residual.0.gamma", "a Wan VAE (it goes in models/vae)"),
)


def describe_foreign(keys) -> str:
    keys = set(keys)
    for key, what in _FOREIGN:
        if key in keys or any(k.endswith("." + key) for k in keys):
            return f"; it looks like {what}"
    return ""


class DitFile:
    """A DiT single file (GGUF or safetensors) under official names with stacked experts.

    ``shapes`` holds each tensor's checkpoint shape (quantized ones: the values' shape), ``qtypes`` the
    GGML type of GGUF tensors. :meth:`get` returns the mapped tensor (block bytes for a quantized one).
    """

    def __init__(self, path, component: str = "transformer"):
        self.path = Path(path)
        self.component = component
        if not self.path.is_file():
            raise ModelPackageError(f"{component}: file {self.path} does not exist.")
        self.is_gguf = self.path.suffix.lower() == ".gguf"
        if not self.is_gguf and self.path.suffix.lower() not in DIT_SUFFIXES:
            raise ModelPackageError(f"{component}: {self.path.name} is neither a .gguf nor a .safetensors file; "
                                    "other formats (.ckpt, .pt, .bin) are refused because loading them can run code.")
        self.reader = GGUFFile(self.path, component) if self.is_gguf else SafetensorsReader(self.path)
        raw_keys = self.reader.keys()
        prefix = next((p for p in NAME_PREFIXES if f"{p}patch_embedder.weight" in raw_keys), "")
        self.prefix = prefix
        self._source: Dict[str, str] = {}  # official name -> key in the file (2-D/3-D stacked or plain)
        self._experts: Dict[str, Dict[int, str]] = {}  # stacked name -> {expert index: file key}
        self.scales: Dict[str, str] = {}  # weight name -> key of its fp8 scale (safetensors)
        extra = []
        for key in raw_keys:
            name = key[len(prefix):] if prefix and key.startswith(prefix) else key
            m = _PER_EXPERT.match(name)
            if m:
                self._experts.setdefault(m.group(1), {})[int(m.group(2))] = key
                continue
            m = _STACKED.match(name)
            if m and len(self._file_shape(key)) == 3:
                name = m.group(1)
            if not self.is_gguf and name.endswith("_scale") and name != "scale_shift_table":
                self.scales[name[:-len("_scale")]] = key
                continue
            leaf = name.rpartition(".")[2]
            if not self.is_gguf and (leaf in ("scale_weight", "scale_input") or name == "scaled_fp8"):
                extra.append(key)  # ComfyUI's fp8 scale / input scale / format marker: handled below
                continue
            self._source[name] = key
        if "patch_embedder.weight" not in self._source:
            raise ModelPackageError(
                f"{component}: {self.path.name} is not a LingBot-Video DiT (it has no patch_embedder.weight"
                f"{describe_foreign(raw_keys)}). Expected a LingBot-Video dense 1.3B or MoE 30B-A3B file "
                "(official names, optionally prefixed model.diffusion_model.).")
        for key in extra:
            name = key[len(prefix):] if prefix and key.startswith(prefix) else key
            owner, _, leaf = name.rpartition(".")
            if leaf == "scale_weight":
                self.scales[f"{owner}.weight"] = key
        self.qtypes: Dict[str, object] = {}
        self.shapes: Dict[str, tuple] = {}
        for name, key in self._source.items():
            self.shapes[name] = self._logical_shape(key)
            if self.is_gguf:
                self.qtypes[name] = self._checked_qtype(key)
        for name, by_index in self._experts.items():
            if sorted(by_index) != list(range(len(by_index))):
                raise ModelPackageError(f"{component}: {self.path.name} has experts {sorted(by_index)[:5]}... for {name}; "
                                        "expected indices 0..N-1 (the file is incomplete).")
            keys = [by_index[e] for e in range(len(by_index))]
            first = self._logical_shape(keys[0])
            types = {self._checked_qtype(k) for k in keys} if self.is_gguf else {None}
            if any(self._logical_shape(k) != first for k in keys) or len(types) != 1:
                raise ModelPackageError(f"{component}: the experts of {name} in {self.path.name} differ in shape or type.")
            self.shapes[name] = (len(keys), *first)
            if self.is_gguf:
                self.qtypes[name] = types.pop()

    # -- reading --------------------------------------------------------------------------------

    def _file_shape(self, key: str) -> tuple:
        return tuple(self.reader.shape(key))

    def _logical_shape(self, key: str) -> tuple:
        return self._file_shape(key)  # GGUFFile and SafetensorsReader both report the values' shape

    def _checked_qtype(self, key: str):
        qtype = self.reader.qtype(key)
        if not gguf_weights.is_supported(qtype):
            supported = ", ".join(gguf_weights.QUANTIZED_TYPE_NAMES + gguf_weights.PLAIN_TYPE_NAMES)
            raise ModelPackageError(f"{self.component}: tensor {key!r} of {self.path.name} is stored as {qtype.name}, "
                                    f"which this pack cannot dequantize; use a file quantized to one of {supported}.")
        return qtype

    def is_block_quantized(self, name: str) -> bool:
        return self.is_gguf and gguf_weights.is_block_quantized(self.qtypes[name])

    def get(self, name: str) -> torch.Tensor:
        """The mapped tensor ``name`` (official name): values for float types, block bytes for quantized
        GGUF types (experts: ``(experts, rows, row_bytes)``)."""
        if name not in self._experts:
            return self.reader.get(self._source[name])
        keys = [self._experts[name][e] for e in range(len(self._experts[name]))]
        return self._stack(keys)

    def _stack(self, keys) -> torch.Tensor:
        """Per-expert tensors as one stack: a strided view of the map when they lie at one stride in
        expert order (how writers lay them out), else a copy of their bytes (logged)."""
        parts = [self.reader.get(k) for k in keys]
        if self.is_gguf and len(keys) > 1:
            offsets = [self.reader.offset(k) for k in keys]
            stride = offsets[1] - offsets[0]
            one = parts[0]
            if stride >= one.numel() and all(b - a == stride for a, b in zip(offsets, offsets[1:])) and one.is_contiguous():
                inner = list(one.stride())
                return self.reader.mapped().as_strided((len(keys), *one.shape), (stride, *inner), offsets[0])
        logger.info("%s: the experts of %s are not evenly laid out; stacking copies them into RAM.",
                    self.path.name, keys[0])
        return torch.stack(parts)

    def mapped_bytes(self) -> int:
        return self.path.stat().st_size

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``name`` as values in ``dtype`` (dequantized, fp8-descaled): what a plain load holds; LoRA
        restores merged weights from it."""
        t = self.get(name)
        if self.is_gguf:
            return gguf_weights.dequantize(t, self.qtypes[name], dtype) if self.is_block_quantized(name) else t.to(dtype)
        scale = self.scales.get(name)
        if scale is not None or is_fp8(t.dtype):
            s = None if scale is None else checkpoint_scale(name, self.reader.get(scale), self.shapes[name])
            return dequantize(t, s, dtype)
        return t.to(dtype)


# ----------------------------------------------------------------------------------------------
# Config from shapes
# ----------------------------------------------------------------------------------------------


def config_from_shapes(shapes: Dict[str, tuple], source: str = "the file") -> dict:
    """The DiT config a file's tensor shapes imply (dense 1.3B, MoE 30B-A3B and its refiner share the
    released fields of lingbot-video-model.md section 2; what shapes cannot show comes from there)."""
    try:
        hidden, patch_dim = shapes["patch_embedder.weight"]
        head_dim = shapes["blocks.0.attn.norm_q.weight"][0]
        depth = 1 + max(int(m.group(1)) for m in map(_BLOCK.match, shapes) if m)
        cfg = {
            "patch_size": [1, 2, 2], "in_channels": patch_dim // 4, "out_channels": shapes["proj_out.weight"][0] // 4,
            "hidden_size": hidden, "num_attention_heads": hidden // head_dim, "depth": depth,
            "text_dim": shapes["text_embedder.linear_1.weight"][1], "freq_dim": shapes["time_embedder.linear_1.weight"][1],
            "norm_eps": 1e-6, "rope_theta": 256.0, "axes_lens": [8192, 1024, 1024],
            "qkv_bias": "blocks.0.attn.to_q.bias" in shapes, "out_bias": "blocks.0.attn.to_out.bias" in shapes,
            "patch_embed_bias": "patch_embedder.bias" in shapes, "timestep_mlp_bias": "time_embedder.linear_1.bias" in shapes,
        }
    except (KeyError, ValueError, IndexError) as e:
        raise ModelPackageError(f"transformer: the tensors of {source} do not describe a LingBot-Video DiT (missing {e}).") from None
    axes = _AXES_DIMS_BY_HEAD_DIM.get(head_dim)
    if axes is None:
        raise ModelPackageError(f"transformer: {source} has attention head size {head_dim}, unlike the released "
                                "LingBot-Video models (128); give the package folder whose transformer/config.json describes it.")
    cfg["axes_dims"] = axes
    if "blocks.0.ffn.router.weight" in shapes:
        experts = shapes["blocks.0.ffn.router.weight"][0]
        routing = _MOE_ROUTING.get(experts)
        if routing is None:
            raise ModelPackageError(f"transformer: {source} is an MoE with {experts} experts, unlike the released "
                                    "MoE 30B-A3B (128); give the package folder whose transformer/config.json describes it.")
        moe_hidden = shapes["blocks.0.ffn.experts.w1"][1]
        shared = shapes.get("blocks.0.ffn.shared_experts.gate_proj.weight")
        cfg.update(routing, num_experts=experts, moe_intermediate_size=moe_hidden,
                   n_shared_experts=(shared[0] // moe_hidden) if shared else None, intermediate_size=6144)
    else:
        cfg.update(num_experts=0, intermediate_size=shapes["blocks.0.ffn.gate_proj.weight"][0])
    return cfg


def transformer_config(root: Optional[Path], transformer_subfolder: str = "transformer",
                       transformer_file=None, dit=None) -> dict:
    """The DiT config: the package's own ``config.json`` when there is one (it wins), else the one the
    single file's tensor shapes imply."""
    own = None if root is None else Path(root) / transformer_subfolder
    if transformer_file is None or (own is not None and (own / "config.json").is_file()):
        return read_config(own, transformer_subfolder)
    dit = dit or DitFile(transformer_file, transformer_subfolder)
    return config_from_shapes(dit.shapes, dit.path.name)


def model_kind(config: dict) -> str:
    if config.get("num_experts"):
        return f"MoE ({config['num_experts']} experts, {config['depth']} blocks)"
    return f"dense ({config['depth']} blocks)"


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def meta_model(config: dict, name: str = "transformer", source: str = "the DiT config") -> LingBotVideoTransformer3DModel:
    """The DiT ``config`` describes, built on ``meta`` (no memory); ``source`` names the config in the error."""
    try:
        with torch.device("meta"):
            return LingBotVideoTransformer3DModel.from_config(config)
    except (TypeError, ValueError) as e:
        raise ModelPackageError(f"{name}: {source} describes an invalid model: {e}") from None


def check_dit_file(dit: DitFile, config: Optional[dict] = None, name: str = "transformer") -> LingBotVideoTransformer3DModel:
    """Every name and shape of ``dit`` against ``config`` (default: the shapes' own config), and
    completeness, from the file's header alone; returns the DiT on ``meta``."""
    config = config or config_from_shapes(dit.shapes, dit.path.name)
    model = meta_model(config, name)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for key in dit.shapes:
        if key not in expected:
            raise ModelPackageError(f"{name}: {dit.path.name} has tensor {key!r}, which a LingBot-Video {model_kind(config)} "
                                    f"DiT does not have{describe_foreign(dit.shapes)}.")
        if tuple(dit.shapes[key]) != expected[key]:
            raise ModelPackageError(f"{name}: tensor {key!r} in {dit.path.name} has shape {list(dit.shapes[key])}, but the "
                                    f"{model_kind(config)} config implies {list(expected[key])}.")
    missing = sorted(set(expected) - set(dit.shapes))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelPackageError(f"{name}: {dit.path.name} is missing {len(missing)} tensors of a LingBot-Video "
                                f"{model_kind(config)} DiT: {', '.join(missing[:3])}{more}.")
    return model


def _stays_quantized(dit: DitFile, key: str, owner: nn.Module, leaf: str) -> bool:
    return dit.is_block_quantized(key) and not is_fp32_island(key) and (
        (isinstance(owner, Linear) and leaf == "weight") or isinstance(owner, Experts))


def loaded_bytes(dit: DitFile, dtype: torch.dtype, config: Optional[dict] = None) -> Dict[str, int]:
    """Bytes each tensor of ``dit`` takes once loaded at ``dtype`` (header only): block bytes that stay
    mapped for the quantized Linears and experts, values for the rest (fp32 islands in fp32)."""
    model = check_dit_file(dit, config)
    modules = dict(model.named_modules())
    size = torch.empty(0, dtype=FP8_COMPUTE_DTYPE if is_fp8(dtype) else dtype).element_size()
    out = {}
    for key, shape in dit.shapes.items():
        owner_name, _, leaf = key.rpartition(".")
        n = 1
        for d in shape:
            n *= int(d)
        if _stays_quantized(dit, key, modules[owner_name], leaf):
            out[key] = gguf_weights.raw_nbytes(shape, dit.qtypes[key])
        elif is_fp8(dtype) and is_quantized_name(key):
            out[key] = n
        else:
            out[key] = n * (4 if is_fp32_island(key) else size)
    return out


def load_dit_file(path, dtype: torch.dtype, config: Optional[dict] = None, name: str = "transformer",
                  dit: Optional[DitFile] = None) -> LingBotVideoTransformer3DModel:
    """The DiT of a single file; ``config`` (a package's ``config.json``) wins over the shapes' config.

    GGUF: block-quantized Linear weights and expert stacks stay mapped block bytes (computed in
    ``dtype``; an fp8 ``dtype`` is refused: the file is already quantized); other tensors are
    dequantized once (fp32 islands to fp32, the rest to ``dtype``). Safetensors: as a package's DiT
    (fp8 weights with their scales kept fp8 under an fp8 ``dtype``, else dequantized).
    """
    dit = dit or DitFile(path, name)
    model = check_dit_file(dit, config, name)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fp8 = is_fp8(dtype)
    if fp8 and dit.is_gguf:
        raise ModelPackageError(f"{name}: {dit.path.name} is already quantized (GGUF); choose bf16, fp16 or fp32 as the "
                                "DiT precision (its compute dtype), not an fp8 storage type.")
    plain = FP8_COMPUTE_DTYPE if fp8 else dtype
    modules = dict(model.named_modules())
    state, scales = {}, {}
    try:
        for key in expected:
            owner_name, _, leaf = key.rpartition(".")
            owner = modules[owner_name]
            island = is_fp32_island(key)
            target = torch.float32 if island else plain
            if _stays_quantized(dit, key, owner, leaf):
                raw = dit.get(key)
                owner._parameters[leaf] = nn.Parameter(raw, requires_grad=False)
                if isinstance(owner, Linear):
                    owner.weight_qtype = dit.qtypes[key]
                else:
                    owner.qtypes[leaf] = dit.qtypes[key]
                continue
            tensor = dit.get(key)
            if dit.is_gguf:
                state[key] = (gguf_weights.dequantize(tensor, dit.qtypes[key], target) if dit.is_block_quantized(key)
                              else tensor.to(target))
            elif not tensor.is_floating_point():
                state[key] = tensor
            elif fp8 and is_quantized_name(key):
                if tensor.dtype == dtype:  # already stored as wanted: keep it with its scale (or 1)
                    stored = dit.reader.get(dit.scales[key]) if key in dit.scales else torch.ones(())
                    state[key], scales[key] = tensor.clone(), checkpoint_scale(key, stored, dit.shapes[key])
                else:
                    state[key], scales[key] = quantize(dit.tensor(key, FP8_COMPUTE_DTYPE), dtype, scale_shape(key, dit.shapes[key]))
            else:
                state[key] = dit.tensor(key, target)
    except (OSError, ValueError, RuntimeError) as e:
        if isinstance(e, ModelPackageError):
            raise
        raise ModelPackageError(f"{name}: {dit.path.name} could not be read ({e}); it may be truncated, download it again.") from None
    model.load_state_dict(state, strict=False, assign=True)
    for key, scale in scales.items():
        owner, _, leaf = key.rpartition(".")
        setattr(model.get_submodule(owner), f"scale_{leaf}", scale)
    model.stored_compute_dtype = plain
    still_meta = [k for k, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if still_meta:
        raise ModelPackageError(f"{name}: {dit.path.name} left {still_meta[:3]} unset.")
    return model.eval().requires_grad_(False)


def file_checkpoint_tensor(path, name: str, key: str, dtype: torch.dtype) -> torch.Tensor:
    """One DiT tensor of a single file as a plain load holds it (LoRA restores merged weights from it)."""
    dit = DitFile(path, name)
    if key not in dit.shapes:
        raise ModelPackageError(f"{name}: {key} is no longer in {dit.path.name}; the file changed since it was loaded, reload the pipeline.")
    return dit.tensor(key, dtype)
