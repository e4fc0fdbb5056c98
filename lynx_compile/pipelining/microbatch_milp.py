"""The MILP behind ``plan_microbatches``: a variant per (stage, micro-batch), least step first.

The ranks' actions and their order are fixed (torch's, ``placement.zero_bubble_orders``), so
everything is linear in the choice, with no big-M (``build_model``):

- x[s, j, v] binary, sum_v x[s, j, v] = 1; an action's duration is sum_v x[s, j, v] x its seconds;
- e[a] >= 0, when action a ends: e[a] - d[a] >= e[previous action on its rank] (0 for the
  first) and >= e[the action it waits for] + the send between two ranks;
- T >= the last e of every rank; per rank, the memory walk's points within its limit;
- minimize T; then, T capped at the replayed step of that choice, the least total work (a
  recompute that lands in a bubble ties on T: only the needed ones are kept).

The least e's meeting these rows are the replay's end times, so min T is the least step.
``replay`` is the exact reference for one choice (``schedule_sim``'s replay loop and the memory
walk, ``microbatch_replay``); the MILP's numbers are never reported, ``replay``'s are. Without
a MILP solver ``microbatch_plan``'s greedy finds a fitting choice, no optimality claimed.

``smallest_choice`` finds the lowest peak each rank can reach (a memory-only MILP, or exactly
when every stage has a variant smallest in both held and carry bytes): what an infeasible
limit's error names.
"""
from __future__ import annotations

import time
from typing import Sequence

from .microbatch_replay import Choice, StageVariant, replay, walk_points
from .schedule_sim import Action

TOLERANCE_RETRIES = 3
"""Solves again when the solver's tolerance let a choice a few bytes over a rank's limit, that
rank's memory rows tightened by the overshoot, and at least 1e-7, 1e-6, 1e-5 of the limit (a
choice that close below the limit may then be given up; HiGHS's tolerances are about 1e-9 to
1e-6 of a row near 1)."""
SMALLEST_TIME_LIMIT_S = 30.0
"""Time limit of the memory-only MILP behind ``smallest_peaks``."""


def _memory_rows(order: Sequence[Action]):
    """The walk's points of one rank minus those another point covers (its alive sets inside the
    other's): with bytes >= 0 they can never be the peak."""
    pts = list(dict.fromkeys((frozenset(h), frozenset(c), frozenset(f)) for h, c, f in walk_points(order)))
    # a fresh part is at most its carry: a point whose fresh pair the other carries is covered too
    return [(h, c, f) for i, (h, c, f) in enumerate(pts)
            if not any(i != k and h <= h2 and c <= c2 and f <= f2 | c2 for k, (h2, c2, f2) in enumerate(pts))]


def _input_of(action: Action, p: int) -> Action | None:
    """The action whose output ``action`` waits for (as ``replay_actions``)."""
    kind, s, j = action
    if kind == "F":
        return ("F", s - 1, j) if s > 0 else None
    if kind == "B":
        return ("F", s, j) if s == p - 1 else ("B", s + 1, j)
    return ("B", s, j)


def _alive(M, variants, point, unit: float):
    """Bytes alive at one point of the walk over ``unit``, linear in ``M.x``."""
    held, carry, fresh = point
    return sum(var.held_bytes / unit * M.x[s, j, v] for s, j in held for v, var in enumerate(variants[s])) + \
        sum(var.carry_bytes / unit * M.x[s, j, v] for s, j in carry for v, var in enumerate(variants[s])) + \
        sum(var.fresh / unit * M.x[s, j, v] for s, j in fresh for v, var in enumerate(variants[s]))


