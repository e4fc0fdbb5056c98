"""Predict a training step's activation memory from the partitioned fw/bw graphs.

The model is the one the generated code actually follows (eager execution of fx code with the
boxed calling convention): a node's output is allocated when it runs; a view or other aliasing
output shares its base's storage; a storage is freed right after the last node that reads any
alias of it, unless it is a graph output. Forward outputs that the backward reads (saved
tensors) stay live from the end of the forward until their last use in the backward.
Parameters and inputs (forward placeholders) are the baseline and not counted. The gradients
the backward returns are counted from where they are computed to the end of the backward: a
compiled backward returns them together, and only then does autograd add them into ``.grad``
(the gradient storage, allocated before the step in steady state: ``lynx_compile.budget``).
Where lynx adds them into ``.grad`` inside the backward (``lynx_compile.memory.grad_in_graph``), each
dies at its ``lynx::accumulate_grads``; a ``.grad`` that op creates (None when the graph
compiled) is counted to the end: the gradient's own storage where the op keeps it
(``storage.KEEPS_GRAD``), else the copy's bytes from the op on (``storage.GRAD_BYTES``).

Offloaded tensors (``lynx.offload``, ``passes/offload.py``): the host copy allocates no device
bytes; the device tensor lives until ``lynx.offload_wait`` (the copy is done), the reloaded one
from ``lynx.reload``. On CPU "host" is a second CPU buffer, but the prediction is still the
device-side bytes, as if host memory were separate (the CPU allocator's measured peak includes
the host copies).

Not modelled: workspace an op allocates internally and frees before returning (matmul packing,
softmax temporaries). That is what keeps prediction and measurement apart by a few percent.

Under Inductor (``fused=True``) the walk follows ``inductor_model``: Inductor's fused kernels,
its run order and its in-place buffers. Measured on CPU (``tests/test_compiled_peak.py``,
docs/memory_budget.md "Measured peaks against the budget under Inductor") the prediction is
within bytes of the allocator's peak for gpt-small, a GQA LM and HF Llama; on an H200 within
0.8% for policies none, full and a budget of 0.8 (``benchmarks/results/step_h200.md``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.memory.inductor_model import fused_order, inplace_outputs, interior_nodes, kernel_positions
from lynx_compile.memory.storage import KEEPS_GRAD, KEPT, _bytes, _nbytes, allocations, storage_keys


@dataclass
class GraphMemory:
    """Live-bytes timeline of one graph."""

    peak_bytes: int = 0
    peak_node: str = ""
    end_bytes: int = 0
    timeline: list[tuple[str, int]] = field(default_factory=list)


def simulate_graph(gm: fx.GraphModule, *, live_inputs: dict[str, int], input_keys: dict[str, str],
                   keep_outputs: bool = True, count_outputs: bool = True, fused: bool = False,
                   held_inputs: frozenset[str] = frozenset(), donated: frozenset[str] = frozenset()) -> GraphMemory:
    """Walk ``gm`` and track live bytes.

    ``live_inputs``: storage key → bytes of inputs already counted as live (freed at their last
    use). ``input_keys``: placeholder name → storage key (several placeholders may share one).
    Placeholders not in ``input_keys``/``live_inputs`` are baseline (not counted).
    ``count_outputs=False``: storages the graph returns are not counted (the backward's
    gradients, which become ``.grad``: gradient memory, not activation memory).
    ``fused=True`` (the graph is compiled by Inductor): the module docstring's Inductor model
    (``fused_interior`` nodes allocate nothing and read at :func:`kernel_positions`; kernels
    write in place, :func:`inplace_outputs`). ``fused=False`` is the exact op-by-op model.
    ``held_inputs``: storage keys of inputs the caller keeps alive until the graph returns.
    ``donated``: storage keys of ``live_inputs`` Inductor may write a kernel's output into once
    they die (:func:`donated_inputs`)."""
    keys = storage_keys(gm, input_keys)
    nodes = list(gm.graph.nodes)
    interior = interior_nodes(nodes) if fused else set()
    groups: dict[fx.Node, int] = {}
    if fused:
        sizes = {k: b for n in nodes for k, b in allocations(n)}
        sizes.update({keys[n]: _bytes(n) for n in nodes if n.op == "placeholder"})
        nodes, groups = fused_order(nodes, keys, interior, sizes)
    pos = kernel_positions(nodes, interior) if fused else {n: i for i, n in enumerate(nodes)}
    if groups:  # a fused group's kernel allocates all its outputs, then frees what dies in it
        index = {n: i for i, n in enumerate(nodes)}
        end: dict[int, int] = {}
        for n, g in groups.items():
            end[g] = max(end.get(g, -1), index[n])
        last = {index[n]: end[g] for n, g in groups.items()}
        pos = {n: last.get(p, p) for n, p in pos.items()}
    output = nodes[-1]
    last_use = _last_uses(nodes, keys, pos)
    pinned = {keys[n] for n in output.all_input_nodes} if keep_outputs else set()
    reused: dict[str, str] = {}
    if fused:  # one storage for a kernel's output and the input it overwrites, to the later end
        reused = inplace_outputs(nodes, keys, last_use, pinned, interior, groups,
                                 {k: live_inputs[k] for k in donated if k in live_inputs and k not in held_inputs},
                                 pos)
        keys = {n: reused.get(k, k) for n, k in keys.items()}
        last_use = _last_uses(nodes, keys, pos)
        pinned = {keys[n] for n in output.all_input_nodes} if keep_outputs else set()

    # a gradient kept as .grad (storage.KEEPS_GRAD) outlives the graph, as a returned one does
    pinned |= {keys[n.args[1][j]] for n in nodes for j in n.meta.get(KEEPS_GRAD) or ()}
    live = dict(live_inputs)
    mem = GraphMemory()
    total = sum(live.values())
    mem.peak_bytes, mem.peak_node = total, "<start>"
    frees: dict[int, list[str]] = {}
    for key, i in last_use.items():
        if key not in pinned and key not in held_inputs:
            frees.setdefault(i, []).append(key)
    uncounted = set() if count_outputs else pinned
    for i, node in enumerate(nodes):
        for key, size in () if node in interior else allocations(node):
            if key in reused or reused.get(key, key) in uncounted:  # nothing new, or a gradient
                continue
            live[key] = size
            total += size
        if total > mem.peak_bytes:
            mem.peak_bytes, mem.peak_node = total, node.name
        mem.timeline.append((node.name, total))
        for k in frees.get(i, ()):
            total -= live.pop(k, 0)
    mem.end_bytes = total
    return mem


def _last_uses(nodes: list[fx.Node], keys: dict[fx.Node, str], pos: dict[fx.Node, int]) -> dict[str, int]:
    """Storage key → position of its last reader (the graph's output excluded)."""
    output = nodes[-1]
    last_use: dict[str, int] = {}
    for node in nodes:
        for key, _ in allocations(node):  # an output nobody takes dies right away
            if key.endswith(KEPT):  # a .grad: kept past the graph's end
                continue
            k = keys[node] if key == node.name else key  # written in place: the reused storage
            last_use[k] = max(last_use.get(k, -1), pos[node])
        for user in node.users:  # a read by an interior node counts where its kernel runs
            if user is not output:
                last_use[keys[node]] = max(last_use.get(keys[node], -1), pos[user])
        last_use.setdefault(keys[node], pos[node])
    return last_use


@dataclass(frozen=True)
class StepMemory:
    """Predicted activation memory of one fw+bw step (bytes)."""

    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    peak_bytes: int
    peak_at: str


def backward_inputs(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule) -> tuple[dict[str, str], dict[str, int]]:
    """Map the backward's placeholders onto forward storages.

    Returns (placeholder name → storage key, storage key → bytes live when the backward
    starts). Saved tensors keep their forward storage identity, so two saved views of one
    tensor count once; parameters and inputs (and views of them) count zero; placeholders that
    are no forward value (tangents, replayed RNG states) count their own size."""
    fw_keys = storage_keys(fw_gm, {})
    fw_by_name = {n.name: n for n in fw_gm.graph.nodes}
    fw_alloc = {k: b for n in fw_gm.graph.nodes for k, b in allocations(n)}
    input_keys: dict[str, str] = {}
    live: dict[str, int] = {}
    for ph in bw_gm.graph.find_nodes(op="placeholder"):
        src = fw_by_name.get(ph.name)
        key = fw_keys[src] if src is not None else f"bw:{ph.name}"
        input_keys[ph.name] = key
        if key not in live:
            live[key] = fw_alloc.get(key, 0) if src is not None else _nbytes(ph.meta.get("val"))
    return input_keys, live


def saved_input_bytes(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, names: frozenset[str]) -> int:
    """Bytes of the forward's inputs named ``names`` (placeholders) that the backward takes,
    once per storage. :func:`backward_inputs` counts every input zero (in a whole graph an input
    is alive anyway: a parameter, the batch); in a piece of a model an activation input (the
    block's input, the logits a loss graph takes) stays alive after the forward only because
    the backward saved it."""
    keys = storage_keys(fw_gm, {})
    wanted = {keys[n]: _nbytes(n.meta.get("val")) for n in fw_gm.graph.find_nodes(op="placeholder") if n.name in names}
    input_keys, _ = backward_inputs(fw_gm, bw_gm)
    return sum(wanted[k] for k in set(input_keys.values()) if k in wanted)


def held_tangents(keys) -> frozenset[str]:
    """The backward inputs torch keeps alive for the whole backward call (pass them as
    ``simulate_graph(held_inputs=...)``): the output gradients (``tangents_*``, keys as given by
    :func:`backward_inputs` or plain placeholder names) on torch 2.11, none on 2.13
    (``_compat.backward_holds_grad_inputs``)."""
    if not _compat.backward_holds_grad_inputs():
        return frozenset()
    return frozenset(k for k in keys if k.removeprefix("bw:").startswith("tangents"))


def donated_inputs(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, input_keys: dict[str, str]) -> frozenset[str]:
    """Storage keys of the backward's inputs AOTAutograd donates to Inductor (the saved tensors
    that share no storage with a forward input or a forward output the user gets), when it
    donates them at all (``_compat.backward_donates_saved``)."""
    if not _compat.backward_donates_saved():
        return frozenset()
    fw_keys = storage_keys(fw_gm, {})
    fw_names = {n.name for n in fw_gm.graph.nodes}
    # the forward returns the user's outputs (mutated inputs first), then what the backward takes
    # of its values: not the tangents, nor the RNG states a recomputed random op replays
    # (``bwd_rng_state_<i>`` on CUDA: counted as saved, they made the user's logits donatable,
    # and a 4-layer GPT-1.3B on an H200 ran 136 MiB above its plan's predicted peak)
    saved = [ph for ph in bw_gm.graph.find_nodes(op="placeholder") if ph.name in fw_names]
    outputs = next(n for n in reversed(fw_gm.graph.nodes) if n.op == "output").args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    user = {fw_keys[o] for o in outputs[:max(0, len(outputs) - len(saved))] if isinstance(o, fx.Node)}
    inputs = {fw_keys[n] for n in fw_gm.graph.find_nodes(op="placeholder")}
    return frozenset(k for name, k in input_keys.items()
                     if not k.startswith("bw:") and k not in user and k not in inputs)


def simulate_step(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, *, fused: bool = False) -> StepMemory:
    """Peak activation memory of forward then backward, and the bytes saved between them
    (``fused``: see ``simulate_graph``)."""
    fw_mem = simulate_graph(fw_gm, live_inputs={}, input_keys={}, fused=fused)
    input_keys, live_inputs = backward_inputs(fw_gm, bw_gm)
    saved = sum(v for k, v in live_inputs.items() if not k.startswith("bw:tangents"))
    bw_mem = simulate_graph(bw_gm, live_inputs=live_inputs, input_keys=input_keys, count_outputs=True,
                            fused=fused, held_inputs=held_tangents(live_inputs),
                            donated=donated_inputs(fw_gm, bw_gm, input_keys) if fused else frozenset())
    peak = max(fw_mem.peak_bytes, bw_mem.peak_bytes)
    at = f"forward:{fw_mem.peak_node}" if fw_mem.peak_bytes >= bw_mem.peak_bytes else f"backward:{bw_mem.peak_node}"
    return StepMemory(saved_bytes=saved, forward_peak_bytes=fw_mem.peak_bytes,
                      backward_peak_bytes=bw_mem.peak_bytes, peak_bytes=peak, peak_at=at)
