"""The video-to-video schedule (issue 39): ``denoise`` as ComfyUI's KSampler has it. Expected grids are
computed here from the documented rules alone: the FlowUniPC grid sigma = s b / (1 + (s - 1) b) with
b = linspace(float32(0.999), 0, N + 1)[:-1] (docs/lingbot-video-model.md), and KSampler's rule: a grid of
N = int(steps / denoise) steps, of which the last ``steps`` are sampled."""

import numpy as np
import pytest

from lingbot_core.sampling.scheduling import sampler_sigmas


def flow_grid(n, shift=3.0):
    b = np.linspace(float(np.float32(0.999)), 0.0, n + 1)[:-1]  # the reference's fp32 sigma_max
    return shift * b / (1 + (shift - 1) * b)


# steps 20: N = 66, 40, 22; the start is the grid's sigma at N - 20.
@pytest.mark.parametrize("denoise,total,start", [(0.3, 66, 0.565685), (0.5, 40, 0.749625), (0.9, 22, 0.967398)])
def test_steps_20_run_20_steps_from_the_ksampler_point(denoise, total, start):
    got = sampler_sigmas("unipc", 20, 3.0, None, denoise)
    want = flow_grid(total)[total - 20:]
    assert len(got) == 20
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert abs(got[0] - start) < 1e-6


def test_denoise_one_is_the_reference_grid_exactly():
    for steps, shift in ((40, 3.0), (8, 5.0), (1, 3.0)):
        assert np.array_equal(sampler_sigmas("unipc", steps, shift, None, 1.0), sampler_sigmas("unipc", steps, shift))
        assert np.array_equal(sampler_sigmas("euler", steps, shift), flow_grid(steps, shift))


def test_other_shift_and_the_dmd_grid_follow_the_same_rule():
    np.testing.assert_allclose(sampler_sigmas("euler", 4, 5.0, None, 0.5), flow_grid(8, 5.0)[4:], rtol=0, atol=1e-12)
    b = np.linspace(1.0, 1e-3, 17)[:-1]  # the DMD student's grid (16 steps for 8 at denoise 0.5)
    dmd = 3 * b / (1 + 2 * b)
    dmd[0] -= 1e-6
    np.testing.assert_allclose(sampler_sigmas("dmd_student", 8, 3.0, None, 0.5), dmd[8:], rtol=0, atol=1e-12)


def test_explicit_sigmas_run_as_given_and_a_tiny_denoise_is_refused():
    assert sampler_sigmas("unipc", 20, 3.0, [0.6, 0.4, 0.2], 0.3).tolist() == [0.6, 0.4, 0.2]
    with pytest.raises(ValueError, match="denoise >= 0.01"):
        sampler_sigmas("unipc", 1000, 3.0, None, 0.001)
