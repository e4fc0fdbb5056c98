"""Seeds: the baselines (``full``, ``selective``, torch's min-cut at several settings) applied
and priced as candidates beside lynx's own plan, and the one measure they compete on.

lynx's optimizer keeps tensors that cross a block boundary and never re-issues a collective, so
some peaks a baseline reaches lie outside its search space. ``seed_with_baselines`` realizes
each candidate (``apply.realize``: partitioned and simulated exactly) and keeps the one that
fits the budget with the least exposed recompute (:func:`exposed`); ``exposed_floor`` skips a
baseline that cannot beat lynx's plan before it is partitioned. ``decide`` calls these; a piece
of a model (``decide.decide_piece``) weighs the same candidates.

A budget that nothing fits is refused naming one number per model and options, whatever budget
was asked: the lowest exact peak of the candidates every such budget tries (``full``,
``selective``, torch's min-cut at ``TORCH_SETTINGS`` and ``LAST_SETTINGS``, the optimizer at its
own smallest peak), never one of a candidate tried for this budget alone (torch's min-cut at
its fraction), so asking for it is accepted.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.budget import budget_error as refuse
from lynx_compile.costs.analytic import is_free_node
from lynx_compile.graph.collectives import is_collective_node, is_wait_node
from lynx_compile.decisions import CandidateKey, Decisions, Demand, Window
from lynx_compile.distributed.agreement import gather_values, planning_world_size
from lynx_compile.costs.inductor_kernels import recompute_seconds, written_seconds
from lynx_compile.memory.inductor_model import is_loop_kernel, value_readers
from lynx_compile.memory.storage import allocations, storage_keys
from lynx_compile.passes import PassContext, meta
from lynx_compile.passes.apply_decisions import clear_decision_tags
from lynx_compile.passes.mark_recomputed import recomputed_source
from lynx_compile.recompute.apply import Applied, partition_token, realize, scratch_context
from lynx_compile.recompute.baselines import baseline_decisions
from lynx_compile.step.model import USER

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
LAST_SETTINGS = (0.05, 0.025)
"""torch's min-cut settings tried, with lynx's optimizer at its own smallest peak
(``optimize.plan_smallest``), when no other candidate fits a budget the optimizer has no plan
under (on any rank). With ``full``, ``selective`` and ``TORCH_SETTINGS`` these are the
candidates of every such budget: the same whatever budget was asked, so every refusal of one
model and set of options names the same smallest budget (their lowest exact peak), and asking
for it is accepted (the candidate reaching it is tried again and fits). 0.05 and 0.025: what a
refusal of 0.05 tried as its own fraction and half of it (torchtitan's llama3 debugmodel
compiled whole: 0.512 of the no-recompute peak at 0.05, where 0.1 ... 0.9 and full reach 0.544
at best). Only when nothing else fits: a budget that something fits pays nothing more."""



def exposed(applied: Applied, joint: fx.GraphModule) -> float:
    """Exposed seconds of a candidate: on-demand recompute (``exposed_s``) plus the part of its
    host copies compute does not hide (offload plans), less the forward writes of the units it
    recomputes (``writes_saved``): the one measure candidates compete on, as the optimizer's
    objective prices it."""
    off = applied.record.stats.get("offload", {})
    return (exposed_s(applied.bw, joint) + off.get("exposed_fw_s", 0.0) + off.get("exposed_bw_s", 0.0)
            - writes_saved(applied))


def writes_saved(applied: Applied) -> float:
    """Seconds of forward writes a candidate saves: ``Unit.write_s`` of each unit of the
    optimizer's problem (``record.problem``) it recomputes (on demand or in a window)."""
    problem = applied.record.problem
    if problem is None:
        return 0.0
    decisions = applied.decisions
    return sum((u.write_s for u in problem.units
                if u.write_s and isinstance(decisions[u.name], (Demand, Window))), 0.0)


def _writes_bound(ctx: PassContext) -> float:
    """The most forward-write seconds any candidate saves (every unit's ``write_s``): what a
    floor on recompute alone is lowered by before it is compared with a candidate's net cost."""
    problem = ctx.record.problem
    return sum((u.write_s for u in problem.units), 0.0) if problem is not None else 0.0


