"""policy="lynx": extract the problem, solve it, apply the plan, and check it by simulation.

::

    joint ─extract─▶ RematProblem ─solve_remat (OPT/HEU)─▶ RematSolution ─▶ decisions
      ▲                                                                      │
      └── tighten the solver's budget by the overshoot ◀── peak > budget ◀───┤ apply tags,
                                                                              │ partition,
                                            (fw, bw, exact simulated peak) ◀──┘ place windows

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
from typing import Any, Callable

import torch.fx as fx

from lynx_compile.config import LynxConfig
from lynx_compile.memory.simulate import StepMemory, simulate_step
from lynx_compile.passes import PassContext
from lynx_compile.passes.remat_problem import (
    apply_remat_decisions, extract_remat_problem, unit_decisions)
from lynx_compile.remat.problem import InfeasibleBudget, RematProblem

log = logging.getLogger("lynx_compile")
MAX_ROUNDS = 6
_CACHE: dict[tuple, tuple[dict[str, str], str, str, float]] = {}
"""(graph hash, budget, solver, gap, compiler) → (decisions, solver, status, exposed seconds)."""


@dataclass
class LynxOutcome:
    fw: fx.GraphModule
    bw: fx.GraphModule
    mem: StepMemory
    problem: RematProblem | None
    decisions: dict[str, str]
    solver: str = ""
    status: str = ""
    exposed_s: float = 0.0
    plan_time_s: float = 0.0
    solve_s: float = 0.0
    node_unit: dict[str, str] | None = None
    """joint node name → name of the unit it belongs to (the op itself, its views, getitems)."""


def load_plan_decisions(path: str, graph_hash: str) -> dict[str, str]:
    """Decisions of the plan in ``path`` made for this graph (hash checked)."""
    with open(path) as f:
        data = json.load(f)
    plans = data if isinstance(data, list) else [data]
    for plan in plans:
        if plan.get("graph_hash") == graph_hash:
            if not plan.get("decisions"):
                raise ValueError(f"plan {path!r} was made with policy {plan.get('policy')!r}; "
                                 "only policy 'lynx' plans carry per-tensor decisions")
            return dict(plan["decisions"])
    found = sorted({p.get("graph_hash", "?") for p in plans})
    raise ValueError(f"plan {path!r} was made for a different graph (hashes {found}); this graph is "
                     f"{graph_hash}. Re-plan it: lynx plan --policy lynx ... --out {path}")


def plan_lynx(joint: fx.GraphModule, ctx: PassContext, ref_fw: fx.GraphModule, ref_bw: fx.GraphModule,
              budget: int | None, partition: Callable[[fx.GraphModule], tuple[Any, Any]],
              clear_tags: Callable[[fx.GraphModule], None]) -> LynxOutcome:
    """Choose what to keep and recompute so the exact simulated peak fits ``budget``.

    ``partition(joint)`` returns (fw, bw) with the backward passes run. Raises
    ``BudgetError`` (from ``lynx_compile.partition``) when no plan fits."""
    from lynx_compile.partition import BudgetError
    from lynx_compile.remat.solve import solve_remat  # imports Pyomo: only when lynx plans

    cfg: LynxConfig = ctx.config
    start = time.perf_counter()
    problem, index = extract_remat_problem(joint, ref_fw, ref_bw, ctx)
    ctx.record.problem = problem  # kept when no plan fits, for the error and for inspection
    target = budget if budget is not None else problem.reference_peak
    key = (problem.graph_hash, budget, cfg.solver, cfg.mip_gap, cfg.compiler)
    fixed = load_plan_decisions(cfg.plan, problem.graph_hash) if cfg.plan else None
    if fixed is None and budget is None:  # nothing to fit: recompute nothing, solve nothing
        fixed = {u.name: "keep" for u in problem.units}
    cached = _CACHE.get(key) if cfg.plan_cache and not fixed else None
    decisions = fixed or (cached[0] if cached else None)
    source = ("file" if cfg.plan else "no budget") if fixed else ("cache" if decisions else "solver")
    solver = status = ""
    exposed = solve_s = 0.0
    if cached:  # what the solve that made these decisions reported
        _, solver, status, exposed = cached
    model_peak = target
    for _ in range(MAX_ROUNDS):
        if decisions is None:
            try:
                sol = solve_remat(problem, target, solver=cfg.solver, time_limit_s=cfg.time_limit_s,
                                  mip_gap=cfg.mip_gap, progress=lambda line: log.info("lynx: %s", line))
            except InfeasibleBudget as e:
                if budget is not None and target < budget:  # a re-solve round, not the budget itself
                    need = max(mem.peak_bytes, e.smallest) / problem.reference_peak
                    raise BudgetError(
                        f"memory_budget={cfg.memory_budget!r} ({budget} B) is at the edge of what can "
                        f"be reached: the smallest reachable peak in the optimizer's model is "
                        f"{e.smallest} B, and the plan solved for this budget peaked at {mem.peak_bytes} B "
                        f"when the rewritten graphs were simulated exactly. Use memory_budget >= "
                        f"{need:.3f}.") from e
                raise BudgetError(_infeasible_message(cfg, budget, e, problem)) from e
            decisions, solver, status, exposed = unit_decisions(problem, sol), sol.solver, sol.status, sol.exposed_s
            solve_s += sol.solve_s
            model_peak = sol.peak_bytes
            for note in sol.notes:  # a time-limited MILP is a warning; the rest is information
                if note not in ctx.record.notes:
                    (log.warning if sol.status == "feasible" else log.info)("lynx: %s", note)
                    ctx.record.notes.append(note)
        clear_tags(joint)
        apply_remat_decisions(joint, problem, index, decisions)
        fw, bw = partition(joint)
        mem = simulate_step(fw, bw, fused=cfg.compiler == "inductor")
        if budget is None or mem.peak_bytes <= budget or source == "file":  # a file plan is checked by the caller
            break
        log.info("lynx: plan peaks at %d B > budget %d B; re-solving with %d B less",
                 mem.peak_bytes, budget, mem.peak_bytes - budget)
        # below the model peak of the plan that overshot, or the solver returns it again
        target = min(target, model_peak) - max(mem.peak_bytes - budget, budget // 200)
        decisions, source = None, "solver"
    else:
        raise BudgetError(f"memory_budget={cfg.memory_budget!r} ({budget} B): after {MAX_ROUNDS} "
                          f"rounds the best plan still peaks at {mem.peak_bytes} B; use a budget "
                          f">= {mem.peak_bytes / problem.reference_peak:.3f}")
    if source == "solver" and cfg.plan_cache:
        _CACHE[key] = (decisions, solver, status, exposed)
    ctx.record.decisions["plan_source"] = source
    return LynxOutcome(fw=fw, bw=bw, mem=mem, problem=problem, decisions=decisions,
                       solver=solver or source, status=status or source, exposed_s=exposed,
                       plan_time_s=time.perf_counter() - start if source == "solver" else 0.0, solve_s=solve_s,
                       node_unit={m: u.name for u, names in zip(problem.units, index.nodes) for m in names})


def _infeasible_message(cfg: LynxConfig, budget: int | None, e: InfeasibleBudget, problem: RematProblem) -> str:
    ref = problem.reference_peak or 1
    return (f"memory_budget={cfg.memory_budget!r} ({budget} B) is below what can be reached: the "
            f"smallest reachable peak is {e.smallest} B = {e.smallest / ref:.3f} of the "
            f"no-recompute peak ({problem.reference_peak} B). Use memory_budget >= "
            f"{e.smallest / ref:.3f} (or >= {e.smallest} bytes).")
