"""Name and tag the recompute nodes of a partitioned backward graph.

Reads ``ctx.forward_names``. Writes, on every backward node that re-runs a forward node,
``meta.RECOMPUTED = True`` and ``meta.RECOMPUTED_FROM = <forward name>``, and renames it
``<forward name>_recomputed`` so dumps and traces show recomputation at a glance::

    before:  addmm = aten.addmm(primals_2, getitem, t)         # copy of a forward node
    after:   addmm_recomputed = aten.addmm(primals_2, getitem, t)

RNG ops replayed from a saved state (``run_with_rng_state``) are tagged the same way, with the
op's name (``native_dropout.default``) as ``RECOMPUTED_FROM``: the partitioner made them, not
copied them. ``recomputed_source`` finds the joint node any recompute node re-runs (for an RNG
replay: the producer of the forward getitems its own getitems copy).
"""
from __future__ import annotations

import torch.fx as fx

from lynx_compile import _compat

from . import meta
from .context import PassContext


def mark_recomputed_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.name in ctx.forward_names:
            node.meta = dict(node.meta)  # the copy must not write into the forward node's meta
            node.meta[meta.RECOMPUTED] = True
            node.meta[meta.RECOMPUTED_FROM] = node.name
            _compat.rename_node(node, f"{node.name}_recomputed")
        elif _compat.is_rng_replay(node):
            node.meta = dict(node.meta)
            node.meta[meta.RECOMPUTED] = True
            op = node.args[1]
            node.meta[meta.RECOMPUTED_FROM] = getattr(op, "__name__", str(op))
    return gm


def recomputed_source(node: fx.Node, joint_nodes: dict[str, fx.Node]) -> fx.Node | None:
    """The joint-graph node a recompute node of the backward re-runs, or None."""
    src = joint_nodes.get(node.meta.get(meta.RECOMPUTED_FROM, ""))
    if src is not None or not _compat.is_rng_replay(node):
        return src
    for user in node.users:  # getitem(run_with_rng_state(...), i), a copy of a forward getitem
        g = joint_nodes.get(user.meta.get(meta.RECOMPUTED_FROM, ""))
        if g is not None and g.args and isinstance(g.args[0], fx.Node):
            return g.args[0]
    return None
