"""Apply a :class:`StagePlan`: split the model, compile each local stage with lynx, wrap it for
torch's schedules.

Splitting is torch's own (``torch.distributed.pipelining.pipeline``: export, then
``split_module`` at a ``SplitPoint.BEGINNING`` before every cut block). Each local stage is
compiled by its own lynx backend with ``memory_budget`` = the stage's allowance per micro-batch
(``StageInfo.budget_bytes``: its in-flight count differs from the other stages') and wrapped in
:class:`LynxPipelineStage`, a ``PipelineStage`` that can recompute while the gradient is in flight:

    schedule asks for the activation send ops of j -> the stage posts the isend itself, returns []
    schedule asks for the gradient recv ops of j   -> the stage posts the irecv itself, returns []
    schedule calls backward_one_chunk(j)           -> run j's recompute prefix (gradient-free)
                                                      wait for the irecv, then the backward

Posting the transfers inside ``get_*_ops`` works with every torch schedule (GPipe, 1F1B,
Interleaved1F1B) unchanged, without a schedule of our own: they only wait on what they are
handed, so the stage reaches ``backward_one_chunk`` while its gradient is still in flight (1F1B
otherwise waits for the fused activation send *and* gradient receive before the backward).
Sends are waited before the next send and after the last backward. Tested on gloo only: on
NCCL, posting sends and receives in separate calls may need the schedule's batching.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lynx_compile.runtime.prefetch import microbatch


class LynxPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose compiled module recomputes during the gradient wait."""

    def __init__(self, *args: Any, lynx_backend=None, recompute_in_wait: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lynx_backend = lynx_backend
        self.recompute_in_wait = bool(recompute_in_wait and lynx_backend is not None)
        self._pending: dict[int, list] = {}
        self._sends: list = []
        self.early_recomputes = 0
        self.early_s = 0.0
        """Seconds spent recomputing early (while the gradient was in flight)."""
        self.grad_wait_s = 0.0
        """Seconds then spent still waiting for gradients (0: the recompute covered the wait)."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
        with microbatch(fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if not self.recompute_in_wait or not ops:
            return ops
        self._wait_sends()
        self._sends = dist.batch_isend_irecv(ops)
        return []

    def _wait_sends(self) -> None:
        for work in self._sends:
            work.wait()
        self._sends = []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        if not self.recompute_in_wait or not ops:
            return ops
        self._pending[bwd_chunk_id] = dist.batch_isend_irecv(ops)  # in flight from now on
        return []

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any):
        t0 = time.perf_counter()
        if self.recompute_in_wait:
            self.early_recomputes += self.lynx_backend.run_early(bwd_chunk_id)
        t1 = time.perf_counter()
        for work in self._pending.pop(bwd_chunk_id, ()):
            work.wait()
        self.early_s += t1 - t0
        self.grad_wait_s += time.perf_counter() - t1
        with microbatch(bwd_chunk_id):
            out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        if kwargs.get("last_backward"):
            self._wait_sends()
        return out


def split_model(module: nn.Module, example_microbatch: tuple, cuts: list[str]):
    """torch's ``Pipe`` of ``module`` cut before each block path in ``cuts``."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = {name: SplitPoint.BEGINNING for name in cuts}
    return pipeline(module, mb_args=tuple(example_microbatch), split_spec=spec or None)


def sync_tied_grads(stage_modules: dict[int, nn.Module], tied: dict[str, tuple[tuple[int, str], ...]],
                    shapes: dict[str, tuple[torch.Size, torch.dtype]], group=None) -> None:
    """Sum the gradients of every copy of a parameter that several stages hold (a tied
    embedding / LM head) over the pipeline group, and give every copy the sum: each copy then
    steps with the gradient the unsplit model would have. Ranks holding no copy contribute zeros
    (one all-reduce per tied parameter, on every rank of the group, in the same order)."""
    device = next(p for m in stage_modules.values() for p in m.parameters()).device
    for name in sorted(tied):
        copies: dict[int, nn.Parameter] = {}
        for stage, pname in tied[name]:
            if stage in stage_modules:
                p = dict(stage_modules[stage].named_parameters(remove_duplicate=False))[pname]
                copies[id(p)] = p
        shape, dtype = shapes[name]
        total = torch.zeros(shape, dtype=dtype, device=device)
        for p in copies.values():
            if p.grad is not None:
                total += p.grad
        dist.all_reduce(total, group=group)
        for p in copies.values():
            p.grad = total.clone()
