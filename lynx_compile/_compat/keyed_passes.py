"""lynx's callables as entries of Inductor's config, keyed for its caches: the partitioner
(``custom_partitioner_fn``), the post-fusion scheduler pass and the chained post-grad pass.

Inductor's FX-graph cache key pickles its config: each of these pickles as its uuid only (what
made the compiled graph, not the callable with its per-compile state), through the module-level
``_unpickled_*`` functions, and loads as one that does nothing."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch.fx as fx


def _scheduler_pass(fn: Callable[[list], list]) -> dict[str, Any]:
    """Inductor config patches installing ``fn`` as the post-fusion scheduler pass."""
    return {"_post_fusion_custom_pass": _scheduled_pass_class()(fn)}


@functools.lru_cache(maxsize=None)
def _keyed_partitioner_class() -> type:
    """A ``CustomPartitionerFn`` calling a partitioner, pickled as its class and lynx's source
    digest only. Inductor's FX-graph cache key pickles the whole config, this object included,
    for the forward (compiled inside the compile that partitions): the partitioner itself (with
    its per-compile record and timings) made that key differ in every process, so the forward
    never hit. The key is that of an already partitioned graph, which its code holds; what made
    the partition is not part of what Inductor compiles from it."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class KeyedPartitioner(CustomPartitionerFn):
        def __init__(self, fn: Any, uuid: Any = None, source_digest: str = ""):
            self.fn = fn
            self._uuid = uuid if fn is None else (type(fn).__qualname__, source_digest)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.fn(*args, **kwargs)

        def uuid(self) -> Any:
            return self.fn.uuid() if self.fn is not None else None

        def __reduce__(self) -> tuple:
            return (_unpickled_partitioner, (self._uuid,))

    KeyedPartitioner.__qualname__ = KeyedPartitioner.__name__ = "KeyedPartitioner"
    return KeyedPartitioner


def _unpickled_partitioner(uuid: Any) -> Any:
    """What a pickled ``KeyedPartitioner`` (in a cache key) loads as: one that partitions nothing."""
    return _keyed_partitioner_class()(None, uuid)


@functools.lru_cache(maxsize=None)
def _scheduled_pass_class() -> type:
    """A ``CustomSchedulerPass`` (2.13) calling a function; its ``uuid`` (the hash of the file
    defining the function's class) is what Inductor's FX-graph cache key holds, and what it
    pickles of the config (the function itself may hold anything). 2.11 has no such class and
    pickles the config's ``_post_fusion_custom_pass`` as it is: the same object, pickled as its
    uuid, keys it there (lynx's pass reads the schedule, it changes nothing in it)."""
    from torch._inductor import custom_graph_pass

    base = getattr(custom_graph_pass, "CustomSchedulerPass", object)

    class ScheduledPass(base):
        def __init__(self, fn: Callable[[list], list] | None, uuid: Any = None):
            self.fn = fn
            self._uuid = uuid if fn is None else custom_graph_pass.get_hash_for_files(
                (inspect.getfile(type(fn)),), type(fn).__qualname__)

        def __call__(self, nodes: list) -> list:
            return self.fn(nodes) if self.fn is not None else nodes

        def uuid(self) -> Any:
            return self._uuid

        def __reduce__(self) -> tuple:
            return (_unpickled_scheduled_pass, (self._uuid,))

    ScheduledPass.__qualname__ = ScheduledPass.__name__ = "ScheduledPass"
    return ScheduledPass


def _unpickled_scheduled_pass(uuid: Any) -> Any:
    """What a pickled ``ScheduledPass`` (in a cache key) loads as: one that does nothing."""
    return _scheduled_pass_class()(None, uuid)


def _chained_post_grad_pass(user_pass: Any, fn: Callable[[fx.Graph], None], source_digest: str) -> Any:
    """A ``CustomGraphPass`` running the user's own post-grad pass(es), if any, then ``fn`` (a
    function, or an object whose ``uuid()`` says what else decides its rewrite)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    users = [p for p in (user_pass if isinstance(user_pass, (list, tuple)) else [user_pass]) if p is not None]

    class Chained(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for p in users:
                p(graph)
            fn(graph)

        def uuid(self) -> Any:
            # fn's file and lynx's sources: fn calls helpers in other lynx modules, and a changed
            # helper must not reuse Inductor's FX-graph cache entries compiled with the old one
            src = fn if inspect.isfunction(fn) else type(fn)
            own = get_hash_for_files((inspect.getfile(src),), getattr(src, "__qualname__", ""))
            extra = (fn.uuid(),) if hasattr(fn, "uuid") else ()
            return (own, source_digest, *extra, *(p.uuid() if hasattr(p, "uuid") else repr(p) for p in users))

    return Chained()
