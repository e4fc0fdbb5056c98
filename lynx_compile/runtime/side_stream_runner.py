"""Run a backward graph's side-stream segments on a secondary CUDA stream.

``side_stream_pass`` brackets each recompute segment with ``lynx.side_stream_begin / end`` and
puts ``lynx.side_stream_wait`` before its first main-stream use (``runtime/stream_ops.py``).
``SideStreamRunner`` cuts the graph at those markers into pieces, compiles each piece on its own,
and runs them in graph order::

    main piece 0                                  (main stream)
    begin k:  side.wait_stream(main); inputs.record_stream(side)
    side piece k under torch.cuda.stream(side)    (queued; runs beside what follows)
    end k:    event_k.record(side); outputs.record_stream(main)
    main piece 1                                  (main stream, overlaps side piece k)
    wait k:   main.wait_event(event_k)
    main piece 2 ...

``record_stream`` is what keeps the caching allocator honest across streams: a tensor the main
stream allocated and the side stream reads must not be reused before the side stream is done
with it, and a recomputed tensor the side stream allocated is freed after the main stream's use.
Values are dropped after their last piece, as the single graph would free them.

``InlineStreams`` (any device without CUDA streams) runs the same pieces in the same order on
one stream and keeps a log of the marker actions; results are those of the uncut graph.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from lynx_compile import _compat

from .prefetch import _placeholder_like
from .stream_ops import BEGIN, END, MARKERS


@dataclass
class Step:
    kind: str  # "main" | "side" | "begin" | "end" | "wait"
    segment: int = -1
    piece: fx.GraphModule | None = None
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    run: Callable | None = None
    drop: tuple[str, ...] = field(default=())
    """Values whose last use is this step (freed after it)."""


def split_at_markers(gm: fx.GraphModule) -> list[Step]:
    """The graph as steps: pieces of consecutive nodes cut at every marker, and the markers."""
    steps: list[Step] = []
    current: list[fx.Node] = []
    kind = "main"

    def close(next_kind: str) -> None:
        nonlocal current, kind
        if current:
            steps.append(Step(kind, piece=_piece(gm, current)))
        current, kind = [], next_kind

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.target in MARKERS:
            k = node.args[0]
            if node.target is BEGIN:
                close("side")
                steps.append(Step("begin", k, reads=tuple(a.name for a in node.args[1])))
            elif node.target is END:
                close("main")
                steps.append(Step("end", k, reads=tuple(a.name for a in node.args[1])))
            else:
                close("main")
                steps.append(Step("wait", k))
            continue
        current.append(node)
    close("main")
    for step in steps:
        if step.piece is not None:
            step.reads = tuple(p.name for p in step.piece.graph.find_nodes(op="placeholder"))
            step.writes = tuple(n.name for n in step.piece.graph.output_node().args[0])
    return steps


def _piece(gm: fx.GraphModule, nodes: list[fx.Node]) -> fx.GraphModule:
    """``nodes`` as a graph: placeholders for what it reads from outside, outputs for what
    anything outside (later pieces, markers, the graph's output) reads."""
    members = set(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a not in env:
                env[a] = _placeholder_like(graph, a.name, a)
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in nodes if any(u not in members for u in n.users)))
    return fx.GraphModule(gm, graph, "lynx_piece")


class InlineStreams:
    """One stream: markers only logged (CPU, or any device without CUDA streams)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def begin(self, k: int, inputs: list) -> None:
        self.log.append(("begin", k))

    def side(self):
        return contextlib.nullcontext()

    def end(self, k: int, outputs: list) -> None:
        self.log.append(("end", k))

    def wait(self, k: int) -> None:
        self.log.append(("wait", k))


class CudaStreams:
    """A secondary CUDA stream for ``device``, with one event per launched segment."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.events: dict[int, torch.cuda.Event] = {}

    def begin(self, k: int, inputs: list) -> None:
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # inputs were produced on the main stream
        for t in _tensors(inputs):
            t.record_stream(self.stream)

    def side(self):
        return torch.cuda.stream(self.stream)

    def end(self, k: int, outputs: list) -> None:
        event = torch.cuda.Event()
        event.record(self.stream)
        self.events[k] = event
        main = torch.cuda.current_stream(self.device)
        for t in _tensors(outputs):
            t.record_stream(main)

    def wait(self, k: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.events.pop(k))


def _tensors(values: list) -> list[torch.Tensor]:
    return [t for t in _compat.tree_leaves(values) if isinstance(t, torch.Tensor)]


class SideStreamRunner:
    """The boxed callable that runs ``gm`` as drawn in the module docstring."""

    def __init__(self, gm: fx.GraphModule, compile_fn: Callable[[fx.GraphModule], Callable], streams) -> None:
        self.streams = streams
        self.steps = split_at_markers(gm)
        self.inputs = tuple(p.name for p in gm.graph.find_nodes(op="placeholder"))
        out = gm.graph.output_node()
        self.output_spec = out.args[0]
        needed_at_end = {n.name for n in out.all_input_nodes}
        last: dict[str, int] = {}
        for i, step in enumerate(self.steps):
            for name in step.reads:
                last[name] = i
        for i, step in enumerate(self.steps):
            step.drop = tuple(n for n, j in last.items() if j == i and n not in needed_at_end)
            if step.piece is not None:
                step.run = compile_fn(step.piece)
        self.launches = 0

    @property
    def num_segments(self) -> int:
        return sum(s.kind == "begin" for s in self.steps)

    def __call__(self, args: list) -> Any:
        env = dict(zip(self.inputs, args))
        args.clear()  # boxed: the caller's references to saved tensors go; env holds them
        for step in self.steps:
            if step.kind in ("main", "side"):
                ins = [env[n] for n in step.reads]
                with self.streams.side() if step.kind == "side" else contextlib.nullcontext():
                    outs = step.run(ins)
                env.update(zip(step.writes, outs))
            elif step.kind == "begin":
                self.streams.begin(step.segment, [env[n] for n in step.reads])
                self.launches += 1
            elif step.kind == "end":
                self.streams.end(step.segment, [env[n] for n in step.reads])
            else:
                self.streams.wait(step.segment)
            for name in step.drop:
                env.pop(name, None)
        return fx.node.map_arg(self.output_spec, lambda n: env[n.name])


SideStreamRunner._boxed_call = True  # type: ignore[attr-defined]
