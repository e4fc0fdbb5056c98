"""Recompute priced as Inductor runs it: by kernel, not by node (issue R, item 1).

Inductor computes a pointwise value inside the loop kernels that read it (the memory model's
``memory.inductor_model.interior_nodes``: the same rule decides where a value lives and what it
costs). So a recomputed GELU read by its gradient's kernel adds its FLOPs, and the bytes it reads
in place of the saved value, to a kernel the backward runs anyway; a recomputed norm's chain of
pointwise ops is one kernel, not one launch and one round trip to memory per op. Priced per node
(``analytic.analytic_node_cost``: a roofline and a launch each), the H200's pointwise recompute
was predicted at 4.8 ms and ran in 1.6 ms, and lynx chose matmuls instead.

The model, on the list of nodes Inductor compiles (a backward graph):

- every node that materializes (not an interior value, a view, a getitem or a wait) is one
  kernel; its **body** is itself and the interior values it reads, through views, transitively
  (a value read by several kernels is computed in each);
- a loop kernel (its node pointwise, a reduction, a gather or scatter) costs the roofline of its
  body: the FLOPs of every body node at its rate, against the bytes it reads from buffers
  (each distinct buffer once) and writes; one launch. Any other kernel (a matmul, attention, a
  collective, an aten fallback) costs its node's own ``meta.COST``, as before.

The recompute of a graph is priced kernel by kernel (:func:`recompute_seconds`):

- a kernel whose own node is recomputed: all of it, its launch included;
- a kernel that runs anyway and computes recomputed interior values: what they add, its
  roofline minus that of the same kernel reading those values from buffers (no launch; 0 where
  recomputing reads no more than the saved value's read, and the FLOPs hide under the bytes).

Applies where Inductor compiles the graph with analytic costs (``meta.KERNEL_PROFILE`` on the
joint graph, set by ``annotate_costs_pass``); eager runs one kernel per op, and measured node
costs have no kernel to add up: both keep the per-node sum.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable

import torch.fx as fx

from lynx_compile.costs.analytic import (_dtype_of, analytic_node_cost, is_free_node, matrix_flops, node_flops,
                                         tensor_bytes_of)
from lynx_compile.costs.hardware import HardwareProfile
from lynx_compile.graph.values import iter_tensors, tensor_read_bytes
from lynx_compile.memory.inductor_model import interior_nodes, is_loop_kernel, view_source


class Kernel:
    """One kernel Inductor generates: ``node`` (the value it writes) and ``body`` (``node`` first,
    then the interior values it computes); ``reads``: the nodes whose buffers it reads."""

    __slots__ = ("node", "body", "reads")

    def __init__(self, node: fx.Node, body: list[fx.Node], reads: list[fx.Node]):
        self.node, self.body, self.reads = node, body, reads

    @property
    def loop(self) -> bool:
        return is_loop_kernel(self.node)


def kernels(nodes: Iterable[fx.Node], interior: Collection[fx.Node] | None = None) -> list[Kernel]:
    """The kernels of ``nodes`` (a graph's nodes in order) as the module docstring describes;
    ``interior``: ``interior_nodes(nodes)`` when the caller has it."""
    nodes = list(nodes)
    interior = interior_nodes(nodes) if interior is None else interior
    return [Kernel(node, *_body(node, interior)) for node in nodes
            if node.op == "call_function" and node not in interior and not is_free_node(node)]


def _body(node: fx.Node, interior: Collection[fx.Node],
          stop: Collection[fx.Node] = ()) -> tuple[list[fx.Node], list[fx.Node]]:
    """(body, buffers read) of the kernel writing ``node``; a value in ``stop`` is read from a
    buffer even where it is interior (the kernel as it would run with that value saved). A view
    of an interior value is indexing inside the body; a view of a buffer is read at its size."""
    body, reads, seen = [node], [], {node}
    stack = [node]
    while stack:
        n = stack.pop()
        for i in n.all_input_nodes:
            src = view_source(i)
            if src in interior and src not in stop:
                if src not in seen:
                    seen.add(src)
                    body.append(src)
                    stack.append(src)
            elif i not in seen:
                seen.add(i)
                reads.append(i)
    return body, reads


def _read_bytes(values: Iterable[fx.Node]) -> int:
    """Bytes a kernel reads from the buffers of ``values`` (each once)."""
    return sum(tensor_read_bytes(t) for r in dict.fromkeys(values) for t in iter_tensors(r.meta.get("val")))


def _memory_seconds(nbytes: int, profile: HardwareProfile) -> float:
    return profile.memory_seconds(nbytes)


def loop_seconds(body: Iterable[fx.Node], reads: Iterable[fx.Node], written: int,
                 profile: HardwareProfile, *, launch: bool = True) -> float:
    """Roofline of a loop kernel computing ``body``, reading ``reads``' values and writing
    ``written`` bytes: max(FLOPs at each node's rate, bytes at the memory rate), plus a launch."""
    compute = 0.0
    for n in body:
        flops, matmul_like = node_flops(n)
        if flops:
            rate = profile.peak_flops_for(_dtype_of(n), matmul=matmul_like) * profile.matmul_efficiency
            compute += flops / (rate * profile.matmul_fraction(matrix_flops(n, flops)) if matmul_like else rate)
    memory = _memory_seconds(written + _read_bytes(reads), profile)
    return max(compute, memory) + (profile.launch_overhead_s if launch else 0.0)


def written_seconds(node: fx.Node, profile: HardwareProfile) -> float:
    """The least a kernel writing ``node``'s value costs: its launch and the bytes it writes."""
    return _memory_seconds(tensor_bytes_of(node), profile) + profile.launch_overhead_s


def recompute_seconds(nodes: Iterable[fx.Node], recomputed: Collection[fx.Node], profile: HardwareProfile,
                      node_seconds=None) -> float:
    """Seconds the ``recomputed`` nodes of ``nodes`` (a backward graph in order) add, priced by
    kernel (module docstring). ``node_seconds(node)``: the cost of a kernel that is no loop
    kernel (default: its analytic cost on ``profile``; a backward copy may read its forward
    node's annotated cost instead)."""
    node_seconds = node_seconds or (lambda node: analytic_node_cost(node, profile).runtime_s)
    nodes = list(nodes)
    interior = interior_nodes(nodes)
    rec = set(recomputed)
    total = 0.0
    for k in kernels(nodes, interior):
        if not k.loop:
            total += node_seconds(k.node) if k.node in rec else 0.0
            continue
        inner = [n for n in k.body[1:] if n in rec]
        written = tensor_bytes_of(k.node)
        if k.node in rec:
            total += loop_seconds(k.body, k.reads, written, profile)
        elif inner:  # a kernel that runs anyway: what its recomputed interior values add
            saved_body, saved_reads = _body(k.node, interior, stop=inner)
            added = (loop_seconds(k.body, k.reads, written, profile, launch=False)
                     - loop_seconds(saved_body, saved_reads, written, profile, launch=False))
            total += max(0.0, added)
    return total


def fused_unit_seconds(members: list[fx.Node], external: Iterable[fx.Node], out_bytes: int,
                       read_in_loop: bool, profile: HardwareProfile) -> float:
    """The recompute optimizer's price of one unit of loop ops (``members``: its op and the
    pointwise values folded into it), reading ``external`` values: where every reader reads it
    inside a loop kernel (``read_in_loop``), what it adds to those kernels (its FLOPs, and the
    bytes it reads beyond the ``out_bytes`` read of its saved value it replaces; no launch);
    otherwise a kernel of its own writing ``out_bytes``."""
    if read_in_loop:
        compute = loop_seconds(members, (), 0, profile, launch=False)
        return max(compute, _memory_seconds(max(0, _read_bytes(external) - out_bytes), profile))
    return loop_seconds(members, external, out_bytes, profile)


__all__ = ["Kernel", "fused_unit_seconds", "kernels", "loop_seconds", "recompute_seconds", "written_seconds"]
