"""Causal softmax recomputed from the saved attention scores (the non-flash path): one Triton
program per score row.

    y[..., i, j] = exp(a_ij - max_k a_ik) / sum_k exp(a_ik - max_k a_ik),   k, j <= i
    a_ij = scale * s[..., i, j];   y[..., i, j] = 0 for j > i (the future is masked)

Rows of the (..., T, T) scores are contiguous, so row r is query position i = r mod T.
Sandwich: ``_causal_softmax_kernel`` → ``_launch`` → custom op ``lynx::causal_softmax`` (fake +
autograd) → ``causal_softmax``. fp32 inside. Backward as torch math on the output:
ds = scale * y * (dy - sum_j dy * y).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .reference import causal_softmax as _reference
from ._support import triton_importable, warn_fallback, why_not

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _causal_softmax_kernel(s_ptr, y_ptr, T, scale, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        i = row % T  # query position of this row
        cols = tl.arange(0, BLOCK)
        valid = cols <= i
        a = tl.load(s_ptr + row * T + cols, mask=valid, other=float("-inf")).to(tl.float32) * scale
        a = tl.where(valid, a, float("-inf"))
        e = tl.exp(a - tl.max(a, axis=0))  # e = 0 where masked
        y = e / tl.sum(e, axis=0)
        tl.store(y_ptr + row * T + cols, y.to(y_ptr.dtype.element_ty), mask=cols < T)


def _launch(scores: Tensor, scale: float) -> Tensor:
    T = scores.shape[-1]
    y = torch.empty_like(scores)
    rows = scores.numel() // max(1, T)
    if rows:
        _causal_softmax_kernel[(rows,)](scores, y, T, scale, BLOCK=triton.next_power_of_2(T))
    return y


@torch.library.custom_op("lynx::causal_softmax", mutates_args=())
def _causal_softmax_op(scores: Tensor, scale: float) -> Tensor:
    reason = why_not("causal_softmax", scores)
    if reason is not None:
        warn_fallback("causal_softmax", reason)
        return _reference(scores, scale)
    return _launch(scores, scale)


@_causal_softmax_op.register_fake
def _(scores: Tensor, scale: float) -> Tensor:
    return torch.empty_like(scores)


def _setup(ctx, inputs, output) -> None:
    ctx.scale = inputs[1]
    ctx.save_for_backward(output)


def _backward(ctx, dy: Tensor):
    (y,) = ctx.saved_tensors
    yf, dyf = y.float(), dy.float()
    ds = ctx.scale * yf * (dyf - (dyf * yf).sum(-1, keepdim=True))
    return ds.to(y.dtype), None


_causal_softmax_op.register_autograd(_backward, setup_context=_setup)


def causal_softmax(scores: Tensor, scale: float = 1.0) -> Tensor:
    """Softmax over the last dim of ``scale * scores`` (..., T, T) with the future (j > i) masked;
    fused on CUDA (or the Triton interpreter), the torch reference elsewhere (warned once)."""
    if scores.dim() < 2 or scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"causal_softmax: scores must be (..., T, T), got {tuple(scores.shape)}")
    return _causal_softmax_op(scores, float(scale))
