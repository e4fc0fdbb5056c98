"""Stages that share a rank share its memory: their joint walk, and allowances that fit it.

Under ``ZBVZeroBubble``, ``InterleavedZeroBubble`` and ``Interleaved1F1B`` a rank holds several
stages. ``plan_stages`` chooses the cuts with each stage priced as if it had the device alone
(that keeps its dynamic programme over cut positions separable); the stages of one rank then
together may need more than ``memory_per_device``. This module walks each rank's stages together
over torch's own action order and, where they exceed the device, lowers their allowances until
they fit, keeping the bytes where they save the most recompute.

After each action of the rank (``rank_points``: F adds a micro-batch in flight, B turns it into a
W-carry, W frees the carry; without W's B frees it), stage s holds ``f_s`` micro-batches and
``w_s`` carries. The fit test is the stage planner's own (``stage_pricer.StagePricer.allowance``),
summed over the rank point by point: each micro-batch in flight counts at the stage's whole
allowance ``b_s`` (its lynx ``memory_budget``, which bounds one micro-batch's forward + backward
peak, not what it saves: a stage compiled at ``b`` may keep close to ``b``; measured on gpt-small,
a ZBV stage at a 5.49 MiB allowance kept 4.9 MiB per micro-batch where the planner's curves
expected 2.6), a carry at its bytes, and the first stage's carry at ``b`` plus its output
gradient ``g`` (its B computes nothing, its W reads all it keeps). At every point::

    sum_s coef_s x b_s + const_s <= memory - sum_s static_s
    coef = f, const = w x carry            (the first stage: coef = f + w, const = w x g)

``share_rank`` picks one allowance per stage among a few (``StageShare.options``: from the least
the stage runs with, full recompute, to the most it had alone), minimizing the summed stage time
(one rank runs all its stages' work). ``StagePlan.rank_peak_bytes`` counts what the planner
expects each micro-batch to keep instead (lower). Plain numbers in and out; ``rank_sharing``
applies it to a stage plan's priced stages. Pure (no torch).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping, Sequence

Counts = Mapping[int, tuple[int, int]]
"""Per stage of a rank: (micro-batches between F and B, carries between B and W)."""

ROUNDS = 4


def rank_points(orders: Sequence[Sequence[tuple[str, int, int]]]) -> list[list[dict[int, tuple[int, int]]]]:
    """Per rank, the count vectors its stages pass through after each of its actions (module
    docstring); those another point matches or exceeds in every count are dropped."""
    out = []
    for order in orders:
        has_w = any(kind == "W" for kind, _, _ in order)
        now: dict[int, tuple[int, int]] = {s: (0, 0) for _, s, _ in order}
        seen: dict[tuple, dict[int, tuple[int, int]]] = {}
        for kind, s, _ in order:
            f, w = now[s]
            now[s] = {"F": (f + 1, w), "B": (f - 1, w + 1) if has_w else (f - 1, w), "W": (f, w - 1)}[kind]
            seen.setdefault(tuple(sorted(now.items())), dict(now))
        pts = list(seen.values())
        out.append([p for p in pts if not any(q is not p and q != p and all(q[s][0] >= p[s][0] and q[s][1] >= p[s][1]
                                                                                 for s in p) for q in pts)])
    return out


@dataclass(frozen=True)
class Option:
    """One allowance of a stage, priced."""

    budget: int
    kept: int
    """Bytes one micro-batch keeps (fixed activations included)."""
    transient: int
    seconds: float
    """Stage time per micro-batch."""


@dataclass(frozen=True)
class StageShare:
    """One stage of a rank, as ``share_rank`` sees it."""

    index: int
    static: int
    first: bool
    """The pipeline's first stage: its carry is its kept bytes plus ``gradient``."""
    carry: int
    """Bytes of one W-carry (not the first stage)."""
    gradient: int
    options: tuple[Option, ...]
    """Sorted by budget, the first the least the stage runs with, the last the most it had alone."""

    def held(self, f: int, w: int, o: Option) -> int:
        """The most the stage may hold with f micro-batches in flight and w carries at option ``o``."""
        if self.first:
            return (f + w) * o.budget + w * self.gradient
        return f * o.budget + w * self.carry


def rank_bytes(points: Sequence[Counts], stages: Sequence[StageShare], chosen: Mapping[int, Option]) -> int:
    """The most the rank's stages may hold at any point at the ``chosen`` options (statics excluded)."""
    return max((sum(st.held(*pt[st.index], chosen[st.index]) for st in stages) for pt in points), default=0)


def share_rank(points: Sequence[Counts], stages: Sequence[StageShare], memory: int) -> dict[int, Option] | None:
    """An option per stage of one rank that fits ``memory`` at every point (module docstring),
    the summed stage time least among those tried: the most options when they fit; else from the
    least ones, for each pair of stages, every option of one with the largest of the other that
    fits, a few rounds while the sum falls. None when even the least options do not fit."""
    room = memory - sum(st.static for st in stages)

    def fits(chosen: Mapping[int, Option]) -> bool:
        return rank_bytes(points, stages, chosen) <= room

    most = {st.index: st.options[-1] for st in stages}
    if fits(most):
        return most
    chosen = {st.index: st.options[0] for st in stages}
    if not fits(chosen):
        return None
    total = sum(o.seconds for o in chosen.values())
    for _ in range(ROUNDS):
        improved = False
        for a in stages:
            for c in stages:
                if a is c:
                    continue
                for oa in a.options:
                    trial = dict(chosen)
                    trial[a.index] = oa
                    oc = _largest(c, trial, fits)
                    if oc is None:
                        continue
                    trial[c.index] = oc
                    t = sum(o.seconds for o in trial.values())
                    if t < total - 1e-12:
                        chosen, total, improved = trial, t, True
        if not improved:
            break
    return chosen


def _largest(c: StageShare, chosen: Mapping[int, Option], fits) -> Option | None:
    """The largest option of ``c`` that fits with the others at ``chosen`` (bytes grow with the
    option: a binary search); None when not even its least does."""
    def ok(k: int) -> bool:
        return fits({**chosen, c.index: c.options[k]})
    if not ok(0):
        return None
    lo = bisect.bisect_left(range(len(c.options)), True, key=lambda k: not ok(k)) - 1
    return c.options[max(0, lo)]
