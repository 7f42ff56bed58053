"""The Qwen3-VL text encoder as llama.cpp's text-model GGUF (issue 41): the prompt embeddings of the F32
file equal the safetensors file's; quantized files give those of the same model holding gguf-py's
dequantized values, with their Linear weights and token embedding kept as memory-mapped block bytes;
an mmproj file beside it serves image prompts (TI2V); files of another model, incomplete files and image
prompts without a usable mmproj are refused naming the file and what to do."""

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from lingbot_core.files.checkpoint_files import ModelPackageError
from lingbot_core.model.component_files import load_text_encoder_file
from lingbot_core.prompts.text_conditioning import encode_text, template_crop_start
from lingbot_core.testing import file_fixtures as ff
from lingbot_core.testing.gguf_fixtures import write_mmproj_gguf, write_text_encoder_gguf
from support.alike_layout import align_module

PROMPTS = ("a cat on a sofa, 一只猫 🐱", "rain over a harbour at night")
# Widths whose rows are whole 256-value K-quant blocks (hidden 256, attention 4 x 64, MLP 512); a small
# vocabulary (the prompt given as token ids) keeps it cheap, so its embedding can be Q4_K too.
WIDE_TEXT_CONFIG = {
    **ff.TINY_TEXT_CONFIG,
    "text_config": {**ff.TINY_TEXT_CONFIG["text_config"], "vocab_size": 512, "hidden_size": 256,
                    "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 64,
                    "rope_parameters": {**ff.TINY_TEXT_CONFIG["text_config"]["rope_parameters"],
                                        "mrope_section": [16, 8, 8]}},
    "vision_config": {**ff.TINY_TEXT_CONFIG["vision_config"], "out_hidden_size": 256},
}
# The deepstack merger fed by vision layer 1 (not 0): llama.cpp names it by that layer, not by list position.
VISION_TEXT_CONFIG = {**ff.TINY_TEXT_CONFIG,
                      "vision_config": {**ff.TINY_TEXT_CONFIG["vision_config"], "deepstack_visual_indexes": [1]}}
WIDE_IDS = torch.tensor([[3, 500, 17, 17, 255, 0, 511, 42, 128, 7]])


def _config(raw):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(**raw)


def _model(raw, seed):
    from lingbot_core.testing.fixtures import text_encoder_from_config

    return text_encoder_from_config(_config(raw), seed)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from lingbot_core import load_processor

    processor = load_processor(None)
    root, tiny = tmp_path_factory.mktemp("te_gguf"), ff.tiny_text_encoder(5)
    from safetensors.torch import save_file

    st = root / "qwen3vl_tiny.safetensors"  # what write_text_encoder_file writes, from the model already built
    save_file(ff.comfy_text_encoder_state(tiny), str(st), metadata={"format": "pt"})
    q8 = root / "Qwen3-VL-tiny-Q8_0.gguf"  # shared by the tests that need any quantized file
    held = write_text_encoder_gguf(q8, tiny, "Q8_0", seed=4)
    return {"root": root, "processor": processor, "crop": template_crop_start(processor), "tiny": tiny,
            "q8": q8, "q8_held": held, "safetensors": st}


def _embeds(setup, model, image=None):
    return [encode_text(model, setup["processor"], p, image, torch.device("cpu"), setup["crop"]) for p in PROMPTS]


def _oracle(model, held, raw, path=None, dtype=torch.float32, copy=True):
    """``model`` holding the values the GGUF holds (gguf-py's dequantization); at another dtype than fp32
    through its safetensors file at ``path``, loaded by the pack's safetensors path (a module cast after
    loading would round its rotary tables too, which a bf16 load keeps in fp32)."""
    from copy import deepcopy

    from safetensors.torch import save_file

    values = deepcopy(model) if copy else model
    missing, unexpected = values.load_state_dict(held, strict=False)
    family = "model.visual." if next(iter(held)).startswith("model.visual.") else "model.language_model."
    assert not unexpected and all(not k.startswith(family) for k in missing)  # the file holds all of its part
    if path is not None:
        save_file(ff.comfy_text_encoder_state(values), str(path))
        values = load_text_encoder_file(path, dtype, config=raw)
    values.lm_head = torch.nn.Identity()  # as load_pipeline sets it: the final hidden states
    return values.eval()


