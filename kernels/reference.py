"""Pure-torch references of every lynx kernel: the test oracle, the CPU fallback, and the
baseline the GPU benchmark compares against. Math in fp32, result in the input's dtype."""
from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """y = x / sqrt(mean(x^2, -1) + eps) * weight over the last dim; also rstd (fp32, one per row)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return (xf * rstd * weight.float()).to(x.dtype), rstd.squeeze(-1)