def exposed_s(bw: fx.GraphModule, joint: fx.GraphModule) -> float:
    """Seconds of recompute the backward runs on demand (not inside a communication window),
    from the cost model: by kernel where Inductor compiles it (``costs.inductor_kernels``: a
    recomputed pointwise value inside a kernel that runs anyway costs what it adds to it), else
    per recomputed node."""
    joint_nodes = {n.name: n for n in joint.graph.nodes}

    def seconds(node: fx.Node) -> float:
        cost = (recomputed_source(node, joint_nodes) or node).meta.get(meta.COST)
        return cost.runtime_s if cost else 0.0

    on_demand = [n for n in bw.graph.nodes
                 if n.meta.get(meta.RECOMPUTED) and not isinstance(n.meta.get(meta.DECISION), Window)]
    profile = joint.meta.get(meta.KERNEL_PROFILE)
    if profile is not None and on_demand:
        return recompute_seconds(bw.graph.nodes, on_demand, profile, node_seconds=seconds)
    return sum((seconds(n) for n in on_demand), 0.0)


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
    return _least_seconds(joint, seen)


ACCUMULATE_GRAD = "lynx.accumulate_grads.default"  # (lynx_compile.memory.grad_in_graph's op, by name: no arrow up)


def min_cut_floor(joint: fx.GraphModule, ctx: PassContext, saved: frozenset) -> float:
    """Seconds of on-demand recompute torch's min-cut exposes when it saves ``saved`` (names of
    joint nodes), known from the choice alone: the backward torch extracts is every node the
    backward's outputs are computed from, back to the saved values and the graph's inputs, so
    the forward nodes among them are recomputed. :func:`exposed` of the realized candidate is
    never below this (the passes after the partition only add recompute;
    ``tests/test_min_cut_floor.py``)."""
    out = joint.graph.output_node()
    forward = ctx.forward_names
    seen: set[fx.Node] = set()
    # the backward's outputs, as torch's partitioner reads them: the output's arguments flattened
    stack = [a for a in _compat.tree_leaves(out.args)[ctx.num_fwd_outputs:] if isinstance(a, fx.Node)]
    # and the parameter gradients added into .grad in the graph (lynx_compile.memory.grad_in_graph):
    # side effects the backward runs, which torch's partitioner extracts with it
    stack += [n for n in joint.graph.nodes if n.op == "call_function" and str(n.target) == ACCUMULATE_GRAD]
    while stack:
        n = stack.pop()
        if n in seen or n.name in saved or n.op != "call_function":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return _least_seconds(joint, {n for n in seen if n.name in forward
                                  and not isinstance(n.meta.get(meta.DECISION), Window)})


def _least_seconds(joint: fx.GraphModule, recomputed: set[fx.Node]) -> float:
    """The least seconds that recomputing ``recomputed`` (joint nodes, all of them recomputed on
    demand) exposes: their costs, or priced by kernel (``costs.inductor_kernels``) the kernels of
    their own among them (matmuls, attention, fallbacks) and, for each loop value one of those
    reads, a kernel writing it (its launch and bytes); a loop op may add nothing to a kernel it
    joins. Summed in graph order: a float sum in set order differs between processes in its
    last bit."""
    profile = joint.meta.get(meta.KERNEL_PROFILE)
    total = 0.0
    for n in joint.graph.nodes:
        if n not in recomputed or (c := n.meta.get(meta.COST)) is None:
            continue
        if profile is None or not is_loop_kernel(n):
            total += c.runtime_s
        elif any(r in recomputed and not is_loop_kernel(r) and not is_free_node(r) for r in value_readers(n)):
            total += written_seconds(n, profile)
    return total


