"""GGUF DiTs (both expert layouts) and single-file DiTs give the frames of a package holding the same
values, in every offload mode; quantized weights stay memory-mapped block bytes until a layer runs."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from lingbot_core import load_pipeline
from lingbot_core.files.checkpoint_files import ModelPackageError
from lingbot_core.model.lora import LoraError
from lingbot_core.testing.gguf_fixtures import package_state, write_gguf_dit, write_oracle_package

from support.alike_layout import align_alike, at_offset, in_file_mapping
from support.sizes import GGUF_DIT

RUN = dict(height=32, width=32, num_frames=5, steps=2, seed=7, guidance_scale=1.0, output_type="latent")
MODES = ("none", "model", "sequential", "block")


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory):
    from lingbot_core.testing.fixtures import write_package

    root = tmp_path_factory.mktemp("gguf")
    pkg = write_package(root / "pkg", moe=True, fp32=True, refiner=False, seed=3, dit=GGUF_DIT)
    return root, pkg


def _case(gguf_root, qtype, layout, **kw):
    root, pkg = gguf_root
    name = f"{qtype}-{layout}-{'-'.join(f'{k}{v}' for k, v in sorted(kw.items()))}"
    path = root / f"{name}.gguf"
    values = write_gguf_dit(path, package_state(pkg), qtype, layout=layout, seed=11, **kw)
    oracle = write_oracle_package(pkg, root / f"oracle-{name}", values)
    return path, oracle, values


def _frames(pipe, modes=MODES):
    out = {}
    for mode in modes:
        pipe.set_offload(mode, blocks_on_gpu=0)
        out[mode] = pipe.generate("a cat", **RUN)
    pipe.set_offload("none")
    return out


@pytest.mark.parametrize("qtype,layout,kw,modes", [
    ("Q4_K", "rebel", {}, MODES),
    ("Q8_0", "sdcpp", {"prefix": True, "plain": "F16"}, MODES),
    # experts written in reverse file order (copied into a stack, not a strided view), BF16 plain tensors
    ("Q5_1", "rebel", {"plain": "BF16", "expert_order": "reversed"}, ("none", "block")),
])
def test_gguf_frames_equal_the_dequantized_package_in_every_offload_mode(gguf_root, qtype, layout, kw, modes):
    path, oracle, values = _case(gguf_root, qtype, layout, **kw)

    def check(dit):
        q = dit.blocks[0].attn.to_q
        assert q.weight.dtype == torch.uint8 and q.weight_qtype.name == qtype  # block bytes, not values
        experts = dit.blocks[1].ffn.experts
        assert set(experts.qtypes) == {"w1", "w2", "w3"} and experts.w1.dtype == torch.uint8
        assert experts.w1.shape[0] == 16
        for island in ("blocks.0.norm1.weight", "blocks.0.scale_shift_table", "blocks.0.ffn.router.weight"):
            t = dit.get_parameter(island)
            assert t.dtype == torch.float32 and torch.equal(t, values[island]), island

    want, got = _package_and_gguf_frames(path, oracle, modes, check)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    for mode, frames in got.items():
        assert (frames - want).abs().max().item() <= 1e-5, (mode, (frames - want).abs().max().item())


def _package_and_gguf_frames(path, oracle, modes, check=None, disturb=None):
    """The dequantized package's latents and the GGUF DiT's in each of ``modes``, both loads on alike
    memory layouts (``alike_layout``). ``disturb(pipe)`` runs on the package side first (a layout fixture)."""
    ref = load_pipeline(oracle, device="cpu", dtypes={"transformer": "fp32"})
    try:
        if disturb:
            disturb(ref)
        align_alike(ref)
        want = ref.generate("a cat", **RUN)
    finally:
        ref.release()
    pipe = load_pipeline(oracle, device="cpu", dtypes={"transformer": "fp32"}, transformer_file=path)
    try:
        if check:
            check(pipe.transformer)
        align_alike(pipe)
        got = _frames(pipe, modes)
    finally:
        pipe.release()
    return want, got


def test_a_weight_at_an_offset_of_40_bytes_does_not_change_the_verdict(gguf_root):
    """The alignment-changing fixture: one side's time-MLP weight copied to data_ptr() % 64 == 40 (where a
    memory-mapped safetensors file may put it; on AVX-512 CPUs a one-row Linear then rounds differently
    and the MoE routes another way) must leave the frame comparison passing."""
    path, oracle, _ = _case(gguf_root, "Q8_0", "sdcpp", prefix=True, plain="F16")

    def disturb(pipe):
        linear = pipe.transformer.time_embedder.linear_1
        linear.weight.data = at_offset(linear.weight.data, 40)
        assert linear.weight.data_ptr() % 64 == 40

    want, got = _package_and_gguf_frames(path, oracle, ("none",), disturb=disturb)
    assert (got["none"] - want).abs().max().item() <= 1e-5, (got["none"] - want).abs().max().item()


def test_quantized_bytes_are_views_of_the_mapped_file(gguf_root):
    path, oracle, _ = _case(gguf_root, "Q4_0", "rebel")
    pipe = load_pipeline(oracle, device="cpu", dtypes={"transformer": "fp32"}, transformer_file=path)
    try:
        from lingbot_core.files.checkpoint_files import GGUFFile

        f = GGUFFile(path)
        base = f.mapped().data_ptr()
        size = path.stat().st_size
        experts = pipe.transformer.blocks[0].ffn.experts
        for t in (experts.w1, pipe.transformer.blocks[0].attn.to_q.weight):
            assert 0 <= t.data_ptr() - base < size or in_file_mapping(t, path), "copied out of the map"
    finally:
        pipe.release()


def test_lora_on_a_gguf_dit_runs_as_run_time_adapters(gguf_root, tmp_path):
    """A LoRA on quantized Linears leaves the block bytes alone and adds x down^T up^T at run time: the
    frames match the dequantized package with the same LoRA merged (fp32, summation order aside)."""
    from safetensors.torch import save_file

    path, oracle, _ = _case(gguf_root, "Q8_0", "rebel")
    gen = torch.Generator().manual_seed(5)
    lora = {}
    for i in range(2):
        for target, (out_f, in_f) in ((f"blocks.{i}.attn.to_q", (256, 256)),
                                      (f"blocks.{i}.ffn.shared_experts.gate_proj", (256, 256))):
            lora[f"{target}.lora_A.weight"] = torch.randn(4, in_f, generator=gen) * 0.05
            lora[f"{target}.lora_B.weight"] = torch.randn(out_f, 4, generator=gen) * 0.05
    lora_file = tmp_path / "tiny_lora.safetensors"
    save_file(lora, str(lora_file))
    ref = load_pipeline(oracle, device="cpu", dtypes={"transformer": "fp32"}, loras=[(str(lora_file), 1.0)])
    try:
        align_alike(ref)
        want = ref.generate("a cat", **RUN)
    finally:
        ref.release()
    pipe = load_pipeline(oracle, device="cpu", dtypes={"transformer": "fp32"}, transformer_file=path,
                         loras=[(str(lora_file), 1.0)])
    try:
        q = pipe.transformer.blocks[0].attn.to_q
        assert q.weight.dtype == torch.uint8 and q.lora_down is not None and q.lora_down.dtype == torch.float32
        align_alike(pipe)
        with_lora = _frames(pipe, ("none", "block"))
        pipe.set_loras([])
        assert q.lora_down is None and q.weight.dtype == torch.uint8
        without = pipe.generate("a cat", **RUN)
    finally:
        pipe.release()
    # Adapter and merged weight round differently in fp32; a routing decision near a tie can amplify that
    # locally, so the bound is on the relative norm (a missing or doubled LoRA is ~100x larger).
    effect = ((without - want).norm() / want.norm()).item()
    assert effect > 1e-2, effect  # the LoRA changes the frames
    for mode, frames in with_lora.items():
        rel = ((frames - want).norm() / want.norm()).item()
        assert rel <= 1e-3, (mode, rel, effect)


def test_an_overflowing_lora_on_a_gguf_dit_is_refused_when_applied(gguf_root, tmp_path):
    """Quantized Linears get run-time adapters; adapters that overflow are refused at load, naming the
    LoRA, instead of a whole run that ends in the generic NaN error."""
    from support.lora_files import overflowing_lora

    path, oracle, _ = _case(gguf_root, "Q8_0", "rebel")
    bad = overflowing_lora(tmp_path / "overflowing_lora.safetensors", "blocks.0.attn.to_q", (256, 256))
    with pytest.raises(LoraError, match=r"overflowing_lora\.safetensors @ 4.*NaN or infinite"):
        load_pipeline(oracle, device="cpu", dtypes={"transformer": "fp32"}, transformer_file=path, loras=[(bad, 4.0)])


def test_pool_handle_with_a_gguf_dit_counts_mapped_bytes_and_generates(gguf_root):
    """The lazy path (ComfyUI's loader): the RAM budget counts the quantized weights at their mapped size
    (what the loaded DiT really holds), and the handle generates the package's frames in offload block."""
    from lingbot_core.memory.budget import package_bytes
    from lingbot_core.pipeline_pool import PipelinePool

    path, oracle, values = _case(gguf_root, "Q4_K", "sdcpp")
    pool = PipelinePool()
    handle = pool.handle(oracle, offload="block", dtypes={"transformer": "fp32"}, device="cpu", transformer_file=str(path))
    dtypes = handle.spec.load_dtypes()
    others = package_bytes(oracle, "transformer", dtypes) - sum(v.numel() * 4 for v in values.values())
    try:
        with pool.use(handle) as loaded:
            align_alike(loaded)  # F32 tensors of the GGUF stay mapped at the file's offsets: alike_layout
        got = handle.generate("a cat", **RUN)
        dit = pool._loaded[handle.spec].transformer
        held = sum(t.numel() * t.element_size() for t in list(dit.parameters()) + list(dit.buffers()))
        quantized = sum(p.numel() for p in dit.parameters() if p.dtype == torch.uint8)
    finally:
        handle.release()
    assert pool.weight_bytes(handle.spec) == others + held
    assert quantized > 0.5 * held  # most of the DiT stays block bytes (the rest: fp32 islands, F32 biases)
    assert held < 0.3 * sum(v.numel() * 4 for v in values.values())  # vs the fp32 DiT
    ref = load_pipeline(oracle, device="cpu", dtypes={"transformer": "fp32"})
    try:
        align_alike(ref)
        want = ref.generate("a cat", **RUN)
    finally:
        ref.release()
    assert (got - want).abs().max().item() <= 1e-5


def test_sampler_auto_runs_dmd_student_for_a_dmd_gguf_file(gguf_root):
    """A DMD student shipped as one GGUF (beside an ordinary package for the small components) is
    recognised by its file name: sampler "auto" then gives the dmd_student frames; another file keeps UniPC."""
    root, pkg = gguf_root
    for name, expected in (("lingbot-moe-dmd-Q8_0.gguf", "dmd_student"), ("lingbot-moe-Q8_0.gguf", "unipc")):
        path = root / name
        write_gguf_dit(path, package_state(pkg), "Q8_0", layout="rebel", seed=11)
        pipe = load_pipeline(pkg, transformer_file=path, device="cpu")
        try:
            auto = pipe.generate("a cat", sampler="auto", **RUN)
            chosen = pipe.generate("a cat", sampler=expected, **RUN)
            other = pipe.generate("a cat", sampler="unipc" if expected == "dmd_student" else "dmd_student", **RUN)
            assert torch.equal(auto, chosen), name
            assert not torch.allclose(auto, other, atol=1e-3), name
        finally:
            pipe.release()


def test_vram_bound_counts_the_ring_and_the_largest_blocks_dequantized_stacks(gguf_root):
    """Issue 31 item 5: under offload ``block`` the stated VRAM bound of the DiT's weights is the device
    buffers the stage really allocates (counted on the fake device: the resident part's and the ring's) plus
    what converting the largest block's GGUF weights adds (``converted_bytes``, measured against live bytes in
    test_gguf_weights, where the stacks are shown to be in it); the MoE block's expert stacks are counted whole."""
    from support.fake_accelerator import FAKE, recording_transfers

    from lingbot_core.memory.host_memory import PinBudget
    from lingbot_core.model.transformer import converted_bytes

    path, _, _ = _case(gguf_root, "Q8_0", "rebel")
    pipe = load_pipeline(gguf_root[1], device="cpu", offload="block", blocks_on_gpu=0, transformer_file=str(path))
    try:
        streamer = pipe.transformer._hf_hook
        streamer.execution_device = FAKE
        pipe.offloader.pins = PinBudget(0)
        with recording_transfers() as req:
            pipe.generate("a cat", **dict(RUN, output_type="latent"))
        buffers = sum(n for fn, n, d in req.allocations if fn in ("_device_slot", "load_whole") and d == FAKE)
        dtype = pipe.transformer.compute_dtype  # fp32 here: dequantized unchunked
        converted = [converted_bytes(b, dtype) for b in pipe.transformer.blocks]
        experts = pipe.transformer.blocks[1].ffn.experts
        stacks = 3 * experts.w1.shape[0] * GGUF_DIT["moe_intermediate_size"] * GGUF_DIT["hidden_size"] * dtype.itemsize
        assert pipe.vram_bound() == buffers + max(converted)
        assert max(converted) >= stacks > 0
    finally:
        pipe.release()
