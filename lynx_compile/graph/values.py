"""Sizes of an FX node's values, as plain ints: what the cost model and the memory model both
read (``node.meta["val"]`` as aot_autograd / make_fx produce it: a FakeTensor, a tuple/list of
them (``None`` entries allowed), a SymInt/int/float, or ``None``).

Symbolic sizes are replaced by their size hints (``optimization_hint``). A data-dependent
(unbacked) size has no hint: inside :func:`sizes_seen` it takes the value a step saw
(``step.sizes``: the routed token counts of an MoE block), else ``UNBACKED_SIZE_HINT``.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator

import torch
import torch.fx

from lynx_compile._compat import hint_with_values

#: Size hint used for an unbacked SymInt (data-dependent size with no hint at trace time)
#: that no step has shown (:func:`sizes_seen`).
UNBACKED_SIZE_HINT = 4096

_SEEN: contextvars.ContextVar[dict[str, int]] = contextvars.ContextVar("lynx_unbacked_sizes", default={})


@contextlib.contextmanager
def sizes_seen(values: dict[str, int] | None) -> Iterator[None]:
    """Within it, an unbacked symbol named in ``values`` (``{"u2": 1536}``) sizes every tensor
    and time at that value (``hint_int``): a graph planned again with the sizes a step ran."""
    token = _SEEN.set(dict(values or {}))
    try:
        yield
    finally:
        _SEEN.reset(token)



def per_op_cached(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn(target)`` computed once per op: a node's ``target`` (an ``OpOverload``, a function) is
    asked about for every node of every graph simulated or costed. An unhashable target is
    computed each time."""
    cached = functools.lru_cache(maxsize=4096)(fn)

    @functools.wraps(fn)
    def lookup(target: Any) -> Any:
        try:
            return cached(target)
        except TypeError:  # unhashable
            return fn(target)

    return lookup


def hint_int(x: Any) -> int:
    """A plain int for an int or SymInt (its size hint; an unbacked symbol the value
    :func:`sizes_seen` gives it, else ``UNBACKED_SIZE_HINT``)."""
    if isinstance(x, torch.SymInt):
        return hint_with_values(x, _SEEN.get(), UNBACKED_SIZE_HINT)
    return int(x)


def hint_shape(t: torch.Tensor) -> torch.Size:
    """``t.shape`` with every symbolic dimension replaced by its hint."""
    return torch.Size(hint_int(s) for s in t.shape)


def iter_tensors(val: Any) -> Iterator[torch.Tensor]:
    """Yield the tensors inside a meta val (tensor, nested tuples/lists; other things skipped)."""
    if isinstance(val, torch.Tensor):
        yield val
    elif isinstance(val, (tuple, list)):
        for v in val:
            yield from iter_tensors(v)


def input_tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    """Meta-val tensors of the distinct nodes ``node`` reads (args and kwargs, nested)."""
    seen: dict[torch.fx.Node, None] = {}
    torch.fx.node.map_arg((node.args, node.kwargs), lambda n: seen.setdefault(n))
    return [t for n in seen for t in iter_tensors(n.meta.get("val"))]


def numel(t: torch.Tensor) -> int:
    """Number of elements of ``t`` (hinted)."""
    n = 1
    for s in t.shape:
        n *= hint_int(s)
    return n


def tensor_nbytes(t: torch.Tensor) -> int:
    """Logical size of ``t`` in bytes: numel × element size (hinted)."""
    return numel(t) * t.element_size()


def tensor_read_bytes(t: torch.Tensor) -> int:
    """Bytes an op has to read to consume ``t``: the memory span its strides cover.

    Equal to :func:`tensor_nbytes` for dense tensors; smaller for broadcast views (stride 0),
    e.g. a bias expanded to (B, T, C) is read as C elements, not B·T·C.
    """
    sizes = [hint_int(s) for s in t.shape]
    if any(s == 0 for s in sizes):
        return 0
    try:
        strides = [hint_int(s) for s in t.stride()]
    except (RuntimeError, NotImplementedError):  # sparse / nested tensors have no strides
        return tensor_nbytes(t)
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(sizes, strides))
    return min(span, numel(t)) * t.element_size()
