"""``pipeline(..., per_microbatch=True)``: each stage's recompute chosen per micro-batch over a
zero-bubble schedule (``pipeline.stage_variants`` + ``pipeline.microbatch_plan``), run by
``runtime.per_microbatch``. On gloo CPU ranks: losses and gradients equal one process's
(``test_pipeline``'s reference), and every stage ran, for each micro-batch, the variant the plan
chose."""
import pytest

from _dist import run_ranks
from test_pipeline import MICRO, _batch, _check, _loss_fn, _model, _steps_against_reference

PM_BATCH = 32
"""Micro-batches of 8: the stage peaks count the parameter gradients each backward returns (issue
M); with micro-batches of 2 they set every level's peak and no level mixes variants."""
OPTIONS = {"solver": "heu", "hardware": "h100-sxm"}
"""Analytic costs of a fixed profile: every process plans alike (the CPU profile is calibrated
by timing, per process)."""


def _memory(schedule):
    """The largest memory per device (a multiple of the largest stage peak without recompute,
    downwards) at which the per-micro-batch plan mixes variants, planned in this process as every
    rank will."""
    from lynx_compile.pipelining import StagePlanError, plan_pipeline, plan_stages
    from lynx_compile.pipelining.microbatch_plan import MicrobatchPlanError, plan_microbatches
    from lynx_compile.pipelining.placement import zero_bubble_orders
    from lynx_compile.pipelining.stage_variants import send_seconds, stage_variants

    model = _model()
    mb = (_batch(model, PM_BATCH)[: PM_BATCH // MICRO],)
    free, costs, _ = plan_pipeline(model, mb, num_stages=4, num_microbatches=MICRO, schedule=schedule,
                                   options=OPTIONS, ranks=2)
    top = max(s.peak_bytes for s in free.stages)
    orders = zero_bubble_orders(schedule, 2, 4, MICRO)
    for level in [k / 20 for k in range(40, 15, -1)]:  # 2.0 ... 0.8 (the stage plan refuses ZBV below ~1.05)
        try:
            plan = plan_stages(costs, 4, MICRO, int(level * top), schedule, ranks=2)
            sv = stage_variants(plan, costs, ranks=2)
            choice = plan_microbatches(orders, sv.variants, send_seconds(plan, costs), sv.memory_limit,
                                       solver="auto").choice
        except (StagePlanError, MicrobatchPlanError):
            continue
        if any(len(set(row)) > 1 for row in choice):
            return int(level * top)
    raise AssertionError("no memory level mixes variants")


def _per_microbatch(rank, world, schedule, memory):
    import copy

    import lynx_compile

    model = _model()
    ref = copy.deepcopy(model)
    idx = _batch(model, PM_BATCH)
    pl = lynx_compile.pipeline(model, (idx,), num_stages=4, num_microbatches=MICRO, loss_fn=_loss_fn,
                               schedule=schedule, options=OPTIONS, memory_per_device=memory,
                               per_microbatch=True)
    steps = 2
    compared = _steps_against_reference(pl, ref, idx, steps=steps)
    choice = pl.microbatch_plan.choice
    ran = {i: {k: n for k, n in pl.backends[i].runs.items() if k[0] is not None} for i in pl.backends}
    return {**compared, "stages": sorted(pl.modules), "layers": pl.plan.layers_per_stage, "ran": ran,
            "choice": [list(row) for row in choice], "steps": steps,
            "deferred": sum(s.deferred_weights for s in pl.stages),
            "table": pl.microbatch_plan.table(pl.stage_variants.variants)}


@pytest.mark.timeout(300)
def test_per_microbatch_zbv_matches_single_process_and_runs_the_chosen_variants():
    memory = _memory("ZBVZeroBubble")
    results = run_ranks(_per_microbatch, 2, "ZBVZeroBubble", memory, timeout_s=280)
    _check(results, 4)
    choice = results[0]["choice"]
    assert results[1]["choice"] == choice  # every rank runs rank 0's plan
    assert any(len(set(row)) > 1 for row in choice), choice  # the level is one where the plan mixes
    for r in results:
        for i, calls in r["ran"].items():
            # each micro-batch j ran its chosen variant, once per step (untagged calls left out)
            assert calls == {(j, v): r["steps"] for j, v in enumerate(choice[int(i)])}, (i, calls)
        assert r["deferred"] >= 2 * 2 * MICRO  # W deferred for every micro-batch of both stages
