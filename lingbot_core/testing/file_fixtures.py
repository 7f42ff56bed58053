"""The three single files a ComfyUI user has (a DiT, the Qwen3-VL text encoder, the Wan 2.1 VAE), tiny and
random, in the layouts of the real files, so the files-only loader runs on a fresh clone:

- the DiT as a GGUF file (gguf_fixtures), of a config its shapes alone describe (attention head size 128
  as released, so :func:`lingbot_core.model.dit_files.config_from_shapes` infers it; the MoE with 128
  experts);
- the text encoder as one safetensors file under ComfyUI's names (``model.layers.*``, ``visual.*``, no
  ``lm_head``), Qwen3-VL with the real vocabulary (151,936 rows, the released special-token ids) but tiny
  widths: :data:`TINY_TEXT_CONFIG` goes with it, passed explicitly or as the ``<stem>.json`` beside the
  file (the shipped config is the 4B's, which refuses it);
- the VAE as the original Wan 2.1 layout (``decoder.middle.0.residual.0.gamma``: Comfy-Org's
  ``wan_2.1_vae.safetensors``) of the released architecture at base width 4.

CLI: ``python -m lingbot_core.testing.file_fixtures --models DIR [--moe]`` writes them into ComfyUI's
``diffusion_models/``, ``text_encoders/`` and ``vae/`` below DIR.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
from safetensors.torch import save_file

from ..files.vae_layout import to_original_wan21
from . import fixtures

# The released Qwen3-VL token ids (tokenizer_config.json of the shipped processor).
QWEN3VL_VOCAB = 151936  # embedding rows of Qwen3-VL-4B (ids 0-151668 used, padded)
QWEN3VL_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
               "vision_end_token_id": 151653}

# A tiny Qwen3-VL with the real vocabulary: what tests pass as ``text_encoder_config`` with the file.
TINY_TEXT_CONFIG = {
    "text_config": dict(vocab_size=QWEN3VL_VOCAB, hidden_size=fixtures.TEXT_HIDDEN, intermediate_size=2 * fixtures.TEXT_HIDDEN,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=65536,
                        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                         "mrope_interleaved": True},
                        tie_word_embeddings=True),
    "vision_config": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                          spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=fixtures.TEXT_HIDDEN,
                          num_position_embeddings=16, deepstack_visual_indexes=[0]),
    "tie_word_embeddings": True,
    **QWEN3VL_IDS,
}

# DiTs whose shapes describe them (config_from_shapes gives back exactly these): head size 128.
FILES_DENSE_CONFIG = {
    **fixtures.TINY_DENSE_CONFIG, "hidden_size": 128, "num_attention_heads": 1, "intermediate_size": 256,
    "axes_dims": [32, 48, 48],
}
FILES_MOE_CONFIG = {
    **FILES_DENSE_CONFIG, "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "score_func": "sigmoid", "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "axes_lens": [4096, 512, 512],
}

# The names the GGUF example workflow uses for the text encoder and VAE (Comfy-Org's files).
TEXT_ENCODER_NAME = "qwen3vl_4b_bf16.safetensors"
VAE_NAME = "wan_2.1_vae.safetensors"


def files_dit_config(moe: bool = False) -> dict:
    return dict(FILES_MOE_CONFIG if moe else FILES_DENSE_CONFIG)


def tiny_text_encoder(seed: int = 0, dtype: torch.dtype = torch.float32):
    """Qwen3-VL of :data:`TINY_TEXT_CONFIG` (the real vocabulary), every weight drawn from ``seed``."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(**TINY_TEXT_CONFIG)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(cfg).eval()
    fixtures._fill_(model, torch.Generator().manual_seed(seed))
    return model.to(dtype)


