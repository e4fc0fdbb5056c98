"""Place window recomputation inside its communication window.

Reads ``meta.DECISION`` (``Window(collective)``, set by ``apply_decisions_pass`` on the joint
nodes and copied onto their backward copies) and ``meta.RECOMPUTED``. torch's partitioner
already put every recompute on demand, right before its first use; this pass moves the ones the
plan assigned to a window right after that collective (found by name in the backward) is
issued, so they run while it is in flight (FSDP2's window, ``distributed/fsdp.py``, has no
collective in the graph: it is in flight as the backward starts, so its recompute goes right
after the backward's inputs)::

    before:  ar = all_reduce(g) ... x_recomputed = gelu(h) ... wait_tensor(ar) ... use(x_recomputed)
    after:   ar = all_reduce(g); x_recomputed = gelu(h) ... wait_tensor(ar) ... use(x_recomputed)

The plan guarantees a window unit's inputs are kept or recomputed in the same or an earlier
window, so the move keeps the graph topologically valid (checked by lint; a violation is a
planner bug and raises). A node is moved at most once, into the earliest window that needs it:
under Inductor a pointwise op folded into several consumer units (``remat_problem._fold_fused``,
e.g. a causal mask's ``where`` read by the softmax's ``amax`` and its ``sub``) is one FX node
carrying the last consumer's decision, and a consumer in an earlier window has already pulled
it there; moving it on to its own, later window would leave that consumer reading it before it
is defined (seen on a DTensor TP=2 Llama at selective's peak).
"""
from __future__ import annotations

import torch.fx as fx

from lynx_compile.graph.collectives import is_collective_node
from lynx_compile.decisions import Window
from lynx_compile.distributed.fsdp import WINDOW as FSDP_WINDOW

from . import meta
from .context import PassContext


def _with_recomputed_inputs(group: list[fx.Node], coll: fx.Node, gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``group`` that sit after ``coll``, plus the recomputed nodes they read that
    sit after ``coll``, in graph order.

    Nodes the partitioner creates itself carry no plan role: the RNG replay
    (``run_with_rng_state``) whose getitem a window unit is, for one. They must move with the
    unit that reads them. A node already before ``coll`` (moved into an earlier window with a
    unit that reads it) stays there: it is computed before this window's units need it, and
    moving it later would break its earlier readers."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    group = [n for n in group if order[n] > order[coll]]
    members, todo = set(group), list(group)
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in members and order[a] > order[coll] and a.meta.get(meta.RECOMPUTED):
                members.add(a)
                todo.append(a)
    return sorted(members, key=order.__getitem__)


def insert_recompute_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    # A forward collective re-issued by a policy that recomputes it (``full``) is a recomputed
    # node, not a window.
    collectives = {n.name: n for n in gm.graph.nodes if is_collective_node(n) and not n.meta.get(meta.RECOMPUTED)}
    by_window: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        decision = n.meta.get(meta.DECISION)
        if n.meta.get(meta.RECOMPUTED) and isinstance(decision, Window):
            by_window.setdefault(decision.collective, []).append(n)
    fsdp = by_window.pop(FSDP_WINDOW, [])
    if fsdp:  # FSDP2's prefetch is in flight as the backward starts: right after its inputs
        anchor = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        fsdp = _with_recomputed_inputs(fsdp, anchor, gm)
        for node in fsdp:
            anchor.append(node)
            anchor = node
    stray = sorted(w for w in by_window if w not in collectives)
    if stray:
        raise RuntimeError(f"plan places recompute in the windows of {stray}, collectives this backward "
                           f"does not have ({sorted(collectives)}); the plan is stale for this graph")
    moved = len(fsdp)
    for name, coll in collectives.items():  # graph order
        group = _with_recomputed_inputs(by_window.get(name, []), coll, gm)
        anchor = coll
        for node in group:
            anchor.append(node)
            anchor = node
            moved += 1
    try:
        gm.graph.lint()
    except Exception as e:  # a window unit read something produced after its collective
        raise RuntimeError(f"lynx planner bug: window placement broke the graph order: {e}") from e
    ctx.record.stats["recompute_nodes_in_windows"] = moved
    return gm
