"""``plan_stages``: cut a block stack into pipeline stages, balancing compute *and* recompute.

A pure planner (no torch, no graphs): :class:`PipelineCosts` in, a frozen :class:`StagePlan` out.

Why recompute-aware: under 1F1B, stage i keeps ``k_i = min(p - i, m)`` micro-batches' activations
in flight (GPipe: all m), so with the same memory per device early stages must drop more
activations and recompute them. Balancing on compute alone leaves those stages slowest. The
zero-bubble schedules' counts are derived from torch's schedule definitions in
``placement.in_flight`` (ZBV: as 1F1B over all 2P stages; InterleavedZeroBubble: torch's order
replayed). Where a rank holds several stages (ZBVZeroBubble, InterleavedZeroBubble,
Interleaved1F1B) the programme prices each stage as if it had the device to itself; the stages of
a rank are then fitted to it together over torch's order (``rank_sharing.share_ranks``: their
allowances lowered where their sum would exceed it), and when the programme's split cannot fit
that way the splits are searched (``joint_search``). ``StagePlan.rank_peak_bytes`` is each rank's
predicted device peak.

Each candidate stage i holding blocks [s, e) is priced by ``stage_pricer.StagePricer`` (the
memory model is there): its allowance per micro-batch a_i = (memory_per_device - static_i) / k_i
(with the zero-bubble schedules' B-to-W carries, the largest a_i that fits every held pair), the
least exposed recompute that fits it (``recompute_curve``), and its time per micro-batch
t_i = F + B + exposed recompute.

``method``:
- ``"lynx"``: dynamic programme over cut positions minimizing the bottleneck stage time
  max_i t_i (ties: the smaller sum), each candidate stage priced with its own in-flight count;
- ``"compute"``: the same programme on compute alone (F + B), then priced like the others;
- ``"uniform"``: equal numbers of blocks per stage (the remainder to the last stages, which
  hold the fewest micro-batches).
The predicted step time comes from ``schedule_sim`` (the schedule's timeline),
with and without recompute run while the stage waits for its gradient.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

from lynx_compile.budget import format_bytes

from .pipeline_costs import PipelineCosts
from .placement import check_placement, default_ranks
from .rank_memory import rank_bytes
from .rank_sharing import rank_bounds, rank_walk, share_ranks, stages_on_rank
from .stage_plan import METHODS, SCHEDULES, StagePlan, StagePlanError
from .stage_pricer import StagePricer
from .step_time import simulate_stages


def check_inputs(costs: PipelineCosts, num_stages: int, num_microbatches: int, schedule: str,
                 ranks: int | None = None) -> None:
    n = len(costs.blocks)
    if schedule not in SCHEDULES:
        raise StagePlanError(f"schedule={schedule!r} is not valid; choose one of {sorted(SCHEDULES)}")
    if ranks is not None or schedule == "ZBVZeroBubble":
        why = check_placement(schedule, num_stages, default_ranks(schedule, num_stages, ranks))
        if why:
            raise StagePlanError(why)
    if num_stages < 1:
        raise StagePlanError(f"num_stages={num_stages} must be >= 1")
    if num_stages > n:
        raise StagePlanError(f"num_stages={num_stages} is more than the model's {n} transformer blocks: "
                             f"every stage needs at least one block; use num_stages <= {n}")
    if num_microbatches < num_stages and schedule != "GPipe":
        raise StagePlanError(f"num_microbatches={num_microbatches} is fewer than num_stages={num_stages}: "
                             f"{schedule} needs at least one micro-batch per stage to fill the pipeline; "
                             f"use num_microbatches >= {num_stages}")
    if num_microbatches < 1:
        raise StagePlanError(f"num_microbatches={num_microbatches} must be >= 1")
    rounds = max(1, num_microbatches // default_ranks(schedule, num_stages, ranks))
    if ranks is not None and schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and num_microbatches % rounds:
        raise StagePlanError(f"{schedule} runs micro-batches in rounds of the pipeline group size: "
                             f"num_microbatches={num_microbatches} must be a multiple of {rounds}")


def _dp(pr: StagePricer, stage_time) -> list[int]:
    """Cut starts [s_1 .. s_{p-1}] minimizing (max stage time, sum of stage times)."""
    n, p = pr.n, pr.p
    INF = (math.inf, math.inf)
    best: dict[tuple[int, int], tuple[float, float]] = {}
    choice: dict[tuple[int, int], int] = {}
    for i in range(p - 1, -1, -1):
        for s in range(i, n - (p - 1 - i)):
            if i == p - 1:
                t = stage_time(i, s, n)
                best[i, s] = (t, t)
                continue
            val, arg = INF, -1
            for e in range(s + 1, n - (p - 1 - i) + 1):
                t = stage_time(i, s, e)
                rest = best[i + 1, e]
                cand = (max(t, rest[0]), t + rest[1])
                if cand < val:
                    val, arg = cand, e
            best[i, s], choice[i, s] = val, arg
    if best[0, 0][0] == math.inf:
        return []
    cuts, s = [], 0
    for i in range(p - 1):
        s = choice[i, s]
        cuts.append(s)
    return cuts


def uniform_cuts(n: int, p: int) -> list[int]:
    """Equal blocks per stage; the remainder goes to the last stages (fewest in flight)."""
    sizes = [n // p + (1 if i >= p - n % p else 0) for i in range(p)] if n % p else [n // p] * p
    out, acc = [], 0
    for size in sizes[:-1]:
        acc += size
        out.append(acc)
    return out


def plan_stages(costs: PipelineCosts, num_stages: int, num_microbatches: int,
                memory_per_device: int | None = None, schedule: str = "1F1B", *,
                method: str = "lynx", pinned_cuts: Sequence[int] | None = None,
                ranks: int | None = None) -> StagePlan:
    """Cut ``costs.blocks`` into ``num_stages`` stages (see the module docstring).

    ``pinned_cuts``: block indices where stages must begin (user pins; ``costs.pinned_cuts``,
    from ``pipe_split()`` markers, are added); with p - 1 of them the split is fixed and only
    priced. ``ranks``: the pipeline group size, for the schedules that put several stages on a
    rank (None: one stage per rank; ``ZBVZeroBubble``: two). Raises :class:`StagePlanError` on bad input and, for
    ``method="lynx"``, when no split fits ``memory_per_device`` (naming the least that fits)."""
    check_inputs(costs, num_stages, num_microbatches, schedule, ranks)
    if method not in METHODS:
        raise StagePlanError(f"method={method!r} is not valid; choose one of {sorted(METHODS)}")
    n, p, m = len(costs.blocks), num_stages, num_microbatches
    pr = StagePricer(costs, p, m, memory_per_device, schedule, ranks)
    pins = sorted(set(pinned_cuts or ()) | set(costs.pinned_cuts))
    if pins and (pins[0] < 1 or pins[-1] >= n or len(pins) > p - 1):
        raise StagePlanError(f"pinned cuts {pins} must be block indices in 1..{n - 1}, at most {p - 1} of them")

    def allowed(i: int, s: int, e: int) -> bool:  # a stage may not straddle a pinned cut
        return not any(s < c < e for c in pins)

    def timed(fn):
        return lambda i, s, e: fn(i, s, e) if allowed(i, s, e) else math.inf

    if len(pins) == p - 1:
        cuts = pins
    elif method == "uniform":
        cuts = uniform_cuts(n, p)
    elif method == "compute":
        cuts = _dp(pr, timed(pr.compute_s))
    else:
        def lynx_time(i, s, e):
            info = pr.price(i, s, e)
            return info.time_s if info.fits else math.inf
        cuts = _dp(pr, timed(lynx_time))
        if not cuts and p > 1 or (p == 1 and not pr.price(0, 0, n).fits):
            least = _dp(pr, timed(lambda i, s, e: float(pr.min_memory(i, s, e))))
            need = max(pr.min_memory(i, s, e) for i, (s, e) in enumerate(_ranges(least, n)))
            if pr.ranks < p:
                need = max(need, joint_search(pr, allowed, [least])[1] or 0)
            raise _too_small(pr, need)
    stages = tuple(pr.price(i, s, e) for i, (s, e) in enumerate(_ranges(cuts, n)))
    stages, rank_peaks, over = share_ranks(pr, stages)
    if over and method == "lynx" and len(pins) < p - 1:  # a split the user fixed is reported, not refused
        # the programme priced each stage as if alone on its device: search the splits whose
        # stages fit their ranks together
        found, need = joint_search(pr, allowed, [cuts, _dp(pr, timed(lambda i, s, e: float(pr.min_memory(i, s, e))))])
        if found is None:
            raise _too_small(pr, need)
        cuts, (stages, rank_peaks, over) = found
    step = simulate_stages(stages, costs, schedule, m, recompute_in_wait=False, ranks=pr.ranks)
    step_wait = simulate_stages(stages, costs, schedule, m, recompute_in_wait=True, ranks=pr.ranks)
    notes = []
    if not all(s.fits for s in stages):
        bad = [s.index for s in stages if not s.fits]
        notes.append(f"stages {bad} do not fit memory_per_device={memory_per_device} B even with full recompute")
    if over:
        notes.append(f"ranks {over} do not fit memory_per_device={memory_per_device} B with their stages together")
    if pins:
        notes.append(f"pinned cuts at blocks {pins}")
    return StagePlan(method=method, schedule=schedule, num_stages=p, num_microbatches=m,
                     memory_per_device=memory_per_device, stages=stages, predicted_step_s=step,
                     predicted_step_in_wait_s=step_wait, notes=tuple(notes), pinned_cuts=tuple(pins),
                     marker_cuts=tuple(sorted(costs.pinned_cuts)), rank_peak_bytes=rank_peaks,
                     rank_bound_bytes=rank_bounds(pr, stages))


def _too_small(pr: StagePricer, need: int) -> StagePlanError:
    shared = f", the stages of a rank together on {pr.ranks} ranks" if pr.ranks < pr.p else ""
    return StagePlanError(
        f"memory_per_device={pr.memory} B ({format_bytes(pr.memory)}) is too small for any split of {pr.n} blocks "
        f"into {pr.p} stages with {pr.m} micro-batches ({pr.schedule}{shared}): even with full recompute the "
        f"smallest split needs {need} B ({format_bytes(need)}) on its fullest device. Give each device at least "
        f"that, use more stages, or a smaller micro-batch.")


SEARCH_LIMIT = 20000
"""Splits ``joint_search`` enumerates at most; above, the neighbours of its starting splits."""


def joint_search(pr: StagePricer, allowed, starts: Sequence[Sequence[int]]):
    """The split (with stages sharing ranks, ``share_ranks``) least in (slowest stage, summed
    stage time) among those whose ranks fit memory at full recompute: every split when there are at
    most ``SEARCH_LIMIT``, else those with each cut of a split in ``starts`` moved by at most 2
    (1 when that is too many). Splits are tried in the order of their stages priced alone, which
    sharing can only slow down, until none left can beat the best. Returns ((cuts, shared), least
    memory per device any split needed)."""
    n, p = pr.n, pr.p
    if math.comb(n - 1, p - 1) <= SEARCH_LIMIT:
        splits = itertools.combinations(range(1, n), p - 1)
    else:
        reach = 2 if 5 ** (p - 1) * len(starts) <= SEARCH_LIMIT else 1
        splits = {tuple(c + d for c, d in zip(start, moves))
                  for start in starts if start for moves in itertools.product(range(-reach, reach + 1), repeat=p - 1)}
        splits = sorted(c for c in splits if all(a < b for a, b in zip((0,) + c, c + (n,))))
    points = rank_walk(pr)
    rows, least_need = [], None
    for cuts in splits:
        ranges = _ranges(cuts, n)
        if not all(allowed(i, s, e) for i, (s, e) in enumerate(ranges)):
            continue
        infos = tuple(pr.price(i, s, e) for i, (s, e) in enumerate(ranges))
        need = 0
        for r in range(pr.ranks):
            shares = [pr.share(st) for st in stages_on_rank(pr, infos, r)]
            need = max(need, sum(sh.static for sh in shares)
                       + rank_bytes(points[r], shares, {sh.index: sh.options[0] for sh in shares}))
        least_need = need if least_need is None else min(least_need, need)
        if need <= pr.memory:
            rows.append(((max(st.time_s for st in infos), sum(st.time_s for st in infos)), tuple(cuts), infos))
    rows.sort(key=lambda row: row[0])
    best, best_key = None, None
    for key, cuts, infos in rows:
        if best_key is not None and key >= best_key:
            break
        shared = share_ranks(pr, infos)
        if shared[2]:
            continue
        got = (max(st.time_s for st in shared[0]), sum(st.time_s for st in shared[0]))
        if best_key is None or got < best_key:
            best, best_key = (list(cuts), shared), got
    return best, least_need


def _ranges(cuts: Sequence[int], n: int) -> list[tuple[int, int]]:
    bounds = [0, *cuts, n]
    return list(zip(bounds, bounds[1:]))
