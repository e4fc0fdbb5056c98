"""``seeds.min_cut_floor``: the on-demand recompute a torch min-cut candidate exposes, read off
its choice of saved values before torch extracts the forward and backward (issue P item 3: a
min-cut seed that cannot beat lynx's plan is not extracted). Reference: the same candidate
extracted in full (torch's partitioner, then the backward as compiled) and priced by
``seeds.exposed``, the measure candidates compete on.

1. The floor is never above the realized exposed recompute of any torch setting tried, under
   both compilers, on the zoo's GPT and on HF Llama (and says something: most of it).
2. Skipping changes no plan: the plan, its peak and every realized candidate equal those of the
   same compile with every setting extracted, and fewer partitions are extracted."""
import json

import pytest
import torch

import lynx_compile
from lynx_compile.recompute import seeds
from _reach import reach_model

OPTS = dict(cost_source="analytic", hardware="h100-sxm", plan_cache=False)


def _plan(model, x, monkeypatch, **options):
    """(the records of this compile's graphs, how many partitions torch extracted)."""
    extracted = []
    original = torch._functorch.partitioners._extract_fwd_bwd_modules

    def counting(*args, **kwargs):
        extracted.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch._functorch.partitioners, "_extract_fwd_bwd_modules", counting)
    backend = lynx_compile.backend(**OPTS, **options)
    known = len(backend.records)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x).loss.backward()
    monkeypatch.setattr(torch._functorch.partitioners, "_extract_fwd_bwd_modules", original)
    return backend.records[known:], len(extracted)


@pytest.mark.parametrize("name,compiler", [("gpt-tiny", "inductor"), ("gpt-tiny", "eager"),
                                           ("hf-llama", "inductor")])
def test_floor_is_never_above_the_realized_exposed_recompute(name, compiler, monkeypatch):
    """At 0.8 lynx's optimizer has no plan for these (analytic H100 costs), so torch's min-cut
    is tried at every setting; each choice's floor is taken (an infinite plan to beat: nothing
    skipped) and set beside the candidate extracted from that same choice."""
    model, x = reach_model(name, monkeypatch)
    floors, seen = [], []
    floor_of = seeds.min_cut_floor
    candidates = seeds.baseline_candidates

    def recording_floor(joint, ctx, saved):
        floors.append(floor_of(joint, ctx, saved))
        return floors[-1]

    def every_setting_realized(joint, ctx, kw, policies, frac, settings=(), *, beat=None):
        taken = 0
        for cand, applied in candidates(joint, ctx, kw, policies, frac, settings, beat=float("inf")):
            if cand.startswith("torch@") and len(floors) > taken:  # a new choice (a repeat is not checked)
                taken = len(floors)
                seen.append((cand, floors[-1], seeds.exposed(applied, joint)))
            yield cand, applied

    monkeypatch.setattr(seeds, "min_cut_floor", recording_floor)
    monkeypatch.setattr(seeds, "baseline_candidates", every_setting_realized)
    _plan(model, x, monkeypatch, memory_budget=0.8, compiler=compiler)
    assert len(seen) >= 3, seen
    for cand, floor, realized in seen:
        assert 0.0 <= floor <= realized * (1 + 1e-9) + 1e-15, (cand, floor, realized)
        assert floor >= 0.5 * realized, (cand, floor, realized)  # most of it: a floor that says something


def test_skipping_changes_no_plan(monkeypatch):
    """gpt-tiny at 0.9: lynx's optimizer has a plan exposing less than torch's min-cut at the
    budget fraction and at half of it, so neither is extracted."""
    model, x = reach_model("gpt-tiny", monkeypatch)
    skipped, n_skipped = _plan(model, x, monkeypatch, memory_budget=0.9)
    monkeypatch.setattr(seeds, "_check_floor", lambda *a: None)  # every setting extracted
    realized, n_realized = _plan(model, x, monkeypatch, memory_budget=0.9)
    assert len(skipped) == len(realized) == 1
    a, b = skipped[0], realized[0]
    assert a.plan.decisions.to_dict() == b.plan.decisions.to_dict()
    assert a.plan.peak_bytes == b.plan.peak_bytes and a.plan.solver == b.plan.solver == "opt-highs"
    ca, cb = a.stats["candidates"], b.stats["candidates"]
    torch_skipped = [k for k, v in ca.items() if k.startswith("torch@") and "skipped" in v]
    assert torch_skipped, json.dumps(ca)
    for k in torch_skipped:  # the floor is at least lynx's exposed, and at most the candidate's own
        assert ca[k]["exposed_at_least_s"] >= ca["lynx"]["exposed_s"]
        assert cb[k]["exposed_s"] >= ca[k]["exposed_at_least_s"] * (1 - 1e-9)
    assert {k: v for k, v in ca.items() if k not in torch_skipped} == \
        {k: v for k, v in cb.items() if k not in torch_skipped}
    assert n_skipped < n_realized, (n_skipped, n_realized)
