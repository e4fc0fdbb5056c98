"""RMSNorm recomputed from its saved input: one Triton program per row.

    y[r, :] = x[r, :] * rstd[r] * w,   rstd[r] = 1 / sqrt(mean_c x[r, c]^2 + eps)

Sandwich: ``_rms_norm_kernel`` (Triton) → ``_launch`` → custom op ``lynx::rms_norm`` (with a
fake for torch.compile and autograd) → ``rms_norm`` (public). Sums in fp32 whatever the input
dtype. The backward is torch math on the saved rstd (dx, dw), not a kernel: what lynx recomputes
in a backward is the forward output, which needs no gradient of its own.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from ._support import triton_importable, warn_fallback, why_not

if triton_importable():
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)  # fp32 accumulation
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * rstd * w
        tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)


def _launch(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    n_cols = x.shape[-1]
    rows = x.numel() // max(1, n_cols)
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x, weight, y, rstd, n_cols, eps, BLOCK=triton.next_power_of_2(n_cols))
    return y, rstd


@torch.library.custom_op("lynx::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    reason = why_not("rms_norm", x, weight)
    if reason is not None:
        warn_fallback("rms_norm", reason)
        y, rstd = reference.rms_norm(x, weight, eps)
        return y, rstd.contiguous()
    return _launch(x, weight, eps)


@_rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _setup(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy: Tensor, _drstd: Tensor):
    x, weight, rstd = ctx.saved_tensors
    xf, dyf, wf, r = x.float(), dy.float(), weight.float(), rstd.unsqueeze(-1)
    xhat = xf * r
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    g = dyf * wf
    # d/dx [x * r] with r = (mean x^2 + eps)^-1/2:  r * (g - xhat * mean(g * xhat))
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape) scaled by ``weight``; fused on CUDA
    (or the Triton interpreter), the torch reference elsewhere (warned once)."""
    if x.shape[-1] != weight.numel():
        raise ValueError(f"rms_norm: weight has {weight.numel()} elements, x's last dim is {x.shape[-1]}")
    return _rms_norm_op(x, weight, float(eps))[0]
