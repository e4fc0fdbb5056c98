"""The stage planner's answer: a frozen :class:`StagePlan`, one :class:`StageInfo` per stage.

Plain data keyed by block names and indices (printable with ``table()``, JSON round-trips with
``to_dict`` / ``from_dict``; every rank receives rank 0's by pickle). ``plan_stages`` makes it,
``lynx_compile.pipeline`` builds the stages from its cuts and compiles each under its
``budget_bytes``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Schedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]
SCHEDULES: frozenset[str] = frozenset({"GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"})
Method = Literal["lynx", "compute", "uniform"]
METHODS: frozenset[str] = frozenset({"lynx", "compute", "uniform"})


class StagePlanError(ValueError):
    """The pipeline cannot be planned as asked; the message names the limit and the fix."""


@dataclass(frozen=True, kw_only=True)
class StageInfo:
    index: int
    blocks: tuple[int, int]
    """Half-open range [start, end) of block indices."""
    block_names: tuple[str, ...]
    in_flight: int
    static_bytes: int
    budget_bytes: int | None
    """Peak allowed for one micro-batch's fw+bw (the stage's lynx ``memory_budget``); None: no limit."""
    kept_bytes: int
    """Activation bytes one micro-batch keeps under the plan."""
    peak_bytes: int
    """Predicted device peak: static + the most ``f x kept + w x carry_bytes`` over ``held`` +
    working + the transient of a block's backward (``transient_bytes``; the waiting micro-batches
    hold only what they keep, those past B only their carry). The fit test is stricter: each
    micro-batch in flight counts at the whole per-micro-batch peak (``budget_bytes``), as the
    stage's lynx budget bounds only that peak."""
    compute_s: float
    recompute_s: float
    """Exposed recompute per micro-batch."""
    recompute_w_s: float = 0.0
    """The part of ``recompute_s`` only the weight gradients need: it runs in W under the
    zero-bubble schedules (``RecomputeCurve.exposed_w_s``; 0 elsewhere or when not known)."""
    fits: bool = True
    carry_bytes: int = 0
    """Bytes one micro-batch holds from its B to its W (zero-bubble schedules with lynx's B/W
    split; 0 otherwise)."""
    held: tuple[tuple[int, int], ...] = ()
    """Pairs (micro-batches between F and B, carries between B and W) the stage passes through
    and no other pair exceeds in both, from torch's action order (``schedule_sim.held_microbatches``);
    ``((in_flight, 0),)`` without W. The peak is the joint maximum over them."""
    pending_w: int = 0
    """Carries held at the predicted peak (the ``w`` of the pair reaching it)."""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.recompute_s


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    method: str
    schedule: str
    num_stages: int
    num_microbatches: int
    memory_per_device: int | None
    stages: tuple[StageInfo, ...]
    predicted_step_s: float
    """Timeline of the schedule, recompute on the critical path."""
    predicted_step_in_wait_s: float
    """Same, with recompute run while the stage waits for its gradient."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    pinned_cuts: tuple[int, ...] = ()
    """Cuts the user pinned (argument or ``pipe_split()`` markers); the rest were chosen."""
    marker_cuts: tuple[int, ...] = ()
    """The pinned cuts that are ``pipe_split()`` markers in the model (torch splits there itself)."""
    rank_peak_bytes: tuple[int, ...] = ()
    """Predicted device peak of each rank (pipeline group rank), its stages together over torch's
    order (``rank_memory``), from the bytes the planner expects each micro-batch to keep; one
    stage per rank: that stage's ``peak_bytes``."""
    rank_bound_bytes: tuple[int, ...] = ()
    """Each rank's fit test at the plan's allowances (every micro-batch in flight at its stage's
    whole allowance, ``rank_memory``), at most ``memory_per_device`` when the plan fits; () without
    a memory limit. What is left under ``memory_per_device`` is the headroom early recompute may use."""

    @property
    def cuts(self) -> tuple[str, ...]:
        """Name of the first block of every stage after the first (where a stage begins)."""
        return tuple(s.block_names[0] for s in self.stages[1:])

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(s.blocks[1] - s.blocks[0] for s in self.stages)

    @property
    def bottleneck_s(self) -> float:
        return max(s.time_s for s in self.stages)

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cuts"], d["layers_per_stage"] = list(self.cuts), list(self.layers_per_stage)
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StagePlan":
        d = {k: v for k, v in d.items() if k not in ("cuts", "layers_per_stage")}
        d["stages"] = tuple(StageInfo(**{**s, "blocks": tuple(s["blocks"]), "block_names": tuple(s["block_names"]),
                                         "held": tuple(tuple(h) for h in s.get("held", ()))})
                            for s in d["stages"])
        d["notes"] = tuple(d.get("notes", ()))
        d["pinned_cuts"] = tuple(d.get("pinned_cuts", ()))
        d["marker_cuts"] = tuple(d.get("marker_cuts", ()))
        d["rank_peak_bytes"] = tuple(d.get("rank_peak_bytes", ()))
        d["rank_bound_bytes"] = tuple(d.get("rank_bound_bytes", ()))
        return cls(**d)

    def table(self) -> str:
        """One line per stage, for logs and the CLI."""
        lines = [f"stage plan ({self.method}, {self.schedule}, p={self.num_stages}, m={self.num_microbatches}): "
                 f"layers {list(self.layers_per_stage)}, predicted step {self.predicted_step_s * 1e3:.1f} ms "
                 f"({self.predicted_step_in_wait_s * 1e3:.1f} ms with recompute in the gradient wait)"]
        for s in self.stages:
            budget = f"{s.budget_bytes / 2**20:.1f} MiB" if s.budget_bytes is not None else "-"
            carry = (f" W-carry {s.carry_bytes / 2**20:.1f} MiB/mb x{s.pending_w} at peak"
                     if s.carry_bytes else "")
            lines.append(f"  stage {s.index}: blocks {s.blocks[0]}..{s.blocks[1] - 1} in-flight {s.in_flight}{carry} "
                         f"budget/mb {budget} peak {s.peak_bytes / 2**20:.1f} MiB compute "
                         f"{s.compute_s * 1e3:.2f} ms recompute {s.recompute_s * 1e3:.2f} ms"
                         f"{'' if s.fits else '  DOES NOT FIT'}")
        if len(self.rank_peak_bytes) < len(self.stages):  # several stages per rank
            bound = (" (fit test, every micro-batch in flight at its whole allowance: "
                     + ", ".join(f"{b / 2**20:.1f} MiB" for b in self.rank_bound_bytes) + ")"
                     if self.rank_bound_bytes else "")
            lines.append("  device peak per rank (its stages together): "
                         + ", ".join(f"{b / 2**20:.1f} MiB" for b in self.rank_peak_bytes) + bound)
        return "\n".join(lines)
