"""Replay one training iteration (pipeline x tensor parallel x recompute) as a timeline.

``simulate_iteration(StepSim) -> StepResult``: plain numbers in, events and per-rank peaks out; no
torch. Richer than ``pipelining.schedule_sim.simulate_pipeline`` (same dependency rules, same
``schedule_order``): each stage is a list of layers whose forward and backward are split into
compute segments and blocking tensor-parallel collectives, and recompute is either on demand
(exposed, right before the layer's backward) or placed in a backward collective's window::

    compute:  | B seg | R (kappa * r_w) ..... | B seg | ...        window w lasts
    comm:     |       | TP collective c_w ...........|             max(c_w, kappa * r_w)

Ranks run their actions (``F``/``B`` of a stage and micro-batch) in the schedule's order, one at
a time. ``F`` of stage s waits for stage s-1's ``F`` plus the send; ``B`` waits for stage s+1's
``B`` plus the send (the last stage's ``B`` follows its own ``F``). With ``recompute_in_wait``
the stage's on-demand recompute runs as its own ``R`` action as soon as the rank is free.

With FSDP (ZeRO-3) each layer also has communication on a stream of its own
(``fsdp_forward_comm_s``, ``fsdp_backward_comm_s``: the parameter all-gather prefetch and the
gradient reduce-scatter): the layer ends when its compute and that communication both end, so
recompute (on demand or in a window) that fits in what the communication takes beyond the
compute is hidden.

Memory: a rank holds its stages' ``static_bytes``; each micro-batch holds its stage's
``kept_bytes`` from the start of its ``F`` to the end of its ``B``; each layer holds
``backward_transient_bytes`` during its backward (with ``recompute_in_wait``, from the early
``R`` on for layers that recompute on demand: the recomputed tensors live from then on).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from lynx_compile.pipelining.schedule_sim import schedule_order

SCHEDULES = frozenset({"1F1B", "GPipe", "Interleaved1F1B"})
Lane = Literal["compute", "comm", "p2p", "fsdp"]


def _nonneg(owner: str, **values: float) -> None:
    for key, v in values.items():
        if not v >= 0:  # also rejects NaN
            raise ValueError(f"{owner}: {key} = {v!r} must be >= 0; pass a non-negative time or byte count")


@dataclass(frozen=True, kw_only=True)
class LayerSim:
    """One layer of a stage, per micro-batch (seconds and bytes)."""

    forward_s: float
    """Forward compute, excluding communication."""
    backward_s: float
    """Backward compute, excluding recompute and communication."""
    tp_forward_comm_s: tuple[float, ...] = ()
    """Blocking tensor-parallel collectives of the forward, in order (Megatron: 2 all-reduces)."""
    tp_backward_comm_s: tuple[float, ...] = ()
    """Collectives of the backward; collective w opens window w."""
    recompute_on_demand_s: float = 0.0
    """Recompute on the compute stream right before this layer's backward (exposed)."""
    recompute_in_window_s: tuple[float, ...] = ()
    """Recompute overlapped with backward collective w; empty or one entry per collective."""
    kept_bytes: int = 0
    """Activations kept per micro-batch from the forward until the backward."""
    backward_transient_bytes: int = 0
    """Extra bytes live only during this layer's backward."""
    fsdp_forward_comm_s: float = 0.0
    """FSDP: the all-gather of the next layer's parameters, in flight on its own stream while
    this layer's forward computes (the forward's prefetch); the layer ends when both end."""
    fsdp_backward_comm_s: float = 0.0
    """FSDP: the all-gather of the next layer to run backward plus the reduce-scatter of the
    previous one's gradients, in flight while this layer's backward (and its recompute) runs;
    the layer ends when both end, so recompute up to the difference is hidden."""
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("tp_forward_comm_s", "tp_backward_comm_s", "recompute_in_window_s"):
            object.__setattr__(self, f, tuple(getattr(self, f)))
        owner = f"LayerSim {self.name!r}"
        _nonneg(owner, forward_s=self.forward_s, backward_s=self.backward_s,
                recompute_on_demand_s=self.recompute_on_demand_s, kept_bytes=self.kept_bytes,
                fsdp_forward_comm_s=self.fsdp_forward_comm_s, fsdp_backward_comm_s=self.fsdp_backward_comm_s,
                backward_transient_bytes=self.backward_transient_bytes,
                **{f"{f}[{i}]": v for f in ("tp_forward_comm_s", "tp_backward_comm_s", "recompute_in_window_s")
                   for i, v in enumerate(getattr(self, f))})
        if self.recompute_in_window_s and len(self.recompute_in_window_s) != len(self.tp_backward_comm_s):
            raise ValueError(
                f"{owner}: recompute_in_window_s has {len(self.recompute_in_window_s)} entries but "
                f"tp_backward_comm_s has {len(self.tp_backward_comm_s)}; give one recompute time per "
                "backward collective (0.0 where none) or leave recompute_in_window_s empty")

    def window_recompute(self, w: int) -> float:
        return self.recompute_in_window_s[w] if self.recompute_in_window_s else 0.0


