"""Causal softmax recomputed from the saved attention scores (the non-flash path): each Triton
program takes ROWS consecutive score rows (a (ROWS, next_pow2(T)) tile of about ``TILE``
elements; one row per program from T > TILE / 2), with optional attention-probability dropout
fused in the same pass.

    y[..., i, j] = exp(a_ij - max_k a_ik) / sum_k exp(a_ik - max_k a_ik),   k, j <= i
    a_ij = scale * s[..., i, j];   y[..., i, j] = 0 for j > i (the future is masked)

Rows of the (..., T, T) scores are contiguous, so row r is query position i = r mod T.

Dropout (p > 0) follows ``lynx_compile.kernels.dropout``'s Philox convention over the whole
contiguous (..., T, T) output: the element of row r, column j has the int64 linear index
n = r * T + j and is kept iff ``tl.rand(seed, offset + n) >= p``; kept values are scaled by
1 / (1 - p) (0 when p = 1). So the mask is ``dropout_mask(y, p, seed, offset)`` bit for bit and
the output is ``dropout(causal_softmax(scores, scale), p, seed, offset)`` (up to one rounding:
the kernel rounds y * 1/(1-p) once, the composition rounds y first). p = 0 is the plain kernel.

Sandwich: ``_causal_softmax_kernel`` → ``_launch`` → custom op
``lynx::causal_softmax(scores, scale, p=0., seed=0, offset=0)`` (fake + autograd) →
``causal_softmax``. fp32 inside. Backward as torch math, with y the softmax before dropout:

    p = 0:  ds = scale * y * (dy - sum_j dy * y)                     (y = the saved output)
    p > 0:  g  = dy * keep / (1 - p)                                  (dropout backward, mask regenerated)
            ds = scale * y * (g - sum_j g * y)

For p > 0 the op's output is the dropped y, which has lost y at the dropped positions, and a
custom op's autograd can only save its inputs and outputs: so the backward saves the scores
(same size and dtype as y) and recomputes y with the p = 0 kernel, then regenerates the mask
with ``lynx::dropout_mask``. No mask is saved between forward and backward.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import reference as _ref
from .dropout import _check, _dropout_mask_op, _scale
from ._support import triton_importable, warn_fallback, why_not

if triton_importable():
    import triton
    import triton.language as tl

    from .dropout import _keep

    @triton.jit(do_not_specialize=["seed", "offset"])
    def _causal_softmax_kernel(s_ptr, y_ptr, n_rows, T, scale, p, dscale, seed, offset,
                               HAS_DROPOUT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # a (ROWS, BLOCK) tile: ROWS consecutive score rows, each reduced on its own
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        cols = tl.arange(0, BLOCK).to(tl.int64)
        i = rows % T  # query position of each row
        idx = rows[:, None] * T + cols[None, :]  # int64 linear index in the (..., T, T) tensor
        inb = (rows[:, None] < n_rows) & (cols[None, :] < T)
        valid = cols[None, :] <= i[:, None]  # j <= i (column 0 at least: no all -inf row)
        a = tl.load(s_ptr + idx, mask=valid & inb, other=0.0).to(tl.float32) * scale
        a = tl.where(valid, a, float("-inf"))
        e = tl.exp(a - tl.max(a, axis=1)[:, None])  # e = 0 where masked
        y = e / tl.sum(e, axis=1)[:, None]
        if HAS_DROPOUT:
            y = tl.where(_keep(seed, offset, idx, p), y * dscale, 0.0)  # y * keep / (1 - p)
        tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=inb)


TILE = 4096  # elements per program: ROWS = TILE // BLOCK rows of BLOCK = next_pow2(T) (at least 1)


def _launch(scores: Tensor, scale: float, p: float = 0.0, seed: int = 0, offset: int = 0) -> Tensor:
    T = scores.shape[-1]
    y = torch.empty_like(scores)
    n_rows = scores.numel() // max(1, T)
    if n_rows:
        block = triton.next_power_of_2(T)
        rows = min(max(1, TILE // block), triton.next_power_of_2(n_rows))
        _causal_softmax_kernel[(triton.cdiv(n_rows, rows),)](
            scores, y, n_rows, T, scale, p, _scale(p), seed, offset,
            HAS_DROPOUT=p > 0.0, ROWS=rows, BLOCK=block)
    return y


@torch.library.custom_op("lynx::causal_softmax", mutates_args=())
def _causal_softmax_op(scores: Tensor, scale: float, p: float = 0.0, seed: int = 0,
                       offset: int = 0) -> Tensor:
    reason = why_not("causal_softmax", scores)
    if reason is not None:
        warn_fallback("causal_softmax", reason)
        if p > 0.0:
            return _ref.causal_softmax_dropout(scores, scale, p, seed, offset)
        return _ref.causal_softmax(scores, scale)
    return _launch(scores, scale, p, seed, offset)


@_causal_softmax_op.register_fake
def _(scores: Tensor, scale: float, p: float = 0.0, seed: int = 0, offset: int = 0) -> Tensor:
    return torch.empty_like(scores)


def _setup(ctx, inputs, output) -> None:
    scores, ctx.scale, ctx.p, ctx.seed, ctx.offset = inputs
    # p = 0: the output is y itself. p > 0: y is recomputed from the scores in the backward.
    ctx.save_for_backward(output if ctx.p == 0.0 else scores)


def _backward(ctx, dy: Tensor):
    (saved,) = ctx.saved_tensors
    if ctx.p == 0.0:
        y, g = saved, dy.float()
    else:
        y = _causal_softmax_op(saved, ctx.scale)  # softmax before dropout (p = 0 kernel)
        keep = _dropout_mask_op(saved, ctx.p, ctx.seed, ctx.offset)  # the forward's mask, regenerated
        g = torch.where(keep, dy.float() * _scale(ctx.p), 0.0)  # dropout backward
    yf = y.float()
    ds = ctx.scale * yf * (g - (g * yf).sum(-1, keepdim=True))
    return ds.to(saved.dtype), None, None, None, None


_causal_softmax_op.register_autograd(_backward, setup_context=_setup)


def causal_softmax(scores: Tensor, scale: float = 1.0, p: float = 0.0, seed: int = 0,
                   offset: int = 0) -> Tensor:
    """Softmax over the last dim of ``scale * scores`` (..., T, T) with the future (j > i) masked,
    then (p > 0) dropout with the mask of ``dropout_mask(scores, p, seed, offset)`` (Philox, linear
    index row * T + col, never stored: the backward regenerates it); fused on CUDA (or the Triton
    interpreter), the torch reference elsewhere (warned once)."""
    if scores.dim() < 2 or scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"causal_softmax: scores must be (..., T, T), got {tuple(scores.shape)}")
    p, seed, offset = _check("causal_softmax", p, seed, offset)
    return _causal_softmax_op(scores, float(scale), p, seed, offset)
