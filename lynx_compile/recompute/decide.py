"""Decide: every policy's choice for one joint graph, as one applied ``Decisions`` record.

::

    policy none / full / selective ── baseline_decisions ─────────────┐
    policy torch ── min-cut at the budget, read back ─────────────────┤
    policy lynx ── optimize.plan_lynx (solve, re-solve on overshoot) ─┼─▶ apply.realize ─▶ Applied
                └─ seed_with_baselines: full, selective, torch min-cut ┘   (fw, bw, exact peak)
                   candidates, least exposed recompute that fits wins (torch's min-cut at
                   the budget fraction and half of it; at 0.1 ... 0.9 too when plan_lynx fails)

The seeds and the measure they compete on (``exposed``) are in ``recompute/seeds.py``.
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

from lynx_compile.budget import budget_error as refuse
from lynx_compile.decisions import BudgetError, CandidateKey, Decisions
from lynx_compile.errors import without_tracebacks
from lynx_compile.memory.simulate import saved_input_bytes
from lynx_compile.memory.storage import _nbytes
from lynx_compile.passes import APPLY_PIPELINE, PassContext, run_passes
from lynx_compile.passes.apply_decisions import clear_decision_tags
from lynx_compile.passes.mark_recomputed import mark_recomputed_pass
from lynx_compile.recompute import seeds
from lynx_compile.recompute.apply import Applied, activation_inputs, partition_joint, realize, scratch_context
from lynx_compile.recompute.baselines import baseline_decisions
from lynx_compile.recompute.regions import RegionBudgetError
from lynx_compile.step.model import USER, Candidate, GraphChoices, provisional_pick

log = logging.getLogger("lynx_compile")


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
        if budget is None or cfg.plan or isinstance(e, RegionBudgetError):
            raise
        outcome, failure = None, without_tracebacks(e)
    if budget is not None and not cfg.plan:
        outcome = seeds.seed_with_baselines(joint, ctx, kw, budget, reference_peak, outcome, failure)
        # the plan time a user sees covers the baselines tried as seeds (and a failed solve)
        outcome.plan_time_s = time.perf_counter() - start
    if outcome.applied.record is not ctx.record:  # a seed won: its passes' counts are the plan's
        ctx.record.stats.update(outcome.applied.record.stats)
    realize_tags(joint, ctx, outcome.decisions)
    return outcome


def decide_piece(joint: fx.GraphModule, ctx: PassContext, kw: dict, budget: int | None,
                 reference_saved: int) -> tuple[Applied, Any]:
    """A graph that is one block or a piece of a model (``find_blocks``: no module-list
    children): the budget bounds the bytes it saves for its backward, which is what adds up
    across the pieces (its own peak is mostly the one block's backward, the same under any
    plan). Baseline policies are applied as asked. Policy lynx, before a step is recorded
    (``record.provisional``: a model compiled in pieces under a step recorder), takes the
    candidate of least memory in a step of any number of calls (``step.model.provisional_pick``;
    none at a budget of the whole step) until the step's plan chooses; without a recorder, the
    candidate (none, full, selective, torch's min-cut at the budget and half of it, lynx's
    optimizer) that saves no more than ``budget`` with the least exposed recompute; when none
    does (a loss-only graph saves what nothing recomputes), the one that saves least, with a
    warning naming the graph break."""
    cfg = ctx.config
    if cfg.policy != "lynx":
        return decide(joint, ctx, kw, None, reference_saved)
    frac = min(1.0, budget / reference_saved) if budget is not None and reference_saved else 1.0
    forced = ctx.record.step_choice
    if forced is not None:  # the step's plan across graphs chose this candidate (step.recorder)
        return _forced_piece(joint, ctx, kw, forced, frac)
    from lynx_compile.recompute.optimize import with_piece_cache

    return with_piece_cache(joint, ctx, kw, budget, reference_saved,
                            lambda: _plan_piece(joint, ctx, kw, budget, reference_saved, frac))


def _plan_piece(joint, ctx: PassContext, kw: dict, budget: int | None, reference_saved: int, frac: float):
    """:func:`decide_piece`'s candidates weighed, the provisional choice made."""
    scored, own = [], None
    regions = ctx.region_check
    if (budget is not None or regions is not None) and ctx.record.reference_peak_bytes:
        # lynx's optimizer too (it places recompute in communication windows): solved for the
        # same fraction of the peak, a candidate like the others when what it saves fits
        from lynx_compile.recompute.optimize import plan_lynx

        try:
            own = plan_lynx(joint, ctx, *_problem_base(joint, ctx, kw),
                            int(frac * ctx.record.reference_peak_bytes), kw)
            scored.append((CandidateKey("lynx"), seeds.exposed(own.applied, joint), own.applied))
        except BudgetError as e:
            if isinstance(e, RegionBudgetError):
                raise
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
            scored.append((CandidateKey("lynx", nbytes=target), seeds.exposed(more.applied, joint), more.applied))
            own = own or more
    # no budget: only none (recompute nothing beyond what the compiler does on its own)
    policies = ("none", *seeds.user_candidate(ctx), *seeds.BASELINES) if budget is not None else ("none",)
    # with a budget, torch's min-cut at every setting too: the step's plan across pieces
    # (step.recorder) picks from these, and steps between them are what lets it fit a budget closely
    settings = seeds.TORCH_SETTINGS if budget is not None else ()
    seen = set()
    for name, applied in seeds.baseline_candidates(joint, ctx, kw, policies, frac if budget is not None else None,
                                              settings):
        cost = seeds.exposed(applied, joint)
        same = (applied.mem.saved_bytes, applied.mem.forward_peak_bytes, applied.mem.backward_peak_bytes, cost)
        if same not in seen:  # min-cut gives the same partition at many settings
            seen.add(same)
            scored.append((name, cost, applied))
    acts = activation_inputs(joint, kw)
    as_candidate = lambda n, e, a: step_candidate(n, e, a.mem, saved_input_bytes(a.fw, a.bw, acts))  # noqa: E731
    none = next(as_candidate(n, e, a) for n, e, a in scored if n == CandidateKey("none"))  # the budget's 100%
    if regions is not None:  # the model's region budgets bound every candidate
        scored = [c for c in scored if not regions.over(c[2].fw, c[2].bw)]
        if not scored:
            raise RegionBudgetError("lynx: no plan of this piece holds the model's region budgets "
                                    f"({', '.join(r.name for r in regions.regions)}); raise the region budgets")
    ctx.record.stats["candidates"] = {str(n): {"exposed_s": e, "saved_bytes": a.mem.saved_bytes} for n, e, a in scored}
    choices = tuple(as_candidate(n, e, a) for n, e, a in scored)
    fitting = [c for c in scored if budget is None or c[2].mem.saved_bytes <= budget]
    if budget is not None and ctx.record.provisional and frac < 1.0:
        # before a step is recorded nothing says what the other pieces and the code outside them
        # hold: the least memory, whatever it costs, until the step's plan chooses (step.recorder).
        # (At a budget of the whole step with no recompute, recomputing nothing is within it:
        # qwen3 under TP at 1.0 measured 42.11 MB at step 1 with the least memory, 40.96 with none.)
        # Pieces with communication windows (FSDP2, TP, EP) too: until session 43 they took the
        # least exposed recompute saving no more than the budget's fraction (recomputing in the
        # windows where it could), and llama3 under TP at 0.936 measured 10.24 MB at step 1
        # against a step budget of 9.72 MB, above Inductor's step with no recompute (10.16 MB);
        # now 9.72 MB. The windows are the step's plan's to fill.
        grads = ctx.record.new_grad_bytes
        pick = provisional_pick(choices, grads)
        name, cost, applied = next(c for c in scored if c[0] == pick.name)
        mine = next((c for c in scored if c[0] == CandidateKey(USER)), None)
        if mine is not None and mine[2].mem.saved_bytes <= budget:
            # the user's own checkpointing fits: what torch.compile would run, until the step's plan
            name, cost, applied = mine
        ctx.record.step = GraphChoices(reference=none, choices=choices, current=name,
                                       incoming_bytes=incoming_bytes(joint))
        note = (f"one block or a piece of a model, planned before a step was recorded: '{name}', the candidate "
                "of least memory in a step of any number of calls (step.model.provisional_pick), until the step's "
                "pieces are planned together (lynx_compile.step.recorder)")
        return _piece_outcome(joint, ctx, name, cost, applied, own, note)
    if fitting:
        name, cost, applied = min(fitting, key=lambda c: (c[1], c[2].mem.saved_bytes))
    else:
        name, cost, applied = min(scored, key=lambda c: (c[2].mem.saved_bytes, c[1]))
        msg = (f"graph {ctx.record.graph_id} is one block or a piece of a model (no module-list children; "
               f"a graph break or a per-block compile), where {ctx.budget.given()} bounds the "
               f"bytes it saves for its backward ({budget} B of {reference_saved} B); no plan saves that "
               f"little (least: '{name}', {applied.mem.saved_bytes} B), so that one is used. If this graph "
               "should not be separate, TORCH_LOGS=graph_breaks shows why dynamo split the model.")
        log.warning("lynx: %s", msg)
        ctx.record.notes.append(msg)
    ctx.record.step = GraphChoices(reference=none, choices=choices, current=name,
                                   incoming_bytes=incoming_bytes(joint))
    note = (f"one block or a piece of a model: provisionally the budget bounds saved bytes; '{name}' chosen "
            "(the step's pieces are planned together once a step has run: lynx_compile.step.recorder)")
    return _piece_outcome(joint, ctx, name, cost, applied, own, note)


