"""Precision by capability (issue 15 item 5): what ``auto`` means per GPU generation, and where the MoE uses
``torch._grouped_mm``; decided from faked compute capabilities (no GPU needed)."""

import logging

import pytest
import torch

from lingbot_core.loading import default_dtypes
from lingbot_core.model.precision import auto_dtypes, fp8_compute_dtype, grouped_mm_fast, grouped_mm_supported

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


@pytest.mark.parametrize("capability, expected", [((7, 0), FP16), ((7, 5), FP16), ((8, 0), BF16), ((8, 9), BF16),
                                                   ((9, 0), BF16), ((12, 0), BF16)])
def test_fp8_weights_compute_in_autos_dtype(capability, expected):
    """Issue 24 item 5: below sm80 fp8 weights are computed in fp16 (SDPA has no fast bf16 kernel there:
    its math fallback needs O(S^2) memory), as ``auto`` computes the DiT; bf16 elsewhere."""
    assert fp8_compute_dtype(CUDA, capability) == expected == auto_dtypes(CUDA, capability, log=False)["transformer"]
    assert fp8_compute_dtype(torch.device("cpu")) == BF16


def test_fp8_dit_computes_in_the_dtype_the_loader_chose(packages):
    """The DiT's compute dtype under fp8 storage is what the loader set (fp16 on a pre-sm80 GPU): its
    Linears then dequantize into fp16 and return fp16."""
    from lingbot_core import load_pipeline

    pipe = load_pipeline(packages["dense"], device="cpu", dtypes={"transformer": "fp8_e4m3fn"})
    try:
        dit = pipe.transformer
        assert dit.compute_dtype == BF16
        dit.stored_compute_dtype = FP16
        assert dit.compute_dtype == FP16
        lin = dit.blocks[0].attn.to_q
        x = torch.randn(2, lin.in_features)
        y = lin(x, dit.compute_dtype)
        expected = x.to(FP16) @ (lin.weight.to(FP16) * lin.scale_weight.to(FP16)).t()
        assert y.dtype == FP16 and torch.equal(y, expected)
    finally:
        pipe.release()


def test_grouped_mm_wherever_torch_runs_it():
    """Issue 24 item 4: the grouped experts are used wherever ``torch._grouped_mm`` runs: its native
    kernel (sm90/sm100) without asking, other CUDA devices by a probe run once per device; never on a CPU
    (the loop was faster there). A capability asked about without its device only knows the native kernel."""
    assert grouped_mm_supported(torch.device("cpu")) is False
    has = hasattr(torch, "_grouped_mm")
    assert grouped_mm_supported(CUDA, (9, 0)) is has and grouped_mm_supported(CUDA, (8, 6)) is False
    import lingbot_core.model.precision as precision
    from unittest import mock

    calls = []

    def probe(device):
        calls.append(device)
        return True

    with mock.patch.object(precision, "cuda_capability", return_value=(8, 6)), \
            mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(precision, "_grouped_mm_runs", probe), \
            mock.patch.object(precision, "_grouped_mm_sync_free", return_value=False), \
            mock.patch.dict(precision._GROUPED_NATIVE, clear=True), \
            mock.patch.dict(precision._GROUPED_PROBES, clear=True):
        assert grouped_mm_supported(CUDA) is False  # not placed yet: only the native kernel is known
        precision.probe_grouped_mm(CUDA)  # placement
        precision.probe_grouped_mm(CUDA)
        assert grouped_mm_supported(CUDA) is has and grouped_mm_supported(CUDA) is has
        assert calls == ([CUDA] if has else [])  # probed once


def test_the_native_kernel_probe_runs_at_placement_never_from_run_experts():
    """gpu-review-4 finding 12: the probe (two synchronisations and a process-wide sync-debug switch) runs when
    the offloader places the DiT on a CUDA device, once per device, on transposed stacks; ``run_experts``,
    asked per MoE layer call, only reads its answer (before placement: torch's architecture list)."""
    import lingbot_core.memory.offload as offload
    import lingbot_core.model.precision as precision
    from unittest import mock
    from torch import nn

    from lingbot_core.model import transformer
    from lingbot_core.model.transformer import Experts, run_experts

    cuda = torch.device("cuda", 3)
    probed = []

    def native_probe(device):
        probed.append(device)
        return True

    def mid_forward(device):
        raise AssertionError("the grouped-mm probe ran inside run_experts")

    gen = torch.Generator().manual_seed(0)
    experts = Experts(8, 64, 48)
    for p in experts.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.1).to(torch.bfloat16)
    x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(20)])
    gates = torch.rand(20, 2, generator=gen)
    real = precision.use_grouped_mm
    decisions = []

    def on_cuda(device, *args, **kwargs):  # the decision run_experts makes, for a CUDA tensor's device
        decisions.append(real(cuda, *args, **kwargs))
        return decisions[-1]

    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(precision, "cuda_capability", return_value=(8, 6)), \
            mock.patch.object(precision, "_grouped_mm_sync_free", mid_forward), \
            mock.patch.object(precision, "_grouped_mm_runs", mid_forward), \
            mock.patch.dict(precision._GROUPED_NATIVE, clear=True), \
            mock.patch.dict(precision._GROUPED_PROBES, clear=True), \
            mock.patch.object(transformer, "use_grouped_mm", on_cuda), torch.no_grad():
        loop = run_experts(x, ids, gates, experts)  # before placement: sm86 by the list, the loop
        assert decisions == [False]
        with mock.patch.object(precision, "_grouped_mm_sync_free", native_probe):
            placed = offload.Offloader({"transformer": nn.Linear(4, 4)}, stacks={"transformer": lambda m: []})
            placed.apply("block", cuda)
            placed.apply("model", cuda)
            assert probed == [cuda]  # at placement, once per device
        if hasattr(torch, "_grouped_mm"):
            grouped = run_experts(x, ids, gates, experts)  # the placement probe's answer: native, grouped
            assert decisions == [False, True]
            torch.testing.assert_close(grouped, loop, rtol=0.02, atol=0.02)
        placed.remove_hooks()
    w = precision._probe_operands(torch.device("cpu"))[1]
    assert w.shape == (2, 32, 16) and not w.is_contiguous()  # the experts' transposed layout
