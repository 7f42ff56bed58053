"""LINGBOT_RAM_BUDGET_GB: read in GB (GiB), refused with a message when it is not a positive number."""

import pytest

from lingbot_core.memory.budget import ram_budget_from_env
from lingbot_core.pipeline_pool import PipelinePool

GIB = 1024 ** 3


@pytest.mark.parametrize("raw, expected", [("48", 48 * GIB), (" 0.5 ", GIB // 2), ("", None), ("  ", None)])
def test_budget_is_read_in_gigabytes(raw, expected):
    assert ram_budget_from_env({"LINGBOT_RAM_BUDGET_GB": raw}) == expected
    assert ram_budget_from_env({}) is None


@pytest.mark.parametrize("raw", ["48GB", "abc", "0", "-3", "nan", "inf"])
def test_bad_budget_is_refused_with_the_variable_named(raw):
    with pytest.raises(ValueError, match="LINGBOT_RAM_BUDGET_GB"):
        ram_budget_from_env({"LINGBOT_RAM_BUDGET_GB": raw})


def test_a_48_gb_budget_admits_a_pipeline_of_a_few_mib(packages, monkeypatch):
    """Read as MiB, 48 would refuse every pipeline: the tiny dense package (~1.6 MiB) must fit."""
    monkeypatch.setenv("LINGBOT_RAM_BUDGET_GB", "48")
    pool = PipelinePool(budget=ram_budget_from_env())
    handle = pool.handle(packages["dense"], offload="none", device="cpu")
    assert pool.weight_bytes(handle.spec) < 16 * 2 ** 20
    with pool.use(handle) as pipe:
        assert pipe.transformer is not None
    handle.release()
