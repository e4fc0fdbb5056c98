"""torch's AOTAutograd cache for lynx's graphs (issue P item 2), and the record kept beside it.

::

    dynamo graph + inputs' layout + lynx's options, profile, source ─sha256─▶ key
        key = LynxPartitioner.uuid(): part of AOTAutograd's (and Inductor's FX-graph) cache key
    miss: the partitioner runs, plans, and stores the graph's record (GraphRecord.to_dict)
          under key in lynx's plan cache directory; AOTAutograd stores the compiled graphs
    hit:  AOTAutograd returns the compiled graphs without partitioning; the backend restores
          the record (the plan, the piece's candidates, Inductor's compiled peak) from the entry

A hit skips everything a warm ``backend="inductor"`` run skips (the joint trace, the joint
passes, the partition, the compile of each graph), so lynx's warm first step costs what
Inductor's does. The key holds all that decides the partition besides what AOTAutograd keys
itself (the graph as dynamo traced it, its inputs, torch's and Inductor's settings and
versions): every ``LynxConfig`` option but ``plan_cache.NOT_IN_KEY`` (the budget, the resident
bytes of ``device_budget`` included), the graph's role in a step planned across pieces
(``takes_activations``, ``step_choice``), the hardware profile's numbers, lynx's source digest,
and each node's module path (lynx's blocks come from ``nn_module_stack``, which AOTAutograd's
key leaves out).

The cache stays off (:func:`cache_key` returns None) for graphs that are not partitioned
(inference), and where a hit could not stand for a plan:
a plan file (``plan``), measured costs (they differ between processes), offload (it reads the
host link), ``plan_cache=False``, and a planning group of several ranks: planning there
all-gathers (the plan cache's hit check, the plan agreement check, the step's outside memory),
and a rank served by its cache would leave the others waiting. A hit whose record is missing or
unreadable (``lynx cache clear`` removes records, not torch's entries) is compiled again with
the cache off, with a warning. No torch.fx graph is changed here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging

import torch
import torch.fx as fx

from lynx_compile.caches import plans as plan_cache
from lynx_compile.config import LynxConfig
from lynx_compile.passes import GraphRecord

log = logging.getLogger("lynx_compile")


def cache_key(gm: fx.GraphModule, example_inputs: list, config: LynxConfig, record: GraphRecord) -> str | None:
    """The partitioner's uuid for ``gm`` (see the module docstring), or None where AOTAutograd's
    cache stays off for it. Read inside the compile's planning group."""
    trains = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
    if not trains or not keeps_plans(config):
        return None
    return plan_cache.plan_key({**graph_fields(gm, example_inputs, config, "autograd_cache"),
                                "takes_activations": record.takes_activations,
                                "step_choice": None if record.step_choice is None else str(record.step_choice),
                                "provisional": record.provisional, "new_grad_bytes": record.new_grad_bytes,
                                "fsdp": list(record.fsdp) if record.fsdp is not None else None,
                                "resident": list(record.resident) if record.resident is not None else None,
                                "grads_in_graph": list(record.grads_in_graph or ()),
                                "unbacked_sizes": sorted((record.unbacked_sizes or {}).items())})


def keeps_plans(config: LynxConfig) -> bool:
    """Whether a graph's plan may be kept for a later process to compile alike: not with a plan
    file, measured costs (they differ between processes), offload (it reads the host link),
    ``plan_cache=False``, or several planning ranks (see the module docstring)."""
    from lynx_compile.distributed.agreement import planning_world_size

    return (config.plan_cache and config.plan is None and config.cost_source == "analytic" and not config.offload
            and planning_world_size() == 1)


def graph_fields(gm: fx.GraphModule, example_inputs: list, config: LynxConfig, kind: str) -> dict:
    """The key fields of what a kept plan of ``gm`` depends on besides its role: the graph and
    its inputs, lynx's options, the hardware profile's numbers, lynx's source."""
    from lynx_compile.costs import get_profile

    return {"schema": plan_cache.SCHEMA, "kind": kind, "graph": graph_digest(gm, example_inputs),
            "options": plan_cache.planning_options(config), "profile": get_profile(config.hardware).to_dict(),
            "lynx": plan_cache.lynx_source_digest()}


def graph_digest(gm: fx.GraphModule, example_inputs: list) -> str:
    """sha256 of a dynamo graph's code, its inputs' layouts and every node's module path."""
    h = hashlib.sha256(gm.code.encode())
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            h.update(repr((tuple(t.shape), t.stride(), t.dtype, t.device.type, t.requires_grad,
                           isinstance(t, torch.nn.Parameter))).encode())
        else:
            h.update(repr((type(t).__name__, t)).encode())
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        h.update(repr((node.name, [v[0] if isinstance(v, tuple) else v for v in stack.values()],
                       node.meta.get("custom"))).encode())
    return h.hexdigest()


def keep(record: GraphRecord, key: str) -> None:
    """Store ``record`` under ``key`` for a later process served by AOTAutograd's cache (after
    the partition, and again once Inductor's compiled peak is on its plan)."""
    record.stats["autograd_cache_key"] = key
    plan_cache.store_record(key, record.to_dict())


def restore(record: GraphRecord, key: str) -> bool:
    """Fill ``record`` from the entry ``keep`` stored under ``key``; False (with a warning)
    when there is none or it does not parse."""
    data = plan_cache.load_record(key)
    try:
        kept = None if data is None else GraphRecord.from_dict(
            data, graph_id=record.graph_id, takes_activations=record.takes_activations,
            step_choice=record.step_choice, grads_in_graph=record.grads_in_graph, provisional=record.provisional,
            new_grad_bytes=record.new_grad_bytes)
    except (TypeError, KeyError, ValueError) as e:
        log.warning("lynx plan cache: ignoring the record of graph %d (%s: %s)", record.graph_id,
                    type(e).__name__, e)
        kept = None
    if kept is None:
        log.warning("lynx plan cache: torch's AOTAutograd cache served graph %d, but lynx's record of its "
                    "plan is missing; compiling it again with that cache off", record.graph_id)
        return False
    for f in dataclasses.fields(GraphRecord):
        setattr(record, f.name, getattr(kept, f.name))
    record.stats["plan_cache"] = "hit"
    record.stats["served_by"] = "autograd_cache"
    log.info("lynx plan cache: hit for graph %d (torch's AOTAutograd cache served its compile; the plan "
             "restored from %s)", record.graph_id, plan_cache.entry_path(key))
    return True
