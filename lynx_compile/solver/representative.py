"""Lynx-HEU's exact pieces: small MILPs over *positions*, solved with highspy directly (Pyomo's
model building alone would cost more than the heuristic's whole time budget).

A position is a list of units that share one decision. The representative step makes one
position per unit index within a group of identical blocks (the k-th unit of each block; units
of identical blocks are listed in the same order), plus one per unit outside the groups; the
polish step makes one position per unit of a single block. Every unit not in a position keeps
its given state (constants). Since a decision is replicated onto all units of its position, the
memory at every event is linear in the position decisions: the "keep k" column sums the live
intervals of each block's k-th unit; a demanded one-event unit counts in its event's chain
rows instead (one extra memory row per chain row, ``_chain_matrix``). The MILP is therefore
the exact model of ``problem.py`` restricted to replicated decisions, at every event of the
timeline (other blocks' kept bytes are live in each block's backward; the peak is wherever it
is), except that fixed units' chain bytes add to every chain row of their event (an upper
bound):

    columns per position p:  s_p (keep), r_p (demand), o_p,rho (window of rank rho: the rho-th
    latest eligible window of each unit; a unit without one recomputes on demand, paying c_a)

Memory rows are added lazily (cutting planes: solve, add the most violated events, re-solve)
and share one slack column with a large penalty, so the MILP always has a solution; the repair
step fixes any slack left. Input rules and window order come from each position's first unit;
``heuristic.fix_inputs`` corrects the other blocks where their inputs differ.
"""
from __future__ import annotations

import numpy as np

from .evaluate import DEMAND, KEEP, NONE, WINDOW, ProblemArrays
from .milp_solvers import SOLVER_SEED

RANKS = 2            # window ranks per position (the latest eligible windows)
TIE_BREAK = 1e-6     # as in milp.py: prefer fewer kept bytes among equal-time plans
PENALTY = 1e6        # objective per budget-worth of slack bytes (the objective is O(1) without)
MAX_NODES = 1        # root only (deterministic effort cap): B&B past it rarely changed the plan
GAP = 1e-2           # relative MIP gap: the repair and polish steps that follow refine it


def _columns(arr: ProblemArrays, positions: list[np.ndarray]):
    cols: list[tuple[str, int, int]] = []          # (kind, position, rank)
    for p, units in enumerate(positions):
        lead = int(units[0])
        if arr.must[lead]:
            continue
        if arr.hold[lead]:  # kept or dropped, never recomputed
            cols.append(("s", p, -1))
            continue
        cols += [("s", p, -1), ("r", p, -1)]
        cols += [("o", p, rho) for rho in range(min(RANKS, arr.eligible[lead].size))]
    return cols


def _matrix(arr: ProblemArrays, positions, cols):
    """(memory coefficients (fw+bw events x cols), cost, kept bytes, {(col, window): load})."""
    F = arr.F
    d = np.zeros((F + arr.B + 1, len(cols)))
    cost, kept = np.zeros(len(cols)), np.zeros(len(cols))
    loads: dict[tuple[int, int], float] = {}
    for j, (kind, p, rho) in enumerate(cols):
        units = positions[p]
        m = arr.m[units].astype(np.float64)
        if kind == "s":
            # kept: live from the forward tail (fw_last, F) straight on to the backward's need_end
            np.add.at(d[:, j], arr.fw_last[units] + 1, m)
            np.add.at(d[:, j], F + arr.ne[units] + 1, -m)
            kept[j] = m.sum()
            continue
        start = arr.ns[units].copy()
        for x, a in enumerate(units):
            if kind == "o" and arr.eligible[a].size > rho:
                w = int(arr.eligible[a][rho])
                start[x] = arr.win_start[w]
                loads[j, w] = loads.get((j, w), 0.0) + arr.kappa * arr.c[a]
            else:
                cost[j] += arr.c[a]
            cost[j] -= arr.k[a]            # recomputed (on demand or in a window): no forward write
        if kind == "r":
            m = m * ~arr.transient[units]     # a demanded one-event unit counts in chain rows
        np.add.at(d[:, j], F + start, m)
        np.add.at(d[:, j], F + arr.ne[units] + 1, -m)
    return np.cumsum(d, axis=0)[:-1], cost, kept, loads


