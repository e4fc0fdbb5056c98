"""Dropout whose mask is never saved: it is regenerated from a Philox (seed, offset).

Convention (the contract between forward, backward, ``dropout_mask`` and the reference):

    keep[i] = tl.rand(seed, offset + i) >= p        i = linear index of the contiguous tensor
    y[i]    = keep[i] ? x[i] / (1 - p) : 0          (scale 0 when p = 1: nothing is kept)

``offset + i`` is an int64 block (Philox counter c0 = low 32 bits, c1 = high 32 bits, c2 = c3 = 0;
key = the seed's low and high 32 bits), ``tl.rand`` is Triton's Philox4x32-10 first word mapped to
[0, 1) in float32, and p is compared in float32. The pure-torch reference (``reference.py``) reproduces
those bits exactly, so the reference fallback draws the same mask as the kernel. Callers
advance ``offset`` by at least ``numel`` between independent dropouts sharing a seed.

    dropout:           y = x * keep / (1 - p)
                       dx = dy * keep / (1 - p)  = dropout(dy) with the same (seed, offset)
    bias_dropout_add:  y = residual + (x + bias[i mod C]) * keep / (1 - p)   (C = last dim)
                       dx = dropout(dy),  dbias = sum over rows of dx,  dresidual = dy

The backward regenerates the mask in the kernel: nothing but (p, seed, offset) and shapes is
kept for it. Sandwich per op: ``@triton.jit`` kernel → ``_launch_*`` → custom op
``lynx::dropout`` / ``lynx::dropout_mask`` / ``lynx::bias_dropout_add`` (fake for torch.compile,
autograd where there is a gradient) → public function. fp32 inside; one rounding to the output
dtype (bias_dropout_add: promote_types(x, residual), with x + bias not rounded in between).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import reference as _reference
from ._support import triton_importable, warn_fallback, why_not

BLOCK_SIZE = 1024

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _keep(seed, offset, idx, p):
        # idx is int64, so the Philox counter is (lo32(offset + idx), hi32(offset + idx), 0, 0)
        return tl.rand(seed, offset + idx) >= p

    @triton.jit(do_not_specialize=["seed", "offset"])
    def _dropout_kernel(x_ptr, y_ptr, n, p, scale, seed, offset, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inb = idx < n
        x = tl.load(x_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        y = tl.where(_keep(seed, offset, idx, p), x * scale, 0.0)  # y = x * keep / (1 - p)
        tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=inb)

    @triton.jit(do_not_specialize=["seed", "offset"])
    def _dropout_mask_kernel(m_ptr, n, p, seed, offset, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        tl.store(m_ptr + idx, _keep(seed, offset, idx, p).to(tl.uint8), mask=idx < n)

    @triton.jit(do_not_specialize=["seed", "offset"])
    def _bias_dropout_add_kernel(x_ptr, b_ptr, r_ptr, y_ptr, n, n_cols, p, scale, seed, offset,
                                 HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inb = idx < n
        h = tl.load(x_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        if HAS_BIAS:
            h += tl.load(b_ptr + idx % n_cols, mask=inb, other=0.0).to(tl.float32)  # bias over last dim
        r = tl.load(r_ptr + idx, mask=inb, other=0.0).to(tl.float32)
        y = r + tl.where(_keep(seed, offset, idx, p), h * scale, 0.0)  # r + (x + b) * keep / (1 - p)
        tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=inb)


def _scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK_SIZE),)


def _launch_dropout(x: Tensor, p: float, seed: int, offset: int) -> Tensor:
    y = torch.empty_like(x)
    if x.numel():
        _dropout_kernel[_grid(x.numel())](x, y, x.numel(), p, _scale(p), seed, offset, BLOCK=BLOCK_SIZE)
    return y


def _launch_mask(like: Tensor, p: float, seed: int, offset: int) -> Tensor:
    m = torch.empty(like.shape, dtype=torch.uint8, device=like.device)
    if m.numel():
        _dropout_mask_kernel[_grid(m.numel())](m, m.numel(), p, seed, offset, BLOCK=BLOCK_SIZE)
    return m.view(torch.bool)


def _launch_bias_dropout_add(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: int,
                             offset: int) -> Tensor:
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    if x.numel():
        b = bias if bias is not None else x  # a placeholder pointer, never read
        n_cols = x.shape[-1] if x.dim() else 1
        _bias_dropout_add_kernel[_grid(x.numel())](x, b, residual, y, x.numel(), n_cols, p, _scale(p),
                                                   seed, offset, HAS_BIAS=bias is not None, BLOCK=BLOCK_SIZE)
    return y


# ---------------------------------------------------------------- lynx::dropout

@torch.library.custom_op("lynx::dropout", mutates_args=())
def _dropout_op(x: Tensor, p: float, seed: int, offset: int) -> Tensor:
    reason = why_not("dropout", x)
    if reason is not None:
        warn_fallback("dropout", reason)
        return _reference.dropout(x, p, seed, offset).contiguous()  # the fake's layout
    return _launch_dropout(x, p, seed, offset)


@_dropout_op.register_fake
def _(x: Tensor, p: float, seed: int, offset: int) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _dropout_setup(ctx, inputs, output) -> None:
    _, ctx.p, ctx.seed, ctx.offset = inputs  # no tensor saved: the mask is regenerated


def _dropout_backward(ctx, dy: Tensor):
    # dx = dy * keep / (1 - p): dropout is linear, so it is dropout(dy) with the same (seed, offset);
    # dy made contiguous so its linear index is the forward's (and the kernel runs, not the fallback).
    return _dropout_op(dy.contiguous(), ctx.p, ctx.seed, ctx.offset), None, None, None


_dropout_op.register_autograd(_dropout_backward, setup_context=_dropout_setup)


# ---------------------------------------------------------------- lynx::dropout_mask

@torch.library.custom_op("lynx::dropout_mask", mutates_args=())
def _dropout_mask_op(like: Tensor, p: float, seed: int, offset: int) -> Tensor:
    # only like's shape and device matter: check the device with a contiguous fp32 stand-in
    reason = why_not("dropout_mask", torch.empty(0, device=like.device))
    if reason is not None:
        warn_fallback("dropout_mask", reason)
        return _reference.dropout_mask(like, p, seed, offset)
    return _launch_mask(like, p, seed, offset)


@_dropout_mask_op.register_fake
def _(like: Tensor, p: float, seed: int, offset: int) -> Tensor:
    return like.new_empty(like.shape, dtype=torch.bool)


# ---------------------------------------------------------------- lynx::bias_dropout_add

@torch.library.custom_op("lynx::bias_dropout_add", mutates_args=())
def _bias_dropout_add_op(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: int,
                         offset: int) -> Tensor:
    tensors = (x, residual) if bias is None else (x, bias, residual)
    reason = why_not("bias_dropout_add", *tensors)
    if reason is not None:
        warn_fallback("bias_dropout_add", reason)
        return _reference.bias_dropout_add(x, bias, residual, p, seed, offset).contiguous()
    return _launch_bias_dropout_add(x, bias, residual, p, seed, offset)


@_bias_dropout_add_op.register_fake
def _(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: int, offset: int) -> Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))


def _bda_setup(ctx, inputs, output) -> None:
    x, bias, residual, ctx.p, ctx.seed, ctx.offset = inputs
    ctx.x_dtype, ctx.r_dtype = x.dtype, residual.dtype
    ctx.b_dtype = None if bias is None else bias.dtype


def _bda_backward(ctx, dy: Tensor):
    dh = _dropout_op(dy.contiguous(), ctx.p, ctx.seed, ctx.offset)  # d(x + b) = dy * keep / (1 - p)
    db = None
    if ctx.b_dtype is not None and ctx.needs_input_grad[1]:
        db = dh.float().reshape(-1, dh.shape[-1]).sum(0).to(ctx.b_dtype)
    return dh.to(ctx.x_dtype), db, dy.to(ctx.r_dtype), None, None, None


_bias_dropout_add_op.register_autograd(_bda_backward, setup_context=_bda_setup)


# ---------------------------------------------------------------- public

def _check(name: str, p: float, seed: int, offset: int) -> tuple[float, int, int]:
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name}: p must be in [0, 1], got {p}")
    seed, offset = int(seed), int(offset)
    if not -2**63 <= seed < 2**63:
        raise ValueError(f"{name}: seed must fit in int64, got {seed}")
    if not 0 <= offset < 2**62:
        raise ValueError(f"{name}: offset must be in [0, 2^62), got {offset}")
    return p, seed, offset


def dropout(x: Tensor, p: float, seed: int, offset: int = 0) -> Tensor:
    """Dropout of ``x`` with the mask drawn from Philox (seed, offset + linear index) and never
    stored (the backward regenerates it); fused on CUDA (or the Triton interpreter), the bit-exact
    torch reference elsewhere (warned once)."""
    p, seed, offset = _check("dropout", p, seed, offset)
    return _dropout_op(x, p, seed, offset)


def dropout_mask(like: Tensor, p: float, seed: int, offset: int = 0) -> Tensor:
    """The bool keep-mask ``dropout(like, p, seed, offset)`` applies, regenerated (like's shape)."""
    p, seed, offset = _check("dropout_mask", p, seed, offset)
    return _dropout_mask_op(like.detach(), p, seed, offset)


def bias_dropout_add(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: int,
                     offset: int = 0) -> Tensor:
    """``residual + dropout(x + bias)`` in one pass (bias over the last dim, may be None), with
    the mask of ``dropout_mask(x, p, seed, offset)``; output dtype promote_types(x, residual)."""
    p, seed, offset = _check("bias_dropout_add", p, seed, offset)
    if residual.shape != x.shape:
        raise ValueError(f"bias_dropout_add: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    if bias is not None and (bias.dim() != 1 or x.dim() == 0 or bias.numel() != x.shape[-1]):
        raise ValueError(f"bias_dropout_add: bias {tuple(bias.shape)} must be 1-D of x's last dim "
                         f"{x.shape[-1] if x.dim() else None}")
    return _bias_dropout_add_op(x, bias, residual, p, seed, offset)
