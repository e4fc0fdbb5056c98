"""``evaluate``: the reference evaluator of the model in ``problem.py`` (numpy, no solver).

Given a problem and an assignment (keep set, demand set, (unit, window) pairs) it returns the
memory at every forward and backward event, the peak, the objective (exposed seconds) and the
list of rule violations. Both solvers report their ``peak_bytes``/``exposed_s`` through it, and
the tests check both solvers against it.

The per-problem arrays (``ProblemArrays``: bytes, intervals, window order, the forward profile
that does not depend on the assignment, edges for the input rule) are built once and cached
by ``problem_arrays`` (keyed by the problem's id, dropped when the problem is collected); an
evaluation is then a few difference-array cumsums, O(units + events).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .problem import RematProblem

NONE, KEEP, DEMAND, WINDOW, OFFLOAD = 0, 1, 2, 3, 4
"""Per-unit states of the internal assignment arrays (``state``; ``win`` holds window order)."""


@dataclass(frozen=True)
class Evaluation:
    peak_bytes: int
    peak_event: str
    """``"fw:t"`` or ``"bw:t"``, the first event reaching the peak ("" without events)."""
    fw_memory: tuple[int, ...]
    bw_memory: tuple[int, ...]
    exposed_s: float
    """Objective: demand recompute time + Σ_w window overflow + offload copies' exposed time."""
    recompute_s: float
    """All recompute time (demand + window), unscaled by kappa."""
    feasible_inputs: bool
    """True when no rule other than the budget is broken (``violations`` is empty)."""
    violations: tuple[str, ...]


