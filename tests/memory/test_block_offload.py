"""Offload mode ``block`` (issue 10 item 2): the DiT streamed block by block with ``blocks_on_gpu``
resident blocks, text encoder and VAE placed as under ``model``.

Residency is measured by the tracker of ``residency.py`` (which blocks each placement unit really
moves), inputs by the fake ``cuda:3`` accelerator of ``test_offload.py``; frames are compared with
offload ``none`` bit for bit.
"""

import gc
import weakref
from unittest import mock

import numpy as np
import pytest
import torch

from lingbot_core import OFFLOAD_MODES, load_pipeline
from lingbot_core.memory import host_memory
from lingbot_core.memory.block_streaming import BlockRing, BlockStreamer
from support.residency import ResidencyTracker
from support.fake_accelerator import FAKE, assert_placed_on_hook_device, fake_accelerator
from support.sizes import SIZE
from support.residency import only
from support.sizes import DEPTH

RUN = dict(SIZE, num_frames=5, steps=2, seed=7)


def leave_resident(pipe, tracker):
    """Start dirty, as after code that ran components outside any stage: the VAE, and the text encoder's and
    the DiT's non-block weights with their first streamed layer or block."""
    for name in ("text_encoder", "vae", "transformer"):
        module = pipe.offloader.components[name]
        module._hf_hook.pre_forward(module)
    assert tracker.current() == {"text_encoder", "vae", "transformer"}


@pytest.fixture(scope="module")
def deep_reference(deep_package, test_image):
    pipe = load_pipeline(deep_package, device="cpu")
    try:
        return pipe.generate("a cat", image=test_image, **RUN)
    finally:
        pipe.release()


def test_block_is_a_mode():
    assert OFFLOAD_MODES == ("none", "model", "sequential", "block")


def largest_stream_unit(module) -> int:
    """Bytes of the largest unit an ``AlignDevicesHook`` of ``module`` streams at once (a layer, or a
    preloaded subtree such as the vision tower)."""
    from accelerate.hooks import AlignDevicesHook

    sizes = [sum(t.numel() * t.element_size() for t in m.parameters(recurse=h.place_submodules))
             for m in module.modules() for h in _hooks_of(m) if isinstance(h, AlignDevicesHook) and h.offload]
    return max(sizes)


def _hooks_of(module):
    from lingbot_core.memory.offload import _hooks

    return _hooks(module)


def stage_peaks(pipe, tracker):
    """Patch the pipeline's ``Offloader.stage`` (on the instance) so that each stage's peak resident
    bytes are recorded, in order: returns the list it appends to."""
    from contextlib import contextmanager

    peaks, orig = [], pipe.offloader.stage

    @contextmanager
    def stage():
        with orig():
            tracker.peak_bytes = 0
            yield
            peaks.append(tracker.peak_bytes)

    return peaks, mock.patch.object(pipe.offloader, "stage", stage)


@pytest.mark.parametrize("k", [0, 2])
def test_block_residency_and_frames(deep_package, deep_reference, test_image, k):
    """Issue 24 item 2, issue 31 item 10: under ``block`` the text encoder streams its decoder layers through a
    ring as the DiT streams its blocks, so the stated bound holds per stage: image encode and decode <= the
    VAE, prompt encode <= the text encoder's non-layer weights + 2 layers, sampling <= the DiT's non-block
    weights + (K + 2) blocks."""
    pipe = load_pipeline(deep_package, offload="block", device="cpu", blocks_on_gpu=k)
    try:
        streamed = [i for i, b in enumerate(pipe.transformer.blocks) if hasattr(b, "_hf_hook")]
        assert streamed == list(range(k, DEPTH))
        assert isinstance(pipe.transformer._hf_hook, BlockStreamer)
        with ResidencyTracker(pipe) as tr:
            leave_resident(pipe, tr)
            peaks, patch = stage_peaks(pipe, tr)
            with patch:
                frames = pipe.generate("a cat", image=test_image, **RUN)
            assert tr.current() == frozenset() and tr.blocks_resident() == set()
        np.testing.assert_array_equal(frames, deep_reference)
        assert only(tr.seen("DiT"), "transformer") and only(tr.seen("VAE.enc"), "vae") and only(tr.seen("VAE.dec"), "vae")
        assert only(tr.seen("TE"), "text_encoder")  # the text encoder alone
        assert tr.seen("stream") == []  # nothing streamed module by module any more
        # every block ran on the device, with at most K + 2 blocks there
        assert len(tr.block_snapshots) == DEPTH * 2 * RUN["steps"]
        assert all(here for _, _, here, _ in tr.block_snapshots)
        assert max(n for _, n, _, _ in tr.block_snapshots) <= k + 2
        assert tr.max_blocks_resident == k + 2  # the next block really is prefetched
        # the bound of each stage (prompt encode, image encode, sampling, decode)
        def nbytes(m):
            return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
        block_bytes = nbytes(pipe.transformer.blocks[0])
        non_block = nbytes(pipe.transformer) - DEPTH * block_bytes
        layers = pipe.text_encoder.model.language_model.layers
        te_layer, te_bytes, vae_bytes = nbytes(layers[0]), nbytes(pipe.text_encoder), nbytes(pipe.vae)
        te_core = te_bytes - len(layers) * te_layer
        enc_peak, te_peak, dit_peak, dec_peak = peaks  # TI2V: the image is encoded first (the prompt encode sees it)
        assert te_core + 2 * te_layer >= te_peak > te_core + te_layer  # the next layer really is prefetched
        assert 0 < enc_peak <= vae_bytes and 0 < dec_peak <= vae_bytes
        assert non_block + min(k + 2, DEPTH) * block_bytes >= dit_peak > non_block + k * block_bytes
    finally:
        pipe.release()


def test_block_inputs_on_the_hook_device(deep_package):
    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    try:
        pipe.transformer._hf_hook.execution_device = FAKE
        with ResidencyTracker(pipe) as tr, fake_accelerator(pipe) as req:
            leave_resident(pipe, tr)
            pipe.generate("a cat", **RUN)
            assert tr.current() == frozenset()
        assert_placed_on_hook_device(req, ("encode_text", "denoise", "vae_decode"))
        # the weights were copied into buffers on the hook's device: the ring's, and one per stage for the
        # resident weights (issue 31 item 11: no per-tensor copies any more)
        assert {d for fn, _, d in req.allocations if fn in ("_device_slot", "load_whole")} == {FAKE}
        assert not [r for r in req if r[1] == "onload"]
    finally:
        pipe.release()


def test_block_moe_frames_equal_no_offload(packages, test_image):
    pipe = load_pipeline(packages["moe"], device="cpu")
    try:
        reference = pipe.generate("a cat", output_type="latent", **RUN)
        pipe.set_offload("block", blocks_on_gpu=0)
        assert torch.equal(pipe.generate("a cat", output_type="latent", **RUN), reference)
    finally:
        pipe.release()


