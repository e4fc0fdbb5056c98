"""The stages of a rank fitted to its memory together, and each rank's predicted peak.

``plan_stages`` prices each stage as if it had the device alone (``stage_pricer``); where a rank
holds several stages (ZBVZeroBubble, InterleavedZeroBubble, Interleaved1F1B) ``share_ranks``
walks them together over torch's order and lowers their allowances where their sum would exceed
the device (``rank_memory.share_rank`` on plain numbers), re-pricing the stages at the allowances
chosen. ``rank_bounds`` is each rank's fit test at the plan's allowances
(``StagePlan.rank_bound_bytes``). Pure (no torch).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from .placement import ZERO_BUBBLE_SCHEDULES, rank_orders, stage_rank
from .rank_memory import Option, StageShare, rank_bytes, rank_points, share_rank
from .stage_plan import StageInfo
from .stage_pricer import StagePricer


def rank_walk(pr: StagePricer) -> list:
    """``rank_memory.rank_points`` of torch's order (W's dropped when the stages do not split B from W)."""
    orders = rank_orders(pr.schedule, pr.ranks, pr.p, pr.m)
    if not (pr.schedule in ZERO_BUBBLE_SCHEDULES and pr.c.weight_split):
        orders = tuple(tuple(a for a in order if a[0] != "W") for order in orders)
    return rank_points(orders)


def stages_on_rank(pr: StagePricer, stages: Sequence[StageInfo], r: int) -> list[StageInfo]:
    """The stages of ``stages`` that rank ``r`` holds."""
    return [st for st in stages if stage_rank(pr.schedule, st.index, pr.p, pr.ranks) == r]


def share_ranks(pr: StagePricer,
                stages: tuple[StageInfo, ...]) -> tuple[tuple[StageInfo, ...], tuple[int, ...], list[int]]:
    """Stages that share a rank fitted to its memory together (``rank_memory``): (the stages,
    re-priced at their shared allowances where those are lower; the predicted device peak of each
    rank; the ranks that do not fit even at full recompute, whose stages are marked as not fitting).
    One stage per rank: the stages as they are, and their peaks."""
    if pr.ranks >= pr.p:
        return stages, tuple(st.peak_bytes for st in stages), []
    points = rank_walk(pr)
    out, peaks, over = list(stages), [], []
    for r in range(pr.ranks):
        mine = stages_on_rank(pr, stages, r)
        if pr.memory is not None and _rank_bound(points[r], mine) > pr.memory:
            chosen = share_rank(points[r], [pr.share(st) for st in mine], pr.memory)
            if chosen is None:
                over.append(r)
                for st in mine:
                    out[st.index] = replace(st, fits=False)
            else:
                for st in mine:
                    if chosen[st.index].budget != st.budget_bytes:
                        out[st.index] = pr.price(st.index, *st.blocks, chosen[st.index].budget)
        peaks.append(_rank_peak(pr, points[r], [out[st.index] for st in mine]))
    return tuple(out), tuple(peaks), over


def rank_bounds(pr: StagePricer, stages: Sequence[StageInfo]) -> tuple[int, ...]:
    """``StagePlan.rank_bound_bytes``: ``_rank_bound`` of every rank (one stage per rank: over the
    stage's own ``held`` pairs)."""
    if pr.memory is None:
        return ()
    if pr.ranks >= pr.p:
        return tuple(_rank_bound([{st.index: pair} for pair in st.held], [st]) for st in stages)
    points = rank_walk(pr)
    return tuple(_rank_bound(points[r], stages_on_rank(pr, stages, r)) for r in range(pr.ranks))


def _rank_bound(points, mine: Sequence[StageInfo]) -> int:
    """The rank's fit test at its stages' allowances (``rank_memory``: each micro-batch in flight
    at its stage's whole allowance), statics included."""
    shares = [StageShare(index=st.index, static=st.static_bytes, first=st.index == 0,
                         carry=st.carry_bytes if st.index else 0,
                         gradient=max(0, st.carry_bytes - st.kept_bytes) if st.index == 0 else 0, options=())
              for st in mine]
    chosen = {st.index: Option(budget=st.budget_bytes, kept=st.kept_bytes, transient=0, seconds=0.0) for st in mine}
    return sum(st.static_bytes for st in mine) + rank_bytes(points, shares, chosen)


def _rank_peak(pr: StagePricer, points, mine: Sequence[StageInfo]) -> int:
    """Predicted device peak of one rank (``rank_memory``): its stages' static bytes, the most
    their kept and carried bytes add up to at a point of the rank's walk, the working bytes and
    the largest transient."""
    held = max((sum(pt[st.index][0] * st.kept_bytes + pt[st.index][1] * st.carry_bytes for st in mine)
                for pt in points), default=0)
    return sum(st.static_bytes for st in mine) + held + pr.c.working_bytes + max(pr.transient(st) for st in mine)
