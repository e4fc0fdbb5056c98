"""``weight_split_census``: what a micro-batch holds from B to W, read off the traced backward.

Each segment's ``carry_bytes`` (what a micro-batch holds from B to W, ``runtime.weight_split``)
is read off the model's backward graph as lynx's eager compiler builds it when it recomputes
nothing (torch's default partition of the canonicalized joint, traced once more; nothing
runs): B is every node whose value flows into the backward of an earlier segment
(a stage starting at any block computes the gradient of its input through them), W and its
carry are ``weight_split.weight_side`` of that, as ``split_weight_grads`` cuts a stage::

    bw of segments  ... block 3 | block 4 ...     B(stage from block 4) = what reaches block 3
    carry of block 4: inputs of block 4's W (saved x, dy of each linear, ...), by storage

Each storage counts once (``memory.simulate``'s storage keys: saved views of one tensor share
their forward storage), parameters not at all, at the segment whose W reads it. Exact for a stage
that recomputes nothing (``tests/test_pipeline_bw_carry.py`` against ``WeightDeferral``'s real
carry); a stage that recomputes carries what W reads of the recomputed values instead, which
the profile does not trace.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.fx as fx
from torch import nn

from lynx_compile import _compat


class _Traced(Exception):
    """Raised by the capturing partition once it holds the graphs: nothing needs to run."""


def traced_backward(module: nn.Module,
                    example_inputs: Sequence[Any]) -> tuple[fx.GraphModule, fx.GraphModule, list[bool]]:
    """(forward, backward, per graph input: is it a parameter) of ``module`` on
    ``example_inputs``, partitioned as lynx's eager compiler does when nothing is recomputed
    (``apply.partition_joint`` of the canonicalized joint). Compiles nothing and runs nothing."""
    from lynx_compile.recompute.apply import partition_joint
    from lynx_compile.compiler.dynamo_backend import find_backend_error

    got: list = []

    def partition(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **_):
        kw = dict(num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static_lifetime_input_indices)
        got.append(partition_joint(_compat.canonicalize_joint(joint), joint_inputs, kw, inductor=False))
        raise _Traced()

    def backend(gm: fx.GraphModule, inputs: list) -> Callable:
        got.append([isinstance(t, nn.Parameter) for t in inputs])  # dynamo's inputs: the backward's outputs
        return _compat.aot_autograd(fw_compiler=lambda g, _: g, partition_fn=partition)(gm, inputs)

    torch.compiler.reset()
    try:
        with torch.enable_grad():
            torch.compile(module, backend=backend, fullgraph=True)(*example_inputs)
    except Exception as e:  # noqa: BLE001 - dynamo wraps the partition's exception
        if find_backend_error(e, _Traced) is None:
            raise
    finally:
        torch.compiler.reset()
    if len(got) != 2:
        raise RuntimeError("tracing the model's backward gave no partitioned graph")
    (fw, bw), params = got[1], got[0]
    return fw, bw, params


def carry_bytes(module: nn.Module, example_inputs: Sequence[Any], block_paths: Sequence[str]) -> list[int]:
    """Per block of ``block_paths`` and, last, the post-block work: the bytes one micro-batch
    holds from B to W in a stage whose input has a gradient (module docstring)."""
    return weight_split_census(module, example_inputs, block_paths).carry


class WeightSplitCensus(NamedTuple):
    """What ``weight_split_census`` reads off the traced backward."""

    carry: list[int]
    """Per block, and last the post-block work: ``SegmentCost.carry_bytes``."""
    carry_saved: list[int]
    """The part of ``carry`` that is saved forward tensors: alive from F anyway, so B adds only
    the rest (``SegmentCost.carry_saved_bytes``)."""
    w_only: frozenset[str]
    read_in_b: frozenset[str]


def weight_split_census(module: nn.Module, example_inputs: Sequence[Any],
                        block_paths: Sequence[str]) -> WeightSplitCensus:
    """``carry_bytes`` and its saved part; the forward storages (``memory.simulate`` keys: an op's name, or
    ``name[i]`` for output i of a multi-output op) that the traced backward reads only in W; and
    those it reads in B. Read only in W:
    saved tensors no op of B reads, such as the input of a linear layer (``dW = dy.T @ x``; B's
    ``dx = dy @ W`` does not read x). A recompute of one of them runs in W
    (``runtime.weight_split``), where a zero-bubble schedule may place it in a bubble."""
    from lynx_compile.memory.simulate import backward_inputs
    from lynx_compile.memory.storage import allocations, storage_keys
    from lynx_compile.runtime.weight_split import ancestors, weight_side

    fw, bw, params = traced_backward(module, example_inputs)
    n = len(block_paths)
    outs = list(bw.graph.output_node().args[0])
    if len(outs) != len(params):  # the outputs cannot be matched to parameters (as WeightDeferral would not)
        return WeightSplitCensus([0] * (n + 1), [0] * (n + 1), frozenset(), frozenset())
    seg = _backward_segments(fw, bw, block_paths)
    # B: what flows into the backward of an earlier segment (lowest segment reachable, users first)
    low: dict[fx.Node, float] = {}
    for node in reversed(bw.graph.nodes):
        low[node] = min((min(seg.get(u, math.inf), low[u]) for u in node.users if u.op != "output"),
                        default=math.inf)
    b_set = ancestors([u for u in bw.graph.nodes if u.op == "call_function" and u in seg and low[u] < seg[u]])
    roots = [o for o, p in zip(outs, params) if p and isinstance(o, fx.Node)]
    root_set = set(roots)
    w_set, carried = weight_side(bw.graph, b_set, roots)
    input_keys, size = backward_inputs(fw, bw)  # saved tensors: their forward storage; parameters 0
    keys = storage_keys(bw, input_keys)
    for node in bw.graph.nodes:
        size.update(allocations(node))
    read_in_b: set[str] = set()
    read_in_w: set[str] = set()
    for ph in bw.graph.find_nodes(op="placeholder"):
        if ph.name.startswith("tangents") or ph not in keys:
            continue
        for u in ph.users:
            (read_in_w if u in w_set else read_in_b).add(keys[ph])
    saved_keys = {keys[ph] for ph in bw.graph.find_nodes(op="placeholder")
                  if ph in keys and not ph.name.startswith("tangents")}  # a view B takes of one shares it
    out, saved, seen = [0] * (n + 1), [0] * (n + 1), set()
    for c in carried:
        readers = [seg[u] for u in c.users if u in w_set and u in seg]
        readers += [seg[c]] if c in root_set and c in seg else []  # a weight gradient B computed
        if not readers or max(readers) < 0:  # read by the pre-block work's W: the first stage's, counted there
            continue
        multi = isinstance(c.meta.get("val"), (tuple, list))
        for key in ([k for k, _ in allocations(c)] if multi else [keys[c]]):
            if key not in seen:
                seen.add(key)
                out[max(readers)] += size.get(key, 0)
                if key in saved_keys:
                    saved[max(readers)] += size.get(key, 0)
    return WeightSplitCensus(out, saved, frozenset(read_in_w - read_in_b), frozenset(read_in_b))


def _backward_segments(fw: fx.GraphModule, bw: fx.GraphModule, block_paths: Sequence[str]) -> dict[fx.Node, int]:
    """Segment of each backward node: -1 before the blocks, b for block b, len(blocks) after.
    A forward node's is its module's (before / after the first block's first node when outside
    the blocks); a backward op takes its forward op's (``seq_nr``), saved tensors their forward
    value's, the output gradients the last; the rest (a gradient sum with no forward op) the
    latest segment among the gradients it reads."""
    from lynx_compile.passes.find_blocks import module_paths

    index = {p: b for b, p in enumerate(block_paths)}

    def block_of(node: fx.Node) -> int | None:
        for path in module_paths(node):
            parts = path.split(".")
            for k in range(len(parts), 0, -1):
                if ".".join(parts[:k]) in index:
                    return index[".".join(parts[:k])]
        return None

    n, fw_seg, by_seq = len(block_paths), {}, {}
    ops = [node for node in fw.graph.nodes if node.op == "call_function"]
    blocks = [block_of(node) for node in ops]
    inside = [i for i, b in enumerate(blocks) if b is not None]
    last = None
    for i, (node, b) in enumerate(zip(ops, blocks)):
        last = b if b is not None else last
        fw_seg[node.name] = b if b is not None else -1 if not inside or i < inside[0] else n if i > inside[-1] else last
        if "seq_nr" in node.meta:
            by_seq.setdefault(node.meta["seq_nr"], fw_seg[node.name])
    seg: dict[fx.Node, int] = {}
    for node in bw.graph.nodes:
        if node.op == "placeholder":
            if node.name in fw_seg:
                seg[node] = fw_seg[node.name]
            elif node.name.startswith("tangents"):
                seg[node] = n
        elif node.op == "call_function":
            s = by_seq.get(node.meta.get("seq_nr"))
            if s is None:
                grads = [a for a in node.all_input_nodes if a.op != "placeholder" or a.name.startswith("tangents")]
                s = max((seg[a] for a in grads if a in seg), default=None)
            if s is not None:
                seg[node] = s
    return seg