def _piece_outcome(joint, ctx: PassContext, name: CandidateKey, cost: float, applied: Applied, own, note: str):
    from lynx_compile.recompute.optimize import LynxOutcome

    ctx.record.stats.update(applied.record.stats)
    realize_tags(joint, ctx, applied.decisions)
    ctx.record.notes.append(note)
    if name == CandidateKey("lynx"):
        return own.applied, own
    outcome = LynxOutcome(applied=seeds.as_seed(applied),
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


def _forced_piece(joint, ctx: PassContext, kw: dict, name: CandidateKey, frac: float):
    """Candidate ``name`` of :func:`decide_piece` made as it was then: lynx's optimizer at the
    same fraction or at its peak, a baseline, or torch's min-cut at its setting."""
    own = None
    if name.policy == "lynx":
        from lynx_compile.recompute.optimize import plan_lynx

        target = name.nbytes if name.nbytes is not None else int(frac * ctx.record.reference_peak_bytes)
        own = plan_lynx(joint, ctx, *_problem_base(joint, ctx, kw), target, kw)
        applied = own.applied
    elif name.policy == "torch":
        applied = _only(name, seeds.baseline_candidates(joint, ctx, kw, (), None, (name.setting,)), ctx)
    else:
        applied = _only(name, seeds.baseline_candidates(joint, ctx, kw, (name.policy,), None), ctx)
    cost = seeds.exposed(applied, joint)
    choice = step_candidate(name, cost, applied.mem,
                            saved_input_bytes(applied.fw, applied.bw, activation_inputs(joint, kw)))
    ctx.record.step = GraphChoices(reference=choice, choices=(choice,), current=name,
                                   incoming_bytes=incoming_bytes(joint))
    note = f"one block or a piece of a model: '{name}', chosen for the step's pieces planned together"
    return _piece_outcome(joint, ctx, name, cost, applied, own, note)


def _only(name: CandidateKey, candidates, ctx: PassContext):
    """The one candidate ``baseline_candidates`` yields for ``name``; none (with several ranks:
    they partitioned it apart, torch's min-cut breaking a tie in set order) is an error naming it
    (it was a ``StopIteration`` escaping the compile)."""
    for _, applied in candidates:
        return applied
    from lynx_compile.distributed.agreement import PlanMismatchError

    raise PlanMismatchError(
        f"lynx: the step's plan chose '{name}' for this graph, and the ranks partitioned it differently "
        f"this time ({'; '.join(ctx.record.notes[-1:])}). Plan once with `lynx plan --out plan.json` and pass "
        "plan='plan.json' on every rank, or ask for another memory_budget.")


def step_candidate(name: CandidateKey, exposed_s: float, mem, held_inputs: int = 0) -> Candidate:
    """A compile of a graph as the step's plan across graphs weighs it (``step.model``).
    ``held_inputs``: the bytes of activation inputs it saves (``memory.simulate.saved_input_bytes``),
    alive from its forward to its backward only because it saves them: counted in what it saves
    and in its backward's peak."""
    return Candidate(name=name, exposed_s=exposed_s, saved_bytes=mem.saved_bytes + held_inputs,
                     forward_peak_bytes=mem.forward_peak_bytes,
                     backward_peak_bytes=mem.backward_peak_bytes + held_inputs)


def incoming_bytes(joint: fx.GraphModule) -> int:
    """Bytes of the gradients the graph's backward receives (the joint's ``tangents_*``):
    ``step.model.GraphChoices.incoming_bytes``."""
    return sum(_nbytes(n.meta.get("val")) for n in joint.graph.find_nodes(op="placeholder")
               if n.name.startswith("tangents"))


def realize_tags(joint: fx.GraphModule, ctx: PassContext, decisions: Decisions) -> None:
    """Leave the compiled plan's tags on ``joint`` (candidates tagged it after)."""
    # (only apply_decisions_pass runs in it: the policy of the context is the graph's own)
    sub = dataclasses.replace(scratch_context(ctx, ctx.config.policy, decisions.policy), decisions=decisions)
    run_passes(joint, sub, APPLY_PIPELINE, "apply")


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


def smallest_reachable(joint, ctx: PassContext, kw: dict, reference_peak: int) -> tuple[str, int]:
    """(policy, peak) of the baseline with the smallest exact peak (none, selective, full)."""
    peaks = {"none": reference_peak}
    if ctx.record.blocks:
        for policy in ("selective", "full"):
            sub = scratch_context(ctx, policy, policy)
            applied = realize(joint, sub, baseline_decisions(joint, sub, policy), kw)
            peaks[policy] = applied.mem.peak_bytes
    best = min(peaks, key=peaks.get)
    return best, peaks[best]


def budget_error(ctx: PassContext, reference_peak, smallest, predicted) -> BudgetError:
    """The refusal of a baseline policy's plan above the graph's budget (``lynx_compile.budget``);
    ``smallest``: (policy, peak) of :func:`smallest_reachable`."""
    policy, peak = smallest
    have = f"policy {ctx.config.policy!r} predicts a peak of {predicted} B; " if predicted is not None else ""
    return refuse(ctx.budget, reference_peak, peak, f"{have}the lowest peak is reached with policy {policy!r}")
