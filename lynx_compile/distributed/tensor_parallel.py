"""Megatron-style tensor parallelism (and sequence parallelism) for the zoo models.

Every collective (``tp_comm``) is a *functional* collective (``torch.distributed._functional_collectives``)
inside an ``autograd.Function``, so dynamo traces through them and the joint graph that the
recompute planner sees holds them as ordinary nodes::

    _c10d_functional.all_reduce / all_gather_into_tensor / reduce_scatter_tensor -> wait_tensor

One block sublayer (attention or MLP), ``tp`` ranks, rank r (Megatron-LM, arXiv 1909.08053)::

    x (B, T, C), same on all ranks
      -> f (identity fwd, all-reduce bwd)
      -> ColumnParallelLinear: rank r's heads / ffn columns           (B, T, C/tp), (B, T, 4C/tp)
      -> ... attention or activation on the local slice ...
      -> RowParallelLinear: partial sums -> g (all-reduce fwd, identity bwd) -> + bias once
    -> (B, T, C), same on all ranks

With sequence parallelism (Korthikanti et al., arXiv 2205.05198) the residual stream between the
sublayers is split along T, and f / g become an all-gather / reduce-scatter over the sequence::

    embeddings (B, T, C) -> scatter_to_sequence -> (B, T/tp, C)
      block: norm on (B, T/tp, C) -> gather_from_sequence -> (B, T, C) -> Column ... Row
             -> reduce_scatter_to_sequence -> (B, T/tp, C) -> + bias -> + residual
    final norm on (B, T/tp, C) -> gather_from_sequence (split bwd) -> (B, T, C) -> LM head

Not parallelized: the embeddings, the norms and the LM head are replicated (there is no vocab
parallelism), so every rank computes the full logits and the full loss. Under sequence
parallelism the replicated parameters that run on a sequence shard (block norms, final norm,
row-parallel biases) only see their rank's tokens: :func:`sync_sequence_parallel_grads`
all-reduces their gradients after backward, as Megatron does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lynx_compile.distributed.tp_comm import (copy_to_tensor_parallel, gather_from_sequence, reduce_from_tensor_parallel,
                                             reduce_scatter_to_sequence, scatter_to_sequence)
from lynx_compile.models.gpt import GPT
from lynx_compile.models.llama import Llama

TP_SHARD_ATTR = "lynx_tp_shard"
"""Attribute on every sharded Parameter: its :class:`TPShard` (read by :func:`full_gradients`)."""

SP_PARTIAL_GRAD_ATTR = "lynx_sp_partial_grad"
"""Attribute (True) on replicated Parameters that run on a sequence shard: after backward their
gradient holds only this rank's tokens (read by :func:`sync_sequence_parallel_grads`)."""

InputComm = Literal["copy", "gather_sequence", "none"]
OutputComm = Literal["all_reduce", "reduce_scatter_sequence"]


# ---------------------------------------------------------------------------------------------
# Sharded parameters and parallel linear layers
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TPShard:
    """How a parameter is split over the tensor-parallel group."""

    dim: int
    """0: output features (column-parallel weight and bias); 1: input features (row-parallel)."""
    fused: int = 1
    """Number of matrices stacked along ``dim`` (3 for GPT's fused q, k, v); each is split on
    its own, so rank r holds [q_r; k_r; v_r]."""


