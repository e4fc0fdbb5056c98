"""Recompute ahead of the backward: run the gradient-free prefix of a backward graph early.

A pipeline stage's backward for micro-batch j cannot start before the next stage sends the
gradient of j. The recomputation in that backward needs no gradient (it re-runs forward ops on
saved tensors), so it can run while the gradient is still in flight. ``split_backward`` cuts
the backward graph in two::

    bw(saved..., tangents...)                 pre(saved_subset...) -> recomputed...
      recompute  (no tangent upstream)  ==>   main(saved..., tangents..., recomputed...)
      gradient ops                            (the same graph, recompute nodes now inputs)

Only recomputed nodes (``meta.RECOMPUTED``) with no tangent upstream go into ``pre``, in graph
order, until their outputs reach ``byte_limit``: what ``pre`` produces stays alive from the
early run until ``main`` uses it, so it costs memory the plan did not budget for; the limit is
the stage's headroom under its memory per device.

``GraphRuntime`` keeps, per micro-batch key, the saved tensors the compiled forward produced
and the early ``pre`` outputs, until that micro-batch's backward (or early run) takes them;
a graph with no early prefix keeps nothing. The key is whatever ``microbatch(key)`` set around the forward
and backward calls (``LynxPipelineStage`` sets its chunk id); outside such a block nothing is
captured and the backward runs ``pre`` then ``main`` inline.
"""
from __future__ import annotations

import contextlib
import contextvars
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from lynx_compile.graph.collectives import is_collective_node, is_wait_node
from lynx_compile.passes import meta

_KEY: contextvars.ContextVar[Any] = contextvars.ContextVar("lynx_microbatch", default=None)


@contextlib.contextmanager
def microbatch(key: Any) -> Iterator[None]:
    """Tag forward/backward calls inside with ``key`` (e.g. a pipeline chunk id)."""
    token = _KEY.set(key)
    try:
        yield
    finally:
        _KEY.reset(token)


def current_microbatch() -> Any:
    return _KEY.get()


@dataclass
class BackwardSplit:
    pre: fx.GraphModule
    main: fx.GraphModule
    pre_inputs: tuple[int, ...]
    """Positions of the backward's inputs that ``pre`` reads."""
    pre_input_names: tuple[str, ...]
    pre_bytes: int
    pre_nodes: int


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return sum(v.untyped_storage().nbytes() if isinstance(v, torch.Tensor) and v._base is None
               else 0 for v in vals)


def _placeholder_like(graph: fx.Graph, name: str, like: fx.Node) -> fx.Node:
    node = graph.placeholder(name)
    node.meta = dict(like.meta)
    return node


def split_backward(bw: fx.GraphModule, byte_limit: float | None = None) -> BackwardSplit | None:
    """Cut ``bw`` into (pre, main) as drawn in the module docstring; None when nothing moves."""
    placeholders = list(bw.graph.find_nodes(op="placeholder"))
    tangent_free = {p for p in placeholders if not p.name.startswith("tangents")}
    chosen: list[fx.Node] = []
    total = 0
    for node in bw.graph.nodes:
        if node.op != "call_function" or not node.meta.get(meta.RECOMPUTED) or is_collective_node(node) \
                or is_wait_node(node):
            continue
        if not all(a in tangent_free for a in node.all_input_nodes):
            continue
        size = _nbytes(node)
        if byte_limit is not None and total + size > byte_limit:
            break
        chosen.append(node)
        tangent_free.add(node)
        total += size
    # a multi-output op goes with its getitems
    for node in list(chosen):
        for user in node.users:
            if user.target is operator.getitem and user not in tangent_free:
                chosen.append(user)
                tangent_free.add(user)
    if not chosen:
        return None
    chosen_set = set(chosen)
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    chosen.sort(key=order.get)
    outputs = [n for n in chosen if any(u not in chosen_set for u in n.users)]
    inputs = sorted({a for n in chosen for a in n.all_input_nodes if a.op == "placeholder"}, key=order.get)

    pre_graph = fx.Graph()
    env = {p: _placeholder_like(pre_graph, p.name, p) for p in inputs}
    for n in chosen:
        env[n] = pre_graph.node_copy(n, lambda a: env[a])
    pre_graph.output(tuple(env[n] for n in outputs))
    pre = fx.GraphModule(bw, pre_graph, "lynx_recompute_pre")

    main_graph = fx.Graph()
    menv = {p: _placeholder_like(main_graph, p.name, p) for p in placeholders}
    menv.update({n: _placeholder_like(main_graph, f"{n.name}_early", n) for n in outputs})
    for n in bw.graph.nodes:
        if n.op == "placeholder" or n in chosen_set:
            continue
        menv[n] = main_graph.node_copy(n, lambda a: menv[a])
    main = fx.GraphModule(bw, main_graph, "lynx_backward_main")
    main.graph.lint()
    return BackwardSplit(pre=pre, main=main, pre_inputs=tuple(placeholders.index(p) for p in inputs),
                         pre_input_names=tuple(p.name for p in inputs),
                         pre_bytes=total, pre_nodes=len(chosen))


