"""The memory of a whole training step run as several compiled pieces, and the one choice per
piece that keeps it within a budget (issue M item 3; ``docs/budget_pieces.md``).

Plain data and arithmetic, no torch: ``lynx_compile.step.recorder`` fills it from a recorded step.

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

The transients of the candidates that ran are taken as measured too (``StepModel.measured``):
a running call's peak above the level its segment started at is its own. Before, they were
lynx's memory model's, and where the model over-estimated the one that ran, ``outside`` came out
low by as much and every other candidate was predicted low by it (gpt-tiny per block: the
backward of torch's min-cut at 0.1 modelled 37,888 B above what it allocates, so 0.3 was
predicted to reach 0.460 of the step and measured 0.491).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Callable

from lynx_compile.decisions import CandidateKey

USER = "user"
"""The policy of the candidate that is the user's own checkpoint regions and SAC policies
(``passes.user_tags``), partitioned as torch.compile partitions them (key ``CandidateKey(USER)``)."""

EXHAUSTIVE_LIMIT = 20_000
"""Choices per graph multiplied together up to this many are all tried; beyond it, the choice is
improved one graph at a time from the least-memory one (deterministic, in graph order)."""


@dataclass(frozen=True)
class Candidate:
    """One way to compile a piece: what it saves and its transients (bytes), its exposed
    recompute (seconds per call)."""

    name: CandidateKey
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
    start: int | None = None
    """Bytes allocated as it started (the level at the mark before it), measured like ``peak``;
    None where not recorded."""


@dataclass(frozen=True)
class GraphChoices:
    """A compiled graph's candidates: ``reference`` is its no-recompute partition (the budget's
    100%), ``choices`` what the step's plan may pick from (a graph planned on its own peak, not a
    piece, has one: its plan), ``current`` the one that ran when the step was recorded."""

    reference: Candidate
    choices: tuple[Candidate, ...]
    current: CandidateKey
    incoming_bytes: int | None = None
    """Bytes of the gradients its backward receives (one per differentiable output), alive as
    the backward starts and counted in every candidate's ``backward_peak_bytes``; None where not
    known (a backward's transient is then not taken from a recording)."""

    def to_dict(self) -> dict:
        """JSON's form: each key as its text (``str(CandidateKey)``)."""
        def plain(c: Candidate) -> dict:
            return dict(dataclasses.asdict(c), name=str(c.name))

        return {"reference": plain(self.reference), "choices": [plain(c) for c in self.choices],
                "current": str(self.current), "incoming_bytes": self.incoming_bytes}

    @classmethod
    def from_dict(cls, data: dict) -> "GraphChoices":
        """Raises ``TypeError`` / ``KeyError`` / ``ValueError`` on anything but ``to_dict``'s form."""
        def candidate(c: dict) -> Candidate:
            return Candidate(**dict(c, name=CandidateKey.parse(c["name"])))

        incoming = data.get("incoming_bytes")
        return cls(reference=candidate(data["reference"]), choices=tuple(candidate(c) for c in data["choices"]),
                   current=CandidateKey.parse(data["current"]), incoming_bytes=None if incoming is None else int(incoming))

    def named(self, name: CandidateKey) -> Candidate:
        for c in self.choices:
            if c.name == name:
                return c
        raise KeyError(name)


Assignment = tuple[Candidate, ...]
"""One candidate per call of a graph in the step, in call order."""


@dataclass(frozen=True)
class StepModel:
    """A recorded step: ``calls[i]`` is the graph (a key of ``graphs``) of the i-th piece call.
    A choice (``pick``) gives each graph an ``Assignment``: the candidate of each of its calls."""

    graphs: dict[int, GraphChoices]
    calls: tuple[int, ...]
    segments: tuple[Segment, ...]

    @functools.cached_property
    def positions(self) -> tuple[int, ...]:
        """Per call, how many calls of the same graph came before it in the step (read by every
        prediction ``choose`` makes: computed once)."""
        seen: dict[int, int] = {}
        out = []
        for g in self.calls:
            out.append(seen.get(g, 0))
            seen[g] = out[-1] + 1
        return tuple(out)

    def calls_of(self, graph: int) -> int:
        return sum(1 for g in self.calls if g == graph)

    def uniform(self, each: dict[int, Candidate]) -> dict[int, Assignment]:
        """Every call of graph ``g`` compiled as ``each[g]``."""
        return {g: (c,) * self.calls_of(g) for g, c in each.items()}

    def _pieces(self, seg: Segment, pick: dict[int, Assignment], pos: tuple[int, ...]) -> int:
        total = sum(pick[self.calls[q]][pos[q]].saved_bytes for q in seg.alive)
        if seg.running is not None:
            call, kind = seg.running
            c = pick[self.calls[call]][pos[call]]
            total += c.forward_peak_bytes if kind == "fw" else c.backward_peak_bytes
        return total

    def measured(self) -> tuple["StepModel", list[tuple[int, str, int, int]]]:
        """This step with the transients of the candidates that ran as the recording measured
        them, and what changed: (graph, ``"forward"`` or ``"backward"``, modelled, measured).

        In a segment where call ``c`` runs, everything but ``c`` holds still, so the peak above
        the segment's start is ``c``'s own: its forward peak (nothing of it is alive at its
        start), or its backward peak less what is alive of it at its start (what it saved, the
        gradients it receives). Every call of a graph runs the same compile: the least over its
        calls is taken (it keeps each segment's prediction at or above what it measured, and any
        other candidate's no lower than that candidate's model). Unchanged where segments have
        no start, a backward's incoming bytes are not known, or a graph has no such segment."""
        seen: dict[tuple[int, str], int] = {}
        for s in self.segments:
            if s.start is None or s.running is None:
                continue
            call, kind = s.running
            g = self.calls[call]
            gc = self.graphs[g]
            own = s.peak - s.start
            if kind == "bw":
                if gc.incoming_bytes is None:
                    continue
                own += gc.named(gc.current).saved_bytes + gc.incoming_bytes
            seen[g, kind] = min(own, seen.get((g, kind), own))
        graphs, changes = dict(self.graphs), []
        for (g, kind), own in sorted(seen.items()):
            gc = graphs[g]
            c = gc.named(gc.current)
            field = "forward_peak_bytes" if kind == "fw" else "backward_peak_bytes"
            if getattr(c, field) == own:
                continue
            changes.append((g, "forward" if kind == "fw" else "backward", getattr(c, field), own))
            new = dataclasses.replace(c, **{field: own})
            graphs[g] = dataclasses.replace(
                gc, choices=tuple(new if x.name == c.name else x for x in gc.choices),
                reference=new if gc.reference.name == c.name else gc.reference)
        return dataclasses.replace(self, graphs=graphs), changes

    def own(self, pick: dict[int, Assignment]) -> dict[int, Assignment]:
        """``pick`` (made from another model of the same step) with this model's candidates of
        the same names (:meth:`measured` changes the numbers of some)."""
        return {g: tuple(self.graphs[g].named(c.name) for c in a) for g, a in pick.items()}

    def outside(self) -> list[int]:
        """Per segment: the measured bytes beyond the pieces' part under the plans that ran."""
        ran = self.uniform({g: gc.named(gc.current) for g, gc in self.graphs.items()})
        pos = self.positions
        return [s.peak - self._pieces(s, ran, pos) for s in self.segments]

    def predicted(self, pick: dict[int, Assignment], outside: list[int] | None = None) -> int:
        """The step's peak with the calls of graph ``g`` compiled as ``pick[g]``."""
        outside = self.outside() if outside is None else outside
        pos = self.positions
        return max((o + self._pieces(s, pick, pos) for o, s in zip(outside, self.segments)), default=0)

    def reference(self, outside: list[int] | None = None) -> int:
        """The step's peak with every graph at its no-recompute partition."""
        return self.predicted(self.uniform({g: gc.reference for g, gc in self.graphs.items()}), outside)

    def exposed_s(self, pick: dict[int, Assignment]) -> float:
        """Seconds of recompute the step exposes with ``pick``."""
        return sum(c.exposed_s for calls in pick.values() for c in calls)


def recorded(graphs: dict[int, GraphChoices], calls: tuple[int, ...], marks: list[tuple[int, str]],
             peaks: list[int | None], levels: list[int | None], grads: list[int],
             before: int) -> tuple[StepModel, StepModel, list[tuple[int, str, int, int]]]:
    """A recorded step as segments. ``calls``: the graph of each piece call; ``marks``: (call,
    ``fw0`` / ``fw1`` / ``bw0`` / ``bw1`` / ``end``) in the order the step placed them;
    ``peaks[i]``: the highest bytes measured between mark ``i - 1`` and mark ``i``,
    ``levels[i]`` the bytes at mark ``i`` (None: mark ``i`` was not seen); ``grads[i]``: the
    ``.grad`` bytes accumulated into by mark ``i`` (``memory.param_grads.GradWatch``);
    ``before``: bytes the step allocated before the recording started (the first call's
    activation inputs), in every segment.

    Two models: the step as if it allocated its parameter gradients (``.grad`` None at its
    start), and as it ran (the same when no ``.grad`` was accumulated into); in both, the
    candidates that ran have their transients as measured (:meth:`StepModel.measured`, whose
    changes are returned third)."""
    segments: list[Segment] = []
    as_ran: list[Segment] = []
    alive: set[int] = set()
    running: tuple[int, str] | None = None
    # on CPU the allocator does not report the free of a block allocated before the recording;
    # on CUDA the recording's base holds it
    start: int | None = before  # the level the recording starts from
    for (call, kind), peak, level, held in zip(marks, peaks, levels, [0, *grads[:-1]]):
        if peak is None:
            start = None
            continue
        peak += before
        level = None if level is None else level + before
        # + the gradients accumulated into an allocated .grad before this segment started,
        # which a step starting with .grad None holds (memory.param_grads). One accumulated
        # within the segment was in its measured peak until then (the backward's output that
        # autograd adds into .grad and frees), so it counts from the next segment on.
        segments.append(Segment(peak=peak + held, alive=tuple(sorted(alive)), running=running,
                                start=None if start is None else start + held))
        as_ran.append(Segment(peak=peak, alive=tuple(sorted(alive)), running=running, start=start))
        start = level
        if kind == "fw0":
            running = (call, "fw")
        elif kind == "fw1":
            running = None
            alive.add(call)
        elif kind == "bw0":
            alive.discard(call)
            running = (call, "bw")
        elif kind == "bw1":
            running = None
    model = StepModel(graphs=graphs, calls=calls, segments=tuple(segments))
    # the transients as the step ran them; a step that allocates its gradients holds, in a
    # piece's backward, the gradients it accumulates there too, which a step that ran with
    # .grad allocated did not measure: that one keeps the model's
    ran, changes = dataclasses.replace(model, segments=tuple(as_ran)).measured()
    return (ran if not any(grads) else model), ran, changes


@dataclass(frozen=True)
class StepChoice:
    pick: dict[int, Assignment]
    predicted: int
    exposed_s: float
    fits: bool
    """Whether ``predicted`` is within the budget (when not: the least-memory choice found)."""


CALL_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 10**6)
"""The numbers of calls per step :func:`provisional_pick` weighs a candidate at (a block's graph
is called once per layer; how many is not known when it compiles)."""