def build_model(orders: Sequence[Sequence[Action]], variants: Sequence[Sequence[StageVariant]],
                send_s: Sequence[float], memory_limit: Sequence[int] | None, time_unit_s: float):
    """The Pyomo MILP: minimize the step ``T`` (in ``time_unit_s``) over a variant per
    (stage, micro-batch), under the memory walk's rows per rank (None: no rows), each over its
    rank's limit, at most ``M.mem_rhs[r]`` (mutable: ``solve_milp`` tightens it)."""
    import pyomo.environ as pyo

    p = len(variants)
    rank_of = {s: r for r, order in enumerate(orders) for _, s, _ in order}
    mbs = sorted({j for order in orders for _, _, j in order})
    M = pyo.ConcreteModel()
    # x[s, j, v] = 1: micro-batch j of stage s runs variant v
    M.x = pyo.Var([(s, j, v) for s in range(p) for j in mbs for v in range(len(variants[s]))], domain=pyo.Binary)
    # e[a]: when action a ends, in time units
    M.e = pyo.Var([a for order in orders for a in order], domain=pyo.NonNegativeReals)
    # T: the step (the last end over all ranks)
    M.T = pyo.Var(domain=pyo.NonNegativeReals)

    def dur(a: Action):
        kind, s, j = a
        return sum(var.seconds(kind) / time_unit_s * M.x[s, j, v] for v, var in enumerate(variants[s]))

    def start(a: Action):
        return M.e[a] - dur(a)

    M.rows = pyo.ConstraintList()
    # [Constraint] one variant per (stage, micro-batch)
    for s in range(p):
        for j in mbs:
            M.rows.add(sum(M.x[s, j, v] for v in range(len(variants[s]))) == 1)
    for order in orders:
        # [Constraint] a rank runs its actions one at a time, in its order (the first from 0)
        for k, a in enumerate(order):
            M.rows.add(start(a) >= (M.e[order[k - 1]] if k else 0.0))
        # [Constraint] the step ends after every rank's last action
        if order:
            M.rows.add(M.T >= M.e[order[-1]])
    # [Constraint] an action starts after its input's action, plus the send between two ranks
    for order in orders:
        for a in order:
            src = _input_of(a, p)
            if src is not None:
                send = 0.0 if rank_of[src[1]] == rank_of[a[1]] else send_s[min(src[1], a[1])] / time_unit_s
                M.rows.add(start(a) >= M.e[src] + send)
    # [Constraint] memory: every point of each rank's walk within its limit. Over the limit, so
    # that a row is near 1: HiGHS's absolute tolerances (1e-9 for a MIP) then stay above the
    # rounding of its sums (rows in bytes or KiB of tens of GiB gave "Solve error"); plus half a
    # byte, so that a peak equal to the limit is never cut off by rounding. A choice that the
    # tolerance lets a few bytes over is caught by ``replay`` and tightened by ``solve_milp``.
    ranks = range(len(orders)) if memory_limit is not None else range(0)
    M.mem_rhs = pyo.Param(ranks, mutable=True, initialize={r: 1.0 + 0.5 / max(1, memory_limit[r]) for r in ranks})
    for r in ranks:
        for point in _memory_rows(orders[r]):
            M.rows.add(_alive(M, variants, point, max(1, memory_limit[r])) <= M.mem_rhs[r])
    M.step = pyo.Objective(expr=M.T, sense=pyo.minimize)
    M.work = pyo.Expression(expr=sum(var.work_s / time_unit_s * M.x[s, j, v]
                                     for s in range(p) for j in mbs for v, var in enumerate(variants[s])))
    M.info = f"{len(M.x)} binaries, {len(M.e)} end times, {len(M.rows)} rows"
    return M


def _read_choice(M, variants, num_mb: int) -> Choice:
    return tuple(tuple(max(range(len(variants[s])), key=lambda v: M.x[s, j, v].value or 0.0) for j in range(num_mb))
                 for s in range(len(variants)))


