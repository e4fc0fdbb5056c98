"""CPU tests for lynx_compile.models: shapes, loss, compile parity, parameter counts, RoPE, GQA."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from lynx_compile.models import (
    GPT,
    PRESETS,
    GPTConfig,
    Llama,
    LlamaConfig,
    LMOutput,
    build_model,
    example_batch,
    load_model_spec,
    num_parameters,
)
from lynx_compile.models import presets as presets_module
from lynx_compile.models.llama import RMSNorm, apply_rope, rope_tables

TINY = ("gpt-tiny", "llama-tiny")
IMPLS = ("manual", "sdpa")


def _seeded(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(name, **overrides)


def _loss_and_grads(model: torch.nn.Module, idx: torch.Tensor, run=None):
    """Loss and parameter grads of ``run(idx)`` (default: ``model``), keyed by ``model``'s names."""
    model.zero_grad(set_to_none=True)
    loss = (model if run is None else run)(idx).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rtol * max(scale, 1e-12), f"{what}: max err {err:.3e} vs scale {scale:.3e}"


# ---------------------------------------------------------------- shapes and loss


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("T", [32, 9])
def test_output_shapes(name: str, T: int) -> None:
    model = _seeded(name)
    cfg = model.config
    idx = torch.randint(0, cfg.vocab_size, (3, T))
    out = model(idx)
    assert isinstance(out, LMOutput)
    assert out.logits.shape == (3, T, cfg.vocab_size)
    assert out.loss.shape == ()
    assert [name for name, _ in model.blocks.named_children()] == [
        str(i) for i in range(cfg.n_layers)
    ]
    assert len({type(b) for b in model.blocks}) == 1


@pytest.mark.parametrize("name", TINY)
def test_loss_is_next_token_cross_entropy(name: str) -> None:
    model = _seeded(name, dropout=0.0)
    idx = example_batch(model, 2, generator=torch.Generator().manual_seed(1))
    out = model(idx)
    V = model.config.vocab_size
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), idx[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    targets = torch.roll(idx, -1, dims=1)
    explicit = model(idx, targets)
    expected = F.cross_entropy(out.logits.reshape(-1, V), targets.reshape(-1))
    torch.testing.assert_close(explicit.loss, expected)


def test_init_is_deterministic_and_lm_head_tied() -> None:
    a, b = _seeded("gpt-tiny", seed=3), _seeded("gpt-tiny", seed=3)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    assert a.lm_head.weight is a.wte.weight
    assert abs(a.wte.weight.std().item() - 0.02) < 0.002


# ---------------------------------------------------------------- compile parity


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", TINY)
def test_compile_matches_eager(name: str, impl: str) -> None:
    model = _seeded(name, dropout=0.0, attn_impl=impl)
    idx = example_batch(model, 2, generator=torch.Generator().manual_seed(0))
    loss_e, grads_e = _loss_and_grads(model, idx)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss_c, grads_c = _loss_and_grads(model, idx, run=compiled)
    _assert_rel_close(loss_c, loss_e, 1e-5, "loss")
    assert grads_c.keys() == grads_e.keys()
    for n in grads_e:
        _assert_rel_close(grads_c[n], grads_e[n], 1e-5, n)


@pytest.mark.parametrize("name", TINY)
def test_compile_with_dropout_runs(name: str) -> None:
    model = _seeded(name, dropout=0.2)
    model.train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(example_batch(model, 2)).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", TINY)
def test_manual_attention_equals_sdpa(name: str) -> None:
    manual = _seeded(name, dropout=0.0, attn_impl="manual")
    sdpa = build_model(name, dropout=0.0, attn_impl="sdpa")
    sdpa.load_state_dict(manual.state_dict())
    idx = example_batch(manual, 2)
    torch.testing.assert_close(sdpa(idx).logits, manual(idx).logits, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- sizes and presets


def test_meta_build_of_23b_allocates_nothing() -> None:
    model = build_model("gpt-23b", device="meta")
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    assert 22e9 < num_parameters("gpt-23b") < 24e9
    out = model(torch.zeros(1, 16, dtype=torch.long, device="meta"))
    assert out.logits.shape == (1, 16, 51200) and out.logits.is_meta


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_parameters_matches_meta_build(name: str) -> None:
    model = build_model(name, device="meta")
    assert num_parameters(name) == sum(p.numel() for p in model.parameters())


def test_docstring_table_matches_num_parameters() -> None:
    rows = re.findall(r"^\s+(\S+)\s.*\s([\d,]{5,})$", presets_module.__doc__, flags=re.M)
    table = {name: int(count.replace(",", "")) for name, count in rows}
    assert table == {name: num_parameters(name) for name in PRESETS}


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="gpt-tiny.*llama-tiny"):
        build_model("gpt-huge")
    with pytest.raises(ValueError, match="gpt-tiny"):
        load_model_spec("gpt-huge")
    with pytest.raises(ValueError, match="cannot load"):
        load_model_spec("no_such_module_xyz:make")


def make_tiny_llama(**overrides) -> Llama:
    """Factory for the ``module:callable`` spec test."""
    return build_model("llama-tiny", **overrides)


def test_load_model_spec() -> None:
    assert isinstance(load_model_spec("gpt-tiny"), GPT)
    model = load_model_spec(f"{__name__}:make_tiny_llama", n_layers=3)
    assert isinstance(model, Llama) and len(model.blocks) == 3


def test_build_model_overrides_dtype_and_example_batch() -> None:
    model = build_model("gpt-tiny", dtype=torch.bfloat16, seq_len=64, dropout=0.0)
    assert model.config.seq_len == 64 and model.config.dropout == 0.0
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert PRESETS["gpt-tiny"].seq_len == 32  # presets are not mutated
    a = example_batch(model, 4, generator=torch.Generator().manual_seed(7))
    b = example_batch("gpt-tiny", 4, generator=torch.Generator().manual_seed(7))
    assert a.shape == (4, 64) and a.dtype == torch.long
    assert 0 <= a.min() and a.max() < 128
    assert b.shape == (4, 32)
    assert model(a).logits.dtype == torch.bfloat16


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=8, seq_len=8, n_layers=1, hidden=10, n_heads=4)
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig(vocab_size=8, seq_len=8, n_layers=1, hidden=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="attn_impl"):
        GPTConfig(vocab_size=8, seq_len=8, n_layers=1, hidden=8, n_heads=2, attn_impl="flash")
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["gpt-tiny"].hidden = 1  # type: ignore[misc]