def _in_map(t: torch.Tensor, path) -> bool:
    """The tensor's bytes are a view of the file's memory map (not a copy)."""
    with open("/proc/self/maps") as f:
        for line in f:
            if str(path) in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= t.data_ptr() < hi:
                    return True
    return False


def test_the_f32_gguf_gives_the_safetensors_files_prompt_embeddings(setup):
    root, tiny = setup["root"], setup["tiny"]
    st = setup["safetensors"]
    path = root / "Qwen3-VL-tiny-F32.gguf"
    write_text_encoder_gguf(path, tiny, "F32")
    reference = load_text_encoder_file(st, torch.float32, config=ff.TINY_TEXT_CONFIG)
    reference.lm_head = torch.nn.Identity()  # as load_pipeline sets it: the final hidden states
    te = load_text_encoder_file(path, torch.float32, config=ff.TINY_TEXT_CONFIG)
    q = te.model.language_model.layers[1].self_attn.q_proj.weight
    assert q.dtype == torch.float32 and _in_map(q, path)  # F32 weights used straight from the map
    # Two loads at their files' offsets (safetensors 8-byte, GGUF 32-byte aligned) may round differently on
    # another CPU: compared on alike (64-byte aligned) layouts, as every two-load test is.
    align_module(reference), align_module(te)
    want, got = _embeds(setup, reference), _embeds(setup, te)
    for w, g in zip(want, got):
        assert w.shape == g.shape and w.shape[1] > 5 and w.abs().max() > 0.1
        assert torch.equal(g, w)  # no q/k permutation to undo: llama.cpp writes qwen3vl's q/k as HF has them


@pytest.mark.parametrize("qtype,raw,embed", [("Q8_0", ff.TINY_TEXT_CONFIG, "Q8_0"), ("Q4_K", WIDE_TEXT_CONFIG, "Q4_K"),
                                             ("Q5_0", ff.TINY_TEXT_CONFIG, "F16")])
def test_quantized_gguf_gives_the_embeddings_of_its_dequantized_values(setup, qtype, raw, embed):
    shared = raw is ff.TINY_TEXT_CONFIG
    model = setup["tiny"] if shared else _model(raw, 6)
    if qtype == "Q8_0":
        path, held = setup["q8"], setup["q8_held"]
    else:
        path = setup["root"] / f"Qwen3-VL-tiny-{qtype}-{embed}.gguf"
        held = write_text_encoder_gguf(path, model, qtype, seed=3, embed=embed)
    encode = (lambda m: _embeds(setup, m)) if shared else (
        lambda m: [m(input_ids=WIDE_IDS, attention_mask=torch.ones_like(WIDE_IDS), use_cache=False).logits])
    want = encode(_oracle(model, held, raw, copy=shared))
    te = load_text_encoder_file(path, torch.float32, config=raw)
    got = encode(te)
    for w, g in zip(want, got):
        assert w.shape == g.shape and torch.isfinite(w).all() and w.abs().max() > 0.1
        assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item(), (g - w).abs().max().item()
    layer = te.model.language_model.layers[0]
    reader = gguf.GGUFReader(str(path))
    blocks = {t.name: t for t in reader.tensors}
    checked = [(layer.self_attn.q_proj, "blk.0.attn_q.weight"), (layer.mlp.down_proj, "blk.0.ffn_down.weight")]
    if embed != "F16":
        checked.append((te.model.language_model.embed_tokens, "token_embd.weight"))
    else:  # F16 values, dequantized once (to the compute dtype) as the norms
        embed_values = te.model.language_model.embed_tokens.weight
        assert embed_values.dtype == torch.float32 and torch.equal(embed_values, held["model.language_model.embed_tokens.weight"])
    for module, key in checked:
        w = module.weight
        assert w.dtype == torch.uint8 and module.weight_qtype.name == (embed if key.startswith("token") else qtype)
        assert _in_map(w, path), key  # the block bytes stay memory-mapped
        from lingbot_core.files.gguf_weights import dequantize

        numpy_values = gguf.quants.dequantize(blocks[key].data, blocks[key].tensor_type)
        assert torch.equal(dequantize(w, module.weight_qtype), torch.from_numpy(numpy_values.reshape(w.shape[0], -1)))
    norm = te.model.language_model.layers[0].input_layernorm.weight
    assert norm.dtype == torch.float32 and torch.equal(norm, held["model.language_model.layers.0.input_layernorm.weight"])


