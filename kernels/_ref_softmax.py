"""Pure-torch reference of the causal softmax kernel (merged into reference.py with the others)."""
from __future__ import annotations

import torch
from torch import Tensor


def causal_softmax(scores: Tensor, scale: float = 1.0) -> Tensor:
    """softmax_j(scale * s[..., i, j]) over j <= i, 0 for j > i; fp32 math, output in s.dtype."""
    T = scores.shape[-1]
    future = torch.ones(T, T, dtype=torch.bool, device=scores.device).triu(1)
    a = (scores.float() * scale).masked_fill(future, float("-inf"))
    return torch.softmax(a, dim=-1).to(scores.dtype)