def shard_tensor(full: Tensor, spec: TPShard, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s slice of ``full`` (a copy). ValueError if the size does not divide it."""
    width = full.size(spec.dim)
    if width % (spec.fused * size):
        raise ValueError(
            f"dim {spec.dim} of width {width} ({spec.fused} fused) is not divisible by the "
            f"tensor-parallel size {size}"
        )
    parts = full.chunk(spec.fused, dim=spec.dim)
    return torch.cat([p.chunk(size, dim=spec.dim)[rank] for p in parts], dim=spec.dim)


def unshard_tensors(pieces: list[Tensor], spec: TPShard) -> Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor from every rank's piece, in rank order."""
    split = [p.chunk(spec.fused, dim=spec.dim) for p in pieces]
    ordered = [split[r][j] for j in range(spec.fused) for r in range(len(pieces))]
    return torch.cat(ordered, dim=spec.dim)


def _shard_param(full: Tensor, spec: TPShard, group: ProcessGroup) -> nn.Parameter:
    data = shard_tensor(full.detach(), spec, group.rank(), group.size()).clone()
    param = nn.Parameter(data, requires_grad=full.requires_grad)
    setattr(param, TP_SHARD_ATTR, spec)
    return param


class ColumnParallelLinear(nn.Module):
    """This rank's shard of ``dense`` with the output features split: y_r = x A_r^T + b_r.

    In: (..., in_features), the full activation. Out: (..., out_features / tp), rank r's slice
    (not gathered: a :class:`RowParallelLinear` consumes it). ``input_comm`` brings the input
    into the tensor-parallel region: "copy" applies f (input replicated), "gather_sequence"
    all-gathers a (B, T/tp, C) sequence shard, "none" means the caller already did one of those
    (``tensor_parallelize`` does it once per sublayer, shared by e.g. wq, wk and wv).
    """

    def __init__(
        self,
        dense: nn.Linear,
        group: ProcessGroup,
        *,
        fused: int = 1,
        input_comm: InputComm = "copy",
    ) -> None:
        super().__init__()
        self.group, self.input_comm = group, input_comm
        self.in_features, self.out_features = dense.in_features, dense.out_features
        spec = TPShard(dim=0, fused=fused)
        self.weight = _shard_param(dense.weight, spec, group)  # (out / tp, in)
        self.bias = None if dense.bias is None else _shard_param(dense.bias, spec, group)

    def forward(self, x: Tensor) -> Tensor:
        if self.input_comm == "copy":
            x = copy_to_tensor_parallel(x, self.group)
        elif self.input_comm == "gather_sequence":
            x = gather_from_sequence(x, self.group)
        return F.linear(x, self.weight, self.bias)  # (..., out / tp)


class RowParallelLinear(nn.Module):
    """This rank's shard of ``dense`` with the input features split: y = sum_r x_r A_r^T + b.

    In: (..., in_features / tp), rank r's slice (a column-parallel output). Out: the sum over
    ranks, replicated (``output_comm="all_reduce"``, g) or as this rank's (B, T/tp, C)
    sequence shard (``"reduce_scatter_sequence"``). The bias is replicated and added once,
    after the reduction; under sequence parallelism its gradient is partial (marked with
    ``SP_PARTIAL_GRAD_ATTR``).
    """

    def __init__(
        self, dense: nn.Linear, group: ProcessGroup, *, output_comm: OutputComm = "all_reduce"
    ) -> None:
        super().__init__()
        self.group, self.output_comm = group, output_comm
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.weight = _shard_param(dense.weight, TPShard(dim=1), group)  # (out, in / tp)
        self.bias = None
        if dense.bias is not None:
            self.bias = nn.Parameter(dense.bias.detach().clone(), dense.bias.requires_grad)
            if output_comm == "reduce_scatter_sequence":
                setattr(self.bias, SP_PARTIAL_GRAD_ATTR, True)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)  # (..., out), this rank's partial sum
        if self.output_comm == "all_reduce":
            y = reduce_from_tensor_parallel(y, self.group)
        else:
            y = reduce_scatter_to_sequence(y, self.group)  # (B, T / tp, out)
        return y if self.bias is None else y + self.bias


# ---------------------------------------------------------------------------------------------
# Whole zoo models
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class _ZooLayout:
    """Where the parallel layers go in one zoo model class."""

    column: dict[str, int]
    """Block-relative path of each column-parallel Linear -> number of fused matrices."""
    row: tuple[str, ...]
    """Block-relative paths of the row-parallel Linears."""
    sp_entry: str
    """Top-level module whose output is the residual stream entering ``blocks[0]``."""
    sp_exit: str
    """The final norm: under sequence parallelism it runs on the shard, its output is gathered."""


_LAYOUTS: dict[type, _ZooLayout] = {
    GPT: _ZooLayout(
        column={"attn.c_attn": 3, "mlp.c_fc": 1},
        row=("attn.c_proj", "mlp.c_proj"),
        sp_entry="drop",
        sp_exit="ln_f",
    ),
    Llama: _ZooLayout(
        column={"attn.wq": 1, "attn.wk": 1, "attn.wv": 1, "mlp.w1": 1, "mlp.w3": 1},
        row=("attn.wo", "mlp.w2"),
        sp_entry="tok_embeddings",
        sp_exit="norm",
    ),
}


def check_tp_divisible(model: nn.Module, tp: int) -> None:
    """ValueError naming the first head count or ffn width that ``tp`` does not divide."""
    config = model.config
    widths = {"n_heads": config.n_heads}
    if isinstance(model, Llama):
        widths |= {"n_kv_heads": config.n_kv_heads, "ffn_dim": config.ffn_dim}
    else:
        widths |= {"mlp width 4*hidden": 4 * config.hidden}
    for what, width in widths.items():
        if width % tp:
            raise ValueError(f"{what}={width} is not divisible by the tensor-parallel size {tp}")


