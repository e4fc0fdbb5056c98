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

:func:`with_plan_cache` wraps the whole of policy lynx's choice for a model (this solve and the
baselines ``decide`` seeds it with) in the persistent plan cache (``lynx_compile.caches.plans``)::

    key (graph, options, budget, versions, costs) ─ hit ─▶ realize cached Decisions ─ fits? ─▶ plan
                                                  └ miss, or a hit that does not fit ─▶ plan ─▶ store
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.caches import plans as plan_cache
from lynx_compile.recompute.apply import Applied, partition_token, piece_saved_bytes, realize, scratch_context
from lynx_compile.budget import budget_error
from lynx_compile.config import LynxConfig
from lynx_compile.decisions import KEEP, BudgetError, CandidateKey, Decisions
from lynx_compile.step.model import USER
from lynx_compile.passes import PassContext, meta
from lynx_compile.passes.find_blocks import without_addresses
from lynx_compile.recompute.problem_from_graph import extract_remat_problem, unit_decisions
from lynx_compile.recompute import regions as region_budgets
from lynx_compile.solver.problem import InfeasibleBudget, InfeasibleRegion, RematProblem

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
    cfg: LynxConfig = ctx.config
    start = time.perf_counter()
    problem, index = extract_remat_problem(joint, base_fw, base_bw, ctx)
    ctx.record.problem, ctx.record.unit_index = problem, index  # kept when no plan fits, for the error
    target = budget if budget is not None else problem.reference_peak
    key = (problem.graph_hash, problem.region_caps, budget, cfg.solver, cfg.mip_gap, cfg.compiler,
           tuple(u.offload_s for u in problem.units) if cfg.offload else None)
    fixed = load_plan_decisions(cfg.plan, problem.graph_hash) if cfg.plan else None
    if fixed is None and budget is None and not problem.region_caps:  # nothing to fit: recompute nothing
        fixed = Decisions.make("lynx", {u.name: KEEP for u in problem.units}, source="no budget")
    cached = _CACHE.get(key) if cfg.plan_cache and not fixed else None
    decisions = fixed or (cached[0].with_source("cache") if cached else None)
    solver = status = ""
    exposed = solve_s = 0.0
    if cached:  # what the solve that made these decisions reported
        _, solver, status, exposed = cached
    model_peak = target
    applied = None
    kept = None  # unit ids the last solve kept (None: decisions not solved here)
    for _ in range(MAX_ROUNDS):
        if decisions is None:
            try:
                sol = _solve_as_rank0(problem, target, cfg)
            except InfeasibleRegion as e:
                raise region_budgets.refusal(e) from e
            except InfeasibleBudget as e:
                if applied is not None:  # a re-solve round, not the budget itself
                    raise budget_error(
                        ctx.budget, problem.reference_peak,
                        max(applied.mem.peak_bytes, e.smallest),
                        f"at the edge of what can be reached: the smallest reachable peak in the "
                        f"optimizer's model is {e.smallest} B, and the plan solved for this budget peaked "
                        f"at {applied.mem.peak_bytes} B when the rewritten graphs were simulated exactly") from e
                raise _infeasible(ctx, e, problem) from e
            decisions, solver, status, exposed = unit_decisions(problem, index, sol), sol.solver, sol.status, sol.exposed_s
            kept = frozenset(sol.keep)
            solve_s += sol.solve_s
            model_peak = sol.peak_bytes
            for note in sol.notes:  # a time-limited MILP is a warning; the rest is information
                if note not in ctx.record.notes:
                    (log.warning if sol.status == "feasible" else log.info)("lynx: %s", note)
                    ctx.record.notes.append(note)
        applied = realize(joint, ctx, decisions, kw)
        peak = applied.mem.peak_bytes
        over = ctx.region_check.over(applied.fw, applied.bw) if ctx.region_check is not None else {}
        if over and decisions.source != "file":  # the partition saves more in a region than the model
            log.info("lynx: plan saves above region budget(s) %s; re-solving with their caps lowered", over)
            if kept is not None:
                problem = region_budgets.tightened(problem, ctx.region_check, over, kept)
            decisions = None
            continue
        if budget is None or peak <= budget or decisions.source == "file":  # a file plan is checked by the caller
            break
        log.info("lynx: plan peaks at %d B > budget %d B; re-solving with %d B less", peak, budget, peak - budget)
        # below the model peak of the plan that overshot, or the solver returns it again
        target = min(target, model_peak) - max(peak - budget, budget // 200)
        decisions = None
    else:
        raise budget_error(ctx.budget, problem.reference_peak, applied.mem.peak_bytes,
                           f"after {MAX_ROUNDS} rounds the best plan still peaks at {applied.mem.peak_bytes} B")
    source = decisions.source
    if source == "solver" and cfg.plan_cache:
        _CACHE[key] = (decisions, solver, status, exposed)
    ctx.record.stats["plan_source"] = source
    return LynxOutcome(applied=applied, problem=problem, solver=solver or source, status=status or source,
                       exposed_s=exposed, plan_time_s=time.perf_counter() - start if source == "solver" else 0.0,
                       solve_s=solve_s)


def _solve_as_rank0(problem: RematProblem, target: int, cfg: LynxConfig):
    """``solve_remat`` of ``problem`` at ``target``; with several planning ranks, rank 0's answer
    (its solution or its ``InfeasibleBudget``) on every rank that solved the same problem (same
    graph hash, target and solver settings).

    Every rank solves, but a solve need not give every rank the same answer: a MILP stopped by
    its time limit, or by a machine's load, returns whatever incumbent it had (seen once: two
    processes, the same graph and options, one of them on a loaded machine, two plans of equal
    peak). Ranks that compile different plans issue collectives in different orders, so the
    plan is rank 0's. A rank whose problem differs (another budget, another graph) keeps its own
    answer, and ``check_plan_agreement`` then stops every rank with one error naming the plans."""
    from lynx_compile.distributed.agreement import planning_world_size, rank0_value
    from lynx_compile.solver.solve import solve_remat  # imports Pyomo: only when lynx plans

    try:
        mine = ("solution", solve_remat(problem, target, solver=cfg.solver, time_limit_s=cfg.time_limit_s,
                                        mip_gap=cfg.mip_gap, progress=lambda line: log.info("lynx: %s", line)))
    except InfeasibleBudget as e:  # sent as its fields: the exception does not unpickle
        mine = ("infeasible", (e.budget, e.smallest, e.reference))
    if planning_world_size() > 1:
        key = (problem.graph_hash, len(problem.units), target, cfg.solver, cfg.mip_gap, cfg.time_limit_s)
        with _compat.eager_dispatch():
            rank0_key, rank0_answer = rank0_value((key, mine))
        if rank0_key == key:
            mine = rank0_answer
    kind, value = mine
    if kind == "infeasible":
        raise InfeasibleBudget(*value)
    return value


def plan_smallest(joint: fx.GraphModule, ctx: PassContext, kw: dict) -> Applied | None:
    """lynx's optimizer at the smallest peak its own model reaches, realized once on a scratch
    record (``ctx.record.problem``, extracted by :func:`plan_lynx`); None without a problem.

    A candidate whatever budget was asked (``seeds.seed_with_baselines`` tries it whenever the
    optimizer has no plan under the budget), so the smallest budget a refusal names is the same
    for every budget asked, and asking for it is accepted (gpt-tiny, 2 layers, batch 4, Inductor:
    0.542 of the no-recompute peak, where ``full`` and torch's min-cut reach 0.573 at best). Not
    re-solved when its exact peak is above the model's (as :func:`plan_lynx` does): below the
    model's smallest there is nothing to solve for, and the peak it has is the one a later
    budget meets again."""
    problem, index = ctx.record.problem, ctx.record.unit_index
    if problem is None:
        return None
    target, sol = 0, None
    for _ in range(2):  # the heuristic's smallest is a bound of its own: once more at its answer
        try:
            sol = _solve_as_rank0(problem, target, ctx.config)
            break
        except InfeasibleBudget as e:
            target = e.smallest
    if sol is None:
        return None
    return realize(joint, scratch_context(ctx, SMALLEST.policy, str(SMALLEST)), unit_decisions(problem, index, sol), kw)


SMALLEST = CandidateKey("lynx", smallest=True)
"""The candidate name of :func:`plan_smallest`'s plan."""


def _infeasible(ctx: PassContext, e: InfeasibleBudget, problem: RematProblem) -> BudgetError:
    return budget_error(ctx.budget, problem.reference_peak, e.smallest,
                        "below what can be reached in the optimizer's model")


def with_plan_cache(joint: fx.GraphModule, ctx: PassContext, kw: dict, budget: int | None, reference_peak: int,
                    plan: Callable[[], LynxOutcome]) -> LynxOutcome:
    """``plan()`` (policy lynx's whole choice for ``joint``: solve and seeds), through the
    persistent plan cache (``lynx_compile.caches.plans``) when ``config.plan_cache`` is on, a
    budget is set and no plan file is given.

    A hit is applied (one ``realize``) and used only when its exact simulated peak fits
    ``budget`` and, with several ranks, every rank hit and fits (one all-gather, so ranks
    never take different paths through the collectives of planning); otherwise ``plan()``
    runs and its outcome replaces the entry. A hit's decisions carry ``source="cache"``; the
    solver, status, exposed seconds, candidates and notes are the ones the plan was made with;
    ``plan_time_s`` is the hit's own; ``record.problem`` stays None (nothing was extracted)."""
    cfg = ctx.config
    if not cfg.plan_cache or budget is None or cfg.plan:
        return plan()
    start = time.perf_counter()
    key, fields = _cache_key(joint, ctx, reference_peak, budget)
    entry = plan_cache.load(key)
    hit = _apply_cached(joint, ctx, kw, budget, entry, key) if entry is not None else None
    if _every_rank_hit(hit):
        log.info("lynx plan cache: hit %s", key[:12])
        ctx.record.stats["plan_cache"] = "hit"
        ctx.record.stats["plan_source"] = "cache"
        ctx.record.stats["candidates"] = entry.candidates
        ctx.record.notes.extend(n for n in entry.notes if n not in ctx.record.notes)
        if entry.compiled_peak_bytes is not None:  # plan_cache.restore_compiled_peak puts it on the plan
            ctx.record.stats["cached_compiled_peak_bytes"] = entry.compiled_peak_bytes
        return LynxOutcome(applied=hit, problem=None, solver=entry.solver, status=entry.status,
                           exposed_s=entry.exposed_s, plan_time_s=time.perf_counter() - start)
    log.info("lynx plan cache: miss %s", key[:12])
    notes_before = len(ctx.record.notes)
    outcome = plan()
    ctx.record.stats["plan_cache"] = "miss"
    plan_cache.store(key, plan_cache.CachedPlan(
        decisions=outcome.decisions, solver=outcome.solver, status=outcome.status, exposed_s=outcome.exposed_s,
        solve_s=outcome.solve_s, plan_time_s=outcome.plan_time_s, torch_budget=outcome.applied.torch_budget,
        candidates=ctx.record.stats.get("candidates", {}), notes=tuple(ctx.record.notes[notes_before:])),
        fields)
    return outcome


def _cache_key(joint: fx.GraphModule, ctx: PassContext, reference: int, budget: int,
               scope: str | None = None) -> tuple[str, dict]:
    """(key, its fields) of ``joint``'s plan-cache entry (``plan_cache.key_fields``); ``scope``
    ``"piece"`` keys a piece's provisional choice apart from a whole graph's plan. The key goes on
    the record (Inductor's compiled peak is added to its entry later)."""
    from lynx_compile.costs import get_profile
    from lynx_compile.distributed.agreement import planning_world_size

    cfg = ctx.config
    fields = plan_cache.key_fields(
        cfg, graph_hash=ctx.record.stats.get("graph_hash", ""), graph_digest=graph_digest(joint),
        reference_peak=reference, budget=budget, world_size=planning_world_size(),
        profile={"hardware": get_profile(cfg.hardware).to_dict(), "link": ctx.record.stats.get("link")})
    if scope is not None:
        fields["scope"] = scope
    if ctx.record.fsdp is not None:  # FSDP2's collectives around the backward: windows to plan in
        fields["fsdp"] = list(ctx.record.fsdp)
    if ctx.record.unbacked_sizes:  # data-dependent sizes as a step ran them (step.sizes)
        fields["unbacked_sizes"] = sorted(ctx.record.unbacked_sizes.items())
    if ctx.user_tags is not None:  # the user's checkpoint tags are a candidate and bound the plan
        fields["user_tags"] = hashlib.sha256(repr(ctx.user_tags).encode()).hexdigest()
    if ctx.region_check is not None:  # the model's region budgets bound the plan
        regions = [(r.name, r.fraction, sorted(r.nodes)) for r in ctx.region_check.regions]
        fields["regions"] = hashlib.sha256(repr(regions).encode()).hexdigest()
    key = plan_cache.plan_key(fields)
    ctx.record.stats["plan_cache_key"] = key
    return key, fields


def _every_rank_hit(hit: Applied | None) -> bool:
    """Whether this rank's cache ``hit`` is used: every rank takes the same path, so a hit only
    where every rank hit with the same partition (one all-gather of its token)."""
    from lynx_compile.distributed.agreement import gather_values

    token = partition_token(hit) if hit is not None else None
    with _compat.eager_dispatch():  # real tensors for the all-gather, not the compile's fakes
        everyone = set(gather_values(token))
    return hit is not None and everyone == {token}


def with_piece_cache(joint: fx.GraphModule, ctx: PassContext, kw: dict, budget: int | None, reference_saved: int,
                     plan: Callable[[], tuple[Applied, LynxOutcome]]) -> tuple[Applied, LynxOutcome]:
    """``plan()`` (``decide.decide_piece``'s provisional choice for a piece of a model, and its
    candidates on ``record.step``), through the persistent plan cache as :func:`with_plan_cache`
    does for whole graphs: the key is the same, with the saved-bytes budget and reference and
    ``scope: piece``; the entry keeps the chosen candidate's decisions and every candidate's
    numbers (``CachedPlan.step``), so a hit realizes one candidate instead of weighing them all.
    A hit is used where it partitions as when it was made (the same saved bytes) and every
    rank hit alike."""
    cfg = ctx.config
    if not cfg.plan_cache or budget is None or cfg.plan:
        return plan()
    start = time.perf_counter()
    key, fields = _cache_key(joint, ctx, reference_saved, budget,
                             scope=f"piece-provisional-{ctx.record.new_grad_bytes}" if ctx.record.provisional
                             else "piece")
    entry = plan_cache.load(key)
    hit = _apply_cached_piece(joint, ctx, kw, entry, key) if entry is not None else None
    if _every_rank_hit(hit[0] if hit is not None else None):
        applied, choices = hit
        log.info("lynx plan cache: hit %s", key[:12])
        ctx.record.stats.update(plan_cache="hit", plan_source="cache", candidates=entry.candidates)
        ctx.record.notes.extend(n for n in entry.notes if n not in ctx.record.notes)
        ctx.record.step = choices
        return applied, LynxOutcome(applied=applied, problem=None, solver=entry.solver, status=entry.status,
                                    exposed_s=entry.exposed_s, plan_time_s=time.perf_counter() - start)
    log.info("lynx plan cache: miss %s", key[:12])
    notes_before = len(ctx.record.notes)
    applied, outcome = plan()
    ctx.record.stats["plan_cache"] = "miss"
    plan_cache.store(key, plan_cache.CachedPlan(
        decisions=applied.decisions, solver=outcome.solver, status=outcome.status, exposed_s=outcome.exposed_s,
        plan_time_s=time.perf_counter() - start, torch_budget=applied.torch_budget,
        candidates=ctx.record.stats.get("candidates", {}), notes=tuple(ctx.record.notes[notes_before:]),
        step=ctx.record.step.to_dict() if ctx.record.step is not None else None), fields)
    return applied, outcome


def _apply_cached_piece(joint: fx.GraphModule, ctx: PassContext, kw: dict, entry: plan_cache.CachedPlan,
                        key: str):
    """(applied, GraphChoices) of a piece's cache ``entry``, or None with a warning when it has no
    candidates, does not apply, or saves other bytes than when it was made."""
    from lynx_compile.step.model import GraphChoices

    try:
        choices = GraphChoices.from_dict(entry.step)
        want = choices.named(choices.current)
        applied = _realize_entry(joint, ctx, kw, entry)
    except Exception as e:  # noqa: BLE001 - a stale entry is ignored, never trusted
        log.warning("lynx plan cache: entry %s does not apply to this graph (%s: %s); re-planning",
                    key[:12], type(e).__name__, e)
        return None
    # (the candidate's bytes count the activation inputs it keeps by saving them: compared
    # without them, every piece that saves its input missed, and was weighed again in every rerun)
    saved = piece_saved_bytes(applied, joint, kw)
    if saved != want.saved_bytes:
        log.warning("lynx plan cache: entry %s saves %d B here, %d B when it was made; re-planning",
                    key[:12], saved, want.saved_bytes)
        return None
    return applied, choices


def _apply_cached(joint: fx.GraphModule, ctx: PassContext, kw: dict, budget: int, entry: plan_cache.CachedPlan,
                  key: str) -> Applied | None:
    """``entry``'s plan applied to ``joint`` (on ``ctx``'s record), or None with a warning when it
    does not apply, partitions otherwise than when it was made, or peaks above ``budget``. A
    plan that was a torch min-cut seed is partitioned again at its setting (its decisions are
    a reading of that partition: applied as tags they partition differently)."""
    try:
        applied = _realize_entry(joint, ctx, kw, entry)
    except Exception as e:  # noqa: BLE001 - a cached plan that does not apply is stale, never fatal
        log.warning("lynx plan cache: entry %s does not apply to this graph (%s: %s); re-planning",
                    key[:12], type(e).__name__, e)
        return None
    if applied.mem.peak_bytes > budget:
        log.warning("lynx plan cache: entry %s peaks at %d B, above the budget %d B; re-planning",
                    key[:12], applied.mem.peak_bytes, budget)
        return None
    return applied


def _realize_entry(joint: fx.GraphModule, ctx: PassContext, kw: dict, entry: plan_cache.CachedPlan) -> Applied:
    """``entry``'s decisions applied to ``joint``; a torch min-cut seed is partitioned again at
    its setting (its decisions are a reading of that partition: applied as tags they partition
    differently), and ``ValueError`` when min-cut now recomputes other tensors."""
    decisions = entry.decisions.with_source("cache")
    if decisions.policy == USER:  # the user's own tags won: partitioned with them again
        if ctx.user_tags is None:
            raise ValueError("the plan was the user's checkpoint tags, and this graph has none")
        applied = realize(joint, ctx, Decisions(policy=USER), kw, as_user_tagged=True)
        return dataclasses.replace(applied, decisions=decisions)
    if entry.torch_budget is None:
        return realize(joint, ctx, decisions, kw)
    with _compat.min_cut_counts_script_objects_as_zero():
        applied = realize(joint, ctx, Decisions(policy=decisions.policy), kw, torch_budget=entry.torch_budget)
    recomputed, wanted = {n for n, _ in applied.decisions.recomputed()}, {u for u, _ in decisions.recomputed()}
    if any(bool(recomputed.intersection(decisions.nodes_of(u))) != (u in wanted) for u, _ in decisions):
        raise ValueError(f"torch's min-cut at {entry.torch_budget:g} recomputes other tensors now")
    return dataclasses.replace(applied, decisions=decisions)


def graph_digest(joint: fx.GraphModule) -> str:
    """sha256 of what the planner reads of ``joint`` beyond its structural hash: every node's
    name, op, target and arguments (the wiring; decisions are keyed by node names) and its
    cost (``meta.COST``: the hardware profile, link and measured times it was priced with)."""
    h = hashlib.sha256()
    for n in joint.graph.nodes:
        line = f"{n.name}|{n.op}|{n.target}|{n.args}|{n.kwargs}|{n.meta.get(meta.COST)!r}\n"
        h.update(without_addresses(line).encode())  # an object's repr may hold its id
    return h.hexdigest()
