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

Zero-bubble schedules (ZBVZeroBubble, InterleavedZeroBubble) split each backward into B (input
gradients, ``backward_one_chunk(full_backward=False)``) and W (weight gradients,
``backward_weight_one_chunk``). torch splits them by walking the autograd graph, and a compiled
stage's backward is one autograd node there: its B runs the whole compiled backward for the
input gradients (retaining the graph, which lynx's compiled backward refuses: it donates
buffers) and its W would run it a second time. Here the split is lynx's own, on the backward
graph (``lynx_compile.runtime.weight_split``; the eager compiler cuts it at the first deferred
call, Inductor compiles B and W as two graphs when it compiles the backward, option
``weight_split``, which ``pipeline()`` sets for these schedules):

    schedule calls backward_one_chunk(j, full_backward=False)
        -> j's backward inside defer_weights(j): the ops the input gradient needs (B) run,
           the values the weight gradients need are kept for j
    schedule calls backward_weight_one_chunk(j)
        -> the lynx backend runs j's weight-gradient ops (W), accumulating into .grad

"""
from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lynx_compile.runtime.prefetch import microbatch
from lynx_compile.runtime.weight_split import defer_weights


class LynxPipelineStage(PipelineStage):
    """A ``PipelineStage`` whose compiled module recomputes during the gradient wait, and whose
    backward lynx splits into B and W under the zero-bubble schedules."""

    def __init__(self, *args: Any, lynx_backend=None, recompute_in_wait: bool = False,
                 scaled_elsewhere: frozenset[int] = frozenset(), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.scaled_elsewhere = scaled_elsewhere
        """ids of parameters that another stage of this rank holds too and scales (see :meth:`scale_grads`)."""
        self.lynx_backend = lynx_backend
        self.recompute_in_wait = bool(recompute_in_wait and lynx_backend is not None)
        self._pending: dict[int, list] = {}
        self._sends: list = []
        self._weight_done: set[int] = set()
        """Chunks whose B ran (``full_backward=False``) and whose W has not."""
        self.deferred_weights = 0
        """Backward graphs whose weight gradients ran in W (the B/W split happened)."""
        self.early_recomputes = 0
        self.early_s = 0.0
        """Seconds spent recomputing early (while the gradient was in flight)."""
        self.grad_wait_s = 0.0
        """Seconds then spent still waiting for gradients (0: the recompute covered the wait)."""

    def _get_init_p2p_neighbors_ops(self) -> list:
        """torch's warm-up transfers to the neighbouring stages, without those to a stage on this
        same rank: torch 2.11's multi-stage schedules post them for every neighbour, and under the
        V placement (ZBVZeroBubble: stages 1 and 2 on one rank of two) gloo cannot send to its
        own rank ("Pair is not connected"); the pair is dropped on both sides, so the others
        still match. torch 2.13 warms up without them."""
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

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

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        """The backward of ``bwd_chunk_id``. When a zero-bubble schedule asks for its input
        gradients only (``full_backward=False``), the lynx backend leaves the weight gradients
        it can split off for :meth:`backward_weight_one_chunk`; autograd runs the rest."""
        t0 = time.perf_counter()
        if self.recompute_in_wait:
            self.early_recomputes += self.lynx_backend.runtimes.run_early(bwd_chunk_id)
        t1 = time.perf_counter()
        for work in self._pending.pop(bwd_chunk_id, ()):
            work.wait()
        self.early_s += t1 - t0
        self.grad_wait_s += time.perf_counter() - t1
        defer = defer_weights(bwd_chunk_id) if not full_backward else contextlib.nullcontext()
        with microbatch(bwd_chunk_id), defer:
            out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True,
                                             last_backward=last_backward)
        if not full_backward:
            self._weight_done.add(bwd_chunk_id)
        if last_backward:
            self._wait_sends()
        return out

    def scale_grads(self, grad_scale_factor: int) -> None:
        """torch's scaling of the step's gradients (by the micro-batch count), skipping the
        parameters in ``scaled_elsewhere``: under ZBVZeroBubble rank 0 holds the first and the
        last stage, which share a tied embedding / LM head, and scaling per stage would divide its
        gradient twice."""
        if grad_scale_factor == 1:
            return
        for p in self.submod.parameters():
            if p.grad is not None and id(p) not in self.scaled_elsewhere:
                p.grad.div_(grad_scale_factor)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """W of a zero-bubble schedule: the weight gradients B deferred (none when the backward
        could not be split: then B accumulated them already)."""
        if not self.has_backward:
            return
        if bwd_chunk_id not in self._weight_done:
            raise RuntimeError(f"{self.log_prefix} backward_weight_one_chunk({bwd_chunk_id}) without "
                               "backward_one_chunk(full_backward=False) first")
        self._weight_done.remove(bwd_chunk_id)
        if self.lynx_backend is not None:
            self.deferred_weights += self.lynx_backend.runtimes.run_weights(bwd_chunk_id)
        if last_backward:  # zero-bubble schedules flag the last backward on W
            self._wait_sends()


def compile_stage(module: nn.Module, backend: Any, *, in_place: bool) -> nn.Module:
    """``module`` compiled by ``backend``: ``torch.compile(module)`` (an ``OptimizedModule``), or,
    with ``in_place``, ``module.compile()`` (the module itself, its calls compiled). torch's
    zero-bubble schedules refuse stages that contain an ``OptimizedModule``, because their own
    B/W split cannot see through a compiled backward; :class:`LynxPipelineStage` does not use
    that split, so those schedules get the module compiled in place. In place, dynamo starts at
    the module's ``forward``: one defined in torch itself (e.g. ``nn.Sequential``) would run
    uncompiled; lynx's stage modules (``PipelineStageShell``, export's ``GraphModule``) are not."""
    if not in_place:
        return torch.compile(module, backend=backend)
    module.compile(backend=backend)
    return module


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
