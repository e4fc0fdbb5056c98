"""A recompute variant per (stage, micro-batch) under a zero-bubble schedule (ELF / HAL's choice).

Each stage has a few *variants*: recompute plans of the same stage that trade time for memory,
e.g. ``keep`` (nothing recomputed) and ``recompute-w`` (activations only W reads are dropped
after F and recomputed inside W: W is longer, a micro-batch holds less between F and W). A
stage's micro-batches need not all run the same one. Under a zero-bubble schedule W never
waits for another rank, so W's recompute is free where it lands in a bubble; and only the
micro-batches alive at a rank's memory peak need to shrink. ``plan_microbatches`` picks a
variant per (stage, micro-batch) minimizing the step under a per-rank memory limit::

    ZBV, 2 ranks, 4 micro-batches, rank 0 at its limit (tests/test_microbatch_plan.py):
    stage 0  keep: mb 1 3    recompute-w: mb 0 2      W00, W02 sit before waits for B11, B13

The ranks' actions and their order are fixed (torch's, ``placement.zero_bubble_orders``), so
everything is linear in the choice, with no big-M (``build_model``):

- x[s, j, v] binary, sum_v x[s, j, v] = 1; an action's duration is sum_v x[s, j, v] x its seconds;
- e[a] >= 0, when action a ends: e[a] - d[a] >= e[previous action on its rank] (0 for the
  first) and >= e[the action it waits for] + the send between two ranks;
- T >= the last e of every rank; per rank, the walk's points (below) within its limit;
- minimize T; then, T capped at the replayed step of that choice, the least total work (a
  recompute that lands in a bubble ties on T: only the needed ones are kept).

The least e's meeting these rows are the replay's end times, so min T is the least step.
``replay`` is the exact reference for one choice (``schedule_sim``'s replay loop and the memory
walk below); the MILP's numbers are never reported, ``replay``'s are. Without a MILP solver a
greedy (``_greedy``) finds a fitting choice, no optimality claimed.

Memory walk of one rank (``replay`` and the MILP's rows both come from ``_walk_points``): walk
its actions in order, starting from nothing alive.

- F(s, j): the micro-batch's held bytes become alive; a point is taken after it.
- B(s, j): its carry is created while its held bytes are still alive (B reads the saved
  activations and writes W's carry): a point is taken with its held bytes and the part of its
  carry B creates (``StageVariant.fresh``; the rest of the carry is held bytes W reads), then
  the held bytes W does not read die.
- W(s, j): its carry dies (no point: memory only falls).

The rank's peak is the largest sum of held, carry and fresh bytes alive at a point. Per stage,
with one variant, the pairs ``schedule_sim.held_microbatches`` returns are the counts (f, w)
just *after* each action; the B point here is that pair with the micro-batch B runs still held
and only its fresh part carried, so a stage's peak is ``max(f x held + w x carry)`` over the
after-F pairs and ``max((f + 1) x held + (w - 1) x carry + fresh)`` over the after-B ones. A
rank sums its stages point by point (not their separate maxima). It is an upper bound: B frees
held bytes as it goes. Measured on 2 gloo ranks (gpt-small, 8 layers, batch 8 in 4, ZBV,
nothing recomputed), the walk plus the bytes the limit reserves (``StageVariants.reserved_bytes``)
is 15% (rank 0) and 19% (rank 1) above the allocator's peak; counting the whole carry at B, as
before, it was 28% and 26% above.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .schedule_sim import Action, replay_actions

MiB = 2**20
TOLERANCE_RETRIES = 3
"""Solves again when the solver's tolerance let a choice a few bytes over a rank's limit, that
rank's memory rows tightened by the overshoot, and at least 1e-7, 1e-6, 1e-5 of the limit (a
choice that close below the limit may then be given up; HiGHS's tolerances are about 1e-9 to
1e-6 of a row near 1)."""
SMALLEST_TIME_LIMIT_S = 30.0
"""Time limit of the memory-only MILP behind ``smallest_peaks``."""
Choice = tuple[tuple[int, ...], ...]
"""``choice[stage][microbatch]``: the index of the variant that micro-batch of that stage runs."""


@dataclass(frozen=True, kw_only=True)
class StageVariant:
    """One recompute plan of a stage, priced per micro-batch."""

    name: str
    """What it recomputes, e.g. ``"keep"``, ``"recompute-w"``."""
    forward_s: float
    input_backward_s: float
    """B, with the recompute B runs."""
    weight_backward_s: float
    """W, with the recompute W runs."""
    held_bytes: int
    """What one micro-batch holds between its F and its B."""
    carry_bytes: int
    """What it holds between its B and its W."""
    fresh_bytes: int | None = None
    """Of ``carry_bytes``, what its B creates while its held bytes are still alive (output
    gradients W reads; the rest of the carry is held bytes W reads); None: all of it."""

    @property
    def fresh(self) -> int:
        return self.carry_bytes if self.fresh_bytes is None else min(self.fresh_bytes, self.carry_bytes)

    def seconds(self, kind: str) -> float:
        return {"F": self.forward_s, "B": self.input_backward_s, "W": self.weight_backward_s}[kind]

    @property
    def work_s(self) -> float:
        return self.forward_s + self.input_backward_s + self.weight_backward_s


@dataclass(frozen=True, kw_only=True)
class MicrobatchPlan:
    """The chosen variant per (stage, micro-batch) and what ``replay`` says of it."""

    choice: Choice
    step_s: float
    """The replayed step time of ``choice`` (not the MILP's objective value)."""
    peak_bytes: tuple[int, ...]
    """Per rank, from the memory walk of ``choice``."""
    status: str
    """"optimal", or "feasible" (time limit or gap, or the greedy: no optimality claimed)."""
    gap: float | None
    """The MILP's relative gap on the step; None when unknown (GLPK, the greedy)."""
    solve_s: float
    solver: str = "highs"
    """"highs", "glpk" or "heu" (the greedy)."""
    notes: tuple[str, ...] = ()

    def table(self, variants: Sequence[Sequence[StageVariant]]) -> str:
        """Step, peaks, and one line per stage: which micro-batches run which variant."""
        peaks = ", ".join(f"{b / MiB:.2f} MiB" if b >= MiB else f"{b} B" for b in self.peak_bytes)
        gap = "" if self.gap is None else f", gap {self.gap:.2g}"
        lines = [f"step {self.step_s * 1e3:.3f} ms, peak per rank [{peaks}] ({self.solver}, "
                 f"{self.status}{gap}, {self.solve_s:.2f} s)"]
        for s, row in enumerate(self.choice):
            parts = []
            for v, var in enumerate(variants[s]):
                mbs = [j for j, c in enumerate(row) if c == v]
                if mbs:
                    parts.append(f"{var.name}: mb {' '.join(map(str, mbs))}")
            lines.append(f"stage {s}  " + "    ".join(parts))
        return "\n".join(lines + list(self.notes))


class MicrobatchPlanError(ValueError):
    """No choice fits the memory limit: ``smallest`` is the lowest peak reachable per rank
    (None when unknown: the greedy found no choice and no MILP solver can say more)."""

    def __init__(self, smallest: Sequence[int] | None, limit: Sequence[int], how: str):
        self.smallest = None if smallest is None else tuple(smallest)
        self.limit = tuple(limit)
        if smallest is None:
            msg = f"no recompute choice per micro-batch found within the memory limit {self.limit} B ({how})"
        else:
            over = [f"rank {r}: smallest reachable peak {p} B > limit {m} B"
                    for r, (p, m) in enumerate(zip(smallest, limit)) if p > m]
            msg = f"no recompute choice per micro-batch fits the memory limit ({'; '.join(over)}; {how})"
        super().__init__(msg)


# ---------------------------------------------------------------- the exact reference: replay


Pairs = tuple[tuple[int, int], ...]


def _walk_points(order: Sequence[Action]) -> list[tuple[Pairs, Pairs, Pairs]]:
    """The memory walk's points of one rank (module docstring): per point, the (stage,
    micro-batch) pairs whose held bytes, whose carry bytes and whose fresh bytes (the one in B)
    are alive there."""
    held: dict[tuple[int, int], None] = {}   # ordered sets
    carry: dict[tuple[int, int], None] = {}
    points = []
    for kind, s, j in order:
        if kind == "F":
            held[s, j] = None
            points.append((tuple(held), tuple(carry), ()))
        elif kind == "B":
            points.append((tuple(held), tuple(carry), ((s, j),)))
            carry[s, j] = None
            del held[s, j]
        else:
            del carry[s, j]
    return points


def _peak(points, variants: Sequence[Sequence[StageVariant]], choice: Choice) -> int:
    def at(point) -> int:
        held, carry, fresh = point
        return (sum(variants[s][choice[s][j]].held_bytes for s, j in held)
                + sum(variants[s][choice[s][j]].carry_bytes for s, j in carry)
                + sum(variants[s][choice[s][j]].fresh for s, j in fresh))
    return max((at(pt) for pt in points), default=0)


def replay(orders: Sequence[Sequence[Action]], variants: Sequence[Sequence[StageVariant]], choice: Choice,
           send_s: Sequence[float]) -> tuple[float, tuple[int, ...]]:
    """Step seconds and per-rank peak bytes of ``choice`` (the exact reference): micro-batch j of
    stage s takes the F, B and W seconds of ``variants[s][choice[s][j]]`` under
    ``schedule_sim.replay_actions``' rules (``send_s[s]``: the transfer between stage s and s + 1
    on different ranks); peaks from the memory walk (module docstring)."""
    def seconds(action: Action) -> float:
        kind, s, j = action
        return variants[s][choice[s][j]].seconds(kind)

    step = replay_actions(orders, len(variants), seconds, send_s).step_s
    return step, tuple(_peak(_walk_points(order), variants, choice) for order in orders)


# ---------------------------------------------------------------- the MILP


def _memory_rows(order: Sequence[Action]):
    """The walk's points of one rank minus those another point covers (its alive sets inside the
    other's): with bytes >= 0 they can never be the peak."""
    pts = list(dict.fromkeys((frozenset(h), frozenset(c), frozenset(f)) for h, c, f in _walk_points(order)))
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
    rank's limit, at most ``M.mem_rhs[r]`` (mutable: ``_solve_milp`` tightens it)."""
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
    # tolerance lets a few bytes over is caught by ``replay`` and tightened by ``_solve_milp``.
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


def _solve_milp(orders, variants, send_s, memory_limit, name, time_limit_s, mip_gap, progress, t0):
    """(choice, outcome, notes) from two solves sharing ``time_limit_s``: the least step, then,
    with the step capped at that choice's replayed step, the least total work, so that nothing
    is recomputed that does not help (a second recompute in a bubble ties the first on the
    step). The outcome (status, gap) is the first solve's: it is about the step."""
    import pyomo.environ as pyo

    from lynx_compile.remat.milp_solvers import run_solver

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


# ---------------------------------------------------------------- no MILP: the greedy


def _overflow(points, variants, choice: Choice, limit: int) -> int:
    """Bytes over ``limit`` summed over the walk's points: zero iff the rank fits."""
    return sum(max(0, _peak([pt], variants, choice) - limit) for pt in points)


def _greedy(orders, variants, send_s, memory_limit, m: int) -> Choice | None:
    """Lynx-HEU's counterpart, no optimality claimed: every micro-batch on its least-work
    variant; while a rank is over its limit, make the one switch (stage, micro-batch -> variant),
    among the micro-batches alive at a point over the limit, that lowers the rank's overflow
    (bytes over the limit summed over its walk's points; the peak alone stalls on ties) most per
    second of replayed step added, switches that add none first. Every switch lowers one rank's
    overflow and no other rank's bytes, so it ends. None when no switch helps: then no choice
    fits if every stage has a variant with the least held and the least carry bytes (the point
    over the limit already holds the least it can); otherwise one might."""
    choice = [[min(range(len(vs)), key=lambda v: vs[v].work_s)] * m for vs in variants]
    walks = [_walk_points(order) for order in orders]
    frozen = lambda: tuple(map(tuple, choice))  # noqa: E731
    step = replay(orders, variants, frozen(), send_s)[0]
    while True:
        over = [r for r in range(len(orders)) if _overflow(walks[r], variants, frozen(), memory_limit[r])]
        if not over:
            return frozen()
        r = over[0]
        now = _overflow(walks[r], variants, frozen(), memory_limit[r])
        alive = sorted({sj for pt in walks[r] if _peak([pt], variants, frozen()) > memory_limit[r]
                        for part in pt for sj in part})
        best, best_key = None, None
        for s, j in alive:
            for v in range(len(variants[s])):
                old, choice[s][j] = choice[s][j], v
                gain = now - _overflow(walks[r], variants, frozen(), memory_limit[r])
                if v != old and gain > 0:
                    dt = replay(orders, variants, frozen(), send_s)[0] - step
                    key = (dt <= 0, gain if dt <= 0 else gain / dt)
                    if best_key is None or key > best_key:
                        best, best_key = (s, j, v, dt), key
                choice[s][j] = old
        if best is None:
            return None
        s, j, v, dt = best
        choice[s][j], step = v, step + dt


def _smallest(orders, variants, solver: str) -> tuple[Choice | None, tuple[int, ...] | None, str]:
    """(choice, its peaks, how found) reaching the lowest peak on every rank at once (a stage's
    bytes count on its own rank only, so the ranks are independent). Exact when every stage has
    a variant with both the least held and the least carry bytes (all on it); else a
    memory-only MILP (its incumbent if its time limit stops it); (None, None, why) without one."""
    from lynx_compile.remat.milp_solvers import pick_solver, run_solver

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
    units = [max([1] + [sum(largest[s] for s, _ in h + c + f) for h, c, f in _walk_points(order)]) for order in orders]
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
    """The lowest peak each rank can reach (all at once), and how it was found (``_smallest``);
    None without a MILP solver when no stage variant is smallest in both held and carry bytes."""
    _, peaks, how = _smallest(orders, variants, solver)
    return peaks, how


# ---------------------------------------------------------------- the entry point


def _check(orders, variants, send_s, memory_limit) -> int:
    """The number of micro-batches; ValueError on a malformed problem (``replay_actions``
    checks the orders and that they run without a deadlock)."""
    if not variants or any(not vs for vs in variants):
        raise ValueError("every stage needs at least one StageVariant")
    for s, vs in enumerate(variants):
        for var in vs:
            if min(var.forward_s, var.input_backward_s, var.weight_backward_s) < 0 or \
                    min(var.held_bytes, var.carry_bytes) < 0:
                raise ValueError(f"stage {s} variant {var.name!r}: seconds and bytes must be >= 0")
    if len(memory_limit) != len(orders):
        raise ValueError(f"memory_limit has {len(memory_limit)} entries for {len(orders)} ranks")
    if len(send_s) < len(variants) - 1:
        raise ValueError(f"send_s has {len(send_s)} entries; {len(variants) - 1} stage boundaries need one each")
    m = len({j for o in orders for _, _, j in o})
    if {j for o in orders for _, _, j in o} != set(range(m)):
        raise ValueError(f"micro-batches must be numbered 0..{m - 1}")
    replay(orders, variants, tuple((0,) * m for _ in variants), send_s)  # orders well formed, no deadlock
    return m


def plan_microbatches(orders: Sequence[Sequence[Action]], variants: Sequence[Sequence[StageVariant]],
                      send_s: Sequence[float], memory_limit: Sequence[int], *, solver: str = "highs",
                      time_limit_s: float = 20.0, mip_gap: float = 1e-4,
                      progress: Callable[[str], None] | None = None) -> MicrobatchPlan:
    """A variant per (stage, micro-batch) minimizing the replayed step under ``memory_limit[r]``
    bytes per rank (held + carry of all its stages, the memory walk in the module docstring).

    ``orders``: per rank, its actions (``placement.zero_bubble_orders``); ``variants[s]``: stage
    s's variants; ``send_s[s]``: the transfer between stage s and s + 1 on different ranks.
    ``solver``: "highs" or "glpk" (the MILP; missing: RuntimeError with the install command),
    "auto" (HiGHS, else GLPK, else the greedy) or "heu" (the greedy: a fitting choice, no
    optimality claimed). ``time_limit_s``: the solver's time for both of ``_solve_milp``'s solves
    (building the model is extra). ``mip_gap`` / ``progress`` as ``remat.milp_solvers.run_solver``
    (a model-size line first, a result line last). A MILP that stops without any incumbent falls
    back to the greedy, with a note. The reported step and
    peaks are ``replay``'s. Raises ``MicrobatchPlanError`` (a ValueError) naming the smallest
    reachable peak per rank when no choice fits."""
    from lynx_compile.remat.milp_solvers import HIGHS_INSTALL, pick_solver, require_solver

    t0 = time.perf_counter()
    m = _check(orders, variants, send_s, memory_limit)
    picked = pick_solver(solver)
    name = picked.name
    notes: list[str] = [picked.reason] if solver == "auto" and name == "heu" else []
    choice, outcome = None, None
    if name != "heu":
        require_solver(name)
        try:
            choice, outcome, more = _solve_milp(orders, variants, send_s, memory_limit, name, time_limit_s,
                                                mip_gap, progress, t0)
            notes.extend(more)
        except RuntimeError as e:   # no incumbent within the time limit, solver failure
            notes.append(f"the {name} MILP failed ({e}); the greedy's choice instead")
            name = "heu"
        if outcome is not None and outcome.status == "infeasible":
            _, smallest, how = _smallest(orders, variants, name)
            if all(p <= lim for p, lim in zip(smallest, memory_limit)):
                raise RuntimeError(f"{name} reported the limit infeasible, but a choice with peaks {smallest} B "
                                   f"fits {tuple(memory_limit)} B (numerical trouble)")
            raise MicrobatchPlanError(smallest, memory_limit, how)
    if name == "heu":
        choice = _greedy(orders, variants, send_s, memory_limit, m)
        if choice is None:
            choice, smallest, how = _smallest(orders, variants, "auto")   # any MILP solver installed
            if smallest is None:
                raise MicrobatchPlanError(None, memory_limit, "the greedy found none and no MILP solver is "
                                          f"installed to say whether one exists ({HIGHS_INSTALL})")
            if any(p > lim for p, lim in zip(smallest, memory_limit)):
                raise MicrobatchPlanError(smallest, memory_limit, how)
            notes.append("the greedy found no fitting choice; the smallest-peak choice instead")
    step, peaks = replay(orders, variants, choice, send_s)
    if any(p > lim for p, lim in zip(peaks, memory_limit)):
        raise RuntimeError(f"the {name} choice peaks at {peaks} B over the limit {tuple(memory_limit)} B (a bug)")
    solve_s = time.perf_counter() - t0
    if progress:
        progress(f"lynx-microbatch[{name}]: step {step * 1e3:.3f} ms, peaks {peaks} B in {solve_s:.2f} s")
    status, gap = ("feasible", None) if outcome is None else (outcome.status, outcome.gap)
    return MicrobatchPlan(choice=choice, step_s=step, peak_bytes=peaks, status=status, gap=gap, solve_s=solve_s,
                          solver=name, notes=tuple(notes) + (outcome.notes if outcome else ()))
