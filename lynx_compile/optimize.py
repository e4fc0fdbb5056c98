"""policy="lynx": extract the problem, solve it, apply the plan, and check it by simulation.

::

    joint ─extract─▶ RematProblem ─solve_remat (OPT/HEU)─▶ RematSolution ─▶ Decisions
      ▲                                                                      │
      └── tighten the solver's budget by the overshoot ◀── peak > budget ◀───┤ apply.realize
                                                                              │ (tag, partition,
                                                   (Applied: fw, bw, exact peak) ◀─┘ place, simulate)

The solver's memory model is linear and slightly conservative; the plan that counts is the
partitioned graphs' exact simulated peak (the number the allocator measures). When that is
still above the budget (e.g. CPU dropout replay saves a 5 KB RNG state per recomputed dropout,
which the model does not see), the solver's budget is lowered by the overshoot and it solves
again, up to ``MAX_ROUNDS`` times. Decisions come from a plan file (``plan=``), the in-process
cache (same graph hash, budget and solver), or a fresh solve, in that order.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch.fx as fx

from lynx_compile.apply import Applied, realize
from lynx_compile.budget import budget_error
from lynx_compile.config import LynxConfig
from lynx_compile.decisions import KEEP, BudgetError, Decisions
from lynx_compile.passes import PassContext
from lynx_compile.passes.remat_problem import extract_remat_problem, unit_decisions
from lynx_compile.remat.problem import InfeasibleBudget, RematProblem

log = logging.getLogger("lynx_compile")
MAX_ROUNDS = 6
_CACHE: dict[tuple, tuple[Decisions, str, str, float]] = {}
"""(graph hash, budget, solver, gap, compiler, offload prices) → (decisions, solver, status,
exposed seconds)."""


@dataclass
class LynxOutcome:
    """The plan policy lynx compiles: its application, and how it was found."""

    applied: Applied
    problem: RematProblem | None
    solver: str = ""
    status: str = ""
    exposed_s: float = 0.0
    plan_time_s: float = 0.0
    solve_s: float = 0.0

    @property
    def decisions(self) -> Decisions:
        return self.applied.decisions


def load_plan_decisions(path: str, graph_hash: str) -> Decisions:
    """Decisions of the plan in ``path`` made for this graph (hash checked)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"plan file {path!r} cannot be read: {e}. Re-plan it: lynx plan --policy lynx "
                         f"... --out {path}") from e
    plans = data if isinstance(data, list) else [data]
    for plan in plans:
        if isinstance(plan, dict) and plan.get("graph_hash") == graph_hash:
            if not plan.get("decisions") or not plan["decisions"].get("units"):
                raise ValueError(f"plan {path!r} was made with policy {plan.get('policy')!r}; "
                                 "only policy 'lynx' plans carry per-tensor decisions")
            try:
                return Decisions.from_dict(plan["decisions"]).with_source("file")
            except ValueError as e:
                raise ValueError(f"plan {path!r}: {e}") from e
    found = sorted({p.get("graph_hash", "?") for p in plans if isinstance(p, dict)})
    raise ValueError(f"plan {path!r} was made for a different graph (hashes {found}); this graph is "
                     f"{graph_hash}. Re-plan it: lynx plan --policy lynx ... --out {path}")


def plan_lynx(joint: fx.GraphModule, ctx: PassContext, base_fw: fx.GraphModule, base_bw: fx.GraphModule,
              budget: int | None, kw: dict) -> LynxOutcome:
    """Choose what to keep and recompute so the exact simulated peak fits ``budget``.

    ``base_fw`` / ``base_bw``: the partition whose saved tensors are the problem's units.
    Raises ``BudgetError`` when no plan fits."""
    from lynx_compile.remat.solve import solve_remat  # imports Pyomo: only when lynx plans

    cfg: LynxConfig = ctx.config
    start = time.perf_counter()
    problem, index = extract_remat_problem(joint, base_fw, base_bw, ctx)
    ctx.record.problem, ctx.record.unit_index = problem, index  # kept when no plan fits, for the error
    target = budget if budget is not None else problem.reference_peak
    key = (problem.graph_hash, budget, cfg.solver, cfg.mip_gap, cfg.compiler,
           tuple(u.offload_s for u in problem.units) if cfg.offload else None)
    fixed = load_plan_decisions(cfg.plan, problem.graph_hash) if cfg.plan else None
    if fixed is None and budget is None:  # nothing to fit: recompute nothing, solve nothing
        fixed = Decisions.make("lynx", {u.name: KEEP for u in problem.units}, source="no budget")
    cached = _CACHE.get(key) if cfg.plan_cache and not fixed else None
    decisions = fixed or (cached[0].with_source("cache") if cached else None)
    solver = status = ""
    exposed = solve_s = 0.0
    if cached:  # what the solve that made these decisions reported
        _, solver, status, exposed = cached
    model_peak = target
    applied = None
    for _ in range(MAX_ROUNDS):
        if decisions is None:
            try:
                sol = solve_remat(problem, target, solver=cfg.solver, time_limit_s=cfg.time_limit_s,
                                  mip_gap=cfg.mip_gap, progress=lambda line: log.info("lynx: %s", line))
            except InfeasibleBudget as e:
                if applied is not None:  # a re-solve round, not the budget itself
                    raise budget_error(
                        cfg.budget, problem.reference_peak,
                        max(applied.mem.peak_bytes, e.smallest),
                        f"at the edge of what can be reached: the smallest reachable peak in the "
                        f"optimizer's model is {e.smallest} B, and the plan solved for this budget peaked "
                        f"at {applied.mem.peak_bytes} B when the rewritten graphs were simulated exactly") from e
                raise _infeasible(cfg, e, problem) from e
            decisions, solver, status, exposed = unit_decisions(problem, index, sol), sol.solver, sol.status, sol.exposed_s
            solve_s += sol.solve_s
            model_peak = sol.peak_bytes
            for note in sol.notes:  # a time-limited MILP is a warning; the rest is information
                if note not in ctx.record.notes:
                    (log.warning if sol.status == "feasible" else log.info)("lynx: %s", note)
                    ctx.record.notes.append(note)
        applied = realize(joint, ctx, decisions, kw)
        peak = applied.mem.peak_bytes
        if budget is None or peak <= budget or decisions.source == "file":  # a file plan is checked by the caller
            break
        log.info("lynx: plan peaks at %d B > budget %d B; re-solving with %d B less", peak, budget, peak - budget)
        # below the model peak of the plan that overshot, or the solver returns it again
        target = min(target, model_peak) - max(peak - budget, budget // 200)
        decisions = None
    else:
        raise budget_error(cfg.budget, problem.reference_peak, applied.mem.peak_bytes,
                           f"after {MAX_ROUNDS} rounds the best plan still peaks at {applied.mem.peak_bytes} B")
    source = decisions.source
    if source == "solver" and cfg.plan_cache:
        _CACHE[key] = (decisions, solver, status, exposed)
    ctx.record.decisions["plan_source"] = source
    return LynxOutcome(applied=applied, problem=problem, solver=solver or source, status=status or source,
                       exposed_s=exposed, plan_time_s=time.perf_counter() - start if source == "solver" else 0.0,
                       solve_s=solve_s)


def _infeasible(cfg: LynxConfig, e: InfeasibleBudget, problem: RematProblem) -> BudgetError:
    return budget_error(cfg.budget, problem.reference_peak, e.smallest,
                        "below what can be reached in the optimizer's model")
