"""lynx's ``partition_fn`` for aot_autograd: passes on the joint graph, then the partition.

::

    joint graph ──annotate_costs──find_blocks──select_recompute──▶ tagged joint graph
        │                                                              │
        └─ default_partition (untagged) = the no-recompute reference   │   (policy lynx:
           (budget fractions are fractions of its peak)                │    optimize.plan_lynx,
                                                                       ▼    seed_with_baselines)
                       compiler="eager": default_partition (tags → saved frontier + recompute,
                       RNG replayed); compiler="inductor": min-cut at budget 1 under the tags;
                       policy "torch": min-cut under activation_memory_budget
                                                                       │
                                       mark_recomputed on the backward ▼
                                simulate_step → RecomputePlan → budget check → (fw, bw)
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.config import LynxConfig
from lynx_compile.distributed.agreement import check_plan_agreement
from lynx_compile.memory.simulate import StepMemory, _nbytes, backward_inputs, simulate_step
from lynx_compile.passes import BACKWARD_PIPELINE, JOINT_PIPELINE, GraphRecord, PassContext, meta, run_passes
from lynx_compile.passes.find_blocks import structural_hash
from lynx_compile.passes.policies import select_recompute_pass
from lynx_compile.plan import BlockSummary, RecomputePlan, TensorDecision
from lynx_compile.optimize import plan_lynx

log = logging.getLogger("lynx_compile")


class BudgetError(ValueError):
    """The memory budget is below what the chosen policy (or any policy) reaches."""


def _clear_tags(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        for key in ("recompute", "ac_graph_id", meta.DECISION, meta.ROLE):
            node.meta.pop(key, None)


def _partition(joint: fx.GraphModule, joint_inputs: Any, policy: str, kw: dict, budget: float = 1.0,
               inductor: bool = False):
    """(fw, bw) of the tagged ``joint``. Tagged nodes are recomputed, their untagged producers
    saved. Without Inductor (``compiler="eager"``) everything untagged is saved (torch's default
    partitioner: the graphs run as written, so that is what they hold). Under Inductor the base
    is torch.compile's own min-cut at budget 1: on top of lynx's tags it also recomputes the
    cheap pointwise chains Inductor fuses into their consumers, so saved bytes only fall and
    ``none`` is exactly torch.compile's default partition."""
    if policy == "torch":
        fw, bw = _compat.min_cut_partition(joint, joint_inputs, memory_budget=budget, **kw)
    elif inductor:
        fw, bw = _compat.min_cut_partition(joint, joint_inputs, memory_budget=1.0, **kw)
    else:
        fw, bw = _compat.default_partition(joint, joint_inputs, **kw)
    # torch's partitioner can leave forward ops copied into the backward with no user there
    # (seen on tensor-parallel graphs: the mm's feeding a saved collective input); they would
    # run every step for nothing.
    if bw.graph.eliminate_dead_code():
        bw.recompile()
    return fw, bw


def _peak_under(policy: str, joint: fx.GraphModule, ctx: PassContext, joint_inputs: Any, kw: dict) -> int:
    """Predicted peak of ``joint`` under a baseline policy (re-tags the graph; restores nothing)."""
    _clear_tags(joint)
    sub = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, policy=policy),
                              record=GraphRecord(graph_id=ctx.record.graph_id, policy=policy,
                                                 blocks=ctx.record.blocks))
    select_recompute_pass(joint, sub)
    fw, bw = _partition(joint, joint_inputs, policy, kw, inductor=ctx.config.compiler == "inductor")
    return simulate_step(fw, bw, fused=ctx.config.compiler == "inductor").peak_bytes


def _budget_bytes(config: LynxConfig, reference_peak: int) -> int | None:
    b = config.memory_budget
    if b is None:
        return None
    return int(b * reference_peak) if isinstance(b, float) else int(b)