def _chain_matrix(arr: ProblemArrays, positions, cols, A: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, events): per chain row of ``arr`` that holds a position's unit, its event's row of
    ``A`` plus the demand columns of the transients in it (``evaluate``'s chain model)."""
    pos_of = {int(a): p for p, units in enumerate(positions) for a in units}
    rcol = {p: j for j, (kind, p, _) in enumerate(cols) if kind == "r"}
    rows, events = [], []
    for t, units in arr.chain_rows:
        add = [(rcol[pos_of[a]], float(arr.m[a])) for a in units.tolist()
               if a in pos_of and pos_of[a] in rcol]
        if not add:
            continue
        row = A[arr.F + t].copy()
        for j, m in add:
            row[j] += m
        rows.append(row)
        events.append(t)
    return (np.array(rows).reshape(len(rows), A.shape[1]), np.array(events, dtype=np.int64))


def _allowed(arr, cols, pcols, b, w):
    """Columns of input b's position a window-w recompute accepts: keep, or a window <= w."""
    return [j for j in pcols if cols[j][0] == "s"
            or (cols[j][0] == "o" and int(arr.eligible[b][cols[j][2]]) <= w)]


def _logic_rows(arr, positions, cols, state, win):
    """Rows (cols, coefs, lo, hi) for completeness and the input rule, both directions."""
    inf = np.inf
    pos_of = {int(a): p for p, units in enumerate(positions) for a in units}
    by_pos: dict[int, list[int]] = {}
    for j, (_, p, _) in enumerate(cols):
        by_pos.setdefault(p, []).append(j)
    rows = []
    # [Constraint] completeness: one of keep/demand/window per position (<= 1: intermediates)
    for p, js in by_pos.items():
        rows.append((js, [1.0] * len(js), 1.0 if arr.needed[positions[p][0]] else 0.0, 1.0))
    # [Constraint] inputs available: a recompute's inputs kept or recomputed no later
    for p, js in by_pos.items():
        a = int(positions[p][0])
        for b in arr.inputs[a]:
            q = pos_of.get(b)
            for j in js:
                kind, _, rho = cols[j]
                if kind == "s" or arr.must[b] or (q is None and state[b] == KEEP):
                    continue
                w = int(arr.eligible[a][rho]) if kind == "o" else -1
                if q is not None:
                    ok = by_pos.get(q, []) if kind == "r" else _allowed(arr, cols, by_pos.get(q, []), b, w)
                    rows.append(([j] + ok, [1.0] + [-1.0] * len(ok), -inf, 0.0))
                elif state[b] == NONE or (kind == "o" and not (state[b] == WINDOW and win[b] <= w)):
                    rows.append(([j], [1.0], -inf, 0.0))        # the fixed input forbids it
    # [Constraint] fixed recomputed consumers need their position inputs available
    for p, js in by_pos.items():
        for a in positions[p]:
            for c in arr.consumers[a]:
                if c in pos_of or state[c] not in (DEMAND, WINDOW):
                    continue
                ok = js if state[c] == DEMAND else _allowed(arr, cols, js, a, int(win[c]))
                rows.append((ok, [1.0] * len(ok), 1.0, inf))
    return rows


def _capacity_rows(arr, loads, state, win, n):
    """Window capacity rows, identical rows merged: (rows, overflow weights)."""
    fixed = arr.window_load(state, win) if arr.W else np.zeros(0)
    per_window: dict[int, list[int]] = {}
    for j, w in sorted(loads):
        per_window.setdefault(w, []).append(j)
    merged: dict[tuple, int] = {}
    for w, js in sorted(per_window.items()):
        key = (tuple(js), tuple(loads[j, w] for j in js), float(arr.win_tau[w] - fixed[w]))
        merged[key] = merged.get(key, 0) + 1
    rows, weights = [], []
    # [Constraint] window capacity: kappa * c of the units in w <= tau_w - fixed load + over_w
    for x, ((js, vs, tau), count) in enumerate(merged.items()):
        rows.append((list(js) + [n + x], list(vs) + [-1.0], -np.inf, tau))
        weights.append(count)
    return rows, weights


def _undominated(A: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Rows not dominated by a neighbour in a run of elementwise-monotone coefficient rows.

    Along a run where every coefficient only grows (A[t+1] >= A[t]), a row whose right-hand side
    is not smaller than a later row's in the run is implied by it; likewise backwards along runs
    where coefficients only shrink. A row is dropped only for a row that stays: equal rows
    (a run both grows and shrinks) keep one of them (dropping both let the MILP's plan exceed
    the budget by up to 1.5 % on traced GPTs, which the greedy repair then paid for)."""
    E = A.shape[0]
    keep = np.ones(E, dtype=bool)
    grow = np.all(A[1:] >= A[:-1], axis=1)
    shrink = np.all(A[1:] <= A[:-1], axis=1)
    best = np.inf
    for t in range(E - 1, -1, -1):
        if t == E - 1 or not grow[t]:
            best = np.inf
        keep[t] &= rhs[t] < best
        best = min(best, rhs[t])
    best = np.inf
    for t in range(E):
        if t == 0 or not shrink[t - 1]:
            best = np.inf
        if keep[t] and rhs[t] < best:
            best = rhs[t]          # only a row still kept may imply later ones (equal rows:
        else:                      # the first pass kept the last of them, not this one)
            keep[t] = False
    return keep


def _add_rows(h, rows) -> None:
    if not rows:
        return
    starts, idx, val = [], [], []
    for js, vs, _, _ in rows:
        starts.append(len(idx))
        idx += js
        val += vs
    big = 1e30
    h.addRows(len(rows), np.clip([r[2] for r in rows], -big, big), np.clip([r[3] for r in rows], -big, big),
              len(idx), np.array(starts, dtype=np.int32), np.array(idx, dtype=np.int32), np.array(val))


def solve_positions(arr: ProblemArrays, positions: list[np.ndarray], budget: int, state: np.ndarray,
                    win: np.ndarray, time_limit_s: float = 10.0):
    """(state, win, notes) with every position's decision replicated onto its units (the other
    units as given), or None when the MILP gives no answer. Solved to ``GAP`` or ``MAX_NODES``
    (both deterministic); ``time_limit_s`` is only a safety net (a note says when it hit). It was
    1 s, which a loaded 2-core machine reached: the same problem then planned differently
    (tests/test_solver_heuristic.py::test_deterministic, seen with two test processes running)."""
    import highspy

    cols = _columns(arr, positions)
    if not cols:
        return None
    n = len(cols)
    base = state.copy()
    for units in positions:
        base[units] = np.where(arr.must[units], KEEP, NONE)
    fw, bw = arr.profile(base, win)
    scale = float(max(arr.m.max(initial=1), 1))          # memory rows in units of the largest unit
    A, cost, kept, loads = _matrix(arr, positions, cols)
    chain, chain_events = _chain_matrix(arr, positions, cols, A)
    A = np.vstack([A, chain]) / scale
    rhs = (budget - np.concatenate([fw, bw, bw[chain_events]])) / scale
    maxlhs = np.zeros(A.shape[0])
    for p in sorted({c[1] for c in cols}):
        maxlhs += A[:, [j for j, c in enumerate(cols) if c[1] == p]].max(axis=1)
    cand = np.flatnonzero((maxlhs > rhs + 1e-12) & _undominated(A, rhs))   # rows that can bind
    cap_rows, weights = _capacity_rows(arr, loads, base, win, n)
    T = float(arr.c.sum()) or 1.0
    R = float(max(arr.reference, arr.m.sum(), 1))

    h = _quiet_highs(highspy)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", SOLVER_SEED)          # same plan in every process
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", GAP)
    h.setOptionValue("mip_max_nodes", MAX_NODES)
    h.setOptionValue("mip_allow_restart", False)         # restarts cost more than they saved here
    h.setOptionValue("mip_heuristic_effort", 0.0)        # same plans on the benchmarks, faster
    nw = len(weights)
    # x[j]: column j chosen (binary); over[k] >= 0: overflow seconds of merged window row k;
    # slack >= 0: budgets of memory over the budget (penalized, repaired afterwards)
    ncol = n + nw + 1
    h.addVars(ncol, np.zeros(ncol), np.concatenate([np.ones(n), np.full(nw + 1, highspy.kHighsInf)]))
    h.changeColsCost(ncol, np.arange(ncol, dtype=np.int32),
                     np.concatenate([cost / T + TIE_BREAK * kept / R, np.array(weights) / T, [PENALTY]]))
    _add_rows(h, _logic_rows(arr, positions, cols, base, win) + cap_rows)
    added: set[int] = set()

    def add_memory(events):
        # [Constraint] memory at event t: replicated live bytes - slack*budget <= budget - const
        rows = []
        for t in events:
            nz = np.flatnonzero(A[t])
            rows.append((nz.tolist() + [ncol - 1], A[t, nz].tolist() + [-budget / scale], -np.inf, float(rhs[t])))
            added.add(int(t))
        _add_rows(h, rows)

    def cut_loop(integral: bool):
        """Solve, add the most violated memory rows, repeat until none is violated."""
        for _ in range(30):
            h.run()
            if h.getInfo().primal_solution_status != 2:
                return None
            sol = np.asarray(h.getSolution().col_value)
            x = (sol[:n] > 0.5).astype(np.float64) if integral else sol[:n]
            viol = A[cand] @ x - rhs[cand] - sol[-1] * budget / scale
            worst = [int(cand[i]) for i in np.argsort(-viol, kind="stable")[:16]
                     if viol[i] > 1e-9 and int(cand[i]) not in added]
            if not worst:
                return x
            add_memory(worst)
        return x

    x = np.array([1.0 if c[0] == "s" else 0.0 for c in cols])
    add_memory(cand[np.argsort(-(A[cand] @ x - rhs[cand]), kind="stable")[:24]])
    if cut_loop(False) is None:                          # rows the LP relaxation needs: cheap
        return None
    h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), np.full(n, highspy.HighsVarType.kInteger))
    x = cut_loop(True)
    if x is None:
        return None
    hit = h.getModelStatus() == highspy.HighsModelStatus.kTimeLimit
    notes = [f"representative MILP stopped at its {time_limit_s:g} s safety limit"] if hit else []
    return (*_replicate(arr, positions, cols, x, state, win), notes)


def _quiet_highs(highspy):
    """``highspy.Highs()`` without its banner: HiGHS 1.16 writes "Running HiGHS ..." to the
    process's stdout (file descriptor 1, past Python's ``sys.stdout``) when constructed, before
    ``output_flag`` can be set; a user's training log got it once per process."""
    import os
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return h


def _replicate(arr, positions, cols, x, state, win):
    """Copy every position's decision onto each of its units."""
    state, win = state.copy(), win.copy()
    for units in positions:
        state[units] = np.where(arr.must[units], KEEP, NONE)
        win[units] = -1
    for j, (kind, p, rho) in enumerate(cols):
        if x[j] < 0.5:
            continue
        for a in positions[p]:
            if arr.must[a]:
                continue
            if kind == "s":
                state[a] = KEEP
            elif kind == "o" and arr.eligible[a].size > rho:
                state[a], win[a] = WINDOW, int(arr.eligible[a][rho])
            else:
                state[a] = DEMAND
    return state, win
