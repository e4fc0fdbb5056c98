"""Pure-torch references of every lynx kernel: the test oracle, the CPU fallback, and the
baseline the GPU benchmark compares against. Math in fp32, result in the input's dtype."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """y = x / sqrt(mean(x^2, -1) + eps) * weight over the last dim; also rstd (fp32, one per row)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return (xf * rstd * weight.float()).to(x.dtype), rstd.squeeze(-1)


# --- layer_norm --------------------------------------------------------------------------------

def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
               eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor]:
    """y = (x - mean) * rstd * weight + bias over the last dim, rstd = 1 / sqrt(var + eps) with the
    biased variance; weight and bias may each be None (no scale, no shift). Also mean and rstd
    (fp32, one per row, shape x.shape[:-1]). fp32 math, y in x.dtype."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)  # (..., 1)
    xc = xf - mean
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)  # two-pass variance, as the kernel
    y = xc * rstd
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean.squeeze(-1), rstd.squeeze(-1)


# --- softmax -----------------------------------------------------------------------------------

def causal_softmax(scores: Tensor, scale: float = 1.0) -> Tensor:
    """softmax_j(scale * s[..., i, j]) over j <= i, 0 for j > i; fp32 math, output in s.dtype."""
    T = scores.shape[-1]
    future = torch.ones(T, T, dtype=torch.bool, device=scores.device).triu(1)
    a = (scores.float() * scale).masked_fill(future, float("-inf"))
    return torch.softmax(a, dim=-1).to(scores.dtype)


# --- activations -------------------------------------------------------------------------------

def bias_gelu(x: Tensor, bias: Tensor | None = None, approximate: str = "none") -> Tensor:
    """y = gelu(x + bias), bias (x.shape[-1],) broadcast over the last dim (None: no bias);
    ``approximate`` "none" (erf) or "tanh" as in ``torch.nn.functional.gelu``. Output in x.dtype."""
    v = x.float() if bias is None else x.float() + bias.float()
    return F.gelu(v, approximate=approximate).to(x.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """y = silu(gate) * up = gate * sigmoid(gate) * up (same shapes); output in gate.dtype."""
    g = gate.float()
    return (F.silu(g) * up.float()).to(gate.dtype)


# --- dropout -----------------------------------------------------------------------------------
# Pure-torch reference of the dropout kernels (merged into reference.py with the others).
# 
# It reproduces Triton's ``tl.rand(seed, offset)`` bit for bit without importing triton:
# Philox4x32-10 and the uint32 -> float32 conversion of ``triton/language/random.py`` (triton 3.x),
# in torch int64 arithmetic masked to 32 bits.
# 
# What ``tl.rand(seed, off)`` computes, for an int64 block ``off`` (the lynx kernels always pass
# int64 offsets, so these are the bits the kernels use):
# 
#     key     k0 = seed & 0xffffffff,  k1 = (seed >> 32) & 0xffffffff     (seed as uint64)
#     counter c0 = off & 0xffffffff,   c1 = (off >> 32) & 0xffffffff,  c2 = c3 = 0
#     10 rounds, A = 0xD2511F53, B = 0xCD9E8D57:
#         c0, c1, c2, c3 = hi(B*c2) ^ c1 ^ k0,  lo(B*c2),  hi(A*c0) ^ c3 ^ k1,  lo(A*c0)
#         k0 += 0x9E3779B9;  k1 += 0xBB67AE85                        (all mod 2^32)
#     u = c0 (the first of the four words)
#     s = u as int32;  s = ~s if s < 0   (so s in [0, 2^31 - 1])
#     rand = float32(s) * float32(4.6566127342e-10)                 (in [0, 1), never 1)
# 
# An int32 offset block gives the same bits as long as ``off`` is in [0, 2^32) (c1 = 0 either way).
# 
# Dropout convention (see ``lynx_compile.kernels.dropout``): element with linear index i of the
# contiguous tensor is kept iff rand(seed, offset + i) >= p (both compared in float32); kept values
# are scaled by 1 / (1 - p) (0 when p = 1: then nothing is kept).

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_SCALE = 4.6566127342e-10  # ((2**23 - 1) / 2**23) * 2**-31 as triton writes it; rounded to fp32 below
N_ROUNDS = 10


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit words of a * b for a 32-bit constant ``a`` and int64 ``b`` in [0, 2^32),
    without overflowing int64: split b = bh * 2^16 + bl, so a*b = (a*bh + (a*bl >> 16)) * 2^16
    + (a*bl & 0xffff), every partial product < 2^49."""
    bh, bl = b >> 16, b & 0xFFFF
    low = a * bl  # < 2^48
    mid = a * bh + (low >> 16)  # < 2^49
    hi = mid >> 16
    lo = ((mid & 0xFFFF) << 16) | (low & 0xFFFF)
    return hi, lo


