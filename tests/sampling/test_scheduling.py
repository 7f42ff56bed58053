"""Sigma grids, integer/model timesteps, the refiner schedule and the sampler loop (model doc §8, §9)."""

import numpy as np
import pytest
import torch

from lingbot_core.sampling.sampler import sample
from lingbot_core.sampling.scheduling import (
    make_scheduler, model_timestep, refiner_sigmas, shifted_sigmas, timesteps_from_sigmas,
)

# Model doc §8.1 (N = 40, s = 3), rounded to 6 places.
SIGMAS_40 = [
    0.999666, 0.991189, 0.982419, 0.973342, 0.963941, 0.954198, 0.944094, 0.93361, 0.922722, 0.911407,
    0.89964, 0.887393, 0.874635, 0.861335, 0.847457, 0.832963, 0.81781, 0.801952, 0.78534, 0.767918,
    0.749625, 0.730394, 0.710152, 0.688816, 0.666296, 0.64249, 0.617284, 0.590551, 0.562148, 0.531915,
    0.499667, 0.465196, 0.428265, 0.388601, 0.345888, 0.29976, 0.249792, 0.195482, 0.13624, 0.071361,
]
TIMESTEPS_40 = [
    999, 991, 982, 973, 963, 954, 944, 933, 922, 911, 899, 887, 874, 861, 847, 832, 817, 801, 785, 767,
    749, 730, 710, 688, 666, 642, 617, 590, 562, 531, 499, 465, 428, 388, 345, 299, 249, 195, 136, 71,
]
# Model doc §8.4: what a bf16 DiT is fed (rounded to bf16 twice).
BF16_MODEL_TIMESTEPS_40 = [
    1000, 992, 980, 972, 964, 952, 944, 932, 920, 912, 900, 888, 876, 860, 848, 832, 816, 800, 784, 764,
    752, 732, 712, 688, 664, 640, 616, 588, 564, 532, 498, 464, 428, 388, 346, 298, 249, 195, 136, 71,
]
# Model doc §9 worked example (steps 8, shift 3, t_thresh 0.85, tail 2).
REFINER_SIGMAS = [0.85, 0.832963, 0.749625, 0.64249, 0.499667, 0.29976, 0.19984, 0.09992]
REFINER_TIMESTEPS = [850, 832, 749, 642, 499, 299, 199, 99]
REFINER_BF16_MODEL_TIMESTEPS = [852, 832, 752, 640, 498, 298, 199, 99]


# ---------------------------------------------------------------------------------------------
# Grids
# ---------------------------------------------------------------------------------------------


def test_default_grid_40_steps_shift_3():
    sigmas = shifted_sigmas(40, 3.0)
    assert sigmas.shape == (40,)
    np.testing.assert_allclose(sigmas, SIGMAS_40, rtol=0, atol=1e-6)
    assert timesteps_from_sigmas(sigmas).tolist() == TIMESTEPS_40


def test_first_sigma_uses_fp32_sigma_max():
    # sigma_max = float32(0.999) = 0.9990000128746033, shifted by 3 -> 0.99966...; not 1 - 1e-6 (diffusers' grid).
    s0 = shifted_sigmas(40, 3.0)[0]
    base = 0.9990000128746033
    assert s0 == pytest.approx(3 * base / (1 + 2 * base), abs=1e-15)
    assert abs(s0 - 0.999999) > 3e-4


@pytest.mark.parametrize(
    "steps, sigmas, timesteps",
    [
        (8, [0.999666, 0.954198, 0.89964, 0.832963, 0.749625, 0.64249, 0.499667, 0.29976],
         [999, 954, 899, 832, 749, 642, 499, 299]),
        (4, None, [999, 899, 749, 499]),
        (2, None, [999, 749]),
    ],
)
def test_short_grids_shift_3(steps, sigmas, timesteps):
    grid = shifted_sigmas(steps, 3.0)
    assert len(grid) == steps
    if sigmas is not None:
        np.testing.assert_allclose(grid, sigmas, rtol=0, atol=1e-6)
    assert timesteps_from_sigmas(grid).tolist() == timesteps


def test_grid_40_steps_shift_1_is_unshifted_linspace():
    grid = shifted_sigmas(40, 1.0)
    np.testing.assert_allclose(grid[[0, 1, -1]], [0.999, 0.974025, 0.024975], rtol=0, atol=1e-6)
    t = timesteps_from_sigmas(grid)
    assert (t[0], t[1], t[-1]) == (999, 974, 24)


