"""Plan without training: trace a model once and return what lynx decides for it.

``plan_model`` traces the model with a fresh plan-only lynx backend: aot_autograd builds and
partitions the joint graph, lynx records its plan, and the backend stops before anything is
executed. Nothing runs, so paper-scale models can be planned on the meta device (no memory
allocated); costs are then analytic. ``fullgraph=True``: a plan of a model with graph breaks
would only cover its first subgraph, so a break is an error here.

``plan_model_variants`` plans several option sets from one trace: dynamo, aot_autograd and
Inductor's joint passes run once, then each option set partitions its own copy of the joint
graph. Tracing is most of a small model's planning time (a DTensor model's above all), so
comparing policies or budgets on one model is several times faster that way.
"""
from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.compiler.dynamo_backend import LynxBackend, _graph_ids, find_backend_error, runs_as_pieces
from lynx_compile.config import LynxConfig, make_config
from lynx_compile.errors import PlanningDone
from lynx_compile.recompute.partition import lynx_partition
from lynx_compile.passes import GraphRecord


def plan_model(model: torch.nn.Module, example_inputs: tuple, **options: Any) -> list[GraphRecord]:
    """Records (one per compiled graph, each with its ``plan``) for ``model`` under ``options``."""
    config = make_config(options)
    device = next(model.parameters()).device
    if device.type == "meta" and config.cost_source == "measured":
        raise ValueError("cost_source='measured' needs real tensors; plan on a real device or use "
                         "cost_source='analytic' with --hardware")
    backend = LynxBackend(config, plan_only=True)
    _trace(model, example_inputs, backend)
    return backend.records


def plan_model_variants(model: torch.nn.Module, example_inputs: tuple, variants: Sequence[dict[str, Any]],
                        **common: Any) -> list[list[GraphRecord]]:
    """``[plan_model(model, example_inputs, **common, **v) for v in variants]``, tracing once.

    Each variant partitions a copy of the joint graph its own ``plan_model`` would get (same
    joint passes, same graph hash), so its records are the same. The variants must agree on
    ``compiler`` (it decides which joint graph is made: Inductor's or aot_autograd's). With
    several ranks every rank must pass the same variants (each plan's agreement check is a
    collective)."""
    configs = [make_config({**common, **v}) for v in variants]
    compilers = sorted({c.compiler for c in configs})
    if len(compilers) > 1:
        raise ValueError(f"plan_model_variants: the variants name compilers {compilers}; one trace makes "
                         "one joint graph, so they must share a compiler")
    device = next(model.parameters()).device
    if device.type == "meta" and any(c.cost_source == "measured" for c in configs):
        raise ValueError("cost_source='measured' needs real tensors; plan on a real device or use "
                         "cost_source='analytic' with --hardware")
    backend = _VariantsBackend(configs)
    _trace(model, example_inputs, backend)
    return backend.records


def _trace(model: torch.nn.Module, example_inputs: tuple, backend: Any) -> None:
    """Compile ``model`` with a planning ``backend`` and run it up to ``PlanningDone``."""
    torch.compiler.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    try:
        with torch.enable_grad():
            compiled(*example_inputs)
    except Exception as e:  # noqa: BLE001 - dynamo wraps the backend's exception
        if find_backend_error(e, PlanningDone) is None:
            raise
    finally:
        torch.compiler.reset()


class _VariantsBackend:
    """A plan-only dynamo backend whose partitioner plans every config on the one joint graph
    (``LynxBackend(plan_only=True)`` for several configs at once)."""

    def __init__(self, configs: list[LynxConfig]):
        self.configs = configs
        self.records: list[list[GraphRecord]] = [[] for _ in configs]

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **_: Any):
        from lynx_compile.caches.source_digest import lynx_source_digest
        from lynx_compile.memory import grad_in_graph
        from lynx_compile.memory.resident import resident_bytes

        # where each config puts the parameter gradients, and what a device budget holds
        # besides the step, as its own LynxBackend decides
        records = [GraphRecord(graph_id=next(_graph_ids), policy=c.policy,
                               grads_in_graph=grad_in_graph.decide(c, example_inputs, switchable=runs_as_pieces(c)),
                               resident=(resident_bytes(example_inputs, plan_only=True)
                                         if c.device_budget is not None else None))
                   for c in self.configs]
        for mine, record in zip(self.records, records):
            mine.append(record)
        partition = _VariantsPartitioner(self.configs, records)
        on_meta = any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in example_inputs)
        if self.configs[0].compiler == "inductor" and not on_meta:  # as LynxBackend decides
            return _compat.inductor_compile_with_partitioner(gm, example_inputs, partition, keep_placement=False,
                                                             source_digest=lynx_source_digest())
        return _compat.aot_autograd(fw_compiler=_stop, bw_compiler=_stop, inference_compiler=_stop,
                                    partition_fn=partition)(gm, example_inputs)


def _stop(gm: fx.GraphModule, example_inputs: list):
    raise PlanningDone()


class _VariantsPartitioner(_compat.inductor_partitioner_base()):
    """Plans each config on its own copy of the joint (lynx's passes tag and extend the joint
    in place), then stops the compile."""

    def __init__(self, configs: list[LynxConfig], records: list[GraphRecord]):
        self.configs = configs
        self.records = records

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        for config, record in zip(self.configs, self.records):
            joint = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # node metas copied one level deep
            joint.meta = dict(gm.meta)
            lynx_partition(joint, joint_inputs, config=config, record=record, **kwargs)
        raise PlanningDone()

    def uuid(self) -> None:
        return None

