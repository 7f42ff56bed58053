"""End to end on the tiny fixture packages: T2V, T2I, TI2V, MoE, refiner; determinism, RNG draw order,
guidance, errors and callbacks (model doc §7-§10; test-fixtures §10)."""

import numpy as np
import pytest
import torch

from lingbot_core import load_pipeline
from lingbot_core.model.latents import resize_frames
from lingbot_core.model.refiner import first_frame_pixels, refiner_frame_indices
from lingbot_core.sampling.scheduling import refiner_sigmas, timesteps_from_sigmas

from support.alike_layout import align_alike

H, W, F = 64, 96, 5
BASE = dict(height=H, width=W, num_frames=F, steps=2)
REFINE = dict(height=64, width=128, steps=3, tile_size=(32, 32), tile_stride=(24, 24))


@pytest.fixture(scope="module")
def moe(packages):
    pipe = load_pipeline(packages["moe"], device="cpu")
    yield pipe
    pipe.release()


@pytest.fixture(scope="module")
def refiner(packages):
    pipe = load_pipeline(packages["moe"], transformer_subfolder="refiner", device="cpu")
    yield pipe
    pipe.release()


@pytest.fixture(scope="module")
def base_frames(moe):
    """A T2V run of the MoE base model: the refiner's input."""
    return moe.generate("a cat", seed=0, **BASE)


def _check_frames(frames, shape):
    assert isinstance(frames, np.ndarray)
    assert frames.shape == shape
    assert frames.dtype == np.float32
    assert np.isfinite(frames).all()
    assert frames.min() >= 0.0 and frames.max() <= 1.0
    assert frames.std() > 0  # not a constant image


def _capture_denoise(monkeypatch, pipe):
    """Record the arguments of pipe.denoise (and still run it)."""
    seen = {}
    original = pipe.denoise

    def wrapper(embeds, latents, **kwargs):
        seen["embeds"], seen["latents"] = embeds, latents.clone()
        seen.update(kwargs)
        return original(embeds, latents, **kwargs)

    monkeypatch.setattr(pipe, "denoise", wrapper)
    return seen


def _count_dit_calls(pipe):
    calls = []
    # Text lengths of the DiT's branches in call order (a lockstep call passes both as a list).
    handle = pipe.transformer.register_forward_pre_hook(
        lambda m, a: calls.extend(t.shape[1] for t in (a[2] if isinstance(a[2], list) else [a[2]])))
    return calls, handle


# ---------------------------------------------------------------------------------------------
# Shapes and value ranges
# ---------------------------------------------------------------------------------------------


def test_t2v(dense):
    _check_frames(dense.generate("a cat", seed=0, **BASE), (F, H, W, 3))


def test_t2i(dense):
    _check_frames(dense.generate("a cat", seed=0, **dict(BASE, num_frames=1)), (1, H, W, 3))


def test_ti2v(dense, test_image):
    _check_frames(dense.generate("a cat", image=test_image, seed=0, **BASE), (F, H, W, 3))


def test_moe_t2v(moe):
    _check_frames(moe.generate("a cat", seed=0, **BASE), (F, H, W, 3))


def test_refiner(base_frames, refiner, test_image):
    refined = refiner.refine(base_frames, "a cat", first_frame=test_image, seed=0, **REFINE)
    _check_frames(refined, (F, 64, 128, 3))


