"""Plan without training: trace a model once and return what lynx decides for it.

``plan_model`` traces the model with a fresh plan-only lynx backend: aot_autograd builds and
partitions the joint graph, lynx records its plan, and the backend stops before anything is
executed. Nothing runs, so paper-scale models can be planned on the meta device (no memory
allocated); costs are then analytic. ``fullgraph=True``: a plan of a model with graph breaks
would only cover its first subgraph, so a break is an error here.
"""
from __future__ import annotations

from typing import Any

import torch

from lynx_compile.backend import LynxBackend, PlanningDone, find_backend_error
from lynx_compile.config import make_config
from lynx_compile.passes import GraphRecord


def plan_model(model: torch.nn.Module, example_inputs: tuple, **options: Any) -> list[GraphRecord]:
    """Records (one per compiled graph, each with its ``plan``) for ``model`` under ``options``."""
    config = make_config(options)
    device = next(model.parameters()).device
    if device.type == "meta" and config.cost_source == "measured":
        raise ValueError("cost_source='measured' needs real tensors; plan on a real device or use "
                         "cost_source='analytic' with --hardware")
    backend = LynxBackend(config, plan_only=True)
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
    return backend.records

