"""torch.compile of the DiT blocks (issue 17 item 3): fp32 CPU frames within 1e-5 of eager, no
recompile after the first run nor when only the seed or the prompt changes (dynamo's own counters),
in every offload mode, and the compile time in the log.

Inductor compiles one graph for the tiny DiT (its C++ kernels land in the on-disk inductor cache, so
later runs take seconds); deselect with ``-m "not compile"``.
"""

import logging

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from lingbot_core import load_pipeline
from lingbot_core.model.block_compile import RECOMPILE_LIMIT, blocks_compiled

pytestmark = pytest.mark.compile

RUN = dict(height=64, width=96, num_frames=5, steps=2)


def _graphs():
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def compiled(packages):
    pipe = load_pipeline(packages["dense"], device="cpu")
    eager = {key: pipe.generate(prompt, seed=seed, **RUN) for key, (prompt, seed) in CASES.items()}
    torch._dynamo.reset()  # forget graphs of earlier tests, so the first run below really compiles
    pipe.set_speed(compile_blocks=True)
    before = _graphs()
    first = pipe.generate("a cat", seed=1, **RUN)
    yield pipe, eager, first, _graphs() - before
    pipe.release()


CASES = {"first": ("a cat", 1), "seed": ("a cat", 2), "prompt": ("a red fox jumps over the sleeping dog", 1)}


@pytest.mark.parametrize("mode", ["none", "model", "block", "sequential"])
def test_compiled_frames_match_eager_without_recompiles(compiled, mode):
    pipe, eager, first, compiled_graphs = compiled
    # One graph for every block and both CFG branches (their text lengths differ): the sequence
    # length is dynamic from the start.
    assert compiled_graphs == 1 and blocks_compiled(pipe.transformer)
    np.testing.assert_allclose(first, eager["first"], rtol=0, atol=1e-5)
    pipe.set_offload(mode)
    graphs = _graphs()
    for key in ("seed", "prompt", "first"):
        prompt, seed = CASES[key]
        np.testing.assert_allclose(pipe.generate(prompt, seed=seed, **RUN), eager[key], rtol=0, atol=1e-5)
    assert _graphs() == graphs  # no recompile for another seed, another prompt (text length) or another step
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT


def test_compile_time_is_logged_and_compile_can_be_turned_off(packages, caplog):
    pipe = load_pipeline(packages["dense"], device="cpu", compile_blocks=True)
    try:
        with caplog.at_level(logging.INFO, logger="lingbot_core"):
            compiled = pipe.generate("a cat", **RUN)
        assert "compile_blocks: first step took" in caplog.text and "so compiling took about" in caplog.text
        pipe.set_speed(compile_blocks=False)
        assert not blocks_compiled(pipe.transformer)
        np.testing.assert_allclose(pipe.generate("a cat", **RUN), compiled, rtol=0, atol=1e-5)
    finally:
        pipe.release()
