"""``plan_stages``: cut a block stack into pipeline stages, balancing compute *and* recompute.

A pure planner (no torch, no graphs): :class:`PipelineCosts` in, a frozen :class:`StagePlan` out.

Why recompute-aware: under 1F1B, stage i keeps ``k_i = min(p - i, m)`` micro-batches' activations
in flight (GPipe: all m), so with the same memory per device early stages must drop more
activations and recompute them. Balancing on compute alone leaves those stages slowest. The
zero-bubble schedules' counts are derived from torch's schedule definitions in :func:`in_flight`
(ZBV: as 1F1B over all 2P stages; InterleavedZeroBubble: torch's order replayed). Where a rank
holds several stages (ZBVZeroBubble, InterleavedZeroBubble, Interleaved1F1B) the programme prices
each stage as if it had the device to itself; the stages of a rank are then fitted to it together
over torch's order (``rank_memory``, ``_share_ranks``: their allowances lowered where their sum
would exceed it), and when the programme's split cannot fit that way the splits are searched
(``_joint_search``). ``StagePlan.rank_peak_bytes`` is each rank's predicted device peak.

The model (per stage i holding blocks S_i, pre-block work on stage 0, post-block work on the last):

    static_i  = state_bytes_per_param_byte * params(S_i)              weights, grads, optimizer
    allowance a_i = (memory_per_device - static_i) / k_i              one micro-batch's fw+bw peak
    kept      = min  sum_b e_b(kept_b)  s.t.  fixed_i + W + T_i + sum_b kept_b <= a_i
    t_i       = sum_b (F_b + B_b) + [pre/post] + exposed recompute                 per micro-batch

``e_b`` is block b's :class:`RecomputeCurve` (exposed recompute seconds against the bytes the
block keeps; from Lynx-HEU solves of the traced model, see ``lynx_compile.pipelining.costs``),
``W`` the working bytes of one micro-batch (temporaries, gradients in flight), ``T_i`` the
bytes a block's backward brings back on top of what the stage keeps (while a block's backward
runs, what it dropped is recomputed and alive: the largest block's size minus its share of the
kept bytes; ``allocate_with_transient``), ``fixed_i`` the activations of pre/post work, which
are always kept. ``k_i * a_i`` bounds the device peak
because the k_i - 1 waiting micro-batches hold only their saved bytes, which never exceed one
micro-batch's peak; the same allowance is each stage's ``memory_budget`` when lynx compiles it.
Curves are convex piecewise linear (lower hull of the solved points), so splitting a stage's
bytes between its blocks is a greedy by seconds saved per byte, which is exact for them.

Zero-bubble schedules (lynx's B/W split) also hold, from a micro-batch's B to its W, the values
W reads (``carry``: ``SegmentCost.carry_bytes`` summed; on the first stage, whose B computes no
input gradient, all it keeps plus its output's gradient). Stage i passes through pairs
(f, w) of micro-batches in flight and carries pending, replayed from torch's own action order
(``StageInfo.held``), so the allowance is the largest a_i with ``f x a_i + w x carry_i <=
memory_per_device - static_i`` at every pair, and the peak is the joint maximum of
``f x kept + w x carry``, not the sum of the two counts' maxima.

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
import json
import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal, Sequence

from lynx_compile.report import human_bytes

from .placement import ZERO_BUBBLE_SCHEDULES, default_ranks, in_flight, rank_orders, stage_rank
from .rank_memory import Option, StageShare, rank_bytes, rank_points, share_rank

SHARE_GRID = 32
"""Allowances per stage ``rank_memory.share_rank`` tries, evenly spaced (besides the curves' points)."""

Schedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
SCHEDULES: frozenset[str] = frozenset({"GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"})
Method = Literal["lynx", "compute", "uniform"]
METHODS: frozenset[str] = frozenset({"lynx", "compute", "uniform"})


class StagePlanError(ValueError):
    """The pipeline cannot be planned as asked; the message names the limit and the fix."""


@dataclass(frozen=True, kw_only=True)
class RecomputeCurve:
    """Exposed recompute seconds of one block (one micro-batch) against the bytes it keeps.

    Points sorted by ``kept_bytes``; ``kept_bytes[0]`` is the least the block can keep (full
    recompute), ``kept_bytes[-1]`` keeps everything (``exposed_s[-1] == 0``)."""

    kept_bytes: tuple[int, ...]
    exposed_s: tuple[float, ...]
    exposed_w_s: tuple[float, ...] = ()
    """Per point, the part of ``exposed_s`` that only the weight gradients need (W's recompute
    under a zero-bubble schedule's B/W split; ``pipeline.costs``); empty: not known (all B)."""

    def _interp(self, ys: Sequence[float], kept: float) -> float:
        """Piecewise-linear interpolation of ``ys`` (one per point) at ``kept`` bytes over the
        points sorted by bytes; clamped to the ends."""
        pts = sorted(zip(self.kept_bytes, ys))
        if kept <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if kept <= x1:
                return y0 if x1 == x0 else y0 + (y1 - y0) * (kept - x0) / (x1 - x0)
        return pts[-1][1]

    def weight_share(self, kept: float) -> float:
        """The share of the exposed recompute at ``kept`` bytes that only W needs (0..1),
        interpolated between the solved points; 0 when not known."""
        if not self.exposed_w_s:
            return 0.0
        total = self._interp(self.exposed_s, kept)
        return min(1.0, self._interp(self.exposed_w_s, kept) / total) if total > 0 else 0.0

    def hull(self) -> tuple[tuple[int, float], ...]:
        """Lower convex hull of the points (non-increasing, convex in bytes)."""
        pts = sorted(zip(self.kept_bytes, self.exposed_s))
        best: list[tuple[int, float]] = []
        for x, y in pts:  # keep the cheapest point per byte count, and monotone non-increasing
            if best and y >= best[-1][1] - 1e-15:
                continue
            if best and x == best[-1][0]:
                best[-1] = (x, y)
                continue
            best.append((x, y))
        hull: list[tuple[int, float]] = []
        for p in best:
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
                hull.pop()
            hull.append(p)
        return tuple(hull)

    @property
    def min_bytes(self) -> int:
        return min(self.kept_bytes)

    @property
    def max_bytes(self) -> int:
        return max(self.kept_bytes)


def _cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


@dataclass(frozen=True, kw_only=True)
class SegmentCost:
    """One block (or the pre-/post-block work) for one micro-batch."""

    name: str
    """Module path (``blocks.3``), or ``<pre>`` / ``<post>``."""
    forward_s: float
    backward_s: float
    param_bytes: int = 0
    activation_bytes: int = 0
    """Bytes kept with no recompute (pre/post: always kept)."""
    curve: RecomputeCurve | None = None
    """None: nothing to recompute (keeps ``activation_bytes``)."""
    output_bytes: int = 0
    """Bytes of the tensor it hands to the next segment (what a stage boundary sends)."""
    weight_backward_s: float | None = None
    """The part of ``backward_s`` that computes weight gradients (W under the zero-bubble
    schedules); None: not known, ``pipeline.step_time`` takes ``WEIGHT_SHARE`` of it."""
    carry_bytes: int = 0
    """Bytes one micro-batch holds from its B to its W under the zero-bubble schedules, in a stage
    whose input has a gradient (every stage but the first): what the segment's W reads (saved
    tensors, output gradients B computed) and a plain backward would have freed, parameters not
    counted. Exact for the traced backward, which recomputes nothing (``pipeline.costs``). Not
    used for the first stage, whose B has no input gradient to compute: its W runs the whole
    backward, so it carries all the stage keeps plus its output gradient (``_Pricer.carry``)."""
    carry_saved_bytes: int = 0
    """The part of ``carry_bytes`` that is saved forward tensors (a linear layer's input): the
    micro-batch holds them from its F anyway, so its B adds only the rest (``_Pricer.fresh``)."""


@dataclass(frozen=True, kw_only=True)
class PipelineCosts:
    """Everything ``plan_stages`` needs, as plain data (JSON round-trips)."""

    blocks: tuple[SegmentCost, ...]
    pre: SegmentCost = SegmentCost(name="<pre>", forward_s=0.0, backward_s=0.0)
    post: SegmentCost = SegmentCost(name="<post>", forward_s=0.0, backward_s=0.0)
    working_bytes: int = 0
    """Transient bytes of one micro-batch's fw+bw beyond what its blocks keep."""
    state_bytes_per_param_byte: float = 4.0
    """Static bytes per parameter byte: weights + gradients + two Adam moments = 4."""
    p2p_bytes_per_s: float = float("inf")
    p2p_latency_s: float = 0.0
    microbatch_size: int = 1
    pinned_cuts: tuple[int, ...] = ()
    """Blocks where the user requires a stage to begin (``pipe_split()`` markers in the model)."""
    weight_split: bool = True
    """Whether the stages split each backward into B and W under the zero-bubble schedules
    (lynx's split, ``compiler="eager"``); False (Inductor): B runs the whole backward, W is a
    no-op, nothing is carried."""

    def p2p_s(self, nbytes: int) -> float:
        return self.p2p_latency_s + (nbytes / self.p2p_bytes_per_s if nbytes else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PipelineCosts":
        def seg(s):
            c = s.get("curve")
            curve = RecomputeCurve(kept_bytes=tuple(c["kept_bytes"]), exposed_s=tuple(c["exposed_s"]),
                                   exposed_w_s=tuple(c.get("exposed_w_s", ()))) if c else None
            return SegmentCost(**{**s, "curve": curve})
        d = dict(d)
        d["blocks"] = tuple(seg(b) for b in d["blocks"])
        d["pre"], d["post"] = seg(d["pre"]), seg(d["post"])
        d["pinned_cuts"] = tuple(d.get("pinned_cuts", ()))
        return cls(**d)


@dataclass(frozen=True, kw_only=True)
class StageInfo:
    index: int
    blocks: tuple[int, int]
    """Half-open range [start, end) of block indices."""
    block_names: tuple[str, ...]
    in_flight: int
    static_bytes: int
    budget_bytes: int | None
    """Peak allowed for one micro-batch's fw+bw (the stage's lynx ``memory_budget``); None: no limit."""
    kept_bytes: int
    """Activation bytes one micro-batch keeps under the plan."""
    peak_bytes: int
    """Predicted device peak: static + the most ``f x kept + w x carry_bytes`` over ``held`` +
    working + the transient of a block's backward (``transient_bytes``; the waiting micro-batches
    hold only what they keep, those past B only their carry). The fit test is stricter: each
    micro-batch in flight counts at the whole per-micro-batch peak (``budget_bytes``), as the
    stage's lynx budget bounds only that peak."""
    compute_s: float
    recompute_s: float
    """Exposed recompute per micro-batch."""
    recompute_w_s: float = 0.0
    """The part of ``recompute_s`` only the weight gradients need: it runs in W under the
    zero-bubble schedules (``RecomputeCurve.exposed_w_s``; 0 elsewhere or when not known)."""
    fits: bool = True
    carry_bytes: int = 0
    """Bytes one micro-batch holds from its B to its W (zero-bubble schedules with lynx's B/W
    split; 0 otherwise)."""
    held: tuple[tuple[int, int], ...] = ()
    """Pairs (micro-batches between F and B, carries between B and W) the stage passes through
    and no other pair exceeds in both, from torch's action order (``schedule_sim.held_microbatches``);
    ``((in_flight, 0),)`` without W. The peak is the joint maximum over them."""
    pending_w: int = 0
    """Carries held at the predicted peak (the ``w`` of the pair reaching it)."""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.recompute_s


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    method: str
    schedule: str
    num_stages: int
    num_microbatches: int
    memory_per_device: int | None
    stages: tuple[StageInfo, ...]
    predicted_step_s: float
    """Timeline of the schedule, recompute on the critical path."""
    predicted_step_in_wait_s: float
    """Same, with recompute run while the stage waits for its gradient."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    pinned_cuts: tuple[int, ...] = ()
    """Cuts the user pinned (argument or ``pipe_split()`` markers); the rest were chosen."""
    marker_cuts: tuple[int, ...] = ()
    """The pinned cuts that are ``pipe_split()`` markers in the model (torch splits there itself)."""
    rank_peak_bytes: tuple[int, ...] = ()
    """Predicted device peak of each rank (pipeline group rank), its stages together over torch's
    order (``rank_memory``), from the bytes the planner expects each micro-batch to keep; one
    stage per rank: that stage's ``peak_bytes``."""
    rank_bound_bytes: tuple[int, ...] = ()
    """Each rank's fit test at the plan's allowances (every micro-batch in flight at its stage's
    whole allowance, ``rank_memory``), at most ``memory_per_device`` when the plan fits; () without
    a memory limit. What is left under ``memory_per_device`` is the headroom early recompute may use."""

    @property
    def cuts(self) -> tuple[str, ...]:
        """Name of the first block of every stage after the first (where a stage begins)."""
        return tuple(s.block_names[0] for s in self.stages[1:])

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(s.blocks[1] - s.blocks[0] for s in self.stages)

    @property
    def bottleneck_s(self) -> float:
        return max(s.time_s for s in self.stages)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cuts"], d["layers_per_stage"] = list(self.cuts), list(self.layers_per_stage)
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StagePlan":
        d = {k: v for k, v in d.items() if k not in ("cuts", "layers_per_stage")}
        d["stages"] = tuple(StageInfo(**{**s, "blocks": tuple(s["blocks"]), "block_names": tuple(s["block_names"]),
                                         "held": tuple(tuple(h) for h in s.get("held", ()))})
                            for s in d["stages"])
        d["notes"] = tuple(d.get("notes", ()))
        d["pinned_cuts"] = tuple(d.get("pinned_cuts", ()))
        d["marker_cuts"] = tuple(d.get("marker_cuts", ()))
        d["rank_peak_bytes"] = tuple(d.get("rank_peak_bytes", ()))
        d["rank_bound_bytes"] = tuple(d.get("rank_bound_bytes", ()))
        return cls(**d)

    def table(self) -> str:
        """One line per stage, for logs and the CLI."""
        lines = [f"stage plan ({self.method}, {self.schedule}, p={self.num_stages}, m={self.num_microbatches}): "
                 f"layers {list(self.layers_per_stage)}, predicted step {self.predicted_step_s * 1e3:.1f} ms "
                 f"({self.predicted_step_in_wait_s * 1e3:.1f} ms with recompute in the gradient wait)"]
        for s in self.stages:
            budget = f"{s.budget_bytes / 2**20:.1f} MiB" if s.budget_bytes is not None else "-"
            carry = (f" W-carry {s.carry_bytes / 2**20:.1f} MiB/mb x{s.pending_w} at peak"
                     if s.carry_bytes else "")
            lines.append(f"  stage {s.index}: blocks {s.blocks[0]}..{s.blocks[1] - 1} in-flight {s.in_flight}{carry} "
                         f"budget/mb {budget} peak {s.peak_bytes / 2**20:.1f} MiB compute "
                         f"{s.compute_s * 1e3:.2f} ms recompute {s.recompute_s * 1e3:.2f} ms"
                         f"{'' if s.fits else '  DOES NOT FIT'}")
        if len(self.rank_peak_bytes) < len(self.stages):  # several stages per rank
            bound = (" (fit test, every micro-batch in flight at its whole allowance: "
                     + ", ".join(f"{b / 2**20:.1f} MiB" for b in self.rank_bound_bytes) + ")"
                     if self.rank_bound_bytes else "")
            lines.append("  device peak per rank (its stages together): "
                         + ", ".join(f"{b / 2**20:.1f} MiB" for b in self.rank_peak_bytes) + bound)
        return "\n".join(lines)


def check_inputs(costs: PipelineCosts, num_stages: int, num_microbatches: int, schedule: str,
                 ranks: int | None = None) -> None:
    n = len(costs.blocks)
    if schedule not in SCHEDULES:
        raise StagePlanError(f"schedule={schedule!r} is not valid; choose one of {sorted(SCHEDULES)}")
    if ranks is not None or schedule == "ZBVZeroBubble":
        from .placement import check_placement

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


class _Pricer:
    """Prices a candidate stage [s, e) at position i; memoized."""

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
            from .placement import zero_bubble_orders
            from .schedule_sim import held_microbatches

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


def weight_share(curves: Sequence[RecomputeCurve], kept: float) -> float:
    """The share of the exposed recompute of blocks keeping ``kept`` bytes together (in equal
    shares, as ``transient_bytes``) that only W needs (``RecomputeCurve.weight_share``, weighted
    by each block's exposed seconds there); 0 without curves or when nothing is exposed."""
    if not curves:
        return 0.0
    each = kept / len(curves)
    total = sum(c._interp(c.exposed_s, each) for c in curves)
    if total <= 0:
        return 0.0
    return min(1.0, sum(c.weight_share(each) * c._interp(c.exposed_s, each) for c in curves) / total)


def transient_bytes(curves: Sequence[RecomputeCurve], kept: float) -> int:
    """Bytes a block's backward brings back on top of what the stage keeps: the largest block's
    full activations minus its share of ``kept`` (blocks assumed to keep equal shares, exact for
    identical blocks). 0 without blocks."""
    if not curves:
        return 0
    return int(max(0.0, max(c.max_bytes for c in curves) - kept / len(curves)))


def allocate_with_transient(curves: Sequence[RecomputeCurve], room: float) -> tuple[int, float, bool, int]:
    """``allocate`` under ``kept + transient_bytes(kept) <= room``: start from the largest
    transient (every block at its least), then shrink it to what the allocation leaves,
    re-allocating the freed bytes, a few rounds. Every round's (kept, transient) pair satisfies
    the constraint with the transient it was allocated under, which is never below the one it
    implies."""
    transient = transient_bytes(curves, sum(c.min_bytes for c in curves))
    kept, exposed, fits = allocate(curves, room - transient)
    for _ in range(8):
        if not fits:
            break
        implied = transient_bytes(curves, kept)
        if implied >= transient - 1:
            break
        transient = implied
        kept, exposed, fits = allocate(curves, room - transient)
    return kept, exposed, fits, transient


def allocate(curves: Sequence[RecomputeCurve], room: float) -> tuple[int, float, bool]:
    """Split ``room`` kept bytes between blocks minimizing summed exposed recompute.

    Returns (kept bytes, exposed seconds, fits). Greedy over hull segments by seconds saved per
    byte: exact for convex piecewise-linear curves (a fractional last segment interpolates)."""
    hulls = [c.hull() for c in curves]
    kept = sum(h[0][0] for h in hulls)
    exposed = sum(h[0][1] for h in hulls)
    if kept > room:
        return kept, exposed, False
    steps = []
    for h in hulls:
        for (x0, y0), (x1, y1) in zip(h, h[1:]):
            steps.append(((y0 - y1) / (x1 - x0), x1 - x0, y0 - y1))
    steps.sort(key=lambda t: -t[0])  # convexity keeps each hull's segments in order
    left = room - kept
    for _, dx, dy in steps:
        if left <= 0:
            break
        take = min(1.0, left / dx)
        kept += int(dx * take)
        exposed -= dy * take
        left -= dx * take
    return int(kept), max(0.0, exposed), True


def _dp(pr: _Pricer, stage_time) -> list[int]:
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
    pr = _Pricer(costs, p, m, memory_per_device, schedule, ranks)
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
                need = max(need, _joint_search(pr, allowed, [least])[1] or 0)
            raise _too_small(pr, need)
    stages = tuple(pr.price(i, s, e) for i, (s, e) in enumerate(_ranges(cuts, n)))
    stages, rank_peaks, over = _share_ranks(pr, stages)
    if over and method == "lynx" and len(pins) < p - 1:  # a split the user fixed is reported, not refused
        # the programme priced each stage as if alone on its device: search the splits whose
        # stages fit their ranks together
        found, need = _joint_search(pr, allowed, [cuts, _dp(pr, timed(lambda i, s, e: float(pr.min_memory(i, s, e))))])
        if found is None:
            raise _too_small(pr, need)
        cuts, (stages, rank_peaks, over) = found
    from .step_time import simulate_stages

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
                     rank_bound_bytes=_rank_bounds(pr, stages))


def _too_small(pr: _Pricer, need: int) -> StagePlanError:
    shared = f", the stages of a rank together on {pr.ranks} ranks" if pr.ranks < pr.p else ""
    return StagePlanError(
        f"memory_per_device={pr.memory} B ({human_bytes(pr.memory)}) is too small for any split of {pr.n} blocks "
        f"into {pr.p} stages with {pr.m} micro-batches ({pr.schedule}{shared}): even with full recompute the "
        f"smallest split needs {need} B ({human_bytes(need)}) on its fullest device. Give each device at least "
        f"that, use more stages, or a smaller micro-batch.")


def _rank_walk(pr: _Pricer) -> list:
    """``rank_memory.rank_points`` of torch's order (W's dropped when the stages do not split B from W)."""
    orders = rank_orders(pr.schedule, pr.ranks, pr.p, pr.m)
    if not (pr.schedule in ZERO_BUBBLE_SCHEDULES and pr.c.weight_split):
        orders = tuple(tuple(a for a in order if a[0] != "W") for order in orders)
    return rank_points(orders)


def _rank_of(pr: _Pricer, stages: Sequence[StageInfo], r: int) -> list[StageInfo]:
    return [st for st in stages if stage_rank(pr.schedule, st.index, pr.p, pr.ranks) == r]


def _share_ranks(pr: _Pricer, stages: tuple[StageInfo, ...]) -> tuple[tuple[StageInfo, ...], tuple[int, ...], list[int]]:
    """Stages that share a rank fitted to its memory together (``rank_memory``): (the stages,
    re-priced at their shared allowances where those are lower; the predicted device peak of each
    rank; the ranks that do not fit even at full recompute, whose stages are marked as not fitting).
    One stage per rank: the stages as they are, and their peaks."""
    if pr.ranks >= pr.p:
        return stages, tuple(st.peak_bytes for st in stages), []
    points = _rank_walk(pr)
    out, peaks, over = list(stages), [], []
    for r in range(pr.ranks):
        mine = _rank_of(pr, stages, r)
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


def _rank_bounds(pr: _Pricer, stages: Sequence[StageInfo]) -> tuple[int, ...]:
    """``StagePlan.rank_bound_bytes``: ``_rank_bound`` of every rank (one stage per rank: over the
    stage's own ``held`` pairs)."""
    if pr.memory is None:
        return ()
    if pr.ranks >= pr.p:
        return tuple(_rank_bound([{st.index: pair} for pair in st.held], [st]) for st in stages)
    points = _rank_walk(pr)
    return tuple(_rank_bound(points[r], _rank_of(pr, stages, r)) for r in range(pr.ranks))


def _rank_bound(points, mine: Sequence[StageInfo]) -> int:
    """The rank's fit test at its stages' allowances (``rank_memory``: each micro-batch in flight
    at its stage's whole allowance), statics included."""
    shares = [StageShare(index=st.index, static=st.static_bytes, first=st.index == 0,
                         carry=st.carry_bytes if st.index else 0,
                         gradient=max(0, st.carry_bytes - st.kept_bytes) if st.index == 0 else 0, options=())
              for st in mine]
    chosen = {st.index: Option(budget=st.budget_bytes, kept=st.kept_bytes, transient=0, seconds=0.0) for st in mine}
    return sum(st.static_bytes for st in mine) + rank_bytes(points, shares, chosen)


def _rank_peak(pr: _Pricer, points, mine: Sequence[StageInfo]) -> int:
    """Predicted device peak of one rank (``rank_memory``): its stages' static bytes, the most
    their kept and carried bytes add up to at a point of the rank's walk, the working bytes and
    the largest transient."""
    held = max((sum(pt[st.index][0] * st.kept_bytes + pt[st.index][1] * st.carry_bytes for st in mine)
                for pt in points), default=0)
    return sum(st.static_bytes for st in mine) + held + pr.c.working_bytes + max(pr.transient(st) for st in mine)


SEARCH_LIMIT = 20000
"""Splits ``_joint_search`` enumerates at most; above, the neighbours of its starting splits."""


def _joint_search(pr: _Pricer, allowed, starts: Sequence[Sequence[int]]):
    """The split (with stages sharing ranks, ``_share_ranks``) least in (slowest stage, summed
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
    points = _rank_walk(pr)
    rows, least_need = [], None
    for cuts in splits:
        ranges = _ranges(cuts, n)
        if not all(allowed(i, s, e) for i, (s, e) in enumerate(ranges)):
            continue
        infos = tuple(pr.price(i, s, e) for i, (s, e) in enumerate(ranges))
        need = 0
        for r in range(pr.ranks):
            shares = [pr.share(st) for st in _rank_of(pr, infos, r)]
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
        shared = _share_ranks(pr, infos)
        if shared[2]:
            continue
        got = (max(st.time_s for st in shared[0]), sum(st.time_s for st in shared[0]))
        if best_key is None or got < best_key:
            best, best_key = (list(cuts), shared), got
    return best, least_need


def _ranges(cuts: Sequence[int], n: int) -> list[tuple[int, int]]:
    bounds = [0, *cuts, n]
    return list(zip(bounds, bounds[1:]))