class ProblemArrays:
    """A problem as numpy arrays, indexed by unit position ``i`` in ``problem.units``.

    Windows are indexed by their *order* (sorted by (start, id)), the order the input rule uses.
    Raises ValueError when the problem is malformed (sizes, event ranges, unknown ids).
    """

    def __init__(self, p: RematProblem):
        us = p.units
        self.n, self.F, self.B, self.kappa = len(us), p.num_fw_events, p.num_bw_events, p.kappa
        self.reference = p.reference_peak
        self.index = {u.id: i for i, u in enumerate(us)}
        if len(self.index) != self.n:
            raise ValueError("RematProblem: duplicate unit ids")
        if len(p.fw_base) != self.F or len(p.bw_base) != self.B:
            raise ValueError(f"RematProblem: fw_base/bw_base have {len(p.fw_base)}/{len(p.bw_base)} "
                             f"entries for {self.F}/{self.B} events")
        self.names = tuple(u.name for u in us)
        self.ids = np.array([u.id for u in us], dtype=np.int64)
        self.m = np.array([u.nbytes for u in us], dtype=np.int64)
        self.c = np.array([u.compute_s for u in us], dtype=np.float64)
        self.k = np.array([u.write_s for u in us], dtype=np.float64)
        """The forward write a unit's recompute saves (``Unit.write_s``)."""
        self.fw_pos = np.array([u.fw_pos for u in us], dtype=np.int64)
        self.fw_last = np.array([u.fw_last for u in us], dtype=np.int64)
        self.ns = np.array([u.need_start for u in us], dtype=np.int64)
        self.ne = np.array([u.need_end for u in us], dtype=np.int64)
        self.needed = np.array([u.first_use is not None for u in us], dtype=bool)
        self.must = np.array([u.must_keep for u in us], dtype=bool)
        self.hold = np.array([not u.recomputable for u in us], dtype=bool)
        """Units that are kept or dropped, never recomputed (``Unit.recomputable`` False)."""
        self.can_off = np.array([u.offload_s is not None for u in us], dtype=bool)
        self.off_s = np.array([u.offload_s or 0.0 for u in us], dtype=np.float64)
        self.off_exposed = np.array([u.offload_exposed_s for u in us], dtype=np.float64)
        self.off_fw_end = np.array([max(u.offload_fw_end, u.fw_last) for u in us], dtype=np.int64)
        self.off_bw_start = np.array([min(u.offload_bw_start, u.need_start) for u in us], dtype=np.int64)
        self.block = np.array([-1 if u.block is None else u.block for u in us], dtype=np.int64)
        for u in us:
            if not (0 <= u.fw_pos <= u.fw_last < max(self.F, 1)) or \
                    not (0 <= u.need_start <= u.need_end < max(self.B, 1)):
                raise ValueError(f"RematProblem: unit {u.name!r} has events out of range")
            if u.offload_s is not None and not (u.offload_fw_end < max(self.F, 1) and u.offload_bw_start >= 0):
                raise ValueError(f"RematProblem: unit {u.name!r} has offload events out of range")
            missing = [b for b in u.inputs if b not in self.index]
            if missing:
                raise ValueError(f"RematProblem: unit {u.name!r} reads unknown unit ids {missing}")
        self.inputs = tuple(tuple(self.index[b] for b in u.inputs) for u in us)
        cons: list[list[int]] = [[] for _ in us]
        for i, ins in enumerate(self.inputs):
            for b in ins:
                cons[b].append(i)
        self.consumers = tuple(tuple(c) for c in cons)
        self.edge_a = np.array([i for i, ins in enumerate(self.inputs) for _ in ins], dtype=np.int64)
        self.edge_b = np.array([b for ins in self.inputs for b in ins], dtype=np.int64)
        self.topo = self._topological()
        self._windows(p)
        fw = np.zeros(self.F + 1, dtype=np.int64)
        np.add.at(fw, self.fw_pos, self.m)
        np.add.at(fw, self.fw_last + 1, -self.m)
        self.fw_const = np.asarray(p.fw_base, dtype=np.int64) + np.cumsum(fw)[:self.F]
        self.bw_base = np.asarray(p.bw_base, dtype=np.int64)
        self._chains()
        # regions with their own budget: unit positions and the most bytes they keep
        self.region_names = tuple(c.name for c in p.region_caps)
        self.region_units = tuple(np.array([self.index[u] for u in c.units if u in self.index], dtype=np.int64)
                                  for c in p.region_caps)
        self.region_max = np.array([c.max_bytes for c in p.region_caps], dtype=np.int64)
        self.region_of = np.full(self.n, -1, dtype=np.int64)
        for r, units in enumerate(self.region_units):
            self.region_of[units] = r
        self.cache: dict[str, Any] = {}
        """Other modules' per-problem results (e.g. ``smallest_peak``)."""

    def _topological(self) -> tuple[int, ...]:
        indeg = [len(ins) for ins in self.inputs]
        ready = [i for i in range(self.n) if indeg[i] == 0]
        order: list[int] = []
        while ready:
            i = ready.pop()
            order.append(i)
            for c in self.consumers[i]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    ready.append(c)
        if len(order) != self.n:
            raise ValueError("RematProblem: the units' inputs form a cycle")
        return tuple(order)

    def _windows(self, p: RematProblem) -> None:
        ws = sorted(p.windows, key=lambda w: (w.start, w.id))
        for w in ws:
            if not 0 <= w.start <= w.end < self.B:
                raise ValueError(f"RematProblem: window {w.id} is out of the backward's range")
        self.W = len(ws)
        self.win_ids = np.array([w.id for w in ws], dtype=np.int64)
        self.win_index = {w.id: k for k, w in enumerate(ws)}
        self.win_start = np.array([w.start for w in ws], dtype=np.int64)
        self.win_end = np.array([w.end for w in ws], dtype=np.int64)
        self.win_tau = np.array([w.duration_s for w in ws], dtype=np.float64)
        # eligible[i]: window orders with end <= need_start, latest start first
        self.eligible = tuple(np.flatnonzero(self.win_end <= ns)[::-1] for ns in self.ns)

    def _chains(self) -> None:
        """The recompute chains' rows (see ``problem.py``, [Memory], chains).

        ``transient[i]``: unit i, when demanded, is live at its one event only (need_start ==
        need_end, not must_keep), and counts through its chain's rows instead of the event sum.
        Row r (at event ``row_event[r]``) holds the transients live while the chain computes
        one unit: entries (``entry_row``, ``entry_unit``). Chain order is forward order."""
        self.transient = (self.ns == self.ne) & ~self.must
        rows_event: list[int] = []
        entry_row: list[int] = []
        entry_unit: list[int] = []
        chain: dict[int, list[int]] = {}
        for i in np.argsort(self.fw_pos, kind="stable").tolist():
            chain.setdefault(int(self.ns[i]), []).append(i)
        for t, units in sorted(chain.items()):
            trans = [i for i in units if self.transient[i]]
            if not trans:
                continue
            at = {i: k for k, i in enumerate(units)}
            # a transient is live from its own position to its last consumer's in the chain;
            # one read directly by the backward op at t stays to the end of the chain
            last = {i: max([at[c] for c in self.consumers[i] if c in at] + [at[i]]) for i in trans}
            last.update({i: len(units) for i in trans if self.needed[i]})
            seen: set[tuple[int, ...]] = set()
            for k in range(len(units) + 1):
                live = tuple(i for i in trans if at[i] <= k <= last[i])
                if live and live not in seen:
                    seen.add(live)
                    entry_row += [len(rows_event)] * len(live)
                    entry_unit += live
                    rows_event.append(t)
        self.row_event = np.array(rows_event, dtype=np.int64)
        self.entry_row = np.array(entry_row, dtype=np.int64)
        self.entry_unit = np.array(entry_unit, dtype=np.int64)
        cuts = np.flatnonzero(np.diff(self.entry_row)) + 1
        self.chain_rows = tuple(zip(self.row_event.tolist(), np.split(self.entry_unit, cuts))) \
            if self.row_event.size else ()
        """(event, unit indices) per chain row."""

    def chain_bytes(self, state: np.ndarray) -> np.ndarray:
        """Per backward event: the largest chain row's bytes of the demanded transients."""
        out = np.zeros(self.B, dtype=np.int64)
        if self.row_event.size:
            dem = (state == DEMAND) & self.transient
            rows = np.bincount(self.entry_row, weights=(self.m * dem)[self.entry_unit],
                               minlength=self.row_event.size).astype(np.int64)
            np.maximum.at(out, self.row_event, rows)
        return out

    def profile(self, state: np.ndarray, win: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Memory at every forward and backward event (int64 arrays) of an assignment."""
        keep = state == KEEP
        fw = self.fw_const.copy()
        if self.F:
            d = np.zeros(self.F + 1, dtype=np.int64)
            np.add.at(d, self.fw_last[keep] + 1, self.m[keep])
            off = state == OFFLOAD        # device copy live until its copy to host is done
            np.add.at(d, self.fw_last[off] + 1, self.m[off])
            np.add.at(d, self.off_fw_end[off] + 1, -self.m[off])
            fw += np.cumsum(d)[:self.F]
        live = (state != NONE) & ~((state == DEMAND) & self.transient)   # chains: chain_bytes
        start = np.where(state == DEMAND, self.ns, 0)
        start = np.where(state == OFFLOAD, self.off_bw_start, start)
        if self.W:
            ws = self.win_start[np.maximum(win, 0)]
            start = np.where(state == WINDOW, np.minimum(ws, self.ne), start)
        d = np.zeros(self.B + 1, dtype=np.int64)
        np.add.at(d, start[live], self.m[live])
        np.add.at(d, self.ne[live] + 1, -self.m[live])
        return fw, self.bw_base + np.cumsum(d)[:self.B] + self.chain_bytes(state)

    def window_load(self, state: np.ndarray, win: np.ndarray) -> np.ndarray:
        """κ·Σ c_a per window order."""
        inw = state == WINDOW
        return np.bincount(win[inw], weights=self.kappa * self.c[inw], minlength=self.W)

    def times(self, state: np.ndarray, win: np.ndarray) -> tuple[float, float]:
        """(exposed_s, recompute_s) of an assignment: exposed net of the forward writes the
        recomputed units save (``k``)."""
        dem = float(self.c[state == DEMAND].sum())
        over = float(np.maximum(self.window_load(state, win) - self.win_tau, 0.0).sum()) if self.W else 0.0
        off = float(self.off_exposed[state == OFFLOAD].sum())
        saved = float(self.k[(state == DEMAND) | (state == WINDOW)].sum())
        return dem + over + off - saved, dem + float(self.c[state == WINDOW].sum())

    def kept_in_region(self, state: np.ndarray, r: int) -> int:
        """Bytes region ``r`` (``RegionCap`` order) keeps saved on the device."""
        units = self.region_units[r]
        return int(self.m[units][state[units] == KEEP].sum())

    def region_kept(self, state: np.ndarray) -> np.ndarray:
        """Bytes each region keeps saved on the device (``RegionCap`` order)."""
        return np.array([self.kept_in_region(state, r) for r in range(len(self.region_units))], dtype=np.int64)

    def regions_fit(self, state: np.ndarray) -> bool:
        return not self.region_units or bool((self.region_kept(state) <= self.region_max).all())

    def violations(self, state: np.ndarray, win: np.ndarray) -> list[str]:
        """Every broken rule except the step's budget (a region's budget included), as readable lines."""
        out = [f"region {self.region_names[r]!r}: keeps {int(kept)} B, above its {int(self.region_max[r])} B"
               for r, kept in enumerate(self.region_kept(state)) if kept > self.region_max[r]] if self.region_units else []
        out += [f"{self.names[i]}: must_keep but not kept"
               for i in np.flatnonzero(self.must & (state != KEEP) & (state != OFFLOAD))]
        out += [f"{self.names[i]}: recomputed but not recomputable"
                for i in np.flatnonzero(self.hold & ((state == DEMAND) | (state == WINDOW)))]
        out += [f"{self.names[i]}: offloaded but not offloadable"
                for i in np.flatnonzero((state == OFFLOAD) & ~self.can_off)]
        out += [f"{self.names[i]}: read by the backward but neither kept nor recomputed"
                for i in np.flatnonzero(self.needed & (state == NONE))]
        inw = np.flatnonzero(state == WINDOW)
        out += [f"{self.names[i]}: window {self.win_ids[win[i]]} ends after its need_start"
                for i in inw[self.win_end[win[inw]] > self.ns[inw]]]
        a, b = self.edge_a, self.edge_b
        bad = (state[a] == DEMAND) & (state[b] == NONE)
        bad |= (state[a] == WINDOW) & ~((state[b] == KEEP) | ((state[b] == WINDOW) & (win[b] <= win[a])))
        out += [f"{self.names[i]}: recomputed but its input {self.names[j]} is not available"
                for i, j in zip(a[bad], b[bad])]
        return out

    def to_state(self, assignment: Any) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """(state, win, parse problems) from a solution, a mapping or a (keep, demand, window[,
        offload])."""
        keep, demand, window, offload = _parts(assignment)
        state = np.zeros(self.n, dtype=np.int8)
        win = np.full(self.n, -1, dtype=np.int64)
        bad: list[str] = []
        pairs = [(u, KEEP, -1) for u in keep] + [(u, DEMAND, -1) for u in demand]
        pairs += [(u, WINDOW, w) for u, w in window] + [(u, OFFLOAD, -1) for u in offload]
        for uid, st, wid in pairs:
            i = self.index.get(uid)
            if i is None or (st == WINDOW and wid not in self.win_index):
                bad.append(f"unknown unit/window id in ({uid}, {wid})")
                continue
            if state[i] != NONE:
                bad.append(f"{self.names[i]}: assigned more than once")
            state[i] = st
            win[i] = self.win_index[wid] if st == WINDOW else -1
        return state, win, bad

    def to_sets(self, state: np.ndarray, win: np.ndarray):
        """(keep, demand, window pairs) in unit-id order (``offloaded`` gives the offload set)."""
        ids = self.ids
        keep = tuple(int(x) for x in sorted(ids[state == KEEP]))
        demand = tuple(int(x) for x in sorted(ids[state == DEMAND]))
        inw = np.flatnonzero(state == WINDOW)
        window = tuple(sorted((int(ids[i]), int(self.win_ids[win[i]])) for i in inw))
        return keep, demand, window

    def offloaded(self, state: np.ndarray) -> tuple[int, ...]:
        """Offloaded unit ids, sorted."""
        return tuple(int(x) for x in sorted(self.ids[state == OFFLOAD]))


def _parts(a: Any):
    if isinstance(a, dict):
        return a.get("keep", ()), a.get("demand", ()), a.get("window", ()), a.get("offload", ())
    if isinstance(a, (tuple, list)):
        keep, demand, *rest = a
        return keep, demand, rest[0] if rest else (), rest[1] if len(rest) > 1 else ()
    return a.keep, a.demand, getattr(a, "window", ()), getattr(a, "offload", ())


_CACHE: dict[int, tuple[weakref.ref, ProblemArrays]] = {}


def problem_arrays(problem: RematProblem) -> ProblemArrays:
    """The cached ``ProblemArrays`` of ``problem`` (built on first use)."""
    key = id(problem)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is problem:
        return hit[1]
    arrays = ProblemArrays(problem)
    _CACHE[key] = (weakref.ref(problem), arrays)
    weakref.finalize(problem, _CACHE.pop, key, None)
    return arrays


def evaluate_state(arr: ProblemArrays, state: np.ndarray, win: np.ndarray,
                   extra: Iterable[str] = ()) -> Evaluation:
    fw, bw = arr.profile(state, win)
    exposed, recompute = arr.times(state, win)
    viol = tuple(extra) + tuple(arr.violations(state, win))
    peak, where = 0, ""
    if fw.size and (not bw.size or fw.max() >= bw.max()):
        peak, where = int(fw.max()), f"fw:{int(fw.argmax())}"
    elif bw.size:
        peak, where = int(bw.max()), f"bw:{int(bw.argmax())}"
    return Evaluation(peak_bytes=peak, peak_event=where, fw_memory=tuple(fw.tolist()),
                      bw_memory=tuple(bw.tolist()), exposed_s=exposed, recompute_s=recompute,
                      feasible_inputs=not viol, violations=viol)


def evaluate(problem: RematProblem, solution_or_assignment: Any) -> Evaluation:
    """Memory profile, peak, objective and rule violations of an assignment.

    ``solution_or_assignment``: a ``RematSolution`` (or anything with ``keep``, ``demand``,
    ``window``), a dict with those keys, or a tuple ``(keep, demand[, window])`` of unit ids
    and (unit id, window id) pairs. Units in none of them are "none". Never raises on a bad
    assignment: unknown ids, double assignments, must_keep, completeness, window eligibility
    and input availability problems are listed in ``violations``. The budget is not checked.
    """
    arr = problem_arrays(problem)
    state, win, bad = arr.to_state(solution_or_assignment)
    return evaluate_state(arr, state, win, bad)
