"""lynx's ``partition_fn`` for aot_autograd: analyse, decide, apply, verify, record.

::

    joint ──JOINT_PIPELINE (annotate_costs, find_blocks)──▶ analysed joint
        │
        ├─ untagged default partition = the no-recompute reference (budgets are fractions of it)
        ▼
    decide.decide (policy → Decisions) ── apply.realize (tag, partition, backward passes,
        exact simulated peak) ──▶ Applied(fw, bw, mem) ──▶ RecomputePlan, budget check ──▶ (fw, bw)
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.recompute import regions as region_budgets
from lynx_compile.recompute import seeds
from lynx_compile.recompute.apply import Applied, realize, scratch_context, untagged_partition
from lynx_compile.budget import budget_error as refuse
from lynx_compile.budget import Budget, format_bytes
from lynx_compile.config import LynxConfig
from lynx_compile.recompute.decide import budget_error, decide, decide_piece, incoming_bytes, smallest_reachable, step_candidate
from lynx_compile.decisions import BudgetError, CandidateKey, Decisions
from lynx_compile.distributed.agreement import check_plan_agreement
from lynx_compile.memory.simulate import backward_inputs
from lynx_compile.memory.storage import _nbytes
from lynx_compile.passes import JOINT_PIPELINE, PREPARE_PIPELINE, GraphRecord, PassContext, meta, run_passes
from lynx_compile.passes import user_tags
from lynx_compile.passes.context import TakeOnce
from lynx_compile.passes.find_blocks import WHOLE_GRAPH, structural_hash
from lynx_compile.passes.mark_recomputed import recomputed_source
from lynx_compile.recompute_plan import BlockSummary, RecomputePlan, TensorDecision
from lynx_compile.step.model import USER, GraphChoices

log = logging.getLogger("lynx_compile")
__all__ = ["BudgetError", "lynx_partition", "build_plan", "segment_costs"]


def _budget_bytes(budget: Budget | None, reference_peak: int) -> int | None:
    return None if budget is None else budget.bytes_of(reference_peak)


_warned_loose: set[str] = set()


def _warn_loose_budget(budget: Budget, reference_peak: int) -> None:
    """A ``memory_budget`` in bytes at or above a whole graph's no-recompute peak constrains
    nothing: said once per budget (a size typed for another model, a unit slip: '48MB' for
    '48KB'). Not a ``device_budget``: "the device's memory" is meant to hold a step that fits."""
    given = budget.given()
    if given in _warned_loose:
        return
    _warned_loose.add(given)
    log.warning("lynx: %s (%d B) is at or above this graph's no-recompute peak (%s, %d B): it constrains "
                "nothing (a fraction such as memory_budget=0.7 is relative to that peak)",
                given, budget.nbytes, format_bytes(reference_peak), reference_peak)


def lynx_partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                   config: LynxConfig, record: GraphRecord,
                   static_lifetime_input_indices: list[int] | None = None, **_: Any):
    """Partition ``joint`` into (fw, bw) under ``config.policy``; fills ``record.plan``.

    Every partition of this joint (the reference, the candidates) shares torch's min-cut
    solves (``_compat.shared_min_cut_solves``): most of them solve the same cuts."""
    with _compat.shared_min_cut_solves():
        return _lynx_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, config=config, record=record,
                               static_lifetime_input_indices=static_lifetime_input_indices)


def _lynx_partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, config: LynxConfig,
                    record: GraphRecord, static_lifetime_input_indices: list[int] | None):
    kw = dict(num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static_lifetime_input_indices)
    prepare = PassContext(config=config, record=record, num_fwd_outputs=num_fwd_outputs, joint_inputs=joint_inputs,
                          forward_names=frozenset())
    joint = run_passes(joint, prepare, PREPARE_PIPELINE, "prepare")  # the reference is of the prepared joint
    # CSE'd before the reference too: under Inductor min-cut does it anyway; under the eager
    # compiler every plan runs the CSE'd joint, and the joint as traced can compute a value
    # several times (HF Llama: its causal mask once per layer, each saved: 2.6% of the step)
    joint = _compat.canonicalize_joint(joint)
    user = user_tags.read(joint)  # the user's checkpoint regions / SAC policy, before any tag is cleared
    # regions with their own budget, taken off the joint (torch's min-cut, which lynx calls, would apply one)
    regions = region_budgets.read_regions(joint, frozenset(_compat.forward_node_names(joint)))
    # The reference is this compiler's no-recompute step (torch.compile's own under Inductor):
    # budgets are fractions of its peak (of its saved bytes for a piece of a model).
    inductor = config.compiler == "inductor"
    reference = region_check = None
    grads = record.grads_in_graph
    if grads is not None and grads.applies:  # the reference first: fractions stay of torch.compile's step
        from lynx_compile.memory.grad_in_graph import param_indices, rewrite_joint

        ref_fw, ref_bw, reference = untagged_partition(joint, joint_inputs, kw, inductor=inductor)
        region_check = region_budgets.bind(regions, ref_fw, ref_bw)
        record.stats["grads_in_graph"] = rewrite_joint(
            joint, num_fwd_outputs, param_indices(joint, num_fwd_outputs, static_lifetime_input_indices),
            new_grads=grads.new_grads, may_keep=not inductor or config.policy not in ("none", "torch"))
    ctx = PassContext(config=config, record=record, num_fwd_outputs=num_fwd_outputs,
                      joint_inputs=joint_inputs,
                      forward_names=frozenset(_compat.forward_node_names(joint)),
                      user_tags=user if config.policy == "lynx" else None)
    joint = run_passes(joint, ctx, JOINT_PIPELINE, "joint")  # (meta only: costs, blocks)
    if reference is None:  # its graphs are lynx's problem base too, taken once (decide._problem_base)
        base_fw, base_bw, reference = untagged_partition(joint, joint_inputs, kw, inductor=inductor)
        ctx.untagged = TakeOnce((base_fw, base_bw))
        region_check = region_budgets.bind(regions, base_fw, base_bw)
    if region_check is not None and config.policy != "lynx":
        record.notes.append(f"{len(regions)} region budget(s) of the model: not applied by policy {config.policy!r} "
                            "(policy 'lynx', the default, plans within them)")
        region_check = None
    ctx.region_check = region_check
    record.reference_peak_bytes = reference.peak_bytes
    # Hashed before any tagged partition: replaying RNG adds nodes to the joint graph in place.
    ctx.record.stats["graph_hash"] = structural_hash(list(joint.graph.nodes))
    if config.cost_source == "analytic":  # the numbers recompute was priced with (measured or datasheet)
        from lynx_compile.costs import get_profile

        ctx.record.stats["profile"] = get_profile(config.hardware).summary()
    piece = record.blocks == [WHOLE_GRAPH] or record.takes_activations
    if user is not None and config.policy != "lynx":
        record.notes.append(f"{user.describe()}: replaced by policy {config.policy!r}, applied as named "
                            "(policy 'lynx', the default, keeps them)")
    limit = ctx.budget  # this graph's (a device budget less what is resident)
    if piece:  # one block or a piece of a model: what adds up across graphs is what each saves
        budget = _budget_bytes(limit, reference.saved_bytes)
    else:
        budget = _budget_bytes(limit, reference.peak_bytes)
        if record.step_choice is not None and record.step_choice.plan_within is not None:
            budget = record.step_choice.plan_within  # the step's plan: a tighter peak (step.recorder)
        elif limit is not None and (limit.nbytes or 0) >= reference.peak_bytes:
            _warn_loose_budget(limit, reference.peak_bytes)
    if ctx.user_tags is not None and budget is None and record.step_choice is None and region_check is None:
        # no budget: the user's checkpointing, partitioned as torch.compile partitions it, is the plan
        applied, outcome = _users_partition(joint, ctx, kw, scratch=False), None
        record.notes.append(f"{ctx.user_tags.describe()}: no budget given, so the graph is partitioned as "
                            "torch.compile partitions it with them (set memory_budget for lynx's plan within them)")
        if piece:
            record.step = GraphChoices(reference=step_candidate(CandidateKey("none"), 0.0, reference),
                                       choices=(step_candidate(CandidateKey(USER), 0.0, applied.mem),),
                                       current=CandidateKey(USER),
                                       incoming_bytes=incoming_bytes(joint))
    else:
        if ctx.user_tags is not None:
            mine = _users_partition(joint, ctx, kw, scratch=True).mem
            if budget is not None:  # never above what the user's annotations hold
                budget = min(budget, mine.saved_bytes if piece else mine.peak_bytes)
        if piece:
            applied, outcome = decide_piece(joint, ctx, kw, budget, reference.saved_bytes)
        else:
            applied, outcome = decide(joint, ctx, kw, budget, reference.peak_bytes)
    fw, bw, mem = applied.fw, applied.bw, applied.mem
    if region_check is not None:  # the user's region budgets, and what the plan saves in each
        record.stats["regions"], over = region_check.report(fw, bw)
        if over:
            fix = (f"re-plan it with the regions annotated: lynx plan --policy lynx ... --out {config.plan}"
                   if config.plan else "this is a bug in lynx: please report it with the model (a larger region "
                   "budget works around it)")
            raise region_budgets.RegionBudgetError(
                (f"lynx: the plan in {config.plan!r}" if config.plan else "lynx: the plan") + " saves more than the "
                "region budget(s) allow: " + "; ".join(f"region {n!r} saves {s} B, above its {c} B"
                                                      for n, (s, c) in over.items()) + f"; {fix}")
        record.notes.append("region budgets of the model: " + "; ".join(
            f"{r['name']!r} at {r['budget']:g} saves {r['saved_bytes']} B of {r['reference_bytes']} B "
            f"(at most {r['max_bytes']} B)" for r in record.stats["regions"]))
    # torch.compile's own kind of partition (the user's tags, torch's min-cut at a budget): compiled as it does.
    # A min-cut candidate that policy lynx chose for a graph planned on its own peak keeps its
    # recompute apart from independent kernels: HF Llama (2 layers, batch 4 x 32, .grad None,
    # 0.7): torch@0.2 chosen, predicted 760064 B; Inductor fused a block's recomputed norm (sharing
    # the residual stream's reads) into the backward's first kernel: 924168 B (0.777 of the step);
    # with that fusion refused, 760072 B (0.639). Compiled wholly as lynx's placements (no
    # reordering) it measured the same but ran 1.7x torch.compile's step (HF Llama 4 layers at
    # 0.69, bench_peers.py); a piece (budgeted on the bytes it saves) under the
    # user's checkpointing measured 833800 B against 821512 B with the fusion refused, so pieces
    # keep torch.compile's compile for the user's checkpointing.
    # A piece's min-cut candidate is compiled as lynx's own placements (no peak-memory reordering,
    # lynx's post-grad passes), the compile lynx's memory model describes: the step's plan weighs
    # every candidate by that model, the one that ran by the recorded step. With Inductor's
    # reordering (it does not know the .grad a backward keeps) gpt-tiny per block at 0.47 ran
    # torch@0.1 at 0.490 of the step where the model said 0.467, and the step's plan, torch@0.3,
    # measured 0.491 (model: 0.460); compiled as modelled, both measure what the model says.
    record.torch_partition = applied.decisions.policy == USER or (applied.torch_budget is not None and not piece)
    record.keep_recompute_apart = (applied.torch_budget is not None and applied.decisions.policy != USER
                                   and config.policy == "lynx" and not piece)
    if not piece:  # planned on its own peak: the step's plan across graphs keeps it (step.recorder)
        name = record.step_choice or CandidateKey("plan")
        record.step = GraphChoices(reference=step_candidate(CandidateKey("none"), 0.0, reference),
                                   choices=(step_candidate(name, 0.0, mem),), current=name,
                                   incoming_bytes=incoming_bytes(joint))
    record.plan = build_plan(config.policy, joint, applied, ctx, budget, outcome,
                             budget_scope="saved" if piece else "peak")
    record.saved_names = tuple(p.name for p in bw.graph.find_nodes(op="placeholder")
                               if not p.name.startswith("tangents"))
    record.segment_costs = segment_costs(joint, ctx.forward_names)
    if config.check_plan_agreement:
        with _compat.eager_dispatch():  # real tensors for the all-gather, not the compile's fakes
            positions = {n.name: i for i, n in enumerate(joint.graph.nodes)}
            record.stats["plan_fingerprint"] = check_plan_agreement(record.plan, record.graph_id, positions=positions)

    if budget is not None and piece and mem.saved_bytes > budget and config.policy != "lynx":
        raise refuse(limit, reference.saved_bytes, None,
                     f"this graph is one block or a piece of a model, where the budget applies to the "
                     f"activations it saves ({budget} B of {reference.saved_bytes} B); policy {config.policy!r} "
                     f"saves {mem.saved_bytes} B. Use policy 'lynx' (it picks the cheapest plan that fits) "
                     "or a larger budget")
    if budget is not None and not piece and mem.peak_bytes > budget:
        if config.policy == "torch":
            frac = min(1.0, budget / reference.peak_bytes)
            msg = (f"policy 'torch' at activation_memory_budget={frac:.3f} predicts a peak of "
                   f"{mem.peak_bytes} B, above the budget {budget} B (torch budgets saved bytes, "
                   "not the peak)")
            log.warning("lynx: %s", msg)
            record.notes.append(msg)
        elif config.policy == "lynx":  # only a plan from a file can get here
            raise refuse(limit, reference.peak_bytes, None,
                         f"the plan in {config.plan!r} peaks at {mem.peak_bytes} B, above the budget; "
                         f"re-plan with `lynx plan --policy lynx {_budget_flags(config)} "
                         f"--out {config.plan}`")
        else:
            smallest = smallest_reachable(joint, ctx, kw, reference.peak_bytes)
            raise budget_error(ctx, reference.peak_bytes, smallest, mem.peak_bytes)
    _log_plan(record)
    return fw, bw


def _users_partition(joint: fx.GraphModule, ctx: PassContext, kw: dict, *, scratch: bool) -> Applied:
    """The joint partitioned with the user's own checkpoint tags (torch.compile's partition of
    the annotated model): the plan itself (``scratch`` False, no budget) or, on a scratch record,
    the bound of lynx's plan (issue U: never above the memory the user's annotations give); what
    it holds is on ``record.stats["user_tags"]``."""
    sub = scratch_context(ctx, USER, USER) if scratch else ctx
    mine = realize(joint, sub, Decisions(policy=USER), kw, as_user_tagged=True)
    ctx.record.stats["user_tags"] = {**ctx.user_tags.summary(), "peak_bytes": mine.mem.peak_bytes,
                                     "saved_bytes": mine.mem.saved_bytes,
                                     "must_save_names": sorted(ctx.user_tags.must_save)}
    ctx.record.notes.append(f"{ctx.user_tags.describe()}; with them the graph peaks at {mine.mem.peak_bytes} B "
                            f"and saves {mine.mem.saved_bytes} B: lynx's plan stays within that "
                            "(or within the budget, where it is lower)")
    return mine


def _budget_flags(config: LynxConfig) -> str:
    """``lynx plan``'s flags for this config's budget."""
    memory = config.memory_budget
    flags = [] if memory is None else [f"--memory-budget {memory if isinstance(memory, float) else f'{memory}B'}"]
    if config.device_budget is not None:
        flags.append(f"--device-budget {config.device_budget}B")
    return " ".join(flags)


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


def build_plan(policy: str, joint: fx.GraphModule, applied: Applied, ctx: PassContext,
               budget: int | None, outcome=None, budget_scope: str = "peak") -> RecomputePlan:
    """The plan record of ``applied``: its decisions, what its graphs save and recompute (names,
    bytes, blocks, seconds) and their exact simulated memory."""
    fw, bw, mem = applied.fw, applied.bw, applied.mem
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
        src = recomputed_source(node, joint_nodes)
        cost = (src or node).meta.get(meta.COST)
        recomputed.append(TensorDecision(
            name=src.name if src is not None else node.meta[meta.RECOMPUTED_FROM], block=node.meta.get(meta.BLOCK),
            nbytes=_nbytes(node.meta.get("val")), recompute_s=cost.runtime_s if cost else 0.0))
    blocks = []
    for i, path in enumerate(ctx.record.blocks):
        s = [d for d in saved if d.block == i]
        r = [d for d in recomputed if d.block == i]
        blocks.append(BlockSummary(block=i, path=path, saved_bytes=sum(d.nbytes for d in s),
                                   saved=tuple(d.name for d in s), recomputed=tuple(d.name for d in r),
                                   recompute_s=sum(d.recompute_s for d in r)))
    recompute_s = sum(d.recompute_s for d in recomputed)
    offload = applied.record.stats.get("offload", {})
    return RecomputePlan(
        policy=policy, graph_hash=ctx.record.stats.get("graph_hash") or structural_hash(list(joint.graph.nodes)),
        saved=tuple(saved), recomputed=tuple(recomputed), blocks=tuple(blocks),
        saved_bytes=mem.saved_bytes, peak_bytes=mem.peak_bytes,
        forward_peak_bytes=mem.forward_peak_bytes, backward_peak_bytes=mem.backward_peak_bytes,
        peak_at=mem.peak_at, recompute_s=recompute_s,
        reference_peak_bytes=ctx.record.reference_peak_bytes or 0, budget_bytes=budget, budget_scope=budget_scope,
        **_device_budget_fields(ctx.budget),
        notes=tuple(ctx.record.notes), decisions=applied.decisions,
        solver=outcome.solver if outcome else "", solver_status=outcome.status if outcome else "",
        # a policy's own plan: its on-demand recompute as candidates are priced (by kernel under Inductor)
        exposed_s=outcome.exposed_s if outcome else seeds.exposed(applied, joint),
        offload_bytes=offload.get("bytes", 0), offload_copy_s=offload.get("copy_s", 0.0),
        offload_exposed_s=offload.get("exposed_fw_s", 0.0) + offload.get("exposed_bw_s", 0.0),
        plan_time_s=outcome.plan_time_s if outcome else 0.0, solve_s=outcome.solve_s if outcome else 0.0,
        block_ops=_block_ops(joint, ctx, applied.decisions) if outcome else {})


def _device_budget_fields(budget: Budget | None) -> dict:
    """The plan's ``device_budget_bytes`` / ``resident_bytes`` / ``resident_source``."""
    if budget is None or budget.device_nbytes is None:
        return {}
    return dict(device_budget_bytes=budget.device_nbytes, resident_bytes=budget.resident,
                resident_source=budget.resident_source)


