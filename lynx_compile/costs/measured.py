"""Measured node costs: run the graph on real tensors and time every node.

    inputs (given, or materialized from placeholder meta vals)
      -> _TimingInterpreter.run  × (warmup + repeats)
      -> {node name: median seconds}

Each ``call_function`` / ``call_method`` / ``call_module`` node is timed around its own
execution only (argument fetching is outside the timer); on CUDA the device is synchronized
before and after, so a node's time includes its kernels but not its neighbours'. Placeholders,
outputs, get_attr and getitem are not timed (0). Per-node timing adds a Python call and (on
CUDA) a sync per node, so tiny ops measure as dispatch overhead: that is what they cost in an
eager backward too.
"""
from __future__ import annotations

import operator
import statistics
import time
from typing import Any

import torch
import torch.fx

from lynx_compile.costs.analytic import node_work
from lynx_compile.costs.types import NodeCost
from lynx_compile.graph.collectives import is_wait_node
from lynx_compile.graph.values import hint_int

_UNTIMED_OPS = frozenset({"placeholder", "output", "get_attr"})


def materialize_inputs(gm: torch.fx.GraphModule, device: torch.device | str | None = None) -> list[Any]:
    """Real inputs for ``gm`` from its placeholders' ``meta["val"]``.

    Floating tensors: ``randn``; integer tensors: zeros (valid indices for embedding /
    cross-entropy targets); bool: False; complex: randn. Sizes and strides are hinted;
    SymInt placeholders become their hint. Tensors go to ``device`` (default: the val's own
    device when it is usable here, else CPU). Raises ValueError for a placeholder without val.
    """
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        if "val" not in node.meta:
            raise ValueError(f"placeholder {node.name} has no meta['val']; pass inputs=")
        out.append(_materialize(node.meta["val"], device))
    return out


def _materialize(val: Any, device: torch.device | str | None) -> Any:
    if isinstance(val, torch.Tensor):
        dev = torch.device(device) if device is not None else _usable_device(val.device)
        size = [hint_int(s) for s in val.shape]
        stride = [hint_int(s) for s in val.stride()]
        t = torch.empty_strided(size, stride, dtype=val.dtype, device=dev)
        if val.dtype.is_floating_point or val.dtype.is_complex:
            t.normal_()
        else:
            t.zero_()
        return t.requires_grad_(False)
    if isinstance(val, torch.SymInt):
        return hint_int(val)
    if isinstance(val, (list, tuple)):
        return type(val)(_materialize(v, device) for v in val)
    return val


def _usable_device(dev: torch.device) -> torch.device:
    if dev.type == "cuda" and torch.cuda.is_available():
        return dev
    return torch.device("cpu")


class _TimingInterpreter(torch.fx.Interpreter):
    """Interpreter that records the wall time of every working node into ``times``."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device):
        super().__init__(gm, garbage_collect_values=True)
        self.device = device
        self.cuda = device.type == "cuda"
        self.times: dict[str, list[float]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op in _UNTIMED_OPS or n.target is operator.getitem:
            return super().run_node(n)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if "device" in kwargs and kwargs["device"] is not None:
                # Graph traced for another device (e.g. fake CUDA tensors, measured on CPU).
                kwargs = {**kwargs, "device": self.device}
            if self.cuda:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            out = getattr(self, n.op)(n.target, args, kwargs)
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.times.setdefault(n.name, []).append(time.perf_counter() - t0)
        return out


def _pick_device(inputs: list[Any], device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def measure_node_costs(
    gm: torch.fx.GraphModule,
    inputs: list | None = None,
    *,
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """Run ``gm`` ``warmup + repeats`` times and return node name -> median seconds.

    ``inputs``: flat list, one value per placeholder, in graph order (joint graphs take
    primals then tangents, flat). ``None``: :func:`materialize_inputs` on ``device``.
    Every node of the graph appears in the result; untimed nodes map to 0.0. Random ops run
    with whatever RNG state the process has (the graph's numbers are not checked).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if inputs is None:
        inputs = materialize_inputs(gm, device)
    dev = _pick_device(list(inputs), device)
    interp = _TimingInterpreter(gm, dev)
    with torch.no_grad():
        for _ in range(warmup):
            interp.run(*inputs, enable_io_processing=False)
        interp.times.clear()
        for _ in range(repeats):
            interp.run(*inputs, enable_io_processing=False)
    return {n.name: statistics.median(interp.times[n.name]) if n.name in interp.times else 0.0 for n in gm.graph.nodes}


def measured_node_cost(node: torch.fx.Node, runtime_s: float) -> NodeCost:
    """NodeCost with a measured runtime; FLOPs and bytes come from the analytic model.

    Placeholders, outputs, getitem and waits stay ``source="zero"``: no op runs for them. Views
    keep their measured time: they allocate nothing, but each one is a dispatched op that costs
    a few microseconds in an eager fw/bw, and a transformer graph has hundreds of them
    (counting them zero made the per-node sum of gpt-small fall 18% short of the step time).
    """
    if node.op in ("placeholder", "output", "get_attr") or node.target is operator.getitem \
            or is_wait_node(node):
        return NodeCost.zero()
    flops, moved, out_b, _ = node_work(node)
    return NodeCost(runtime_s=float(runtime_s), out_bytes=out_b, flops=flops, bytes_moved=moved, source="measured")
