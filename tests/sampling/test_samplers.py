"""Sampler choice for distilled models: flow Euler on an explicit sigma list, against a hand-written loop."""

import numpy as np
import pytest
import torch

from lingbot_core.model.latents import latent_shape
from lingbot_core.sampling.scheduling import check_sigmas, parse_sigmas, shifted_sigmas

PROMPT = "a lighthouse at dusk"
SIZE = dict(height=64, width=96, num_frames=5)


def hand_euler(pipe, sigmas, guidance, seed):
    """x <- x + (sigma_next - sigma) v with v = v_u + g (v_c - v_u), the DiT fed sigma * 1000 (fp32 DiT)."""
    embeds = pipe.encode_prompt(PROMPT, guidance_scale=guidance, num_frames=SIZE["num_frames"])
    gen = torch.Generator("cpu").manual_seed(seed)
    x = torch.randn(latent_shape(SIZE["num_frames"], SIZE["height"], SIZE["width"], 16), generator=gen)
    grid = list(sigmas) + [0.0]
    with torch.no_grad():
        for s, s_next in zip(grid[:-1], grid[1:]):
            t = torch.tensor([s * 1000.0])
            v = pipe.transformer(x, t, embeds.positive).float()
            if guidance > 1:
                vu = pipe.transformer(x, t, embeds.negative).float()
                v = vu + guidance * (v - vu)
            x = x + (s_next - s) * v
    return x


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_euler_on_a_given_list_matches_a_hand_written_loop(dense_pipe, guidance):
    sigmas = [1.0, 0.9, 0.75, 0.5]
    seen = []
    got = dense_pipe.generate(PROMPT, **SIZE, guidance_scale=guidance, seed=3, sampler="euler", sigmas=sigmas,
                              output_type="latent", callback=lambda i, n, x0: seen.append((i, n)))
    want = hand_euler(dense_pipe, sigmas, guidance, 3)
    assert seen == [(i, 4) for i in range(4)]
    assert (got - want).abs().max() < 1e-5
    unipc = dense_pipe.generate(PROMPT, **SIZE, guidance_scale=guidance, seed=3, sigmas=sigmas, output_type="latent")
    assert (unipc - got).abs().max() > 1e-3  # the two solvers differ


def test_explicit_sigmas_equal_to_the_grid_give_the_grid_run(dense_pipe):
    a = dense_pipe.generate(PROMPT, **SIZE, steps=3, shift=3.0, seed=1, output_type="latent")
    b = dense_pipe.generate(PROMPT, **SIZE, steps=3, seed=1, sigmas=shifted_sigmas(3, 3.0).tolist(), output_type="latent")
    assert torch.equal(a, b)


def test_four_step_grid_is_lightx2vs():
    np.testing.assert_allclose(shifted_sigmas(4, 3.0), [0.99967, 0.89964, 0.74962, 0.49967], atol=1e-5)


@pytest.mark.parametrize("bad", [[0.9, 1.0], [1.0, 0.5, 0.0], [1.2, 0.5], [0.5, 0.5], [], [float("nan")]])
def test_bad_sigma_lists_are_refused(bad):
    with pytest.raises(ValueError, match="sigmas"):
        check_sigmas(bad)


def test_sigma_text_and_sampler_name(dense_pipe):
    np.testing.assert_array_equal(parse_sigmas("1.0, 0.9 0.75,0.5"), [1.0, 0.9, 0.75, 0.5])
    assert parse_sigmas("  ") is None
    with pytest.raises(ValueError, match="not numbers"):
        parse_sigmas("1.0, x")
    with pytest.raises(ValueError, match="sampler='ddim'"):
        dense_pipe.generate(PROMPT, **SIZE, sampler="ddim")


@pytest.mark.parametrize("sampler", ["unipc", "euler", "dmd_student"])
def test_the_dits_timesteps_go_to_the_device_once_per_stage(sampler):
    """gpu-review-4 finding 13: the DiT's timestep tensor is built and moved to the latents' device once for the
    whole loop (one ``.to`` from the sampler, not one per step), and each step's value is the reference's
    rounding for a bf16 DiT: ``t / 1000`` in bf16, times 1000 in bf16 (999 -> 1000, 991 -> 992)."""
    from support.fake_accelerator import recording_transfers

    from lingbot_core.sampling.sampler import sample
    from lingbot_core.sampling.scheduling import make_sampler

    class Dit:
        compute_dtype = torch.bfloat16

        def __init__(self):
            self.seen = []

        def __call__(self, x, t_model, context, step_cache=None):
            self.seen.append(t_model.clone())
            return torch.zeros_like(x)

    sigmas = shifted_sigmas(6, 3.0)
    dit = Dit()
    x = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with recording_transfers() as transfers:
        sample(dit, x, sigmas, torch.zeros(1, 3, 8), None, guidance_scale=1.0, sampler=sampler,
               generator=torch.Generator().manual_seed(1))
    moved = [t for t in transfers if t[0].endswith("sampling.sampler") and t[1] == "sample"]
    assert len(moved) == 1, moved
    timesteps = make_sampler(sampler, sigmas, None, torch.Generator().manual_seed(1)).timesteps
    want = [float((torch.tensor(float(t), dtype=torch.float32) / 1000).to(torch.bfloat16) * 1000) for t in timesteps]
    assert [float(t) for t in dit.seen] == want and all(t.shape == (1,) for t in dit.seen)
    assert len(dit.seen) == len(sigmas)
