"""Lazy pipeline handles and the RAM-budgeted pool (lingbot_core.pipeline_pool), in-process, tiny packages.

Budgets are set in bytes relative to the packages' own weight sizes, so the tests do not depend on
how much RAM the machine has free.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from lingbot_core import LazyPipeline, MemoryBudgetError, PipelinePool, load_pipeline
from lingbot_core.loading import ModelPackageError

GEN = dict(height=32, width=32, num_frames=5, steps=1, guidance_scale=1.0)


def budget_pool(budget: int, **kw) -> PipelinePool:
    return PipelinePool(budget=budget, headroom=0, **kw)


def test_handle_reads_no_weight_until_a_stage_runs_and_matches_a_direct_load(packages):
    pool = PipelinePool(headroom=0)
    handle = pool.handle(packages["dense"], offload="model", device="cpu")
    assert isinstance(handle, LazyPipeline) and not handle.loaded
    handle.normalizer.to_vae(torch.zeros(1, 16, 1, 2, 2))  # read from vae/config.json: still nothing loaded
    assert pool.loaded() == ()
    frames = handle.generate("a kite", **GEN)
    assert handle.loaded
    direct = load_pipeline(packages["dense"], device="cpu")
    try:
        np.testing.assert_array_equal(frames, direct.generate("a kite", **GEN))
    finally:
        direct.release()
    handle.release()
    assert not handle.loaded and pool.loaded() == ()


def test_offload_modes_share_one_copy_of_the_weights(packages):
    pool = PipelinePool(headroom=0)
    a = pool.handle(packages["dense"], offload="model", device="cpu")
    b = pool.handle(packages["dense"], offload="sequential", device="cpu")
    ea = a.encode_prompt("a kite", guidance_scale=1.0)
    with pool.use(a) as pipe_a:
        assert pipe_a.offload == "model"
    with pool.use(b) as pipe_b:
        assert pipe_b is pipe_a and pipe_b.offload == "sequential"
        pipe_b._prompt_cache.clear()
    eb = b.encode_prompt("a kite", guidance_scale=1.0)
    torch.testing.assert_close(ea.positive, eb.positive, rtol=0, atol=1e-6)
    assert len(pool.loaded()) == 1
    pool.release_idle()


def test_budget_evicts_the_least_recently_used_idle_pipeline(packages):
    probe = PipelinePool()
    specs = {name: probe.handle(packages[name], device="cpu").spec for name in ("dense", "moe", "dense_bf16")}
    sizes = {name: probe.weight_bytes(spec) for name, spec in specs.items()}
    pool = budget_pool(sizes["dense"] + sizes["moe"] + sizes["dense_bf16"] // 2)  # two fit, not three
    h = {name: pool.handle(packages[name], device="cpu") for name in specs}
    h["dense"].encode_prompt("a kite", guidance_scale=1.0)
    h["moe"].encode_prompt("a kite", guidance_scale=1.0)
    h["dense"].encode_prompt("a kite again", guidance_scale=1.0)  # dense is now the most recently used
    h["dense_bf16"].encode_prompt("a kite", guidance_scale=1.0)
    assert set(pool.loaded()) == {specs["dense"], specs["dense_bf16"]}
    # the evicted handle still works: it loads again (and evicts the LRU one, dense)
    h["moe"].encode_prompt("a kite", guidance_scale=1.0)
    assert set(pool.loaded()) == {specs["dense_bf16"], specs["moe"]}
    pool.release_idle()


def test_three_pipelines_that_fit_stay_loaded_together(packages):
    probe = PipelinePool()
    names = ("dense", "moe", "dense_bf16")
    total = sum(probe.weight_bytes(probe.handle(packages[n], device="cpu").spec) for n in names)
    pool = budget_pool(total)
    handles = [pool.handle(packages[n], device="cpu") for n in names]
    for h in handles:
        h.encode_prompt("a kite", guidance_scale=1.0)
    assert all(h.loaded for h in handles)
    pool.release_idle()


def test_a_running_pipeline_is_never_evicted(packages):
    probe = PipelinePool()
    size = probe.weight_bytes(probe.handle(packages["moe"], device="cpu").spec)
    pool = budget_pool(size + size // 2)  # room for one
    a = pool.handle(packages["moe"], device="cpu")
    b = pool.handle(packages["dense"], device="cpu")
    with pool.use(a):
        with pytest.raises(MemoryBudgetError, match=r"lingbot-tiny-moe \(transformer\), .* \(running\)"):
            b.encode_prompt("a kite", guidance_scale=1.0)
        assert a.loaded and not b.loaded
    b.encode_prompt("a kite", guidance_scale=1.0)  # idle now: evicted to make room
    assert b.loaded and not a.loaded
    pool.release_idle()


def test_a_pipeline_still_needed_by_the_running_job_is_not_evicted(packages):
    caller = {"who": None}
    probe = PipelinePool()
    size = probe.weight_bytes(probe.handle(packages["moe"], device="cpu").spec)
    pool = budget_pool(size + size // 2, caller=lambda: caller["who"])
    base = pool.handle(packages["moe"], device="cpu")
    other = pool.handle(packages["dense"], device="cpu")
    pool.expect(base.spec, "job1", ["4", "7"])  # two consumers of the base pipeline
    caller["who"] = ("job1", "4")
    base.encode_prompt("a kite", guidance_scale=1.0)
    caller["who"] = ("job1", "5")
    with pytest.raises(MemoryBudgetError, match=r"still needed by node\(s\) 7") as err:
        other.encode_prompt("a kite", guidance_scale=1.0)
    assert "UnloadLingbotPipeline" in str(err.value) and "dit_precision" in str(err.value)
    assert base.loaded
    caller["who"] = ("job1", "7")
    base.encode_prompt("a kite", guidance_scale=1.0)  # the last consumer has run
    caller["who"] = ("job1", "5")
    other.encode_prompt("a kite", guidance_scale=1.0)
    assert other.loaded and not base.loaded
    # a new job forgets the old job's needs
    pool.expect(other.spec, "job1", ["9"])
    caller["who"] = ("job2", "1")
    base.encode_prompt("a kite", guidance_scale=1.0)
    assert base.loaded and not other.loaded
    pool.release_idle()


def test_a_pipeline_bigger_than_the_budget_is_refused_before_reading_weights(packages, monkeypatch):
    pool = budget_pool(1024)
    handle = pool.handle(packages["dense"], device="cpu")
    import lingbot_core.pipeline_pool as pp

    monkeypatch.setattr(pp, "load_pipeline", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(MemoryBudgetError, match=r"needs about .* exceeds the RAM budget"):
        handle.generate("a kite", **GEN)


def test_broken_dit_is_reported_when_the_handle_is_made(broken_packages):
    pool = PipelinePool()
    for variant, pattern in (("wrong_shape", r"has shape \[63, 64\], but config\.json implies \[64, 64\]"),
                             ("missing_key", r"the checkpoint is missing 1 tensors: proj_out\.bias"),
                             ("unexpected_key", r"has tensor 'blocks\.0\.attn\.to_q\.bias'"),
                             ("bad_config", r"config\.json describes an invalid model")):
        with pytest.raises(ModelPackageError, match=pattern):
            pool.handle(broken_packages[variant], device="cpu")


@pytest.mark.parametrize("mode", ["none", "model", "sequential"])
def test_release_frees_every_weight_without_garbage_collection(packages, mode):
    """After release() no weight tensor is alive, in every mode, with the cyclic GC switched off: the
    hooks that accelerate leaves behind (module <-> bound forward cycles) must not keep weights."""
    pool = PipelinePool(headroom=0)
    handle = pool.handle(packages["moe"], offload=mode, device="cpu")
    handle.encode_prompt("a kite", guidance_scale=1.0)
    with pool.use(handle) as pipe:
        modules = [pipe.transformer, pipe.text_encoder, pipe.vae]
    tensors = {id(t): t for m in modules for t in list(m.parameters()) + list(m.buffers()) if t.device.type != "meta"}
    if mode == "sequential":  # parameters are on meta; the real tensors live in the hooks' weights maps
        tensors.update({id(t): t for m in modules for sub in m.modules() for hook in _hooks(sub)
                        for t in _weights_map_tensors(hook)})
    refs = [weakref.ref(t) for t in tensors.values()]
    del modules, pipe, tensors
    assert len(refs) > 50
    gc.collect()
    gc.disable()
    try:
        assert handle.release()
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert alive == 0, f"{alive} of {len(refs)} weight tensors still alive after release()"


def _hooks(module):
    from accelerate.hooks import SequentialHook

    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(hook.hooks) if isinstance(hook, SequentialHook) else [hook]


def _weights_map_tensors(hook):
    data = getattr(getattr(hook, "weights_map", None), "dataset", None)  # accelerate's PrefixedDataset
    return [t for t in (data or {}).values() if isinstance(t, torch.Tensor)]


# ---------------------------------------------------------------------------------------------
# Budget arithmetic against the real bytes of the packages' files (issue 15 item 7)
# ---------------------------------------------------------------------------------------------


def file_tensor_bytes(root, subfolders=("transformer", "text_encoder", "vae")) -> int:
    """Bytes of every tensor in every safetensors file of the components, read with safetensors itself."""
    from safetensors import safe_open

    total = 0
    for sub in subfolders:
        for path in sorted((root / sub).glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    total += t.numel() * t.element_size()
    return total


def test_weight_bytes_count_every_file_of_a_sharded_package(packages):
    root = packages["moe_sharded"]  # fp32 files loaded in fp32 on the CPU: loaded bytes = file bytes
    assert len(list((root / "transformer").glob("*.safetensors"))) == 2
    pool = PipelinePool()
    spec = pool.handle(root, device="cpu").spec
    assert pool.weight_bytes(spec) == file_tensor_bytes(root)


@pytest.mark.parametrize("spare", [-1, 0])
def test_headroom_is_kept_free_not_added_to_the_available_ram(packages, monkeypatch, spare):
    import lingbot_core.pipeline_pool as pp

    root = packages["dense"]
    need = file_tensor_bytes(root)
    headroom = pp.DEFAULT_HEADROOM
    monkeypatch.setattr(pp, "available_ram", lambda: need + headroom + spare)
    pool = PipelinePool()
    handle = pool.handle(root, device="cpu")
    if spare < 0:  # one byte short of weights + headroom: refused before reading a byte
        monkeypatch.setattr(pp, "load_pipeline", lambda *a, **k: pytest.fail("weights were read"))
        with pytest.raises(MemoryBudgetError, match=r"of RAM available \(keeping 1.00 GiB free\)"):
            handle.encode_prompt("a kite", guidance_scale=1.0)
        assert not handle.loaded
    else:
        handle.encode_prompt("a kite", guidance_scale=1.0)
        assert handle.loaded
        pool.release_idle()


def test_switching_into_block_makes_room_for_its_pins(packages, monkeypatch):
    """A loaded pipeline switched to offload 'block' pins its staging ring: the pool makes room for those
    bytes first (evicting an idle pipeline), or refuses clearly. Pins exist only on CUDA, so this CPU
    test states the ring's size for the dense spec."""
    probe = PipelinePool()
    dense_spec = probe.handle(packages["dense"], device="cpu").spec
    moe_spec = probe.handle(packages["moe"], device="cpu").spec
    pins = 4096
    pool = budget_pool(probe.weight_bytes(dense_spec) + probe.weight_bytes(moe_spec) + pins - 1)
    monkeypatch.setattr(pool, "pin_bytes", lambda spec: pins if spec == dense_spec else 0)
    moe = pool.handle(packages["moe"], device="cpu")
    pool.handle(packages["dense"], offload="model", device="cpu").encode_prompt("a kite", guidance_scale=1.0)
    moe.encode_prompt("a kite", guidance_scale=1.0)
    block = pool.handle(packages["dense"], offload="block", device="cpu")
    with pool.use(moe):  # running: cannot be evicted
        with pytest.raises(MemoryBudgetError, match=r"switching to offload 'block' \(pinned staging buffers\) needs about"):
            block.encode_prompt("a kite", guidance_scale=1.0)
    block.encode_prompt("a kite", guidance_scale=1.0)  # the idle MoE pipeline makes room
    assert pool.loaded() == (dense_spec,)
    with pool.use(block) as pipe:
        assert pipe.offload == "block"
    pool.release_idle()