def lynx_partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                   config: LynxConfig, record: GraphRecord,
                   static_lifetime_input_indices: list[int] | None = None, **_: Any):
    """Partition ``joint`` into (fw, bw) under ``config.policy``; fills ``record.plan``."""
    kw = dict(num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static_lifetime_input_indices)
    ctx = PassContext(config=config, record=record, num_fwd_outputs=num_fwd_outputs,
                      joint_inputs=joint_inputs,
                      forward_names=frozenset(_compat.forward_node_names(joint)))
    inductor = config.compiler == "inductor"
    # The reference saves every forward value the backward reads: budgets are fractions of it.
    ref_fw, ref_bw = _partition(joint, joint_inputs, "none", kw)
    reference = simulate_step(ref_fw, ref_bw)
    record.reference_peak_bytes = reference.peak_bytes
    budget = _budget_bytes(config, reference.peak_bytes)

    joint = run_passes(joint, ctx, JOINT_PIPELINE, "joint")
    # Hashed before any tagged partition: replaying RNG adds nodes to the joint graph in place.
    ctx.record.decisions["graph_hash"] = structural_hash(list(joint.graph.nodes))
    smallest = None
    if budget is not None and config.policy == "torch":
        smallest = _smallest_reachable(joint, ctx, joint_inputs, kw, reference.peak_bytes)
        _clear_tags(joint)
        select_recompute_pass(joint, ctx)  # restore this policy's tags
        if budget < smallest[1]:
            raise _budget_error(config, budget, reference.peak_bytes, smallest, None)
    outcome = None
    if config.policy == "lynx":
        def partition_and_place(j: fx.GraphModule):
            fw, bw = _partition(j, joint_inputs, "lynx", kw, inductor=inductor)
            return fw, run_passes(bw, ctx, BACKWARD_PIPELINE, "backward")

        base_fw, base_bw = ref_fw, ref_bw
        if inductor:
            # The problem's units are what torch.compile's own partition saves (plus what
            # recomputing them needs): the pointwise chains min-cut recomputes fuse under
            # Inductor and never materialize, so they are not units to decide on.
            from lynx_compile.passes.mark_recomputed import mark_recomputed_pass

            base_fw, base_bw = _partition(joint, joint_inputs, "none", kw, inductor=True)
            base_bw = mark_recomputed_pass(base_bw, ctx)  # copies renamed: no name clash with units
        try:
            outcome, failure = plan_lynx(joint, ctx, base_fw, base_bw, budget, partition_and_place,
                                         _clear_tags), None
        except BudgetError as e:
            if budget is None or config.plan:
                raise
            outcome, failure = None, e
        if budget is not None and not config.plan:
            outcome = seed_with_baselines(joint, ctx, joint_inputs, kw, budget, reference.peak_bytes,
                                          outcome, failure)
        fw, bw, mem = outcome.fw, outcome.bw, outcome.mem
    else:
        if config.policy == "none" and not inductor:
            fw, bw = ref_fw, ref_bw
        else:
            frac = min(1.0, budget / reference.peak_bytes) if budget is not None else 1.0
            fw, bw = _partition(joint, joint_inputs, config.policy, kw, budget=frac, inductor=inductor)
        bw = run_passes(bw, ctx, BACKWARD_PIPELINE, "backward")
        mem = simulate_step(fw, bw, fused=inductor)
    record.plan = build_plan(config.policy, joint, fw, bw, mem, ctx, budget, outcome)
    record.saved_names = tuple(p.name for p in bw.graph.find_nodes(op="placeholder")
                               if not p.name.startswith("tangents"))
    record.problem = outcome.problem if outcome and outcome.problem else record.problem
    record.segment_costs = segment_costs(joint, ctx.forward_names)
    if config.check_plan_agreement:
        with _compat.eager_dispatch():  # real tensors for the all-gather, not the compile's fakes
            record.decisions["plan_fingerprint"] = check_plan_agreement(record.plan, record.graph_id)

    if budget is not None and mem.peak_bytes > budget:
        if config.policy == "torch":
            frac = min(1.0, budget / reference.peak_bytes)
            msg = (f"policy 'torch' at activation_memory_budget={frac:.3f} predicts a peak of "
                   f"{mem.peak_bytes} B, above the budget {budget} B (torch budgets saved bytes, "
                   "not the peak)")
            log.warning("lynx: %s", msg)
            record.notes.append(msg)
        elif config.policy == "lynx":  # only a plan from a file can get here
            raise BudgetError(f"the plan in {config.plan!r} peaks at {mem.peak_bytes} B, above the "
                              f"budget {budget} B; re-plan with `lynx plan --policy lynx --memory-budget "
                              f"{config.memory_budget} --out {config.plan}`")
        else:
            smallest = _smallest_reachable(joint, ctx, joint_inputs, kw, reference.peak_bytes)
            raise _budget_error(config, budget, reference.peak_bytes, smallest, mem.peak_bytes)
    _log_plan(record)
    return fw, bw


