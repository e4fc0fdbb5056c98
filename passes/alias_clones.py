"""``alias_clones_pass``: under ``compiler="eager"``, a layout-preserving clone in the joint
graph is its input.

aot_autograd's joint graph is functional (no op writes into a tensor), so ``y = clone(x)``
holds exactly the values of ``x`` and nothing can tell the two apart. The eager compiler runs
the partitioned graphs op by op, so there a clone is a real copy, and when the backward reads
both ``x`` and ``y`` the partition saves both. The zoo's attention is the case measured:
``F.dropout(att, p=0.0, training=True)`` traces to a clone of the softmax probabilities, and
the batched matmul with V saves that copy beside the softmax output (gpt-tiny, 4 layers, batch
3 x 48: 4 x 110,592 B saved that eager PyTorch, which shares one storage, does not)::

    before:  p = _softmax(s); c = clone(p); v6 = view(expand(c)); o = bmm(v6, v)   saved p, v6
    after:   p = _softmax(s);               v6 = view(expand(p)); o = bmm(v6, v)   saved p, v6 = p

Only clones that keep dtype, device and strides (static ones), of a computed value (not a graph
input), that are no graph output. Under Inductor the pass does nothing: Inductor computes such a
copy inside the kernels that read it.

Reads ``meta["val"]``; removes clone nodes.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .context import PassContext


def _same_layout(a: object, b: object) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if any(not isinstance(s, int) for s in (*a.shape, *a.stride(), *b.shape, *b.stride())):
        return False  # symbolic sizes: no comparison that would add guards
    return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()


def alias_clones_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.config.compiler != "eager":
        return gm
    output = next(iter(gm.graph.find_nodes(op="output")))
    changed = False
    for n in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default)):
        x = n.args[0] if n.args else None
        if not isinstance(x, fx.Node) or x.op == "placeholder" or output in n.users:
            continue
        if not _same_layout(x.meta.get("val"), n.meta.get("val")):
            continue
        n.replace_all_uses_with(x)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.recompile()
    return gm
