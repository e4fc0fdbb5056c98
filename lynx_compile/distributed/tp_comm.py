"""The collectives of Megatron-style tensor parallelism as autograd functions
(``tensor_parallel`` says where each sits in a block).

Each is a *functional* collective (``torch.distributed._functional_collectives``, through
``_compat``) inside an ``autograd.Function``, so dynamo traces through it and the joint graph
lynx plans holds it as ordinary nodes (``all_reduce`` / ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` -> ``wait_tensor``): ``f`` (:func:`copy_to_tensor_parallel`: identity
forward, all-reduce backward), ``g`` (:func:`reduce_from_tensor_parallel`: the reverse), and the
sequence-parallel gather / reduce-scatter / scatter along the sequence (dim 1).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lynx_compile import _compat

SEQ_DIM = 1
"""Zoo activations are (B, T, C): sequence parallelism splits dim 1."""


def _wait(t: Tensor) -> Tensor:
    # Eager functional collectives return an AsyncCollectiveTensor; waiting here keeps that
    # subclass out of autograd. Under tracing they already end in wait_tensor.
    return _compat.wait_collective(t)


def _all_reduce(x: Tensor, group: ProcessGroup) -> Tensor:
    return _wait(_compat.functional_all_reduce(x.contiguous(), "sum", group))


def _all_gather_seq(x: Tensor, group: ProcessGroup) -> Tensor:
    # gathers along dim 0 and re-concatenates along SEQ_DIM (chunk + cat).
    return _wait(_compat.functional_all_gather(x.contiguous(), SEQ_DIM, group))


def _reduce_scatter_seq(x: Tensor, group: ProcessGroup) -> Tensor:
    return _wait(_compat.functional_reduce_scatter(x.contiguous(), "sum", SEQ_DIM, group))


def _split_seq(x: Tensor, rank: int, size: int) -> Tensor:
    if x.size(SEQ_DIM) % size:
        raise ValueError(
            f"sequence parallelism needs the sequence length T={x.size(SEQ_DIM)} to be "
            f"divisible by the tensor-parallel size {size}"
        )
    return x.chunk(size, dim=SEQ_DIM)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFromSeq(torch.autograd.Function):
    """All-gather along T forward. Backward: reduce-scatter when every rank's consumer saw only
    part of the computation (a column-parallel layer), a plain split when the consumer is
    replicated and each rank already holds the full gradient (the LM head)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup, rank: int, size: int, reduce_grad: bool):
        ctx.group, ctx.rank, ctx.size, ctx.reduce_grad = group, rank, size, reduce_grad
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.reduce_grad:
            grad = _reduce_scatter_seq(grad, ctx.group)
        else:
            grad = _split_seq(grad, ctx.rank, ctx.size)
        return grad, None, None, None, None


class _ReduceScatterToSeq(torch.autograd.Function):
    """Reduce-scatter along T forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather_seq(grad, ctx.group), None


class _ScatterToSeq(torch.autograd.Function):
    """Keep this rank's T/tp slice forward (no communication), all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup, rank: int, size: int) -> Tensor:
        ctx.group = group
        return _split_seq(x, rank, size)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather_seq(grad, ctx.group), None, None, None


def copy_to_tensor_parallel(x: Tensor, group: ProcessGroup) -> Tensor:
    """f: ``x`` unchanged; its gradient is summed over the group."""
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel(x: Tensor, group: ProcessGroup) -> Tensor:
    """g: the sum of ``x`` over the group; the gradient passes through unchanged."""
    return _ReduceFromTP.apply(x, group)


def gather_from_sequence(x: Tensor, group: ProcessGroup, *, reduce_grad: bool = True) -> Tensor:
    """(B, T/tp, ...) shards -> (B, T, ...) on every rank, in rank order.

    ``reduce_grad=True``: the gradient is reduce-scattered (the gathered tensor feeds a
    column-parallel layer, so each rank holds a partial gradient). ``False``: it is split (the
    gathered tensor feeds replicated code, so each rank already holds the full gradient).
    """
    return _GatherFromSeq.apply(x, group, group.rank(), group.size(), reduce_grad)


def reduce_scatter_to_sequence(x: Tensor, group: ProcessGroup) -> Tensor:
    """(B, T, ...) partial sums -> this rank's (B, T/tp, ...) slice of their sum."""
    return _ReduceScatterToSeq.apply(x, group)


def scatter_to_sequence(x: Tensor, group: ProcessGroup) -> Tensor:
    """(B, T, ...) replicated -> this rank's (B, T/tp, ...) slice. ValueError if tp does not
    divide T."""
    return _ScatterToSeq.apply(x, group, group.rank(), group.size())
