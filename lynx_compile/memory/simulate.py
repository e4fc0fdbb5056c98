"""Predict a training step's activation memory from the partitioned fw/bw graphs.

The model is the one the generated code actually follows (eager execution of fx code with the
boxed calling convention): a node's output is allocated when it runs; a view or other aliasing
output shares its base's storage; a storage is freed right after the last node that reads any
alias of it, unless it is a graph output. Forward outputs that the backward reads (saved
tensors) stay live from the end of the forward until their last use in the backward.
Parameters and inputs (forward placeholders) are the baseline and not counted, and neither are
the gradients the backward returns (they become ``.grad``: gradient memory).

Offloaded tensors (``lynx.offload``, ``passes/offload.py``): the host copy allocates no device
bytes; the device tensor lives until ``lynx.offload_wait`` (the copy is done), the reloaded one
from ``lynx.reload``. On CPU "host" is a second CPU buffer, but the prediction is still the
device-side bytes, as if host memory were separate (the CPU allocator's measured peak includes
the host copies).

Not modelled: workspace an op allocates internally and frees before returning (matmul packing,
softmax temporaries). That is what keeps prediction and measurement apart by a few percent.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.costs.comm import is_wait_node


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        numel = 1
        for d in val.shape:
            numel *= _hint(d)
        return numel * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_nbytes(v) for v in val)
    return 0


def _hint(d) -> int:
    if isinstance(d, int):
        return d
    try:
        return int(d.node.hint) if d.node.hint is not None else int(d)
    except Exception:  # noqa: BLE001 - unbacked symbol: size it as 1
        return 1


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output shares (views, in-place ops), else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        parent = node.args[0]
        return parent if isinstance(parent, fx.Node) and aliased_input(parent) is not None else None
    if is_wait_node(node):  # wait_tensor hands back its input, the collective's output buffer
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    for arg in node.args:
        if isinstance(arg, fx.Node):
            return arg
    return None


@dataclass
class GraphMemory:
    """Live-bytes timeline of one graph."""

    peak_bytes: int = 0
    peak_node: str = ""
    end_bytes: int = 0
    timeline: list[tuple[str, int]] = field(default_factory=list)


def _value(node: fx.Node):
    """``meta["val"]``; for an op inserted without one whose users are all getitems (torch's
    ``run_and_save_rng_state`` in the forward), the tuple its getitems take."""
    if "val" in node.meta or not node.users or any(u.target is not operator.getitem for u in node.users):
        return node.meta.get("val")
    taken = {u.args[1]: u.meta.get("val") for u in node.users}
    return tuple(taken.get(i) for i in range(max(taken) + 1))


def _is_multi_output(node: fx.Node) -> bool:
    return isinstance(_value(node), (tuple, list)) and aliased_input(node) is None


def _tuple_prefix(node: fx.Node) -> str:
    """Key prefix of a tuple value: the op's name, or ``<prefix>[i]`` for a nested tuple taken
    by a getitem (``run_and_save_rng_state`` returns ``(state, (out, mask))``)."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and _is_multi_output(node.args[0]):
        return f"{_tuple_prefix(node.args[0])}[{node.args[1]}]"
    return node.name


def storage_keys(gm: fx.GraphModule, inputs: dict[str, str]) -> dict[fx.Node, str]:
    """Storage key per node: its own name when it allocates; its base's key when it aliases;
    ``"<op>[i]"`` for output i of a multi-output op, taken by ``getitem(op, i)``."""
    keys: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            keys[node] = inputs.get(node.name, node.name)
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and _is_multi_output(node.args[0]):
            keys[node] = _tuple_prefix(node)
            continue
        base = aliased_input(node)
        keys[node] = keys[base] if base is not None else node.name
    return keys


def _leaves(prefix: str, val) -> list[tuple[str, int]]:
    if isinstance(val, (tuple, list)):
        return [leaf for i, v in enumerate(val) for leaf in _leaves(f"{prefix}[{i}]", v)]
    size = _nbytes(val)
    return [(prefix, size)] if size else []