def test_block_exception_mid_forward_leaves_nothing(deep_package, deep_reference, test_image):
    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    try:
        block = pipe.transformer.blocks[3]
        with ResidencyTracker(pipe) as tr:
            with mock.patch.object(type(block.attn), "forward", side_effect=RuntimeError("mid-forward failure")):
                with pytest.raises(RuntimeError, match="mid-forward"):
                    pipe.generate("a cat", image=test_image, **RUN)
            assert tr.current() == frozenset() and tr.blocks_resident() == set()
        np.testing.assert_array_equal(pipe.generate("a cat", image=test_image, **RUN), deep_reference)
    finally:
        pipe.release()


def test_block_switching_and_release(deep_package, deep_reference, test_image):
    pipe = load_pipeline(deep_package, device="cpu")
    pipe.set_offload("block", blocks_on_gpu=3)
    np.testing.assert_array_equal(pipe.generate("a cat", image=test_image, **RUN), deep_reference)
    assert pipe.blocks_on_gpu == 3
    pipe.set_offload("sequential")
    pipe.set_offload("none")  # every block's tensors are back in place, unhooked
    assert not any(hasattr(m, "_hf_hook") for c in pipe.offloader.components.values() for m in c.modules())
    assert all(p.device.type == "cpu" for p in pipe.transformer.parameters())
    refs = [weakref.ref(m) for m in (pipe.transformer, pipe.text_encoder, pipe.vae)]
    pipe.release()
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


@pytest.mark.parametrize("bad", [-1, 65, 1.5, True, "2"])
def test_blocks_on_gpu_validated(deep_package, bad):
    with pytest.raises(ValueError, match="blocks_on_gpu=.*integer from 0 to 64"):
        load_pipeline(deep_package, offload="block", device="cpu", blocks_on_gpu=bad)


# ---------------------------------------------------------------------------------------------
# The ring (issue 15 item 1): bounded pinned host bytes and device buffers, proven on the fake device
# ---------------------------------------------------------------------------------------------


class PinCounter:
    """Instruments ``host_memory.pinned_buffer`` (the pack's only pinning function): every call with
    its size; the buffers pretend to be page-locked so ``pinned_bytes()`` reports them."""

    def __init__(self):
        self.calls, self.buffers = [], []

    class Pretend:
        def __init__(self, nbytes):
            self.nbytes, self.tensor, self.pinned = nbytes, torch.empty(nbytes, dtype=torch.uint8), True

        def free(self):  # the real one unregisters with CUDA
            self.tensor, self.pinned = None, False

    def __call__(self, nbytes):
        buf = self.Pretend(nbytes)
        self.calls.append(nbytes)
        self.buffers.append(buf)
        return buf


def block_tensor_bytes(block):
    tensors = list(block.parameters()) + list(block.buffers())
    return sum(t.numel() * t.element_size() for t in tensors), len(tensors)


def ring_run(pipe, pins, runs=2, pin_budget=0, **run):
    """``runs`` generates with the streamers on the fake ``cuda:3`` (pinned homes within ``pin_budget``
    bytes; 0: every copy goes through the staging buffers); returns the device allocations per run and,
    per streamed-block call, whether each weight lay in a device buffer and equalled its home."""
    streamer = pipe.transformer._hf_hook
    streamer.execution_device = FAKE
    pipe.offloader.pins = host_memory.PinBudget(pin_budget)
    homes = {id(p): p.data.clone() for p in pipe.transformer.parameters()}  # values only; placement changes
    seen = []

    def probe(block, args):
        buffers = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.numel()) for s in streamer.ring.device_slots]
        inside = all(any(lo <= p.data_ptr() < hi for lo, hi in buffers) for p in block.parameters())
        equal = all(torch.equal(p, homes[id(p)]) for p in block.parameters())
        seen.append((inside, equal))

    handles = [b.register_forward_pre_hook(probe) for b in pipe.transformer.blocks if hasattr(b, "_hf_hook")]
    allocations, frames = [], []
    try:
        with mock.patch.object(host_memory, "pinned_buffer", pins):
            for _ in range(runs):
                with fake_accelerator(pipe) as req:
                    frames.append(pipe.generate("a cat", **run))
                allocations.append([a for a in req.allocations])
                assert streamer.ring.device_slots == []  # dropped at the stage's end
    finally:
        for h in handles:
            h.remove()
    return allocations, seen, frames


@pytest.mark.parametrize("k", [0, 2])
def test_block_ring_pins_two_exact_buffers_and_reuses_two_device_buffers(deep_package, deep_reference, test_image, k):
    pipe = load_pipeline(deep_package, offload="block", device="cpu", blocks_on_gpu=k)
    pins = PinCounter()
    try:
        block_bytes, n_tensors = block_tensor_bytes(pipe.transformer.blocks[-1])
        with ResidencyTracker(pipe) as tr:
            allocations, seen, frames = ring_run(pipe, pins, image=test_image, **RUN)
        dit, te = pipe.transformer._hf_hook, pipe.text_encoder._hf_hook  # the text encoder streams its layers too
        # two staging buffers per ring for the pipeline's life, each one block's (layer's) bytes (+ <= 256
        # alignment per tensor)
        assert sorted(pins.calls) == sorted([dit.ring.slot_bytes] * 2 + [te.ring.slot_bytes] * 2)
        assert block_bytes <= dit.ring.slot_bytes <= block_bytes + 256 * n_tensors
        assert pipe.pinned_bytes() == sum(pins.calls)
        # per run: two ring buffers per streamer, of the same size, never more however many blocks ran, and
        # one buffer per stage for each streamer's resident weights (copied through the same staging buffers)
        for i, stage in enumerate(allocations):  # the second run's prompt comes from the cache
            ring = [n for fn, n, d in stage if fn == "_device_slot"]
            assert ring == [te.ring.slot_bytes] * 2 * (i == 0) + [dit.ring.slot_bytes] * 2
            assert [n for fn, n, d in stage if fn == "load_whole"] == [te.core.span] * (i == 0) + [dit.core.span]
            assert {d for fn, n, d in stage if fn in ("_device_slot", "load_whole")} == {FAKE}
        # streamed blocks x steps x runs: CFG lockstep (issue 17) streams each block once for both branches
        assert len(seen) == (DEPTH - k) * RUN["steps"] * 2
        assert all(inside and equal for inside, equal in seen)  # every block ran on its copy in a ring buffer
        assert tr.max_blocks_resident == k + 2 and max(n for _, n, _, _ in tr.block_snapshots) <= k + 2
        for f in frames:  # the same weights at other addresses: CPU kernels may round differently (AVX2)
            np.testing.assert_allclose(f, deep_reference, rtol=0, atol=1e-4)
        # leaving block mode (or releasing) unpins the ring
        pipe.set_offload("none")
        assert pipe.pinned_bytes() == 0 and all(b.tensor is None and not b.pinned for b in pins.buffers)
    finally:
        pipe.release()


