"""The package's Wan 2.1 VAE in the original Wan 2.1 checkpoint layout (what ComfyUI's VAE loaders read).

The package stores the VAE under diffusers' ``AutoencoderKLWan`` names. ComfyUI (and other tools built
on the original Wan 2.1 code) only recognise the original names, whose modules are flat sequences:
``encoder.downsamples.N``, ``decoder.upsamples.N``, ``middle.{0,1,2}``, ``head.{0,2}``, and a residual
block's layers as ``residual.{0,2,3,6}``. The conversion is a pure rename: every tensor keeps its shape
and values, so a latent decodes to the same frames in either layout.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Mapping

import torch

from .checkpoint_files import ModelPackageError, SafetensorsReader, read_config, safetensors_files

# The architecture the original Wan 2.1 loaders build (ComfyUI reads only the base width from the
# weights and assumes the rest), i.e. the released Wan 2.1 VAE at any base width.
ORIGINAL_WAN21_ARCH = {
    "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "is_residual": False,
}

_RESBLOCK = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
             "conv2": "residual.6", "conv_shortcut": "shortcut"}
_TOP = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
_ENDS = {"conv_in": "conv1", "norm_out": "head.0", "conv_out": "head.2"}  # of encoder and decoder
_MID = {"resnets.0": "middle.0", "resnets.1": "middle.2"}  # and attentions.0 -> middle.1
_RES_PART = r"norm1\.gamma|norm2\.gamma|(?:conv1|conv2|conv_shortcut)\.(?:weight|bias)"
_OTHER_PART = r"(?:resample\.1|time_conv|to_qkv|proj)\.(?:weight|bias)|norm\.gamma"


def _res_part(part: str) -> str:
    for old, new in _RESBLOCK.items():
        if part == old or part.startswith(old + "."):
            return new + part[len(old):]
    raise AssertionError(part)  # unreachable: _RES_PART only matches these names


def _block_part(part: str) -> str:
    """A residual block's tensor is renamed; resample and attention tensors keep their names."""
    return _res_part(part) if re.fullmatch(_RES_PART, part) else part


def unsupported_reason(config: Mapping) -> str | None:
    """Why this VAE config cannot be read by an original-layout Wan 2.1 loader, or None when it can."""
    for key, want in ORIGINAL_WAN21_ARCH.items():
        have = config.get(key, False if key == "is_residual" else None)
        if isinstance(have, tuple):
            have = list(have)
        if have != want:
            return (f"vae/config.json has {key}={have!r}, but the Wan 2.1 VAE that ComfyUI builds has {key}={want!r} "
                    "(a Wan 2.2 or other VAE cannot be converted)")
    return None


def original_key(key: str, config: Mapping) -> str:
    """The original Wan 2.1 name of one diffusers ``AutoencoderKLWan`` tensor name.

    ``config`` is the VAE's ``config.json`` (``num_res_blocks`` sets the decoder's flat indices).
    Raises ``KeyError`` for a name that is not part of a Wan 2.1 VAE.
    """
    top, _, rest = key.partition(".")
    if top in _TOP and re.fullmatch(r"(?:weight|bias)", rest):
        return f"{_TOP[top]}.{rest}"
    if top not in ("encoder", "decoder"):
        raise KeyError(key)
    m = re.fullmatch(r"(?P<mod>conv_in|conv_out)\.(?P<leaf>weight|bias)|(?P<norm>norm_out)\.(?P<g>gamma)", rest)
    if m:
        return f"{top}.{_ENDS[m['mod'] or m['norm']]}.{m['leaf'] or m['g']}"
    m = re.fullmatch(rf"mid_block\.(?P<mod>resnets\.[01])\.(?P<part>{_RES_PART})", rest)
    if m:
        return f"{top}.{_MID[m['mod']]}.{_res_part(m['part'])}"
    m = re.fullmatch(r"mid_block\.attentions\.0\.(?P<part>(?:to_qkv|proj)\.(?:weight|bias)|norm\.gamma)", rest)
    if m:
        return f"{top}.middle.1.{m['part']}"
    if top == "encoder":
        # Both layouts hold the encoder's residual blocks and resamplers in one flat list, same order.
        m = re.fullmatch(rf"down_blocks\.(?P<i>\d+)\.(?P<part>{_RES_PART}|{_OTHER_PART})", rest)
        if m:
            return f"encoder.downsamples.{m['i']}.{_block_part(m['part'])}"
        raise KeyError(key)
    # Decoder: diffusers nests (num_res_blocks + 1) residual blocks and one upsampler per up block; the
    # original flattens them, so up block i starts at i * (num_res_blocks + 2).
    per_block = int(config["num_res_blocks"]) + 2
    m = re.fullmatch(rf"up_blocks\.(?P<i>\d+)\.resnets\.(?P<r>\d+)\.(?P<part>{_RES_PART})", rest)
    if m and int(m["r"]) < per_block - 1:
        return f"decoder.upsamples.{int(m['i']) * per_block + int(m['r'])}.{_res_part(m['part'])}"
    m = re.fullmatch(r"up_blocks\.(?P<i>\d+)\.upsamplers\.0\.(?P<part>(?:resample\.1|time_conv)\.(?:weight|bias))", rest)
    if m:
        return f"decoder.upsamples.{int(m['i']) * per_block + per_block - 1}.{m['part']}"
    raise KeyError(key)


def to_original_wan21(state_dict: Mapping[str, torch.Tensor], config: Mapping) -> Dict[str, torch.Tensor]:
    """Rename a diffusers ``AutoencoderKLWan`` state dict to the original Wan 2.1 layout (same tensors).

    Every tensor must map to a distinct name; anything else raises ``ValueError`` naming the tensor.
    """
    reason = unsupported_reason(config)
    if reason:
        raise ValueError(reason + ".")
    out: Dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        try:
            new = original_key(key, config)
        except KeyError:
            raise ValueError(f"VAE tensor {key!r} is not part of a diffusers Wan 2.1 VAE; the file cannot be converted.") from None
        if new in out:
            raise ValueError(f"VAE tensors map twice to {new!r} (second: {key!r}).")
        out[new] = tensor
    return out


def load_original_wan21(package_dir) -> Dict[str, torch.Tensor]:
    """Read a package's ``vae/`` (safetensors only) and return it in the original Wan 2.1 layout."""
    from safetensors import SafetensorError

    folder = Path(package_dir) / "vae"
    config = read_config(folder, "vae")
    reason = unsupported_reason(config)
    if reason:
        raise ModelPackageError(f"vae: {reason}.")
    state: Dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder, "vae", "diffusion_pytorch_model"):
        try:  # the reader checks the header's layout (offsets, sizes) before any tensor is read
            reader = SafetensorsReader(path)
            state.update({key: reader.get(key).clone() for key in reader.keys()})
        except (SafetensorError, OSError) as e:
            raise ModelPackageError(f"vae: {path.name} is not a readable safetensors file ({e}); download it again.") from None
    try:
        return to_original_wan21(state, config)
    except ValueError as e:
        raise ModelPackageError(f"vae: {e}") from None


def write_original_wan21(package_dir, out_file) -> Path:
    """Write the package's VAE in the original Wan 2.1 layout to ``out_file`` (a .safetensors file)."""
    from safetensors.torch import save_file

    out = Path(out_file)
    if out.suffix != ".safetensors":
        raise ValueError(f"output {out} must end in .safetensors.")
    state = {k: v.contiguous() for k, v in load_original_wan21(package_dir).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata={"format": "pt"})
    return out
