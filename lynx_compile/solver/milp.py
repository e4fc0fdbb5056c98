"""Lynx-OPT: the recompute MILP of ``problem.py`` in Pyomo, solved by HiGHS or GLPK.

Plain arrays in (``RematProblem``), ``RematSolution`` out; no torch, no graph. The model is the
one in ``problem.py``'s docstring, variable for variable; two exact reductions keep it small:

- memory rows: within a run of events where no free unit's interval ends, the live sets only
  grow, so an event is dominated by a later event of the run whose base bytes are at least as
  large (identical live sets included); the forward's kept tails only grow, so the forward is
  one run. With a budget, rows that cannot bind (base + every live unit at its largest term
  <= budget) are dropped too. ``build_model`` reports the counts.
- window variables: only the ``max_windows_per_unit`` eligible windows starting latest (closest
  before ``need_start``; earlier ones hold the tensor longer) get a variable (None: all).

Objective: (Σ c_a·r_a + Σ_w over_w + Σ e_a·f_a) / T + 1e-6 · (Σ kept bytes + 2 Σ offloaded
bytes) / R, with T the total recompute time (keeps the objective O(1) for the solvers' gap
tolerances), e_a an offload's exposed copy time and R the reference peak: the tie-break makes
solutions deterministic, prefers the plan keeping fewer bytes among plans whose exposed times
differ by less than 1e-6·T, and offloads only what the budget needs (an offload hidden behind
compute is free in the model, but still moves bytes over the host link). ``solve_milp`` reports the exact objective and
peak through ``evaluate``.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Iterable

import numpy as np
import pyomo.environ as pyo

from .evaluate import DEMAND, KEEP, NONE, OFFLOAD, WINDOW, ProblemArrays, evaluate_state, problem_arrays
from .milp_solvers import SOLVER_LOG, Outcome, pick_solver, require_solver, run_solver
from .problem import InfeasibleBudget, RematProblem, RematSolution, check_region_caps

TIE_BREAK = 1e-6
SMALLEST_TIME_LIMIT_S = 60.0


def _fixed_state(arr: ProblemArrays, units: Iterable[int] | None) -> tuple[np.ndarray, np.ndarray]:
    """(free mask, state of the fixed units): must_keep units (unless they may be offloaded) and
    units outside ``units`` are fixed kept, except intermediates nothing reads, which are fixed
    none."""
    free = ~arr.must | arr.can_off
    if units is not None:
        chosen = np.zeros(arr.n, dtype=bool)
        chosen[[arr.index[u] for u in units]] = True
        free &= chosen
    used = arr.needed | arr.must
    used[arr.edge_b] = True
    fixed = np.where(~free & used, KEEP, NONE).astype(np.int8)
    return free, fixed


def _kept_rows(const: np.ndarray, run_ends: np.ndarray) -> np.ndarray:
    """Events not dominated by a later event of their run (see the module docstring)."""
    keep = np.zeros(const.size, dtype=bool)
    best = -math.inf
    for t in range(const.size - 1, -1, -1):
        if run_ends[t]:
            best = -math.inf
        if const[t] > best:
            keep[t], best = True, const[t]
    return keep


def _rows(arr: ProblemArrays, free: np.ndarray, fixed: np.ndarray, budget: int | None):
    """(fw events, fw consts, bw events, bw consts, dropped count) of the memory rows."""
    fw_c, bw_c = arr.profile(fixed, np.full(arr.n, -1))
    mf = arr.m * free
    fw_ends = np.zeros(arr.F, dtype=bool)
    fw_ends[arr.off_fw_end[free & arr.can_off]] = True   # an offloaded unit's forward tail ends
    bw_ends = np.zeros(arr.B, dtype=bool)
    bw_ends[arr.ne[free]] = True
    fw_keep, bw_keep = _kept_rows(fw_c, fw_ends), _kept_rows(bw_c, bw_ends)
    if budget is not None:
        d = np.zeros(arr.F + 1, dtype=np.int64)
        np.add.at(d, arr.fw_last + 1, mf)
        fw_keep &= fw_c + np.cumsum(d)[:arr.F] > budget
        d = np.zeros(arr.B + 1, dtype=np.int64)
        np.add.at(d, arr.ne + 1, -mf)
        d[0] += mf.sum()
        bw_keep &= bw_c + np.cumsum(d)[:arr.B] > budget
    fe, be = np.flatnonzero(fw_keep), np.flatnonzero(bw_keep)
    return fe, fw_c[fe], be, bw_c[be], arr.F + arr.B - fe.size - be.size


def _chain_rows(arr: ProblemArrays, free: np.ndarray, events: set[int]) -> dict[int, list[list[int]]]:
    """Per memory-row event: the chain rows over free transient units (fixed units are never
    demanded), rows that are subsets of another row of the same event dropped."""
    out: dict[int, list[list[int]]] = {}
    for t, units in arr.chain_rows:
        if t not in events:
            continue
        row = [int(i) for i in units if free[i]]
        if row:
            out.setdefault(t, []).append(row)
    for t, rows in out.items():
        sets = [set(r) for r in rows]
        out[t] = [r for k, r in enumerate(rows)
                  if not any(k != j and sets[k] <= sets[j] and (sets[k] != sets[j] or j < k) for j in range(len(rows)))]
    return out


def build_model(problem: RematProblem, budget_bytes: int | None, *, units: Iterable[int] | None = None,
                max_windows_per_unit: int | None = 4, windows: bool = True) -> pyo.ConcreteModel:
    """The Pyomo model. ``budget_bytes=None`` builds the smallest-peak model instead: memory
    rows ``<= peak`` and objective ``peak`` (in bytes / ``model.scale``). ``windows=False``
    leaves out window variables. ``model.info`` holds sizes for logs; ``model.fw_events`` /
    ``model.bw_events`` the events that got a memory row."""
    arr = problem_arrays(problem)
    free, fixed = _fixed_state(arr, units)
    fe, fc, be, bc, dropped = _rows(arr, free, fixed, budget_bytes)
    F = np.flatnonzero(free).tolist()
    pairs = [(i, int(w)) for i in F if not arr.must[i] and not arr.hold[i]
             for w in (arr.eligible[i] if windows else ())[:max_windows_per_unit]]
    M = pyo.ConcreteModel("lynx_opt")
    M.scale = float(max(int(arr.m.max(initial=1)), 1))   # memory rows in units of the largest unit
    M.s = pyo.Var(F, domain=pyo.Binary)          # s[a] = 1: a is kept (saved by the forward)
    M.r = pyo.Var(F, domain=pyo.Binary)          # r[a] = 1: a is recomputed right before its use
    M.o = pyo.Var(pairs, domain=pyo.Binary)      # o[a, w] = 1: a is recomputed inside window w
    OFF = [i for i in F if arr.can_off[i]]
    M.f = pyo.Var(OFF, domain=pyo.Binary)        # f[a] = 1: a is saved in host memory (offload)
    for i in F:
        if arr.must[i] or arr.hold[i]:
            M.r[i].fix(0)                        # must be saved (kept or offloaded), or kept or dropped
    W = sorted({w for _, w in pairs})
    M.over = pyo.Var(W, domain=pyo.NonNegativeReals)   # over[w]: seconds window w overflows by
    by_unit: dict[int, list[int]] = {i: [] for i in F}
    for i, w in pairs:
        by_unit[i].append(w)

    def assigned(i):
        return M.s[i] + M.r[i] + sum(M.o[i, w] for w in by_unit[i]) + (M.f[i] if arr.can_off[i] else 0)

    # [Constraint] completeness: units read by the backward get exactly one of keep/demand/window
    M.complete = pyo.Constraint(F, rule=lambda _, i: assigned(i) == 1 if arr.needed[i] else assigned(i) <= 1)
    # [Constraint] inputs available: a recompute's inputs are kept or recomputed no later
    M.inputs = pyo.ConstraintList()
    for i in F:
        for b in arr.inputs[i]:
            if not free[b]:
                continue                             # fixed inputs are kept (_fixed_state)
            M.inputs.add(M.r[i] <= assigned(b))
            for w in by_unit[i]:
                M.inputs.add(M.o[i, w] <= M.s[b] + sum(M.o[b, v] for v in by_unit[b] if v <= w))
    # [Constraint] window capacity: kappa * hidden recompute <= tau_w + overflow
    in_window: dict[int, list[int]] = {w: [] for w in W}
    for i, w in pairs:
        in_window[w].append(i)
    M.capacity = pyo.Constraint(W, rule=lambda _, w: pyo.quicksum(
        arr.kappa * float(arr.c[i]) * M.o[i, w] for i in in_window[w]) <= float(arr.win_tau[w]) + M.over[w])
    # [Constraint] memory at the kept forward and backward events (bytes / scale)
    M.peak = pyo.Var(domain=pyo.NonNegativeReals) if budget_bytes is None else None
    limit = M.peak if budget_bytes is None else budget_bytes / M.scale
    M.memory = pyo.ConstraintList()
    mF = {i: float(arr.m[i]) / M.scale for i in F}
    Fa = np.asarray(F, dtype=np.int64)
    M.constant_over = False       # a row without free units over the budget: nothing can fit

    def memory_row(base, terms):
        if terms or budget_bytes is None:
            M.memory.add(base / M.scale + pyo.quicksum(terms) <= limit)
        else:
            M.constant_over |= base > budget_bytes
    Oa = np.asarray(OFF, dtype=np.int64)
    for t, base in zip(fe.tolist(), fc.tolist()):
        terms = [mF[i] * M.s[i] for i in Fa[arr.fw_last[Fa] < t].tolist()]
        terms += [mF[i] * M.f[i] for i in Oa[(arr.fw_last[Oa] < t) & (t <= arr.off_fw_end[Oa])].tolist()]
        memory_row(base, terms)
    chain_rows = _chain_rows(arr, free, set(be.tolist()))
    M.chain = pyo.Var(sorted(chain_rows), domain=pyo.NonNegativeReals)  # chain[t]: largest chain row at t
    M.chains = pyo.ConstraintList()
    for t, rows in sorted(chain_rows.items()):
        for row in rows:
            M.chains.add(M.chain[t] >= pyo.quicksum(mF[i] * M.r[i] for i in row))
    for t, base in zip(be.tolist(), bc.tolist()):
        terms = [M.chain[t]] if t in chain_rows else []
        for i in Fa[arr.ne[Fa] >= t].tolist():
            terms.append(mF[i] * M.s[i])
            if arr.ns[i] <= t and not arr.transient[i]:
                terms.append(mF[i] * M.r[i])
            terms += [mF[i] * M.o[i, w] for w in by_unit[i] if arr.win_start[w] <= t]
            if arr.can_off[i] and arr.off_bw_start[i] <= t:
                terms.append(mF[i] * M.f[i])
        memory_row(base, terms)
    # [Constraint] region caps: the units of a region with its own budget keep at most its bytes
    M.regions = pyo.ConstraintList()
    for units, most in zip(arr.region_units, arr.region_max.tolist()):
        kept_fixed = int(arr.m[units][(~free[units]) & (fixed[units] == KEEP)].sum())
        terms = [mF[i] * M.s[i] for i in units.tolist() if free[i]]
        if terms:
            M.regions.add(pyo.quicksum(terms) <= (most - kept_fixed) / M.scale)
        else:
            M.constant_over |= kept_fixed > most
    if budget_bytes is None:
        M.obj = pyo.Objective(expr=M.peak)
    else:
        T = float(arr.c[F].sum()) or 1.0
        R = float(max(arr.reference, int(arr.m.sum()), 1))
        M.obj = pyo.Objective(expr=(pyo.quicksum(float(arr.c[i] - arr.k[i]) * M.r[i] for i in F)
                                    - pyo.quicksum(float(arr.k[i]) * M.o[i, w] for i, w in pairs if arr.k[i])
                                    + pyo.quicksum(M.over[w] for w in W)
                                    + pyo.quicksum(float(arr.off_exposed[i]) * M.f[i] for i in OFF)) / T
                              + TIE_BREAK / R * (pyo.quicksum(float(arr.m[i]) * M.s[i] for i in F)
                                                 + pyo.quicksum(2.0 * float(arr.m[i]) * M.f[i] for i in OFF)))
    M.fixed_state, M.free, M.pairs = fixed, free, pairs
    M.fw_events, M.bw_events = fe, be
    M.info = (f"{2 * len(F) + len(pairs) + len(OFF)} binaries ({len(F)} units, {len(pairs)} window pairs, "
              f"{len(OFF)} offloadable), "
              f"{len(W)} overflow vars, {fe.size + be.size} memory rows ({dropped} events dropped)")
    return M


def extract_state(M: pyo.ConcreteModel, arr: ProblemArrays) -> tuple[np.ndarray, np.ndarray]:
    """(state, win) of a solved model (fixed units as fixed)."""
    state, win = M.fixed_state.copy(), np.full(arr.n, -1, dtype=np.int64)
    for i in M.s:
        if (M.s[i].value or 0) > 0.5:
            state[i] = KEEP
        elif (M.r[i].value or 0) > 0.5:
            state[i] = DEMAND
        elif i in M.f and (M.f[i].value or 0) > 0.5:
            state[i] = OFFLOAD
    for i, w in M.pairs:
        if (M.o[i, w].value or 0) > 0.5:
            state[i], win[i] = WINDOW, w
    return state, win


def solve_milp(problem: RematProblem, budget_bytes: int, *, solver: str = "highs",
               time_limit_s: float = 60.0, mip_gap: float = 1e-4,
               progress: Callable[[str], None] | None = None, units: Iterable[int] | None = None,
               max_windows_per_unit: int | None = 4) -> RematSolution:
    """Lynx-OPT: the minimum-exposed-time assignment under ``budget_bytes``.

    ``solver``: "highs" (Pyomo's HiGHS interface, needs highspy), "glpk" (glpsol) or "auto".
    ``time_limit_s``/``mip_gap`` go to the solver (glpsol takes whole seconds); ``progress``
    gets the solver's log lines and an end line (the model's size: the solver's log at DEBUG).
    ``units``: only these unit ids are decided; the others are kept (intermediates nothing reads:
    none). ``max_windows_per_unit``: window variables per unit (latest eligible first; None: all). Returns status "optimal", or "feasible" with a note when the time limit stopped the
    solver with an incumbent. Raises ``InfeasibleBudget`` (with ``smallest_peak``) when no
    assignment fits, RuntimeError when the solver is missing (the message has the install
    command), fails, or stops without any incumbent.
    """
    t0 = time.perf_counter()
    choice = pick_solver(solver)
    if choice.name == "heu":
        raise RuntimeError(f"Lynx-OPT needs a MILP solver: {choice.reason}")
    name = choice.name
    require_solver(name)
    check_region_caps(problem)
    arr = problem_arrays(problem)
    M = build_model(problem, budget_bytes, units=units, max_windows_per_unit=max_windows_per_unit)
    # the model's size is the solver's detail (``verbose``); ``progress`` gets its log and result
    SOLVER_LOG.debug("lynx-opt[%s]: %s; built in %.2f s", name, M.info, time.perf_counter() - t0)
    if M.constant_over:
        outcome = Outcome("infeasible")
    elif not len(M.s):            # nothing to decide: the fixed plan is the answer
        outcome = Outcome("optimal", 0.0)
    else:
        outcome = run_solver(M, name, time_limit_s, mip_gap, progress)
    if outcome.status == "infeasible":
        smallest = smallest_peak(problem) if units is None else _smallest(problem, units, name)
        if smallest <= budget_bytes:
            raise RuntimeError(f"{name} reported the budget infeasible, but a plan with peak "
                               f"{smallest} B <= {budget_bytes} B exists (numerical trouble)")
        raise InfeasibleBudget(budget_bytes, smallest, problem.reference_peak)
    state, win = extract_state(M, arr)
    # what no recompute reads and the backward does not (a held unit whose readers stay saved)
    # is dropped: keeping it is free in the objective only up to the MIP gap
    from .heuristic import cleanup
    cleanup(arr, state, win)
    ev = evaluate_state(arr, state, win)
    notes = list(outcome.notes)
    if ev.peak_bytes > budget_bytes:
        notes.append(f"peak {ev.peak_bytes} B exceeds the budget by {ev.peak_bytes - budget_bytes} B "
                     "(solver tolerance)")
    if ev.violations:
        raise RuntimeError(f"{name} returned an assignment breaking the model: {ev.violations[:3]}")
    keep, demand, window = arr.to_sets(state, win)
    solve_s = time.perf_counter() - t0
    if progress:
        progress(f"lynx-opt[{name}]: {outcome.status} in {solve_s:.2f} s, exposed "
                 f"{ev.exposed_s * 1e3:.3f} ms, peak {ev.peak_bytes} B")
    return RematSolution(keep=keep, demand=demand, window=window, offload=arr.offloaded(state),
                         offload_exposed_s=float(arr.off_exposed[state == OFFLOAD].sum()),
                         exposed_s=ev.exposed_s,
                         recompute_s=ev.recompute_s, peak_bytes=ev.peak_bytes, solver=f"opt-{name}",
                         status=outcome.status, solve_s=solve_s, gap=outcome.gap, notes=tuple(notes))


def _smallest(problem: RematProblem, units: Iterable[int] | None, solver: str | None) -> int:
    """Minimum peak over assignments (``units`` free, the rest fixed as in ``solve_milp``).

    Exact by a MILP without window variables: windows never help memory (moving every window
    recompute to demand shrinks each live interval to [need_start, need_end] and keeps the input
    rule), and time is not optimized. Past ``SMALLEST_TIME_LIMIT_S`` the solver's incumbent is
    used: a reachable peak, so possibly above the minimum. Falls back to the heuristic's bound
    when no MILP solver is installed."""
    try:
        name = pick_solver(solver or "auto").name
        require_solver(name)
    except RuntimeError:
        name = "heu"
    if name == "heu":
        from .heuristic import heuristic_bound
        return heuristic_bound(problem)
    check_region_caps(problem)
    M = build_model(problem, None, units=units, windows=False)
    arr = problem_arrays(problem)
    if not len(M.s):
        return evaluate_state(arr, M.fixed_state, np.full(arr.n, -1)).peak_bytes
    out = run_solver(M, name, SMALLEST_TIME_LIMIT_S, 0.0, None)
    if out.status == "infeasible":
        raise RuntimeError(f"smallest-peak MILP reported infeasible with {name} (a bug: it has no budget)")
    return evaluate_state(arr, *extract_state(M, arr)).peak_bytes


def smallest_peak(problem: RematProblem, solver: str | None = None) -> int:
    """The smallest peak any assignment reaches (exact MILP, see ``_smallest``); cached per problem."""
    cache = problem_arrays(problem).cache
    if "smallest_peak" not in cache:
        cache["smallest_peak"] = _smallest(problem, None, solver)
    return cache["smallest_peak"]
