"""Analytic (roofline) cost of one aten-level FX node from its meta vals.

    flops       torch.utils.flop_counter's formula for the op (mm, addmm, bmm, conv, sdpa,
                flash/efficient attention, ...; ``FLOP_FORMULA_ALIASES`` maps the CPU SDPA
                kernels onto them), called on the hinted shapes in node.meta;
                other ops: 1 FLOP per element of the larger of output / largest input
                (pointwise ops: per output element; reductions: per input element)
    bytes_moved input bytes read + output bytes written
    out_bytes   bytes of new storage the node allocates
    runtime_s   max(flops / (peak·eff_matmul), bytes / (bw·eff_memory)) + launch overhead

Free nodes (``source="zero"``, everything 0): placeholders, outputs, get_attr, getitem, nodes
whose value holds no tensor (SymInt arithmetic, sym_size), pure views/aliases (schema return
with non-writing alias_info, plus ``VIEW_OPS``), and collective waits. In-place ops
(``add_``, ``copy_``: writing alias_info) allocate nothing but do move bytes and take time.
Functional collectives are delegated to :func:`comm.comm_node_cost`.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from lynx_compile.costs.comm import LINKS, LinkProfile, comm_node_cost
from lynx_compile.costs.hardware import HardwareProfile
from lynx_compile.costs.types import NodeCost
from lynx_compile.graph.collectives import is_collective_node, is_wait_node
from lynx_compile.graph.values import (
    hint_int,
    hint_shape,
    input_tensors,
    iter_tensors,
    numel,
    tensor_nbytes,
    tensor_read_bytes,
)

log = logging.getLogger(__name__)
aten = torch.ops.aten

#: Ops whose schema declares a fresh tensor but that only reinterpret their input's storage.
VIEW_OPS: frozenset[Any] = frozenset({aten._unsafe_view.default})
#: Ops that allocate without touching the memory (no fill), so they move no bytes.
ALLOC_ONLY_OPS: frozenset[Any] = frozenset(
    {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default, aten.new_empty_strided.default}
)
#: Ops torch's flop registry lacks that compute exactly what a registered op computes (same
#: argument order): count them with that op's formula. The CPU SDPA kernels appear in every
#: CPU-traced attention graph; without this they would fall back to ~1 FLOP per element.
FLOP_FORMULA_ALIASES: dict[Any, Any] = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_fused_attention_overrideable: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_fused_attention_overrideable_backward: aten._scaled_dot_product_flash_attention_backward,
}
#: FX node kinds that never cost anything.
FREE_NODE_OPS: frozenset[str] = frozenset({"placeholder", "output", "get_attr"})


def _returns_alias(node: torch.fx.Node) -> list[tuple[bool, bool]]:
    """Per schema return: (aliases an input, writes it). Empty list when there is no schema."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    return [(r.alias_info is not None, r.alias_info is not None and r.alias_info.is_write) for r in schema.returns]


def _has_tensor(val: Any) -> bool:
    return next(iter_tensors(val), None) is not None


def is_free_node(node: torch.fx.Node) -> bool:
    """True when the node costs nothing: see the module docstring for the list."""
    if node.op in FREE_NODE_OPS or node.target is operator.getitem:
        return True
    if not _has_tensor(node.meta.get("val")) and "val" in node.meta:
        return True
    if node.target in VIEW_OPS or is_wait_node(node):
        return True
    aliases = _returns_alias(node)
    return bool(aliases) and all(a and not w for a, w in aliases)


def out_bytes_of(node: torch.fx.Node) -> int:
    """Bytes of new storage ``node`` allocates: sum over its tensor outputs that are not
    views/aliases of inputs (0 for placeholders, getitem, views, in-place ops, waits).

    For the size of the value a node *holds* (e.g. a saved getitem), use :func:`tensor_bytes_of`.
    """
    if node.op in FREE_NODE_OPS or node.target is operator.getitem or node.target in VIEW_OPS:
        return 0
    if is_wait_node(node):
        return 0
    val = node.meta.get("val")
    aliases = _returns_alias(node)
    if not aliases:
        return sum(map(tensor_nbytes, iter_tensors(val)))
    outs = list(val) if isinstance(val, (tuple, list)) and len(aliases) > 1 else [val]
    if len(outs) != len(aliases):  # unexpected arity: count everything unless all returns alias
        return 0 if all(a for a, _ in aliases) else sum(map(tensor_nbytes, iter_tensors(val)))
    return sum(tensor_nbytes(t) for (alias, _), out in zip(aliases, outs) if not alias for t in iter_tensors(out))


