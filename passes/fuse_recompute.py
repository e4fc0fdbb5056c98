"""Replace recompute chains in the backward with lynx's fused kernels (``lynx_compile.kernels``).

Reads ``meta.RECOMPUTED`` and ``config.fuse_kernels``. Only recomputed nodes are rewritten (the
backward's own gradient ops are left to the compiler); a chain it does not recognize stays as
it is. Each rewrite keeps the chain's output value; the nodes it leaves unused are removed.

    causal softmax:  mul(s, c) -> masked_fill(·, triu(ones(T, T), 1), -inf) -> _softmax(·, -1)
                     ==> lynx.causal_softmax(s, c)
    layer norm:      native_layer_norm(x, [C], w, b, eps) -> (y, mean, rstd)
                     ==> lynx.layer_norm(x, w, b, eps), mean / rstd viewed to (..., 1)
    GeLU:            gelu(x, approximate)  ==>  lynx.bias_gelu(x, None, approximate)

New nodes keep ``meta.RECOMPUTED`` / ``meta.BLOCK`` (and a ``val`` from the op's fake), so the
memory simulation and the trace ranges see them as recompute.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from lynx_compile import _compat

from . import meta
from .context import PassContext

aten = torch.ops.aten


def fuse_recompute_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not fusion_enabled(ctx.config.fuse_kernels):
        return gm
    import lynx_compile.kernels  # noqa: F401  (registers torch.ops.lynx.*)

    fused = {"causal_softmax": 0, "layer_norm": 0, "gelu": 0}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not node.meta.get(meta.RECOMPUTED):
            continue
        if node.target is aten._softmax.default and _fuse_softmax(gm, node):
            fused["causal_softmax"] += 1
        elif node.target is aten.native_layer_norm.default and hasattr(torch.ops.lynx, "layer_norm") \
                and _fuse_layer_norm(gm, node):
            fused["layer_norm"] += 1
        elif node.target is aten.gelu.default and hasattr(torch.ops.lynx, "bias_gelu") and _fuse_gelu(gm, node):
            fused["gelu"] += 1
    gm.graph.eliminate_dead_code()
    ctx.record.stats["fused_recompute"] = fused
    return gm


def fusion_enabled(setting) -> bool:
    """``fuse_kernels``: True / False, or "auto" = when a Triton kernel can run (CUDA, or the
    interpreter)."""
    if setting != "auto":
        return bool(setting)
    from lynx_compile.kernels._support import interpreting, triton_importable

    return triton_importable() and (torch.cuda.is_available() or interpreting())


def _new(gm: fx.GraphModule, like: fx.Node, target, args: tuple) -> fx.Node:
    with gm.graph.inserting_before(like):
        node = gm.graph.call_function(target, args)
    node.meta.update({k: like.meta[k] for k in (meta.RECOMPUTED, meta.RECOMPUTED_FROM, meta.BLOCK, meta.ROLE, meta.DECISION)
                      if k in like.meta})
    node.meta["val"] = _fake_run(target, args)
    return node


def _fake_run(target, args):
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    fake_mode = _compat.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return None
    with fake_mode:
        return target(*vals)


def is_causal_mask(node: fx.Node) -> bool:
    """``triu(ones(T, T), 1)``: the constant causal mask (True above the diagonal)."""
    return (node.target is aten.triu.default and node.args[1:] == (1,) and isinstance(node.args[0], fx.Node)
            and node.args[0].target is aten.ones.default)


def _fuse_softmax(gm: fx.GraphModule, softmax: fx.Node) -> bool:
    src, dim, half = softmax.args
    if dim not in (-1, len(softmax.meta["val"].shape) - 1) or half:
        return False
    fill = src
    if not (isinstance(fill, fx.Node) and fill.target is aten.masked_fill.Scalar and fill.args[2] == float("-inf")):
        return False
    scaled, mask = fill.args[0], fill.args[1]
    if not (isinstance(mask, fx.Node) and (is_causal_mask(mask) or mask.meta.get(meta.CAUSAL_MASK))):
        return False
    if isinstance(scaled, fx.Node) and scaled.target is aten.mul.Tensor and isinstance(scaled.args[1], (int, float)):
        scores, scale = scaled.args[0], float(scaled.args[1])
    else:
        scores, scale = scaled, 1.0
    T = softmax.meta["val"].shape[-1]
    if softmax.meta["val"].shape[-2] != T:
        return False
    new = _new(gm, softmax, torch.ops.lynx.causal_softmax.default, (scores, scale))
    softmax.replace_all_uses_with(new)
    return True


def _fuse_layer_norm(gm: fx.GraphModule, ln: fx.Node) -> bool:
    x, shape, w, b, eps = ln.args
    if len(shape) != 1:
        return False
    new = _new(gm, ln, torch.ops.lynx.layer_norm.default, (x, w, b, float(eps)))
    stat_shape = list(ln.meta["val"][1].shape)
    for user in list(ln.users):
        if user.target is not operator.getitem:
            return False
    for user in list(ln.users):
        i = user.args[1]
        with gm.graph.inserting_before(user):
            out = gm.graph.call_function(operator.getitem, (new, i))
            out.meta.update(new.meta)
            out.meta["val"] = new.meta["val"][i] if new.meta.get("val") is not None else None
            if i in (1, 2):  # kernel: fp32, one per row; aten: (..., 1) in its own dtype (bf16 on CPU)
                out = gm.graph.call_function(aten.view.default, (out, stat_shape))
                out.meta.update({k: v for k, v in new.meta.items() if k != "val"})
                want = user.meta.get("val")
                out.meta["val"] = want
                if want is not None and want.dtype != torch.float32:
                    out = gm.graph.call_function(aten._to_copy.default, (out,), {"dtype": want.dtype})
                    out.meta.update({k: v for k, v in new.meta.items() if k != "val"})
                    out.meta["val"] = want
        user.replace_all_uses_with(out)
    return True


def _fuse_gelu(gm: fx.GraphModule, gelu: fx.Node) -> bool:
    approximate = gelu.kwargs.get("approximate", gelu.args[1] if len(gelu.args) > 1 else "none")
    new = _new(gm, gelu, torch.ops.lynx.bias_gelu.default, (gelu.args[0], None, approximate))
    gelu.replace_all_uses_with(new)
    return True
