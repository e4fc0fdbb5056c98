"""Decide: every policy's choice for one joint graph, as one applied ``Decisions`` record.

::

    policy none / full / selective ── baseline_decisions ─────────────┐
    policy torch ── min-cut at the budget, read back ─────────────────┤
    policy lynx ── optimize.plan_lynx (solve, re-solve on overshoot) ─┼─▶ apply.realize ─▶ Applied
                └─ seed_with_baselines: full, selective, torch min-cut ┘   (fw, bw, exact peak)
                   candidates, least exposed recompute that fits wins (torch's min-cut at
                   the budget fraction and half of it; at 0.1 ... 0.9 too when plan_lynx fails)

Policy lynx's whole choice (solve and seeds) goes through the persistent plan cache
(``optimize.with_plan_cache``): a hit applies the cached winner once and skips both.
``decide`` returns the ``Applied`` plan to compile (and lynx's ``LynxOutcome`` for the plan
record) or raises ``BudgetError`` naming the smallest reachable peak.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.recompute.apply import Applied, partition_joint, partition_token, realize, scratch_context
from lynx_compile.budget import budget_error as refuse
from lynx_compile.costs.comm import is_collective_node, is_wait_node
from lynx_compile.decisions import BudgetError, Decisions, Window
from lynx_compile.distributed.agreement import gather_values, planning_world_size
from lynx_compile.passes import APPLY_PIPELINE, PassContext, meta, run_passes
from lynx_compile.passes.apply_decisions import clear_decision_tags
from lynx_compile.passes.mark_recomputed import mark_recomputed_pass, recomputed_source
from lynx_compile.recompute.baselines import baseline_decisions
from lynx_compile.step_model import Candidate, GraphChoices

log = logging.getLogger("lynx_compile")

BASELINES = ("full", "selective")
TORCH_BUDGET_LADDER = (1.0, 0.5)
"""torch's min-cut is tried at these multiples of the requested budget fraction: its budget
counts saved bytes, not the peak, so a lower setting may be the one that fits."""
TORCH_SETTINGS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
"""Where lynx's optimizer has no plan under the budget, torch's min-cut is also tried at each of
these settings. torch's setting bounds (saved - inputs) / (min-cut's saved - inputs), which has
no fixed relation to the peak, so the setting that reached a peak need not be on the ladder
above: on HF Llama (2 layers, batch 2, seq 32) setting 0.5 peaks at 0.520 of the no-recompute
peak, but 0.52 (the ladder's first rung for that peak) at 0.534 and 0.26 at 0.719, so lynx fell
back to ``full`` and exposed 362 us of recompute against torch's 256 us. Only when the optimizer
fails: where it has a plan, it exposed 4-40x less than torch at every setting measured."""
_SETTING_NAMES = frozenset(f"torch@{s:g}" for s in TORCH_SETTINGS)


def decide(joint: fx.GraphModule, ctx: PassContext, kw: dict, budget: int | None,
           reference_peak: int) -> tuple[Applied, Any]:
    """(the applied plan, lynx's ``LynxOutcome`` or None) under ``ctx.config.policy``.

    Budget checks of the baselines are the caller's (after the plan is recorded): a plan above
    the budget is an error, and for policy torch a warning (torch budgets saved bytes, not the
    peak, so it is given the fraction whether or not a baseline reaches it)."""
    cfg = ctx.config
    policy = cfg.policy
    if policy == "torch":
        frac = min(1.0, budget / reference_peak) if budget is not None else 1.0
        return realize(joint, ctx, Decisions(policy="torch"), kw, torch_budget=frac), None
    if policy != "lynx":
        return realize(joint, ctx, baseline_decisions(joint, ctx, policy), kw), None
    from lynx_compile.recompute.optimize import with_plan_cache

    outcome = with_plan_cache(joint, ctx, kw, budget, reference_peak,
                              lambda: _plan_and_seed(joint, ctx, kw, budget, reference_peak))
    return outcome.applied, outcome


def _plan_and_seed(joint: fx.GraphModule, ctx: PassContext, kw: dict, budget: int | None, reference_peak: int):
    """Policy lynx's ``LynxOutcome``: the optimizer's plan, or a baseline seed that beats it."""
    from lynx_compile.recompute.optimize import plan_lynx

    cfg = ctx.config
    start = time.perf_counter()
    try:
        outcome, failure = plan_lynx(joint, ctx, *_problem_base(joint, ctx, kw), budget, kw), None
    except BudgetError as e:
        if budget is None or cfg.plan:
            raise
        outcome, failure = None, e
    if budget is not None and not cfg.plan:
        outcome = seed_with_baselines(joint, ctx, kw, budget, reference_peak, outcome, failure)
        # the plan time a user sees covers the baselines tried as seeds (and a failed solve)
        outcome.plan_time_s = time.perf_counter() - start
    if outcome.applied.record is not ctx.record:  # a seed won: its passes' counts are the plan's
        ctx.record.decisions.update(outcome.applied.record.decisions)
    realize_tags(joint, ctx, outcome.decisions)
    return outcome


def decide_piece(joint: fx.GraphModule, ctx: PassContext, kw: dict, budget: int | None,
                 reference_saved: int) -> tuple[Applied, Any]:
    """A graph that is one block or a piece of a model (``find_blocks``: no module-list
    children): the budget bounds the bytes it saves for its backward, which is what adds up
    across the pieces (its own peak is mostly the one block's backward, the same under any
    plan). Baseline policies are applied as asked. Policy lynx takes the candidate (none, full,
    selective, torch's min-cut at the budget and half of it) that saves no more than
    ``budget`` with the least exposed recompute; when none does (a loss-only graph saves what
    nothing recomputes), the one that saves least, with a warning naming the graph break."""
    cfg = ctx.config
    if cfg.policy != "lynx":
        return decide(joint, ctx, kw, None, reference_saved)
    frac = min(1.0, budget / reference_saved) if budget is not None and reference_saved else 1.0
    forced = ctx.record.step_choice
    if forced is not None:  # the step's plan across graphs chose this candidate (step_record)
        return _forced_piece(joint, ctx, kw, forced, frac)
    from lynx_compile.recompute.optimize import with_piece_cache

    return with_piece_cache(joint, ctx, kw, budget, reference_saved,
                            lambda: _plan_piece(joint, ctx, kw, budget, reference_saved, frac))


def _plan_piece(joint, ctx: PassContext, kw: dict, budget: int | None, reference_saved: int, frac: float):
    """:func:`decide_piece`'s candidates weighed, the provisional choice made."""
    cfg = ctx.config
    scored, own = [], None
    if budget is not None and ctx.record.reference_peak_bytes:
        # lynx's optimizer too (it places recompute in communication windows): solved for the
        # same fraction of the peak, a candidate like the others when what it saves fits
        from lynx_compile.recompute.optimize import plan_lynx

        try:
            own = plan_lynx(joint, ctx, *_problem_base(joint, ctx, kw),
                            int(frac * ctx.record.reference_peak_bytes), kw)
            scored.append(("lynx", exposed(own.applied, joint), own.applied))
        except BudgetError as e:
            ctx.record.notes.append(f"lynx's optimizer: {e}")
            own = None
            smallest = e.smallest_bytes
        else:
            smallest = None
        for target in _window_targets(ctx, smallest):
            try:  # where the graph has windows, lynx's optimizer at more peaks: it fills them first
                more = plan_lynx(joint, ctx, *_problem_base(joint, ctx, kw), target, kw)
            except BudgetError as e:
                ctx.record.notes.append(f"lynx's optimizer at {target} B: {e}")
                continue
            scored.append((f"lynx@{target}", exposed(more.applied, joint), more.applied))
            own = own or more
    # no budget: only none (recompute nothing beyond what the compiler does on its own)
    policies = ("none", *BASELINES) if budget is not None else ("none",)
    # with a budget, torch's min-cut at every setting too: the step's plan across pieces
    # (step_record) picks from these, and steps between them are what lets it fit a budget closely
    settings = TORCH_SETTINGS if budget is not None else ()
    seen = set()
    for name, applied in _baseline_candidates(joint, ctx, kw, policies, frac if budget is not None else None,
                                              settings):
        cost = exposed(applied, joint)
        same = (applied.mem.saved_bytes, applied.mem.forward_peak_bytes, applied.mem.backward_peak_bytes, cost)
        if same not in seen:  # min-cut gives the same partition at many settings
            seen.add(same)
            scored.append((name, cost, applied))
    ctx.record.decisions["candidates"] = {n: {"exposed_s": e, "saved_bytes": a.mem.saved_bytes} for n, e, a in scored}
    choices = tuple(step_candidate(n, e, a.mem) for n, e, a in scored)
    fitting = [c for c in scored if budget is None or c[2].mem.saved_bytes <= budget]
    if fitting:
        name, cost, applied = min(fitting, key=lambda c: (c[1], c[2].mem.saved_bytes))
    else:
        name, cost, applied = min(scored, key=lambda c: (c[2].mem.saved_bytes, c[1]))
        msg = (f"graph {ctx.record.graph_id} is one block or a piece of a model (no module-list children; "
               f"a graph break or a per-block compile), where {cfg.budget.given()} bounds the "
               f"bytes it saves for its backward ({budget} B of {reference_saved} B); no plan saves that "
               f"little (least: '{name}', {applied.mem.saved_bytes} B), so that one is used. If this graph "
               "should not be separate, TORCH_LOGS=graph_breaks shows why dynamo split the model.")
        log.warning("lynx: %s", msg)
        ctx.record.notes.append(msg)
    ctx.record.step = GraphChoices(reference=next(c for c in choices if c.name == "none"), choices=choices,
                                   current=name)
    note = (f"one block or a piece of a model: provisionally the budget bounds saved bytes; '{name}' chosen "
            "(the step's pieces are planned together once a step has run: lynx_compile.step_record)")
    return _piece_outcome(joint, ctx, name, cost, applied, own, note)


def _piece_outcome(joint, ctx: PassContext, name: str, cost: float, applied: Applied, own, note: str):
    from lynx_compile.recompute.optimize import LynxOutcome

    ctx.record.decisions.update(applied.record.decisions)
    realize_tags(joint, ctx, applied.decisions)
    ctx.record.notes.append(note)
    if name == "lynx":
        return own.applied, own
    outcome = LynxOutcome(applied=_as_seed(applied),
                          problem=ctx.record.problem, solver=f"baseline:{name}", status="seeded", exposed_s=cost)
    return outcome.applied, outcome


def _window_targets(ctx: PassContext, smallest: int | None) -> list[int]:
    """Peaks at which a piece with communication windows (in-graph collectives, FSDP2's
    prefetch: ``distributed/fsdp.py``) is planned by lynx's optimizer besides the budget's
    fraction (``candidate 'lynx@<bytes>'``): the smallest it reaches when the fraction is below
    it, and halfway from there to the no-recompute peak, so that the step's plan across pieces
    has candidates that recompute inside the windows. None without windows (no solve more)."""
    problem = ctx.record.problem
    if problem is None or not problem.windows or not ctx.record.reference_peak_bytes:
        return []
    ref = ctx.record.reference_peak_bytes
    base = smallest if smallest is not None else int(0.5 * ref)
    targets = [smallest] if smallest is not None else []
    targets.append((base + ref) // 2)
    return sorted(set(t for t in targets if 0 < t < ref))


def _forced_piece(joint, ctx: PassContext, kw: dict, name: str, frac: float):
    """Candidate ``name`` of :func:`decide_piece` made as it was then: lynx's optimizer at the
    same fraction, a baseline, or torch's min-cut at the setting in its name (``torch@0.25``)."""
    own = None
    if name == "lynx" or name.startswith("lynx@"):
        from lynx_compile.recompute.optimize import plan_lynx

        target = int(name[5:]) if name.startswith("lynx@") else int(frac * ctx.record.reference_peak_bytes)
        own = plan_lynx(joint, ctx, *_problem_base(joint, ctx, kw), target, kw)
        applied = own.applied
    elif name.startswith("torch@"):
        applied = next(a for _, a in _baseline_candidates(joint, ctx, kw, (), None, (float(name[6:]),)))
    else:
        applied = next(a for _, a in _baseline_candidates(joint, ctx, kw, (name,), None))
    cost = exposed(applied, joint)
    choice = step_candidate(name, cost, applied.mem)
    ctx.record.step = GraphChoices(reference=choice, choices=(choice,), current=name)
    note = f"one block or a piece of a model: '{name}', chosen for the step's pieces planned together"
    return _piece_outcome(joint, ctx, name, cost, applied, own, note)


def step_candidate(name: str, exposed_s: float, mem) -> Candidate:
    """A compile of a graph as the step's plan across graphs weighs it (``step_model``)."""
    return Candidate(name=name, exposed_s=exposed_s, saved_bytes=mem.saved_bytes,
                     forward_peak_bytes=mem.forward_peak_bytes, backward_peak_bytes=mem.backward_peak_bytes)


def realize_tags(joint: fx.GraphModule, ctx: PassContext, decisions: Decisions) -> None:
    """Leave the compiled plan's tags on ``joint`` (candidates tagged it after)."""
    sub = dataclasses.replace(scratch_context(ctx, decisions.policy), decisions=decisions)
    run_passes(joint, sub, APPLY_PIPELINE, "apply")


def exposed(applied: Applied, joint: fx.GraphModule) -> float:
    """Exposed seconds of a candidate: on-demand recompute (``exposed_s``) plus the part of its
    host copies compute does not hide (offload plans): the one measure candidates compete on."""
    off = applied.record.decisions.get("offload", {})
    return exposed_s(applied.bw, joint) + off.get("exposed_fw_s", 0.0) + off.get("exposed_bw_s", 0.0)


def exposed_s(bw: fx.GraphModule, joint: fx.GraphModule) -> float:
    """Seconds of recompute the backward runs on demand (not inside a communication window),
    from the cost model."""
    joint_nodes = {n.name: n for n in joint.graph.nodes}
    total = 0.0
    for node in bw.graph.nodes:
        if not node.meta.get(meta.RECOMPUTED) or isinstance(node.meta.get(meta.DECISION), Window):
            continue
        cost = (recomputed_source(node, joint_nodes) or node).meta.get(meta.COST)
        total += cost.runtime_s if cost else 0.0
    return total


def exposed_floor(joint: fx.GraphModule, ctx: PassContext, decisions: Decisions) -> float:
    """Seconds of on-demand recompute that ``decisions`` expose at least, known before any
    partition: a tagged forward node a backward node reads cannot be saved (torch's partitioners
    never save a ``PREFER_RECOMPUTE`` node), so it is recomputed, and so are the tagged nodes it
    is computed from. Left out, as torch may save them after all: a tagged node read by a tagged
    node of a later block (``cleanup_recompute_tags`` saves block boundaries), one with a
    backward hook, collectives. :func:`exposed` of the realized plan is never below this
    (``tests/test_exposed_floor.py``)."""
    tagged = {name for unit, d in decisions.recomputed() if not isinstance(d, Window)
              for name in decisions.nodes_of(unit)}
    nodes = {n.name: n for n in joint.graph.nodes}
    forward = ctx.forward_names

    def block(n: fx.Node) -> int:
        return n.meta.get(meta.BLOCK) or 0

    def surely_recomputed(n: fx.Node) -> bool:
        return (n.op == "call_function" and n.name in tagged and not n.meta.get("has_backward_hook")
                and not is_collective_node(n) and not is_wait_node(n)
                and not any(u.name in tagged and u.name in forward and block(u) > block(n) for u in n.users))

    stack = [n for name in tagged if (n := nodes.get(name)) is not None and surely_recomputed(n)
             and any(u.name not in forward for u in n.users)]
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes if surely_recomputed(a))
    # summed in graph order: a float sum in set order differs between processes in its last bit
    return sum((c.runtime_s for n in joint.graph.nodes if n in seen and (c := n.meta.get(meta.COST)) is not None), 0.0)


def seed_with_baselines(joint, ctx: PassContext, kw: dict, budget: int, reference_peak: int,
                        outcome, failure: Exception | None):
    """lynx's plan, or a baseline's when one fits ``budget`` with less exposed recompute.

    The optimizer's model keeps tensors that cross a block boundary and never re-issues a
    collective, so some peaks that ``full``, ``selective`` or torch's min-cut reach lie outside
    its search space. Each baseline is applied and simulated exactly (``realize``); the
    candidate that fits with the least on-demand recompute (``exposed_s``) wins, so lynx reaches
    every peak a baseline reaches with no more exposed recompute. Raises ``failure`` (lynx's
    BudgetError) when nothing fits."""
    from lynx_compile.recompute.optimize import LynxOutcome

    frac = min(1.0, budget / reference_peak)
    scores: dict[str, tuple[float, int]] = {}
    lowest: tuple[int, str] | None = None       # (peak, where) of the lowest-peak candidate
    best = None
    if outcome is not None:
        best = ("lynx", exposed(outcome.applied, joint), outcome)
        scores["lynx"] = (best[1], outcome.applied.mem.peak_bytes)
    # every rank must try the same candidates (torch's are agreed on by a collective each)
    with _compat.eager_dispatch():
        failed_somewhere = any(gather_values(outcome is None))
    settings = TORCH_SETTINGS if failed_somewhere else ()
    policies = BASELINES if ctx.record.blocks else ()
    # where lynx's plan fits, a baseline that exposes at least as much cannot win: not realized
    beat = best[1] if best is not None and not failed_somewhere else None
    for name, applied in _baseline_candidates(joint, ctx, kw, policies, frac, settings, beat=beat):
        if not isinstance(applied, Applied):  # skipped: its floor (0.0 where lynx's plan exposes nothing)
            scores[name] = (applied, None)
            continue
        cost = exposed(applied, joint)
        scores[name] = (cost, applied.mem.peak_bytes)
        # the smallest named is a candidate every budget below the optimizer's reach tries again
        # (full, selective, torch's min-cut at TORCH_SETTINGS), not one at this budget's fraction:
        # else the budget named would be refused in its turn (seen under compiler='eager')
        if (name in policies or name in _SETTING_NAMES) and (lowest is None or applied.mem.peak_bytes < lowest[0]):
            lowest = (applied.mem.peak_bytes, applied.mem.peak_at)
        if applied.mem.peak_bytes <= budget and (best is None or cost < best[1] * (1 - 1e-9)):
            best = (name, cost, LynxOutcome(
                applied=_as_seed(applied),
                problem=outcome.problem if outcome else ctx.record.problem,
                solver=f"baseline:{name}", status="seeded", exposed_s=cost,
                plan_time_s=outcome.plan_time_s if outcome else 0.0,
                solve_s=outcome.solve_s if outcome else 0.0))
    ctx.record.decisions["candidates"] = {
        k: {"exposed_s": e, "peak_bytes": b} if b is not None else
        {"exposed_at_least_s": e, "skipped": "exposes at least as much as lynx's plan"} for k, (e, b) in scores.items()}
    if best is None:
        tried = ", ".join(f"{k} {b / reference_peak:.3f}" for k, (_, b) in scores.items() if b is not None)
        smallest = getattr(failure, "smallest_bytes", None)
        why = f"no plan reaches it. lynx's optimizer: {getattr(failure, 'why', failure)}. Baselines tried as " \
              f"seeds peak at (fraction of the no-recompute peak): {tried}"
        if lowest is not None:
            # the lowest candidate simulated exactly is reachable; the optimizer's own floor is its
            # linear model's and may not be (seen: floor 0.615, the plan for it peaked at 0.632)
            smallest = lowest[0]
            why += f". The lowest of them peaks at {lowest[1]}"
            peaks = [b for _, b in scores.values() if b is not None]  # no candidate (full ... torch@0.1) moves it
            if lowest[0] >= 0.9 * reference_peak or max(peaks) <= 1.01 * min(peaks):
                why += (": recompute cannot lower it, the bytes live there are the step's working set "
                        "(e.g. the logits, the loss, the parameter gradients the backward returns), not "
                        "saved activations")
        raise refuse(ctx.config.budget, reference_peak, smallest, why) from failure
    if best[0] != "lynx":
        why = (f"lynx's optimizer found no plan under this budget ({failure})" if outcome is None else
               f"lynx's own plan exposes {scores['lynx'][0] * 1e3:.3g} ms of recompute")
        note = (f"seeded by baseline '{best[0]}': {why}; '{best[0]}' fits (peak "
                f"{best[2].applied.mem.peak_bytes} B <= {budget} B) exposing {best[1] * 1e3:.3g} ms")
        ctx.record.notes.append(note)
        log.info("lynx: %s", note)
    return best[2]


def _problem_base(joint: fx.GraphModule, ctx: PassContext, kw: dict):
    """(fw, bw) whose saved tensors are lynx's units: the untagged partition of this compiler.
    Under Inductor that is torch.compile's own min-cut partition (plus what recomputing them
    needs): the pointwise chains min-cut recomputes fuse under Inductor and never materialize,
    so they are not units to decide on."""
    clear_decision_tags(joint)
    inductor = ctx.config.compiler == "inductor"
    taken = ctx.untagged.take() if ctx.untagged is not None else None  # the reference's partition
    base_fw, base_bw = taken or partition_joint(joint, ctx.joint_inputs, kw, inductor=inductor)
    if inductor:
        base_bw = mark_recomputed_pass(base_bw, ctx)  # copies renamed: no name clash with units
    return base_fw, base_bw


def _baseline_candidates(joint: fx.GraphModule, ctx: PassContext, kw: dict, policies: tuple[str, ...],
                         frac: float | None, settings: tuple[float, ...] = (), *, beat: float | None = None):
    """(name, Applied) of each baseline in ``policies``, then torch's min-cut at ``frac`` times
    ``TORCH_BUDGET_LADDER`` (not with ``frac`` None) and at each of ``settings``, highest first,
    each applied on a scratch record. torch's min-cut breaks ties in set order, which differs
    between processes (seen on 2 gloo ranks: the same graph, different recomputed getitems):
    with several ranks a torch candidate is used only where every rank partitioned it alike
    (else it is left out on every rank, with a note), so ranks never choose different plans.
    ``beat``: a baseline whose :func:`exposed_floor` is at least this is not realized; it is
    yielded as (name, its floor) instead (the floor reads only the graph: every rank skips alike)."""
    candidates = [(p, None) for p in policies]
    budgets = ({round(frac * m, 3) for m in TORCH_BUDGET_LADDER} if frac is not None else set()) | set(settings)
    candidates += [("torch", b) for b in sorted(budgets, reverse=True)]
    saved_sets: dict = {}     # torch's min-cut: saved values -> the first budget that chose them
    realized: dict[str, Applied] = {}
    for policy, torch_budget in candidates:
        name = f"torch@{torch_budget:g}" if policy == "torch" else policy
        sub = scratch_context(ctx, name)
        if policy != "torch":
            decisions = baseline_decisions(joint, sub, policy)
            floor = exposed_floor(joint, ctx, decisions) if beat is not None else None
            if floor is not None and floor >= beat:
                yield name, floor
                continue
            yield name, realize(joint, sub, decisions, kw)
            continue
        try:  # a budget whose min-cut saves what a higher one saved is that candidate again
            with _compat.min_cut_counts_script_objects_as_zero(), \
                    _compat.min_cut_stops_on_repeat(saved_sets, name):
                applied = realize(joint, sub, Decisions(policy=name), kw, torch_budget=torch_budget)
        except _compat.SameSavedValues as same:
            clear_decision_tags(joint)  # as realize leaves it: min-cut's MUST_SAVE pins are no decision
            applied = realized[same.first]
        realized[name] = applied
        if planning_world_size() > 1:
            with _compat.eager_dispatch():
                tokens = gather_values(partition_token(applied))
            if len(set(tokens)) > 1:
                ctx.record.notes.append(f"{name}: ranks partitioned it differently (torch's min-cut breaks "
                                        "ties in set order), so it is no candidate")
                continue
        yield name, applied


def _as_seed(applied: Applied) -> Applied:
    return dataclasses.replace(applied, decisions=applied.decisions.with_source("seed"))


def smallest_reachable(joint, ctx: PassContext, kw: dict, reference_peak: int) -> tuple[str, int]:
    """(policy, peak) of the baseline with the smallest exact peak (none, selective, full)."""
    peaks = {"none": reference_peak}
    if ctx.record.blocks:
        for policy in ("selective", "full"):
            sub = scratch_context(ctx, policy)
            applied = realize(joint, sub, baseline_decisions(joint, sub, policy), kw)
            peaks[policy] = applied.mem.peak_bytes
    best = min(peaks, key=peaks.get)
    return best, peaks[best]


def budget_error(config, reference_peak, smallest, predicted) -> BudgetError:
    """The refusal of a baseline policy's plan above the budget (``lynx_compile.budget``);
    ``smallest``: (policy, peak) of :func:`smallest_reachable`."""
    policy, peak = smallest
    have = f"policy {config.policy!r} predicts a peak of {predicted} B; " if predicted is not None else ""
    return refuse(config.budget, reference_peak, peak, f"{have}the lowest peak is reached with policy {policy!r}")
