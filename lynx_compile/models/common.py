"""Pieces shared by the model zoo: the output record, the attention core, the loss and the init.

Every model in the zoo has the same outer contract, which the rest of lynx_compile relies on:

- ``model.blocks`` is an ``nn.ModuleList`` of identical blocks (module paths ``blocks.0``,
  ``blocks.1``, ...). Each block maps ``(B, T, C) -> (B, T, C)`` and takes no other input, so
  block detection can find repeated children and a pipeline stage is just a slice of ``blocks``.
- Inside each block, attention lives under ``attn`` and the feed-forward under ``mlp``.
- ``model(idx)`` returns :class:`LMOutput`; ``model(idx).loss`` is a scalar training loss.

Why the manual attention is the default: recomputation policies (selective recompute in
Megatron's sense, REFERENCE.md section 3) target the s x s tensors of attention -- the scores,
the softmax, its dropout mask. With ``attn_impl="manual"`` those appear as ordinary ops
(``bmm``, ``masked_fill``, ``_softmax``, ``native_dropout``) in the traced graph and the
planner can choose to save or recompute each one. With ``"sdpa"`` they are fused inside one op
that saves only O(s) statistics, so there is little left to plan.
"""
from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

AttnImpl = Literal["manual", "sdpa"]
ATTN_IMPLS: frozenset[str] = frozenset({"manual", "sdpa"})

INIT_STD = 0.02
"""Standard deviation of the GPT-2 normal init, for every Linear and Embedding weight."""


class LMOutput(NamedTuple):
    """What every zoo model returns from ``forward``."""

    loss: Tensor
    """Scalar mean next-token cross-entropy."""
    logits: Tensor
    """(B, T, vocab_size) unnormalized scores for the token after each position."""


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, *, impl: AttnImpl, dropout_p: float, training: bool
) -> Tensor:
    """Causal softmax attention over heads: q, k, v (B, nh, T, hd) -> (B, nh, T, hd).

    ``dropout_p`` is applied to the attention probabilities only while ``training``.
    Both implementations compute the same function; "manual" spells out the math so that the
    s x s intermediates are separate graph nodes (see the module docstring).
    """
    p = dropout_p if training else 0.0
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    T, hd = q.size(-2), q.size(-1)
    scale = 1.0 / math.sqrt(hd)
    att = (q @ k.transpose(-2, -1)) * scale  # (B, nh, T, T)
    # Built in forward rather than stored as a buffer: no per-block T x T state, works on the
    # meta device, and a planner sees a cheap input-free op it can always recompute.
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(diagonal=1)  # (T, T)
    att = att.masked_fill(future, float("-inf"))  # (B, nh, T, T)
    att = F.softmax(att, dim=-1)  # (B, nh, T, T)
    att = F.dropout(att, p=p, training=training)  # (B, nh, T, T)
    return att @ v  # (B, nh, T, hd)


def lm_loss(logits: Tensor, idx: Tensor, targets: Tensor | None) -> Tensor:
    """Mean cross-entropy of ``logits`` (B, T, V).

    With ``targets`` (B, T) the targets are taken as already aligned with ``logits`` (nanoGPT
    convention; entries equal to -100 are ignored). Without them the loss is next-token
    prediction of ``idx`` on itself: ``logits[:, :-1]`` against ``idx[:, 1:]``.
    """
    if targets is None:
        logits, targets = logits[:, :-1], idx[:, 1:]  # (B, T-1, V), (B, T-1)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def init_weights_(model: nn.Module, *, n_layers: int, residual_suffixes: tuple[str, ...]) -> None:
    """GPT-2 init, in place: weights of Linear and Embedding ~ N(0, 0.02), biases zero.

    Projections that write into the residual stream (parameter names ending in one of
    ``residual_suffixes``) get std 0.02 / sqrt(2 * n_layers), as in GPT-2, so the residual
    variance does not grow with depth. Norm layers keep their own init (weight 1, bias 0).
    Deterministic given ``torch.manual_seed``: parameters are visited in registration order.
    """
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    residual_std = INIT_STD / math.sqrt(2 * n_layers)
    for name, param in model.named_parameters():
        if name.endswith(residual_suffixes):
            nn.init.normal_(param, mean=0.0, std=residual_std)


def check_common_fields(
    *, hidden: int, n_heads: int, n_layers: int, seq_len: int, dropout: float, attn_impl: str
) -> None:
    """Raise ValueError for config values that no zoo model can build."""
    if min(hidden, n_heads, n_layers, seq_len) < 1:
        raise ValueError("hidden, n_heads, n_layers and seq_len must all be positive")
    if hidden % n_heads:
        raise ValueError(f"hidden={hidden} is not divisible by n_heads={n_heads}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl must be one of {sorted(ATTN_IMPLS)}, got {attn_impl!r}")


class PipelineStageShell(nn.Module):
    """Blocks ``start .. end-1`` of a zoo model, plus its embedding (``first``) and its final norm
    and head (``last``): one pipeline stage that *shares* the model's modules (nothing copied,
    tensor-parallel modules included). Parameter names are the model's (``blocks.3.attn...``,
    ``wte.weight``), so a stage's gradients compare name by name with the unsplit model.

    ``forward``: token ids on the first stage, the (B, T, C) hidden state elsewhere; returns the
    hidden state, or the logits on the last stage."""

    def __init__(self, model: nn.Module, start: int, end: int, *, first: bool, last: bool,
                 embed: tuple[str, ...], head: tuple[str, ...]):
        super().__init__()
        self.first, self.last = first, last
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, end)})
        self._model_ref = [model]  # a list, so the whole model is not registered as a child
        for name in embed if first else ():
            setattr(self, name, getattr(model, name))
        for name in head if last else ():
            setattr(self, name, getattr(model, name))

    def forward(self, x: Tensor) -> Tensor:
        model = type(self._model_ref[0])
        if self.first:
            x = model.embed(self, x)  # (B, T) ids -> (B, T, C)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C)
        if self.last:
            x = model.head(self, x)  # (B, T, C) -> (B, T, V)
        return x
