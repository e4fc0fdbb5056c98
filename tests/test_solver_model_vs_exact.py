"""The optimizer's memory model against the exact simulation of the rewritten graphs.

The recompute MILP plans on a linear model (``solver/problem.py``); the plan that counts is
the partitioned graphs' exact simulated peak. The model must not understate a plan's peak
(else its plans overshoot and are re-solved), and must not overstate it so much that budgets
its own baselines reach look infeasible (issue L: the 1.3B ``lynx plan --memory-budget 0.4``
ended with the ``selective`` seed because the model counted every link of a recompute chain
live at once, and both outputs of every dropout). Paper-scale GPT cut to gpt-small, planned
on the meta device (nothing runs), eager and Inductor partitions.
"""
import pytest
import torch

from lynx_compile.decisions import DEMAND
from lynx_compile.models import build_model, example_batch
from lynx_compile.planning import plan_model
from lynx_compile.solver.evaluate import evaluate

pytest.importorskip("highspy")
OPTIONS = dict(hardware="h100-sxm", cost_source="analytic", plan_cache=False)


def _units_of(problem, decisions):
    """A baseline's node-level decisions as the problem's assignment: a unit is demanded when
    its op is recomputed; an intermediate a demanded unit reads is kept when not demanded."""
    demanded = {name for name, d in decisions if d == DEMAND}
    demand = {u.id for u in problem.units if u.name in demanded and not u.must_keep}
    keep = {u.id for u in problem.units if u.id not in demand and (u.first_use is not None or u.must_keep)}
    for u in problem.units:
        if u.id not in demand | keep and any(u.id in v.inputs for v in problem.units if v.id in demand):
            keep.add(u.id)
    return keep, demand


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_model_bounds_full_recompute_tightly_and_highs_plans_at_0_4(compiler):
    torch.manual_seed(0)
    model = build_model("gpt-small", device="meta")
    x = example_batch(model, 1, device="meta")
    bound = plan_model(model, (x,), policy="lynx", memory_budget=1.0, solver="highs", compiler=compiler,
                       **OPTIONS)[0]
    full = plan_model(model, (x,), policy="full", compiler=compiler, **OPTIONS)[0]
    problem = bound.problem
    ev = evaluate(problem, _units_of(problem, full.plan.decisions))
    assert ev.violations == ()
    exact = full.plan.peak_bytes
    # an upper bound of the exact peak, within 15 % of it (it was 34 % over before chains); with
    # the parameter gradients in the step's peak (issue M): 4.3 % (eager) / 1.2 % (inductor) at
    # batch 1, but 22-26 % on eager at batch 4-8 (not analysed yet)
    assert exact <= ev.peak_bytes <= 1.15 * exact, (ev.peak_bytes / problem.reference_peak,
                                                    exact / problem.reference_peak)
    # the MILP finds its own plan at 0.41, which fits exactly: at batch 8, since at batch 1 the
    # parameter gradients hold full's peak at 0.65-0.71 of none's (at batch 8: 0.32 / 0.37).
    # (0.4 before alias_clones_pass: the eager reference no longer counts the dropout copies,
    # and the optimizer's own floor there is now 0.401 of it; it plans at 0.41, peak 0.377.)
    x8 = example_batch(model, 8, device="meta")
    lynx = plan_model(model, (x8,), policy="lynx", memory_budget=0.41, solver="highs", compiler=compiler,
                      **OPTIONS)[0]
    assert lynx.plan.solver == "opt-highs", lynx.notes
    assert lynx.plan.peak_bytes <= 0.41 * lynx.problem.reference_peak + 1
