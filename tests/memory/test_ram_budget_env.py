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


# -- LINGBOT_PINNED_GB (issue 31 item 11): the pinned-homes budget of offload "block" ----------------


@pytest.mark.parametrize("raw, expected", [("0", 0), ("2", 2 * 1024 ** 3), (" 0.5 ", 512 * 1024 ** 2)])
def test_pinned_homes_budget_is_read_in_gigabytes_and_0_turns_it_off(raw, expected):
    from lingbot_core.memory.host_memory import pinned_homes_budget

    assert pinned_homes_budget({"LINGBOT_PINNED_GB": raw}) == expected


@pytest.mark.parametrize("raw", ["-1", "lots", "nan", "inf"])
def test_bad_pinned_homes_budget_is_refused_with_the_variable_named(raw):
    from lingbot_core.memory.host_memory import pinned_homes_budget

    with pytest.raises(ValueError, match="LINGBOT_PINNED_GB"):
        pinned_homes_budget({"LINGBOT_PINNED_GB": raw})


def test_pinned_homes_default_to_a_quarter_of_physical_ram():
    from lingbot_core.memory.host_memory import pinned_homes_budget

    with open("/proc/meminfo", encoding="ascii") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert pinned_homes_budget({}) == total // 4


def test_pin_budget_keeps_its_total_and_the_ram_headroom(monkeypatch):
    from lingbot_core.memory import host_memory

    monkeypatch.setattr(host_memory, "available_ram", lambda: 10 * 1024 ** 3)
    budget = host_memory.PinBudget(5 * 1024 ** 3, headroom=4 * 1024 ** 3)
    assert budget.take(3 * 1024 ** 3) and budget.used == 3 * 1024 ** 3
    assert not budget.take(3 * 1024 ** 3)  # over the total
    budget.give(3 * 1024 ** 3)
    assert budget.used == 0
    budget = host_memory.PinBudget(100 * 1024 ** 3, headroom=4 * 1024 ** 3)
    assert budget.take(6 * 1024 ** 3) and not budget.take(7 * 1024 ** 3)  # 10 - 7 < 4 GiB left available
