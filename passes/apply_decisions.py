"""Tag the joint graph with a ``Decisions`` record: the one way any policy's choice reaches it.

Reads ``ctx.decisions`` (``lynx_compile.decisions.Decisions``) and ``meta.BLOCK``. Clears
every recompute tag first, then, on each joint node of every recomputed unit, writes torch's
checkpoint tags (``meta["recompute"] = PREFER_RECOMPUTE``, ``meta["ac_graph_id"]`` = its block)
and ``meta.DECISION`` = the unit's ``Demand()`` / ``Window(collective)``, ``meta.ROLE`` = the
deciding policy; where the user's SAC policy said MUST_SAVE (``ctx.user_tags``), that tag is put
back over any decision. The partitioner then saves exactly the untagged producers of tagged nodes::

    before:  gelu = aten.gelu(addmm)                          # no tags
    after:   gelu = aten.gelu(addmm)   {recompute: PREFER_RECOMPUTE, ac_graph_id: 3,
                                        lynx_decision: Demand(), lynx_role: "full"}
"""
from __future__ import annotations

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.memory.inductor_model import index_values

from . import meta
from .context import PassContext

TAG_KEYS = ("recompute", "ac_graph_id", meta.DECISION, meta.ROLE)


def clear_decision_tags(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        for key in TAG_KEYS:
            node.meta.pop(key, None)


def apply_decisions_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    decisions = ctx.decisions
    clear_decision_tags(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    constant = index_values(list(gm.graph.nodes))
    missing = []
    for unit, decision in decisions.recomputed() if decisions is not None else ():
        for name in decisions.nodes_of(unit):
            node = by_name.get(name)
            if node is None:
                missing.append(name)
                continue
            # one checkpoint region per block: torch saves a tensor that crosses into a later one;
            # a value computed from constants alone is in none (each region recomputes it freely)
            _compat.tag_recompute(node, None if node in constant else node.meta.get(meta.BLOCK) or 0)
            node.meta[meta.DECISION] = decision
            node.meta[meta.ROLE] = decisions.policy
    if ctx.user_tags is not None:  # what a SAC policy says to save stays saved (issue U)
        ctx.user_tags.pin_must_save(gm)
    if missing:
        raise ValueError(f"decisions of policy {decisions.policy!r} name nodes this graph does not have "
                         f"({sorted(missing)[:5]}...); they were made for another graph")
    return gm
