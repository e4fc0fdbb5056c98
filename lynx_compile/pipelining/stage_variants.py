"""A stage plan's per-micro-batch variants: for each stage, a few recompute plans of its own
blocks, priced from ``PipelineCosts``, for ``microbatch_plan.plan_microbatches`` to choose among
per (stage, micro-batch). Pure (no torch).

``plan_stages`` gives every micro-batch of stage i the same allowance ``a_i`` (its lynx
``memory_budget``), sized for the moment the stage holds the most micro-batches. Micro-batches
that are not alive at that moment could keep more, and those alive at it must keep less; which
is which depends on the schedule's order on the rank, which holds *all* its stages (ZBV: two).
The variants of stage i, each one lynx compile of the stage:

    name      memory_budget per micro-batch           priced with
    keep      None (policy "none": recompute nothing)  every block at its curve's largest point
    plan      a_i (the stage plan's allowance)         allocate_with_transient(a_i), as plan_stages
    least     the curves' least peak x (1 + LEAST_SLACK)  every block at its curve's least point
    curve<k>  the stage's bytes at the profile's k-th    allocate_with_transient, as above
              budget-ladder point (strictly between)

A variant's times: F as the stage plan; B = the backward less its weight share, plus the
variant's exposed recompute that B needs; W = the weight share plus the exposed recompute only
W needs (``recompute_curve.weight_share`` of the curves' ``exposed_w_s``, as
``step_time.simulate_stages``). ``held_bytes`` = what it keeps (blocks + pre/post), ``carry_bytes`` =
``StagePricer.carry`` at that. A variant another one matches or beats in held bytes, carry, B and W
at once is dropped (each variant a stage uses is one more compile of it).

The rank's limit for the micro-batch walk: memory per device less the static bytes of every
stage on the rank, less one micro-batch's working bytes and the largest transient of a block's
backward among its stages' variants (one backward runs at a time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .microbatch_replay import StageVariant
from .pipeline_costs import PipelineCosts
from .placement import default_ranks, stage_rank
from .recompute_curve import allocate_with_transient, transient_bytes, weight_share
from .stage_plan import StagePlan
from .stage_pricer import StagePricer
from .step_time import stage_times

LEAST_SLACK = 0.02
"""The ``least`` variant's budget sits this far above the curves' least peak: the curves come
from solves of the whole model's problem, a stage's own compile may land a little above them."""


@dataclass(frozen=True, kw_only=True)
class StageVariants:
    """Per stage, its variants and the ``memory_budget`` each compiles with (None: policy none)."""

    variants: tuple[tuple[StageVariant, ...], ...]
    budgets: tuple[tuple[int | None, ...], ...]
    memory_limit: tuple[int, ...]
    """Per rank: bytes for the activations its stages hold (``microbatch_replay``'s walk)."""
    reserved_bytes: tuple[int, ...]
    """Per rank: what the limit sets aside beside the walk (one micro-batch's working bytes and the
    largest block-backward transient); walk + reserved is the predicted activation peak."""
    ranks: int


def stage_variants(plan: StagePlan, costs: PipelineCosts, *, ranks: int | None = None) -> StageVariants:
    """The variants of every stage of ``plan`` (module docstring). ``plan.memory_per_device`` must be set."""
    if plan.memory_per_device is None:
        raise ValueError("per-micro-batch variants need a memory_per_device: without one nothing is recomputed")
    p, m = plan.num_stages, plan.num_microbatches
    ranks = default_ranks(plan.schedule, p, ranks)
    pr = StagePricer(costs, p, m, plan.memory_per_device, plan.schedule, ranks)
    fwd, bwd, wgt, _ = stage_times(plan.stages, costs)
    variants, budgets, transient = [], [], [0] * ranks
    for st in plan.stages:
        i, (s, e) = st.index, st.blocks
        segs = pr.segments(i, s, e)
        fixed = sum(g.activation_bytes for g in segs if g.curve is None)
        curves = [g.curve for g in segs if g.curve is not None]
        most = sum(c.max_bytes for c in curves)
        least = sum(c.min_bytes for c in curves)
        room = costs.working_bytes + fixed
        least_budget = int((least + room + transient_bytes(curves, least)) * (1 + LEAST_SLACK))
        rows = [("keep", None, most, 0.0, transient_bytes(curves, most))]
        if st.budget_bytes is not None:
            kept, exposed, fits, tr = allocate_with_transient(curves, st.budget_bytes - room)
            if fits:
                rows.append(("plan", int(st.budget_bytes), kept, exposed, tr))
        kept, exposed, fits, tr = allocate_with_transient(curves, least_budget - room)
        if fits:
            rows.append(("least", least_budget, kept, exposed, tr))
        for k in range(len(curves[0].kept_bytes) if curves else 0):  # the profile's ladder points
            point = sum(c.kept_bytes[k] for c in curves)
            if least < point < most:
                budget = int(point + room + transient_bytes(curves, point))
                kept, exposed, fits, tr = allocate_with_transient(curves, budget - room)
                if fits:
                    rows.append((f"curve{k}", budget, kept, exposed, tr))
        priced = []
        for name, budget, kept, exposed, tr in rows:
            held = kept + fixed
            in_w = exposed * weight_share(curves, kept) if costs.weight_split else 0.0
            priced.append((StageVariant(name=name, forward_s=fwd[i], input_backward_s=bwd[i] - wgt[i] + exposed - in_w,
                                        weight_backward_s=wgt[i] + in_w, held_bytes=held,
                                        carry_bytes=pr.carry(i, segs, e, held),
                                        fresh_bytes=pr.fresh(i, segs, e)), budget, tr))
        mine, mine_budgets = [], []
        for v, budget, tr in _undominated(priced):
            mine.append(v)
            mine_budgets.append(budget)
            r = stage_rank(plan.schedule, i, p, ranks)
            transient[r] = max(transient[r], tr)
        variants.append(tuple(mine))
        budgets.append(tuple(mine_budgets))
    static = [0] * ranks
    for st in plan.stages:
        static[stage_rank(plan.schedule, st.index, p, ranks)] += st.static_bytes
    reserved = tuple(costs.working_bytes + transient[r] for r in range(ranks))
    limit = tuple(plan.memory_per_device - static[r] - reserved[r] for r in range(ranks))
    return StageVariants(variants=tuple(variants), budgets=tuple(budgets), memory_limit=limit,
                         reserved_bytes=reserved, ranks=ranks)


def _undominated(priced):
    """The (variant, budget, transient) rows no other row matches or beats in held bytes, carry
    bytes, B seconds and W seconds at once (the first of equal rows stays), by B seconds."""
    def key(v):
        return (v.held_bytes, v.carry_bytes, v.input_backward_s, v.weight_backward_s)

    out = []
    for a, row in enumerate(priced):
        ka = key(row[0])
        if not any(all(x <= y for x, y in zip(key(other[0]), ka)) and (key(other[0]) != ka or b < a)
                   for b, other in enumerate(priced) if b != a):
            out.append(row)
    return sorted(out, key=lambda r: (r[0].input_backward_s, r[0].weight_backward_s))


def send_seconds(plan: StagePlan, costs: PipelineCosts) -> list[float]:
    """Per stage, the transfer to the next stage (``step_time.stage_times``)."""
    return stage_times(plan.stages, costs)[3]


def stage_assignments(choice: Sequence[Sequence[int]]) -> dict[int, dict[int, int]]:
    """``choice[stage][micro-batch]`` as stage -> {micro-batch: variant index}."""
    return {s: dict(enumerate(row)) for s, row in enumerate(choice)}
