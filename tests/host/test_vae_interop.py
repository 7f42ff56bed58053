"""The package's diffusers-layout Wan 2.1 VAE made readable by ComfyUI's own VAE (native VAE Decode).

The names and shapes are checked against the modules ComfyUI 0.3.75 itself builds (imported from its
tree in a subprocess), the values through a real ComfyUI decoding GenerateVideo's latent.
"""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from lingbot_core.loading import ModelPackageError
from lingbot_core.files.vae_layout import load_original_wan21, to_original_wan21

from support.comfy_host import comfyui_unavailable_reason, execution_error, find_comfyui_dir

comfy = pytest.mark.comfy

WAN_MODEL = "lingbot-tiny-wan21-vae"
H, W, FRAMES, STEPS = 64, 96, 5, 2
# Largest |native VAE Decode - GenerateVideo frames| allowed, in [0, 1] units (fp32 on CPU). Measured on this
# tiny VAE: at most 7.2e-6 over 3 random latents (same math, other operation order), mean 2e-7.
DECODE_TOL = 3e-5

# Run inside ComfyUI's tree: its Wan 2.1 VAE module, built on the meta device with the ddconfig of the Wan 2.1
# branch of comfy.sd.VAE (the base width is read from the weights), at the released width 96 and the tiny 4.
# That comfy.sd.VAE itself picks this branch for a converted file is shown by the real-host test below.
_COMFY_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import torch, comfy.ldm.wan.vae
out = {}
for dim in (96, 4):
    with torch.device("meta"):
        m = comfy.ldm.wan.vae.WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                     temperal_downsample=[False, True, True], dropout=0.0)
    out[dim] = {k: list(v.shape) for k, v in m.state_dict().items()}
