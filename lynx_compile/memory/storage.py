"""Storage identity and sizes of the values of an FX graph: which node allocates how many
bytes, and which node's output shares another's storage (views, in-place ops, waits). The
vocabulary of ``simulate`` (the live-bytes walk) and ``inductor_model`` (Inductor's kernels)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from lynx_compile.graph.collectives import is_wait_node
from lynx_compile.graph.values import per_op_cached


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        numel = 1
        for d in val.shape:
            numel *= _hint(d)
        return numel * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_nbytes(v) for v in val)
    return 0


def storage_nbytes(val) -> int:
    """Bytes of the storage behind a tensor value (a view's whole storage; numel x element size
    on the meta device, which has none); 0 for anything else. What lynx reads of a value Inductor
    allocates: the partitioner's tangents, ``split_late_addmm_pass``'s matmul output."""
    if not isinstance(val, torch.Tensor):
        return 0
    return val.untyped_storage().nbytes() if val.device.type != "meta" else val.numel() * val.element_size()


def _hint(d) -> int:
    if isinstance(d, int):
        return d
    # an unbacked size (expert-parallel token counts) as the cost model sizes it
    # (``graph.values.UNBACKED_SIZE_HINT``), so a tensor's bytes and its time agree
    from lynx_compile.graph.values import hint_int

    return hint_int(d)


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output shares (views, in-place ops), else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        parent = node.args[0]
        return parent if isinstance(parent, fx.Node) and aliased_input(parent) is not None else None
    if is_wait_node(node):  # wait_tensor hands back its input, the collective's output buffer
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    if not _returns_alias(node.target):
        return None
    for arg in node.args:
        if isinstance(arg, fx.Node):
            return arg
    return None


@per_op_cached
def _returns_alias(target) -> bool:
    """Whether the op's first output aliases an input (its schema says so)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


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


GRAD_BYTES = "lynx_grad_bytes"
"""node.meta key: bytes of a ``.grad`` the node creates and keeps past the graph's end (the
parameter gradients ``lynx::accumulate_grads`` copies into ``.grad``s that were None;
``lynx_compile.memory.grad_in_graph``). Its storage key ends with :data:`KEPT`."""

KEPT = ":kept"

KEEPS_GRAD = "lynx_keeps_grad"
"""node.meta key: the positions in its gradients (``args[1]``) of those the node
(``lynx::accumulate_grads``) keeps as a ``.grad`` that was None: their storage outlives the
graph."""


def allocations(node: fx.Node) -> list[tuple[str, int]]:
    """(storage key, bytes) of what ``node`` allocates when it runs: nothing for views,
    placeholders and getitems; one storage per tensor output of a multi-output op (nested
    tuples flattened); a ``.grad`` it keeps (:data:`GRAD_BYTES`, key ending in :data:`KEPT`)."""
    if node.op != "call_function" or aliased_input(node) is not None or node.target is operator.getitem:
        return []
    if node.meta.get(GRAD_BYTES):
        return [(node.name + KEPT, node.meta[GRAD_BYTES])]
    if node.target in HOST_OUTPUT_OPS:
        return []          # host memory, not device memory
    val = _value(node)
    if isinstance(val, (tuple, list)):
        return _leaves(node.name, val)
    return [(node.name, _nbytes(val))]


HOST_OUTPUT_OPS: set = set()
"""Ops whose output lives in host memory, not on the device: they allocate no device bytes.
The module that defines such an op registers it (:func:`register_host_output_op`;
``runtime/offload_ops.py``'s ``lynx.offload``), so memory never imports what runs the graphs."""


def register_host_output_op(op) -> None:
    """Count ``op``'s output as host memory (no device bytes) from now on."""
    HOST_OUTPUT_OPS.add(op)


def _bytes(node: fx.Node) -> int:
    return _nbytes(node.meta.get("val"))
