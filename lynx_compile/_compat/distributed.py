"""torch.distributed's private parts: c10d's bindings and stores, the functional collectives,
FSDP2's parameter groups, DTensor stand-ins (a piece compiled again after its inputs are gone),
and the action order of a pipelining schedule."""
from __future__ import annotations

import weakref
from typing import Any

import torch


def c10d_bindings() -> Any:
    """``torch._C._distributed_c10d``: the option structs (``AllgatherOptions`` is not
    re-exported by ``torch.distributed``) and ``ProcessGroupGloo``."""
    from torch._C import _distributed_c10d

    return _distributed_c10d


def work_from_future(fut: Any) -> Any:
    """A c10d ``Work`` that completes with ``fut`` (``_create_work_from_future``)."""
    return c10d_bindings()._create_work_from_future(fut)


def default_store() -> Any:
    """The default process group's store (``distributed_c10d._get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def fake_store() -> Any:
    """A store for ``init_process_group("fake", ...)``: importing ``fake_pg`` registers the
    "fake" backend (collectives trace but move no data)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _functional_collectives() -> Any:
    import torch.distributed._functional_collectives as fc

    return fc


def wait_collective(t: torch.Tensor) -> torch.Tensor:
    """Wait an eager functional collective's ``AsyncCollectiveTensor``; other tensors (under
    tracing they already end in ``wait_tensor``) pass through."""
    fc = _functional_collectives()
    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


def functional_all_reduce(x: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``_c10d_functional.all_reduce`` (+ ``wait_tensor``); not waited."""
    return _functional_collectives().all_reduce(x, op, group)


def functional_all_gather(x: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
    """All-gather concatenated along ``gather_dim`` (``_c10d_functional.all_gather_into_tensor``,
    then chunk + cat): ``all_gather_single`` on 2.13. Before it (2.11), ``all_gather_tensor``
    re-concatenates through ``torch._utils._maybe_view_chunk_cat``, which dynamo skips: inside an
    autograd.Function that is a graph break. So there lynx gathers along dim 0 and does the chunk
    + cat itself (the same ops, traceable)."""
    fc = _functional_collectives()
    single = getattr(fc, "all_gather_single", None)
    if single is not None:
        return single(x, gather_dim, group)
    out = fc.all_gather_tensor(x, 0, group)
    if gather_dim % x.dim() == 0:
        return out
    out = wait_collective(out)
    return torch.cat(torch.chunk(out, out.size(0) // x.size(0), dim=0), dim=gather_dim)


def functional_reduce_scatter(x: torch.Tensor, op: str, scatter_dim: int, group: Any) -> torch.Tensor:
    """Reduce-scatter along ``scatter_dim`` (``_c10d_functional.reduce_scatter_tensor``):
    ``reduce_scatter_single`` on 2.13, ``reduce_scatter_tensor`` before."""
    fc = _functional_collectives()
    fn = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor
    return fn(x, op, scatter_dim, group)


def fsdp2_groups_holding(tensors: list) -> list[tuple[int, bool, int]]:
    """Per FSDP2 (``fully_shard``) parameter group whose unsharded parameters are among
    ``tensors`` (by identity: dynamo hands a block's unsharded parameters to the backend during
    its forward): ``(shard world size, resharded after forward, unsharded bytes of the group)``.
    Empty without FSDP2. Reads ``torch.distributed._composable_state._module_state_mapping``
    and each state's param groups (``_fsdp_param_groups`` on 2.13, ``_fsdp_param_group`` on 2.11)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - present on 2.11-2.13
        return []
    ids = {id(t) for t in tensors if isinstance(t, torch.Tensor)}
    out = []
    for state in list(_module_state_mapping.values()):
        state = state() if isinstance(state, weakref.ref) else state  # weak references on 2.13
        if not isinstance(state, FSDPState):
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = state.__dict__.get("_fsdp_param_group")
            groups = [group] if group is not None else []
        for group in groups:
            params = [getattr(fp, "_unsharded_param", None) for fp in group.fsdp_params]
            if not any(p is not None and id(p) in ids for p in params):
                continue
            nbytes = sum(p.numel() * p.element_size() for p in params if p is not None)
            mesh = group.mesh_info
            out.append((int(getattr(mesh, "shard_mesh_size", 1)), group.post_forward_mesh_info is not None, nbytes))
    return out


def dtensor_layout(t: Any) -> tuple | None:
    """What a stand-in for the DTensor ``t`` needs (``dtensor_stand_in``): its local shard's shape
    and stride, mesh, placements, global shape and stride, and whether the local shard is an
    ``AsyncCollectiveTensor`` (a collective's output not yet waited on: sequence-parallel TP's
    block inputs); None when ``t`` is no DTensor. Private: ``DTensor._local_tensor``,
    ``torch.distributed._functional_collectives.AsyncCollectiveTensor``."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return None
    if not isinstance(t, DTensor):
        return None
    local = t._local_tensor
    return (tuple(local.shape), local.stride(), t.device_mesh, tuple(t.placements), tuple(t.shape), t.stride(),
            isinstance(local, AsyncCollectiveTensor))


def dtensor_stand_in(local: torch.Tensor, layout: tuple) -> Any:
    """A DTensor laid out as ``layout`` (``dtensor_layout``) over the plain tensor ``local``, its
    local shard wrapped as an ``AsyncCollectiveTensor`` where the original's was: AOTAutograd
    unwraps nested subclasses when it compiles, so a compile on a plain local shard makes code
    that is handed the unwaited wrapper itself at run time (its data pointer is null: a
    segfault in the first kernel, seen on torchtitan's TP at a budget). No communication."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    _, _, mesh, placements, shape, stride, async_local = layout
    if async_local:
        local = AsyncCollectiveTensor(local)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def pipeline_schedule_actions(schedule_class: type, ranks: int, stages_per_rank: int,
                              num_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, the compute actions of a ``torch.distributed.pipelining`` schedule class in the
    order it runs them: ``(type, stage, micro-batch)`` with torch's type letters (``"F"``
    forward, ``"I"`` input-gradient backward, ``"W"`` weight-gradient backward, ``"B"`` whole
    backward); its bubbles (``None``) and non-compute actions dropped.

    torch builds the order (``schedule.pipeline_order``: rank -> list of ``_Action`` or None) in
    the schedule's constructor from the stages' ``group_size`` / ``num_stages`` alone, for every
    rank, so mock stages stand in for a process group. This is the construction of torch's own
    ``pipelining._schedule_visualizer.get_schedule_ops`` (2.11 and 2.13), which lynx does not call
    because it refuses one stage per rank for the multi-stage classes. Checked on torch 2.11 and
    2.13 for ``ScheduleZBVZeroBubble`` and ``ScheduleInterleavedZeroBubble``."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, ranks, None
    stage.num_stages = ranks * stages_per_rank
    schedule = schedule_class([stage] * stages_per_rank, num_microbatches)
    return [[(a.computation_type.value, a.stage_index, a.microbatch_index)
             for a in schedule.pipeline_order[rank]
             if a is not None and a.computation_type.value in ("F", "I", "W", "B")]
            for rank in range(ranks)]