print("PROBE" + json.dumps(out))
"""


def _shapes(state):
    return {k: list(v.shape) for k, v in state.items()}


@pytest.fixture(scope="module")
def wan21_package(packages, tmp_path_factory):
    """The tiny dense package with a VAE of the released Wan 2.1 architecture (width 4): ComfyUI builds
    only that architecture (the shared tiny VAE has dim_mult [1, 1, 1, 1] to stay small)."""
    from lingbot_core.testing.fixtures import tiny_wan21_vae

    root = tmp_path_factory.mktemp("wan21vae") / WAN_MODEL
    shutil.copytree(packages["dense"], root)
    shutil.rmtree(root / "vae")
    tiny_wan21_vae(seed=3).save_pretrained(root / "vae")
    return root


@pytest.fixture(scope="module")
def comfy_probe():
    reason = comfyui_unavailable_reason()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run([sys.executable, "-B", "-c", _COMFY_PROBE, str(find_comfyui_dir())],
                          capture_output=True, text=True, timeout=120)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][len("PROBE"):])


def test_release_size_vae_maps_onto_comfyui_wan21_names_and_shapes(comfy_probe):
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        release = AutoencoderKLWan()  # diffusers' defaults are the released Wan 2.1 VAE (base 96)
    converted = to_original_wan21(release.state_dict(), dict(release.config))
    assert len(converted) == len(release.state_dict()) == 194
    assert _shapes(converted) == comfy_probe["96"]


def test_tiny_test_vae_maps_onto_comfyui_wan21_names_and_shapes(comfy_probe, wan21_package):
    assert _shapes(load_original_wan21(wan21_package)) == comfy_probe["4"]


def test_vae_that_comfyui_cannot_build_is_refused_with_the_reason(packages, tmp_path):
    with pytest.raises(ModelPackageError, match=r"dim_mult=\[1, 1, 1, 1\].*\[1, 2, 4, 4\]"):
        load_original_wan21(packages["dense"])  # the shared tiny VAE is narrower than Wan 2.1
    from lingbot_core.testing.fixtures import tiny_wan21_vae

    vae = tiny_wan21_vae()
    state = dict(vae.state_dict(), **{"decoder.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="decoder.extra.weight"):
        to_original_wan21(state, dict(vae.config))
    with pytest.raises(ValueError, match="is_residual"):
        to_original_wan21(vae.state_dict(), dict(vae.config, is_residual=True))  # Wan 2.2 layout


def test_cli_convert_vae_writes_the_file(wan21_package, tmp_path, capsys):
    from safetensors.torch import load_file

    from lingbot_core.cli import main

    out = tmp_path / "models" / "vae" / "lingbot_wan2.1_vae.safetensors"
    assert main(["convert-vae", "--model_dir", str(wan21_package), "--output", str(out)]) == 0
    written = load_file(str(out))
    expected = load_original_wan21(wan21_package)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    assert main(["convert-vae", "--model_dir", str(wan21_package), "--output", str(tmp_path / "x.ckpt")]) == 2
    assert ".safetensors" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Real host: GenerateVideo's latent -> native VAE Decode
# --------------------------------------------------------------------------------------------

def _abs_difference_over(a, b, tol, prefix):
    """Nodes that save a frame stack that is white exactly where |a - b| > tol in some channel, computed by
    ComfyUI's own nodes (Image Blend 'difference' clamps to [0, 1], so both directions are taken)."""
    def n(name):
        return f"{prefix}_{name}"

    g = {
        n("d1"): {"class_type": "ImageBlend", "inputs": {"image1": a, "image2": b, "blend_factor": 1.0, "blend_mode": "difference"}},
        n("d2"): {"class_type": "ImageBlend", "inputs": {"image1": b, "image2": a, "blend_factor": 1.0, "blend_mode": "difference"}},
        # one of the two is 0 in every element, so screen(d1, d2) = d1 + d2 - d1*d2 = |a - b|
        n("ad"): {"class_type": "ImageBlend", "inputs": {"image1": [n("d1"), 0], "image2": [n("d2"), 0], "blend_factor": 1.0, "blend_mode": "screen"}},
    }
    for c in ("red", "green", "blue"):
        g[n(f"m_{c}")] = {"class_type": "ImageToMask", "inputs": {"image": [n("ad"), 0], "channel": c}}
        g[n(f"t_{c}")] = {"class_type": "ThresholdMask", "inputs": {"mask": [n(f"m_{c}"), 0], "value": tol}}
    g[n("or1")] = {"class_type": "MaskComposite", "inputs": {"destination": [n("t_red"), 0], "source": [n("t_green"), 0], "x": 0, "y": 0, "operation": "add"}}
    g[n("or2")] = {"class_type": "MaskComposite", "inputs": {"destination": [n("or1"), 0], "source": [n("t_blue"), 0], "x": 0, "y": 0, "operation": "add"}}
    g[n("img")] = {"class_type": "MaskToImage", "inputs": {"mask": [n("or2"), 0]}}
    g[n("save")] = {"class_type": "SaveImage", "inputs": {"images": [n("img"), 0], "filename_prefix": prefix}}
    return g


def _frames(server, entry, node_id):
    files = server.output_files({"outputs": {node_id: entry["outputs"][node_id]}})
    assert files, entry.get("outputs")
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in files])


