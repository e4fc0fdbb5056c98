"""Defer a backward's weight gradients: B (input gradients) now, W (weight gradients) later.

Zero-bubble pipeline schedules run each micro-batch's backward in two steps: B, which the
previous stage waits for, and W, which the schedule places in a bubble. A compiled stage's
backward is one graph with one output per forward input; ``split_weight_grads`` cuts it::

    bw(saved..., tangents...) -> (dx, dW1, db1, ...)        (a gradient per forward input)
  ==>
    B(saved..., tangents...)  -> (dx, None, None, ..., carry...)   the ops dx needs
    W(carry...)               -> (dW1, db1, ...)                   every other op

``carry`` is what W reads that B holds: saved tensors, tangents, values B computed. An op only
the weight gradients need (a recompute included) runs in W. Graphs whose weight side holds a
collective are not cut (a collective must run where every rank expects it).

``WeightDeferral`` wraps one backward graph: inside ``defer_weights(key)`` it runs B, returns
its gradients (None for the weights: autograd accumulates nothing there) and keeps W's carry
under ``key``; ``run_weights(key)`` later runs W and accumulates into each parameter's
``.grad`` as autograd would. Outside ``defer_weights`` the whole backward runs as before. The
carry stays alive from B to W (``WeightDeferral.pending_bytes``); a pipeline stage's memory plan
counts it (``pipelining.plan_stages``: ``StageInfo.carry_bytes``, from ``weight_side`` on the
traced backward, ``pipelining.weight_split_census``).
"""
from __future__ import annotations

import contextlib
import contextvars
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

from lynx_compile.graph.collectives import is_collective_node, is_wait_node
from lynx_compile.graph.values import iter_tensors

_DEFER: contextvars.ContextVar[Any] = contextvars.ContextVar("lynx_defer_weights", default=None)


@contextlib.contextmanager
def defer_weights(key: Any) -> Iterator[None]:
    """Backwards run inside leave their weight gradients for ``run_weights(key)``."""
    token = _DEFER.set(key)
    try:
        yield
    finally:
        _DEFER.reset(token)


@dataclass(frozen=True)
class WeightSplit:
    b: fx.GraphModule
    """The backward's inputs -> its outputs with None at ``weight_outputs``, then the carry."""
    w: fx.GraphModule
    """The carry -> the gradients at ``weight_outputs``, in that order."""
    weight_outputs: tuple[int, ...]
    carry: int
    """How many trailing outputs of ``b`` are W's inputs."""
    carried_inputs: tuple[int, ...] = ()
    """The backward's inputs (placeholder positions) that are in the carry."""


def ancestors(roots: Sequence[fx.Node], stop: set[fx.Node] | None = None) -> set[fx.Node]:
    """``roots`` and every node they read, directly or not, walking no further than ``stop``."""
    seen: set[fx.Node] = set()
    todo = [r for r in roots if not stop or r not in stop]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(a for a in n.all_input_nodes if a not in seen and (not stop or a not in stop))
    return seen


def weight_side(graph: fx.Graph, b_set: set[fx.Node],
                weight_roots: Sequence[fx.Node]) -> tuple[set[fx.Node], list[fx.Node]]:
    """W's nodes and its carry (in graph order) for a backward ``graph`` whose B computes
    ``b_set``: every ancestor of ``weight_roots`` that B does not compute and that is no
    placeholder runs in W; the carry is what W reads from outside itself (placeholders, values B
    computed) and the weight gradients B computed itself. A multi-output op B runs (layer norm's
    backward: dx, dgamma, dbeta) is carried as the outputs W takes (its getitems join B, which
    grows ``b_set``), not as the tuple, which would keep dx alive until W."""
    placeholders = set(graph.find_nodes(op="placeholder"))
    w_set = ancestors(list(weight_roots), stop=b_set | placeholders)
    taken = {n for n in w_set if n.target is operator.getitem and n.args[0] in b_set}
    w_set -= taken
    b_set |= taken
    order = {n: k for k, n in enumerate(graph.nodes)}
    carry = sorted({a for n in w_set for a in n.all_input_nodes if a not in w_set}
                   | {r for r in weight_roots if r not in w_set}, key=order.__getitem__)
    return w_set, carry


def split_weight_grads(bw: fx.GraphModule, weight_outputs: Sequence[int]) -> WeightSplit | None:
    """Cut ``bw`` into B and W (module docstring); None when W would be empty or hold a collective."""
    outs = list(bw.graph.output_node().args[0])
    weight = tuple(i for i in weight_outputs if i < len(outs) and isinstance(outs[i], fx.Node))
    if not weight:
        return None
    b_set = ancestors([o for i, o in enumerate(outs) if i not in weight and isinstance(o, fx.Node)])
    w_set, carry = weight_side(bw.graph, b_set, [outs[i] for i in weight])
    if not w_set or any(is_collective_node(n) or is_wait_node(n) for n in w_set):
        return None

    b_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in bw.graph.nodes:
        if n.op == "placeholder" or n in b_set:
            env[n] = b_graph.node_copy(n, env.__getitem__)
    b_out = [env[o] if isinstance(o, fx.Node) and i not in weight else None for i, o in enumerate(outs)]
    b_graph.output(tuple(b_out + [env[c] for c in carry]))

    w_graph = fx.Graph()
    wenv: dict[fx.Node, fx.Node] = {}
    for c in carry:
        wenv[c] = w_graph.placeholder(f"{c.name}_carried")
        wenv[c].meta = dict(c.meta)
    for n in bw.graph.nodes:
        if n in w_set:
            wenv[n] = w_graph.node_copy(n, wenv.__getitem__)
    w_graph.output(tuple(wenv[outs[i]] for i in weight))
    b, w = fx.GraphModule(bw, b_graph, "lynx_backward_input"), fx.GraphModule(bw, w_graph, "lynx_backward_weight")
    b.graph.lint()
    w.graph.lint()
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    carried = set(carry)
    return WeightSplit(b=b, w=w, weight_outputs=weight, carry=len(carry),
                       carried_inputs=tuple(i for i, p in enumerate(placeholders) if p in carried))