@pytest.mark.parametrize("offload", ["block", "model"])
def test_pins_of_a_loaded_block_pipeline_count_against_the_budget(packages, monkeypatch, offload):
    """The budget fits both pipelines' weights but not the dense one's pinned staging ring as well: with
    the dense pipeline loaded in 'block', loading the MoE one must first free it (or refuse while it runs);
    in 'model' (nothing pinned) both stay loaded. Pins exist only on CUDA; the ring's size is stated."""
    probe = PipelinePool()
    dense_spec = probe.handle(packages["dense"], device="cpu").spec
    moe_spec = probe.handle(packages["moe"], device="cpu").spec
    pins = probe.weight_bytes(dense_spec) // 2
    pool = budget_pool(probe.weight_bytes(dense_spec) + probe.weight_bytes(moe_spec) + pins - 1)
    monkeypatch.setattr(pool, "pin_bytes", lambda spec: pins if spec == dense_spec else 0)
    dense = pool.handle(packages["dense"], offload=offload, device="cpu")
    moe = pool.handle(packages["moe"], device="cpu")
    dense.encode_prompt("a kite", guidance_scale=1.0)
    try:
        if offload == "block":
            with pool.use(dense):  # running: cannot be evicted
                with pytest.raises(MemoryBudgetError, match=r"loading its weights needs about .* exceeds the RAM budget"):
                    moe.encode_prompt("a kite", guidance_scale=1.0)
        moe.encode_prompt("a kite", guidance_scale=1.0)
        assert pool.loaded() == ((moe_spec,) if offload == "block" else (dense_spec, moe_spec))
    finally:
        pool.release_idle()
