"""Baseline recompute policies: decide which forward nodes of the joint graph to recompute.

Reads ``meta.BLOCK`` (from ``find_blocks_pass``) and ``ctx.forward_names``; returns a
``Decisions`` record (every chosen node recomputed on demand), which ``apply_decisions_pass``
tags like any other policy's. The partitioner then saves every untagged producer of a tagged
node, so only the *frontier* of the recomputed region is saved. Writes nothing on the graph.

Policies (what a Megatron user knows them as):

- ``full``: per block, every forward node except the block's outputs (values used outside the
  block, i.e. the next block's input). Megatron "full, uniform, 1 layer per checkpoint".
- ``selective``: per block, the attention core: the scores matmul QK^T through scale, mask,
  softmax and dropout, up to (not including) the matmul with V. These are the s x s tensors
  (Megatron's 5·a·s²·b term). With fused SDPA attention there is no such chain and nothing
  is tagged (said in the record).
- ``none``: tag nothing. ``torch``: tag nothing but the outputs of RNG ops, pinned as saved
  (see ``pin_random_outputs``), then torch's min-cut decides.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.decisions import DEMAND, Decisions

from lynx_compile.passes import meta
from lynx_compile.passes.context import PassContext

aten = torch.ops.aten
MATMUL_OPS = frozenset({aten.bmm.default, aten.mm.default, aten.baddbmm.default,
                        aten.addmm.default, aten.matmul.default})
SOFTMAX_OPS = frozenset({aten._softmax.default, aten.softmax.int, aten._safe_softmax.default})


def _recomputable(node: fx.Node, ctx: PassContext) -> bool:
    """Forward call_function nodes that may be re-run in the backward. Impure ops (collectives,
    mutations) are never recomputed; random ops are, with their RNG state replayed."""
    if node.op != "call_function" or node.name not in ctx.forward_names:
        return False
    if node.target is operator.getitem:
        return True
    if _compat.is_sym_node(node) or _compat.is_inductor_seeds(node):
        # Inductor's seeds tensor is the one source of randomness left after its RNG
        # replacement; saved, it makes every recomputed inductor_random redraw the same numbers.
        return False
    return not node.is_impure(impure_random=False) if _takes_impure_random() else not node.is_impure()


def _takes_impure_random() -> bool:
    import inspect

    return "impure_random" in inspect.signature(fx.Node.is_impure).parameters


def _close_multi_output(nodes: set[fx.Node]) -> set[fx.Node]:
    """A multi-output op and its getitems are recomputed together or not at all."""
    closed = set(nodes)
    for node in list(nodes):
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            closed.add(node.args[0])
    for node in list(closed):
        closed.update(u for u in node.users if u.target is operator.getitem)
    return closed


def full_region(block_nodes: list[fx.Node], ctx: PassContext) -> set[fx.Node]:
    """Every recomputable forward node of the block except its outputs."""
    inside = set(block_nodes)
    region = {n for n in block_nodes if _recomputable(n, ctx)
              and not any(u not in inside and u.name in ctx.forward_names for u in n.users)}
    # A multi-output op is recomputed only if all its getitems are: one output leaving the
    # block keeps the op (and so all its outputs) saved.
    for node in list(region):
        getitems = [u for u in node.users if u.target is operator.getitem]
        if getitems and not all(g in region for g in getitems):
            region.discard(node)
            region.difference_update(getitems)
    return {n for n in region
            if n.target is not operator.getitem or n.args[0] in region}


def attention_core(block_nodes: list[fx.Node], ctx: PassContext) -> set[fx.Node]:
    """Scores matmul → ... → softmax → ... up to the matmul with V (exclusive)."""
    inside = set(block_nodes)
    core: set[fx.Node] = set()
    for sm in (n for n in block_nodes if _is_softmax(n) and n.name in ctx.forward_names):
        core.add(sm)
        todo = list(sm.all_input_nodes)  # upstream, until and including the scores matmul
        while todo:
            n = todo.pop()
            if n in core or n not in inside or not _recomputable(n, ctx):
                continue
            core.add(n)
            if n.target not in MATMUL_OPS:
                todo.extend(n.all_input_nodes)
        todo = list(sm.users)  # downstream, until (excluding) the matmul with V
        while todo:
            n = todo.pop()
            if n in core or n not in inside or n.target in MATMUL_OPS or not _recomputable(n, ctx):
                continue
            core.add(n)
            todo.extend(n.users)
    return _close_multi_output(core | _sources_of(core, inside, ctx)) if core else core


def _sources_of(region: set[fx.Node], inside: set[fx.Node], ctx: PassContext) -> set[fx.Node]:
    """Block nodes feeding ``region`` that are computed from no activation (a dropout's random
    numbers and mask under Inductor, a causal mask): recomputed with it rather than saved."""
    out: set[fx.Node] = set()
    todo = [a for n in region for a in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n in out or n in region or n not in inside or not _recomputable(n, ctx) \
                or not _from_no_activation(n):
            continue
        out.add(n)
        todo.extend(n.all_input_nodes)
    return out


def _from_no_activation(node: fx.Node) -> bool:
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return False
        todo.extend(n.all_input_nodes)
    return True


def _is_softmax(node: fx.Node) -> bool:
    """A softmax op, or the ``exp`` of a decomposed one (Inductor's decomposition: amax, sub,
    exp, then sum and div of the exp)."""
    if node.target in SOFTMAX_OPS:
        return True
    if node.target is not aten.exp.default:
        return False
    targets = {u.target for u in node.users}
    return aten.sum.dim_IntList in targets and aten.div.Tensor in targets


def pin_random_outputs(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Keep RNG outputs saved under torch's min-cut (policy ``torch``).

    Below budget 1.0 min-cut's knapsack may pick a dropout to recompute, and without Inductor
    (which decomposes dropout into seeded Philox) the recomputed mask is drawn from a fresh RNG
    state: measured on gpt-small at budget 0.5, losses drift 3e-4 from eager after one step.
    Marking the outputs MUST_SAVE keeps the baseline correct; everything else is torch's."""
    from torch.utils.checkpoint import CheckpointPolicy

    pinned = 0
    for node in gm.graph.nodes:
        if _compat.node_is_random(node) and node.name in ctx.forward_names:
            outs = [node, *(u for u in node.users if u.target is operator.getitem)]
            for out in outs:
                out.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                pinned += 1
    ctx.record.stats["torch_rng_outputs_pinned"] = pinned