class GraphRuntime:
    """One compiled graph's early-recompute state (see the module docstring)."""

    def __init__(self) -> None:
        self.saved_names: tuple[str, ...] = ()
        """Backward input names that are forward outputs (set by the partitioner)."""
        self.fw_positions: tuple[int, ...] = ()
        """Per backward input that the forward produced: its position among forward outputs."""
        self.split: BackwardSplit | None = None
        self.captured: dict[Any, dict[str, Any]] = {}
        self.ready: dict[Any, tuple] = {}
        self.early_runs = 0

    def wrap_forward(self, fw: fx.GraphModule, inner: Callable) -> Callable:
        out_node = fw.graph.output_node()
        names = [a.name if isinstance(a, fx.Node) else None for a in out_node.args[0]]
        self.fw_positions = tuple(names.index(n) if n in names else -1 for n in self.saved_names)

        def run(args: list) -> Any:
            out = inner(args)
            key = _KEY.get()
            if key is not None and self.fw_positions:
                self.captured[key] = {name: out[i] for name, i in zip(self.saved_names, self.fw_positions) if i >= 0}
            return out

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def wrap_backward(self, bw: fx.GraphModule, compile_fn: Callable, byte_limit: float | None) -> Callable:
        self.split = split_backward(bw, byte_limit)
        if self.split is None:
            # Nothing to run early: the forward captures nothing from now on, and what it captured
            # before this (lazy) compile goes at each micro-batch's backward. Kept, it held every
            # micro-batch's saved tensors past its backward, to the next step's forward.
            self.fw_positions = ()
            whole = compile_fn(bw)

            def run_whole(args: list) -> Any:
                key = _KEY.get()
                if key is not None:
                    self.captured.pop(key, None)
                return whole(args)

            run_whole._boxed_call = True  # type: ignore[attr-defined]
            return run_whole
        pre = self.split.pre
        main = compile_fn(self.split.main)
        pre_inputs = self.split.pre_inputs

        def run(args: list) -> Any:
            key = _KEY.get()
            early = self.ready.pop(key, None) if key is not None else None
            self.captured.pop(key, None)
            if early is None:
                early = pre(*[args[i] for i in pre_inputs])
            args = list(args) + list(early)
            return main(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def run_early(self, key: Any) -> bool:
        """Run the recompute prefix of ``key``'s backward now; False when there is nothing to run."""
        if self.split is None or key not in self.captured or key in self.ready:
            return False
        saved = self.captured.pop(key)
        if any(name not in saved for name in self.split.pre_input_names):
            return False
        with torch.no_grad():
            self.ready[key] = self.split.pre(*[saved[name] for name in self.split.pre_input_names])
        self.early_runs += 1
        return True