def test_bf16_gguf_computes_in_bf16_like_its_values_loaded_in_bf16(setup):
    path, held = setup["q8"], setup["q8_held"]
    oracle = _oracle(setup["tiny"], held, ff.TINY_TEXT_CONFIG, setup["root"] / "oracle-bf16.safetensors", torch.bfloat16)
    te = load_text_encoder_file(path, torch.bfloat16, config=ff.TINY_TEXT_CONFIG)
    align_module(oracle), align_module(te)  # two loads: compared on alike layouts (the oracle is file-mapped)
    want, got = _embeds(setup, oracle), _embeds(setup, te)
    for w, g in zip(want, got):
        assert g.dtype == torch.bfloat16 and w.shape == g.shape
        assert torch.equal(g, w)  # the dequantized weight rounded to bf16 once, as the bf16 safetensors load holds it


def test_other_models_incomplete_files_and_mmproj_are_refused_by_name(setup):
    root, tiny = setup["root"], setup["tiny"]
    llama = root / "Llama-3.2-1B-Q8_0.gguf"
    write_text_encoder_gguf(llama, tiny, "F32", arch="llama")
    with pytest.raises(ModelPackageError, match=r"Llama-3.2-1B-Q8_0.gguf is a GGUF of architecture 'llama'.*'qwen3vl'"):
        load_text_encoder_file(llama, torch.float32, config=ff.TINY_TEXT_CONFIG)
    tiny_file = setup["q8"]
    # the shipped Qwen3-VL-4B config (no <stem>.json beside the file) refuses a model of another width
    with pytest.raises(ModelPackageError, match=r"tensor 'token_embd.weight' of Qwen3-VL-tiny-Q8_0.gguf has shape "
                                                r"\[151936, 64\].*\[151936, 2560\].*Qwen3-VL-4B"):
        load_text_encoder_file(tiny_file, torch.float32)
    cut = root / "Qwen3-VL-tiny-cut.gguf"
    write_text_encoder_gguf(cut, tiny, "F32", drop=("model.language_model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ModelPackageError, match=r"Qwen3-VL-tiny-cut.gguf is missing 1 tensors.*blk.1.ffn_up.weight"):
        load_text_encoder_file(cut, torch.float32, config=ff.TINY_TEXT_CONFIG)
    mmproj = root / "mmproj-Qwen3-VL-4B-Instruct-F16.gguf"
    mmproj.write_bytes(tiny_file.read_bytes())
    with pytest.raises(ModelPackageError, match=r"mmproj-Qwen3-VL-4B-Instruct-F16.gguf is llama.cpp's vision projector"):
        load_text_encoder_file(mmproj, torch.float32, config=ff.TINY_TEXT_CONFIG)


def _image():
    from PIL import Image

    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))


def test_an_image_prompt_without_a_usable_mmproj_names_the_file_to_add(setup):
    alone = setup["root"] / "alone"
    alone.mkdir()
    (alone / setup["q8"].name).symlink_to(setup["q8"])
    # the <stem>.json beside the file wins over the shipped 4B config (no config passed)
    (alone / setup["q8"].name).with_suffix(".json").write_text(json.dumps(ff.TINY_TEXT_CONFIG), encoding="utf-8")
    te = load_text_encoder_file(alone / setup["q8"].name, torch.float32)
    assert te.config.text_config.hidden_size == 64
    with pytest.raises(ModelPackageError, match=r"Qwen3-VL-tiny-Q8_0.gguf holds Qwen3-VL's text model only.*"
                                                r"mmproj-Qwen3-VL-4B-Instruct-F16.gguf.*same folder"):
        encode_text(te, setup["processor"], "a cat", _image(), torch.device("cpu"), setup["crop"])
    # an mmproj of another model beside it is passed over, and the message says why
    write_text_encoder_gguf(alone / "mmproj-other.gguf", setup["tiny"], "F32", arch="clip")
    te = load_text_encoder_file(alone / setup["q8"].name, torch.float32, config=ff.TINY_TEXT_CONFIG)
    with pytest.raises(ModelPackageError, match=r"mmproj-other.gguf is not Qwen3-VL's vision projector"):
        encode_text(te, setup["processor"], "a cat", _image(), torch.device("cpu"), setup["crop"])


