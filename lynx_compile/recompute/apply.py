"""Apply one ``Decisions`` record and verify it: the single path from a decision to graphs.

::

    Decisions ─APPLY_PIPELINE (apply_decisions_pass)─▶ tagged joint ─partition─▶ (fw, bw)
        ─FORWARD_PIPELINE (offload)─▶ fw
        ─BACKWARD_PIPELINE (mark, windows, fuse, reload, side stream)─▶ bw ─simulate_step─▶ exact peak

Every policy's candidate goes through ``realize``: the baselines, each round of lynx's solver,
the seeds lynx compares against, and the plan finally compiled. The partition:
``compiler="eager"`` uses torch's default partitioner (saves every untagged producer: the
graphs run as written, so that is what they hold); under Inductor the base is torch.compile's
own min-cut at budget 1, which on top of the tags also recomputes the cheap pointwise chains
Inductor fuses into their consumers, so ``none`` is exactly torch.compile's partition. Policy
``torch`` is min-cut at its own budget, with RNG outputs pinned as saved; what it recomputed is
read back into a ``Decisions`` record.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.decisions import Decisions
from lynx_compile.memory.simulate import StepMemory, saved_input_bytes, simulate_step
from lynx_compile.passes import (APPLY_PIPELINE, BACKWARD_PIPELINE, FORWARD_PIPELINE, GraphRecord, PassContext,
                                  meta, run_passes)
from lynx_compile.passes.apply_decisions import clear_decision_tags
from lynx_compile.recompute.baselines import pin_random_outputs
from lynx_compile.recompute.problem_from_graph import decisions_from_backward


@dataclass
class Applied:
    """A decision record made real: the partitioned graphs and their exact simulated memory."""

    decisions: Decisions
    fw: fx.GraphModule
    bw: fx.GraphModule
    mem: StepMemory
    record: GraphRecord
    """Where the passes of this application wrote their counts (the plan's own record for the
    plan compiled; a scratch record for a candidate)."""
    torch_budget: float | None = None
    """Policy torch: the min-cut setting it was partitioned at (its decisions are read back from
    that partition; applying them as tags partitions differently, so a replay needs the setting)."""


def partition_joint(joint: fx.GraphModule, joint_inputs: Any, kw: dict, *, inductor: bool,
                    torch_budget: float | None = None):
    """(fw, bw) of the tagged ``joint`` (see the module docstring for which partitioner)."""
    if torch_budget is not None:
        fw, bw = _compat.min_cut_partition(joint, joint_inputs, memory_budget=torch_budget, **kw)
    elif inductor:
        fw, bw = _compat.min_cut_partition(joint, joint_inputs, memory_budget=1.0, **kw)
    else:
        fw, bw = _compat.default_partition(joint, joint_inputs, **kw)
    drop_dead_code(bw)
    return fw, bw


def activation_inputs(joint: fx.GraphModule, kw: dict) -> frozenset[str]:
    """Names of the joint's primal inputs that are activations of a model in pieces: floating
    point and not a parameter or buffer (dynamo's static-lifetime inputs)."""
    static = set(kw.get("static_lifetime_input_indices") or ())
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    return frozenset(p.name for i, p in enumerate(primals)
                     if i not in static and isinstance(v := p.meta.get("val"), torch.Tensor) and v.is_floating_point())


def piece_saved_bytes(applied: "Applied", joint: fx.GraphModule, kw: dict) -> int:
    """What a piece of a model saves for its backward under ``applied``, as the step's plan
    counts it (``decide.step_candidate``): its saved activations and the activation inputs it
    keeps alive only by saving them (``memory.simulate.saved_input_bytes``)."""
    return applied.mem.saved_bytes + saved_input_bytes(applied.fw, applied.bw, activation_inputs(joint, kw))


def drop_dead_code(gm: fx.GraphModule) -> bool:
    """Drop ``gm``'s ops whose results nothing uses, random ones too (FX's own pass keeps an op
    tagged ``nondeterministic_seeded``); ops with side effects stay. True if any went.

    torch's partitioner can leave forward ops copied into the backward with no user there (seen
    on tensor-parallel graphs: the mm's feeding a saved collective input; llama3 under TP with
    ``compiler="eager"``, a piece compiled again with the step's plan: a copy of the forward's
    SDPA opening the backward, holding its output, which raised the piece's no-recompute peak
    3.4% and left nothing to recompute below it). They would run every step for nothing; a
    random one drew numbers eager's backward never draws."""
    if gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=False)):
        gm.recompile()
        return True
    return False