def tensor_bytes_of(node: torch.fx.Node) -> int:
    """Logical bytes of every tensor in ``node.meta["val"]`` (aliasing ignored): what it costs
    to keep this node's value alive if nothing else holds its storage."""
    return sum(map(tensor_nbytes, iter_tensors(node.meta.get("val"))))


def _to_shape_arg(x: Any) -> Any:
    """Meta val -> what flop formulas expect: tensors as hinted ``torch.Size``, SymInts as ints."""
    if isinstance(x, torch.fx.Node):
        x = x.meta.get("val")
    if isinstance(x, torch.Tensor):
        return hint_shape(x)
    if isinstance(x, torch.SymInt):
        return hint_int(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_shape_arg(v) for v in x)
    return x


def node_flops(node: torch.fx.Node) -> tuple[float, bool]:
    """FLOPs of ``node`` and whether they came from torch's flop registry (matmul-like op)."""
    packet = getattr(node.target, "overloadpacket", node.target)
    formula = flop_registry.get(FLOP_FORMULA_ALIASES.get(packet, packet))
    if formula is not None:
        args = tuple(_to_shape_arg(a) for a in node.args)
        kwargs = {k: _to_shape_arg(v) for k, v in node.kwargs.items()}
        try:
            return float(formula(*args, **kwargs, out_val=_to_shape_arg(node.meta.get("val")))), True
        except Exception as e:  # formula needs something meta cannot give (e.g. nested seq lens)
            log.debug("flop formula for %s failed (%s); using the per-element fallback", node.target, e)
    out_elems = sum(map(numel, iter_tensors(node.meta.get("val"))))
    in_elems = max(map(numel, input_tensors(node)), default=0)
    return float(max(out_elems, in_elems)), False


def _dtype_of(node: torch.fx.Node) -> torch.dtype:
    """Dtype that sets the compute rate: first floating output, else first floating input."""
    for t in (*iter_tensors(node.meta.get("val")), *input_tensors(node)):
        if t.dtype.is_floating_point:
            return t.dtype
    return torch.float32


def roofline_time(flops: float, nbytes: int, peak_flops: float, profile: HardwareProfile, *,
                  matmul_flops: float = 0.0) -> float:
    """max(compute time, memory time) + launch overhead, with the profile's efficiencies; a
    matmul (``matmul_flops``: the FLOPs of one of its matrices) at the fraction of the peak its
    size achieves (``HardwareProfile.matmul_fraction``), bytes at the rate their size reaches
    (``HardwareProfile.memory_seconds``)."""
    rate = peak_flops * profile.matmul_efficiency
    if matmul_flops:
        rate *= profile.matmul_fraction(matmul_flops)
    compute = flops / rate if flops else 0.0
    return max(compute, profile.memory_seconds(nbytes)) + profile.launch_overhead_s


_BATCHED_MATMULS = frozenset({torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default})


def matrix_flops(node: torch.fx.Node, flops: float) -> float:
    """The FLOPs of one matrix product of a matmul node doing ``flops`` in all: a batched
    matmul's divided by its batch (each matrix runs at its own size's rate)."""
    if node.target in _BATCHED_MATMULS:
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dim() == 3:
            return flops / max(1, hint_int(val.shape[0]))
    return flops


def node_work(node: torch.fx.Node) -> tuple[float, int, int, bool]:
    """(flops, bytes_moved, out_bytes, matmul_like) of a non-free, non-collective node."""
    flops, matmul_like = node_flops(node)
    written = sum(map(tensor_nbytes, iter_tensors(node.meta.get("val"))))
    if node.target in ALLOC_ONLY_OPS:
        moved = 0
    else:
        moved = sum(map(tensor_read_bytes, input_tensors(node))) + written
    return flops, moved, out_bytes_of(node), matmul_like


def analytic_node_cost(
    node: torch.fx.Node,
    profile: HardwareProfile,
    *,
    link: LinkProfile | None = None,
    world_size: int | None = None,
) -> NodeCost:
    """Roofline cost of ``node`` on ``profile`` (module docstring has the model).

    Collectives cost their communication time on ``link`` (default: the profile's
    ``default_link``) over ``world_size`` ranks (see :func:`comm.comm_node_cost`).
    """
    if is_free_node(node):
        return NodeCost.zero()
    if is_collective_node(node):
        return comm_node_cost(node, link or LINKS[profile.default_link], world_size)
    flops, moved, out_b, matmul_like = node_work(node)
    peak = profile.peak_flops_for(_dtype_of(node), matmul=matmul_like)
    return NodeCost(
        runtime_s=roofline_time(flops, moved, peak, profile,
                                matmul_flops=matrix_flops(node, flops) if matmul_like else 0.0),
        out_bytes=out_b,
        flops=flops,
        bytes_moved=moved,
        source="analytic",
    )
