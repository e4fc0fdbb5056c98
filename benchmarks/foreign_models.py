"""Models lynx_compile was not written for, for ``benchmarks/bench_step.py``.

``PostLNGQALM`` is a decoder LM written the way a user writes one in plain PyTorch, with none of
the zoo's conventions (no ``blocks`` list, no ``LMOutput``, no in-forward causal mask):

    idx (B, T) -> tok_emb + pos_emb -> dropout -> layers.0 ... layers.{L-1} -> lm_head -> logits
    layer (post-LN, as in the original Transformer / BERT):
        x = norm1(x + dropout(attn(x)))         grouped-query attention, n_kv_heads < n_heads
        x = norm2(x + dropout(mlp(x)))          Linear d -> 4d, GELU, Linear 4d -> d

The LM head is tied to the token embedding; ``forward(idx)`` returns the logits, and
``forward(idx, targets)`` returns ``(logits, loss)`` with the loss computed inside forward
(nanoGPT's convention). Attention is ``F.scaled_dot_product_attention`` (``attn="sdpa"``) or
spelled out (``attn="explicit"``: scores, a causal mask registered as a buffer, softmax,
dropout); keys and values are shared by groups of ``n_heads // n_kv_heads`` query heads and
expanded with ``repeat_interleave``.

``hf_llama(...)`` builds HF ``transformers``' ``LlamaForCausalLM`` from a small ``LlamaConfig``
when ``transformers`` is importable (it is not a dependency of this project).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, kw_only=True)
class PostLNGQAConfig:
    vocab_size: int = 512
    seq_len: int = 128
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 8
    n_kv_heads: int = 2
    """Key/value heads; must divide ``n_heads`` (grouped-query attention when smaller)."""
    mlp_ratio: int = 4
    dropout: float = 0.0
    attn: Literal["sdpa", "explicit"] = "sdpa"
    ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}, "
                             f"and n_heads by n_kv_heads={self.n_kv_heads}")
        if self.attn not in ("sdpa", "explicit"):
            raise ValueError(f"attn must be 'sdpa' or 'explicit', got {self.attn!r}")


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: PostLNGQAConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * self.head_dim)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * self.head_dim)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.d_model)
        self.attn, self.p = cfg.attn, cfg.dropout
        if cfg.attn == "explicit":
            mask = torch.tril(torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool))
            self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        hd, rep = self.head_dim, self.n_heads // self.n_kv_heads
        q = self.q_proj(x).view(B, T, self.n_heads, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, hd).transpose(1, 2)  # (B, nkv, T, hd)
        k = k.repeat_interleave(rep, dim=1)  # (B, nh, T, hd)
        v = v.repeat_interleave(rep, dim=1)  # (B, nh, T, hd)
        p = self.p if self.training else 0.0
        if self.attn == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hd)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(hd)  # (B, nh, T, T)
            scores = scores.masked_fill(~self.causal_mask[:T, :T], float("-inf"))
            probs = F.dropout(scores.softmax(dim=-1), p=p, training=self.training)  # (B, nh, T, T)
            y = probs @ v  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, d)


class PostLNDecoderLayer(nn.Module):
    def __init__(self, cfg: PostLNGQAConfig) -> None:
        super().__init__()
        self.attn = GroupedQueryAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model))
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm1(x + self.dropout(self.attn(x)))  # (B, T, d)
        return self.norm2(x + self.dropout(self.mlp(x)))  # (B, T, d)


class PostLNGQALM(nn.Module):
    def __init__(self, cfg: PostLNGQAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(PostLNDecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor, targets: Tensor | None = None):
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.dropout(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, d)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(x)  # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def hf_llama(*, vocab_size: int, seq_len: int, n_layers: int, hidden: int, n_heads: int, n_kv_heads: int,
             dropout: float = 0.0, attn: str = "sdpa") -> nn.Module:
    """HF ``LlamaForCausalLM`` from a small ``LlamaConfig`` (``attn``: "sdpa" or "eager", HF's
    names). Raises ImportError without ``transformers``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=_llama_ffn(hidden),
                         num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                         max_position_embeddings=seq_len, attention_dropout=dropout, tie_word_embeddings=True,
                         use_cache=False, attn_implementation=attn)
    return LlamaForCausalLM(config)


def _llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4h, rounded up to a multiple of ``multiple_of`` (of 8 when small)."""
    m = multiple_of if hidden >= 1024 else 8
    return m * math.ceil(int(8 * hidden / 3) / m)
