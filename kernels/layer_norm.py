"""LayerNorm recomputed from its saved input: one Triton program per row.

    mean[r] = mean_c x[r, c]
    rstd[r] = 1 / sqrt(mean_c (x[r, c] - mean[r])^2 + eps)      (biased variance, two passes)
    y[r, :] = (x[r, :] - mean[r]) * rstd[r] * w + b              (w, b optional: 1 and 0 if None)

Sandwich: ``_layer_norm_kernel`` (Triton) → ``_launch`` → custom op ``lynx::layer_norm`` (with a
fake for torch.compile and autograd) → ``layer_norm`` (public). Sums in fp32 whatever the input
dtype. The op returns (y, mean, rstd), mean and rstd fp32 of shape x.shape[:-1]. A missing weight
or bias is a constexpr flag (HAS_W / HAS_B) in the kernel, with x passed as a never-read dummy
pointer. The backward is torch math on the saved mean and rstd (dx, dw, db), not a kernel: what
lynx recomputes in a backward is the forward output, which needs no gradient of its own.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .reference import layer_norm as _reference
from ._support import triton_importable, warn_fallback, why_not

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps,
                           HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n_cols  # fp32 accumulation; masked lanes are 0
        xc = tl.where(mask, x - mean, 0.0)  # keep padding lanes out of the variance
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
        y = xc * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


def _launch(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
            eps: float) -> tuple[Tensor, Tensor, Tensor]:
    n_cols = x.shape[-1]
    rows = x.numel() // max(1, n_cols)
    y = torch.empty_like(x)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if rows:
        _layer_norm_kernel[(rows,)](
            x, x if weight is None else weight, x if bias is None else bias,  # x: unread dummy
            y, mean, rstd, n_cols, eps,
            HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=triton.next_power_of_2(n_cols))
    return y, mean, rstd


@torch.library.custom_op("lynx::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                   eps: float) -> tuple[Tensor, Tensor, Tensor]:
    reason = why_not("layer_norm", *(t for t in (x, weight, bias) if t is not None))
    if reason is not None:
        warn_fallback("layer_norm", reason)
        y, mean, rstd = _reference(x, weight, bias, eps)
        return y, mean.contiguous(), rstd.contiguous()
    return _launch(x, weight, bias, eps)


@_layer_norm_op.register_fake
def _(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
      eps: float) -> tuple[Tensor, Tensor, Tensor]:
    stats = x.shape[:-1]
    return (torch.empty_like(x), x.new_empty(stats, dtype=torch.float32),
            x.new_empty(stats, dtype=torch.float32))


def _setup(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.bias_shape = bias.shape if bias is not None else None
    ctx.save_for_backward(x, weight, output[1], output[2])


def _backward(ctx, dy: Tensor, _dmean: Tensor, _drstd: Tensor):
    x, weight, mean, rstd = ctx.saved_tensors
    n = x.shape[-1]
    xf, dyf, r = x.float(), dy.float(), rstd.unsqueeze(-1)
    xhat = (xf - mean.unsqueeze(-1)) * r
    dw = db = None
    if weight is not None:
        dw = (dyf * xhat).reshape(-1, n).sum(0)  # dL/dw = sum_rows dy * xhat
        dw = dw.reshape(weight.shape).to(weight.dtype)
    if ctx.has_bias:
        db = dyf.reshape(-1, n).sum(0).reshape(ctx.bias_shape).to(ctx.bias_dtype)  # sum_rows dy
    g = dyf if weight is None else dyf * weight.float()  # dL/dxhat
    # d/dx [(x - mean) * r] with r = (var + eps)^-1/2:  r * (g - mean(g) - xhat * mean(g * xhat))
    dx = r * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw, db, None


_layer_norm_op.register_autograd(_backward, setup_context=_setup)


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim of ``x`` (any leading shape), then ``* weight`` and ``+ bias``
    when given (each of last-dim size, or None); biased variance as torch.nn.functional.layer_norm.
    Output in x.dtype. Fused on CUDA (or the Triton interpreter), the torch reference elsewhere or
    for a non-contiguous / unsupported-dtype input (warned once)."""
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.numel() != x.shape[-1]:
            raise ValueError(f"layer_norm: {name} has {t.numel()} elements, x's last dim is {x.shape[-1]}")
    return _layer_norm_op(x, weight, bias, float(eps))[0]
