"""Bracket each recompute segment of the backward for the side stream, one segment ahead.

Reads ``meta.RECOMPUTED`` and ``meta.COST``, ``config.side_stream`` and ``config.side_stream_extra_bytes``. Writes
``meta.SIDE_STREAM = k`` on the nodes of segment k and on its markers, and
``record.stats["side_stream"]``.

A *segment* is a maximal run of consecutive recomputed nodes (collectives excluded: they stay on
the main stream with their wait). torch's partitioner places recompute on demand, right before
its first use, so on one stream it always delays the gradient ops behind it. This pass launches
segment k as soon as segment k - 1's results are being consumed (or, for the first, as soon as
its inputs exist), so it runs on the side stream while the main stream computes the gradients
that precede its use::

    before:  ...grad ops of block i (use R_{i})...  R_{i-1} recompute  grad ops of block i-1
    after:   wait(i) grad ops of block i ...         | main stream
             begin(i-1) R_{i-1} end(i-1)              | side stream, concurrently
             ... wait(i-1) grad ops of block i-1

Launching one segment ahead holds its outputs from launch to use. A segment is launched early
only when that keeps the backward's simulated peak within ``side_stream_extra_bytes`` of where
it was; otherwise it stays where the partitioner put it (still on the side stream, counted in
``not_launched_early``). The memory simulation that follows the pass sees the final graph, so
the plan's predicted peak includes it. Markers are the custom ops of
``lynx_compile.runtime.stream_ops``; ``SideStreamRunner`` executes them on CUDA, elsewhere they
are no-ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from lynx_compile.costs.analytic import is_free_node
from lynx_compile.graph.collectives import is_collective_node, is_wait_node
from lynx_compile.runtime import stream_ops

from . import meta
from .context import PassContext


@dataclass
class Segment:
    index: int
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]


def side_stream_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if not ctx.config.side_stream:
        return gm
    segments = find_segments(gm)
    base_peak = _backward_peak(gm)
    previous_wait: fx.Node | None = None
    overlapped, in_place = 0, 0
    for seg in segments:
        origin = seg.nodes[0].prev
        begin, end = _move_and_bracket(gm, seg, previous_wait)
        if begin.prev is not origin and _backward_peak(gm) > base_peak + ctx.config.side_stream_extra_bytes:
            # launching early would hold its outputs over the backward's peak: launch it where
            # the partitioner put it (still on the side stream, overlapping nothing)
            for node in (begin, *seg.nodes, end):
                origin.append(node)
                origin = node
            in_place += 1
        overlapped += _main_nodes_between(end, seg, gm)
        previous_wait = _insert_wait(gm, seg, end)
    try:
        gm.graph.lint()
    except Exception as e:  # a segment moved above one of its inputs
        raise RuntimeError(f"lynx bug: side-stream placement broke the graph order: {e}") from e
    ctx.record.stats["side_stream"] = {
        "segments": len(segments),
        "nodes": sum(len(s.nodes) for s in segments),
        "recompute_s": sum(_seconds(n) for s in segments for n in s.nodes),
        "main_nodes_overlapped": overlapped,
        "not_launched_early": in_place,
    }
    return gm


def find_segments(gm: fx.GraphModule) -> list[Segment]:
    """Maximal runs of recomputed, non-collective nodes with real work (not only views)."""
    runs: list[list[fx.Node]] = [[]]
    for node in gm.graph.nodes:
        if _is_side_node(node):
            runs[-1].append(node)
        elif runs[-1]:
            runs.append([])
    segments = []
    for run in runs:
        if not run or all(is_free_node(n) for n in run):
            continue
        members = set(run)
        inputs = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in members))
        outputs = [n for n in run if any(u not in members for u in n.users)]
        segments.append(Segment(len(segments), run, inputs, outputs))
    return segments


def _is_side_node(node: fx.Node) -> bool:
    return (node.op == "call_function" and bool(node.meta.get(meta.RECOMPUTED))
            and not is_collective_node(node) and not is_wait_node(node))


def _move_and_bracket(gm: fx.GraphModule, seg: Segment, previous_wait: fx.Node | None) -> tuple[fx.Node, fx.Node]:
    """Move ``seg`` to right after the later of its last input and the previous segment's wait,
    between a begin and an end marker; returns (begin, end)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    anchors = [a for a in seg.inputs if a.op != "placeholder"] + ([previous_wait] if previous_wait else [])
    if anchors:
        anchor = max(anchors, key=order.__getitem__)
    else:  # only graph inputs: launch before everything else
        anchor = list(gm.graph.find_nodes(op="placeholder"))[-1]
    if order[anchor] >= order[seg.nodes[0]]:  # never later than where the partitioner put it
        anchor = seg.nodes[0].prev
    with gm.graph.inserting_after(anchor):
        begin = gm.graph.call_function(stream_ops.BEGIN, (seg.index, list(seg.inputs)))
    at = begin
    for node in seg.nodes:
        at.append(node)
        at = node
    with gm.graph.inserting_after(at):
        end = gm.graph.call_function(stream_ops.END, (seg.index, list(seg.outputs)))
    for node in (begin, *seg.nodes, end):
        node.meta[meta.SIDE_STREAM] = seg.index
    begin.meta["val"] = end.meta["val"] = None
    return begin, end


def _insert_wait(gm: fx.GraphModule, seg: Segment, end: fx.Node) -> fx.Node:
    """The main stream waits right before the first node outside ``seg`` that reads an output."""
    members = set(seg.nodes) | {end}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = min((u for n in seg.outputs for u in n.users if u not in members), key=order.__getitem__)
    with gm.graph.inserting_before(first):
        wait = gm.graph.call_function(stream_ops.WAIT, (seg.index,))
    wait.meta[meta.SIDE_STREAM] = seg.index
    wait.meta["val"] = None
    return wait


def _main_nodes_between(end: fx.Node, seg: Segment, gm: fx.GraphModule) -> int:
    """Main-stream nodes between the segment's end and its first consumer: the overlap room."""
    members = set(seg.nodes)
    count, node = 0, end.next
    while node.op != "output" and not any(a in members for a in node.all_input_nodes):
        count += node.op == "call_function"
        node = node.next
    return count


def _backward_peak(gm: fx.GraphModule) -> int:
    """Peak bytes of the backward, its inputs (saved tensors, tangents) freed at their last use."""
    from lynx_compile.memory.simulate import held_tangents, simulate_graph  # memory imports passes.meta
    from lynx_compile.memory.storage import _nbytes

    inputs = {p.name: _nbytes(p.meta.get("val")) for p in gm.graph.find_nodes(op="placeholder")}
    return simulate_graph(gm, live_inputs=inputs, input_keys={n: n for n in inputs},
                          count_outputs=False, held_inputs=held_tangents(inputs)).peak_bytes


def _seconds(node: fx.Node) -> float:
    cost = node.meta.get(meta.COST)
    return cost.runtime_s if cost is not None else 0.0