def test_timesteps_truncate_not_round():
    # 0.8329627... * 1000 = 832.96 -> 832 (rounding would give 833).
    assert timesteps_from_sigmas(np.array([0.8329627, 0.0999])).tolist() == [832, 99]


# ---------------------------------------------------------------------------------------------
# Timestep fed to the DiT
# ---------------------------------------------------------------------------------------------


def test_bf16_model_timesteps_are_rounded_twice():
    t = torch.tensor(TIMESTEPS_40)
    got = model_timestep(t, torch.bfloat16)
    assert got.dtype == torch.float32
    assert got.tolist() == [float(v) for v in BF16_MODEL_TIMESTEPS_40]
    # Rounding once (bf16(t/1000) * 1000 in fp32) would give 992.1875 for t = 991: not what the reference feeds.
    assert got[1].item() == 992.0


def test_fp32_model_timesteps_equal_the_integers():
    t = torch.tensor(TIMESTEPS_40 + REFINER_TIMESTEPS)
    assert model_timestep(t, torch.float32).tolist() == [float(v) for v in t.tolist()]


# ---------------------------------------------------------------------------------------------
# Refiner schedule
# ---------------------------------------------------------------------------------------------


def test_refiner_worked_example():
    sig = refiner_sigmas(8, 3.0, 0.85, 2)
    np.testing.assert_allclose(sig, REFINER_SIGMAS, rtol=0, atol=1e-6)
    t = timesteps_from_sigmas(sig)
    assert t.tolist() == REFINER_TIMESTEPS
    assert model_timestep(torch.tensor(t), torch.bfloat16).tolist() == [float(v) for v in REFINER_BF16_MODEL_TIMESTEPS]


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(tail_steps=0), [0.85, 0.832963, 0.749625, 0.64249, 0.499667, 0.29976]),
        (dict(tail_steps=1), [0.85, 0.832963, 0.749625, 0.64249, 0.499667, 0.29976, 0.14988]),
        (dict(tail_steps=3), [0.85, 0.832963, 0.749625, 0.64249, 0.499667, 0.29976, 0.22482, 0.14988, 0.07494]),
        (dict(t_thresh=0.7), [0.7, 0.64249, 0.499667, 0.29976, 0.19984, 0.09992]),
    ],
)
def test_refiner_variants(kwargs, expected):
    args = dict(steps=8, shift=3.0, t_thresh=0.85, tail_steps=2)
    args.update(kwargs)
    sig = refiner_sigmas(**args)
    np.testing.assert_allclose(sig, expected, rtol=0, atol=1e-5)


def test_refiner_40_steps():
    sig = refiner_sigmas(40, 3.0, 0.85, 2)
    assert len(sig) == 29
    np.testing.assert_allclose(sig[:3], [0.85, 0.847457, 0.832963], rtol=0, atol=1e-6)


def test_refiner_does_not_duplicate_threshold_on_grid_point():
    # t_thresh equal to a grid value (within 1e-6) is not prepended a second time.
    grid = shifted_sigmas(8, 3.0)
    sig = refiner_sigmas(8, 3.0, float(grid[3]), 0)
    np.testing.assert_array_equal(sig, grid[3:].astype(np.float32))  # float32, as handed to the scheduler


# ---------------------------------------------------------------------------------------------
# diffusers scheduler built from our grid
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sigmas",
    [shifted_sigmas(40, 3.0), shifted_sigmas(8, 3.0), refiner_sigmas(8, 3.0, 0.85, 2)],
    ids=["40", "8", "refiner"],
)
def test_make_scheduler_uses_our_grid(sigmas):
    sched = make_scheduler(sigmas)
    assert sched.timesteps.tolist() == timesteps_from_sigmas(sigmas).tolist()
    expected = np.append(sigmas.astype(np.float32), np.float32(0.0))
    assert sched.sigmas.dtype == torch.float32
    np.testing.assert_array_equal(sched.sigmas.numpy(), expected)


def test_make_scheduler_ignores_config_shift():
    sigmas = shifted_sigmas(8, 3.0)
    a = make_scheduler(sigmas, {"shift": 3.0})
    b = make_scheduler(sigmas, {"shift": 1.0})
    assert torch.equal(a.sigmas, b.sigmas)
    assert torch.equal(a.timesteps, b.timesteps)