def test_block_release_returns_the_pins(deep_package):
    from lingbot_core import PipelinePool

    pool = PipelinePool(headroom=0)
    handle = pool.handle(deep_package, offload="block", device="cpu")
    pins = PinCounter()
    with pool.use(handle) as pipe:
        ring_run(pipe, pins, runs=1, **dict(RUN, steps=1))
        assert pipe.pinned_bytes() == sum(pins.calls) > 0
    assert handle.release()
    assert len(pins.buffers) == 4 and all(b.tensor is None and not b.pinned for b in pins.buffers)  # two per ring


def test_block_pins_are_counted_in_the_ram_budget(deep_package, monkeypatch):
    """The budget reserves the ring's pinned bytes for a pipeline in offload ``block`` on CUDA (spec on
    ``cuda:0``; nothing is loaded, the budget answers first), and that estimate equals the ring's real
    pinned bytes (the same package streamed on the fake device)."""
    import lingbot_core.pipeline_pool as pp
    from lingbot_core import MemoryBudgetError, PipelinePool

    probe = PipelinePool()
    spec = probe.handle(deep_package, device="cuda:0", dtypes={"transformer": "fp32", "text_encoder": "fp32"}).spec
    weights, pins = probe.weight_bytes(spec), probe.pin_bytes(spec)
    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    counter = PinCounter()
    try:
        ring_run(pipe, counter, runs=1, **dict(RUN, steps=1))
        assert pins == sum(counter.calls) == pipe.pinned_bytes() > 0
    finally:
        pipe.release()

    class Reached(Exception):
        pass

    def no_load(*a, **k):
        raise Reached

    monkeypatch.setattr(pp, "load_pipeline", no_load)
    pool = PipelinePool(budget=weights + pins - 1, headroom=0)
    kw = dict(device="cuda:0", dtypes={"transformer": "fp32", "text_encoder": "fp32"})
    with pytest.raises(MemoryBudgetError, match=r"offload 'block''s pinned staging buffers needs about"):
        pool.handle(deep_package, offload="block", **kw).encode_prompt("a cat", guidance_scale=1.0)
    with pytest.raises(Reached):  # the weights alone fit
        pool.handle(deep_package, offload="model", **kw).encode_prompt("a cat", guidance_scale=1.0)
    pool = PipelinePool(budget=weights + pins, headroom=0)
    with pytest.raises(Reached):
        pool.handle(deep_package, offload="block", **kw).encode_prompt("a cat", guidance_scale=1.0)