@comfy
def test_native_vae_decode_of_the_latent_equals_the_frames(comfy_server, wan21_package, tmp_path):
    from lingbot_core.cli import main

    server = comfy_server
    server.add_model(WAN_MODEL, wan21_package)
    vae_file = server.models_dir / "vae" / "lingbot_tiny_wan2.1_vae.safetensors"
    assert main(["convert-vae", "--model_dir", str(wan21_package), "--output", str(vae_file)]) == 0
    vae_info = server.object_info("LoadLingbotVAE")
    assert WAN_MODEL in vae_info["input"]["required"]["model"][0] and vae_info["output"] == ["VAE"]
    latent_tip = server.object_info("GenerateVideo")["output_tooltips"][1]
    assert f"'{vae_info['display_name']}'" in latent_tip and "VAE Decode" in latent_tip  # what to connect

    prompt = {
        "1": {"class_type": "LoadLingbotPipeline", "inputs": {
            "model": WAN_MODEL, "transformer": "transformer", "offload": "model", "dit_precision": "auto",
            "text_encoder_precision": "auto", "vae_precision": "fp32"}},
        "2": {"class_type": "GenerateVideo", "inputs": {
            "pipe": ["1", 0], "prompt": "a red kite above green hills", "negative_prompt": "", "width": W, "height": H,
            "num_frames": FRAMES, "steps": STEPS, "guidance_scale": 1.0, "shift": 3.0, "seed": 7}},  # no CFG: faster
        "3": {"class_type": "LoadLingbotVAE", "inputs": {"model": WAN_MODEL}},
        "4": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 1], "vae": ["3", 0]}},
        "5": {"class_type": "VAELoader", "inputs": {"vae_name": vae_file.name}},  # the CLI's file, ComfyUI's loader
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 1], "vae": ["5", 0]}},
        "10": {"class_type": "UnloadLingbotPipeline", "inputs": {"pipe": ["1", 0], "frames": ["2", 0]}},  # leave no pipeline behind
        "7": {"class_type": "SaveImage", "inputs": {"images": ["10", 0], "filename_prefix": "interop_pack"}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": "interop_node"}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "interop_file"}},
    }
    prompt.update(_abs_difference_over(["2", 0], ["4", 0], DECODE_TOL, "tol"))
    entry = server.run(prompt, timeout=300, check=False)
    assert execution_error(entry) is None, execution_error(entry)

    pack, node, file = (_frames(server, entry, n) for n in ("7", "8", "9"))
    assert pack.shape == node.shape == (FRAMES, H, W, 3)
    assert 10 < pack.mean() < 245 and pack.std() > 5, "degenerate frames would make the comparison vacuous"
    np.testing.assert_array_equal(node, file)  # node and converted file are the same VAE
    assert np.abs(pack.astype(int) - node.astype(int)).max() <= 1  # uint8 truncation of a < 1e-5 difference
    over_tol = _frames(server, entry, "tol_save")
    assert over_tol.shape[0] == FRAMES and over_tol.max() == 0, f"{(over_tol > 0).mean():.2%} of pixels differ by more than {DECODE_TOL}"


@comfy
def test_a_vae_comfyui_cannot_build_is_an_error_naming_the_setting(comfy_server):
    prompt = {
        "1": {"class_type": "LoadLingbotVAE", "inputs": {"model": "lingbot-tiny-dense"}},  # dim_mult [1, 1, 1, 1]
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}},
    }
    entry = comfy_server.run(prompt, timeout=120, check=False)
    err = execution_error(entry)
    assert err is not None and err["node_id"] == "1", entry["status"]
    assert "dim_mult=[1, 1, 1, 1]" in err["exception_message"] and "Wan 2.1" in err["exception_message"]


def test_vae_config_without_is_residual_converts_like_wan21(wan21_package, tmp_path):
    # diffusers before the Wan 2.2 VAE wrote no is_residual: such a config is a Wan 2.1 VAE.
    old = tmp_path / "old-diffusers"
    shutil.copytree(wan21_package / "vae", old / "vae")
    config = json.loads((old / "vae" / "config.json").read_text())
    assert config.pop("is_residual") is False
    (old / "vae" / "config.json").write_text(json.dumps(config))
    converted, expected = load_original_wan21(old), load_original_wan21(wan21_package)
    assert len(converted) == len(expected) > 0 and converted.keys() == expected.keys()
    assert all(torch.equal(converted[k], expected[k]) for k in expected)


@comfy
def test_vae_with_missing_tensors_is_an_error_naming_them(comfy_server, wan21_package, tmp_path):
    """A package VAE without its last decoder conv still converts (every tensor present maps), but ComfyUI
    would build that layer with random weights and VAE Decode would give noise: the node refuses it."""
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "lingbot-tiny-wan21-partial"
    shutil.copytree(wan21_package, partial)
    file = partial / "vae" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(file))
    del state["decoder.conv_out.weight"], state["decoder.conv_out.bias"]
    save_file(state, str(file))
    comfy_server.add_model(partial.name, partial)
    prompt = {
        "1": {"class_type": "LoadLingbotVAE", "inputs": {"model": partial.name}},
        "2": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 32, "height": 32, "length": 1, "batch_size": 1}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}},
    }
    entry = comfy_server.run(prompt, timeout=120, check=False)
    err = execution_error(entry)
    assert err is not None, "a VAE missing decoder.head.2 was loaded and decoded"
    assert (err["node_id"], err["node_type"]) == ("1", "LoadLingbotVAE")
    assert "missing ['decoder.head.2.bias', 'decoder.head.2.weight']" in err["exception_message"], err["exception_message"]