def segment_costs(joint: fx.GraphModule, forward_names: frozenset[str]) -> dict:
    """Forward / backward seconds per block and of the work before (``pre``) and after
    (``post``) the blocks. Backward nodes outside blocks follow their forward op (``seq_nr``).
    ``pipe_splits``: the block after each ``pipe_split()`` marker."""
    out = {"blocks": {}, "pre": [0.0, 0.0], "post": [0.0, 0.0], "pipe_splits": []}
    fwd = [n for n in joint.graph.nodes if n.name in forward_names and n.op == "call_function"]
    for i, n in enumerate(fwd):  # a user's pipe_split() marker: a stage must begin at the next block
        if "pipe_split" in str(n.target):
            nxt = next((m.meta[meta.BLOCK] for m in fwd[i + 1:] if m.meta.get(meta.BLOCK) is not None), None)
            if nxt is not None:
                out["pipe_splits"].append(nxt)
    position = {n: i for i, n in enumerate(fwd)}
    in_block = [i for i, n in enumerate(fwd) if n.meta.get(meta.BLOCK) is not None]
    first = in_block[0] if in_block else len(fwd)
    side_of_seq = {}
    for i, n in enumerate(fwd):
        if n.meta.get(meta.BLOCK) is None and "seq_nr" in n.meta:
            side_of_seq[n.meta["seq_nr"]] = "pre" if i < first else "post"
    for n in joint.graph.nodes:
        cost = n.meta.get(meta.COST)
        if n.op != "call_function" or cost is None:
            continue
        is_fw = n.name in forward_names
        block = n.meta.get(meta.BLOCK)
        if block is not None:
            out["blocks"].setdefault(block, [0.0, 0.0])[0 if is_fw else 1] += cost.runtime_s
            continue
        if is_fw:
            side = "pre" if position[n] < first else "post"
        else:
            side = side_of_seq.get(n.meta.get("seq_nr"), "post")
        out[side][0 if is_fw else 1] += cost.runtime_s
    return out


BASELINES = ("full", "selective")
TORCH_BUDGET_LADDER = (1.0, 0.5)
"""torch's min-cut is tried at these multiples of the requested budget fraction: its budget
counts saved bytes, not the peak, so a lower setting may be the one that fits."""


def _exposed_s(bw: fx.GraphModule, joint: fx.GraphModule) -> float:
    """Seconds of recompute the backward runs on demand (not inside a communication window),
    from the cost model: the one measure every candidate plan is compared on."""
    joint_nodes = {n.name: n for n in joint.graph.nodes}
    total = 0.0
    for node in bw.graph.nodes:
        if not node.meta.get(meta.RECOMPUTED) or str(node.meta.get(meta.ROLE, "")).startswith("window:"):
            continue
        src = joint_nodes.get(node.meta.get(meta.RECOMPUTED_FROM, ""))
        cost = (src or node).meta.get(meta.COST)
        total += cost.runtime_s if cost else 0.0
    return total


