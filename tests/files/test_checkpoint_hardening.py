"""Files that lie (issue 21, the smaller ones): malformed safetensors headers are refused naming the file
and what is wrong; ``.safetensors`` is recognised in any case, everywhere; LoRA factors that overflow
give an error naming the LoRA stack instead of a black video."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from support.sizes import TINY
from lingbot_core import load_pipeline
from lingbot_core.files.checkpoint_files import (ModelPackageError, SafetensorsReader, is_safetensors, safetensors_files,
                                           safetensors_header)
from lingbot_core.model.lora import LoraError

PROMPT = "a red fox running through snow"
RUN = dict(TINY, guidance_scale=3.0, seed=7)


def raw_file(path: Path, header, data: bytes = b"\0" * 16) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


GOOD_INFO = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
MALFORMED = {
    "a list": ([GOOD_INFO], "the safetensors header is a JSON list, not an object of tensors"),
    "a string per tensor": ({"w": "F32"}, "tensor 'w' is described by a JSON str, not an object"),
    "a string shape": ({"w": {**GOOD_INFO, "shape": "2x2"}}, "tensor 'w' has shape '2x2', not a list of sizes"),
    "a negative size": ({"w": {**GOOD_INFO, "shape": [-2, -2]}}, "has shape '[-2, -2]', not a list of sizes"),
    "float sizes": ({"w": {**GOOD_INFO, "shape": [2.0, 2]}}, "not a list of sizes"),
    "string offsets": ({"w": {**GOOD_INFO, "data_offsets": "0-16"}}, "has data_offsets '0-16', not [begin, end]"),
    "an unknown dtype": ({"w": {**GOOD_INFO, "dtype": "Q4_K"}}, "has unsupported dtype 'Q4_K'"),
    "a nesting bomb": (b"[" * 50_000, "nested too deeply"),
    "not UTF-8": (b'{"w\xff": 1}', "invalid safetensors header"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_header_names_the_file_and_what_is_wrong(tmp_path, case):
    header, message = MALFORMED[case]
    path = raw_file(tmp_path / f"bad_{case.replace(' ', '_')}.safetensors", header)
    for read in (SafetensorsReader, safetensors_header):
        with pytest.raises(ModelPackageError) as info:
            read(path)
        assert path.name in str(info.value) and message in str(info.value), str(info.value)


def test_a_huge_announced_header_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write((200 << 20).to_bytes(8, "little"))
        f.truncate(8 + (201 << 20))  # sparse: the file really is that long
    with pytest.raises(ModelPackageError, match="announces a safetensors header of 209,715,200 bytes"):
        SafetensorsReader(path)


@pytest.mark.parametrize("case", ["a list", "a string shape", "an unknown dtype"])
def test_a_malformed_lora_header_is_a_lora_error_naming_the_file(packages, tmp_path, case):
    header, message = MALFORMED[case]
    path = raw_file(tmp_path / "style.safetensors", header)
    with pytest.raises(LoraError) as info:
        load_pipeline(packages["dense"], device="cpu", loras=[(path, 1.0)])
    assert "style.safetensors" in str(info.value) and message in str(info.value), str(info.value)


def test_safetensors_in_upper_case_is_one_rule(packages, tmp_path):
    assert is_safetensors("x.SAFETENSORS") and is_safetensors("a/b.SafeTensors") and not is_safetensors("x.bin")
    # A LoRA ComfyUI lists as X.SAFETENSORS is read, not refused as a pickle.
    gen = torch.Generator().manual_seed(0)
    down, up = torch.randn(4, 64, generator=gen) * 0.2, torch.randn(64, 4, generator=gen) * 0.2
    path = tmp_path / "STYLE.SAFETENSORS"
    save_file({"blocks.0.attn.to_q.lora_A.weight": down, "blocks.0.attn.to_q.lora_B.weight": up}, str(path))
    pipe = load_pipeline(packages["dense"], device="cpu")
    try:
        w = pipe.transformer.blocks[0].attn.to_q.weight.detach().clone()
        pipe.set_loras([(path, 1.0)])
        assert torch.equal(pipe.transformer.blocks[0].attn.to_q.weight, w + up @ down)
    finally:
        pipe.release()
    # A package component whose only weights are upper case is found; an upper-case pickle is still a pickle.
    folder = tmp_path / "transformer"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, str(folder / "MODEL.SAFETENSORS"))
    assert safetensors_files(folder, "transformer", "diffusion_pytorch_model") == [folder / "MODEL.SAFETENSORS"]
    (folder / "MODEL.SAFETENSORS").unlink()
    (folder / "MODEL.BIN").write_bytes(b"pickle")
    with pytest.raises(ModelPackageError, match=r"only pickle weights \(MODEL.BIN\)"):
        safetensors_files(folder, "transformer", "diffusion_pytorch_model")


def _lora(path: Path, amp: float, alpha=None) -> Path:
    tensors = {"blocks.0.attn.to_q.lora_down.weight": torch.full((1, 64), amp),
               "blocks.0.attn.to_q.lora_up.weight": torch.full((64, 1), amp)}
    if alpha is not None:
        tensors["blocks.0.attn.to_q.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(path))
    return path


def test_overflowing_lora_factors_name_the_stack_instead_of_a_black_video(packages, tmp_path):
    pipe = load_pipeline(packages["dense"], device="cpu")
    try:
        base = pipe.generate(PROMPT, **RUN, output_type="latent")
        for path, expect in ((_lora(tmp_path / "huge.safetensors", 1e30), "huge.safetensors"),
                             (_lora(tmp_path / "alpha.safetensors", 2.0, alpha=3e38), "alpha.safetensors")):
            with pytest.raises(LoraError) as info:
                pipe.set_loras([(path, 1.0)])
            msg = str(info.value)
            assert f"the LoRA stack {expect}" in msg and "blocks.0.attn.to_q.weight NaN or infinite" in msg, msg
        # Finite merged weights whose activations overflow: the sampler's output is checked.
        loud = tmp_path / "loud.safetensors"
        save_file({f"blocks.0.ffn.{m}.lora_{r}.weight": torch.full(shape, 1e15) for m in ("gate_proj", "up_proj")
                   for r, shape in (("down", (1, 64)), ("up", (128, 1)))}, str(loud))
        pipe.set_loras([(loud, 1.0)])  # weights of about 1e30: finite, but their product in the FFN is not
        assert torch.isfinite(pipe.transformer.blocks[0].ffn.up_proj.weight).all()
        with pytest.raises(FloatingPointError, match="sampling produced NaN or infinite values with the LoRA stack "
                                                     "loud.safetensors"):
            pipe.generate(PROMPT, **RUN)
        pipe.set_loras([])  # every weight back: the same latents as before any LoRA
        assert torch.equal(pipe.generate(PROMPT, **RUN, output_type="latent"), base)
    finally:
        pipe.release()


# -- tensor layouts (issue 30): offsets that safetensors' own reader refuses only when a tensor is read ----

def _relayout(src: Path, dst: Path, change) -> Path:
    """``src`` with its header's tensor table changed by ``change(table)`` (the data bytes as they are)."""
    raw = src.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    table = json.loads(raw[8:8 + n])
    change(table)
    text = json.dumps(table).encode()
    dst.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return dst


