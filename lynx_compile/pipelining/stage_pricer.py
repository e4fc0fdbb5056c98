"""Prices one candidate stage: its allowance per micro-batch, what it keeps, its peak and time.

``StagePricer.price(i, s, e)`` is stage i holding blocks [s, e) under ``memory_per_device``: the
stage planner's memory model. ``plan_stages`` calls it for every candidate stage of its search,
``rank_sharing`` at lower allowances when stages share a rank, ``stage_variants`` for the
per-micro-batch variants. Pure (no torch).

The model (per stage i holding blocks S_i, pre-block work on stage 0, post-block work on the last):

    static_i  = state_bytes_per_param_byte * params(S_i)              weights, grads, optimizer
    allowance a_i = (memory_per_device - static_i) / k_i              one micro-batch's fw+bw peak
    kept      = min  sum_b e_b(kept_b)  s.t.  fixed_i + W + T_i + sum_b kept_b <= a_i
    t_i       = sum_b (F_b + B_b) + [pre/post] + exposed recompute                 per micro-batch

``e_b`` is block b's :class:`RecomputeCurve` (exposed recompute seconds against the bytes the
block keeps; from Lynx-HEU solves of the traced model, see ``profile``),
``W`` the working bytes of one micro-batch (temporaries, gradients in flight), ``T_i`` the
bytes a block's backward brings back on top of what the stage keeps (while a block's backward
runs, what it dropped is recomputed and alive: the largest block's size minus its share of the
kept bytes; ``allocate_with_transient``), ``fixed_i`` the activations of pre/post work, which
are always kept. ``k_i * a_i`` bounds the device peak
because the k_i - 1 waiting micro-batches hold only their saved bytes, which never exceed one
micro-batch's peak; the same allowance is each stage's ``memory_budget`` when lynx compiles it.
Splitting a stage's bytes between its blocks is ``recompute_curve.allocate`` (exact for the
convex curves).

Zero-bubble schedules (lynx's B/W split) also hold, from a micro-batch's B to its W, the values
W reads (``carry``: ``SegmentCost.carry_bytes`` summed; on the first stage, whose B computes no
input gradient, all it keeps plus its output's gradient). Stage i passes through pairs
(f, w) of micro-batches in flight and carries pending, replayed from torch's own action order
(``StageInfo.held``), so the allowance is the largest a_i with ``f x a_i + w x carry_i <=
memory_per_device - static_i`` at every pair, and the peak is the joint maximum of
``f x kept + w x carry``, not the sum of the two counts' maxima.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from .pipeline_costs import PipelineCosts, SegmentCost
from .placement import ZERO_BUBBLE_SCHEDULES, default_ranks, in_flight, zero_bubble_orders
from .rank_memory import Option, StageShare
from .recompute_curve import allocate_with_transient, transient_bytes, weight_share
from .schedule_sim import held_microbatches
from .stage_plan import StageInfo

SHARE_GRID = 32
"""Allowances per stage ``rank_memory.share_rank`` tries, evenly spaced (besides the curves' points)."""


class StagePricer:
    """Prices a candidate stage [s, e) at position i (module docstring); memoized."""

    def __init__(self, costs: PipelineCosts, p: int, m: int, memory: int | None, schedule: str,
                 ranks: int | None = None):
        self.c, self.p, self.m, self.memory, self.schedule = costs, p, m, memory, schedule
        self.ranks = default_ranks(schedule, p, ranks)
        self.n = len(costs.blocks)
        self.price = lru_cache(maxsize=None)(self._price)
        self._held: dict[int, tuple[tuple[int, int], ...]] | None = None

    def segments(self, i: int, s: int, e: int) -> list[SegmentCost]:
        segs = list(self.c.blocks[s:e])
        if i == 0:
            segs.insert(0, self.c.pre)
        if i == self.p - 1:
            segs.append(self.c.post)
        return segs

    def compute_s(self, i: int, s: int, e: int) -> float:
        return sum(g.forward_s + g.backward_s for g in self.segments(i, s, e))

    def held(self, i: int) -> tuple[tuple[int, int], ...]:
        """Stage i's (in flight, carries) pairs (``StageInfo.held``): replayed from torch's order
        under the zero-bubble schedules when the stages split B from W, else ((in_flight, 0),)."""
        if self.schedule not in ZERO_BUBBLE_SCHEDULES or not self.c.weight_split:
            return ((in_flight(self.schedule, self.p, self.m, i, self.ranks), 0),)
        if self._held is None:
            self._held = held_microbatches(zero_bubble_orders(self.schedule, self.ranks, self.p, self.m))
        return self._held[i]

    def carry(self, i: int, segs: Sequence[SegmentCost], e: int, kept: int) -> int:
        """Bytes one micro-batch of stage i = [s, e) keeps from its B to its W, given the ``kept``
        bytes (fixed included) the stage saves per micro-batch. The first stage's input has no
        gradient, so its B computes nothing and its W reads everything the backward reads: what
        the stage keeps and the gradient of its output. Other stages carry their segments'
        ``carry_bytes``."""
        if self.schedule not in ZERO_BUBBLE_SCHEDULES or not self.c.weight_split:
            return 0
        if i == 0:
            return kept + (self.c.blocks[e - 1].output_bytes if self.p > 1 else 0)
        return sum(g.carry_bytes for g in segs)

    def fresh(self, i: int, segs: Sequence[SegmentCost], e: int) -> int:
        """Of ``carry``, the bytes B creates while the micro-batch's kept bytes are still alive
        (the rest of the carry is kept bytes W reads): the first stage's output gradient (its B
        computes nothing); elsewhere the segments' carry less its saved part (the output
        gradients B computes for W, e.g. each linear's dy)."""
        if self.schedule not in ZERO_BUBBLE_SCHEDULES or not self.c.weight_split:
            return 0
        if i == 0:
            return self.c.blocks[e - 1].output_bytes if self.p > 1 else 0
        return sum(g.carry_bytes - g.carry_saved_bytes for g in segs)

    def allowance(self, i: int, segs: Sequence[SegmentCost], e: int, static: int) -> int:
        """Stage i's ``budget_bytes``: the largest per-micro-batch peak b with, at every pair
        (f, w) of ``held``, f x b + w x carry <= memory - static. The first stage's carry is at
        most b + its output gradient (it keeps no more than its peak), so there (f + w) x b +
        w x output gradient <= memory - static. Negative: no allowance fits."""
        room = self.memory - static
        pairs = self.held(i)
        if i == 0 and any(w for _, w in pairs):
            grad = self.carry(i, segs, e, 0)
            return min((room - w * grad) // (f + w) for f, w in pairs if f + w)
        carry = self.carry(i, segs, e, 0)
        if any(f == 0 and w * carry > room for f, w in pairs):
            return -1
        return min((room - w * carry) // f for f, w in pairs if f)

    def _price(self, i: int, s: int, e: int, budget: int | None = None) -> StageInfo:
        """Stage i = [s, e) at its allowance under ``memory`` (or at ``budget``, when given)."""
        segs = self.segments(i, s, e)
        k = in_flight(self.schedule, self.p, self.m, i, self.ranks)
        static = int(self.c.state_bytes_per_param_byte * sum(g.param_bytes for g in segs))
        fixed = sum(g.activation_bytes for g in segs if g.curve is None)
        curves = [g.curve for g in segs if g.curve is not None]
        full_keep = sum(cv.max_bytes for cv in curves)
        if self.memory is None:
            budget, kept, exposed, fits = None, full_keep, 0.0, True
            transient = transient_bytes(curves, kept)
        else:
            budget = self.allowance(i, segs, e, static) if budget is None else budget
            kept, exposed, fits, transient = allocate_with_transient(curves, budget - fixed - self.c.working_bytes)
        carry = self.carry(i, segs, e, kept + fixed)
        split = self.schedule in ZERO_BUBBLE_SCHEDULES and self.c.weight_split
        exposed_w = exposed * weight_share(curves, kept) if split else 0.0
        held = self.held(i)
        # the peak: the pair of held counts at which kept and carried bytes add up the most
        top, _, w_top = max((f * (kept + fixed) + w * carry, f, w) for f, w in held)  # ties: fewer carries
        peak = static + top + self.c.working_bytes + transient
        return StageInfo(index=i, blocks=(s, e), block_names=tuple(b.name for b in self.c.blocks[s:e]),
                         in_flight=k, static_bytes=static, budget_bytes=budget, kept_bytes=kept + fixed,
                         peak_bytes=peak, compute_s=self.compute_s(i, s, e), recompute_s=exposed, recompute_w_s=exposed_w, fits=fits,
                         carry_bytes=carry, held=held, pending_w=w_top)

    def min_memory(self, i: int, s: int, e: int) -> int:
        """Least memory per device under which stage i = [s, e) fits (full recompute): at every
        pair (f, w) of ``held``, f micro-batches at their least peak and w carries (the first
        stage's carry counted at that peak plus its output gradient, as in ``allowance``)."""
        segs = self.segments(i, s, e)
        static = int(self.c.state_bytes_per_param_byte * sum(g.param_bytes for g in segs))
        least = sum(g.curve.min_bytes if g.curve else g.activation_bytes for g in segs)
        curves = [g.curve for g in segs if g.curve]
        transient = transient_bytes(curves, sum(c.min_bytes for c in curves))
        need = least + self.c.working_bytes + transient
        if i == 0:
            grad = self.carry(i, segs, e, 0)
            return static + max((f + w) * need + w * grad for f, w in self.held(i))
        carry = self.carry(i, segs, e, 0)
        return static + max(f * need + w * carry for f, w in self.held(i))

    def share(self, info: StageInfo) -> StageShare:
        """Stage ``info`` as ``rank_memory.share_rank`` sees it: priced at allowances from the
        least it runs with (full recompute) to the most it had alone (no more than keeping
        everything needs), ``SHARE_GRID`` apart and at the recompute curves' points."""
        i, (s, e) = info.index, info.blocks
        segs = self.segments(i, s, e)
        fixed = sum(g.activation_bytes for g in segs if g.curve is None)
        curves = [g.curve for g in segs if g.curve is not None]

        def need(kept: int) -> int:
            return kept + fixed + self.c.working_bytes + transient_bytes(curves, kept)

        least = need(sum(c.min_bytes for c in curves))
        alone = self.price(i, s, e).budget_bytes
        full = need(sum(c.max_bytes for c in curves))
        most = max(least, min(full, alone if alone is not None else full))
        budgets = {least + (most - least) * k // SHARE_GRID for k in range(SHARE_GRID + 1)}
        if curves and len({len(c.kept_bytes) for c in curves}) == 1:
            budgets |= {need(sum(c.kept_bytes[k] for c in curves)) for k in range(len(curves[0].kept_bytes))}
        options = []
        for b in sorted(x for x in budgets if least <= x <= most):
            st = self.price(i, s, e, b)
            options.append(Option(budget=b, kept=st.kept_bytes, transient=self.transient(st), seconds=st.time_s))
        grad = self.carry(i, segs, e, 0)
        return StageShare(index=i, static=info.static_bytes, first=i == 0, carry=grad if i else 0,
                          gradient=grad if i == 0 else 0, options=tuple(options))

    def transient(self, st: StageInfo) -> int:
        """The backward transient ``st``'s peak counts (its peak less static, working and held)."""
        return st.peak_bytes - st.static_bytes - self.c.working_bytes - \
            max(f * st.kept_bytes + w * st.carry_bytes for f, w in st.held)