@dataclass(frozen=True, kw_only=True)
class StageSim:
    """One pipeline stage: its layers in forward order and what its rank holds and sends."""

    layers: tuple[LayerSim, ...]
    static_bytes: int = 0
    """Parameters + gradients + optimizer state of this stage."""
    send_bytes: int = 0
    """Activation bytes sent to the next stage per micro-batch (and the gradient back)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        _nonneg("StageSim", static_bytes=self.static_bytes, send_bytes=self.send_bytes)

    @property
    def kept_bytes(self) -> int:
        return sum(layer.kept_bytes for layer in self.layers)


@dataclass(frozen=True, kw_only=True)
class StepSim:
    """One training iteration to replay. ``to_dict`` writes an infinite bandwidth as None."""

    stages: tuple[StageSim, ...]
    """Pipeline stages in order; with Interleaved1F1B stage s lives on rank s % num_ranks."""
    num_microbatches: int
    schedule: Literal["1F1B", "GPipe", "Interleaved1F1B"] = "1F1B"
    num_ranks: int | None = None
    """Pipeline ranks; default len(stages) (the only value 1F1B and GPipe accept)."""
    p2p_latency_s: float = 0.0
    p2p_bytes_per_s: float = math.inf
    dp_allreduce_s: float = 0.0
    """Data-parallel gradient reduction per rank after its last backward (not overlapped)."""
    overlap_slowdown: float = 1.0
    """kappa >= 1: compute concurrent with a collective runs kappa times slower."""
    recompute_in_wait: bool = False
    """A stage's on-demand recompute for micro-batch j may run before j's gradient arrives."""
    device_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        p, m, r = len(self.stages), self.num_microbatches, self.ranks
        if p < 1:
            raise ValueError("StepSim: stages is empty; give at least one StageSim")
        if m < 1:
            raise ValueError(f"StepSim: num_microbatches = {m}; use at least 1 micro-batch")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"StepSim: schedule {self.schedule!r} unknown; use one of {sorted(SCHEDULES)}")
        if not self.overlap_slowdown >= 1:
            raise ValueError(f"StepSim: overlap_slowdown = {self.overlap_slowdown!r} < 1; use kappa >= 1 "
                             "(1.0 = overlapped compute runs at full speed)")
        if not self.p2p_bytes_per_s > 0:
            raise ValueError("StepSim: p2p_bytes_per_s must be > 0; use math.inf for a free link")
        _nonneg("StepSim", p2p_latency_s=self.p2p_latency_s, dp_allreduce_s=self.dp_allreduce_s)
        if r < 1:
            raise ValueError(f"StepSim: num_ranks = {r}; use at least 1 rank (or None for len(stages))")
        if self.schedule != "Interleaved1F1B" and r != p:
            raise ValueError(f"StepSim: {self.schedule} runs one stage per rank but num_ranks = {r} and "
                             f"there are {p} stages; leave num_ranks None or use Interleaved1F1B")
        if self.schedule == "Interleaved1F1B":
            if p % r:
                raise ValueError(f"StepSim: Interleaved1F1B needs len(stages) ({p}) to be a multiple of "
                                 f"num_ranks ({r}); split the model into {r} x k stages")
            if m % r:
                raise ValueError(f"StepSim: Interleaved1F1B needs num_microbatches ({m}) to be a multiple of "
                                 f"num_ranks ({r}); use {m + (-m) % r} micro-batches")

    @property
    def ranks(self) -> int:
        return len(self.stages) if self.num_ranks is None else self.num_ranks

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def send_s(self, stage: int) -> float:
        """Transfer time from ``stage`` to ``stage + 1`` (either way); 0 within one rank."""
        if self.rank_of(stage) == self.rank_of(stage + 1):
            return 0.0
        return self.p2p_latency_s + self.stages[stage].send_bytes / self.p2p_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["p2p_bytes_per_s"] = None if math.isinf(self.p2p_bytes_per_s) else self.p2p_bytes_per_s
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepSim":
        d = dict(data)
        d["stages"] = tuple(StageSim(**{**s, "layers": tuple(LayerSim(**lay) for lay in s["layers"])})
                            for s in d["stages"])
        if d.get("p2p_bytes_per_s", 0) is None:
            d["p2p_bytes_per_s"] = math.inf
        return cls(**d)


@dataclass(frozen=True)
class Event:
    """One interval of the timeline. Rank-level events (DP) carry stage = microbatch = -1;
    ``layer`` is the stage-local layer index (-1 for whole-stage events)."""

    rank: int
    lane: Lane
    kind: Literal["F", "B", "R", "TP", "P2P", "DP", "FSDP"]
    stage: int
    microbatch: int
    start_s: float
    end_s: float
    layer: int = -1


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """The replayed iteration. ``busy_s[r]``: time rank r spends in F/B/R actions and the DP
    reduction; ``bubble_fraction = 1 - sum(busy_s) / (num_ranks * iteration_s)``."""

    iteration_s: float
    peak_bytes: tuple[int, ...]
    busy_s: tuple[float, ...]
    bubble_fraction: float
    oom: tuple[int, ...]
    """Ranks whose peak exceeds device_memory_bytes."""
    events: tuple[Event, ...]
    device_memory_bytes: int | None = None

    @property
    def fits(self) -> bool:
        return not self.oom

    @property
    def num_ranks(self) -> int:
        return len(self.peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepResult":
        d = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        for key in ("peak_bytes", "busy_s", "oom"):
            d[key] = tuple(d[key])
        d["events"] = tuple(Event(**e) for e in d["events"])
        return cls(**d)


def interleaved_order(num_ranks: int, num_chunks: int, num_microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """Actions ``(kind, stage, microbatch)`` of one rank under torch's ScheduleInterleaved1F1B
    (``_calculate_single_rank_operations`` with its no-op slots dropped), for m % R == 0.

    Micro-batches go in rounds of R: forwards take chunk (k // R) % v, backwards the chunks in
    reverse. Warm-up: (v - 1) * R + 2 * (R - 1 - rank) forwards (capped at v * m), then pairs
    F, B, then the remaining backwards. Current Megatron-LM (microbatch_group_size_per_vp_stage
    = R, its default) builds the same order; older releases ran all forwards first when m == R.
    """
    R, v, m = num_ranks, num_chunks, num_microbatches
    if m % R:
        raise ValueError(f"interleaved_order: num_microbatches ({m}) must be a multiple of num_ranks ({R})")
    total = v * m
    warmup = min((v - 1) * R + 2 * (R - 1 - rank), total)
    next_f: dict[int, int] = defaultdict(int)  # stage -> its next micro-batch to run forward
    next_b: dict[int, int] = defaultdict(int)
    order: list[tuple[str, int, int]] = []

    def take(kind: str, stage: int, counter: dict[int, int]) -> None:
        order.append((kind, stage, counter[stage]))
        counter[stage] += 1

    for k in range(total + warmup):
        if k < total:
            take("F", ((k // R) % v) * R + rank, next_f)
        if k >= warmup:
            take("B", (v - 1 - ((k - warmup) // R) % v) * R + rank, next_b)
    return order


def rank_orders(step: StepSim) -> list[list[tuple[str, int, int]]]:
    """Per rank, its actions ``(kind, stage, microbatch)`` in execution order."""
    p, m, R = len(step.stages), step.num_microbatches, step.ranks
    if step.schedule == "Interleaved1F1B":
        return [interleaved_order(R, p // R, m, r) for r in range(R)]
    return [[(kind, s, j) for kind, j in schedule_order(step.schedule, p, m, s)] for s in range(p)]


class _Timeline:
    """Events, memory intervals, busy time and free times, appended while the replay runs."""

    def __init__(self, step: StepSim):
        self.step = step
        self.events: list[Event] = []
        self.held: list[list[tuple[float, float, int]]] = [[] for _ in range(step.ranks)]  # (start, end, bytes)
        self.busy = [0.0] * step.ranks
        self.free = [0.0] * step.ranks

    def emit(self, rank: int, lane: Lane, kind: str, stage: int, mb: int, start: float, dur: float,
             layer: int = -1) -> float:
        if dur > 0:  # zero-length work draws nothing and has no trace event
            self.events.append(Event(rank, lane, kind, stage, mb, start, start + dur, layer))
        return start + dur

    def forward(self, s: int, j: int, t: float) -> float:
        """F of stage s, micro-batch j from t: per layer, a compute segment before each collective
        (forward_s split evenly; Megatron: attention | all-reduce | MLP | all-reduce)."""
        r = self.step.rank_of(s)
        for i, layer in enumerate(self.step.stages[s].layers):
            start = t
            comms = layer.tp_forward_comm_s
            seg = layer.forward_s / max(1, len(comms))
            if not comms:
                t = self.emit(r, "compute", "F", s, j, t, seg, i)
            for c in comms:
                t = self.emit(r, "compute", "F", s, j, t, seg, i)
                t = self.emit(r, "comm", "TP", s, j, t, c, i)
            t = max(t, self.emit(r, "fsdp", "FSDP", s, j, start, layer.fsdp_forward_comm_s, i))
        return t

    def backward(self, s: int, j: int, t: float, early_r: float | None) -> float:
        """B of stage s, micro-batch j from t, layers in reverse. ``early_r`` is the start of the
        stage's early R action (recompute in the wait), or None to recompute on demand here."""
        r, kappa = self.step.rank_of(s), self.step.overlap_slowdown
        layers = self.step.stages[s].layers
        for i in reversed(range(len(layers))):
            layer, start = layers[i], t
            fsdp_end = self.emit(r, "fsdp", "FSDP", s, j, t, layer.fsdp_backward_comm_s, i)
            if early_r is None:
                t = self.emit(r, "compute", "R", s, j, t, layer.recompute_on_demand_s, i)
            elif layer.recompute_on_demand_s > 0:
                start = early_r  # its recomputed tensors have been live since the early R
            comms = layer.tp_backward_comm_s
            seg = layer.backward_s / max(1, len(comms))
            if not comms:
                t = self.emit(r, "compute", "B", s, j, t, seg, i)
            for w, c in enumerate(comms):
                t = self.emit(r, "compute", "B", s, j, t, seg, i)
                rw = kappa * layer.window_recompute(w)
                self.emit(r, "comm", "TP", s, j, t, c, i)
                self.emit(r, "compute", "R", s, j, t, rw, i)
                t += max(c, rw)  # the window closes when both the collective and its recompute end
            t = max(t, fsdp_end)  # the next layer's parameters: FSDP's prefetch must have landed
            self.held[r].append((start, t, layer.backward_transient_bytes))
        return t

    def run_backward(self, s: int, j: int, grad_ready: float) -> tuple[float, float]:
        """B of (s, j) on its rank once the gradient is ready; returns (busy seconds, end)."""
        step, r = self.step, self.step.rank_of(s)
        demand = sum(layer.recompute_on_demand_s for layer in step.stages[s].layers)
        if not (step.recompute_in_wait and demand > 0):
            start = max(self.free[r], grad_ready)
            end = self.backward(s, j, start, None)
            return end - start, end
        early = self.free[r]  # R needs no gradient: it runs now, the gradient wait overlaps it
        start = max(self.emit(r, "compute", "R", s, j, early, demand), grad_ready)
        end = self.backward(s, j, start, early)
        return demand + end - start, end


def _ready(step: StepSim, kind: str, s: int, j: int, f_end: dict, b_end: dict) -> tuple[float, int, float] | None:
    """When action (kind, s, j)'s input is ready, with the stage that produced it and when it was
    produced; None while the producer has not run."""
    if kind == "F" and s == 0:
        return 0.0, s, 0.0
    if kind == "B" and s == len(step.stages) - 1:  # the loss is local: B follows the own F
        return (f_end[s, j], s, f_end[s, j]) if (s, j) in f_end else None
    src, done = (s - 1, f_end) if kind == "F" else (s + 1, b_end)
    if (src, j) not in done:
        return None
    return done[src, j] + step.send_s(min(src, s)), src, done[src, j]


def _replay(step: StepSim) -> _Timeline:
    """Run every rank's actions in order as soon as their inputs arrive (as ``simulate_pipeline``)."""
    tl, R, orders = _Timeline(step), step.ranks, rank_orders(step)
    f_start: dict[tuple[int, int], float] = {}
    f_end: dict[tuple[int, int], float] = {}
    b_end: dict[tuple[int, int], float] = {}
    pos, remaining = [0] * R, sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(R):
            while pos[r] < len(orders[r]):
                kind, s, j = orders[r][pos[r]]
                got = _ready(step, kind, s, j, f_end, b_end)
                if got is None:
                    break
                ready, src, sent = got
                tl.emit(step.rank_of(src), "p2p", "P2P", src, j, sent, ready - sent)  # nothing if 0
                if kind == "F":
                    f_start[s, j] = start = max(tl.free[r], ready)
                    f_end[s, j] = end = tl.forward(s, j, start)
                    busy = end - start
                else:
                    busy, end = tl.run_backward(s, j, ready)
                    b_end[s, j] = end
                    tl.held[r].append((f_start[s, j], end, step.stages[s].kept_bytes))
                tl.busy[r] += busy
                tl.free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (a bug in the schedule order)")
    for r in range(R):
        tl.free[r] = tl.emit(r, "comm", "DP", -1, -1, tl.free[r], step.dp_allreduce_s)
        tl.busy[r] += step.dp_allreduce_s
    return tl


def _peak(held: list[tuple[float, float, int]]) -> int:
    """Max over time of the bytes of overlapping intervals; at equal times frees go first."""
    deltas = sorted([(b, 0, -n) for _, b, n in held] + [(a, 1, n) for a, _, n in held])
    cur = peak = 0
    for _, _, n in deltas:
        cur += n
        peak = max(peak, cur)
    return peak


def simulate_iteration(step: StepSim) -> StepResult:
    """Replay ``step``; see the module docstring for the time and memory model.

    Iteration = max over ranks of (end of its last backward + dp_allreduce_s)."""
    tl, R = _replay(step), step.ranks
    iteration = max(tl.free)
    static = [sum(st.static_bytes for s, st in enumerate(step.stages) if step.rank_of(s) == r) for r in range(R)]
    peaks = tuple(static[r] + _peak(tl.held[r]) for r in range(R))
    cap = step.device_memory_bytes
    bubble = 1.0 - sum(tl.busy) / (R * iteration) if iteration > 0 else 0.0
    return StepResult(iteration_s=iteration, peak_bytes=peaks, busy_s=tuple(tl.busy), bubble_fraction=bubble,
                      oom=tuple(r for r in range(R) if cap is not None and peaks[r] > cap),
                      events=tuple(sorted(tl.events, key=lambda e: (e.rank, e.start_s, e.lane))),
                      device_memory_bytes=cap)
