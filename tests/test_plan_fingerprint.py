"""The fingerprint ranks compare before they run a plan (``distributed.agreement``): what the
plan makes the graph do, whatever the graph's nodes are called.

Ranks can trace one graph (the same ops, shapes and order: an equal structural hash) and number
its nodes apart: torchtitan's deepseek_v3 under TP on gloo named one MoE output ``getitem_30`` on
rank 0 and ``getitem_31`` on rank 1, and every run stopped with ``PlanMismatchError`` although
both ranks planned the same tensors (issue S). With the nodes' places in the joint graph the
fingerprints agree; a plan saving another place still differs."""
from __future__ import annotations

import json

import torch

from lynx_compile.distributed.agreement import plan_fingerprint
from lynx_compile.recompute_plan import RecomputePlan


def _plan() -> RecomputePlan:
    from lynx_compile.models import build_model, example_batch
    from lynx_compile.planning import plan_model

    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layers=2, seq_len=64, dropout=0.0)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    plan = plan_model(model, (x,), memory_budget=0.6, plan_cache=False)[-1].plan
    assert plan.saved and plan.recomputed, plan  # something of each to name
    return plan


def _renamed(plan: RecomputePlan, rename: dict[str, str]) -> RecomputePlan:
    """``plan`` with every node name in ``rename`` replaced, as another rank's trace names them."""
    def walk(x):
        if isinstance(x, str):
            return rename.get(x, x)
        if isinstance(x, dict):
            return {walk(k): walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return RecomputePlan.from_dict(walk(json.loads(plan.to_json())))


def test_ranks_that_number_the_nodes_apart_agree_on_the_same_plan():
    plan = _plan()
    names = sorted({d.name for d in plan.saved + plan.recomputed})
    places = {n: i for i, n in enumerate(names)}
    rename = {n: f"{n}_other" for n in names}  # the other rank's names for the same places
    other = _renamed(plan, rename)
    other_places = {rename[n]: i for n, i in places.items()}

    assert plan_fingerprint(other) != plan_fingerprint(plan)  # by name: they look apart
    assert plan_fingerprint(other, other_places) == plan_fingerprint(plan, places)
    # a plan that saves what the other recomputes is another plan, whatever the names
    a, b = plan.saved[0].name, plan.recomputed[0].name
    swapped = _renamed(plan, {a: b, b: a})
    assert plan_fingerprint(swapped, places) != plan_fingerprint(plan, places)
