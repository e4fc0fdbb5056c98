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

The ranks' actions and their order are fixed (torch's, ``placement.zero_bubble_orders``), so the
choice is a MILP linear in it (``microbatch_milp``: the least step, then the least work at that
step); ``microbatch_replay.replay`` is the exact reference for one choice, memory walk included,
and the only source of the numbers reported. Without a MILP solver a greedy (``_greedy``) finds a
fitting choice, no optimality claimed; when nothing fits, ``MicrobatchPlanError`` names each
rank's smallest reachable peak.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from .microbatch_milp import smallest_choice, solve_milp
from .microbatch_replay import Choice, StageVariant, replay, walk_points, walk_peak
from .schedule_sim import Action

MiB = 2**20


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


def _overflow(points, variants, choice: Choice, limit: int) -> int:
    """Bytes over ``limit`` summed over the walk's points: zero iff the rank fits."""
    return sum(max(0, walk_peak([pt], variants, choice) - limit) for pt in points)


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
    walks = [walk_points(order) for order in orders]
    frozen = lambda: tuple(map(tuple, choice))  # noqa: E731
    step = replay(orders, variants, frozen(), send_s)[0]
    while True:
        over = [r for r in range(len(orders)) if _overflow(walks[r], variants, frozen(), memory_limit[r])]
        if not over:
            return frozen()
        r = over[0]
        now = _overflow(walks[r], variants, frozen(), memory_limit[r])
        alive = sorted({sj for pt in walks[r] if walk_peak([pt], variants, frozen()) > memory_limit[r]
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
    bytes per rank (held + carry of all its stages, the memory walk of ``microbatch_replay``).

    ``orders``: per rank, its actions (``placement.zero_bubble_orders``); ``variants[s]``: stage
    s's variants; ``send_s[s]``: the transfer between stage s and s + 1 on different ranks.
    ``solver``: "highs" or "glpk" (the MILP; missing: RuntimeError with the install command),
    "auto" (HiGHS, else GLPK, else the greedy) or "heu" (the greedy: a fitting choice, no
    optimality claimed). ``time_limit_s``: the solver's time for both of ``solve_milp``'s solves
    (building the model is extra). ``mip_gap`` / ``progress`` as ``remat.milp_solvers.run_solver``
    (a model-size line first, a result line last). A MILP that stops without any incumbent falls
    back to the greedy, with a note. The reported step and
    peaks are ``replay``'s. Raises ``MicrobatchPlanError`` (a ValueError) naming the smallest
    reachable peak per rank when no choice fits."""
    from lynx_compile.solver.milp_solvers import HIGHS_INSTALL, pick_solver, require_solver

    t0 = time.perf_counter()
    m = _check(orders, variants, send_s, memory_limit)
    picked = pick_solver(solver)
    name = picked.name
    notes: list[str] = [picked.reason] if solver == "auto" and name == "heu" else []
    choice, outcome = None, None
    if name != "heu":
        require_solver(name)
        try:
            choice, outcome, more = solve_milp(orders, variants, send_s, memory_limit, name, time_limit_s,
                                               mip_gap, progress, t0)
            notes.extend(more)
        except RuntimeError as e:   # no incumbent within the time limit, solver failure
            notes.append(f"the {name} MILP failed ({e}); the greedy's choice instead")
            name = "heu"
        if outcome is not None and outcome.status == "infeasible":
            _, smallest, how = smallest_choice(orders, variants, name)
            if all(p <= lim for p, lim in zip(smallest, memory_limit)):
                raise RuntimeError(f"{name} reported the limit infeasible, but a choice with peaks {smallest} B "
                                   f"fits {tuple(memory_limit)} B (numerical trouble)")
            raise MicrobatchPlanError(smallest, memory_limit, how)
    if name == "heu":
        choice = _greedy(orders, variants, send_s, memory_limit, m)
        if choice is None:
            choice, smallest, how = smallest_choice(orders, variants, "auto")   # any MILP solver installed
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
