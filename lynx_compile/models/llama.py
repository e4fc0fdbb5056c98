"""Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases.

    idx (B, T) -> tok_embeddings -> blocks.0 ... blocks.{L-1} -> norm -> output -> logits

    block:  n = attention_norm(x)
            q, k, v = rope(attn.wq(n)), rope(attn.wk(n)), attn.wv(n)   # k, v: n_kv_heads heads
            x = x + dropout(attn.wo(causal_attention(q, k, v)))
            m = ffn_norm(x)
            x = x + dropout(mlp.w2(silu(mlp.w1(m)) * mlp.w3(m)))

RoPE is written in real arithmetic (rotate-half form with cos/sin tables) because complex
tensors trace badly. Each attention module keeps its own cos/sin buffers so that every block is
a self-contained ``(B, T, C) -> (B, T, C)`` map (see ``common.py``); they are small
(2 x seq_len x head_dim) and not saved in the state dict.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
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
class LlamaConfig:
    """Shape and options of a :class:`Llama`."""

    vocab_size: int
    """Number of token ids (embedding rows and output-head columns)."""
    seq_len: int
    """Maximum sequence length T (rows of the RoPE tables)."""
    n_layers: int
    """Number of transformer blocks L."""
    hidden: int
    """Model width h (C in the shape comments)."""
    n_heads: int
    """Query heads; must divide ``hidden``."""
    n_kv_heads: int
    """Key/value heads for grouped-query attention; must divide ``n_heads`` (1 = multi-query)."""
    ffn_hidden: int | None = None
    """SwiGLU inner width; None applies the Llama rule, see :attr:`ffn_dim`."""
    multiple_of: int = 256
    """The Llama rule rounds the SwiGLU width up to a multiple of this."""
    dropout: float = 0.0
    """Dropout on attention probabilities and both residual branches (Llama trains without)."""
    rope_theta: float = 10000.0
    """RoPE base: pair i of a head rotates by position * theta^(-2i / head_dim)."""
    eps: float = 1e-5
    """RMSNorm epsilon."""
    attn_impl: AttnImpl = "manual"
    """"manual": explicit softmax attention, s x s tensors visible to the planner (default).
    "sdpa": ``F.scaled_dot_product_attention``, fused."""

    def __post_init__(self) -> None:
        check_common_fields(
            hidden=self.hidden,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            seq_len=self.seq_len,
            dropout=self.dropout,
            attn_impl=self.attn_impl,
        )
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """The SwiGLU width in use: ``ffn_hidden``, or multiple_of * ceil((2/3 * 4h) / multiple_of).

        A property rather than a value filled in at construction, so that
        ``dataclasses.replace(config, hidden=...)`` recomputes it.
        """
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        width = int(2 * 4 * self.hidden / 3)
        return self.multiple_of * -(-width // self.multiple_of)

    def num_parameters(self) -> int:
        """Exact parameter count of ``Llama(self)``, computed without building it."""
        h, f = self.hidden, self.ffn_dim
        kv = self.n_kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h  # wq, wk, wv, wo
        mlp = 3 * h * f  # w1, w3, w2
        per_layer = attn + mlp + 2 * h  # + attention_norm, ffn_norm
        return 2 * self.vocab_size * h + self.n_layers * per_layer + h  # embed, output, norm


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalize in fp32 so low-precision inputs do not lose the mean of squares.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (B, T, C)
        return xf.type_as(x) * self.weight  # (B, T, C)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin tables (seq_len, head_dim) for the rotate-half RoPE form.

    Frequency i (of head_dim / 2) is theta^(-2i / head_dim); both halves of the head dimension
    use the same frequencies, so feature j and j + head_dim/2 form a rotated pair.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (hd/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
    return angles.cos(), angles.sin()


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (..., T, hd) by position: x * cos + rotate_half(x) * sin, with cos/sin (T, hd)."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal attention with RoPE on q and k."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.attn_impl = config.attn_impl
        kv = config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.hidden, config.hidden, bias=False)
        self.wk = nn.Linear(config.hidden, kv, bias=False)
        self.wv = nn.Linear(config.hidden, kv, bias=False)
        self.wo = nn.Linear(config.hidden, config.hidden, bias=False)
        self.resid_drop = nn.Dropout(config.dropout)
        cos, sin = rope_tables(config.seq_len, config.head_dim, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (seq_len, hd)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.wq(x).view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Each kv head serves nh // nkv consecutive query heads (repeat_interleave on dim 1).
        rep = nh // nkv
        k = k[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)  # (B, nh, T, hd)
        v = v[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)  # (B, nh, T, hd)
        y = causal_attention(
            q, k, v, impl=self.attn_impl, dropout_p=self.dropout, training=self.training
        )  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hd) = (B, T, C)
        return self.resid_drop(self.wo(y))  # (B, T, C)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): gate w1 and up w3 h -> f, down w2 f -> h."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.hidden, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.hidden, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = F.silu(self.w1(x)) * self.w3(x)  # (B, T, F)
        return self.dropout(self.w2(x))  # (B, T, C)


class Block(nn.Module):
    """Pre-RMSNorm transformer block, (B, T, C) -> (B, T, C)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden, config.eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden, config.eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attention_norm(x))  # (B, T, C)
        x = x + self.mlp(self.ffn_norm(x))  # (B, T, C)
        return x


class Llama(nn.Module):
    """Llama-style language model; see the module docstring for the layout."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden, config.eps)
        self.output = nn.Linear(config.hidden, config.vocab_size, bias=False)  # untied
        init_weights_(self, n_layers=config.n_layers, residual_suffixes=("wo.weight", "w2.weight"))

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
        return self.tok_embeddings(idx)  # (B, T, C)

    def head(self, x: Tensor) -> Tensor:
        return self.output(self.norm(x))  # (B, T, V)

    def pipeline_stage(self, start: int, end: int, *, first: bool, last: bool) -> nn.Module:
        """Blocks [start, end) as a pipeline stage sharing this model's modules."""
        return PipelineStageShell(self, start, end, first=first, last=last,
                                  embed=("tok_embeddings",), head=("norm", "output"))
