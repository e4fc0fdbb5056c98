"""``StepRuntimes``: what a backend's compiled graphs run with besides their code, for the
caller that drives micro-batches (a pipeline stage, ``pipelining.stages``).

One per ``LynxBackend`` (``backend.runtimes``); the compilers append to it as they compile:

- ``prefetch``: a ``runtime.prefetch.GraphRuntime`` per graph (``recompute_in_wait``, the eager
  compiler): :meth:`run_early` runs micro-batch k's recompute prefix at a pipeline wait;
- ``side_stream_runners``: a ``runtime.side_stream_runner.SideStreamRunner`` per backward
  (``side_stream``, the eager compiler);
- ``weight_deferrals``: a ``runtime.weight_split.WeightDeferral`` per graph whose backward can
  leave its weight gradients for later (the eager compiler without a side stream; Inductor with
  ``weight_split``): :meth:`run_weights` runs micro-batch k's.
"""
from __future__ import annotations

from typing import Any, Iterable


class StepRuntimes:
    def __init__(self) -> None:
        self.prefetch: list = []
        self.side_stream_runners: list = []
        self.weight_deferrals: list = []

    @classmethod
    def joined(cls, parts: Iterable["StepRuntimes"]) -> "StepRuntimes":
        """The runtimes of several backends as one (``runtime.per_microbatch``: a variant per
        micro-batch); read at the call, so graphs compiled since are in it."""
        out = cls()
        for p in parts:
            out.prefetch += p.prefetch
            out.side_stream_runners += p.side_stream_runners
            out.weight_deferrals += p.weight_deferrals
        return out

    def run_early(self, key: Any) -> int:
        """Run the recompute prefix of micro-batch ``key``'s backward in every graph now
        (``runtime.prefetch``); returns how many graphs ran one."""
        return sum(rt.run_early(key) for rt in self.prefetch)

    def run_weights(self, key: Any) -> int:
        """Run the weight gradients that micro-batch ``key``'s backward deferred (inside
        ``runtime.weight_split.defer_weights(key)``) in every graph now; returns how many ran."""
        return sum(d.run_weights(key) for d in self.weight_deferrals)
