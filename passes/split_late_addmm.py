"""Undo Inductor's ``mm + add -> addmm`` fusion where the addend comes late (post-grad).

Inductor's post-grad pattern fuses ``add(mm(a, b), inp)`` into ``addmm(inp, a, b)`` at the add's
position. When ``inp`` is computed after both operands (the second gradient of a tied weight:
GPT-2's embedding and LM head) the matmul waits for it, and ``a`` and ``b`` (the logits'
gradient, batch x sequence x vocabulary) stay alive until then, through the whole backward::

    before:  a = ...; b = ...; ... inp = ...; out = addmm(inp, a, b)
    after:   a = ...; b = ...; mm = mm(a, b); ... inp = ...; out = add(inp, mm)

gpt-small (tied, batch 2, CPU) under ``full``: measured peak 4.40 MB without it, 3.75 MB with it
(lynx's prediction 3.75 MB). A bias addmm (``inp`` a parameter or an earlier value) is left
alone, as is one whose matmul output would be larger than the operands it frees (not a saving):
the rule is ``memory.inductor_model.splits_late_addmm``, which lynx's model of Inductor's kernels
reads too.

Runs in ``POST_GRAD_PIPELINE`` (Inductor's post-grad graphs of lynx's own placements, after
Inductor's passes). Reads ``meta["val"]``; writes the ``mm`` / ``add`` nodes (``add`` takes the
addmm's meta, ``mm`` the same without ``"val"`` unless that is a tensor).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from lynx_compile.memory.inductor_model import splits_late_addmm
from lynx_compile.memory.storage import storage_nbytes

from .context import PassContext


def split_late_addmm_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Split every ``addmm(inp, a, b)`` whose ``inp`` comes after both ``a`` and ``b`` (and whose
    matmul output is smaller than the operands it frees): ``mm(a, b)`` goes right after the later
    of ``a`` / ``b``, the ``add`` stays where the addmm was. In place; returns ``gm``."""
    graph = gm.graph
    aten = torch.ops.aten
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.find_nodes(op="call_function", target=aten.addmm.default)):
        if n.kwargs or len(n.args) != 3 or not all(isinstance(x, fx.Node) for x in n.args):
            continue
        inp, a, b = n.args
        if not splits_late_addmm(order, inp, a, b, storage_nbytes(n.meta.get("val")), order[n]):
            continue
        later = max(a, b, key=order.get)
        with graph.inserting_after(later):
            mm = graph.call_function(aten.mm.default, (a, b))
        with graph.inserting_before(n):
            add = graph.call_function(aten.add.Tensor, (inp, mm))
        mm.meta = {k: v for k, v in n.meta.items() if k != "val"}
        add.meta = dict(n.meta)
        if isinstance(n.meta.get("val"), torch.Tensor):
            mm.meta["val"] = n.meta["val"]
        n.replace_all_uses_with(add)
        graph.erase_node(n)
    return gm
