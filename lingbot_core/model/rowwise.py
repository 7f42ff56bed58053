"""Row-wise operations of the DiT computed by chunks of tokens: RMSNorm, the adaLN modulation, the gated
residual and the RoPE rotation.

Each token's numbers depend on that token alone, so computing a (B, S, ...) tensor a chunk of tokens at a
time and writing each chunk into one output gives the whole expression's bits while only one chunk's fp32
temporaries are alive (at the refiner's 253k tokens a whole-tensor fp32 copy of the hidden state is 2 GB, and
RMSNorm makes four). Traced by ``compile_blocks``, the whole expressions are kept: the compiler fuses them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Computed in fp32 with an fp32 weight, returned in the input dtype.

    Eagerly, a (B, S, ...) input is normalised in chunks of tokens (:func:`by_token_chunks`): the norm is
    row-wise, so the bits are the whole expression's while only one chunk's fp32 copies are alive (4 fp32
    copies of the whole input otherwise: 4 GB per call at the refiner's 253k tokens)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3:
            return self.normed(x)
        return by_token_chunks(x.shape, x.dtype, x.device, lambda lo, hi: self.normed(x[:, lo:hi]))

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` as one expression (what each chunk computes)."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


# The most bytes one fp32 temporary of a chunked row-wise operation (RoPE, RMSNorm, modulation) takes:
# 32k tokens of RoPE pairs or 16k hidden states at width 2048, so a call at the refiner's 253k tokens is 8
# to 16 chunks (few kernel launches) while each temporary stays small beside the 1 GB hidden state.
CHUNK_BYTES = 128 << 20


def chunk_tokens(token_bytes: int) -> int:
    """Tokens per chunk when one token's fp32 temporary takes ``token_bytes``: :data:`CHUNK_BYTES` worth."""
    return max(1, CHUNK_BYTES // max(1, token_bytes))


def by_token_chunks(shape: Sequence[int], dtype: torch.dtype, device, part) -> torch.Tensor:
    """The (B, S, ...) result of a row-wise computation, ``part(lo, hi)`` giving tokens ``lo:hi`` (dim 1),
    computed in chunks (:func:`chunk_tokens` of a token of ``shape`` in fp32) written into one output.
    Each token's numbers are ``part``'s over the whole range, so the bits are too. Traced
    (``compile_blocks``), one call: the compiler fuses the expression and sizes its own buffers."""
    seq = shape[1]
    step = chunk_tokens(math.prod(shape[:1]) * math.prod(shape[2:]) * 4)
    if step >= seq or torch.compiler.is_compiling():
        return part(0, seq)
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    for lo in range(0, seq, step):
        hi = min(seq, lo + step)
        out[:, lo:hi] = part(lo, hi)
    return out


def modulated_norm(norm: RMSNorm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(norm(x) * (1 + scale) + shift).to(dtype)`` (adaLN; ``scale``/``shift`` fp32 (B, 1, D)), by token chunks."""
    scale1 = 1 + scale
    return by_token_chunks(x.shape, dtype, x.device, lambda lo, hi: (norm.normed(x[:, lo:hi]) * scale1 + shift).to(dtype))


def gated_residual(x: torch.Tensor, gate: torch.Tensor, norm: RMSNorm, y: torch.Tensor) -> torch.Tensor:
    """``x + (tanh(gate) * norm(y)).to(x.dtype)`` (the sandwich norm's residual), by token chunks."""
    g = torch.tanh(gate)
    return by_token_chunks(x.shape, x.dtype, x.device,
                           lambda lo, hi: x[:, lo:hi] + (g * norm.normed(y[:, lo:hi])).to(x.dtype))


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation of (B, S, heads, head_dim) by the (cos, sin) table (S, head_dim/2, 2),
    in fp32: the pair (a, b) becomes (a cos - b sin, a sin + b cos), the complex product.

    Eagerly the products are written into the output (fp32 input) or into an fp32 chunk of tokens whose
    temporary takes at most :data:`CHUNK_BYTES` (32k tokens at 16 heads x 64 pairs), cast into it
    (bf16/fp16 input), with one temporary: at most about 3
    units of (B, S, heads, head_dim/2) fp32 are alive, against 6 for the plain expression (6 GB per call
    at the refiner's 253k tokens). Every operation and rounding is the plain expression's, so the bits are
    too; compiled, the plain expression is traced and fused."""
    cos, sin = freqs[None, :, None, :, 0], freqs[None, :, None, :, 1]
    if torch.compiler.is_compiling():
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    seq = x.shape[1]
    step = seq if x.dtype == torch.float32 else chunk_tokens(x[:, :1].numel() // 2 * 4)  # tmp: half the pairs
    for lo in range(0, seq, step):
        hi = min(seq, lo + step)
        pairs = x[:, lo:hi].reshape(*x.shape[:1], hi - lo, *x.shape[2:-1], -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]  # in x's dtype: each product promotes it to fp32 exactly
        c, s = cos[:, lo:hi], sin[:, lo:hi]
        if x.dtype == torch.float32:
            rotated = out.view(pairs.shape)
        else:
            rotated = torch.empty(pairs.shape, dtype=torch.float32, device=x.device)
        re, im = rotated[..., 0], rotated[..., 1]
        torch.mul(a, c, out=re)
        tmp = torch.mul(b, s)
        re.sub_(tmp)  # a cos - b sin
        torch.mul(a, s, out=im)
        torch.mul(b, c, out=tmp)
        im.add_(tmp)  # a sin + b cos
        del tmp
        if x.dtype != torch.float32:
            out[:, lo:hi] = rotated.flatten(-2)  # rounded as .to(dtype) rounds
        del rotated, re, im  # before the next chunk's are made
    return out
