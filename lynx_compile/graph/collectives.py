"""Which FX nodes are collectives, and of which kind: torch's functional collectives
(``_c10d_functional``: all_reduce, all_gather_into_tensor, ..., and the ``wait_tensor`` that
synchronizes them), named by the kinds ``costs.comm`` prices. Read by the cost model, the
memory model (a wait returns its collective's buffer) and the passes that place recompute in
communication windows.
"""
from __future__ import annotations

from typing import Any

import torch.fx

from lynx_compile import _compat
from lynx_compile.graph.values import per_op_cached

#: Canonical collective kinds ``collective_time`` understands.
COLLECTIVE_KINDS: frozenset[str] = frozenset(
    {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv"}
)
# Spellings (short names, ``_c10d_functional`` op names, c10d names) -> canonical kind.
_ALIASES: dict[str, str] = {
    "allreduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "allgather": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall": "all_to_all",
    "isend": "send",
    "irecv": "recv",
    "batch_p2p_ops": "send",  # a batch of sends/recvs to peers, modelled as one transfer
}
#: Namespaces whose ops are functional collectives (``wait_tensor`` lives here too).
COLLECTIVE_NAMESPACES: frozenset[str] = frozenset(
    {"_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}
)
#: Op names in those namespaces that only synchronize and cost 0 in this model.
WAIT_OPS: frozenset[str] = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


def canonical_collective(op: Any) -> str:
    """Map an op (short name, ``"ns::name"`` string, OpOverload/Packet) to a ``COLLECTIVE_KINDS`` name.

    Raises ValueError for anything that is not a known collective.
    """
    name = _qualified_name(op).split("::")[-1]
    for ns in COLLECTIVE_NAMESPACES:
        name = name.removeprefix(ns + ".")
    name = name.split(".")[0].rstrip("_")  # drop overload ("default") and in-place suffix
    kind = _ALIASES.get(name, name)
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective {op!r}; known: {sorted(COLLECTIVE_KINDS | set(_ALIASES))}")
    return kind


def is_collective_node(node: torch.fx.Node) -> bool:
    """True for a ``_c10d_functional`` op that ``collective_time`` models (not a wait)."""
    ns, name = _op_namespace_name(node)
    if ns not in COLLECTIVE_NAMESPACES or name in WAIT_OPS:
        return False
    try:
        canonical_collective(name)
    except ValueError:  # e.g. a new functional op: let the roofline model cost it
        return False
    return True


def is_wait_node(node: torch.fx.Node) -> bool:
    """True for ``_c10d_functional.wait_tensor`` (and the autograd wrapper), which cost 0."""
    ns, name = _op_namespace_name(node)
    return ns in COLLECTIVE_NAMESPACES and name in WAIT_OPS


def _qualified_name(op: Any) -> str:
    """"ns::name[.overload]" for an OpOverload / OpOverloadPacket, else ``str(op)``."""
    return _compat.qualified_op_name(op)


def _op_namespace_name(node: torch.fx.Node) -> tuple[str, str]:
    return _namespace_name(node.target) if node.op == "call_function" else ("", "")


@per_op_cached
def _namespace_name(t: Any) -> tuple[str, str]:
    if not _compat.is_op_overload(t):
        return "", ""
    ns, _, name = _qualified_name(t).partition("::")
    return ns, name.split(".")[0]
