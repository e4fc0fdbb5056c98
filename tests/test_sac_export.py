"""A lynx plan exported as torch.utils.checkpoint selective-checkpoint policies (no compile)."""
import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lynx_compile.models import build_model, example_batch
from lynx_compile.planning import plan_model
from lynx_compile.sac import sac_policies


def _forward(model, x, policies=None):
    """GPT forward with each block checkpointed under its exported policy."""
    B, T = x.shape
    h = model.drop(model.wte(x) + model.wpe(torch.arange(T)))
    for i, block in enumerate(model.blocks):
        if policies is None:
            h = block(h)
        else:
            h = checkpoint(block, h, use_reentrant=False, context_fn=policies[f"blocks.{i}"])
    logits = model.lm_head(model.ln_f(h))
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def _saved_bytes(fn):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    return loss, total


def test_exported_policy_matches_eager_and_saves_less():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.1)
    x = example_batch(model, 4)
    records = plan_model(model, (x,), policy="lynx", memory_budget=0.9, solver="heu")
    plan = records[0].plan
    assert plan.recomputed and set(plan.block_ops) == {"blocks.0", "blocks.1"}
    policies = sac_policies(plan)

    twin = copy.deepcopy(model)
    torch.manual_seed(3)
    ref, ref_saved = _saved_bytes(lambda: _forward(model, x))
    ref.backward()
    torch.manual_seed(3)
    loss, saved = _saved_bytes(lambda: _forward(twin, x, policies))
    loss.backward()
    assert torch.allclose(loss, ref, rtol=1e-6)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert saved < ref_saved


def test_policy_without_decisions_is_refused():
    model = build_model("gpt-tiny")
    plan = plan_model(model, (example_batch(model, 2),), policy="full")[0].plan
    with pytest.raises(ValueError, match="plan with policy 'lynx'"):
        sac_policies(plan)
