"""Step cache (issue 17 item 4): EasyCache's rule with one state per CFG branch.

The rule is checked against a hand computation on synthetic inputs, the pipeline against its own
uncached frames: threshold 0 (off) and a threshold that never skips give the same bits; a positive
threshold really skips the block stack (counted at block 0) and reports the counts.
"""

import logging

import numpy as np
import pytest
import torch

from lingbot_core.sampling.step_cache import MAX_THRESHOLD, StepCache, check_step_cache, make_step_cache

RUN = dict(height=64, width=96, num_frames=5, steps=12, seed=3)


def _drive(cache, branch, inputs, f):
    """Feed one branch inputs x_s (one per step) through the cache with block stack ``f``; returns
    the outputs and the steps that were computed."""
    outs, computed = [], []
    for s, x in enumerate(inputs):
        cache.begin_step(s, len(inputs))
        if branch.should_compute(x):
            outs.append(branch.store(x, f(x)))
            computed.append(s)
        else:
            outs.append(branch.reuse(x))
    return outs, computed


def test_rule_matches_a_hand_computation():
    # x_s = a_s (constant tensors), f(x) = 3x + 1: k = 3, residual at a computed step c is 2 a_c + 1,
    # the accumulator adds 3 |a_s - a_{s-1}| / (3 a_c + 1) per step.
    a = [1.0, 2.0, 2.1, 2.2, 2.3, 2.5, 3.5, 3.6, 3.7, 3.8]
    inputs = [torch.full((1, 4, 2), v) for v in a]
    cache = StepCache(0.2, len(a), 1)
    outs, computed = _drive(cache, cache.branches[0], inputs, lambda x: 3 * x + 1)
    expected, acc, last = [0, 1], 0.0, 1  # warm-up: ceil(0.2 * 10) = 2 steps
    for s in range(2, len(a)):
        acc += 3 * abs(a[s] - a[s - 1]) / (3 * a[last] + 1)
        if s == len(a) - 1 or acc >= 0.2:
            expected.append(s)
            acc, last = 0.0, s
    assert computed == expected and len(computed) < len(a)
    for s, out in enumerate(outs):
        c = max(i for i in computed if i <= s)
        assert torch.allclose(out, inputs[s] + 2 * inputs[c] + 1)  # x_s + the residual of the last computed step
    assert (cache.computed, cache.skipped) == (len(expected), len(a) - len(expected))


def test_branches_keep_their_own_state():
    a = [1.0, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 2.7, 2.8]
    decisions = []
    for other in ([5.0 * i for i in range(10)], [0.0] * 10):  # the uncond branch sees very different inputs
        cache = StepCache(0.2, len(a), 2)
        cond, uncond = cache.branches
        seen = []
        for s in range(len(a)):
            cache.begin_step(s, len(a))
            for branch, v, log in ((cond, a[s], seen), (uncond, other[s], None)):
                x = torch.full((1, 3, 2), v)
                if branch.should_compute(x):
                    branch.store(x, 3 * x + 1)
                    if log is not None:
                        log.append(s)
                else:
                    branch.reuse(x)
        decisions.append(seen)
    assert decisions[0] == decisions[1] and len(decisions[0]) < len(a)


def test_threshold_checks_and_warning(caplog):
    assert make_step_cache(0.0, 40, 2) is None  # 0 = off
    for bad in (-0.1, float("nan"), 2.0, True):
        with pytest.raises(ValueError, match="step_cache"):
            check_step_cache(bad)
    with caplog.at_level(logging.WARNING, logger="lingbot_core"):
        make_step_cache(0.1, 4, 2)
    assert "few-step or distilled" in caplog.text


def _block0_calls(pipe):
    calls = []
    handle = pipe.transformer.blocks[0].compute.register_forward_pre_hook(lambda m, a: calls.append(1))
    return calls, handle


def test_off_and_never_skipping_give_the_same_bits(dense_pipe):
    reference = dense_pipe.generate("a cat", **RUN)
    np.testing.assert_array_equal(dense_pipe.generate("a cat", step_cache=0.0, **RUN), reference)
    calls, handle = _block0_calls(dense_pipe)
    try:
        np.testing.assert_array_equal(dense_pipe.generate("a cat", step_cache=1e-9, **RUN), reference)
    finally:
        handle.remove()
    assert len(calls) == 2 * RUN["steps"]  # both branches computed at every step


@pytest.mark.parametrize("lockstep", [True, False])
def test_positive_threshold_skips_and_reports(dense_pipe, lockstep, caplog):
    dense_pipe.set_speed(cfg_lockstep=lockstep)
    reference = dense_pipe.generate("a cat", **RUN)
    calls, handle = _block0_calls(dense_pipe)
    lines = []

    def callback(i, total, x0):
        pass

    callback.status = lines.append
    try:
        with caplog.at_level(logging.INFO, logger="lingbot_core"):
            frames = dense_pipe.generate("a cat", step_cache=0.5, callback=callback, **RUN)
    finally:
        handle.remove()
    computed = len(calls)
    skipped = 2 * RUN["steps"] - computed
    assert skipped > 0 and computed >= 2 * 3  # warm-up (ceil(0.2 * 12) = 3 steps) and the last step computed
    summary = f"{computed} of {2 * RUN['steps']} DiT forwards computed, {skipped} skipped"
    assert summary in caplog.text and summary in lines[-1] and len(lines) == RUN["steps"]
    assert np.isfinite(frames).all() and not np.array_equal(frames, reference)
    assert np.abs(frames - reference).mean() < 0.1  # reused residuals, not garbage


def test_cache_under_block_offload_and_moe_matches_no_offload(moe_pipe):
    reference = moe_pipe.generate("a cat", step_cache=0.5, **RUN)
    moe_pipe.set_offload("block")
    np.testing.assert_array_equal(moe_pipe.generate("a cat", step_cache=0.5, **RUN), reference)


def test_refine_takes_a_step_cache(refiner_pipe, caplog):
    frames = torch.rand(5, 64, 96, 3, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="lingbot_core"):
        out = refiner_pipe.refine(frames, "a cat", height=64, width=96, steps=12, step_cache=0.5)
    assert out.shape == (5, 64, 96, 3) and "DiT forwards computed" in caplog.text


def test_warm_up_is_rounded_up_twelve_steps_compute_three():
    # EasyCache computes the first 20 % of the steps; 20 % of 12 is 2.4, so steps 0, 1 and 2 are always
    # computed. Inputs that barely move would be skipped from step 2 on (k = 3 is learned at step 1),
    # so with the largest threshold only the warm-up and the last step are computed.
    inputs = [torch.full((1, 4, 2), 1.0 + 0.001 * s) for s in range(12)]
    cache = StepCache(MAX_THRESHOLD, 12, 1)
    _, computed = _drive(cache, cache.branches[0], inputs, lambda x: 3 * x + 1)
    assert computed == [0, 1, 2, 11]
    assert (cache.computed, cache.skipped) == (4, 8)
