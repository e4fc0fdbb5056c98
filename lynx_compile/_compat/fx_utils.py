"""FX nodes and ops: what a node is (symbolic, random, an RNG replay, Inductor's seeds), an op's
qualified name, sizes of SymInts, small edits (rename, keep from dead-code elimination), pytree
leaves, and a graph module compiled with the boxed calling convention."""
from __future__ import annotations

from typing import Any, Callable

import sympy
import torch
import torch.fx as fx


def mark_side_effect(op: Any) -> None:
    """Keep ``op`` out of dead-code elimination (FX, AOTAutograd's partitioners, Inductor) though
    nothing reads its result: ``torch.fx.node.has_side_effect``."""
    from torch.fx.node import has_side_effect

    has_side_effect(op)


def is_sym_node(node: fx.Node) -> bool:
    from torch.fx.experimental.proxy_tensor import is_sym_node as _is_sym

    return bool(_is_sym(node))


def optimization_hint(x: Any, fallback: int | None = None) -> int:
    """The size hint of an int / SymInt: ``symbolic_shapes.optimization_hint`` (2.13), else
    ``size_hint`` (2.11-2.12, where ``hint_int`` is its deprecated alias); all take
    ``(a, fallback=None)``."""
    from torch.fx.experimental import symbolic_shapes

    fn = (getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "size_hint", None)
          or symbolic_shapes.hint_int)
    return fn(x, fallback=fallback)


def unbacked_symbol_name(val: Any) -> str | None:
    """The name of the unbacked symbol (``u0``) a SymInt ``val`` is, or None for anything else
    (an int, a backed size, an expression of several symbols). ``SymNode.expr``, sympy."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not isinstance(val, torch.SymInt):
        return None
    expr = val.node.expr
    if not getattr(expr, "is_Symbol", False) or not free_unbacked_symbols(expr):
        return None
    return str(expr)


def hint_with_values(x: Any, values: dict[str, int], fallback: int) -> int:
    """The size hint of an int / SymInt with the unbacked symbols named in ``values`` taken at
    those values (a data-dependent size as a step saw it: ``u2 + u3`` routed rows); an
    expression with another free symbol gets :func:`optimization_hint`'s (``fallback`` per
    unbacked symbol)."""
    if isinstance(x, torch.SymInt) and values:
        expr = x.node.expr
        named = {s: sympy.Integer(values[str(s)]) for s in getattr(expr, "free_symbols", ()) if str(s) in values}
        if named:
            given = expr.xreplace(named)
            if getattr(given, "is_number", False):
                return int(given)
    return int(optimization_hint(x, fallback=fallback))


def boxed(gm: fx.GraphModule) -> Callable[[list], Any]:
    """Compile ``gm`` to a Python function with the boxed calling convention.

    The generated code takes one list and clears it, so saved activations passed to the
    backward are freed at their last use instead of living until the backward returns."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def rename_node(node: fx.Node, name: str) -> None:
    """Rename an FX node in place, keeping the graph's namespace unique (``Node._rename``)."""
    node._rename(name)


def is_op_overload(op: Any) -> bool:
    """An ``OpOverload`` or ``OpOverloadPacket`` (``torch.ops.ns.name[.overload]``)."""
    return isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def qualified_op_name(op: Any) -> str:
    """"ns::name[.overload]" for an OpOverload / OpOverloadPacket, else ``str(op)``."""
    if isinstance(op, torch._ops.OpOverload):
        return op.name()
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    return str(op)


def tree_leaves(tree: Any) -> list:
    """``torch.utils._pytree.tree_leaves`` (no public pytree module on 2.11-2.13)."""
    import torch.utils._pytree as pytree

    return pytree.tree_leaves(tree)


def is_inductor_seeds(node: fx.Node) -> bool:
    """``prims.inductor_seeds``: the one nondeterministic node Inductor's RNG replacement leaves.

    Inductor's joint pass rewrites every ``rand``/dropout into ``inductor_random(shape,
    inductor_lookup_seed(seeds, i))``, which is a pure function of the ``seeds`` tensor: saving
    that small int64 tensor makes every recomputed random op draw the forward's numbers."""
    prims = getattr(torch.ops, "prims", None)
    op = getattr(getattr(prims, "inductor_seeds", None), "default", None)
    return op is not None and node.op == "call_function" and node.target is op


def node_is_random(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and hasattr(target, "tags")
            and torch.Tag.nondeterministic_seeded in target.tags)


def is_rng_replay(node: fx.Node) -> bool:
    """A backward node that re-runs an RNG op from its saved state (``run_with_rng_state``)."""
    return node.target is getattr(torch._prims.rng_prims, "run_with_rng_state", None)
