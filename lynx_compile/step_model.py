"""The memory of a whole training step run as several compiled pieces, and the one choice per
piece that keeps it within a budget (issue M item 3; ``docs/budget_pieces.md``).

Plain data and arithmetic, no torch: ``lynx_compile.step_record`` fills it from a recorded step.

A recorded step is a sequence of **segments**, cut at the start and end of every piece call's
forward and backward. In each segment the memory measured at its highest (``Segment.peak``) is

    outside + sum of what the calls alive in it saved + the running call's own transient

where a call is *alive* between the end of its forward and the start of its backward, and the
*running* call's transient is its candidate's forward peak (in its forward) or backward peak (in
its backward: that counts its saved tensors, its incoming gradient and its gradients out).
``outside`` (eager code between the pieces: embedding, LM head, loss, autograd's gradient
accumulation, and the pieces' inputs and outputs, which no recompute removes) is what the
measurement holds beyond the pieces' part under the plans that ran. It is taken as measured and
held fixed, and the pieces' part is recomputed for any other choice: the prediction is exact for
the plans that ran and moves by the model's differences for the others.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

EXHAUSTIVE_LIMIT = 20_000
"""Choices per graph multiplied together up to this many are all tried; beyond it, the choice is
improved one graph at a time from the least-memory one (deterministic, in graph order)."""


@dataclass(frozen=True)
class Candidate:
    """One way to compile a piece: what it saves and its transients (bytes), its exposed
    recompute (seconds per call)."""

    name: str
    exposed_s: float
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int


@dataclass(frozen=True)
class Segment:
    """A stretch of the recorded step between two piece boundaries."""

    peak: int
    """Highest bytes measured in it, above what was allocated when the recording started."""
    alive: tuple[int, ...]
    """Calls (indices into ``StepModel.calls``) whose forward ended and backward has not started."""
    running: tuple[int, str] | None
    """(call, ``"fw"`` or ``"bw"``) running in it; None between pieces."""


@dataclass(frozen=True)
class GraphChoices:
    """A compiled graph's candidates: ``reference`` is its no-recompute partition (the budget's
    100%), ``choices`` what the step's plan may pick from (a graph planned on its own peak, not a
    piece, has one: its plan), ``current`` the one that ran when the step was recorded."""

    reference: Candidate
    choices: tuple[Candidate, ...]
    current: str

    def named(self, name: str) -> Candidate:
        for c in self.choices:
            if c.name == name:
                return c
        raise KeyError(name)


@dataclass(frozen=True)
class StepModel:
    """A recorded step: ``calls[i]`` is the graph (a key of ``graphs``) of the i-th piece call."""

    graphs: dict[int, GraphChoices]
    calls: tuple[int, ...]
    segments: tuple[Segment, ...]

    def _pieces(self, seg: Segment, pick: dict[int, Candidate]) -> int:
        total = sum(pick[self.calls[q]].saved_bytes for q in seg.alive)
        if seg.running is not None:
            call, kind = seg.running
            c = pick[self.calls[call]]
            total += c.forward_peak_bytes if kind == "fw" else c.backward_peak_bytes
        return total

    def outside(self) -> list[int]:
        """Per segment: the measured bytes beyond the pieces' part under the plans that ran."""
        ran = {g: gc.named(gc.current) for g, gc in self.graphs.items()}
        return [s.peak - self._pieces(s, ran) for s in self.segments]

    def predicted(self, pick: dict[int, Candidate], outside: list[int] | None = None) -> int:
        """The step's peak with graph ``g`` compiled as ``pick[g]``."""
        outside = self.outside() if outside is None else outside
        return max((o + self._pieces(s, pick) for o, s in zip(outside, self.segments)), default=0)

    def reference(self, outside: list[int] | None = None) -> int:
        """The step's peak with every graph at its no-recompute partition."""
        return self.predicted({g: gc.reference for g, gc in self.graphs.items()}, outside)

    def calls_of(self, graph: int) -> int:
        return sum(1 for g in self.calls if g == graph)

    def exposed_s(self, pick: dict[int, Candidate]) -> float:
        """Seconds of recompute the step exposes with ``pick``."""
        return sum(self.calls_of(g) * c.exposed_s for g, c in pick.items())


@dataclass(frozen=True)
class StepChoice:
    pick: dict[int, Candidate]
    predicted: int
    exposed_s: float
    fits: bool
    """Whether ``predicted`` is within the budget (when not: the least-memory choice found)."""


def choose(model: StepModel, budget: int, outside: list[int] | None = None) -> StepChoice:
    """The choice per graph with the least exposed recompute whose predicted peak is within
    ``budget``; when none is, the one with the least predicted peak (``fits`` False). Ties go to
    less memory, then to the earlier candidate of each graph in graph order."""
    outside = model.outside() if outside is None else outside
    keys = sorted(model.graphs)
    options = [model.graphs[g].choices for g in keys]
    combos = 1
    for o in options:
        combos *= len(o)
    picks = (itertools.product(*options) if combos <= EXHAUSTIVE_LIMIT
             else _greedy(model, keys, options, budget, outside))
    best: tuple | None = None
    least: tuple | None = None
    for combo in picks:
        pick = dict(zip(keys, combo))
        peak = model.predicted(pick, outside)
        cost = model.exposed_s(pick)
        if least is None or peak < least[0]:
            least = (peak, cost, pick)
        if peak <= budget and (best is None or (cost, peak) < best[:2]):
            best = (cost, peak, pick)
    if best is not None:
        return StepChoice(pick=best[2], predicted=best[1], exposed_s=best[0], fits=True)
    assert least is not None
    return StepChoice(pick=least[2], predicted=least[0], exposed_s=least[1], fits=False)


def _greedy(model: StepModel, keys: list[int], options: list[tuple[Candidate, ...]], budget: int,
            outside: list[int]):
    """Choices to try when there are too many to enumerate: from every graph at its
    least-saving candidate, each graph in turn takes its cheapest candidate that keeps the
    step within the budget."""
    current = [min(o, key=lambda c: (c.saved_bytes, c.exposed_s)) for o in options]
    yield tuple(current)
    for i, opts in enumerate(options):
        for c in sorted(opts, key=lambda c: (c.exposed_s, c.saved_bytes)):
            trial = current[:i] + [c] + current[i + 1:]
            if model.predicted(dict(zip(keys, trial)), outside) <= budget:
                current = trial
                break
        yield tuple(current)