def test_llama_ffn_rule() -> None:
    cfg = LlamaConfig(vocab_size=8, seq_len=8, n_layers=1, hidden=4096, n_heads=32, n_kv_heads=32)
    assert cfg.ffn_dim == 11008  # Llama-7B
    assert dataclasses.replace(cfg, ffn_hidden=100).ffn_dim == 100
    assert dataclasses.replace(cfg, hidden=64, n_heads=4, n_kv_heads=4).ffn_dim == 256


def test_gelu_tanh_option() -> None:
    model = build_model("gpt-tiny", gelu_approx="tanh")
    assert model.blocks[0].mlp.gelu.approximate == "tanh"
    assert torch.isfinite(model(example_batch(model, 1)).loss)


# ---------------------------------------------------------------- Llama parts


@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_gqa_equals_mha_with_repeated_kv(n_kv_heads: int) -> None:
    gqa = _seeded("llama-tiny", dropout=0.0, n_kv_heads=n_kv_heads)
    cfg = gqa.config
    mha = build_model(cfg, n_kv_heads=cfg.n_heads)
    state = gqa.state_dict()
    rep, hd = cfg.n_heads // n_kv_heads, cfg.head_dim
    for key in list(state):
        if key.endswith(("attn.wk.weight", "attn.wv.weight")):
            w = state[key].view(n_kv_heads, hd, cfg.hidden)
            state[key] = w.repeat_interleave(rep, dim=0).reshape(cfg.n_heads * hd, cfg.hidden)
    mha.load_state_dict(state)
    idx = example_batch(gqa, 2)
    out = gqa(idx)
    out.loss.backward()
    torch.testing.assert_close(out.logits, mha(idx).logits, rtol=1e-5, atol=1e-5)
    assert gqa.blocks[0].attn.wk.weight.shape == (n_kv_heads * hd, cfg.hidden)


def test_rope_scores_depend_only_on_relative_position() -> None:
    T, hd = 24, 16
    cos, sin = rope_tables(T, hd, theta=10000.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    # Place the same q at every position and the same k at every position.
    q_rot = apply_rope(q.expand(T, hd), cos, sin)  # (T, hd)
    k_rot = apply_rope(k.expand(T, hd), cos, sin)  # (T, hd)
    scores = q_rot @ k_rot.T  # (T, T): scores[i, j] = <rope(q, i), rope(k, j)>
    for offset in range(-T + 1, T):
        diag = torch.diagonal(scores, offset=offset)
        torch.testing.assert_close(diag, diag[0].expand_as(diag), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(scores[0, 0], scores[0, 5])  # it does depend on i - j
    torch.testing.assert_close(q_rot[0], q)  # position 0 is the identity
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm().expand(T))  # rotations keep norms


def test_rmsnorm_matches_formula() -> None:
    norm = RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 12)
    expected = F.rms_norm(x, (12,), norm.weight, eps=1e-6)
    torch.testing.assert_close(norm(x), expected)
