"""Cost model: a runtime and output size for every node of an aot_autograd joint graph.

    node_costs(gm, "h100-sxm")                      # roofline on a datasheet profile
    node_costs(gm, "cpu", source="measured")        # time each node on real tensors
    -> {node name: NodeCost(runtime_s, out_bytes, flops, bytes_moved, source)}

Plain data out, no graph writes: ``passes/annotate_costs.py`` stores them in ``node.meta``.

Modules: ``types`` (NodeCost; its size helpers: ``lynx_compile.graph.values``), ``hardware``
(profiles, CPU calibration), ``analytic`` (roofline), ``measured`` (timing interpreter),
``comm`` (α–β collectives; which nodes are collectives: ``lynx_compile.graph.collectives``).
"""
from __future__ import annotations

from typing import Literal

import torch.fx

from lynx_compile.costs.analytic import analytic_node_cost, is_free_node, out_bytes_of, tensor_bytes_of
from lynx_compile.costs.comm import (
    LINKS,
    LinkProfile,
    calibrate_link,
    collective_time,
    comm_node_cost,
)

from lynx_compile.costs.hardware import (
    DATASHEET_PROFILES,
    DEFAULT_CPU_PROFILE_CACHE,
    PROFILES,
    HardwareProfile,
    calibrate_cpu_profile,
    get_profile,
    profile_name_for_device,
)
from lynx_compile.costs.measured import materialize_inputs, measure_node_costs, measured_node_cost
from lynx_compile.costs.types import NodeCost
from lynx_compile.graph.collectives import is_collective_node

#: ``source=`` values ``node_costs`` accepts.
ANNOTATE_SOURCES: tuple[str, ...] = ("analytic", "measured")


def node_costs(
    gm: torch.fx.GraphModule,
    profile: HardwareProfile | str,
    *,
    source: Literal["analytic", "measured"] = "analytic",
    inputs: list | None = None,
    link: LinkProfile | None = None,
    repeats: int = 5,
    world_size: int | None = None,
) -> dict[str, NodeCost]:
    """A NodeCost for every node of ``gm`` (node name -> NodeCost).

    ``profile``: a HardwareProfile or a name for :func:`get_profile`. ``source="measured"``
    runs the graph (``inputs`` or materialized ones, ``repeats`` timed runs) for compute
    nodes; collectives always get the analytic communication time on ``link`` (default: the
    profile's link) over ``world_size`` ranks, because timing an async collective launch says
    nothing about the transfer. Writes nothing on the graph.
    """
    if source not in ANNOTATE_SOURCES:
        raise ValueError(f"unknown cost source {source!r}; valid: {list(ANNOTATE_SOURCES)}")
    prof = get_profile(profile) if isinstance(profile, str) else profile
    measured = measure_node_costs(gm, inputs, repeats=repeats) if source == "measured" else {}
    costs: dict[str, NodeCost] = {}
    for node in gm.graph.nodes:
        if source == "measured" and not is_collective_node(node):
            cost = measured_node_cost(node, measured.get(node.name, 0.0))
        else:
            cost = analytic_node_cost(node, prof, link=link, world_size=world_size)
        costs[node.name] = cost
    return costs


__all__ = [
    "ANNOTATE_SOURCES",
    "DATASHEET_PROFILES",
    "DEFAULT_CPU_PROFILE_CACHE",
    "LINKS",
    "PROFILES",
    "HardwareProfile",
    "LinkProfile",
    "NodeCost",
    "analytic_node_cost",
    "node_costs",
    "calibrate_cpu_profile",
    "calibrate_link",
    "collective_time",
    "comm_node_cost",
    "get_profile",
    "is_free_node",
    "materialize_inputs",
    "measure_node_costs",
    "measured_node_cost",
    "out_bytes_of",
    "profile_name_for_device",
    "tensor_bytes_of",
]
