"""MoE dispatch (issue 10 item 3): sorting the (token, expert) pairs once gives the same bits as the
per-expert loop it replaced, in fp32 and bf16 models, on the grouped-matmul and the per-slice path,
with no host sync per expert."""

from unittest import mock

import pytest
import torch

from bench.moe_ffn import before, issue10
from lingbot_core.model.transformer import MoEFeedForward, route_tokens, run_experts

CFG = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48, n_group=4, topk_group=2,
           n_shared_experts=1, routed_scaling_factor=2.5, score_func="sigmoid", norm_topk_prob=True)
DIM = 64


def per_expert_loop(ffn, f):
    """The dispatch as it was before the sorted dispatch: one ``index_add_`` per used expert, experts ascending
    (kept in bench.moe_ffn, which times the two against each other)."""
    return before(ffn, f, f.dtype)


def make_ffn(dtype, seed=0):
    ffn = MoEFeedForward(DIM, CFG)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(ffn.named_parameters()) + list(ffn.named_buffers()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "router" in name else 0.1))
    if dtype != torch.float32:
        for name, p in ffn.named_parameters():
            if "router" not in name:
                p.data = p.data.to(dtype)
    return ffn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "slices"])
def test_bit_identical_to_per_expert_loop(dtype, grouped):
    ffn = make_ffn(dtype)
    f = torch.randn(2, 97, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = per_expert_loop(ffn, f)
        with mock.patch("lingbot_core.model.transformer._use_grouped_mm", return_value=grouped):
            if grouped and not hasattr(torch, "_grouped_mm"):
                pytest.skip("this torch has no _grouped_mm")
            out = ffn(f, dtype)
    assert out.dtype == dtype and out.shape == f.shape
    assert torch.equal(out, expected), (out - expected).abs().max()
    with torch.no_grad():
        assert torch.equal(out, issue10(ffn, f, dtype))  # and the issue-10 dispatch (all rows gathered at once)
    assert (out != 0).float().mean() > 0.99  # a real output, not zeros


def test_unused_experts_and_single_token():
    """Empty expert slices (one token uses only k of 16 experts) change nothing."""
    ffn = make_ffn(torch.float32, seed=3)
    f = torch.randn(1, 1, DIM, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for grouped in (True, False):
            with mock.patch("lingbot_core.model.transformer._use_grouped_mm", return_value=grouped):
                assert torch.equal(ffn(f, torch.float32), per_expert_loop(ffn, f))


class HostReads:
    """Counts what reads device data back to the host: ``.item()`` / ``bool()`` / ``int()`` (all
    ``aten._local_scalar_dense``), ``.tolist()``, and the ops that size their output from the data
    (``bincount``: CUDA reads its maximum; ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``
    without an output size). Patched ``tolist``, dispatch mode for the rest."""

    SYNCING = ("_local_scalar_dense", "bincount", "nonzero", "masked_select", "_unique", "unique_consecutive",
               "repeat_interleave")

    def __init__(self):
        self.calls = []

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        calls, orig_tolist = self.calls, torch.Tensor.tolist

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if any(name == s or name.startswith(s) for s in HostReads.SYNCING):
                    calls.append(name)
                return func(*args, **(kwargs or {}))

        def tolist(t):
            calls.append("tolist")
            return orig_tolist(t)

        self._patch = mock.patch.object(torch.Tensor, "tolist", tolist)
        self._patch.__enter__()
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self._patch.__exit__(*exc)


def test_no_host_sync_in_the_grouped_dispatch_one_in_the_loop():
    """Issue 24 item 1: the grouped dispatch (routing included: the whole MoE feed-forward) reads nothing
    back to the host, so the host can queue the next blocks while the GPU computes; the per-expert loop
    reads its slice sizes once (one ``tolist``) and never calls ``bincount``."""
    ffn = make_ffn(torch.float32)
    f = torch.randn(1, 50, DIM, generator=torch.Generator().manual_seed(5))
    tokens = f.reshape(-1, DIM).to(torch.bfloat16)
    ids, gates = route_tokens(tokens, ffn.router.weight, ffn.router.e_score_correction_bias, top_k=4, n_group=4,
                              topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    with torch.no_grad():
        with HostReads() as reads:
            run_experts(tokens, ids, gates, ffn.experts, grouped=False)
        assert reads.calls == ["tolist"]
        if hasattr(torch, "_grouped_mm"):
            with HostReads() as reads, mock.patch("lingbot_core.model.transformer._use_grouped_mm", return_value=True):
                ffn(f, torch.float32)
            assert reads.calls == []
    with HostReads() as reads, torch.no_grad():  # the counter sees what issue 10's dispatch did
        issue10(ffn, f, f.dtype)
    assert "bincount" in reads.calls and "tolist" in reads.calls
    with HostReads() as reads, torch.no_grad():  # and the loop before it: a read per expert
        before(ffn, f, f.dtype)
    assert len(reads.calls) > CFG["num_experts_per_tok"]


def test_per_slice_path_never_gathers_all_routed_rows():
    """Each expert gathers only its own rows: no (N * k, D) tensor exists in the per-slice path (at the
    refiner's size that would be 8 GB in bf16), while the outputs stay bit-identical (test above)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ffn = make_ffn(torch.bfloat16)
    tokens = torch.randn(60, DIM, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    ids, gates = route_tokens(tokens, ffn.router.weight, ffn.router.e_score_correction_bias, top_k=4, n_group=4,
                              topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    shapes = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                shapes.append(tuple(out.shape))
            return out

    with torch.no_grad(), Shapes():
        run_experts(tokens, ids, gates, ffn.experts, grouped=False)
    wide = [s for s in shapes if len(s) == 2 and s[1] == DIM]
    assert wide and max(s[0] for s in wide) <= tokens.shape[0], sorted(set(wide))  # at most N rows of width D


# -- issue 31 item 7 / finding 13: the dispatch decision ------------------------------------------------


def test_fallback_grouped_kernel_takes_the_loop_at_real_token_counts():
    """Off torch's native grouped kernel (sm80/86/89/120: host-read offsets, one matmul per expert) the loop
    runs above one grouped chunk of tokens: at 480x832x121 (48,360 tokens) on sm89 it is the loop; on sm90
    (native) grouped; a width not divisible by 8 always takes the loop (torch's stride rule would raise)."""
    from lingbot_core.model.precision import FALLBACK_GROUPED_MAX_TOKENS, grouped_dispatch, grouped_mm_fast

    cuda = torch.device("cuda", 0)
    has = hasattr(torch, "_grouped_mm")
    native_89, native_90 = grouped_mm_fast(cuda, (8, 9)), grouped_mm_fast(cuda, (9, 0))
    assert native_89 is False and native_90 is has
    tokens = 48_360
    assert grouped_dispatch(tokens, 2048, 768, supported=True, native=native_89) is False  # the loop
    assert grouped_dispatch(FALLBACK_GROUPED_MAX_TOKENS, 2048, 768, supported=True, native=native_89) is True
    assert grouped_dispatch(tokens, 2048, 768, supported=True, native=True) is True
    assert grouped_dispatch(100, 2048, 764, supported=True, native=True) is False  # 764 % 8 != 0
    assert grouped_dispatch(100, 2044, 768, supported=True, native=True) is False
    assert grouped_dispatch(100, 2048, 768, supported=False, native=False) is False


def test_run_experts_dispatch_follows_the_decision():
    """``run_experts`` asks the decision with the layer's token count and widths."""
    from lingbot_core.model import transformer

    ffn = make_ffn(torch.bfloat16)
    f = torch.randn(1, 9, DIM, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    asked = []

    def decide(device, tokens, dim, hidden):
        asked.append((device.type, tokens, dim, hidden))
        return False

    with torch.no_grad(), mock.patch.object(transformer, "use_grouped_mm", decide):
        ffn(f, torch.bfloat16)
    assert asked == [("cpu", 9, DIM, CFG["moe_intermediate_size"])]
