"""``RematProblem`` and ``RematSolution``: the recompute optimizer's input and output, plain data.

No torch.fx in here (the solvers never see a graph): a problem is extracted from the joint
graph by ``lynx_compile.recompute.problem_from_graph`` and serializes to JSON.

The model the solvers implement
-------------------------------
Time is a sequence of *events*: ``num_fw_events`` forward events (0 .. F-1), then
``num_bw_events`` backward events (0 .. B-1) in the order the backward runs.

A *unit* a is one forward tensor storage the backward may need (directly, or as the input of a
recomputation), with bytes m_a and recompute time c_a. Per unit exactly one of:

- keep    s_a : saved by the forward; live from its production (``fw_pos``) to the end of the
                forward, and in the backward from event 0 to ``need_end``;
- demand  r_a : recomputed on demand, right before it is first needed; live in the backward
                over [``need_start``, ``need_end``]; costs c_a on the critical path;
- window  o_aw: recomputed inside communication window w (a collective in flight, backward
                events [``start``, ``end``]), only if ``end <= need_start``; live over
                [``start``, ``need_end``]; costs nothing up to the window's capacity;
- offload f_a : (only units with ``offload_s`` set, i.e. ``LynxConfig.offload``) saved in host
                memory: copied device→host right after its producer, host→device before its
                first backward need. Live on the device in the forward over [``fw_pos``,
                ``offload_fw_end``] (until the copy is done) and in the backward over
                [``offload_bw_start``, ``need_end``] (from the prefetching reload); costs
                ``offload_exposed_s`` on the critical path;
- none        : only for units that nothing needs (no direct use and no recomputed consumer).

Units with ``first_use`` set are read directly by the backward: s + r + Σ_w o + f = 1.
Units without it are intermediates: s + r + Σ_w o ≤ 1.
``must_keep`` units (impure ops, collectives, RNG state, block-boundary tensors) are saved:
s + f = 1 (f only when offloadable).

Offload timing (computed at extraction, ``passes/offload.py``; copy time t = bytes / host link
bytes/s, one way): the device→host copy starts after the producer and overlaps the forward ops
after it; ``offload_fw_end`` is the first forward event by which their cost sum reaches t (the
last forward event if never). The host→device copy is issued early enough that the backward
ops before the first need cover t (``offload_bw_start``; event 0 if they never do). Exposed =
max(0, t − forward compute after the producer) + max(0, t − backward compute before the need).
Each copy is priced alone: copies sharing the link (serialized on one copy engine) are not
modelled, nor is the compute slowed by the copies' memory traffic.

[Inputs available] a recomputed unit needs each input b (``inputs``) kept, offloaded or
recomputed no later: demand(a) ≤ s_b + r_b + Σ_w o_bw + f_b (``need_start`` of an input is never later than its
consumers'), and o_aw ≤ s_b + Σ_{w' ≤ w} o_bw' (windows are ordered by ``start``; an offloaded input is
reloaded at its own need, too late for a window).

[Window capacity] Σ_a κ·c_a·o_aw ≤ τ_w + over_w, over_w ≥ 0 (κ = ``kappa``, the slowdown of
compute running beside a collective).

[Memory] at every forward event t:
    fw_base[t] + Σ_a m_a·([fw_pos ≤ t ≤ fw_last] + s_a·[t > fw_last]
                         + f_a·[fw_last < t ≤ offload_fw_end]) ≤ budget
(a unit not kept is still live in the forward from fw_pos to its last forward use fw_last),
and at every backward event t:
    bw_base[t] + Σ_a m_a·(s_a·[t ≤ need_end] + r_a·[need_start ≤ t ≤ need_end]
                         + Σ_w o_aw·[start_w ≤ t ≤ need_end]
                         + f_a·[offload_bw_start ≤ t ≤ need_end]) ≤ budget.
``fw_base``/``bw_base`` are the bytes live at each event that belong to no unit (gradients,
backward temporaries, outputs), from the no-recompute schedule.

[Memory, recompute chains] A *one-event* unit (need_start == need_end == t, not must_keep)
that is demanded lives only inside event t's recompute chain: the chain computes, in forward
order, every unit whose need_start is t, and frees each one-event unit after its last reader
in the chain (one the backward reads directly stays to the op at t). Its bytes are not in the
sum above; instead event t adds the largest *chain row*: for each step k of the chain (each
unit, then the op at t), Σ m_a·r_a over the one-event units live at step k. In the MILP,
chain_t ≥ each row of t (continuous), and chain_t joins event t's memory row. (Counting the
whole chain at once overstated full recompute's peak by 0.12 of the no-recompute peak on
gpt-small.) Longer-lived units recomputed at t count from the chain's start: an upper bound.

Unit bytes: an op with several outputs (``native_dropout``: output and mask) counts the
outputs the backward reads directly plus those a recomputable op reads; an output only read
by ops that are never recomputed is freed after its last forward read under every plan, so it
is in the base.

[Region caps] (issue U: a region of the model with its own budget) for each region R, the
bytes its units keep on the device for the backward: Σ_{a∈R} m_a·s_a ≤ ``max_bytes`` (an
offloaded unit is in host memory and does not count).

[Objective] minimize exposed time Σ_a c_a·r_a + Σ_w over_w + Σ_a offload_exposed_s_a·f_a
− Σ_a k_a·(r_a + Σ_w o_aw), with k_a the forward write a recomputed unit saves (``Unit.write_s``):
the step time a plan adds to the no-recompute step, below zero where recomputing is cheaper.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One forward tensor storage the backward may need."""

    id: int
    name: str
    """Joint-graph name of the node that produces the storage."""
    nbytes: int
    compute_s: float
    """Time to recompute it (its op, plus the views that lead to what the backward reads)."""
    write_s: float = 0.0
    """Time the forward spends writing it only because it is saved: a value Inductor would
    compute inside the kernels that read it (``memory.inductor_model.fused_interior``, a norm's
    normalized input before its affine) is written out when saved. Every plan that does not keep
    it (or offload it) saves this time: its net price is ``compute_s - write_s``, below zero
    where recomputing costs less than writing and reading back."""
    inputs: tuple[int, ...] = ()
    """Unit ids its recomputation reads (parameters and inputs are always available)."""
    block: int | None = None
    fw_pos: int = 0
    fw_last: int = 0
    """Last forward event that reads it (== fw_pos when only the backward reads it)."""
    first_use: int | None = None
    """First backward event that reads it directly; None for intermediates."""
    need_start: int = 0
    """First backward event at which it must exist if recomputed on demand."""
    need_end: int = 0
    """Last backward event at which it must exist (direct reads and recomputed consumers)."""
    must_keep: bool = False
    recomputable: bool = True
    """False: a tensor recomputes read that is never recomputed itself (a block's input the
    backward does not read, which a recompute of the block's first norm reads): kept when a
    recomputed unit reads it, else dropped, never demanded."""
    offload_s: float | None = None
    """One-way host copy time (bytes / host link bytes/s) when the unit may be offloaded; None:
    it may not (offload off, not read by the backward, not a device tensor)."""
    offload_exposed_s: float = 0.0
    """Copy time not hidden behind compute, forward and backward together (model above)."""
    offload_fw_end: int = 0
    """Offloaded: last forward event the device tensor is live (the copy's end, >= fw_last)."""
    offload_bw_start: int = 0
    """Offloaded: first backward event the reloaded tensor is live (<= need_start)."""