def provisional_pick(choices: tuple[Candidate, ...] | list[Candidate], new_grad_bytes: int) -> Candidate:
    """A piece's candidate before any step is recorded (``decide.decide_piece``): the one whose
    step of ``n`` calls of the graph peaks closest to the lowest any candidate reaches, at the
    worst ``n``, nothing else being known (how many calls a step makes is not known when the
    graph compiles).

    In a step of ``n`` calls, the backward of call ``k`` (counted from the first) runs while the
    ``k`` calls before it hold what they saved and the ``n - 1 - k`` after it have added their
    parameter gradients to ``.grad`` (``new_grad_bytes`` each where ``.grad`` is None as the step
    starts; 0 where it is allocated): ``k * saved + (n - 1 - k) * new_grad_bytes + backward peak``,
    highest at ``(n - 1) * max(saved, new_grad_bytes) + backward peak`` for one end or the other
    (the forward's peak in place of the backward's where it is higher). Each candidate's worst
    ratio of that to the lowest of all candidates at the same ``n`` (over :data:`CALL_COUNTS`) is
    its regret; the least regret wins (ties: :func:`provisional_order`). What a candidate saves
    counts only above the gradients a call adds, so saving a little more can pay for a lower
    transient: gpt-tiny per block (4 calls, ``.grad`` None), torch's min-cut at 0.1 saves 72,704 B
    and peaks at 596,992 B in its backward, at 0.3 it saves 200,704 B and peaks at 561,152 B (a
    call adds 196,608 B of gradients): 0.1, the least memory for many calls (by 4,096 B a call),
    measured 0.467 of the step against 0.455 for 0.3. A candidate that saves nothing but
    recomputes the block inside its backward can peak higher than one saving a little (``full``:
    0.552 of the step)."""
    def peak(c: Candidate, n: int) -> int:
        return (n - 1) * max(c.saved_bytes, new_grad_bytes) + max(c.forward_peak_bytes, c.backward_peak_bytes)

    lowest = {n: max(1, min(peak(c, n) for c in choices)) for n in CALL_COUNTS}
    return min(choices, key=lambda c: (max(peak(c, n) / lowest[n] for n in CALL_COUNTS),
                                       provisional_order(c, new_grad_bytes)))


