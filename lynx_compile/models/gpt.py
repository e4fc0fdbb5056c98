"""GPT-2 style decoder (nanoGPT layout), the model the Lynx paper plans for.

    idx (B, T) -> wte + wpe -> dropout -> blocks.0 ... blocks.{L-1} -> ln_f -> lm_head -> logits

    block:  x = x + dropout(attn.c_proj(causal_attention(attn.c_attn(ln_1(x)))))
            x = x + dropout(mlp.c_proj(gelu(mlp.c_fc(ln_2(x)))))

The LM head shares its weight with the token embedding (tied), so it is counted once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from lynx_compile.models.common import (
    AttnImpl,
    LMOutput,
    PipelineStageShell,
    causal_attention,
    check_common_fields,
    init_weights_,
    lm_loss,
)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape and options of a :class:`GPT`."""

    vocab_size: int
    """Number of token ids; the embedding and LM head have this many rows."""
    seq_len: int
    """Maximum sequence length T (rows of the learned position embedding)."""
    n_layers: int
    """Number of transformer blocks L."""
    hidden: int
    """Model width h (C in the shape comments)."""
    n_heads: int
    """Attention heads a; must divide ``hidden``."""
    dropout: float = 0.1
    """Dropout on embeddings, attention probabilities and both residual branches."""
    attn_impl: AttnImpl = "manual"
    """"manual": explicit softmax attention, s x s tensors visible to the planner (default).
    "sdpa": ``F.scaled_dot_product_attention``, fused."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers (GPT-2 has them)."""
    gelu_approx: Literal["none", "tanh"] = "none"
    """GeLU form in the MLP: exact erf ("none") or the tanh approximation of GPT-2 ("tanh")."""
    ln_eps: float = 1e-5
    """LayerNorm epsilon."""

    def __post_init__(self) -> None:
        check_common_fields(
            hidden=self.hidden,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            seq_len=self.seq_len,
            dropout=self.dropout,
            attn_impl=self.attn_impl,
        )
        if self.gelu_approx not in ("none", "tanh"):
            raise ValueError(f"gelu_approx must be 'none' or 'tanh', got {self.gelu_approx!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def num_parameters(self) -> int:
        """Exact parameter count of ``GPT(self)``, computed without building it."""
        h, b = self.hidden, int(self.bias)
        # c_attn h*3h, attn c_proj h*h, mlp c_fc h*4h, mlp c_proj 4h*h.
        linear = 12 * h * h + b * (3 * h + h + 4 * h + h)
        norms = 2 * (h + b * h)
        embeddings = self.vocab_size * h + self.seq_len * h  # lm_head is tied to wte
        return embeddings + self.n_layers * (linear + norms) + (h + b * h)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.dropout = config.dropout
        self.attn_impl = config.attn_impl
        self.c_attn = nn.Linear(config.hidden, 3 * config.hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.hidden, config.hidden, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        nh = self.n_heads
        # Widths come from c_attn's output, not from C: under tensor parallelism c_attn holds
        # this rank's n_heads / tp heads of each of q, k and v (distributed/tensor_parallel.py).
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # 3 x (B, T, C)
        hd = q.size(-1) // nh
        q = q.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        y = causal_attention(
            q, k, v, impl=self.attn_impl, dropout_p=self.dropout, training=self.training
        )  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd) = (B, T, C)
        return self.resid_drop(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Linear h -> 4h, GeLU, Linear 4h -> h, dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden, 4 * config.hidden, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approx)
        self.c_proj = nn.Linear(4 * config.hidden, config.hidden, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.gelu(self.c_fc(x))  # (B, T, 4C)
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block, (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden, eps=config.ln_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden, eps=config.ln_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """GPT-2 style language model; see the module docstring for the layout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.hidden, eps=config.ln_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, counted once
        init_weights_(self, n_layers=config.n_layers, residual_suffixes=("c_proj.weight",))

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> LMOutput:
        """idx (B, T) int64 with T <= seq_len; targets (B, T) or None (next-token of idx)."""
        logits = self.logits(idx)  # (B, T, V)
        return LMOutput(lm_loss(logits, idx, targets), logits)

    def logits(self, idx: Tensor) -> Tensor:
        """(B, T) token ids -> (B, T, V) scores, no loss (what a pipeline's last stage returns)."""
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.head(x)  # (B, T, V)

    def embed(self, idx: Tensor) -> Tensor:
        """(B, T) token ids -> (B, T, C): token + position embeddings, dropout."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def head(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, V): final LayerNorm and the (tied) LM head."""
        return self.lm_head(self.ln_f(x))

    def pipeline_stage(self, start: int, end: int, *, first: bool, last: bool) -> nn.Module:
        """Blocks [start, end) as a pipeline stage sharing this model's modules."""
        return PipelineStageShell(self, start, end, first=first, last=last,
                                  embed=("wte", "wpe", "drop"), head=("ln_f", "lm_head"))