def solve_milp(orders, variants, send_s, memory_limit, name, time_limit_s, mip_gap, progress, t0):
    """(choice, outcome, notes) from two solves sharing ``time_limit_s``: the least step, then,
    with the step capped at that choice's replayed step, the least total work, so that nothing
    is recomputed that does not help (a second recompute in a bubble ties the first on the
    step). The outcome (status, gap) is the first solve's: it is about the step."""
    import pyomo.environ as pyo

    from lynx_compile.solver.milp_solvers import run_solver

    m = len({j for o in orders for _, _, j in o})
    unit = max((sum(min(v.seconds(k) for v in variants[s]) for k, s, _ in order) for order in orders), default=0.0)
    unit = unit or 1.0   # T near 1: the solver's absolute gap 1e-7 is then relative
    M = build_model(orders, variants, send_s, memory_limit, unit)
    if progress:
        progress(f"lynx-microbatch[{name}]: {M.info}; built in {time.perf_counter() - t0:.2f} s")
    t_solve = time.perf_counter()
    for attempt in range(TOLERANCE_RETRIES + 1):
        out = run_solver(M, name, time_limit_s, mip_gap, progress)
        if out.status == "infeasible":
            return None, out, ()
        choice = _read_choice(M, variants, m)
        step, peaks = replay(orders, variants, choice, send_s)
        over = {r: p - memory_limit[r] for r, p in enumerate(peaks) if p > memory_limit[r]}
        if not over:
            break
        for r, extra in over.items():   # within the solver's tolerance: cut it off, solve again
            cut = max((extra + 0.5) / max(1, memory_limit[r]), 1e-7 * 10**attempt)
            M.mem_rhs[r] = M.mem_rhs[r].value - cut
    else:
        raise RuntimeError(f"{name}'s choices stayed over the memory limit by a tolerance after "
                           f"{TOLERANCE_RETRIES} tightenings (peaks {peaks} B, limit {tuple(memory_limit)} B)")
    left = time_limit_s - (time.perf_counter() - t_solve)
    if sum(variants[s][v].work_s - min(x.work_s for x in variants[s]) for s, row in enumerate(choice) for v in row) \
            <= 1e-12 * unit:
        return choice, out, ()   # no micro-batch does more work than it must
    if left < 0.1:
        return choice, out, ("no time left for the least-work pass: a micro-batch may recompute for nothing",)
    if progress:
        progress(f"lynx-microbatch[{name}]: least step {step:.6g} s ({out.status}); now the least work "
                 f"at that step ({left:.1f} s left)")
    M.step.deactivate()
    M.cap = pyo.Constraint(expr=M.T <= step / unit * (1 + 1e-9))
    M.least_work = pyo.Objective(expr=M.work, sense=pyo.minimize)
    try:
        second_out = run_solver(M, name, left, mip_gap, None)
    except RuntimeError as e:
        return choice, out, (f"the least-work pass found nothing ({e}): a micro-batch may recompute for nothing",)
    second = _read_choice(M, variants, m) if second_out.status != "infeasible" else choice
    if replay(orders, variants, second, send_s)[0] > step:   # the cap's tolerance let a slower one in
        second = choice
    notes = () if second_out.status == "optimal" else \
        (f"the least-work pass stopped ({second_out.status}): a micro-batch may recompute for nothing",)
    return second, out, notes


def smallest_choice(orders, variants, solver: str) -> tuple[Choice | None, tuple[int, ...] | None, str]:
    """(choice, its peaks, how found) reaching the lowest peak on every rank at once (a stage's
    bytes count on its own rank only, so the ranks are independent). Exact when every stage has
    a variant with both the least held and the least carry bytes (all on it); else a
    memory-only MILP (its incumbent if its time limit stops it); (None, None, why) without one."""
    from lynx_compile.solver.milp_solvers import pick_solver, run_solver

    m = len({j for o in orders for _, _, j in o})
    least = []
    for vs in variants:
        both = [v for v, var in enumerate(vs) if var.held_bytes == min(x.held_bytes for x in vs)
                and var.carry_bytes == min(x.carry_bytes for x in vs)]
        least.append(both[0] if both else None)
    if all(v is not None for v in least):
        choice = tuple((v,) * m for v in least)
        return choice, replay(orders, variants, choice, [0.0] * len(variants))[1], "every stage on its smallest variant"
    name = pick_solver(solver).name
    if name == "heu":
        return None, None, "no MILP solver to find the smallest"
    import pyomo.environ as pyo

    M = build_model(orders, variants, [0.0] * len(variants), None, 1.0)
    M.step.deactivate()
    # rows over a bound of the rank's peak, so that they are near 1 (as build_model's)
    largest = [max(x.held_bytes + x.carry_bytes for x in vs) for vs in variants]
    units = [max([1] + [sum(largest[s] for s, _ in h + c + f) for h, c, f in walk_points(order)]) for order in orders]
    M.P = pyo.Var(range(len(orders)), domain=pyo.NonNegativeReals)  # per rank, its peak over units[r]
    # [Constraint] a rank's peak is at least what any point of its walk holds
    M.peak_rows = pyo.ConstraintList()
    for r, order in enumerate(orders):
        for point in _memory_rows(order):
            M.peak_rows.add(M.P[r] >= _alive(M, variants, point, units[r]))
    M.least_peak = pyo.Objective(expr=sum(M.P.values()), sense=pyo.minimize)
    out = run_solver(M, name, SMALLEST_TIME_LIMIT_S, 0.0, None)
    choice = _read_choice(M, variants, m)
    how = "a memory-only MILP" + ("" if out.status == "optimal" else f" ({out.status}: maybe above the least)")
    return choice, replay(orders, variants, choice, [0.0] * len(variants))[1], how


def smallest_peaks(orders: Sequence[Sequence[Action]], variants: Sequence[Sequence[StageVariant]],
                   solver: str = "auto") -> tuple[tuple[int, ...] | None, str]:
    """The lowest peak each rank can reach (all at once), and how it was found (``smallest_choice``);
    None without a MILP solver when no stage variant is smallest in both held and carry bytes."""
    _, peaks, how = smallest_choice(orders, variants, solver)
    return peaks, how
