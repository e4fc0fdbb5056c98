"""Annotate every joint-graph node with its cost (runtime, output bytes).

Reads ``config.cost_source``, ``config.hardware``, ``config.link`` (prices collectives, calibrated
only for a graph with collectives or FSDP2 windows; see
``lynx_compile.distributed.link``), ``config.measure_repeats``, ``record.fsdp`` (FSDP2's
collectives around the backward: their seconds and the window they leave). Writes
``meta.COST`` (a ``lynx_compile.costs.NodeCost``) on every node, the totals into the record, and
``meta.KERNEL_PROFILE`` on the graph where Inductor compiles it with analytic costs.
"""
from __future__ import annotations

import torch.fx as fx

from . import meta
from .context import PassContext


def annotate_costs_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    from lynx_compile.costs import LINKS, get_profile, node_costs
    from lynx_compile.graph.collectives import is_collective_node
    from lynx_compile.distributed.agreement import rank0_value
    from lynx_compile.distributed.link import resolve_link

    cfg = ctx.config
    from lynx_compile import _compat

    with _compat.eager_dispatch():  # CPU calibration and measurement must see eager op speed
        # Measured inputs (the calibrated CPU profile, measured node costs) differ per rank;
        # every rank plans from rank 0's, so all ranks reach the same plan.
        profile = rank0_value(get_profile(cfg.hardware))
        fsdp = ctx.record.fsdp  # FSDP2's collectives around this graph's backward, if any
        if cfg.link == "auto" and fsdp is None and not any(is_collective_node(n) for n in gm.graph.nodes):
            # no collective to price (DDP's all-reduces run outside the graph): no calibration,
            # whose all-reduces of up to 4 MiB would run inside the user's first step and add
            # to its peak (measured: 0.65 -> 0.86 of torch.compile's step 1, DDP, 2 ranks)
            link = LINKS[profile.default_link]
        else:
            link = resolve_link(cfg.link, profile.default_link)
        costs = node_costs(gm, profile, source=cfg.cost_source, repeats=cfg.measure_repeats, link=link)
        if cfg.cost_source == "measured":
            costs = rank0_value(costs)
    for node in gm.graph.nodes:
        node.meta[meta.COST] = costs[node.name]
    # Inductor fuses what a recompute adds into kernels: priced by kernel where costs are analytic
    gm.meta.pop(meta.KERNEL_PROFILE, None)
    if cfg.compiler == "inductor" and cfg.cost_source == "analytic":
        gm.meta[meta.KERNEL_PROFILE] = profile
    fwd = ctx.forward_names
    ctx.record.stats["cost_source"] = cfg.cost_source
    ctx.record.stats["hardware"] = profile.name
    ctx.record.stats["link"] = link.name
    ctx.record.stats["forward_s"] = sum(c.runtime_s for n, c in costs.items() if n in fwd)
    ctx.record.stats["backward_s"] = sum(c.runtime_s for n, c in costs.items() if n not in fwd)
    if fsdp is not None:  # FSDP2's collectives overlap this backward (distributed/fsdp.py)
        from lynx_compile.distributed.fsdp import FsdpComm, free_seconds

        ctx.record.stats["fsdp_comm_s"] = FsdpComm(*fsdp).seconds(link)
        ctx.record.stats["fsdp_window_s"] = free_seconds(fsdp, link, ctx.record.stats["backward_s"])
    return gm