def test_output_types(dense):
    latent = dense.generate("a cat", seed=0, output_type="latent", **BASE)
    assert isinstance(latent, torch.Tensor)
    assert latent.shape == (1, 16, 2, H // 8, W // 8) and latent.dtype == torch.float32
    pt = dense.generate("a cat", seed=0, output_type="pt", **BASE)
    assert isinstance(pt, torch.Tensor) and pt.shape == (F, H, W, 3)
    # Decoding the latent gives the frames of the same run.
    assert torch.equal(dense.decode(latent), pt)
    with pytest.raises(ValueError, match="output_type"):
        dense.generate("a cat", seed=0, output_type="pil", **BASE)


# ---------------------------------------------------------------------------------------------
# Determinism (test-fixtures §10)
# ---------------------------------------------------------------------------------------------


def test_same_seed_same_frames_exact(dense):
    a = dense.generate("a cat", seed=3, **BASE)
    b = dense.generate("a cat", seed=3, **BASE)
    np.testing.assert_array_equal(a, b)
    c = dense.generate("a cat", seed=4, **BASE)
    assert np.abs(a - c).max() > 1e-3


def test_two_loads_same_frames(packages, dense):
    other = load_pipeline(packages["dense"], device="cpu")
    try:
        a = dense.generate("a cat", seed=5, **BASE)
        b = other.generate("a cat", seed=5, **BASE)
    finally:
        other.release()
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_sharded_moe_equals_single_file(packages, moe):
    """Same bits in one file or in shards: equal weights, and on alike memory layouts (the two files put
    the tensors at different offsets, which CPU kernels may round differently: alike_layout) the same
    frames, bit for bit."""
    sharded = load_pipeline(packages["moe_sharded"], device="cpu")
    try:
        for name in ("transformer", "text_encoder", "vae"):
            sd_a, sd_b = getattr(moe, name).state_dict(), getattr(sharded, name).state_dict()
            assert sd_a.keys() == sd_b.keys(), name
            different = [k for k in sd_a if sd_a[k].dtype != sd_b[k].dtype or not torch.equal(sd_a[k], sd_b[k])]
            assert not different, f"{name}: {different[:5]}"
        align_alike(moe, sharded)
        a = moe.generate("a cat", seed=6, **BASE)
        b = sharded.generate("a cat", seed=6, **BASE)
    finally:
        sharded.release()
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# TI2V conditioning and RNG order (§7.5, §10)
# ---------------------------------------------------------------------------------------------


def test_ti2v_first_latent_frame_is_condition(dense, test_image):
    seed = 9
    cond = dense.encode_image(test_image, H, W)
    latent = dense.generate("a cat", condition=cond, seed=seed, output_type="latent", **BASE)
    expected = dense.normalizer.to_dit(cond.posterior.sample(torch.Generator().manual_seed(seed)))
    assert torch.equal(latent[:, :, :1], expected)
    assert not torch.equal(latent[:, :, 1:2], expected)
    # The image path and a precomputed condition give the same result.
    from_image = dense.generate("a cat", image=test_image, seed=seed, output_type="latent", **BASE)
    assert torch.equal(from_image, latent)


def test_ti2v_rng_order(monkeypatch, dense, test_image):
    seed = 11
    cond = dense.encode_image(test_image, H, W)
    seen = _capture_denoise(monkeypatch, dense)
    dense.generate("a cat", condition=cond, seed=seed, **BASE)

    g = torch.Generator().manual_seed(seed)
    post = cond.posterior.sample(g)  # draw 1: posterior eps of the first-frame encode
    noise = torch.randn(1, 16, 2, H // 8, W // 8, generator=g)  # draw 2: initial noise
    assert torch.equal(seen["latents"], noise)
    assert torch.equal(seen["condition_latent"], dense.normalizer.to_dit(post))
    # Noise drawn first would be a different tensor: the test can tell the orders apart.
    first = torch.randn(1, 16, 2, H // 8, W // 8, generator=torch.Generator().manual_seed(seed))
    assert not torch.equal(seen["latents"], first)


def test_t2v_noise_is_first_draw(monkeypatch, dense):
    seen = _capture_denoise(monkeypatch, dense)
    dense.generate("a cat", seed=12, **BASE)
    noise = torch.randn(1, 16, 2, H // 8, W // 8, generator=torch.Generator().manual_seed(12))
    assert torch.equal(seen["latents"], noise)
    assert seen["condition_latent"] is None


def test_refiner_rng_order(monkeypatch, base_frames, refiner, test_image):
    seed, t = 13, 0.85
    frames = base_frames
    seen = _capture_denoise(monkeypatch, refiner)
    refiner.refine(frames, "a cat", first_frame=test_image, seed=seed, t_thresh=t, **REFINE)

    tiling = dict(tiling=True, tile_size=REFINE["tile_size"], tile_stride=REFINE["tile_stride"])
    idx = refiner_frame_indices(F, 24.0)
    lowres = resize_frames(torch.from_numpy(frames[idx]), 64, 128)
    norm = refiner.normalizer
    g = torch.Generator().manual_seed(seed)  # fresh generator with the same seed
    x_up = norm.to_dit(refiner.encode_video(lowres, **tiling).sample(g))  # draw 1: video posterior
    pixels = first_frame_pixels(test_image, H, W, 64, 128)
    cond = norm.to_dit(refiner.encode_video(pixels, **tiling).sample(g))  # draw 2: first-frame posterior
    x_up[:, :, :1] = cond
    noise = torch.randn(x_up.shape, generator=g)  # draw 3: noise
    expected = (1 - t) * x_up + t * noise
    assert seen["latents"].shape == (1, 16, 2, 8, 16)
    torch.testing.assert_close(seen["latents"], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(seen["condition_latent"], cond, rtol=0, atol=0)
    # The schedule starts at t_thresh.
    assert seen["sigmas"][0] == pytest.approx(t)
    # Another order (noise before the first-frame draw) gives another start latent.
    g2 = torch.Generator().manual_seed(seed)
    refiner.encode_video(lowres, **tiling).sample(g2)
    wrong_noise = torch.randn(x_up.shape, generator=g2)
    assert (seen["latents"] - ((1 - t) * x_up + t * wrong_noise)).abs().max() > 1e-2


def test_refine_decodes_tiled(base_frames, refiner):
    """Refine decodes with the same tiling as its encode (the reference's refiner tiles both); with
    vae_tiling off it decodes whole frames."""
    kw = dict(REFINE, seed=3)
    latents = refiner.refine(base_frames, "a cat", output_type="latent", **kw)
    tiled = refiner.decode(latents, tiling=True, tile_size=REFINE["tile_size"], tile_stride=REFINE["tile_stride"])
    untiled = refiner.decode(latents)
    assert np.array_equal(refiner.refine(base_frames, "a cat", **kw), tiled.numpy())
    assert np.abs(tiled.numpy() - untiled.numpy()).max() > 1e-3  # tiling really happened
    latents_off = refiner.refine(base_frames, "a cat", output_type="latent", vae_tiling=False, **kw)
    assert np.array_equal(refiner.refine(base_frames, "a cat", vae_tiling=False, **kw), refiner.decode(latents_off).numpy())


# Tiled against untiled decode on the tiny random-weight VAE, 25 % overlap as the reference's 384x640 / 288x480
# tiles: measured mean |diff| 0.0171, max 0.375 (frames in [0, 1]). Random weights make sharp, high-frequency
# frames, so the seams show more than with the real VAE; the differences sit at the tile seams.
TILED_MEAN_BOUND, TILED_MAX_BOUND = 0.025, 0.45


def test_tiled_decode_within_stated_bound_of_untiled(refiner):
    latents = torch.randn(1, 16, 2, 16, 24, generator=torch.Generator().manual_seed(0))
    untiled = refiner.decode(latents)
    tiled = refiner.decode(latents, tiling=True, tile_size=(64, 96), tile_stride=(48, 72))
    assert tiled.shape == untiled.shape == (5, 128, 192, 3)
    diff = (tiled - untiled).abs()
    assert 1e-4 < diff.mean() <= TILED_MEAN_BOUND and diff.max() <= TILED_MAX_BOUND, (diff.mean(), diff.max())
    # away from the seams (the first tile's own interior) the frames agree much more closely
    assert diff[:, :32, :48].mean() < diff.mean() / 2


def test_refiner_uses_null_negative_by_default(monkeypatch, base_frames, refiner):
    frames = base_frames
    seen = _capture_denoise(monkeypatch, refiner)
    refiner.refine(frames, "a cat", seed=0, **REFINE)
    emb = seen["embeds"]
    assert emb.negative.shape == emb.positive.shape and torch.count_nonzero(emb.negative) == 0
    assert not emb.with_image  # text-only conditioning, even with a first frame
    refiner.refine(frames, "a cat", negative_prompt="blurry", seed=0, **REFINE)
    assert torch.count_nonzero(seen["embeds"].negative) > 0


# ---------------------------------------------------------------------------------------------
# Guidance
# ---------------------------------------------------------------------------------------------


def test_guidance_one_runs_without_negative(dense):
    calls, handle = _count_dit_calls(dense)
    try:
        dense.generate("a cat", seed=0, guidance_scale=1.0, **BASE)
        assert len(calls) == BASE["steps"]
        calls.clear()
        dense.generate("a cat", seed=0, guidance_scale=3.0, **BASE)
        assert len(calls) == 2 * BASE["steps"]
        # Cond first (18 text tokens), then uncond (the 909-token default video negative).
        assert calls[:2] == [18, 909]
    finally:
        handle.remove()


def test_guidance_changes_frames(dense):
    a = dense.generate("a cat", seed=0, guidance_scale=1.0, **BASE)
    b = dense.generate("a cat", seed=0, guidance_scale=3.0, **BASE)
    assert np.abs(a - b).max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_refiner_cannot_generate(refiner):
    with pytest.raises(ValueError, match="refiner"):
        refiner.generate("a cat", seed=0, **BASE)


def test_base_pipe_cannot_refine(dense):
    frames = np.zeros((5, H, W, 3), np.float32)
    with pytest.raises(ValueError, match="refiner"):
        dense.refine(frames, "a cat", **REFINE)


def test_refine_needs_five_frames(refiner):
    with pytest.raises(ValueError, match="at least 5 frames"):
        refiner.refine(np.zeros((1, H, W, 3), np.float32), "a cat", **REFINE)


def test_refine_rejects_bad_frames(refiner):
    with pytest.raises(ValueError, match=r"\(T, H, W, 3\)"):
        refiner.refine(np.zeros((5, H, W), np.float32), "a cat", **REFINE)
    bad = np.zeros((5, H, W, 3), np.float32)
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        refiner.refine(bad, "a cat", **REFINE)


def test_condition_size_mismatch(dense, test_image):
    cond = dense.encode_image(test_image, 64, 96)
    with pytest.raises(ValueError, match="64x96"):
        dense.generate("a cat", condition=cond, height=64, width=128, num_frames=5, steps=2)


def test_invalid_sizes_rejected_before_work(dense):
    calls, handle = _count_dit_calls(dense)
    try:
        with pytest.raises(ValueError, match="num_frames"):
            dense.generate("a cat", height=64, width=96, num_frames=6, steps=2)
        with pytest.raises(ValueError, match="width"):
            dense.generate("a cat", height=64, width=100, num_frames=5, steps=2)
        with pytest.raises(ValueError, match="seed"):
            dense.generate("a cat", seed=-1, **BASE)
    finally:
        handle.remove()
    assert calls == []


# ---------------------------------------------------------------------------------------------
# Callbacks
# ---------------------------------------------------------------------------------------------


def test_callback_once_per_step(dense):
    seen = []
    dense.generate("a cat", seed=0, callback=lambda i, n, x0: seen.append((i, n, tuple(x0.shape))),
                        **dict(BASE, steps=3))
    assert seen == [(0, 3, (1, 16, 2, 8, 12)), (1, 3, (1, 16, 2, 8, 12)), (2, 3, (1, 16, 2, 8, 12))]


def test_callback_last_x0_is_result(dense):
    # At the last step sigma goes to 0, so the final latent equals the last x0 estimate (up to the solver's rounding).
    x0s = []
    latent = dense.generate("a cat", seed=0, output_type="latent", callback=lambda i, n, x0: x0s.append(x0.clone()),
                                 **BASE)
    torch.testing.assert_close(x0s[-1], latent, rtol=1e-4, atol=1e-4)


def test_callback_exception_propagates_and_pipeline_recovers(dense):
    before = dense.generate("a cat", seed=1, **BASE)

    class Cancelled(Exception):
        pass

    def cancel(i, n, x0):
        if i == 1:
            raise Cancelled()

    with pytest.raises(Cancelled):
        dense.generate("a cat", seed=1, callback=cancel, **BASE)
    after = dense.generate("a cat", seed=1, **BASE)
    np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("steps, t_thresh, first_timesteps, evaluations",
                         [(8, 0.9, [900, 899], 9), (40, 0.8479, [847, 847], 29)])
def test_refine_t_thresh_sharing_first_integer_timestep(refiner, steps, t_thresh, first_timesteps, evaluations):
    """t_thresh right above a grid point (0.8479 vs 0.847457: both 847) must still start at t_thresh and
    visit every sigma once; diffusers alone would begin at the second 847 and run one step short."""
    frames = np.random.default_rng(0).random((5, H, W, 3), dtype=np.float32)
    kw = {k: v for k, v in REFINE.items() if k != "steps"}
    fed = []
    hook = refiner.transformer.register_forward_pre_hook(lambda m, a: fed.append(a[1].item()))
    try:
        out = refiner.refine(frames, "a cat", steps=steps, t_thresh=t_thresh, guidance_scale=1.0, seed=0, **kw)
    finally:
        hook.remove()
    _check_frames(out, (F, 64, 128, 3))
    sigmas = refiner_sigmas(steps, 3.0, t_thresh, 2)
    assert len(fed) == len(sigmas) == evaluations  # one DiT call per sigma (no CFG)
    assert fed[:2] == first_timesteps
    assert fed == timesteps_from_sigmas(sigmas).tolist()


def test_refine_with_explicit_sigmas_renoises_to_their_first_value(monkeypatch, refiner):
    """Sigmas "0.9, 0.6, 0.3" replace the t_thresh grid: the video is noised to 0.9, not to t_thresh 0.85."""
    frames = np.random.default_rng(1).random((F, H, W, 3), dtype=np.float32)
    seen = _capture_denoise(monkeypatch, refiner)
    refiner.refine(frames, "a cat", sigmas=[0.9, 0.6, 0.3], t_thresh=0.85, seed=5, output_type="latent",
                   guidance_scale=1.0, **REFINE)
    assert seen["sigmas"].tolist() == [0.9, 0.6, 0.3]
    tiling = dict(tiling=True, tile_size=REFINE["tile_size"], tile_stride=REFINE["tile_stride"])
    lowres = resize_frames(torch.from_numpy(frames[refiner_frame_indices(F, 24.0)]), 64, 128)
    g = torch.Generator().manual_seed(5)
    x = refiner.normalizer.to_dit(refiner.encode_video(lowres, **tiling).sample(g))
    noise = torch.randn(x.shape, generator=g)
    sigma0 = 0.9
    torch.testing.assert_close(seen["latents"], noise * sigma0 + x * (1 - sigma0), rtol=0, atol=1e-6)