def allocations(node: fx.Node) -> list[tuple[str, int]]:
    """(storage key, bytes) of what ``node`` allocates when it runs: nothing for views,
    placeholders and getitems; one storage per tensor output of a multi-output op (nested
    tuples flattened)."""
    if node.op != "call_function" or aliased_input(node) is not None or node.target is operator.getitem:
        return []
    if node.target in _host_ops():
        return []          # host memory, not device memory
    val = _value(node)
    if isinstance(val, (tuple, list)):
        return _leaves(node.name, val)
    return [(node.name, _nbytes(val))]


def _host_ops() -> frozenset:
    from lynx_compile.runtime.offload import HOST_OPS

    return HOST_OPS


def fused_interior(node: fx.Node) -> bool:
    """A pointwise op whose users are all pointwise ops (and not the graph's output): Inductor
    computes it inside the fused kernel of its consumers, so it never materializes."""
    if node.op != "call_function" or torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        return False
    return bool(node.users) and all(
        u.op == "call_function" and torch.Tag.pointwise in getattr(u.target, "tags", ()) for u in node.users)


def simulate_graph(gm: fx.GraphModule, *, live_inputs: dict[str, int], input_keys: dict[str, str],
                   keep_outputs: bool = True, count_outputs: bool = True, fused: bool = False,
                   held_inputs: frozenset[str] = frozenset()) -> GraphMemory:
    """Walk ``gm`` and track live bytes.

    ``live_inputs``: storage key → bytes of inputs already counted as live (freed at their last
    use). ``input_keys``: placeholder name → storage key (several placeholders may share one).
    Placeholders not in ``input_keys``/``live_inputs`` are baseline (not counted).
    ``count_outputs=False``: storages the graph returns are not counted (the backward's
    gradients, which become ``.grad``: gradient memory, not activation memory).
    ``fused=True`` (the graph is compiled by Inductor): ``fused_interior`` nodes allocate
    nothing — a first-order model of Inductor's pointwise fusion, not of its scheduling.
    ``held_inputs``: storage keys of inputs the caller keeps alive until the graph returns."""
    keys = storage_keys(gm, input_keys)
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    output = nodes[-1]
    last_use: dict[str, int] = {}
    for node in nodes:
        for key, _ in allocations(node):  # an output nobody takes dies right away
            last_use[key] = pos[node]
        for user in node.users:
            if user is not output:
                last_use[keys[node]] = max(last_use.get(keys[node], -1), pos[user])
        last_use.setdefault(keys[node], pos[node])
    pinned = {keys[n] for n in output.all_input_nodes} if keep_outputs else set()

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
        for key, size in () if fused and fused_interior(node) else allocations(node):
            if key in uncounted:
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


def held_tangents(keys) -> frozenset[str]:
    """The backward inputs torch keeps alive for the whole backward call (pass them as
    ``simulate_graph(held_inputs=...)``): the output gradients (``tangents_*``, keys as given by
    :func:`backward_inputs` or plain placeholder names) on torch 2.11, none on 2.13
    (``_compat.backward_holds_grad_inputs``)."""
    if not _compat.backward_holds_grad_inputs():
        return frozenset()
    return frozenset(k for k in keys if k.removeprefix("bw:").startswith("tangents"))


def simulate_step(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, *, fused: bool = False) -> StepMemory:
    """Peak activation memory of forward then backward, and the bytes saved between them
    (``fused``: see ``simulate_graph``)."""
    fw_mem = simulate_graph(fw_gm, live_inputs={}, input_keys={}, fused=fused)
    input_keys, live_inputs = backward_inputs(fw_gm, bw_gm)
    saved = sum(v for k, v in live_inputs.items() if not k.startswith("bw:tangents"))
    bw_mem = simulate_graph(bw_gm, live_inputs=live_inputs, input_keys=input_keys, count_outputs=False,
                            fused=fused, held_inputs=held_tangents(live_inputs))
    peak = max(fw_mem.peak_bytes, bw_mem.peak_bytes)
    at = f"forward:{fw_mem.peak_node}" if fw_mem.peak_bytes >= bw_mem.peak_bytes else f"backward:{bw_mem.peak_node}"
    return StepMemory(saved_bytes=saved, forward_peak_bytes=fw_mem.peak_bytes,
                      backward_peak_bytes=bw_mem.peak_bytes, peak_bytes=peak, peak_at=at)