class WeightDeferral:
    """One backward graph's deferred weight gradients (module docstring).

    ``params``: per forward input, the parameter it is (None for activations): dynamo passes a
    module's parameters to the backend as graph inputs, in the order of the backward's outputs."""

    def __init__(self, params: Sequence[torch.nn.Parameter | None], grads_in_graph: bool = False):
        self.params = [weakref.ref(p) if p is not None else None for p in params]
        self.grads_in_graph = grads_in_graph
        """The backward adds the weight gradients into ``.grad`` itself (``lynx_compile.memory.grad_in_graph``):
        there is nothing to defer, and ``defer_weights`` around it is refused."""
        self.pending: dict[Any, tuple[Callable, tuple[int, ...], list]] = {}
        self.deferred = 0
        """Backwards whose weight gradients ran in W."""

    def weight_positions(self, bw: fx.GraphModule) -> tuple[int, ...]:
        """The outputs of ``bw`` that are weight gradients; () when its outputs cannot be matched
        to the forward's inputs (then nothing is deferred)."""
        if len(bw.graph.output_node().args[0]) != len(self.params):
            return ()
        return tuple(i for i, p in enumerate(self.params) if p is not None)

    def wrap(self, bw: fx.GraphModule, compile_fn: Callable) -> Callable:
        """The compiled ``bw`` (by ``compile_fn``), deferring its weight gradients when asked; B
        and W are cut and compiled at the first deferred call (the op-by-op compiler: cheap)."""
        full = compile_fn(bw)
        weight = self.weight_positions(bw)
        pieces: list = []  # [] until the first deferred call, then [None] or [(split, b, w)]

        def split_pieces():
            if not pieces:
                split = split_weight_grads(bw, weight)
                pieces.append(split and (split, compile_fn(split.b), compile_fn(split.w)))
            return pieces[0]

        return self._dispatch(full, split_pieces if weight else None, len(self.params))

    def wrap_split(self, bw: fx.GraphModule, compile_b: Callable, compile_w: Callable) -> Callable | None:
        """``bw`` cut into B and W now, compiled by ``compile_b(split)`` and ``compile_w(split)``
        (Inductor compiles both when it compiles the backward: a compile later, at the first
        deferred call, would run outside the compile's context); None when ``bw`` cannot be cut
        (compile it whole then). Outside ``defer_weights`` the backward runs B, then W at once."""
        weight = self.weight_positions(bw)
        split = split_weight_grads(bw, weight) if weight else None
        if split is None:
            return None
        b, w = compile_b(split), compile_w(split)
        n_out = len(self.params)

        def b_then_w(args: list) -> list:
            out = list(b(args))
            for i, g in zip(split.weight_outputs, w(out[n_out:])):
                out[i] = g
            return out[:n_out]

        return self._dispatch(b_then_w, lambda: (split, b, w), n_out)

    def _dispatch(self, full: Callable, split_pieces: Callable | None, n_out: int) -> Callable:
        """A boxed backward: ``full(args)``, or inside ``defer_weights(key)`` B now with W's carry
        kept under ``key`` (``split_pieces()``: (split, b, w), or None when not cut)."""

        def run(args: list) -> Any:
            key = _DEFER.get()
            if key is not None and self.grads_in_graph:
                raise RuntimeError(
                    "lynx: defer_weights around a backward that adds the weight gradients into .grad "
                    "inside the compiled graph (accumulate_grad_in_graph, the default where something is "
                    "recomputed in one process): nothing is left to defer. Compile with "
                    "accumulate_grad_in_graph=False to run W later.")
            pieces = split_pieces() if key is not None and split_pieces is not None else None
            if pieces is None:
                return full(args)
            split, b, w = pieces
            out = list(b(args))
            self.pending[key] = (w, split.weight_outputs, out[n_out:])
            return out[:n_out]

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def pending_bytes(self, key: Any = None) -> int:
        """Bytes the carries of ``key`` (None: of every pending backward) hold: each distinct
        storage once (``untyped_storage().nbytes()``: a view keeps its whole storage alive, and
        two views of one storage hold it once), the parameters' storages not counted (they stay
        alive anyway)."""
        params = {p().untyped_storage().data_ptr() for p in self.params if p is not None and p() is not None}
        entries = [self.pending[key]] if key is not None else list(self.pending.values())
        seen: dict[int, int] = {}
        for _, _, carry in entries:
            for t in iter_tensors(carry):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in params:
                    seen[ptr] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def run_weights(self, key: Any) -> bool:
        """Run W of ``key``'s deferred backward and accumulate into ``.grad``; False if none."""
        entry = self.pending.pop(key, None)
        if entry is None:
            return False
        w, positions, carry = entry
        with torch.no_grad():
            grads = w(carry)
        from lynx_compile.memory.measure import record_backward_outputs

        record_backward_outputs(grads)  # gradients, not activations, in a running measurement
        for i, g in zip(positions, grads):
            p = self.params[i]()
            if p is None or g is None:
                continue
            if p.grad is None:
                p.grad = g.detach()
            else:
                p.grad += g
        self.deferred += 1
        return True
