"""Inductor's buffer reuse, under a rule lynx's memory model can promise.

Inductor's wrapper code hands a freed buffer's storage to a later buffer of the same size, dtype
and device instead of freeing it and allocating anew (``config.allow_buffer_reuse``; the
``AllocateLine`` / ``FreeIfNotReusedLine`` planning in ``codegen/wrapper.py``, 2.11 and 2.13).
Its own rule takes a reuse where its estimate of the graph's memory allows, and that estimate
counts the graph's inputs (the parameters) until their last reader: loose, so a reuse may hold a
buffer above the peak lynx planned (HF Llama under ``full``: 99 KB). Off, every buffer is one
allocation and one free: on CPU, ~90 more allocator calls in a 4-layer step (245 against
torch.compile's 129 on gpt-small) and 0.2-1% of its time (``benchmarks/results/buffer_reuse_cpu_s32.md``).

:func:`buffer_reuse_within` turns it on under lynx's rule (``AllocateLine.should_reuse_buffer``
replaced while Inductor generates code inside it):

- a buffer freed by the scheduler node just before the allocation is reused: nothing runs in
  between, so the memory is the same as a free and an allocation;
- one freed earlier is reused only while the bytes held between its free and its reuse, summed
  with every other such hold overlapping them, stay within ``headroom`` (the budget's bytes
  above the plan's predicted peak): the compiled graph's peak stays within the plan's plus
  ``headroom``. The most held at once is reported (``held()``);
- a buffer read by one of ``keep_ops`` (``lynx::accumulate_grads``, which may keep it as a
  parameter's ``.grad``) is never reused: a later kernel would overwrite the gradient.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator


class ReuseRule:
    """The rule's state over one ``buffer_reuse_within``: per graph generated (its wrapper), the
    bytes held at each scheduler node by reuses taken, and the buffers ``keep_ops`` read."""

    def __init__(self, headroom: int, keep_ops: tuple = ()):
        self.headroom = max(0, int(headroom))
        self.keep_ops = tuple(keep_ops)
        self.graphs: dict[int, tuple[list[int], set[str]]] = {}
        self.reused = 0
        self.refused = 0

    def held(self) -> int:
        """The most bytes held at once by the reuses taken, over the graphs generated."""
        return max((max(h, default=0) for h, _ in self.graphs.values()), default=0)

    def _graph(self, wrapper: Any) -> tuple[list[int], set[str]]:
        from torch._inductor.virtualized import V

        state = self.graphs.get(id(wrapper))
        if state is None:
            nodes = V.graph.scheduler.nodes
            kept: set[str] = set()
            for snode in nodes:
                op = getattr(getattr(snode, "node", None), "op_overload", None)
                if op is not None and op in self.keep_ops:
                    kept |= {dep.name for dep in snode.read_writes.reads}
            state = self.graphs[id(wrapper)] = ([0] * (len(nodes) + 1), kept)
        return state

    def decide(self, line: Any, free_line: Any, size: int) -> bool:
        held, kept = self._graph(line.wrapper)
        if free_line.node.get_name() in kept:
            self.refused += 1
            return False
        if getattr(line, "comm_buffer", False) or free_line.scheduler_node_index + 1 == line.scheduler_node_index:
            self.reused += 1
            return True
        span = range(free_line.scheduler_node_index + 1, line.scheduler_node_index)
        if max((held[i] for i in span), default=0) + size > self.headroom:
            self.refused += 1
            return False
        for i in span:
            held[i] += size
        self.reused += 1
        return True


@contextlib.contextmanager
def buffer_reuse_within(headroom: int, keep_ops: tuple = ()) -> Iterator[ReuseRule]:
    """Inductor's buffer reuse on under lynx's rule (module docstring) while Inductor generates
    code inside it; yields the rule (``held()``, ``reused``, ``refused``). Not reentrant across
    threads: the rule replaces a class attribute of Inductor's for the duration."""
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen.wrapper import AllocateLine

    rule = ReuseRule(headroom, keep_ops)
    before = AllocateLine.should_reuse_buffer

    def should_reuse_buffer(self: Any, free_line: Any, size: int) -> bool:
        return rule.decide(self, free_line, size)

    AllocateLine.should_reuse_buffer = should_reuse_buffer
    try:
        with inductor_config.patch(allow_buffer_reuse=True):
            yield rule
    finally:
        AllocateLine.should_reuse_buffer = before