# ---------------------------------------------------------------------------------------------
# Sampler loop with a stub DiT
# ---------------------------------------------------------------------------------------------


class ConstantVelocity:
    """A stub DiT: returns the same velocity v for any input; records what it was called with."""

    def __init__(self, v, dtype=torch.float32):
        self.v = v
        self.compute_dtype = dtype
        self.calls = []  # (timestep list, text tensor)

    def __call__(self, x, t, text, step_cache=None):
        if isinstance(text, list):  # both CFG branches in one call (lockstep)
            return [self(x, t, branch) for branch in text]
        assert x.shape == self.v.shape
        self.calls.append((t.tolist(), text))
        return self.v.to(self.compute_dtype)


@pytest.mark.parametrize("steps", [2, 8])
def test_constant_velocity_trajectory(steps):
    g = torch.Generator().manual_seed(0)
    x_T = torch.randn(1, 16, 2, 4, 6, generator=g)
    v = torch.randn(x_T.shape, generator=g)
    sigmas = shifted_sigmas(steps, 3.0)
    stub = ConstantVelocity(v)
    pos = torch.randn(1, 3, 8)
    out = sample(stub, x_T, sigmas, pos, None, guidance_scale=1.0)
    sigma0 = float(np.float32(sigmas[0]))
    torch.testing.assert_close(out, x_T - sigma0 * v, rtol=0, atol=1e-5)
    assert len(stub.calls) == steps
    assert all(text is pos for _, text in stub.calls)


def test_cfg_calls_cond_then_uncond_and_combines():
    g = torch.Generator().manual_seed(1)
    x_T = torch.randn(1, 16, 1, 4, 4, generator=g)
    v_c, v_u = torch.randn(x_T.shape, generator=g), torch.randn(x_T.shape, generator=g)
    pos, neg = torch.ones(1, 5, 8), torch.zeros(1, 7, 8)
    calls = []

    class TwoVelocities:
        compute_dtype = torch.float32

        def __call__(self, x, t, text, step_cache=None):
            if isinstance(text, list):  # both CFG branches in one call (lockstep)
                return [self(x, t, branch) for branch in text]
            calls.append((t.tolist(), text))
            return v_c if text is pos else v_u

    steps, guidance = 3, 4.0
    sigmas = shifted_sigmas(steps, 3.0)
    out = sample(TwoVelocities(), x_T, sigmas, pos, neg, guidance_scale=guidance)
    assert len(calls) == 2 * steps
    assert [c[1] is pos for c in calls] == [True, False] * steps
    # Both branches of a step see the same timestep.
    assert [c[0] for c in calls[0::2]] == [c[0] for c in calls[1::2]]
    v = v_u + guidance * (v_c - v_u)
    torch.testing.assert_close(out, x_T - float(np.float32(sigmas[0])) * v, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "dtype, expected",
    [(torch.float32, TIMESTEPS_40), (torch.bfloat16, BF16_MODEL_TIMESTEPS_40)],
    ids=["fp32", "bf16"],
)
def test_sampler_feeds_model_timesteps(dtype, expected):
    x_T = torch.zeros(1, 16, 1, 2, 2)
    stub = ConstantVelocity(torch.zeros_like(x_T), dtype=dtype)
    sample(stub, x_T, shifted_sigmas(40, 3.0), torch.zeros(1, 1, 8), None, guidance_scale=1.0)
    assert [c[0] for c in stub.calls] == [[float(v)] for v in expected]


def test_sampler_refiner_timesteps_bf16():
    x_T = torch.zeros(1, 16, 1, 2, 2)
    stub = ConstantVelocity(torch.zeros_like(x_T), dtype=torch.bfloat16)
    sample(stub, x_T, refiner_sigmas(8, 3.0, 0.85, 2), torch.zeros(1, 1, 8), None, guidance_scale=1.0)
    assert [c[0][0] for c in stub.calls] == [float(v) for v in REFINER_BF16_MODEL_TIMESTEPS]


def test_sampler_needs_negative_with_guidance():
    stub = ConstantVelocity(torch.zeros(1, 16, 1, 2, 2))
    with pytest.raises(ValueError, match="negative"):
        sample(stub, torch.zeros(1, 16, 1, 2, 2), shifted_sigmas(2, 3.0), torch.zeros(1, 1, 8), None, guidance_scale=3.0)


