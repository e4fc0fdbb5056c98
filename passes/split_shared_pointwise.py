"""Give a pointwise value read by an early and a late consumer a copy for the late one (post-grad).

Inductor fuses a pointwise node with all of its pointwise consumers into one kernel, which can
only run once every consumer's inputs are ready. In Llama's recomputed MLP::

    g = x @ Wg; u = x @ Wu; s = silu(g)
    h = s * u  -> dWd = dy^T @ h                  (early: needs g, u)
    dh = dy @ Wd; dhs = dh * s                    (late: needs the matmul dh)

``s``, ``h`` and ``dhs`` became one kernel after ``dh``, so ``h`` waited for ``dh`` and g, u, dh,
h, dhs were alive at once (HF Llama, 4 layers, batch 2, seq 64, policy full: +88 KB per layer
above lynx's prediction, which computes ``h`` and frees it before ``dh``). After::

    h = silu(g) * u -> dWd = dy^T @ h; dh = dy @ Wd; dhs = dh * silu(g)   (silu recomputed)

With Inductor's wrapper buffer reuse off for lynx's placements (``_compat``), HF Llama under
``full`` measured 1077768 B before, 921608 B after (lynx's prediction 921600 B).

Runs in ``POST_GRAD_PIPELINE`` (Inductor's post-grad graphs of lynx's own placements). Reads the
ops' ``torch.Tag.pointwise`` and views (``memory.storage.aliased_input``); writes the copies
(``node_copy``: the original's meta, without ``meta.DECISION``: a copy runs with its consumer,
in no window).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from lynx_compile.memory.storage import aliased_input

from . import meta
from .context import PassContext

MAX_CONE_NODES = 16
"""The most nodes a copy recomputes (the shared node and the pointwise nodes feeding only it)."""


def _fusible(n: fx.Node) -> bool:
    """A node Inductor computes inside a fused kernel: a pointwise op, or a view."""
    if n.op != "call_function":
        return False
    return torch.Tag.pointwise in getattr(n.target, "tags", ()) or aliased_input(n) is not None


def _kernel_bounds(nodes: list[fx.Node]) -> tuple[dict[fx.Node, int], dict[fx.Node, int]]:
    """Per node, through chains of fusible nodes: ``ready``, the position of the latest
    non-fusible node (a matmul, a reduction) it depends on, -1 for none; ``needed``, the
    position of the earliest non-fusible node (or the output) that reads it."""
    order = {n: i for i, n in enumerate(nodes)}
    ready: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op != "call_function":
            ready[n] = -1
        elif _fusible(n):
            ready[n] = max((ready[i] for i in n.all_input_nodes), default=-1)
        else:
            ready[n] = order[n]
    needed: dict[fx.Node, int] = {}
    for n in reversed(nodes):
        if _fusible(n):
            needed[n] = min((needed[u] for u in n.users), default=len(nodes))
        else:
            needed[n] = order[n]
    return ready, needed


def _pointwise_cone(n: fx.Node, max_nodes: int) -> set[fx.Node] | None:
    """``n`` and the fusible nodes that feed only it (what a copy of ``n`` recomputes); None
    when that is more than ``max_nodes`` nodes."""
    cone, grew = {n}, True
    while grew:
        grew = False
        for m in {i for c in cone for i in c.all_input_nodes} - cone:
            if _fusible(m) and all(u in cone for u in m.users):
                cone.add(m)
                grew = True
        if len(cone) > max_nodes:
            return None
    return cone


def plan_pointwise_copies(graph: fx.Graph, max_nodes: int = MAX_CONE_NODES
                          ) -> list[tuple[fx.Node, list[fx.Node], list[fx.Node]]]:
    """The copies to make: ``(n, cone, late consumers)`` per shared pointwise node ``n`` and
    group of consumers that wait for a later matmul, in graph order; reads the graph only.

    A copy is made only where an earlier consumer's result is read by a matmul before then (so
    the fusion would delay it) and the cone's inputs are alive there anyway (the copy extends
    no lifetime). The cost is the cone's pointwise ops once more, inside a kernel that runs
    anyway."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    ready, needed = _kernel_bounds(nodes)
    rewrites = []
    for n in nodes:
        if n.op != "call_function" or torch.Tag.pointwise not in getattr(n.target, "tags", ()) \
                or len(n.users) < 2 or not all(_fusible(u) for u in n.users):
            continue
        groups: dict[int, list[fx.Node]] = {}
        for u in n.users:  # consumers by the latest matmul each waits for, besides n
            groups.setdefault(max((ready[i] for i in u.all_input_nodes if i is not n), default=-1), []).append(u)
        if len(groups) < 2:
            continue
        first, *later = sorted(groups)
        early_read = min(needed[u] for u in groups[first])
        later = [b for b in later if early_read < b]  # the fusion would delay an earlier matmul
        cone = _pointwise_cone(n, max_nodes) if later else None
        if cone is None:
            continue
        leaves = {i for c in cone for i in c.all_input_nodes if i not in cone}
        for b in later:
            start = min(order[u] for u in groups[b])
            if all(leaf.op == "get_attr" or max((order[u] for u in leaf.users if u not in cone), default=-1) >= start
                   for leaf in leaves):
                rewrites.append((n, sorted(cone, key=order.get), sorted(groups[b], key=order.get)))
    return rewrites


def split_shared_pointwise_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Copy each planned cone (:func:`plan_pointwise_copies`) right before its first late
    consumer, and point the late consumers at the copy. In place; returns ``gm``."""
    graph = gm.graph
    for n, cone, users in plan_pointwise_copies(graph):
        copies: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(users[0]):
            for c in cone:
                copies[c] = graph.node_copy(c, lambda x: copies.get(x, x))
                copies[c].meta.pop(meta.DECISION, None)  # runs with its consumer, in no window
        for u in users:
            u.replace_input_with(n, copies[n])
    return gm