@pytest.mark.parametrize("pinned_gb", ["0", "1000", "0.0001"])
def test_the_host_is_told_the_staging_buffers_and_the_pinned_homes_before_placement(deep_package, monkeypatch, pinned_gb):
    """Issue 31 item 11: before a ``block`` pipeline is placed on CUDA the host's placing hook (ComfyUI's
    ``pins_required``) gets the staging buffers plus the homes that the pin budget lets it pin: none with
    ``LINGBOT_PINNED_GB=0``, every weight with a budget larger than them, the budget itself in between."""
    import lingbot_core.pipeline_pool as pp
    from lingbot_core import PipelinePool

    class Reached(Exception):
        pass

    class Observer:
        def __init__(self):
            self.pins = []

        def placing(self, pins):
            self.pins.append(pins)

    def no_load(*a, **k):
        raise Reached

    monkeypatch.setenv("LINGBOT_PINNED_GB", pinned_gb)
    monkeypatch.setattr(host_memory, "_SHARED", None)  # the process's budget, as read from this environment
    monkeypatch.setattr(pp, "load_pipeline", no_load)
    pool = PipelinePool(headroom=0)
    pool.observer = Observer()
    handle = pool.handle(deep_package, offload="block", device="cuda:0", dtypes={"transformer": "fp32", "text_encoder": "fp32"})
    with pytest.raises(Reached):
        handle.encode_prompt("a cat", guidance_scale=1.0)
    staging, weights = pool.pin_bytes(handle.spec), pool.weight_bytes(handle.spec)
    homes = {"0": 0, "1000": weights, "0.0001": int(0.0001 * 1024 ** 3)}[pinned_gb]
    assert staging > 0 and pool.observer.pins == [staging + homes]
    # what another pipeline already pinned is not offered again: the host is told what the budget has left
    budget = host_memory.shared_pin_budget()
    budget.used = budget.total // 2
    with pytest.raises(Reached):
        handle.encode_prompt("a cat", guidance_scale=1.0)
    assert pool.observer.pins[-1] == staging + min(budget.total - budget.total // 2, weights)


def test_changing_blocks_on_gpu_on_a_pipeline_already_in_block_mode(deep_package):
    """A loader whose blocks_on_gpu changed gives a new handle on the same loaded weights: the next stage
    streams with the new K (and LazyPipeline.set_offload does the same)."""
    from lingbot_core import PipelinePool

    def streamed(pipe):
        return [i for i, b in enumerate(pipe.transformer.blocks) if hasattr(b, "_hf_hook")]

    pool = PipelinePool(headroom=0)
    first = pool.handle(deep_package, offload="block", device="cpu", blocks_on_gpu=1)
    first.generate("a cat", **dict(RUN, steps=1))
    with pool.use(first) as pipe:
        assert streamed(pipe) == list(range(1, DEPTH)) and pipe.blocks_on_gpu == 1
    second = pool.handle(deep_package, offload="block", device="cpu", blocks_on_gpu=4)
    second.generate("a cat", **dict(RUN, steps=1))
    with pool.use(second) as pipe2:
        assert pipe2 is pipe and streamed(pipe) == [4, 5] and pipe.blocks_on_gpu == 4
    second.set_offload("block", blocks_on_gpu=0)
    with pool.use(second):
        assert streamed(pipe) == list(range(DEPTH))
    assert len(pool.loaded()) == 1
    pool.release_idle()


def test_block_ring_carries_fp8_moe_blocks(packages):
    """The MoE's raw expert stacks and the fp8 scales are weights like any other: through the ring on
    the fake device the fp8 MoE gives the frames of offload none."""
    pipe = load_pipeline(packages["moe"], device="cpu", dtypes={"transformer": "fp8_e4m3fn"})
    run = dict(RUN, steps=1, output_type="latent")
    try:
        reference = pipe.generate("a cat", **run)
        pipe.set_offload("block", blocks_on_gpu=0)
        pins = PinCounter()
        _, seen, (latent,) = ring_run(pipe, pins, runs=1, **run)
        assert len(pins.calls) == 2 and seen and all(inside and equal for inside, equal in seen)
        torch.testing.assert_close(latent, reference, rtol=0, atol=1e-4)
    finally:
        pipe.release()


def test_host_memory_is_pinned_in_one_place_only():
    """The ring's counts above see every pin only if nothing pins elsewhere: no ``pin_memory`` or
    ``cudaHostRegister`` in the core outside ``host_memory.py``. Off CUDA a buffer is plain memory."""
    from pathlib import Path

    core = Path(host_memory.__file__).parent
    offenders = [p.name for p in core.glob("*.py") if p.name != "host_memory.py"
                 and any(w in p.read_text(encoding="utf-8") for w in ("pin_memory", "cudaHostRegister", "cudaHostAlloc"))]
    assert offenders == []
    buf = host_memory.pinned_buffer(1000)
    assert buf.tensor.numel() == 1000 and buf.pinned == torch.cuda.is_available()
    buf.free()
    assert buf.tensor is None and not buf.pinned


# ---------------------------------------------------------------------------------------------
# Issue 24 item 1 / issue 25 items 10, 11: the staging thread and the events, with recorded streams
# ---------------------------------------------------------------------------------------------


def stream_run(pipe, streams, pin_budget=0, pins=None, **run):
    """One generate with the streamer on the fake ``cuda:3`` and ``streams`` (a RecordingStreams) as its
    CUDA streams, homes pinned within ``pin_budget`` bytes: the staging thread and every event run for real. Returns the frames and, per streamed
    block call, whether its weights equalled their homes when its first Linear read them."""
    from support.fake_streams import RecordingStreams  # noqa: F401  (the type the caller passes)

    streamer = pipe.transformer._hf_hook
    streamer.execution_device, streamer.streams = FAKE, streams
    pipe.offloader.pins = host_memory.PinBudget(pin_budget)
    homes = {id(p): p.data.clone() for p in pipe.transformer.parameters()}
    used = []

    def probe(block):
        return lambda m, a: used.append(all(torch.equal(p, homes[id(p)]) for p in block.parameters()))

    handles = [b.attn.to_q.register_forward_pre_hook(probe(b)) for b in pipe.transformer.blocks if hasattr(b, "_hf_hook")]
    try:
        with mock.patch.object(host_memory, "pinned_buffer", pins or PinCounter()), fake_accelerator(pipe), \
                reporting_releases(streams):
            frames = pipe.generate("a cat", **run)
    finally:
        for h in handles:
            h.remove()
    return frames, used


def reporting_releases(streams):
    """The ring tells ``streams`` (a RecordingStreams) which device buffers it drops, when it drops them."""
    orig = BlockRing.release_device

    def release_device(ring):
        if ring.streams is streams:  # another streamer's ring (on other streams) is not this stand-in's business
            streams.released([slot.buffer for slot in ring.device_slots + ring.whole_slots])
        return orig(ring)

    return mock.patch.object(BlockRing, "release_device", release_device)


def staging_refills_waited(calls) -> bool:
    """Each copy out of a staging buffer after its first is preceded, since the previous copy out of the
    same buffer, by a host wait on the event recorded right after that previous copy."""
    last_event, since, pending = {}, {}, None
    for i, (call, n, ptr) in enumerate(calls):
        if call == "copy_on_side":
            if ptr in last_event and ("host_waits", last_event[ptr], None) not in calls[since[ptr]:i]:
                return False
            pending, since[ptr] = ptr, i
        elif call == "record_side" and pending is not None:
            last_event[pending], pending = n, None
    return True


@pytest.mark.parametrize("k", [0, 2])
def test_staging_thread_overlaps_and_waits(deep_package, deep_reference, test_image, k):
    """The ring's copies run on the staging thread; compute waits for each block's copy, the staging
    thread waits for the copy out of a staging buffer before refilling it, and the stage's last forward
    prefetches nothing: exactly one copy per streamed block per step (CFG lockstep)."""
    from support.fake_streams import RecordingStreams

    pipe = load_pipeline(deep_package, offload="block", device="cpu", blocks_on_gpu=k)
    try:
        streams = RecordingStreams()
        frames, used = stream_run(pipe, streams, image=test_image, **RUN)
        assert len(used) == (DEPTH - k) * RUN["steps"] * 2 and all(used)  # both CFG branches of every block ran on its own weights
        np.testing.assert_allclose(frames, deep_reference, rtol=0, atol=1e-4)
        assert streams.violations == []  # no wait on an unrecorded event, no staging buffer refilled in flight
        assert streams.copy_threads == {"lingbot-staging_0"}  # never the thread that runs the DiT
        assert staging_refills_waited(streams.calls)
        streamer = pipe.transformer._hf_hook
        copies = [c for c in streams.calls if c[0] == "copy_on_side"]
        core_chunks = -(-streamer.core.span // streamer.ring.slot_bytes)  # issue 31 item 11: resident weights staged too
        assert core_chunks >= 2
        # item 8: no block 0 prefetched after the last block
        assert len(copies) == (DEPTH - k) * RUN["steps"] + core_chunks
        waits = [c for c in streams.calls if c[0] == "compute_waits"]
        assert len(waits) == (DEPTH - k) * RUN["steps"] + 1  # compute waited for every block and for the core
    finally:
        pipe.release()


def test_pinned_buffers_lock_their_own_pages_and_unlock_when_dropped():
    """Issue 24 item 9: two small staging buffers never share a locked page (CUDA refuses to register a
    page twice), and a buffer dropped without ``free()`` is unlocked by its finalizer. The CUDA calls
    are replaced by recorders (no GPU here); everything else is the real allocation."""
    registered, unregistered = [], []

    def register(ptr, nbytes):
        registered.append((ptr, nbytes))
        return 0

    page = host_memory.PAGE
    with mock.patch.object(host_memory, "_register", register), \
            mock.patch.object(host_memory, "_unregister", lambda ptr, raw: unregistered.append(ptr)), \
            mock.patch.object(torch.cuda, "is_available", return_value=True):
        a, b = host_memory.pinned_buffer(100), host_memory.pinned_buffer(3 * page + 1)
        assert a.pinned and b.pinned and a.tensor.numel() == 100 and b.tensor.numel() == 3 * page + 1
        assert [n for _, n in registered] == [page, 4 * page]
        assert all(ptr % page == 0 for ptr, _ in registered)
        (pa, na), (pb, nb) = registered
        assert pa + na <= pb or pb + nb <= pa  # disjoint pages
        assert a.tensor.data_ptr() == pa and b.tensor.data_ptr() == pb
        a.tensor.fill_(7)
        b.free()
        assert unregistered == [pb] and b.tensor is None
        del a
        gc.collect()
        assert unregistered == [pb, pa]


# ---------------------------------------------------------------------------------------------
# Issue 31 item 5 / issue 28: the ring's stage end under an interrupt, the text encoder under block's
# reset, the expected forwards outside lockstep, and the host's cancel check between blocks
# ---------------------------------------------------------------------------------------------


def copies_synchronised_before_release(calls) -> bool:
    """Every side-stream copy is followed by a ``synchronize`` before the next release of the buffers."""
    unsynced = False
    for call, _, _ in calls:
        if call == "copy_on_side":
            unsynced = True
        elif call == "synchronize":
            unsynced = False
        elif call == "released" and unsynced:
            return False
    return True


def test_interrupt_inside_a_staging_wait_still_drains_the_job(deep_package, test_image):
    """Issue 31 item 5: an exception raised *into* the compute thread's wait on a staging job (Ctrl-C on the
    CLI's main thread; here ``Future.result`` raises KeyboardInterrupt while the job for block 1 is still
    held back) must not lose the job: the stage's end waits for it, so its copy is queued before the side
    stream is synchronised and the device buffers are released, never into a released buffer."""
    import threading
    from concurrent.futures import Future

    from support.fake_streams import RecordingStreams
    from lingbot_core.memory import block_streaming

    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    try:
        streams = RecordingStreams()
        released = threading.Event()  # the held-back job runs once the buffers are released (or after 2 s)
        orig_stage, orig_result, orig_release = block_streaming._stage, Future.result, BlockRing.release_device
        state = {"held": False, "armed": False, "fired": False}

        def stage(ring, streams_, unit, *a):
            if unit.label == "block1" and not state["held"]:  # the first copy of block 1: held back
                state["held"] = True
                released.wait(timeout=2.0)
            return orig_stage(ring, streams_, unit, *a)

        def result(self, timeout=None):
            if state["armed"] and not state["fired"] and threading.current_thread() is threading.main_thread():
                state["fired"] = True
                raise KeyboardInterrupt  # lands inside the wait, the job still running
            return orig_result(self, timeout)

        def release_device(ring):
            if state["fired"]:  # the interrupted stage's end (earlier stages release too)
                released.set()
            return orig_release(ring)

        def arm(module, args):  # before block 1 waits for its copy
            state["armed"] = module is pipe.transformer.blocks[1]

        handles = [b.register_forward_pre_hook(arm) for b in pipe.transformer.blocks]
        try:
            with mock.patch.object(block_streaming, "_stage", stage), mock.patch.object(Future, "result", result), \
                    mock.patch.object(BlockRing, "release_device", release_device):
                with pytest.raises(KeyboardInterrupt):
                    stream_run(pipe, streams, image=test_image, **RUN)
                ring = pipe.transformer._hf_hook.ring
                ring._worker.submit(lambda: None).result()  # let a lost job finish before judging
        finally:
            for h in handles:
                h.remove()
        assert state["fired"] and state["held"]
        assert streams.violations == []  # no copy into a released buffer
        assert copies_synchronised_before_release(streams.calls)
        assert ring.device_slots == [] and all(not u.on_device for u in pipe.transformer._hf_hook.streamed)
    finally:
        pipe.release()


def test_stage_end_synchronises_the_side_stream_before_dropping_buffers(deep_package, test_image):
    """Issue 28: the buffers are dropped only after every copy on the side stream is known complete (the
    fake streams check it at each release), and no copy ever lands in a released buffer."""
    from support.fake_streams import RecordingStreams

    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    try:
        streams = RecordingStreams()
        stream_run(pipe, streams, image=test_image, **RUN)
        assert ("released", None, None) in streams.calls
        assert streams.violations == [] and copies_synchronised_before_release(streams.calls)
    finally:
        pipe.release()


def test_block_reset_puts_back_a_failed_text_encoder_layer(deep_package, test_image):
    """Issue 28, issue 31 item 10: under ``block`` the text encoder streams its layers through a ring; a prompt
    encode that raises mid-forward leaves the layers in the ring's device buffers unless the stage's reset
    sends them home (their CPU tensors, with their values)."""
    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    try:
        layer = pipe.text_encoder.model.language_model.layers[1]
        homes = {name: p.detach().clone() for name, p in layer.named_parameters()}
        in_ring = []

        def fail(*args, **kwargs):
            ring = pipe.text_encoder._hf_hook.ring
            slots = [(s.buffer.data_ptr(), s.buffer.data_ptr() + s.buffer.numel()) for s in ring.device_slots]
            in_ring.append(all(any(lo <= p.data_ptr() < hi for lo, hi in slots) for p in layer.parameters()))
            raise RuntimeError("mid-encode failure")

        with fake_accelerator(pipe):
            pipe.offloader.pins = host_memory.PinBudget(0)
            with mock.patch.object(layer.mlp, "forward", side_effect=fail):
                with pytest.raises(RuntimeError, match="mid-encode"):
                    pipe.generate("a cat", image=test_image, **RUN)
            assert in_ring == [True]  # the layer computed from a ring buffer on the device
            assert pipe.offloader.resident() == []
            for name, p in layer.named_parameters():  # home again, with its values
                assert pipe.text_encoder._hf_hook.ring.device_slots == []
                assert torch.equal(p, homes[name])
                assert not any(p.data_ptr() == s.buffer.data_ptr() for s in pipe.text_encoder._hf_hook.ring.whole_slots)
    finally:
        pipe.release()


@pytest.mark.parametrize("windows", [{}, dict(num_frames=13, steps=1, context_frames=9, context_overlap=4,
                                                output_type="latent")], ids=["one clip", "two context windows"])
def test_block_prefetches_block_0_across_forwards_outside_lockstep(deep_package, test_image, windows):
    """Issue 28: with CFG lockstep off every step makes two DiT forwards (per context window: 13 frames in
    windows of 9 sharing 4 are two windows); the stage expects all of them, so block 0 is prefetched after
    the last block of every forward but the stage's last one."""
    pipe = load_pipeline(deep_package, offload="block", device="cpu", cfg_lockstep=False)
    try:
        streamer = pipe.transformer._hf_hook
        prefetched = []
        orig = streamer.before_block

        def before_block(j):
            orig(j)
            if j == len(streamer.streamed) - 1:
                prefetched.append(streamer.streamed[0].on_device)

        with mock.patch.object(streamer, "before_block", before_block), fake_accelerator(pipe):
            streamer.execution_device = FAKE
            pipe.generate("a cat", image=test_image, **{**RUN, **windows})
        forwards = {**RUN, **windows}["steps"] * 2 * (2 if windows else 1)
        assert prefetched == [True] * (forwards - 1) + [False]
    finally:
        pipe.release()


def test_interrupt_between_streamed_blocks_drains_and_leaves_nothing(deep_package, deep_reference, test_image):
    """Issue 31 item 17: the host's cancel check (``callback.interrupt``, ComfyUI's in the nodes) runs before
    each streamed block: a cancel mid-step stops at the next block, after draining the copies in flight,
    with nothing left on the device; the next run gives the reference frames."""
    from support.fake_streams import RecordingStreams

    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    try:
        streams = RecordingStreams()
        checks = []

        class Cancelled(Exception):
            pass

        def interrupt():
            checks.append(1)
            if len(checks) == DEPTH + 3:  # step 1, inside the second forward's (the negative's) blocks
                raise Cancelled("processing interrupted")

        def callback(i, n, x0):
            pass

        callback.interrupt = interrupt
        with ResidencyTracker(pipe) as tr:
            with pytest.raises(Cancelled):
                stream_run(pipe, streams, image=test_image, callback=callback, **RUN)
            assert tr.current() == frozenset() and tr.blocks_resident() == set()
        assert len(checks) == DEPTH + 3  # checked before every streamed block, and it stopped at once
        assert streams.violations == [] and copies_synchronised_before_release(streams.calls)
        streamer = pipe.transformer._hf_hook
        assert streamer.interrupt is None and streamer.ring.device_slots == []
        streamer.execution_device, streamer.streams = torch.device("cpu"), None  # off the fake device again
        np.testing.assert_array_equal(pipe.generate("a cat", image=test_image, **RUN), deep_reference)
    finally:
        pipe.release()


def test_settle_keeps_a_job_whose_wait_was_interrupted():
    """Issue 31 item 5: an exception raised into ``settle``'s wait (the job still running) leaves the job
    pending, so a later drain still waits for it; once it has finished it is forgotten."""
    import threading
    from concurrent.futures import Future, ThreadPoolExecutor

    from lingbot_core.memory.block_streaming import _DeviceSlot

    slot = _DeviceSlot(torch.empty(8, dtype=torch.uint8))
    gate = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        job = pool.submit(gate.wait, 10)
        slot.pending = job
        with mock.patch.object(Future, "result", side_effect=KeyboardInterrupt):
            with pytest.raises(KeyboardInterrupt):
                slot.settle(reraise=True)
        assert slot.pending is job
        gate.set()
        slot.settle(reraise=False)
        assert slot.pending is None and job.done()


def test_drain_is_a_barrier_for_jobs_whose_handle_was_lost():
    """Issue 31 item 5: ``drain`` waits for every job submitted to the staging thread, also one no buffer
    holds any more, before it synchronises the side stream: the job's copy is queued first."""
    import threading

    from support.fake_streams import RecordingStreams

    ring = BlockRing(64, 2)
    ring.streams = streams = RecordingStreams()
    gate = threading.Event()
    dst, src = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)

    def late_copy():
        gate.wait(0.5)  # still running when the stage ends
        streams.copy_on_side(dst, src)
        streams.record_side(streams.event())

    from concurrent.futures import ThreadPoolExecutor

    ring._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lingbot-staging")
    try:
        ring._worker.submit(late_copy)  # its handle is nowhere: as after an interrupted settle
        ring.drain()
        names = [c[0] for c in streams.calls]
        assert "copy_on_side" in names and names.index("copy_on_side") < names.index("synchronize")
        assert torch.equal(dst, src)  # the copy landed before the stage end returned
    finally:
        gate.set()
        ring.release_host()


# ---------------------------------------------------------------------------------------------
# Issue 31 items 10, 11: the text encoder through a ring, resident weights staged, pinned homes
# ---------------------------------------------------------------------------------------------


def sources(streams, buffers) -> list:
    """Per ``copy_on_side``, the index in ``buffers`` (pinned host buffers) its source lies in, else None."""
    starts = [b.tensor.untyped_storage().data_ptr() if b.tensor is not None else None for b in buffers]
    return [starts.index(ptr) if ptr in starts else None for call, _, ptr in streams.calls if call == "copy_on_side"]


def test_pinned_homes_are_copied_from_directly_within_the_budget(deep_package, deep_reference, test_image):
    """With room for three blocks in the pin budget, the first three streamed DiT blocks get pinned homes: the
    ring copies them to the device from there (no staging buffer, no host memcpy), the others through the
    staging buffers; the frames are those of offload none, the homes keep their values, and leaving block
    mode unlocks every pinned byte with the weights unchanged."""
    from support.fake_streams import RecordingStreams

    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    pins = PinCounter()
    try:
        streamer = pipe.transformer._hf_hook
        spans = [u.span for u in streamer.streamed]
        values = {id(p): p.detach().clone() for p in pipe.transformer.parameters()}
        streams = RecordingStreams()
        frames, used = stream_run(pipe, streams, pin_budget=sum(spans[:3]) + 1000, pins=pins, image=test_image, **RUN)
        assert [u.pinned is not None for u in streamer.streamed] == [True] * 3 + [False] * (DEPTH - 3)
        assert streamer.core.pinned is None and pipe.offloader.pins.used == sum(spans[:3])
        homes = [u.pinned for u in streamer.streamed[:3]]
        staging = [h.pinned for h in streamer.ring.host_slots]
        assert pins.buffers[:3] == homes and len(staging) == 2  # homes pinned at the stage start, staging when needed
        per_block = sources(streams, homes + staging)  # block j's copies come from home j, the others' from staging
        assert per_block.count(0) == per_block.count(1) == per_block.count(2) == RUN["steps"]
        assert per_block.count(3) + per_block.count(4) == (DEPTH - 3) * RUN["steps"] + -(-streamer.core.span // streamer.ring.slot_bytes)
        assert streams.violations == [] and all(used)
        np.testing.assert_allclose(frames, deep_reference, rtol=0, atol=1e-4)
        for unit, home in zip(streamer.streamed[:3], homes):  # at home, the blocks' weights lie in their pinned buffers
            lo = home.tensor.data_ptr()
            assert all(lo <= t.data_ptr() < lo + home.nbytes for *_, t in unit.slots)
        te_staging = [h.pinned for h in pipe.text_encoder._hf_hook.ring.host_slots]  # the text encoder's layers
        assert sorted(pins.buffers, key=id) == sorted(homes + staging + te_staging, key=id)
        assert pipe.pinned_bytes() == sum(pins.calls)
        pipe.set_offload("none")
        assert pipe.pinned_bytes() == 0 and all(not b.pinned for b in pins.buffers) and pipe.offloader.pins.used == 0
        assert all(torch.equal(p, values[id(p)]) for p in pipe.transformer.parameters())
    finally:
        pipe.release()


def test_with_every_home_pinned_no_staging_buffer_is_made_and_nothing_is_memcpyd(deep_package, deep_reference, test_image):
    """A budget that holds both streamers' homes: every unit (DiT blocks, text-encoder layers, both resident
    parts) is copied from its pinned home, no staging buffer is allocated, and the rings' host copies are 0 s."""
    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    pins = PinCounter()
    try:
        dit, te = pipe.transformer._hf_hook, pipe.text_encoder._hf_hook
        every = sum(u.span for s in (dit, te) for u in s.units())
        with ResidencyTracker(pipe) as tr:
            _, seen, (frames,) = ring_run(pipe, pins, runs=1, pin_budget=every, image=test_image, **RUN)
        assert all(u.pinned is not None for s in (dit, te) for u in s.units())
        assert sorted(pins.calls) == sorted(u.span for s in (dit, te) for u in s.units())  # homes only
        assert dit.ring.host_slots == [] and te.ring.host_slots == []
        assert dit.ring.stats["host_copy_s"] == te.ring.stats["host_copy_s"] == 0
        assert dit.ring.stats["copies"] == DEPTH * RUN["steps"] + 1 and te.ring.stats["copies"] == 2 * 2 + 1
        assert all(inside and equal for inside, equal in seen) and tr.max_blocks_resident == 2
        np.testing.assert_allclose(frames, deep_reference, rtol=0, atol=1e-4)
    finally:
        pipe.release()


def test_text_encoder_streams_its_layers_on_the_staging_thread(deep_package):
    """The text encoder under ``block`` on the fake device with recorded streams: its layers and resident part
    go through the ring's staging thread and events, both prompts' embeddings equal offload none's, and the
    second (last) forward prefetches nothing after its last layer."""
    from support.fake_streams import RecordingStreams

    reference = load_pipeline(deep_package, device="cpu")
    try:
        want = reference.encode_prompt("a cat", guidance_scale=3.0)
    finally:
        reference.release()
    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    try:
        te = pipe.text_encoder._hf_hook
        streams = RecordingStreams()
        pipe.offloader.pins = host_memory.PinBudget(0)
        with mock.patch.object(host_memory, "pinned_buffer", PinCounter()), fake_accelerator(pipe), \
                reporting_releases(streams):
            te.streams = streams
            got = pipe.encode_prompt("a cat", guidance_scale=3.0)
        torch.testing.assert_close(got.positive, want.positive, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.negative, want.negative, rtol=0, atol=1e-5)
        layers = len(pipe.text_encoder.model.language_model.layers)
        core_chunks = -(-te.core.span // te.ring.slot_bytes)
        copies = [c for c in streams.calls if c[0] == "copy_on_side"]
        assert len(copies) == 2 * layers + core_chunks  # two forwards; no layer 0 prefetched after the last one
        assert streams.copy_threads == {"lingbot-staging_0"} and streams.violations == []
        assert staging_refills_waited(streams.calls) and copies_synchronised_before_release(streams.calls)
        assert pipe.offloader.resident() == [] and te.ring.device_slots == [] and te.ring.whole_slots == []
    finally:
        pipe.release()


def test_two_pipelines_draw_from_one_pin_budget(deep_package):
    """Issue 31 item 11: the pin budget is the process's, not each pipeline's: a base and a refiner in ``block``
    together never pin more than ``LINGBOT_PINNED_GB``. The second pipeline pins what the first left, and gets
    the first one's share once that one is released."""
    first = load_pipeline(deep_package, offload="block", device="cpu")
    second = load_pipeline(deep_package, offload="block", device="cpu")
    pins = PinCounter()
    try:
        assert first.offloader.pins is second.offloader.pins is host_memory.shared_pin_budget()
        shared = host_memory.PinBudget(0)
        for pipe in (first, second):
            pipe.offloader.pins = shared
            for s in pipe.offloader.streamers():
                s.execution_device = FAKE
        spans = [u.span for u in first.transformer._hf_hook.streamed]
        shared.total = sum(spans[:4]) + 1000  # four DiT blocks; the 1,000 bytes left hold no other unit
        with mock.patch.object(host_memory, "pinned_buffer", pins):
            with first.offloader.stage():
                pass
            with second.offloader.stage():
                pass
            pinned = [sum(u.pinned is not None for u in p.transformer._hf_hook.streamed) for p in (first, second)]
            assert pinned == [4, 0] and shared.used == sum(spans[:4])
            first.release()
            assert shared.used == 0
            with second.offloader.stage():
                pass
            assert sum(u.pinned is not None for u in second.transformer._hf_hook.streamed) == 4
    finally:
        first.release()
        second.release()


def test_pinning_is_once_per_loaded_weights_across_offload_switches(packages, tmp_path, caplog):
    """gpu-review-4 findings 4 and 7: the homes are pinned once per loaded weights. Switching block -> model ->
    block on unchanged weights pins nothing new (the buffers are kept, still locked, and the new streamers take
    them back), logs "pinned N GiB ... in S s" once and counts the seconds in ``pin_stats``; a LoRA change
    re-pins exactly the DiT blocks whose weights it replaced; offload none unlocks every kept byte."""
    import logging

    from support.lora_files import kohya_lora

    lora, _ = kohya_lora(tmp_path / "style.safetensors")
    pipe = load_pipeline(packages["dense"], offload="block", device="cpu")
    pins = PinCounter()
    try:
        pipe.offloader.pins = host_memory.PinBudget(1 << 40)
        with mock.patch.object(host_memory, "pinned_buffer", pins), \
                caplog.at_level(logging.INFO, logger="lingbot_core"):
            pipe.set_offload("block", device=FAKE)  # streamers on the fake CUDA device: their homes are pinned
            with pipe.offloader.stage():
                pass
            dit, te = pipe.transformer._hf_hook, pipe.text_encoder._hf_hook
            every = sorted(u.span for s in (dit, te) for u in s.units())
            assert sorted(pins.calls) == every and pipe.pinned_bytes() == sum(every)
            homes = {u.label: u.pinned for u in dit.units()}
            stats = dict(pipe.offloader.pin_stats)
            assert stats["pinned_bytes"] == sum(every) and stats["pinned_units"] == len(every) and stats["pin_s"] > 0
            pipe.set_offload("model")
            with pipe.offloader.stage():
                pass
            assert pipe.pinned_bytes() == sum(every)  # kept, still locked, while the model chain copies from them
            pipe.set_offload("block")
            with pipe.offloader.stage():
                pass
            dit, te = pipe.transformer._hf_hook, pipe.text_encoder._hf_hook
            assert len(pins.calls) == len(every)  # 0 new pins across the switch
            assert {u.label: u.pinned for u in dit.units()} == homes and all(b.pinned for b in pins.buffers)
            assert pipe.offloader.pin_stats["pin_s"] == stats["pin_s"]
            assert pipe.offloader.pin_stats["kept_units"] == len(every)
            lines = [r.getMessage() for r in caplog.records if "pinned" in r.getMessage() and "GiB of weights" in r.getMessage()]
            assert len(lines) == 1 and f"pinned {sum(every) / 2**30:.2f} GiB of weights" in lines[0], lines
            pipe.set_offload("block", device="cpu")  # the LoRA's deltas are formed on the execution device
            pipe.set_loras([(str(lora), 0.8)])  # replaces every targeted DiT weight (all in the blocks)
            pipe.set_offload("block", device=FAKE)
            with pipe.offloader.stage():
                pass
            dit = pipe.transformer._hf_hook
            assert sorted(pins.calls[len(every):]) == sorted(u.span for u in dit.streamed)
            assert all(not b.pinned for b in (homes[u.label] for u in dit.streamed))  # the stale buffers unlocked
            assert dit.core.pinned is homes["core"] and pipe.offloader.pins.used == pipe.pinned_bytes() - sum(
                h.pinned.nbytes for s in (dit, pipe.text_encoder._hf_hook) if s.ring for h in s.ring.host_slots)
            for unit in dit.streamed:  # the merged weights now live in the new pinned homes
                lo = unit.pinned.tensor.data_ptr()
                assert all(lo <= t.data_ptr() < lo + unit.pinned.nbytes for *_, t in unit.slots)
            pipe.set_offload("none", device="cpu")
            assert pipe.pinned_bytes() == 0 and pipe.offloader.pins.used == 0 and not any(b.pinned for b in pins.buffers)
    finally:
        pipe.release()


def _comfy_memory_with(monkeypatch, mm):
    """``nodes/comfy_memory.py`` imported against a fake ``comfy.model_management`` (``mm``): the pack's package
    is stood in for, and its ``lingbot_core`` is this process's, so the budget it wires is the one the tests see."""
    import importlib
    import sys
    import types
    from pathlib import Path

    import lingbot_core

    repo = Path(__file__).resolve().parents[2]
    pack = types.ModuleType("fake_pack")
    pack.__path__ = [str(repo)]
    nodes = types.ModuleType("fake_pack.nodes")
    nodes.__path__ = [str(repo / "nodes")]
    comfy = types.ModuleType("comfy")
    comfy.model_management = mm
    for name, module in (("fake_pack", pack), ("fake_pack.nodes", nodes), ("comfy", comfy),
                         ("comfy.model_management", mm)):
        monkeypatch.setitem(sys.modules, name, module)
    for name in [n for n in sys.modules if n == "lingbot_core" or n.startswith("lingbot_core.")]:
        monkeypatch.setitem(sys.modules, "fake_pack." + name, sys.modules[name])
    monkeypatch.delitem(sys.modules, "fake_pack.nodes.comfy_memory", raising=False)
    assert lingbot_core  # the aliases above point at it
    return importlib.import_module("fake_pack.nodes.comfy_memory")


def _pinning_pipe(deep_package, budget):
    """A pipeline in offload ``block`` drawing from the pin budget ``budget``, its streamers on the fake accelerator
    (so its stages pin), and its streamed DiT blocks' spans; the budget is set to the six DiT blocks' spans and
    1,000 bytes more (nothing else fits in them)."""
    pipe = load_pipeline(deep_package, offload="block", device="cpu")
    assert pipe.offloader.pins is budget
    for s in pipe.offloader.streamers():
        s.execution_device = FAKE
    spans = [u.span for u in pipe.transformer._hf_hook.streamed]
    budget.total = sum(spans[:6]) + 1000
    return pipe, spans


def test_pins_are_given_back_at_stage_start_when_available_ram_falls_below_the_headroom(deep_package, monkeypatch, caplog):
    """The pin budget keeps PIN_HEADROOM of RAM available: when available RAM falls below it after the homes were
    pinned (the host is short of memory), the next stage start unlocks the homes missing from it, streamed
    blocks from the last, nothing else pinning (no ComfyUI pins here)."""
    import logging

    gib = 1024 ** 3
    ram = {"available": 64 * gib}
    monkeypatch.setattr(host_memory, "available_ram", lambda: ram["available"])
    budget = host_memory.PinBudget(0, headroom=4 * gib)
    monkeypatch.setattr(host_memory, "_SHARED", budget)
    pipe, spans = _pinning_pipe(deep_package, budget)
    pins = PinCounter()
    try:
        dit = pipe.transformer._hf_hook
        with mock.patch.object(host_memory, "pinned_buffer", pins):
            with pipe.offloader.stage():
                pass
            assert len(spans) == 6 and [u.pinned is not None for u in dit.streamed] == [True] * 6
            ram["available"] = 4 * gib - sum(spans[3:6]) + 1  # three blocks' worth (less a byte) short of the headroom
            with caplog.at_level(logging.INFO, logger="lingbot_core"), pipe.offloader.stage():
                assert [u.pinned is not None for u in dit.streamed] == [True] * 3 + [False] * 3
                assert budget.used == sum(spans[:3])
        assert any("unlocked" in r.getMessage() and "RAM headroom" in r.getMessage() for r in caplog.records)
        assert [b.pinned for b in pins.buffers] == [True] * 3 + [False] * 3
    finally:
        pipe.release()


def test_comfyuis_own_pins_lower_the_pin_budget_and_are_given_back_at_stage_start(deep_package, monkeypatch, caplog):
    """gpu-review-4 finding 11: ComfyUI's ``TOTAL_PINNED_MEMORY`` (its own pinned models; it does not count ours) is
    taken off the pack's pin budget when the pool is made. What is pinned is re-checked at every stage start:
    after ComfyUI pinned more, the homes over the lowered limit are unlocked (the weights stay, the frames too);
    a counter that raises, or none at all, fails nothing and counts 0."""
    import logging
    import types

    mm = types.ModuleType("comfy.model_management")
    mm.TOTAL_PINNED_MEMORY = 0
    monkeypatch.setattr(host_memory, "_SHARED", host_memory.PinBudget(0, headroom=0))
    cm = _comfy_memory_with(monkeypatch, mm)
    cm.pipe_pool()
    budget = host_memory.shared_pin_budget()
    assert budget.pinned_elsewhere == cm.comfy_pinned_bytes
    pipe, spans = _pinning_pipe(deep_package, budget)
    pins = PinCounter()
    try:
        mm.TOTAL_PINNED_MEMORY = spans[0] + spans[1]  # ComfyUI has pinned two blocks' worth
        with mock.patch.object(host_memory, "pinned_buffer", pins):
            with pipe.offloader.stage():
                pass
            dit = pipe.transformer._hf_hook
            assert [u.pinned is not None for u in dit.streamed][:6] == [True] * 4 + [False] * 2
            assert budget.used == sum(spans[:4]) and budget.left() == 1000
            mm.TOTAL_PINNED_MEMORY += spans[0] + spans[1] + spans[2]  # ComfyUI pins three blocks more
            with caplog.at_level(logging.INFO, logger="lingbot_core"), pipe.offloader.stage():
                assert budget.used <= budget.limit() == sum(spans[:6]) + 1000 - sum(spans[:2]) - sum(spans[:3])
                assert [u.pinned is not None for u in dit.streamed][:4] == [True, False, False, False]
            assert any("unlocked" in r.getMessage() and "pinned weights" in r.getMessage() for r in caplog.records)
            assert [b.pinned for b in pins.buffers] == [True, False, False, False]
        mm.TOTAL_PINNED_MEMORY = "many"  # not a number: int() raises inside the guard
        assert cm.comfy_pinned_bytes() == 0
        del mm.TOTAL_PINNED_MEMORY  # an older or newer ComfyUI without the counter
        assert cm.comfy_pinned_bytes() == 0 and budget.limit() == budget.total
        with pipe.offloader.stage():  # the node path still runs
            pass
    finally:
        pipe.release()