def _block_ops(joint: fx.GraphModule, ctx: PassContext, decisions) -> dict[str, list[tuple[str, str]]]:
    """Per block, its forward aten ops in order with the decision of the unit each belongs to
    (``"keep"``, ``"demand"``, ``"window:<collective>"``; what ``lynx_compile.sac`` reads)."""
    out: dict[str, list[tuple[str, str]]] = {path: [] for path in ctx.record.blocks}
    unit_of = {m: unit for unit, _ in decisions for m in decisions.nodes_of(unit)}
    for node in joint.graph.nodes:
        block = node.meta.get(meta.BLOCK)
        if block is None or node.op != "call_function" or "nn_module_stack" not in node.meta \
                or node.name not in ctx.forward_names or node.target is operator.getitem:
            continue
        unit = unit_of.get(node.name, node.name)
        out[ctx.record.blocks[block]].append((str(node.target), str(decisions[unit])))
    return out


def _log_plan(record: GraphRecord) -> None:
    p = record.plan
    device = "" if p.device_budget_bytes is None else (
        f" device_budget={p.device_budget_bytes} B (resident at the step's start {p.resident_bytes} B: "
        f"{p.resident_source}; step budget {p.budget_bytes} B)")
    log.info("lynx graph %d: policy=%s blocks=%d saved=%d B peak=%d B (%.2f of no-recompute) "
             "recompute=%.3g s%s", record.graph_id, p.policy, len(record.blocks), p.saved_bytes,
             p.peak_bytes, p.peak_fraction, p.recompute_s, device)