def provisional_order(c: Candidate, new_grad_bytes: int) -> tuple:
    """Tie-break of :func:`provisional_pick`: least memory in a step of very many calls (what a
    call keeps, at least its gradients' bytes), then the transient, then what it saves, then its
    recompute."""
    return (max(c.saved_bytes, new_grad_bytes), max(c.forward_peak_bytes, c.backward_peak_bytes), c.saved_bytes,
            c.exposed_s)


def assignments(choices: tuple[Candidate, ...], calls: int) -> list[Assignment]:
    """What one graph called ``calls`` times may do: every call the same candidate, or the first
    ``k`` calls one candidate and the rest another (the first calls' saved tensors live longest,
    so they are the ones to make smaller: Megatron's ``recompute_num_layers`` in general form)."""
    out: dict[Assignment, None] = {}
    for a in choices:
        out[(a,) * calls] = None
    for a, b in itertools.permutations(choices, 2):
        if a.saved_bytes >= b.saved_bytes:
            continue
        for k in range(1, calls):
            out[(a,) * k + (b,) * (calls - k)] = None
    return list(out)


def choose(model: StepModel, budget: int, outside: list[int] | None = None,
           accept: Callable[[dict[int, Assignment]], bool] | None = None) -> StepChoice:
    """The choice (an assignment per graph, :func:`assignments`) with the least exposed
    recompute whose predicted peak is within ``budget`` (and that ``accept`` accepts, when
    given); when none is, the one with the least predicted peak (``fits`` False). Ties go to less
    memory, then to the earlier in order."""
    outside = model.outside() if outside is None else outside
    keys = sorted(model.graphs)
    options = [assignments(model.graphs[g].choices, model.calls_of(g)) for g in keys]
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
        if peak <= budget and (best is None or (cost, peak) < best[:2]) and (accept is None or accept(pick)):
            best = (cost, peak, pick)
    if best is not None:
        return StepChoice(pick=best[2], predicted=best[1], exposed_s=best[0], fits=True)
    assert least is not None
    return StepChoice(pick=least[2], predicted=least[0], exposed_s=least[1], fits=False)


def _greedy(model: StepModel, keys: list[int], options: list[list[Assignment]], budget: int,
            outside: list[int]):
    """Choices to try when there are too many to enumerate: from every graph at its
    least-saving assignment, each graph in turn takes its cheapest assignment that keeps the
    step within the budget."""
    saved = lambda a: sum(c.saved_bytes for c in a)  # noqa: E731
    cost = lambda a: sum(c.exposed_s for c in a)  # noqa: E731
    current = [min(o, key=lambda a: (saved(a), cost(a))) for o in options]
    yield tuple(current)
    for i, opts in enumerate(options):
        for a in sorted(opts, key=lambda a: (cost(a), saved(a))):
            trial = current[:i] + [a] + current[i + 1:]
            if model.predicted(dict(zip(keys, trial)), outside) <= budget:
                current = trial
                break
        yield tuple(current)