@dataclass(frozen=True, kw_only=True)
class CommWindow:
    """A communication window of the backward: a collective in flight (the optimizer's view of
    it; the decision to recompute inside one is ``lynx_compile.decisions.Window``)."""

    id: int
    start: int
    """Backward event at which the collective is issued."""
    end: int
    """Backward event of its wait."""
    duration_s: float
    kind: str = "collective"
    name: str = ""
    """The collective's node name in the backward (what a ``Window`` decision names)."""


@dataclass(frozen=True, kw_only=True)
class RegionCap:
    """A region of the model with its own budget: the units it saves for the backward keep at
    most ``max_bytes`` on the device (``fraction`` of ``reference_bytes``, what the region saves
    with no recompute)."""

    name: str
    units: tuple[int, ...]
    max_bytes: int
    fraction: float = 1.0
    reference_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class RematProblem:
    units: tuple[Unit, ...]
    num_fw_events: int
    num_bw_events: int
    fw_base: tuple[int, ...]
    bw_base: tuple[int, ...]
    windows: tuple[CommWindow, ...] = ()
    block_groups: tuple[tuple[int, ...], ...] = ()
    """Blocks (indices) that are structurally identical, one tuple per group."""
    kappa: float = 1.0
    reference_peak: int = 0
    """Peak bytes with no recompute (the budget's 100%)."""
    graph_hash: str = ""
    region_caps: tuple[RegionCap, ...] = ()
    """Regions with their own budget (``RegionCap``); none: only the step's budget applies."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RematProblem":
        d = dict(d)
        d["units"] = tuple(Unit(**{**u, "inputs": tuple(u["inputs"])}) for u in d["units"])
        d["windows"] = tuple(CommWindow(**w) for w in d.get("windows", ()))
        d["block_groups"] = tuple(tuple(g) for g in d.get("block_groups", ()))
        d["region_caps"] = tuple(RegionCap(**{**c, "units": tuple(c["units"])}) for c in d.get("region_caps", ()))
        d["fw_base"], d["bw_base"] = tuple(d["fw_base"]), tuple(d["bw_base"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "RematProblem":
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True, kw_only=True)
class RematSolution:
    """Per unit: keep, recompute on demand, or recompute in a window."""

    keep: tuple[int, ...]
    demand: tuple[int, ...]
    window: tuple[tuple[int, int], ...] = ()
    """(unit id, window id) pairs."""
    offload: tuple[int, ...] = ()
    """Unit ids saved in host memory."""
    exposed_s: float = 0.0
    """Objective: time on the critical path (demand recompute + window overflow + the offload
    copies' exposed part), less the forward writes of the recomputed units (``Unit.write_s``)."""
    offload_exposed_s: float = 0.0
    """The offload copies' part of ``exposed_s``."""
    recompute_s: float = 0.0
    """All recompute time, hidden or not."""
    peak_bytes: int = 0
    """Peak under the problem's memory model."""
    solver: str = ""
    status: str = ""
    """"optimal", "feasible" (stopped at the gap/time limit with an incumbent), "heuristic"."""
    solve_s: float = 0.0
    gap: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RematSolution":
        d = dict(d)
        d["keep"], d["demand"] = tuple(d["keep"]), tuple(d["demand"])
        d["window"] = tuple(tuple(p) for p in d.get("window", ()))
        d["offload"] = tuple(d.get("offload", ()))
        d["notes"] = tuple(d.get("notes", ()))
        return cls(**d)


class InfeasibleBudget(ValueError):
    """No assignment fits the budget; ``smallest`` is the smallest peak any assignment reaches."""

    def __init__(self, budget: int, smallest: int, reference: int):
        self.budget, self.smallest, self.reference = budget, smallest, reference
        frac = f" = {smallest / reference:.3f} of the no-recompute peak" if reference else ""
        super().__init__(
            f"memory budget {budget} B is infeasible: the smallest reachable peak is {smallest} B{frac}; "
            f"use memory_budget >= {smallest / reference:.3f}" if reference else
            f"memory budget {budget} B is infeasible: the smallest reachable peak is {smallest} B")


class InfeasibleRegion(ValueError):
    """A region's budget is below what its units must keep (tensors that cannot be recomputed:
    block-boundary tensors, collectives, impure ops); ``smallest`` is the lowest fraction of
    the region's no-recompute saved bytes any assignment reaches."""

    def __init__(self, cap: RegionCap, must_bytes: int):
        self.cap, self.must_bytes = cap, must_bytes
        self.smallest = smallest_fraction(must_bytes, cap.reference_bytes)
        super().__init__(
            f"region {cap.name!r}: budget {cap.fraction:g} ({cap.max_bytes} B of the {cap.reference_bytes} B it saves "
            f"with no recompute) is below the {must_bytes} B it must keep saved (tensors no plan recomputes: "
            f"block-boundary tensors, collectives, random or impure ops); use a region budget >= {self.smallest:.3f}")


def smallest_fraction(least_bytes: int, reference_bytes: int) -> float:
    """``least_bytes / reference_bytes`` rounded up to 3 decimals (at most 1): the smallest region
    budget a refusal names, so that asking for it fits."""
    return min(1.0, -(-least_bytes * 1000 // max(reference_bytes, 1)) / 1000)


def region_must_bytes(problem: RematProblem, cap: RegionCap) -> int:
    """Bytes of ``cap``'s units that every assignment keeps on the device (must_keep, not
    offloadable)."""
    by_id = {u.id: u for u in problem.units}
    return sum(by_id[i].nbytes for i in cap.units if by_id[i].must_keep and by_id[i].offload_s is None)


def check_region_caps(problem: RematProblem) -> None:
    """Raise ``InfeasibleRegion`` for the first region whose budget no assignment meets."""
    for cap in problem.region_caps:
        must = region_must_bytes(problem, cap)
        if must > cap.max_bytes:
            raise InfeasibleRegion(cap, must)