@pytest.fixture(scope="module")
def vision(setup):
    """A tiny Qwen3-VL of VISION_TEXT_CONFIG and its F32 text GGUF, for the three mmproj types."""
    model = _model(VISION_TEXT_CONFIG, 7)
    text = setup["root"] / "Qwen3-VL-tiny-vision-F32.gguf"
    write_text_encoder_gguf(text, model, "F32")
    return model, text


@pytest.mark.parametrize("vision_type", ["F32", "F16", "Q8_0"])
def test_an_mmproj_beside_the_text_gguf_serves_image_prompts(setup, vision, vision_type):
    """TI2V: the mmproj's vision tower gives the image-prompt embeddings of the model holding its values
    (F32: the model's own, exactly); its Linear weights stay mapped bytes."""
    model, shared_text = vision
    folder = setup["root"] / f"vision-{vision_type}"
    folder.mkdir()
    text = folder / "Qwen3-VL-tiny-F32.gguf"
    text.symlink_to(shared_text)
    proj = folder / f"mmproj-Qwen3-VL-tiny-{vision_type}.gguf"
    held = write_mmproj_gguf(proj, model, vision_type, seed=2)
    want = [encode_text(_oracle(model, held, VISION_TEXT_CONFIG), setup["processor"], p, _image(),
                        torch.device("cpu"), setup["crop"]) for p in PROMPTS]
    te = load_text_encoder_file(text, torch.float32, config=VISION_TEXT_CONFIG)
    qkv = te.model.visual.blocks[0].attn.qkv
    assert qkv.weight.dtype == torch.uint8 and qkv.weight_qtype.name == vision_type and _in_map(qkv.weight, proj)
    # then compared on alike layouts (the oracle is in memory, the file's F32 weights are viewed at its offsets)
    align_module(te, raw_bytes=True)
    got = [encode_text(te, setup["processor"], p, _image(), torch.device("cpu"), setup["crop"]) for p in PROMPTS]
    image_free = _embeds(setup, te)
    for w, g, plain in zip(want, got, image_free):
        assert w.shape == g.shape and w.shape[1] > plain.shape[1]  # the image's tokens are in
        if vision_type == "F32":
            assert torch.equal(g, w)
        else:
            assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item(), (g - w).abs().max().item()
    # the budget counts the vision tower too: Linear weights at their stored size, the rest as bf16 values
    from lingbot_core.model.text_encoder_gguf import loaded_bytes

    counted = sum(n for k, n in loaded_bytes(text, torch.bfloat16).items() if k.startswith(proj.name + ":"))
    stored = {"F32": lambda n: 4 * n, "F16": lambda n: 2 * n, "Q8_0": lambda n: n // 32 * 34}[vision_type]
    assert counted == sum(stored(v.numel()) if v.ndim == 2 and k.endswith("weight") and "pos_embed" not in k
                          else 2 * v.numel() for k, v in held.items())
    merger = te.model.visual.deepstack_merger_list[0].linear_fc2
    assert merger.weight_qtype.name == vision_type and torch.equal(
        merger.bias, held["model.visual.deepstack_merger_list.0.linear_fc2.bias"])


def test_the_memory_budget_counts_quantized_weights_at_their_block_size(setup):
    from lingbot_core.memory.budget import package_bytes

    path, held = setup["q8"], setup["q8_held"]
    dit = setup["root"] / "dit.gguf"
    ff.write_dit_gguf(dit, seed=1)
    vae = ff.write_wan21_vae_file(setup["root"] / "vae.safetensors")
    dtypes = {"transformer": torch.bfloat16, "text_encoder": torch.bfloat16, "vae": torch.float32}
    with_st = package_bytes(None, "transformer", dtypes, {"transformer": str(dit), "vae": str(vae),
                                                          "text_encoder": str(setup["safetensors"])})
    with_gguf = package_bytes(None, "transformer", dtypes, {"transformer": str(dit), "vae": str(vae), "text_encoder": str(path)})
    # independent count: Q8_0 keeps 34 bytes per 32 values of the 2-D text weights; norms 2 bytes a value
    # (bf16); the safetensors file's vision tower (absent from the GGUF) and its bf16 values
    st_text = sum(2 * v.numel() for k, v in setup["tiny"].state_dict().items() if k != "lm_head.weight")
    gguf_text = sum(v.numel() // 32 * 34 if v.ndim == 2 else 2 * v.numel() for v in held.values())
    assert with_st - with_gguf == st_text - gguf_text


def test_offload_block_stages_a_text_layer_at_its_quantized_size(setup):
    """The ring's staging for the text encoder's layers: two slots of its largest decoder layer, Q8_0 weights
    at 34 bytes per 32 values, norms as bf16 values, each tensor on 256-byte boundaries."""
    from lingbot_core.memory.block_streaming import ring_staging_bytes

    dit = setup["root"] / "dit.gguf"
    if not dit.is_file():
        ff.write_dit_gguf(dit, seed=1)
    dit_only = ring_staging_bytes(None, "transformer", torch.bfloat16, str(dit))
    both = ring_staging_bytes(None, "transformer", torch.bfloat16, str(dit), text_encoder_dtype=torch.bfloat16,
                              text_encoder_file=str(setup["q8"]))
    layers = {}
    for k, v in setup["q8_held"].items():
        if ".layers." in k:
            n = v.numel() // 32 * 34 if v.ndim == 2 else 2 * v.numel()
            layer = k.split(".layers.")[1].split(".")[0]
            layers[layer] = layers.get(layer, 0) + -(-n // 256) * 256
    assert both - dit_only == 2 * max(layers.values())


def test_a_text_gguf_of_an_unsupported_type_is_refused_at_load_naming_the_tensor(setup):
    """A tensor stored in a GGML type the pack cannot dequantize (IQ4_NL here, the token embedding) is refused
    when the file is loaded, naming the tensor, its type and the types that work; not at the first prompt."""
    path = setup["root"] / "Qwen3-VL-tiny-IQ4_NL-embed.gguf"
    write_text_encoder_gguf(path, setup["tiny"], "F32", embed="IQ4_NL")
    with pytest.raises(ModelPackageError, match=r"tensor 'token_embd.weight' of Qwen3-VL-tiny-IQ4_NL-embed.gguf is "
                                                r"stored as IQ4_NL, which this pack cannot dequantize; use a file "
                                                r"quantized to one of Q8_0, .*F32"):
        load_text_encoder_file(path, torch.float32, config=ff.TINY_TEXT_CONFIG)


def _two_listed_out_of_name_order(folder):
    """Two mmproj names that ``folder`` lists out of name order, as empty files, in name order (or None). Which
    names do is the file system's: on ext4 a hash of the name, on tmpfs the reverse creation order."""
    for i in range(8):
        (folder / f"mmproj-Qwen3-VL-tiny-{i}.gguf").touch()
    listed = [p.name for p in folder.iterdir()]
    pair = next(((b, a) for a, b in zip(listed, listed[1:]) if a > b), None)
    for name in listed:
        if pair is None or name not in pair:
            (folder / name).unlink()
    return pair


def test_of_several_usable_mmprojs_the_first_by_name_serves_image_prompts(setup, vision):
    """Two usable mmproj files beside the text GGUF that the folder lists out of name order: the first by name
    (its F16 weights, mapped from that file) is the vision tower loaded, whatever the directory order."""
    model, shared_text = vision
    folder = setup["root"] / "two-mmprojs"
    folder.mkdir()
    names = _two_listed_out_of_name_order(folder)
    if names is None:
        pytest.skip("this file system lists a folder in name order: directory order and name order cannot differ")
    for name, kind in zip(names, ("F16", "F32")):
        write_mmproj_gguf(folder / name, model, kind, seed=2)  # rewritten in place: the listing keeps its order
    assert [p.name for p in folder.iterdir()] == list(names[::-1])
    (folder / "Qwen3-VL-tiny-F32.gguf").symlink_to(shared_text)
    te = load_text_encoder_file(folder / "Qwen3-VL-tiny-F32.gguf", torch.float32, config=VISION_TEXT_CONFIG)
    qkv = te.model.visual.blocks[0].attn.qkv
    assert qkv.weight_qtype.name == "F16" and _in_map(qkv.weight, folder / names[0])