def _enter_hook(group: ProcessGroup, sequence_parallel: bool):
    """Forward pre-hook for ``attn`` / ``mlp``: bring the sublayer input into the TP region once.

    One hook per sublayer rather than one comm per column-parallel layer: wq, wk, wv (and w1,
    w3) read the same input, and entering once costs one all-reduce (or all-gather plus
    reduce-scatter) instead of three.
    """

    def hook(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        (x,) = args
        if sequence_parallel:
            return (gather_from_sequence(x, group),)  # (B, T/tp, C) -> (B, T, C)
        return (copy_to_tensor_parallel(x, group),)

    return hook


def tensor_parallelize(
    model: nn.Module, group: ProcessGroup, *, sequence_parallel: bool = False
) -> nn.Module:
    """Turn a full zoo model, in place, into rank ``group.rank()``'s tensor-parallel shard.

    ``model`` must be a :class:`GPT` or :class:`Llama` built identically on every rank (same
    seed). Per block, GPT's ``attn.c_attn`` (fused q, k, v: rank r gets heads r of each) and
    ``mlp.c_fc`` become :class:`ColumnParallelLinear`, ``attn.c_proj`` and ``mlp.c_proj``
    :class:`RowParallelLinear`; Llama's wq, wk, wv, w1, w3 become column-, wo and w2
    row-parallel. The attention modules get their local head counts (``n_heads / tp``,
    ``n_kv_heads / tp``). Parameter names are unchanged. Every block is converted the same way,
    so blocks stay structurally identical. Embeddings, norms and the LM head stay replicated:
    no vocab parallelism. Dropout inside the sharded regions draws per-rank masks, so only
    ``dropout=0`` reproduces the single-process model exactly.

    The TP-region entry of each ``attn`` / ``mlp`` is a forward pre-hook (see
    :func:`_enter_hook`). With ``sequence_parallel`` the output of the embedding module is
    scattered along T (forward hook; ValueError at run time if tp does not divide T) and the
    final norm's output gathered; call :func:`sync_sequence_parallel_grads` after backward.
    Raises ValueError if tp does not divide the (kv) head counts or the ffn width, or if the
    model is already parallelized; TypeError for a model outside the zoo.
    """
    layout = _LAYOUTS.get(type(model))
    if layout is None:
        raise TypeError(f"tensor_parallelize supports GPT and Llama, got {type(model).__name__}")
    if any(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules()):
        raise ValueError("model is already tensor-parallel")
    tp = group.size()
    check_tp_divisible(model, tp)
    out_comm: OutputComm = "reduce_scatter_sequence" if sequence_parallel else "all_reduce"
    for block in model.blocks:
        for path, fused in layout.column.items():
            dense = block.get_submodule(path)
            # input_comm "none": the sublayer's pre-hook brings the input in, once.
            column = ColumnParallelLinear(dense, group, fused=fused, input_comm="none")
            block.set_submodule(path, column)
        for path in layout.row:
            dense = block.get_submodule(path)
            block.set_submodule(path, RowParallelLinear(dense, group, output_comm=out_comm))
        block.attn.n_heads //= tp
        if isinstance(model, Llama):
            block.attn.n_kv_heads //= tp
        for sublayer in (block.attn, block.mlp):
            sublayer.register_forward_pre_hook(_enter_hook(group, sequence_parallel))
    if sequence_parallel:
        _apply_sequence_parallel(model, layout, group)
    return model


def _apply_sequence_parallel(model: nn.Module, layout: _ZooLayout, group: ProcessGroup) -> None:
    """Scatter the residual stream after the embeddings, gather it after the final norm, and mark
    the replicated parameters in between as having partial gradients."""
    entry, exit_norm = model.get_submodule(layout.sp_entry), model.get_submodule(layout.sp_exit)
    entry.register_forward_hook(lambda module, args, out: scatter_to_sequence(out, group))
    # The LM head is replicated: every rank already has the full gradient of the gathered
    # tensor, so backward splits instead of reduce-scattering.
    exit_norm.register_forward_hook(
        lambda module, args, out: gather_from_sequence(out, group, reduce_grad=False)
    )
    for param in [*model.blocks.parameters(), *exit_norm.parameters()]:
        if not hasattr(param, TP_SHARD_ATTR):
            setattr(param, SP_PARTIAL_GRAD_ATTR, True)


def sync_sequence_parallel_grads(model: nn.Module, group: ProcessGroup) -> None:
    """All-reduce (sum), in place, the gradients of parameters marked ``SP_PARTIAL_GRAD_ATTR``.

    Call after backward and before the optimizer step (or :func:`full_gradients`). Eager only:
    one coalesced blocking all-reduce, outside any compiled graph. No-op without sequence
    parallelism.
    """
    grads = [
        p.grad
        for p in model.parameters()
        if getattr(p, SP_PARTIAL_GRAD_ATTR, False) and p.grad is not None
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(synced.view_as(g))


def full_gradients(tp_model: nn.Module, group: ProcessGroup) -> dict[str, Tensor]:
    """Each parameter's gradient in the full (unsharded) model's layout, keyed by parameter name.

    Sharded gradients are all-gathered and reassembled with :func:`unshard_tensors`; DTensor
    gradients (see ``dtensor_tp.py``) via ``full_tensor()``; replicated ones are copied.
    Parameters without a gradient are left out. A collective: every rank must call it. Under
    sequence parallelism call :func:`sync_sequence_parallel_grads` first.
    """
    full: dict[str, Tensor] = {}
    for name, param in tp_model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        spec = getattr(param, TP_SHARD_ATTR, None)
        if isinstance(grad, DTensor):
            full[name] = grad.full_tensor()
        elif spec is None:
            full[name] = grad.detach().clone()
        else:
            pieces = [torch.empty_like(grad) for _ in range(group.size())]
            dist.all_gather(pieces, grad.contiguous(), group=group)
            full[name] = unshard_tensors(pieces, spec)
    return full
