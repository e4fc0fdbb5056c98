"""One plan per micro-batch: compile each graph once per variant, run the variant a micro-batch
was assigned.

A pipeline stage's micro-batches need not all recompute the same activations: the ones alive at
the stage's memory peak must drop more than the ones that are not, and recompute that only the
weight gradients read costs nothing where W runs in a bubble
(``lynx_compile.pipelining.microbatch_plan`` chooses). ``PerMicrobatchBackend`` is a dynamo backend
over several :class:`~lynx_compile.compiler.dynamo_backend.LynxBackend` (one per variant, e.g. different
``memory_budget``): dynamo hands it a graph once, each variant compiles it (its own partition,
its own forward and backward), and the callable it returns runs, per call, the variant of the
micro-batch tagged by ``runtime.prefetch.microbatch`` (``LynxPipelineStage`` tags its chunk id;
untagged calls run ``default``)::

    forward of chunk j ──▶ variant assign[j] ──▶ its compiled forward ──▶ its autograd node
    backward of chunk j ─────────────────────────────────────────────────▶ that variant's backward

The backward needs no dispatch: autograd runs the node the forward created, so the saved
tensors and the recompute are the variant's own. Deferred weight gradients
(``runtime.weight_split``) and early recompute (``runtime.prefetch``) are keyed by the chunk id,
so ``run_weights`` / ``run_early`` ask every variant and only the one that ran the chunk holds it.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import torch.fx as fx

from lynx_compile.runtime.prefetch import current_microbatch
from lynx_compile.runtime.step_runtimes import StepRuntimes


class PerMicrobatchBackend:
    """A dynamo backend running ``backends[assign[j]]``'s compiled graph for micro-batch j."""

    def __init__(self, backends: Sequence[Any], assign: Mapping[Any, int], *, default: int = 0):
        if not backends:
            raise ValueError("PerMicrobatchBackend needs at least one backend")
        bad = {k: v for k, v in assign.items() if not 0 <= v < len(backends)}
        if bad or not 0 <= default < len(backends):
            raise ValueError(f"variant indices {bad or default} out of range for {len(backends)} backends")
        self.backends = list(backends)
        self.assign = dict(assign)
        self.default = default
        self.runs: Counter[tuple[Any, int]] = Counter()
        """Forward calls per (micro-batch key, variant index); untagged calls (a schedule's shape
        inference) under key None."""

    def __repr__(self) -> str:
        return f"PerMicrobatchBackend({len(self.backends)} variants, assign={self.assign})"

    @property
    def calls(self) -> Counter[int]:
        """Forward calls per variant index (what ran, for tests and reports)."""
        out: Counter[int] = Counter()
        for (_, v), n in self.runs.items():
            out[v] += n
        return out

    @property
    def planning_group(self):
        return self.backends[0].planning_group

    @planning_group.setter
    def planning_group(self, group) -> None:
        for b in self.backends:
            b.planning_group = group

    @property
    def records(self) -> list:
        return [r for b in self.backends for r in b.records]

    @property
    def plans(self) -> list:
        return [p for b in self.backends for p in b.plans]

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        used = sorted(set(self.assign.values()) | {self.default})
        compiled: dict[int, Callable] = {}
        for v in used:  # each variant traces its own copy (aot_autograd may rewrite the graph's meta)
            graph = fx.Graph()
            graph.output(graph.graph_copy(gm.graph, {}))
            copy = fx.GraphModule(gm, graph)
            copy.meta = dict(getattr(gm, "meta", {}))
            compiled[v] = self.backends[v](copy, list(example_inputs), **kwargs)  # called as fn(*args)
        assign, default, runs = self.assign, self.default, self.runs

        def run(*args: Any) -> Any:
            key = current_microbatch()
            v = assign.get(key, default)
            runs[key, v] += 1
            return compiled[v](*args)

        return run

    @property
    def runtimes(self) -> StepRuntimes:
        """Every variant's runtimes as one (``runtime.step_runtimes``)."""
        return StepRuntimes.joined(b.runtimes for b in self.backends)

