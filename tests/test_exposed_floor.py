"""``seeds.exposed_floor``: the exposed recompute a baseline's decisions cannot go below, read off
the tagged joint before any partition (issue P item 3: a baseline seed that cannot beat lynx's
plan is not partitioned). Reference: the same decisions realized (torch's partitioner, then the
backward as compiled) and priced by ``seeds.exposed``, the measure candidates compete on.

1. The floor is never above the realized exposed recompute, for ``full`` and ``selective``, under
   both compilers, on the zoo's GPT and Llama and on HF Llama.
2. Skipping changes no plan: the plans with skipping equal those where every baseline is realized."""
import json

import pytest

from lynx_compile.planning import plan_model
from lynx_compile.recompute import seeds
from _reach import reach_model

OPTS = dict(cost_source="analytic", hardware="h100-sxm", plan_cache=False)


def _plan(model, x, **options):
    """The records of the graphs lynx plans for ``model`` on ``x`` (``plan_model``: traced and
    partitioned as a compile does, under the same compiler's joint graph, then stopped before
    Inductor generates code: the floors and the realized exposed recompute are read while the
    joint is partitioned, and nothing asserted here runs the step)."""
    for p in model.parameters():  # from .grad None, whatever ran this model before: one .grad regime planned
        p.grad = None
    return plan_model(model, (x,), **OPTS, **options)


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "hf-llama"])
def test_floor_is_never_above_the_realized_exposed_recompute(name, compiler, monkeypatch):
    model, x = reach_model(name, monkeypatch)
    seen = []
    original = seeds.baseline_candidates

    def every_baseline_realized(joint, ctx, kw, policies, frac, settings=(), *, beat=None, budget=None):
        for cand, applied in original(joint, ctx, kw, policies, frac, settings, beat=None):
            if cand.policy in policies:
                seen.append((cand, seeds.exposed_floor(joint, ctx, applied.decisions),
                             seeds.exposed(applied, joint)))
            yield cand, applied

    monkeypatch.setattr(seeds, "baseline_candidates", every_baseline_realized)
    _plan(model, x, memory_budget=0.8, compiler=compiler)
    assert {c.policy for c, *_ in seen} == {"full", "selective"}, seen
    for cand, floor, realized in seen:
        assert 0.0 <= floor <= realized * (1 + 1e-9) + 1e-15, (cand, floor, realized)
    full = [(f, r) for c, f, r in seen if c.policy == "full"]
    assert all(f > 0.5 * r for f, r in full), full  # a floor that says something: most of full's recompute


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_skipping_changes_no_plan(name, monkeypatch):
    """At 0.9 lynx's optimizer has a plan on both (analytic H100 costs, batch 2), exposing less
    than ``full`` can (gpt-tiny: than ``selective`` too), so those are not partitioned."""
    model, x = reach_model(name, monkeypatch)
    skipped = _plan(model, x, memory_budget=0.9)
    monkeypatch.setattr(seeds, "exposed_floor", lambda *a: 0.0)  # every baseline realized
    monkeypatch.setattr(seeds, "_check_choice", lambda *a: None)  # (not stopped at min-cut's choice either)
    realized = _plan(model, x, memory_budget=0.9)
    assert len(skipped) == len(realized) == 1
    a, b = skipped[0], realized[0]
    assert a.plan.decisions.to_dict() == b.plan.decisions.to_dict()
    assert a.plan.peak_bytes == b.plan.peak_bytes and a.plan.solver == b.plan.solver == "opt-highs"
    cands = a.stats["candidates"]
    assert "skipped" in cands["full"], json.dumps(cands)
    assert cands["full"]["exposed_at_least_s"] >= cands["lynx"]["exposed_s"]
    assert b.stats["candidates"]["full"]["exposed_s"] >= cands["full"]["exposed_at_least_s"]
