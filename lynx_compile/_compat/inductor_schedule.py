"""Inside Inductor's compile, from a post-grad or post-fusion callback: ordering edges between
nodes, the graph's inputs, Inductor's own memory estimate of the schedule, and which
accumulating scatters it leaves to aten."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.fx as fx


def inductor_preserve_node_ordering(graph: fx.Graph, deps: dict) -> None:
    """Make each node in ``deps`` run after the nodes it maps to, in Inductor's schedule: torch's
    own ``control_deps`` ordering edges (``fx_passes.control_dependencies.preserve_node_ordering``,
    2.11 and 2.13, what Inductor's compute/communication overlap uses). Call from a post-grad pass."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    preserve_node_ordering(graph, {n: OrderedSet(d) for n, d in deps.items() if d})


def inductor_graph_input_names() -> list[str]:
    """Names of the inputs of the graph Inductor is compiling now (``V.graph.graph_inputs``,
    2.11 and 2.13); call from a ``post_fusion`` callback."""
    from torch._inductor.virtualized import V

    return list(V.graph.graph_inputs)


def inductor_schedule_memory(nodes: list, *, count_input: Callable[[str], bool],
                             count_output: bool) -> tuple[int, dict[str, int]]:
    """Inductor's own memory estimate of the graph it is scheduling now (call it from a
    ``post_fusion`` callback; ``torch._inductor.memory``, the model behind Inductor's
    ``reorder_for_peak_memory``, 2.11 and 2.13): buffers are allocated at their fused node and
    freed after their last reader; graph inputs Inductor can free (read by the graph) count from
    the start until their last reader.

    ``count_input(name)``: whether graph input ``name`` counts (parameters and the user's inputs
    do not: they are alive regardless). ``count_output``: whether the graph's outputs count (a
    forward's saved activations do; a backward's gradients are not activation memory). Returns
    (peak bytes, {counted input: bytes}); the peak is computed here from Inductor's buffer
    lifetimes (2.11's ``estimate_peak_memory`` mis-frees graph outputs)."""
    from torch._inductor import memory
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet

    graph_inputs = OrderedSet(V.graph.graph_inputs.keys())
    outputs = OrderedSet(V.graph.get_output_names())
    name_to_buf = {b.get_name(): b for n in nodes for b in n.get_outputs()}
    name_to_fused = {sn.get_name(): n for n in nodes for sn in n.get_nodes()}
    # prepare_planning_info stores its analysis on the nodes and buffers (mpi_node, mpi_buffer),
    # which the scheduler reads later (its topological sorts): put back what was there, so that
    # measuring the schedule does not change the code generated (it did: +12% peak on gpt-tiny).
    missing = object()
    saved = [(n, "mpi_node", getattr(n, "mpi_node", missing)) for n in nodes]
    saved += [(b, "mpi_buffer", getattr(b, "mpi_buffer", missing)) for b in name_to_buf.values()]
    try:
        _, freeable = memory.prepare_planning_info(nodes, name_to_buf, name_to_fused, graph_inputs, outputs)
        freeable = {k: v for k, v in freeable.items() if count_input(k)}
        infos, _, _ = memory.compute_memory_timeline(nodes, freeable, outputs)
    finally:
        for obj, attr, value in saved:
            if value is missing:
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)
            else:
                setattr(obj, attr, value)
    delta = [0] * (len(nodes) + 2)
    for b in infos:
        name = b.buffer.get_name()
        if b.end_step == -1 and name in outputs and name not in freeable and not count_output:
            continue
        delta[b.start_step] += b.size_alloc
        if b.end_step != -1:
            delta[b.end_step + 1] -= b.size_free
    live = peak = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak, {k: v.mpi_buffer.size_free for k, v in freeable.items()}


def inductor_atomic_add_falls_back(dtype: torch.dtype) -> bool:
    """Whether Inductor computes an accumulating scatter of ``dtype`` with aten's kernel instead
    of its own (``torch._inductor.utils.needs_fallback_due_to_atomic_add_limitations``: its
    atomics lack int64, bool, and bfloat16 below compute capability 9.0)."""
    from torch._inductor.utils import needs_fallback_due_to_atomic_add_limitations

    return needs_fallback_due_to_atomic_add_limitations(dtype)


def inductor_realize_thresholds(device_type: str) -> tuple[int, int]:
    """``(reads on reuse, accumulated reads)``: Inductor's lowering keeps a pointwise value
    inlined into its readers until it reads more buffers than the first while read by more than one
    node (``StorageBox.should_realize_on_reuse``: ``config.realize_reads_threshold``), or more
    than the second at all (``has_exceeded_max_reads``: ``config.realize_acc_reads_threshold``,
    unset by default: ``realize_cpu_acc_reads_threshold`` on CPU, else
    ``_realize_acc_reads_threshold_default``). Read now, so a user's setting counts (2.11 and
    2.13 alike: 4 and 12 on CPU, 4 and 8 elsewhere)."""
    from torch._inductor import config

    acc = getattr(config, "realize_acc_reads_threshold", None)
    if acc is None:
        acc = (getattr(config, "realize_cpu_acc_reads_threshold", 12) if device_type == "cpu"
               else getattr(config, "_realize_acc_reads_threshold_default", 8))
    return int(getattr(config, "realize_reads_threshold", 4)), int(acc)
