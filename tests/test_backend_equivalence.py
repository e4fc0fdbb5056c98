"""torch.compile(backend="lynx", options={"compiler": "eager"}) trains exactly like eager under
every policy (the Inductor build, whose dropout draws Inductor's own random numbers, is checked
against Inductor without recompute in ``tests/test_inductor.py``).

3 AdamW steps with dropout on and the same seed: loss and every parameter gradient equal to
eager within 1e-5 relative (fp32). Dropout inside recomputed regions replays its saved RNG
state, so the regenerated masks are bit-identical to the forward's.
"""
import copy

import pytest
import torch

import lynx_compile
from lynx_compile.models import build_model, example_batch

POLICIES = ["none", "full", "selective", "torch"]


def _train(model, steps, batches, seed):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for step in range(steps):
        torch.manual_seed(seed + step)
        loss = model(batches[step]).loss
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n.removeprefix("_orig_mod."): p.grad.detach().clone()
                      for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_matches_eager(preset, policy):
    torch.manual_seed(0)
    eager = build_model(preset, dropout=0.1)
    compiled_model = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(1)
    batches = [example_batch(eager, 4, generator=g) for _ in range(3)]

    ref_losses, ref_grads = _train(eager, 3, batches, seed=100)
    options = {"policy": policy, "compiler": "eager"}  # Inductor draws its own random numbers
    if policy == "torch":
        options["memory_budget"] = 0.8
    compiled = torch.compile(compiled_model, backend="lynx", options=options)
    losses, grads = _train(compiled, 3, batches, seed=100)

    for step in range(3):
        assert _rel(losses[step], ref_losses[step]) <= 1e-5, (step, losses[step], ref_losses[step])
        for name, ref in ref_grads[step].items():
            assert _rel(grads[step][name], ref) <= 1e-5, (step, name)
    plans = lynx_compile.backend(**options).plans
    assert plans and plans[-1].policy == policy
    if policy in ("full", "selective"):
        assert plans[-1].recomputed, "policy recomputed nothing"