def seed_with_baselines(joint, ctx, joint_inputs, kw, budget: int, reference_peak: int,
                        outcome, failure: Exception | None):
    """lynx's plan, or a baseline's when one fits ``budget`` with less exposed recompute.

    The optimizer's model keeps tensors that cross a block boundary and never re-issues a
    collective, so some peaks that ``full``, ``selective`` or torch's min-cut reach lie outside
    its search space. Each baseline is partitioned and simulated exactly; the candidate that
    fits with the least on-demand recompute (``_exposed_s``) wins, so lynx reaches every peak a
    baseline reaches with no more exposed recompute. Raises ``failure`` (lynx's BudgetError)
    when nothing fits. Leaves the winner's tags on ``joint``."""
    from lynx_compile.optimize import LynxOutcome

    inductor = ctx.config.compiler == "inductor"
    frac = min(1.0, budget / reference_peak)
    scores: dict[str, tuple[float, int]] = {}
    best = None
    if outcome is not None:
        best = ("lynx", _exposed_s(outcome.bw, joint), outcome)
        scores["lynx"] = (best[1], outcome.mem.peak_bytes)
    lynx_tags = {n.name: (n.meta.get("recompute"), n.meta.get("ac_graph_id"), n.meta.get(meta.DECISION),
                          n.meta.get(meta.ROLE)) for n in joint.graph.nodes}
    candidates = [(p, 1.0) for p in (BASELINES if ctx.record.blocks else ())]
    if _single_process():
        # torch's min-cut breaks ties in set order, which differs between processes (seen on 2
        # gloo ranks: the same graph, different recomputed getitems): with several ranks its
        # partition could differ per rank and deadlock the collectives, so it seeds only here.
        candidates += [("torch", b) for b in sorted({round(frac * m, 3) for m in TORCH_BUDGET_LADDER},
                                                    reverse=True)]
    for policy, torch_budget in candidates:
        name = f"torch@{torch_budget:g}" if policy == "torch" else policy
        _clear_tags(joint)
        # (no graph dumps for candidates: they would overwrite the plan's own)
        sub = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, policy=policy, dump_dir=None),
                                  record=GraphRecord(graph_id=ctx.record.graph_id, policy=policy,
                                                     blocks=ctx.record.blocks))
        select_recompute_pass(joint, sub)
        fw, bw = _partition(joint, joint_inputs, policy, kw, budget=torch_budget, inductor=inductor)
        bw = run_passes(bw, sub, BACKWARD_PIPELINE, "backward")  # its counts go to its own record
        mem = simulate_step(fw, bw, fused=inductor)
        exposed = _exposed_s(bw, joint)
        scores[name] = (exposed, mem.peak_bytes)
        if mem.peak_bytes <= budget and (best is None or exposed < best[1] * (1 - 1e-9)):
            policy, winner_record = name, sub.record
            decisions = _decisions_from_backward(bw, ctx.record.problem)
            best = (policy, exposed, LynxOutcome(
                fw=fw, bw=bw, mem=mem, problem=outcome.problem if outcome else ctx.record.problem,
                decisions=decisions, solver=f"baseline:{policy}", status="seeded", exposed_s=exposed,
                plan_time_s=outcome.plan_time_s if outcome else 0.0,
                solve_s=outcome.solve_s if outcome else 0.0,
                node_unit=outcome.node_unit if outcome else {}))
    ctx.record.decisions["candidates"] = {k: {"exposed_s": e, "peak_bytes": b} for k, (e, b) in scores.items()}
    if best is None:
        tried = ", ".join(f"{k} {b / reference_peak:.3f}" for k, (_, b) in scores.items())
        raise BudgetError(f"{failure} Baselines tried as seeds peak at (fraction of the no-recompute "
                          f"peak): {tried}.") from failure
    _clear_tags(joint)
    if best[0] == "lynx":
        for n in joint.graph.nodes:
            rec, gid, dec, role = lynx_tags[n.name]
            for key, value in (("recompute", rec), ("ac_graph_id", gid), (meta.DECISION, dec), (meta.ROLE, role)):
                if value is not None:
                    n.meta[key] = value
        return best[2]
    for key, value in winner_record.decisions.items():  # what the winner's passes did
        ctx.record.decisions[key] = value
    why = (f"lynx's optimizer found no plan under this budget ({failure})" if outcome is None else
           f"lynx's own plan exposes {scores['lynx'][0] * 1e3:.3g} ms of recompute")
    note = (f"seeded by baseline '{best[0]}': {why}; '{best[0]}' fits (peak {best[2].mem.peak_bytes} B "
            f"<= {budget} B) exposing {best[1] * 1e3:.3g} ms")
    ctx.record.notes.append(note)
    log.info("lynx: %s", note)
    return best[2]


def _single_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _decisions_from_backward(bw: fx.GraphModule, problem) -> dict[str, str]:
    """Per unit of lynx's problem: "demand" if the backward recomputes its op, else "keep"."""
    if problem is None:
        return {}
    recomputed = {n.meta.get(meta.RECOMPUTED_FROM) for n in bw.graph.nodes if n.meta.get(meta.RECOMPUTED)}
    return {u.name: "demand" if u.name in recomputed else "keep" for u in problem.units}


def _smallest_reachable(joint, ctx, joint_inputs, kw, reference_peak) -> tuple[str, int]:
    peaks = {"none": reference_peak}
    if ctx.record.blocks:
        for policy in ("selective", "full"):
            peaks[policy] = _peak_under(policy, joint, ctx, joint_inputs, kw)
    best = min(peaks, key=peaks.get)
    return best, peaks[best]


def _budget_error(config, budget, reference_peak, smallest, predicted) -> BudgetError:
    policy, peak = smallest
    have = f"policy {config.policy!r} predicts a peak of {predicted} B; " if predicted is not None else ""
    return BudgetError(
        f"memory_budget={config.memory_budget!r} ({budget} B) is below what can be reached: {have}"
        f"the smallest reachable peak is {peak} B = {peak / reference_peak:.3f} of the "
        f"no-recompute peak ({reference_peak} B), with policy {policy!r}. "
        f"Use memory_budget >= {peak / reference_peak:.3f} (or >= {peak} bytes).")


