"""Bias + GeLU and SwiGLU recomputed from their saved inputs: elementwise, one Triton program per
BLOCK of flat elements (1-D grid, masked tail).

    bias_gelu:  v = x + b[c]  (c = last-dim index; b optional)
                "none":  y = 0.5 v (1 + erf(v / sqrt 2))
                "tanh":  y = 0.5 v (1 + tanh(u)),  u = sqrt(2/pi) (v + 0.044715 v^3)
                         = v * sigmoid(2u)          (0.5 (1 + tanh u) = sigmoid(2u); Triton 3.9
                                                     has no tl.math.tanh, this needs none)
    swiglu:     y = silu(g) * u = g * sigmoid(g) * u

Sandwich: ``_bias_gelu_kernel`` / ``_swiglu_kernel`` (Triton) → ``_launch_*`` → custom ops
``lynx::bias_gelu`` / ``lynx::swiglu`` (fake + autograd) → ``bias_gelu`` / ``swiglu`` (public).
fp32 inside whatever the input dtype, one rounding to the output dtype. Backward is torch math
on the saved inputs (the forward is recomputed in it, nothing else is saved):

    d gelu/dv ("none") = Phi(v) + v phi(v),   Phi(v) = 0.5 (1 + erf(v / sqrt 2)),
                                              phi(v) = exp(-v^2 / 2) / sqrt(2 pi)
    d gelu/dv ("tanh") = 0.5 (1 + t) + 0.5 v (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 v^2),  t = tanh u
    dx = dy * gelu'(v),   db = sum over leading dims of dx
    d swiglu/dg = u * s (1 + g (1 - s)),  s = sigmoid(g);   d swiglu/du = silu(g)
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .reference import bias_gelu as _ref_bias_gelu
from .reference import swiglu as _ref_swiglu
from ._support import triton_importable, warn_fallback, why_not

BLOCK = 1024
_APPROXIMATE = ("none", "tanh")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _bias_gelu_kernel(x_ptr, b_ptr, y_ptr, n, n_cols, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                          BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: no overflow
        mask = offs < n
        v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += tl.load(b_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)  # b[c]
        if TANH:
            # 0.5 v (1 + tanh u) = v * sigmoid(2u),  u = sqrt(2/pi) (v + 0.044715 v^3)
            u = 0.7978845608028654 * (v + 0.044715 * v * v * v)
            y = v * tl.sigmoid(2.0 * u)
        else:
            y = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))  # erf(v / sqrt 2)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u  # silu(g) * u
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch_bias_gelu(x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        n_cols = x.shape[-1] if x.dim() else 1
        _bias_gelu_kernel[(triton.cdiv(n, BLOCK),)](
            x, x if bias is None else bias, y, n, n_cols,  # x stands in for an absent bias (unread)
            HAS_BIAS=bias is not None, TANH=approximate == "tanh", BLOCK=BLOCK)
    return y


def _launch_swiglu(gate: Tensor, up: Tensor) -> Tensor:
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK)
    return y


# ---------------------------------------------------------------------------- bias_gelu op

@torch.library.custom_op("lynx::bias_gelu", mutates_args=())
def _bias_gelu_op(x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    reason = why_not("bias_gelu", *([x] if bias is None else [x, bias]))
    if reason is not None:
        warn_fallback("bias_gelu", reason)
        return _ref_bias_gelu(x, bias, approximate)
    return _launch_bias_gelu(x, bias, approximate)


@_bias_gelu_op.register_fake
def _(x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    return torch.empty_like(x)


def _bias_gelu_setup(ctx, inputs, output) -> None:
    x, bias, approximate = inputs
    ctx.approximate = approximate
    ctx.save_for_backward(x, bias)


def _gelu_grad(v: Tensor, approximate: str) -> Tensor:
    """d gelu / dv in fp32 (formulas in the module docstring)."""
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (v + 0.044715 * v.pow(3)))
        return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * v * v)
    return 0.5 * (1 + torch.erf(v * _INV_SQRT_2)) + v * torch.exp(-0.5 * v * v) * _INV_SQRT_2PI


def _bias_gelu_backward(ctx, dy: Tensor):
    x, bias = ctx.saved_tensors
    v = x.float() if bias is None else x.float() + bias.float()
    dv = dy.float() * _gelu_grad(v, ctx.approximate)
    db = None
    if bias is not None and ctx.needs_input_grad[1]:
        db = dv.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)  # fp32 sum, one rounding
    return dv.to(x.dtype), db, None


_bias_gelu_op.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)


def bias_gelu(x: Tensor, bias: Tensor | None = None, approximate: str = "none") -> Tensor:
    """gelu(x + bias) with ``bias`` of shape (x.shape[-1],) broadcast over the last dim (or None),
    ``approximate`` "none" (exact, erf) or "tanh" as in ``torch.nn.functional.gelu``. Output in
    x.dtype; x + bias is formed in fp32 (not rounded to x.dtype first). Gradients for x and bias.
    Fused on CUDA (or the Triton interpreter), the torch reference elsewhere (warned once)."""
    if approximate not in _APPROXIMATE:
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    if bias is not None and (x.dim() == 0 or tuple(bias.shape) != (x.shape[-1],)):
        raise ValueError(f"bias_gelu: bias must have shape (x.shape[-1],), got {tuple(bias.shape)} "
                         f"for x of shape {tuple(x.shape)}")
    return _bias_gelu_op(x, bias, approximate)


# ---------------------------------------------------------------------------- swiglu op

@torch.library.custom_op("lynx::swiglu", mutates_args=())
def _swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    reason = why_not("swiglu", gate, up)
    if reason is not None:
        warn_fallback("swiglu", reason)
        return _ref_swiglu(gate, up)
    return _launch_swiglu(gate, up)


@_swiglu_op.register_fake
def _(gate: Tensor, up: Tensor) -> Tensor:
    return torch.empty_like(gate)


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy: Tensor):
    gate, up = ctx.saved_tensors
    g, u, dyf = gate.float(), up.float(), dy.float()
    s = torch.sigmoid(g)
    dg = dyf * u * s * (1 + g * (1 - s))  # d/dg [g s(g)] = s + g s (1 - s)
    du = dyf * g * s
    return dg.to(gate.dtype), du.to(up.dtype)


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, elementwise over same-shape ``gate`` and ``up``; output in gate.dtype
    (fp32 math, one rounding). Gradients for both. Fused on CUDA (or the Triton interpreter), the
    torch reference elsewhere (warned once)."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    return _swiglu_op(gate, up)