BASELINE_POLICIES = ("none", "full", "selective")


def baseline_decisions(gm: fx.GraphModule, ctx: PassContext, policy: str) -> Decisions:
    """Policy ``none`` / ``full`` / ``selective`` as a ``Decisions`` record (see module docstring)."""
    if policy == "none":
        return Decisions(policy="none")
    if policy not in ("full", "selective"):
        raise ValueError(f"{policy!r} is not a baseline policy (one of {BASELINE_POLICIES})")
    by_block: dict[int, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        if meta.BLOCK in node.meta:
            by_block[node.meta[meta.BLOCK]].append(node)
    if not by_block:
        raise ValueError(
            f"policy {policy!r} recomputes per transformer block, but no blocks were found in "
            "this graph. lynx finds blocks as children of a module list (paths ending in .<int>, "
            "e.g. model.layers.3); put your layers in an nn.ModuleList, or annotate them with "
            "torch.fx.traceback.annotate({'lynx_block': i}).")
    counts, units = {}, {}
    for block, nodes in sorted(by_block.items()):
        region = full_region(nodes, ctx) if policy == "full" else attention_core(nodes, ctx)
        units.update(dict.fromkeys((n.name for n in region), DEMAND))
        counts[ctx.record.blocks[block] if block < len(ctx.record.blocks) else str(block)] = len(region)
    ctx.record.stats["recompute_nodes_per_block"] = counts
    if policy == "selective" and not any(counts.values()):
        ctx.record.notes.append(
            "selective: no attention core (softmax between matmuls) found; with fused attention "
            "(SDPA/flash) there are no s x s tensors to drop, so nothing is recomputed")
    return Decisions.make(policy, units)
