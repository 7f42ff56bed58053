"""Precision by capability (issue 15 item 5): what ``auto`` means per GPU generation, and where the MoE uses
``torch._grouped_mm``; decided from faked compute capabilities (no GPU needed)."""

import logging

import pytest
import torch

from lingbot_core.loading import default_dtypes
from lingbot_core.precision import auto_dtypes, grouped_mm_fast

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("capability, dit, text", [
    ((7, 0), FP16, FP32),   # V100
    ((7, 5), FP16, FP32),   # T4, RTX 20xx
    ((8, 0), BF16, BF16),   # A100
    ((8, 6), BF16, BF16),   # RTX 30xx
    ((8, 9), BF16, BF16),   # RTX 40xx
    ((9, 0), BF16, BF16),   # H100 / H200
    ((12, 0), BF16, BF16),  # RTX 50xx
])
def test_auto_dtypes_by_capability(capability, dit, text, caplog):
    with caplog.at_level(logging.INFO, logger="lingbot_core"):
        chosen = default_dtypes(CUDA, capability, log=True)
    assert chosen == {"transformer": dit, "text_encoder": text, "vae": FP32}
    line = [r.getMessage() for r in caplog.records if "auto precision" in r.getMessage()]
    assert len(line) == 1 and f"sm{capability[0]}{capability[1]}" in line[0]
    assert ("fp16 DiT" in line[0]) == (dit == FP16)


def test_auto_dtypes_on_cpu_are_fp32():
    assert auto_dtypes(torch.device("cpu"), log=False) == {"transformer": FP32, "text_encoder": FP32, "vae": FP32}


@pytest.mark.parametrize("capability, expected", [((7, 5), False), ((8, 0), False), ((8, 9), False), ((9, 0), True),
                                                   ((10, 0), True), ((12, 0), False)])
def test_grouped_mm_only_where_its_bf16_kernel_exists(capability, expected):
    assert grouped_mm_fast(CUDA, capability) is (expected and hasattr(torch, "_grouped_mm"))


def test_grouped_mm_never_on_cpu():
    assert grouped_mm_fast(torch.device("cpu")) is False
