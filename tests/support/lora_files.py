"""LoRA files written by the tests: the LightX2V and kohya namings scaled to the tiny DiTs, packages with the
LoRA merged by hand (the oracle), and a LoRA that overflows fp32."""

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lingbot_core.testing.fixtures import dit_config


RANK = 4


def _factors(gen, out_f, in_f, rank=RANK, amp=0.2):
    down = torch.randn(rank, in_f, generator=gen) * amp
    up = torch.randn(out_f, rank, generator=gen) * amp
    return down, up


def _linear_shapes(moe: bool) -> dict:
    """(out, in) of the DiT Linears a trainer targets, from the tiny config (independent of the model code)."""
    cfg = dit_config(moe)
    h = cfg["hidden_size"]
    ffn = cfg["moe_intermediate_size"] * cfg["n_shared_experts"] if moe else cfg["intermediate_size"]
    ffn_prefix = "ffn.shared_experts" if moe else "ffn"
    shapes = {}
    for b in range(cfg["depth"]):
        for name in ("to_q", "to_k", "to_v", "to_out"):
            shapes[f"blocks.{b}.attn.{name}"] = (h, h)
        shapes[f"blocks.{b}.{ffn_prefix}.gate_proj"] = (ffn, h)
        shapes[f"blocks.{b}.{ffn_prefix}.up_proj"] = (ffn, h)
        shapes[f"blocks.{b}.{ffn_prefix}.down_proj"] = (h, ffn)
    return shapes


def lightx2v_lora(path: Path, seed=0, dtype=torch.float32):
    """The LightX2V four-step file's naming, scaled to the tiny MoE: to_q/k/v as .lora.down/.lora.up,
    to_out and the shared expert as lora_A/lora_B; no prefix, no alpha. Returns (path, {module: (down, up, scale)})."""
    gen = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for module, (out_f, in_f) in _linear_shapes(moe=True).items():
        down, up = _factors(gen, out_f, in_f)
        if module.rsplit(".", 1)[1] in ("to_q", "to_k", "to_v"):
            tensors[f"{module}.lora.down.weight"], tensors[f"{module}.lora.up.weight"] = down.to(dtype), up.to(dtype)
        else:
            tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = down.to(dtype), up.to(dtype)
        deltas[module] = (down.to(dtype).float(), up.to(dtype).float(), 1.0)
    save_file(tensors, str(path))
    return path, deltas


def kohya_lora(path: Path, seed=1, alpha=2.0):
    """ComfyUI/kohya naming on the dense model: ``diffusion_model.`` + lora_down/lora_up + a scalar alpha."""
    gen = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for module, (out_f, in_f) in _linear_shapes(moe=False).items():
        down, up = _factors(gen, out_f, in_f)
        tensors[f"diffusion_model.{module}.lora_down.weight"] = down
        tensors[f"diffusion_model.{module}.lora_up.weight"] = up
        tensors[f"diffusion_model.{module}.alpha"] = torch.tensor(alpha)
        deltas[module] = (down, up, alpha / RANK)
    save_file(tensors, str(path))
    return path, deltas


def merged_package(package: Path, dest: Path, loras, subfolder="transformer") -> Path:
    """A copy of ``package`` whose DiT weights are W + sum of strength * scale * up @ down over ``loras``
    (``[(deltas, strength)]``), merged here in fp32."""
    shutil.copytree(package, dest)
    file = dest / subfolder / "diffusion_pytorch_model.safetensors"
    state = load_file(str(file))
    for module in {m for deltas, _ in loras for m in deltas}:
        w = state[f"{module}.weight"]
        merged = w.float()
        for deltas, strength in loras:
            down, up, scale = deltas[module]
            merged = merged + strength * scale * (up @ down)
        state[f"{module}.weight"] = merged.to(w.dtype)
    save_file(state, str(file))
    return dest


def overflowing_lora(path: Path, module: str, shape, prefix: str = "diffusion_model.") -> Path:
    """A LoRA whose factors are finite (the file passes its checks) but whose ``up`` times a strength
    of 4 is beyond fp32's range: its adapters would be infinite."""
    out_f, in_f = shape
    save_file({f"{prefix}{module}.lora_down.weight": torch.full((RANK, in_f), 0.5),
               f"{prefix}{module}.lora_up.weight": torch.full((out_f, RANK), 3e38),
               f"{prefix}{module}.alpha": torch.tensor(float(RANK))}, str(path))
    return path