def comfy_text_encoder_state(model) -> Dict[str, torch.Tensor]:
    """A Qwen3-VL state dict under ComfyUI's names (``model.layers.*``, ``visual.*``), ``lm_head`` left
    out (tied), as Comfy-Org's ``qwen3vl_4b_*.safetensors``."""
    out = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model."):]
        elif k.startswith("model.visual."):
            k = k[len("model."):]
        out[k] = v.detach().contiguous()
    return out


def write_text_encoder_file(path, seed: int = 0, dtype: torch.dtype = torch.float32, sidecar: bool = False) -> Path:
    """The tiny text encoder as one file; ``sidecar`` also writes its config beside it (``<stem>.json``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(comfy_text_encoder_state(tiny_text_encoder(seed, dtype)), str(path), metadata={"format": "pt"})
    if sidecar:
        path.with_suffix(".json").write_text(json.dumps(TINY_TEXT_CONFIG, indent=2) + "\n", encoding="utf-8")
    return path


def write_text_encoder_gguf_file(path, seed: int = 0, qtype: str = "Q8_0", sidecar: bool = True) -> Dict[str, torch.Tensor]:
    """The tiny text encoder's text model as llama.cpp's GGUF (``qtype``), with its config beside it
    (``<stem>.json``) unless ``sidecar`` is off; returns the fp32 values it holds (HF names)."""
    from .gguf_fixtures import write_text_encoder_gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    held = write_text_encoder_gguf(path, tiny_text_encoder(seed), qtype, seed=seed)
    if sidecar:
        path.with_suffix(".json").write_text(json.dumps(TINY_TEXT_CONFIG, indent=2) + "\n", encoding="utf-8")
    return held


def write_wan21_vae_file(path, seed: int = 0) -> Path:
    """The released Wan 2.1 VAE architecture at base width 4 (:func:`fixtures.tiny_wan21_vae`) under the
    original Wan names, as Comfy-Org's ``wan_2.1_vae.safetensors`` (fp32, about 1 MB)."""
    vae = fixtures.tiny_wan21_vae(seed)
    state = to_original_wan21({k: v.contiguous() for k, v in vae.state_dict().items()}, dict(vae.config))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={"format": "pt"})
    return path


def write_dit_gguf(path, moe: bool = False, seed: int = 0, qtype: str = "Q8_0") -> Dict[str, torch.Tensor]:
    """A GGUF DiT of :func:`files_dit_config` (realrebelai's layout); returns the fp32 values it holds."""
    from .gguf_fixtures import write_gguf_dit

    state, _ = fixtures.dit_state_dict(files_dit_config(moe), seed, fp32=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf_dit(path, state, qtype, layout="rebel")


def write_comfy_files(models_dir, moe: bool = True, seed: int = 0, dit_name: Optional[str] = None) -> Dict[str, Path]:
    """The three files in ComfyUI's ``models/`` folders (``diffusion_models/``, ``text_encoders/``, ``vae/``),
    the text encoder (with its tiny config beside it) and VAE under the names of Comfy-Org's files (what the
    GGUF example workflow names)."""
    models = Path(models_dir)
    dit = models / "diffusion_models" / (dit_name or f"lingbot-tiny-files-{'moe' if moe else 'dense'}-Q8_0.gguf")
    write_dit_gguf(dit, moe, seed)
    te = write_text_encoder_file(models / "text_encoders" / TEXT_ENCODER_NAME, seed, sidecar=True)
    vae = write_wan21_vae_file(models / "vae" / VAE_NAME, seed)
    return {"transformer": dit, "text_encoder": te, "vae": vae}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Path]:
    p = argparse.ArgumentParser(prog="python -m lingbot_core.testing.file_fixtures", description=__doc__.splitlines()[0])
    p.add_argument("--models", required=True, help="a ComfyUI models/ folder")
    p.add_argument("--moe", action="store_true", help="an MoE DiT (128 experts) instead of dense")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = write_comfy_files(a.models, a.moe, a.seed)
    for path in out.values():
        print(path)
    return out


if __name__ == "__main__":
    main()