def _same_size_pair(table):
    """Two tensors of the same dtype and byte size (the second after the first in the file)."""
    seen = {}
    for key, info in sorted(((k, v) for k, v in table.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"]):
        span = info["data_offsets"][1] - info["data_offsets"][0]
        if span and (info["dtype"], span) in seen:
            return seen[(info["dtype"], span)], key
        seen.setdefault((info["dtype"], span), key)
    raise AssertionError("no two tensors of one size")


def _overlap(table):
    first, second = _same_size_pair(table)
    table[second]["data_offsets"] = list(table[first]["data_offsets"])  # two tensors share bytes, a gap elsewhere


LAYOUTS = {  # a valid 3-tensor file (two F32 [2, 2] then an F16 [4]) changed; what the error must say
    "overlapping": (lambda t: t["b"].update(data_offsets=[8, 24]), "overlaps the tensor before it"),
    "a gap": (lambda t: t.update(c={"dtype": "F16", "shape": [2], "data_offsets": [36, 40]}), "leaves a gap"),
    "unsorted in the table, but tiling": (lambda t: [t.update({k: t.pop(k)}) for k in ("b", "a")], None),
    "a size that is not dtype x shape": (lambda t: t["c"].update(shape=[3]), "but its F16 shape [3] needs 6"),
    "past the end of the file": (lambda t: t["c"].update(data_offsets=[32, 48], shape=[8]), "ends at byte 48"),
    "bytes after the last tensor": (lambda t: t["c"].update(data_offsets=[32, 36], shape=[2]), "the tensors end at byte 36"),
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_tensor_offsets_are_checked_at_load_for_every_reader(tmp_path, case):
    from lingbot_core.files.checkpoint_files import check_readable

    src = tmp_path / "ok.safetensors"
    save_file({"a": torch.ones(2, 2), "b": torch.full((2, 2), 2.0), "c": torch.ones(4, dtype=torch.float16)}, str(src))
    change, message = LAYOUTS[case]
    path = _relayout(src, tmp_path / f"{case.replace(' ', '_')}.safetensors", change)
    if message is None:  # the table's key order is free; only the byte layout counts
        assert SafetensorsReader(path).get("b").tolist() == [[2.0, 2.0], [2.0, 2.0]]
        return
    for read in (SafetensorsReader, safetensors_header, lambda p: check_readable(p, "transformer")):
        with pytest.raises(ModelPackageError) as info:
            read(path)
        assert path.name in str(info.value) and message in str(info.value), str(info.value)


def test_overlapping_tensors_are_refused_by_the_package_the_single_file_and_the_lora_loader(packages, tmp_path):
    """The DiT of a package, the same DiT chosen as a single file, and a LoRA: each names its file at load
    (before, an overlapping DiT passed the loader and failed in GenerateVideo without the file's name)."""
    import shutil

    package = tmp_path / "package"
    shutil.copytree(packages["dense"], package)
    dit = package / "transformer" / "diffusion_pytorch_model.safetensors"
    single = _relayout(dit, tmp_path / "lingbot_dense_overlap.safetensors", _overlap)
    shutil.copyfile(single, dit)
    with pytest.raises(ModelPackageError, match=r"diffusion_pytorch_model\.safetensors.*overlaps the tensor before it"):
        load_pipeline(package, device="cpu")
    with pytest.raises(ModelPackageError, match=r"lingbot_dense_overlap\.safetensors.*overlaps the tensor before it"):
        load_pipeline(packages["dense"], device="cpu", transformer_file=single)
    lora = tmp_path / "style.safetensors"
    _lora(lora, 0.01)
    bad_lora = _relayout(lora, tmp_path / "style_overlap.safetensors", _overlap)
    with pytest.raises(LoraError, match=r"style_overlap\.safetensors.*overlaps the tensor before it"):
        load_pipeline(packages["dense"], device="cpu", loras=[(bad_lora, 1.0)])


def test_the_native_vae_loader_checks_the_layout_too(packages, tmp_path):
    """Load VAE (native) reads the package's vae/ through the same checked reader: an overlapping table is
    refused naming the file, before any tensor is read."""
    import shutil

    from lingbot_core.files.vae_layout import load_original_wan21
    from lingbot_core.testing.fixtures import tiny_wan21_vae

    package = tmp_path / "package"
    shutil.copytree(packages["dense"], package)
    shutil.rmtree(package / "vae")
    tiny_wan21_vae(0).save_pretrained(package / "vae", safe_serialization=True)  # a VAE ComfyUI can build
    good = load_original_wan21(package)
    assert good and all(torch.isfinite(t).all() for t in good.values())
    vae = package / "vae" / "diffusion_pytorch_model.safetensors"
    bad = _relayout(vae, tmp_path / "vae_overlap.safetensors", _overlap)
    shutil.copyfile(bad, vae)
    with pytest.raises(ModelPackageError, match=r"diffusion_pytorch_model\.safetensors.*overlaps the tensor before it"):
        load_original_wan21(package)


# -- GGUF tensors over the same bytes (issue 51): the span rule safetensors files already follow ----------------

def _gguf_with_overlap(path, overlap: bool):
    """Three F32 tensors written by gguf-py; with ``overlap``, the offset of 'blk.0.b' is moved onto 'blk.0.a'."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen3vl")
    for i, name in enumerate(("blk.0.a", "blk.0.b", "blk.0.c")):
        writer.add_tensor(name, np.full((4, 8), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if overlap:
        reader = gguf.GGUFReader(str(path), "r+")
        tensors = {t.name: t for t in reader.tensors}
        base = reader.data_offset
        # a tensor info's last part is its offset, relative to the data section
        tensors["blk.0.b"].field.parts[-1][0] = tensors["blk.0.a"].data_offset - base + 64
        reader.data.flush()
        del reader


@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_overlapping_gguf_tensors_are_refused_naming_both(tmp_path, component):
    from lingbot_core.files.checkpoint_files import GGUFFile
    from lingbot_core.model.text_encoder_gguf import TextEncoderGGUF

    good, bad = tmp_path / "good.gguf", tmp_path / "forged.gguf"
    _gguf_with_overlap(good, overlap=False)
    _gguf_with_overlap(bad, overlap=True)
    assert GGUFFile(good, component).keys() == ["blk.0.a", "blk.0.b", "blk.0.c"]
    opener = (lambda p: GGUFFile(p, component)) if component == "transformer" else (lambda p: TextEncoderGGUF(p, None))
    with pytest.raises(ModelPackageError) as info:
        opener(bad)
    msg = str(info.value)
    assert msg.startswith(f"{component}: forged.gguf is not a readable GGUF file (tensor 'blk.0.b' overlaps the "
                          "tensor before it, 'blk.0.a' (it begins at byte 64 of the data, 'blk.0.a' ends at 128)"), msg