def build_plan(policy: str, joint: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule,
               mem: StepMemory, ctx: PassContext, budget: int | None, outcome=None) -> RecomputePlan:
    """Summarize what ``fw``/``bw`` save and recompute (names, bytes, blocks, seconds)."""
    joint_nodes = {n.name: n for n in joint.graph.nodes}
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    input_keys, live = backward_inputs(fw, bw)
    seen: set[str] = set()
    saved = []
    for ph in bw.graph.find_nodes(op="placeholder"):
        src = fw_nodes.get(ph.name)
        if ph.name.startswith("tangents") or (src is not None and src.op == "placeholder"):
            continue
        key = input_keys[ph.name]
        nbytes = 0 if key in seen else live.get(key, 0)
        seen.add(key)
        saved.append(TensorDecision(name=ph.name, block=ph.meta.get(meta.BLOCK), nbytes=nbytes))
    recomputed = []
    for node in bw.graph.nodes:
        if not node.meta.get(meta.RECOMPUTED):
            continue
        src = joint_nodes.get(node.meta.get(meta.RECOMPUTED_FROM, ""))
        cost = (src or node).meta.get(meta.COST)
        recomputed.append(TensorDecision(
            name=node.meta[meta.RECOMPUTED_FROM], block=node.meta.get(meta.BLOCK),
            nbytes=_nbytes(node.meta.get("val")), recompute_s=cost.runtime_s if cost else 0.0))
    blocks = []
    for i, path in enumerate(ctx.record.blocks):
        s = [d for d in saved if d.block == i]
        r = [d for d in recomputed if d.block == i]
        blocks.append(BlockSummary(block=i, path=path, saved_bytes=sum(d.nbytes for d in s),
                                   saved=tuple(d.name for d in s), recomputed=tuple(d.name for d in r),
                                   recompute_s=sum(d.recompute_s for d in r)))
    return RecomputePlan(
        policy=policy, graph_hash=ctx.record.decisions.get("graph_hash") or structural_hash(list(joint.graph.nodes)),
        saved=tuple(saved), recomputed=tuple(recomputed), blocks=tuple(blocks),
        saved_bytes=mem.saved_bytes, peak_bytes=mem.peak_bytes,
        forward_peak_bytes=mem.forward_peak_bytes, backward_peak_bytes=mem.backward_peak_bytes,
        peak_at=mem.peak_at, recompute_s=sum(d.recompute_s for d in recomputed),
        reference_peak_bytes=ctx.record.reference_peak_bytes or 0, budget_bytes=budget,
        notes=tuple(ctx.record.notes),
        decisions=outcome.decisions if outcome else {}, solver=outcome.solver if outcome else "",
        solver_status=outcome.status if outcome else "",
        exposed_s=outcome.exposed_s if outcome else sum(d.recompute_s for d in recomputed),
        plan_time_s=outcome.plan_time_s if outcome else 0.0, solve_s=outcome.solve_s if outcome else 0.0,
        block_ops=_block_ops(joint, ctx, outcome) if outcome else {})


def _block_ops(joint: fx.GraphModule, ctx: PassContext, outcome) -> dict[str, list[tuple[str, str]]]:
    """Per block, its forward aten ops in order with the decision of the unit each belongs to."""
    out: dict[str, list[tuple[str, str]]] = {path: [] for path in ctx.record.blocks}
    for node in joint.graph.nodes:
        block = node.meta.get(meta.BLOCK)
        if block is None or node.op != "call_function" or "nn_module_stack" not in node.meta \
                or node.name not in ctx.forward_names or node.target is operator.getitem:
            continue
        unit = outcome.node_unit.get(node.name)
        out[ctx.record.blocks[block]].append((str(node.target), outcome.decisions.get(unit, "keep")))
    return out


def _log_plan(record: GraphRecord) -> None:
    p = record.plan
    log.info("lynx graph %d: policy=%s blocks=%d saved=%d B peak=%d B (%.2f of no-recompute) "
             "recompute=%.3g s", record.graph_id, p.policy, len(record.blocks), p.saved_bytes,
             p.peak_bytes, p.peak_fraction, p.recompute_s)