def saved_floor_bytes(joint: fx.GraphModule, ctx: PassContext, saved: frozenset, memo: dict | None = None) -> int:
    """Bytes a partition that saves ``saved`` (names of joint nodes) holds when its backward
    starts at least: each storage a saved value lives in (a view's or a getitem's: its base's),
    counted once, at what the forward op allocating it allocates (graph inputs: 0), as the
    memory simulation counts a backward's inputs. Every saved value is live when the backward
    starts, so a candidate's simulated peak is never below this (``tests/test_min_cut_floor.py``).
    ``memo``: a dict kept between calls on one joint (its storages are computed once)."""
    memo = {} if memo is None else memo
    if "keys" not in memo:
        memo["keys"] = {n.name: k for n, k in storage_keys(joint, {}).items()}
        memo["bytes"] = {k: b for n in joint.graph.nodes if n.name in ctx.forward_names for k, b in allocations(n)}
    keys, nbytes = memo["keys"], memo["bytes"]
    return sum(nbytes.get(k, 0) for k in {keys[name] for name in saved if name in keys})


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A candidate not realized because it cannot win: it exposes at least as much recompute as
    the plan to beat (``exposed_at_least_s``), or what it saves alone is over the budget
    (``peak_at_least_bytes``)."""

    exposed_at_least_s: float | None = None
    peak_at_least_bytes: int | None = None

    def stats(self) -> dict:
        if self.peak_at_least_bytes is not None:
            return {"peak_at_least_bytes": self.peak_at_least_bytes,
                    "skipped": "what it saves alone is over the budget"}
        return {"exposed_at_least_s": self.exposed_at_least_s, "skipped": "exposes at least as much as lynx's plan"}


class _CannotWin(Exception):
    """Raised from inside torch's min-cut once its choice of saved values cannot win; the
    partition is not completed."""

    def __init__(self, skipped: Skipped):
        super().__init__(skipped)
        self.skipped = skipped


def seed_with_baselines(joint, ctx: PassContext, kw: dict, budget: int, reference_peak: int,
                        outcome, failure: Exception | None):
    """lynx's plan, or a baseline's when one fits ``budget`` with less exposed recompute.

    The optimizer's model keeps tensors that cross a block boundary and never re-issues a
    collective, so some peaks that ``full``, ``selective`` or torch's min-cut reach lie outside
    its search space. Each baseline is applied and simulated exactly (``realize``); the
    candidate that fits with the least on-demand recompute (``exposed_s``) wins, so lynx reaches
    every peak a baseline reaches with no more exposed recompute. Where the optimizer has no
    plan under the budget (on any rank), torch's min-cut is tried at ``TORCH_SETTINGS`` too, and
    when nothing fits, at ``LAST_SETTINGS`` and the optimizer at its own smallest peak; still
    nothing: a ``BudgetError`` naming the lowest exact peak of those (:func:`_refusal`)."""
    from lynx_compile.recompute.optimize import SMALLEST

    frac = min(1.0, budget / reference_peak)
    weighed = _Weighing(joint, ctx, budget, outcome)
    # every rank must try the same candidates (torch's are agreed on by a collective each)
    with _compat.eager_dispatch():
        failed_somewhere = any(gather_values(outcome is None))
    settings = TORCH_SETTINGS if failed_somewhere else ()
    policies = (*user_candidate(ctx), *(BASELINES if ctx.record.blocks else ()))
    # the candidates of every budget the optimizer does not reach, whatever the budget's fraction
    floor = {*map(CandidateKey, policies), *(CandidateKey("torch", setting=s) for s in settings)} if failed_somewhere else set()
    # where lynx's plan fits, a baseline that exposes at least as much cannot win: not realized
    beat = weighed.best[1] if weighed.best is not None and not failed_somewhere else None
    tried: dict[CandidateKey, Applied] = {}
    for name, applied in baseline_candidates(joint, ctx, kw, policies, frac, settings, beat=beat,
                                             budget=budget if beat is not None else None):
        weighed.add(name, applied, name in floor)
        if isinstance(applied, Applied):
            tried[name] = applied
    if failed_somewhere:
        with _compat.eager_dispatch():
            nothing_fits = any(gather_values(weighed.best is None))
        if nothing_fits:  # on every rank: the optimizer's solve is agreed on by a collective
            for name, applied in _last_candidates(joint, ctx, kw, tried):
                weighed.add(name, applied, True)
    ctx.record.stats["candidates"] = {
        str(k): {"exposed_s": e, "peak_bytes": b} if b is not None else e.stats() for k, (e, b) in weighed.scores.items()}
    best = weighed.best
    if best is None:
        if failure is not None:  # the refusal names the lowest of every candidate: the optimizer's own under -v
            log.debug("lynx: graph %d: lynx's optimizer on its own: %s", ctx.record.graph_id, failure)
        raise _refusal(ctx, reference_peak, weighed.floor, failure) from None
    if best[0] != CandidateKey("lynx"):
        why = (f"lynx's optimizer found no plan under this budget ({getattr(failure, 'why', failure)})"
               if outcome is None else
               f"lynx's own plan exposes {weighed.scores[CandidateKey('lynx')][0] * 1e3:.3g} ms of recompute")
        what = "lynx's optimizer at its own smallest peak" if best[0] == SMALLEST else "baseline"
        note = (f"seeded by {what} '{best[0]}': {why}; '{best[0]}' fits (peak "
                f"{best[2].applied.mem.peak_bytes} B <= {budget} B) exposing {best[1] * 1e3:.3g} ms")
        ctx.record.notes.append(note)
        log.info("lynx: %s", note)
    return best[2]


class _Weighing:
    """The candidates of :func:`seed_with_baselines` as they are realized: each one's (exposed
    seconds, exact peak) or ``Skipped`` (``scores``), the best that fits the budget (``best``:
    name, exposed seconds, ``LynxOutcome``), and those a refusal names the lowest of (``floor``)."""

    def __init__(self, joint, ctx: PassContext, budget: int, outcome):
        self.joint, self.ctx, self.budget, self.outcome = joint, ctx, budget, outcome
        self.scores: dict[CandidateKey, tuple] = {}
        self.floor: dict[CandidateKey, Applied] = {}
        self.best = None
        if outcome is not None:
            self.best = (CandidateKey("lynx"), exposed(outcome.applied, joint), outcome)
            self.scores[self.best[0]] = (self.best[1], outcome.applied.mem.peak_bytes)

    def add(self, name: CandidateKey, applied: Applied | Skipped, in_floor: bool) -> None:
        from lynx_compile.recompute.optimize import SMALLEST, LynxOutcome

        if isinstance(applied, Skipped):
            self.scores[name] = (applied, None)
            return
        cost = exposed(applied, self.joint)
        self.scores[name] = (cost, applied.mem.peak_bytes)
        regions = self.ctx.region_check
        if regions is not None and regions.over(applied.fw, applied.bw):
            return  # above one of the model's region budgets: not a plan, nor a floor
        if in_floor:
            self.floor[name] = applied
        if applied.mem.peak_bytes <= self.budget and (self.best is None
                                                      or cost < self.best[1] - 1e-9 * abs(self.best[1])):
            outcome = self.outcome
            self.best = (name, cost, LynxOutcome(
                applied=as_seed(applied), problem=outcome.problem if outcome else self.ctx.record.problem,
                solver=str(name) if name == SMALLEST else f"baseline:{name}", status="seeded", exposed_s=cost,
                plan_time_s=outcome.plan_time_s if outcome else 0.0, solve_s=outcome.solve_s if outcome else 0.0))


def _last_candidates(joint, ctx: PassContext, kw: dict, tried: dict[CandidateKey, Applied]):
    """(name, Applied) of torch's min-cut at ``LAST_SETTINGS``, then of lynx's optimizer at its
    own smallest peak (``optimize.plan_smallest``). A setting the budget's fraction already
    tried (``tried``: a refusal at 0.05 tries 0.05 and 0.025 first) is that candidate again, not
    partitioned twice (every rank tried the same settings: they skip alike)."""
    from lynx_compile.recompute.optimize import SMALLEST, plan_smallest

    keys = [CandidateKey("torch", setting=s) for s in LAST_SETTINGS]
    new = dict(baseline_candidates(joint, ctx, kw, (), None, tuple(k.setting for k in keys if k not in tried)))
    yield from ((k, tried.get(k) or new[k]) for k in keys if k in tried or k in new)  # in LAST_SETTINGS' order
    applied = plan_smallest(joint, ctx, kw)
    if applied is not None:
        yield SMALLEST, applied


def _refusal(ctx: PassContext, reference_peak: int, floor: dict[CandidateKey, Applied], failure: Exception | None):
    """The ``BudgetError`` when no candidate fits, naming the lowest exact peak of ``floor`` (the
    candidates of every budget the optimizer does not reach, which every such budget tries
    again); without any, the optimizer's own smallest (``failure``'s)."""
    if not floor:
        return refuse(ctx.budget, reference_peak, getattr(failure, "smallest_bytes", None),
                      f"no plan reaches it. lynx's optimizer: {getattr(failure, 'why', failure)}")
    name = min(floor, key=lambda n: floor[n].mem.peak_bytes)  # of equal peaks, the first tried
    low = floor[name].mem
    why = f"the lowest of lynx's candidates, {name}, peaks at {low.peak_at}"
    peaks = [a.mem.peak_bytes for a in floor.values()]
    if low.peak_bytes >= 0.9 * reference_peak or max(peaks) <= 1.01 * low.peak_bytes:  # nothing moves it
        why += (": recompute cannot lower it, the bytes live there are the step's working set "
                "(e.g. the logits, the loss, the parameter gradients the backward returns), not "
                "saved activations")
    if ctx.user_tags is not None and ctx.user_tags.must_save:
        why += (f"; the {len(ctx.user_tags.must_save)} values the model's selective checkpointing policy marks "
                "MUST_SAVE are saved in every plan (mark them PREFER_SAVE to let lynx recompute them)")
    return refuse(ctx.budget, reference_peak, low.peak_bytes, why)


def baseline_candidates(joint: fx.GraphModule, ctx: PassContext, kw: dict, policies: tuple[str, ...],
                         frac: float | None, settings: tuple[float, ...] = (), *, beat: float | None = None,
                         budget: int | None = None):
    """(name, Applied) of each baseline in ``policies``, then torch's min-cut at ``frac`` times
    ``TORCH_BUDGET_LADDER`` (not with ``frac`` None) and at each of ``settings``, highest first,
    each applied on a scratch record. torch's min-cut breaks ties in set order, which differs
    between processes (seen on 2 gloo ranks: the same graph, different recomputed getitems):
    with several ranks a torch candidate is used only where every rank partitioned it alike
    (else it is left out on every rank, with a note), so ranks never choose different plans.

    ``beat`` (the exposed seconds of a plan that fits): a candidate that cannot win is yielded as
    (name, :class:`Skipped`) instead of being realized. A baseline whose :func:`exposed_floor`
    is at least ``beat`` is not partitioned (the floor reads only the graph: every rank skips
    alike). A torch min-cut choice (and, planned on one rank, a baseline's under Inductor, which
    partitions with min-cut too) is not extracted when what it saves exposes at least ``beat``
    (:func:`min_cut_floor`) or holds more than ``budget`` bytes (:func:`saved_floor_bytes`);
    with several ranks a torch candidate is skipped only where every rank skips it (where some
    do and some do not, it is no candidate, as a tie broken apart is)."""
    candidates = [(p, None) for p in policies]
    budgets = ({round(frac * m, 3) for m in TORCH_BUDGET_LADDER} if frac is not None else set()) | set(settings)
    candidates += [("torch", b) for b in sorted(budgets, reverse=True)]
    saved_sets: dict = {}     # torch's min-cut: saved values -> the first budget that chose them
    realized: dict[str, Applied | Skipped] = {}
    several = planning_world_size() > 1
    storages: dict = {}  # the joint's storages, for saved_floor_bytes
    for policy, torch_budget in candidates:
        name = CandidateKey("torch", setting=torch_budget) if policy == "torch" else CandidateKey(policy)
        sub = scratch_context(ctx, policy, str(name))
        check = contextlib.nullcontext()
        if beat is not None and (policy == "torch" or not several):  # a choice that cannot win is not extracted
            check = _compat.min_cut_checks_choice(functools.partial(_check_choice, joint, ctx, beat, budget, storages))
        if policy != "torch":
            user = policy == USER
            decisions = Decisions(policy=USER) if user else baseline_decisions(joint, sub, policy)
            floor = exposed_floor(joint, ctx, decisions) - _writes_bound(ctx) if beat is not None and not user else None
            if floor is not None and floor >= beat:
                yield name, Skipped(exposed_at_least_s=floor)
                continue
            try:
                with check:
                    applied = realize(joint, sub, decisions, kw, as_user_tagged=user)
            except _CannotWin as no:
                clear_decision_tags(joint)
                applied = no.skipped
            yield name, applied
            continue
        try:  # a budget whose min-cut saves what a higher one saved is that candidate again
            with _compat.min_cut_counts_script_objects_as_zero(), \
                    _compat.min_cut_stops_on_repeat(saved_sets, name), check:
                applied = realize(joint, sub, Decisions(policy=str(name)), kw, torch_budget=torch_budget)
        except _compat.SameSavedValues as same:
            clear_decision_tags(joint)  # as realize leaves it: min-cut's MUST_SAVE pins are no decision
            applied = realized[same.first]
        except _CannotWin as no:
            clear_decision_tags(joint)
            applied = no.skipped
        realized[name] = applied
        if several:
            with _compat.eager_dispatch():
                tokens = gather_values(partition_token(applied) if isinstance(applied, Applied) else "skipped")
            if len(set(tokens)) > 1:
                ctx.record.notes.append(f"{name}: ranks partitioned it differently (torch's min-cut breaks "
                                        "ties in set order), so it is no candidate")
                continue
        yield name, applied


def _check_choice(joint: fx.GraphModule, ctx: PassContext, beat: float, budget: int | None, storages: dict,
                  saved: frozenset) -> None:
    """Raise :class:`_CannotWin` when a min-cut choice that saves ``saved`` cannot win."""
    floor = min_cut_floor(joint, ctx, saved) - _writes_bound(ctx)
    if floor >= beat:
        raise _CannotWin(Skipped(exposed_at_least_s=floor))
    held = saved_floor_bytes(joint, ctx, saved, storages) if budget is not None else 0
    if budget is not None and held > budget:
        raise _CannotWin(Skipped(peak_at_least_bytes=held))


def user_candidate(ctx: PassContext) -> tuple[str, ...]:
    """``(USER,)`` where the joint carries the user's checkpoint tags, else ``()``."""
    return (USER,) if ctx.user_tags is not None else ()


def as_seed(applied: Applied) -> Applied:
    return dataclasses.replace(applied, decisions=applied.decisions.with_source("seed"))
