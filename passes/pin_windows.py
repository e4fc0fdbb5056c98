"""Pin lynx's window recomputes between their collective's issue and its wait (post-grad).

``insert_recompute_pass`` put each ``Window(collective)`` unit right after that collective's
issue in the FX backward. With peak-memory reordering off for lynx's placements
(``_compat.INDUCTOR_KEEP_PLACEMENT``) Inductor mostly keeps the FX order, but nothing in its
scheduler promises to: this pass makes the order a dependency, with torch's own ordering edges
(``control_deps``, ``_compat.inductor_preserve_node_ordering``)::

    before:                      after:
    ar = all_reduce_(g)          ar = all_reduce_(g)
    x_recomputed = mm(h, w)      x_recomputed = control_deps((ar,), <mm>, h, w)
    y = wait_tensor(ar)          y = control_deps((x_recomputed,), <wait_tensor>, ar)

(``<op>``: a subgraph holding the original node; ``control_deps`` runs it after the nodes of
its first argument.)

On a TP=2 GPT (gloo, CPU) every recomputed matmul of a window is then an extern-kernel call
between the ``all_reduce_`` and its ``wait_tensor`` in the generated backward
(``tests/test_tp_lynx.py``). Runs last in ``POST_GRAD_PIPELINE``: it orders what the passes
before it placed.

Reads ``meta.DECISION`` (``Window``), ``meta.RECOMPUTED``, ``meta["val"]``; writes the ordering
edges (torch's ``control_deps`` nodes and their subgraphs).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.graph.collectives import is_collective_node, is_wait_node
from lynx_compile.decisions import Window

from . import meta
from .context import PassContext


def window_order(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Per node to order, the nodes it must run after; reads the graph only.

    Per window: the wait runs after the window's results (its nodes read after the window, so
    they are realized buffers anyway), and each window node that reads nothing else in the
    window runs after the issue. A pointwise node Inductor fuses into a later kernel has no
    operation of its own to order; its kernel then runs wherever its consumer does."""
    issued = {n.name: n for n in graph.nodes if is_collective_node(n)}
    windows: dict[str, list[fx.Node]] = {}
    for n in graph.nodes:
        decision = n.meta.get(meta.DECISION)
        if isinstance(decision, Window) and n.meta.get(meta.RECOMPUTED) and decision.collective in issued:
            windows.setdefault(decision.collective, []).append(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    deps: dict[fx.Node, list[fx.Node]] = {}
    for name, members in windows.items():
        issue = issued[name]
        # a node shared with an earlier window sits there (insert_recompute moves it once): it
        # is not ordered after this window's issue, which would close a cycle through that wait
        members = [m for m in members if order[m] > order[issue]]
        inside = set(members)
        results = [m for m in members if isinstance(m.meta.get("val"), torch.Tensor)
                   and any(u not in inside for u in m.users)]
        for wait in (u for u in issue.users if is_wait_node(u)):
            deps[wait] = results
        for m in members:
            if m.op == "call_function" and not any(a in inside for a in m.all_input_nodes):
                deps[m] = [issue]
    return deps


def pin_windows_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Add the ordering edges of :func:`window_order` to Inductor's post-grad graph. In place;
    returns ``gm``."""
    _compat.inductor_preserve_node_ordering(gm.graph, window_order(gm.graph))
    return gm