# ---------------------------------------------------------------------------------------------
# Invalid inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: shifted_sigmas(0, 3.0), "steps"),
        (lambda: shifted_sigmas(-3, 3.0), "steps"),
        (lambda: shifted_sigmas(8, 0.0), "shift"),
        (lambda: shifted_sigmas(8, -1.0), "shift"),
        (lambda: shifted_sigmas(8, float("nan")), "shift"),
        (lambda: shifted_sigmas(8, float("inf")), "shift"),
        (lambda: refiner_sigmas(8, 3.0, 0.0, 2), "t_thresh"),
        (lambda: refiner_sigmas(8, 3.0, 1.5, 2), "t_thresh"),
        (lambda: refiner_sigmas(8, 3.0, float("nan"), 2), "t_thresh"),
        (lambda: refiner_sigmas(8, 3.0, 0.85, -1), "tail"),
        (lambda: refiner_sigmas(0, 3.0, 0.85, 2), "steps"),
    ],
    ids=["steps0", "steps-3", "shift0", "shift-1", "shift-nan", "shift-inf", "t_thresh0", "t_thresh1.5",
         "t_thresh-nan", "tail-1", "refiner-steps0"],
)
def test_invalid_schedule_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_generate_rejects_bad_steps_and_shift(dense_pipe):
    with pytest.raises(ValueError, match="steps"):
        dense_pipe.generate("a cat", height=64, width=96, num_frames=1, steps=0)
    with pytest.raises(ValueError, match="shift"):
        dense_pipe.generate("a cat", height=64, width=96, num_frames=1, steps=2, shift=0.0)


# ---------------------------------------------------------------------------------------------
# scheduler_config.json shift is not applied a second time
# ---------------------------------------------------------------------------------------------


def test_scheduler_config_shift_is_not_applied_twice(tmp_path):
    from lingbot_core import load_pipeline
    from lingbot_core.testing.fixtures import write_package

    a = write_package(tmp_path / "shift1", fp32=True, refiner=False, seed=5, scheduler_shift=1.0)
    b = write_package(tmp_path / "shift3", fp32=True, refiner=False, seed=5, scheduler_shift=3.0)
    kw = dict(height=64, width=96, num_frames=5, steps=3, seed=7)
    pa, pb = load_pipeline(a, device="cpu"), load_pipeline(b, device="cpu")
    try:
        assert pb.scheduler_config["shift"] == 3.0
        fa, fb = pa.generate("a cat", **kw), pb.generate("a cat", **kw)
        # Different pipeline objects: compare with a tolerance (test-fixtures §10).
        np.testing.assert_allclose(fa, fb, rtol=0, atol=1e-5)
        # The shift does matter: a run with shift 9 (= 3 applied twice) gives other frames.
        f9 = pa.generate("a cat", shift=9.0, **kw)
        assert np.abs(f9 - fa).max() > 1e-3
    finally:
        pa.release()
        pb.release()


def test_sampler_handles_equal_first_integer_timesteps():
    # t_thresh 0.8479 with a 40-step grid: sigmas 0.8479, 0.847457, ... -> timesteps 847, 847, ...
    sigmas = refiner_sigmas(40, 3.0, 0.8479, 2)
    t = timesteps_from_sigmas(sigmas)
    assert t[0] == t[1] == 847
    g = torch.Generator().manual_seed(0)
    x_T = torch.randn(1, 16, 1, 2, 2, generator=g)
    v = torch.randn(x_T.shape, generator=g)
    stub = ConstantVelocity(v)
    out = sample(stub, x_T, sigmas, torch.zeros(1, 1, 8), None, guidance_scale=1.0)
    assert len(stub.calls) == len(sigmas)
    torch.testing.assert_close(out, x_T - float(np.float32(sigmas[0])) * v, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "sigmas, index, expected",
    [(refiner_sigmas(8, 3.0, 0.7, 2), 0, 700), (refiner_sigmas(8, 3.0, 0.9, 2), 0, 900),
     (shifted_sigmas(37, 1.0), 2, 945)],
    ids=["refiner-0.7", "refiner-0.9", "N37-shift1"],
)
def test_make_scheduler_integer_timesteps_not_lowered_by_fp32(sigmas, index, expected):
    assert timesteps_from_sigmas(sigmas)[index] == expected
    assert make_scheduler(sigmas).timesteps.tolist() == timesteps_from_sigmas(sigmas).tolist()
