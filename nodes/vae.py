"""LoadLingbotVAE: a package's Wan 2.1 VAE as a native ComfyUI VAE (for VAE Decode / VAE Encode)."""

from __future__ import annotations

import comfy.sd

from ..lingbot_core.files.vae_layout import load_original_wan21
from .model_folders import package_choices, resolve_package


class LoadLingbotVAE:
    DESCRIPTION = (
        "Loads the Wan 2.1 VAE of a LingBot-Video package as a ComfyUI VAE, so GenerateVideo's latent can be "
        "decoded with the native VAE Decode (and images encoded with VAE Encode). The package stores the VAE "
        "under diffusers names, which ComfyUI's Load VAE rejects; this node renames the tensors (no copy on disk)."
    )
    CATEGORY = "LingBot-Video"
    FUNCTION = "load"
    RETURN_TYPES = ("VAE",)
    RETURN_NAMES = ("vae",)
    OUTPUT_TOOLTIPS = ("ComfyUI's Wan 2.1 VAE with this package's weights; connect to VAE Decode's vae input.",)

    @classmethod
    def INPUT_TYPES(cls):
        packages = package_choices()
        return {
            "required": {
                "model": (packages, {"tooltip": "A LingBot-Video package (folder with model_index.json) under models/diffusers or models/lingbot_video; its vae/ is used."}),
            }
        }

    def load(self, model):
        state = load_original_wan21(resolve_package(model))
        vae = comfy.sd.VAE(sd=state)
        # ComfyUI loads VAE weights non-strictly and only logs a mismatch; a partial load would decode noise.
        built = getattr(vae, "first_stage_model", None)
        names = set(built.state_dict()) if built is not None else set()
        if getattr(vae, "latent_channels", None) != 16 or names != set(state):
            missing = sorted(names - set(state))[:3]
            unexpected = sorted(set(state) - names)[:3]
            raise RuntimeError(
                f"ComfyUI did not build a Wan 2.1 VAE from {model!r}/vae (built {type(built).__name__}, "
                f"missing {missing}, unexpected {unexpected}). This ComfyUI version may use other names; "
                "decode with the frames output of GenerateVideo instead and report the ComfyUI version."
            )
        return (vae,)