def scratch_context(ctx: PassContext, policy: str, label: str) -> PassContext:
    """A context for a candidate plan: its deciding and its passes write into a record of its
    own (the plan's record only hears of the winner), and no graphs are dumped (they would
    overwrite the plan's own)."""
    r = ctx.record
    return dataclasses.replace(
        ctx, config=dataclasses.replace(ctx.config, policy=policy, dump_dir=None),
        record=GraphRecord(graph_id=r.graph_id, policy=label, blocks=r.blocks, block_hashes=r.block_hashes,
                           reference_peak_bytes=r.reference_peak_bytes, problem=r.problem, unit_index=r.unit_index,
                           resident=r.resident))


def realize(joint: fx.GraphModule, ctx: PassContext, decisions: Decisions, kw: dict, *,
            torch_budget: float | None = None, as_user_tagged: bool = False) -> Applied:
    """Tag ``decisions`` on ``joint``, partition, run the backward passes, simulate exactly.

    ``torch_budget``: policy torch, min-cut at that activation_memory_budget (``decisions`` then
    only names the policy; the result carries what min-cut recomputed). ``as_user_tagged``: the
    joint partitioned with the user's own checkpoint tags (``ctx.user_tags``), as torch.compile
    partitions it (read back like torch's). Pass counts go to
    ``ctx.record`` (a ``scratch_context`` for candidates). Leaves the tags of ``decisions`` on
    ``joint``."""
    inductor = ctx.config.compiler == "inductor"
    ctx = dataclasses.replace(ctx, decisions=decisions)
    joint = run_passes(joint, ctx, APPLY_PIPELINE, "apply")
    if torch_budget is not None:
        pin_random_outputs(joint, ctx)
    if as_user_tagged:
        ctx.user_tags.restore(joint)
    read_back = torch_budget is not None or as_user_tagged
    taken = None
    if not read_back and ctx.untagged is not None and next(iter(decisions.recomputed()), None) is None:
        # nothing tagged: the partition is the untagged reference's (untagged_partition), taken
        # instead of partitioning the same joint again (policy none, a plan with no recompute)
        taken = ctx.untagged.take()
    fw, bw = taken or partition_joint(joint, ctx.joint_inputs, kw, inductor=inductor, torch_budget=torch_budget)
    fw = run_passes(fw, ctx, FORWARD_PIPELINE, "forward")
    bw = run_passes(bw, ctx, BACKWARD_PIPELINE, "backward")
    if read_back:
        decisions = decisions_from_backward(bw, decisions.policy, ctx.record.problem, ctx.record.unit_index)
        clear_decision_tags(joint)  # min-cut's MUST_SAVE pins, the user's tags: its input, not a decision
    return Applied(decisions=decisions, fw=fw, bw=bw, mem=simulate_step(fw, bw, fused=inductor), record=ctx.record,
                   torch_budget=torch_budget)


def untagged_partition(joint: fx.GraphModule, joint_inputs: Any, kw: dict, *,
                       inductor: bool) -> tuple[fx.GraphModule, fx.GraphModule, StepMemory]:
    """(fw, bw, their step) of the no-recompute reference of this compiler, whose peak budget
    fractions are of: the untagged joint partitioned as ``partition_joint`` does (under Inductor
    torch.compile's own min-cut partition, simulated as Inductor runs it: ``backend="inductor"``'s
    step; under the eager compiler the default partition, every forward value the backward reads
    saved). The graphs are also the base of lynx's problem (``decide``), which takes them once
    (``PassContext.untagged``) instead of partitioning the same joint again."""
    clear_decision_tags(joint)
    fw, bw = partition_joint(joint, joint_inputs, kw, inductor=inductor)
    return fw, bw, simulate_step(fw, bw, fused=inductor)


def partition_token(applied: Applied) -> str:
    """What ``applied``'s partition does, comparable across ranks: its exact peak, what its
    backward reads and what it recomputes (a torch min-cut candidate, a plan-cache hit)."""
    saved = sorted(p.name for p in applied.bw.graph.find_nodes(op="placeholder"))
    recomputed = sorted(n.name for n in applied.bw.graph.nodes if n.meta.get(meta.RECOMPUTED))
    return hashlib.sha256(json.dumps([applied.mem.peak_bytes, saved, recomputed]).encode()).hexdigest()[:16]