def philox_uint32(seed: int, offsets: Tensor, n_rounds: int = N_ROUNDS) -> Tensor:
    """The first Philox4x32 output word for each (int64) offset, as int64 in [0, 2^32)."""
    seed = int(seed)
    off = offsets.to(torch.int64)
    k0, k1 = seed & _M32, (seed >> 32) & _M32  # seed as uint64: two's complement for negatives
    c0, c1 = off & _M32, (off >> 32) & _M32
    c2 = torch.zeros_like(off)
    c3 = torch.zeros_like(off)
    for _ in range(n_rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0


def uint32_to_uniform(u: Tensor) -> Tensor:
    """Triton's ``uint_to_uniform_float`` for 32-bit words: bitcast to int32, ~s for s < 0, times
    fp32(4.6566127342e-10) in fp32 (int32 -> fp32 rounds to nearest first)."""
    s = torch.where(u >= 2**31, _M32 - u, u)  # ~s of the int32 view == 2^32 - 1 - u
    scale = torch.tensor(_SCALE, dtype=torch.float32, device=u.device)
    return s.to(torch.int32).to(torch.float32) * scale


def philox_uniform(seed: int, offsets: Tensor) -> Tensor:
    """``tl.rand(seed, offsets)`` for an int64 offsets tensor: float32 in [0, 1), same shape."""
    return uint32_to_uniform(philox_uint32(seed, offsets))


def dropout_mask(like: Tensor, p: float, seed: int, offset: int) -> Tensor:
    """Bool keep-mask of ``like``'s shape: keep[i] = rand(seed, offset + i) >= p, i the linear
    (row-major) index."""
    idx = torch.arange(like.numel(), dtype=torch.int64, device=like.device) + int(offset)
    u = philox_uniform(seed, idx)
    return (u >= torch.tensor(p, dtype=torch.float32, device=like.device)).reshape(like.shape)


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout(x: Tensor, p: float, seed: int, offset: int) -> Tensor:
    """x * keep / (1 - p); fp32 math, output in x.dtype. Differentiable (torch autograd)."""
    keep = dropout_mask(x, p, seed, offset)
    return torch.where(keep, x.float() * _scale(p), 0.0).to(x.dtype)


def bias_dropout_add(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: int,
                     offset: int) -> Tensor:
    """residual + dropout(x + bias) (bias over the last dim, may be None); fp32 in between,
    one rounding to promote_types(x.dtype, residual.dtype)."""
    out_dtype = torch.promote_types(x.dtype, residual.dtype)
    h = x.float() if bias is None else x.float() + bias.float()
    keep = dropout_mask(x, p, seed, offset)
    return (residual.float() + torch.where(keep, h * _scale(p), 0.0)).to(out_dtype)


# --- causal softmax + attention dropout --------------------------------------------------------

def causal_softmax_dropout(scores: Tensor, scale: float, p: float, seed: int, offset: int) -> Tensor:
    """dropout(causal_softmax(scores, scale), p, seed, offset): the attention probabilities with
    the keep-mask of ``dropout_mask(scores, p, seed, offset)`` (linear index row * T + col over the
    whole (..., T, T) tensor). Differentiable (torch autograd); output in scores.dtype."""
    return dropout(causal_softmax(scores, scale), p, seed, offset)
