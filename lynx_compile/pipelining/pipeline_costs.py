"""What the stage planner prices, as plain data: :class:`PipelineCosts` (JSON round-trips).

One :class:`SegmentCost` per block and for the work before and after the blocks, each for one
micro-batch: forward / backward seconds, parameter and activation bytes, the block's
:class:`~lynx_compile.pipelining.recompute_curve.RecomputeCurve`, and the bytes a zero-bubble
schedule carries from B to W. ``profile.profile_pipeline`` measures them on a model;
``sim.scale`` and the benchmarks build them by hand.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .recompute_curve import RecomputeCurve


@dataclass(frozen=True, kw_only=True)
class SegmentCost:
    """One block (or the pre-/post-block work) for one micro-batch."""

    name: str
    """Module path (``blocks.3``), or ``<pre>`` / ``<post>``."""
    forward_s: float
    backward_s: float
    param_bytes: int = 0
    activation_bytes: int = 0
    """Bytes kept with no recompute (pre/post: always kept)."""
    curve: RecomputeCurve | None = None
    """None: nothing to recompute (keeps ``activation_bytes``)."""
    output_bytes: int = 0
    """Bytes of the tensor it hands to the next segment (what a stage boundary sends)."""
    weight_backward_s: float | None = None
    """The part of ``backward_s`` that computes weight gradients (W under the zero-bubble
    schedules); None: not known, ``step_time`` takes ``WEIGHT_SHARE`` of it."""
    carry_bytes: int = 0
    """Bytes one micro-batch holds from its B to its W under the zero-bubble schedules, in a stage
    whose input has a gradient (every stage but the first): what the segment's W reads (saved
    tensors, output gradients B computed) and a plain backward would have freed, parameters not
    counted. Exact for the traced backward, which recomputes nothing (``weight_split_census``).
    Not used for the first stage, whose B has no input gradient to compute: its W runs the whole
    backward, so it carries all the stage keeps plus its output gradient (``StagePricer.carry``)."""
    carry_saved_bytes: int = 0
    """The part of ``carry_bytes`` that is saved forward tensors (a linear layer's input): the
    micro-batch holds them from its F anyway, so its B adds only the rest (``StagePricer.fresh``)."""


@dataclass(frozen=True, kw_only=True)
class PipelineCosts:
    """Everything ``plan_stages`` needs, as plain data (JSON round-trips)."""

    blocks: tuple[SegmentCost, ...]
    pre: SegmentCost = SegmentCost(name="<pre>", forward_s=0.0, backward_s=0.0)
    post: SegmentCost = SegmentCost(name="<post>", forward_s=0.0, backward_s=0.0)
    working_bytes: int = 0
    """Transient bytes of one micro-batch's fw+bw beyond what its blocks keep."""
    state_bytes_per_param_byte: float = 4.0
    """Static bytes per parameter byte: weights + gradients + two Adam moments = 4."""
    p2p_bytes_per_s: float = float("inf")
    p2p_latency_s: float = 0.0
    microbatch_size: int = 1
    pinned_cuts: tuple[int, ...] = ()
    """Blocks where the user requires a stage to begin (``pipe_split()`` markers in the model)."""
    weight_split: bool = True
    """Whether the stages split each backward into B and W under the zero-bubble schedules
    (lynx's split, ``compiler="eager"``); False (Inductor): B runs the whole backward, W is a
    no-op, nothing is carried."""

    def p2p_s(self, nbytes: int) -> float:
        return self.p2p_latency_s + (nbytes / self.p2p_bytes_per_s if nbytes else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PipelineCosts":
        def seg(s):
            c = s.get("curve")
            curve = RecomputeCurve(kept_bytes=tuple(c["kept_bytes"]), exposed_s=tuple(c["exposed_s"]),
                                   exposed_w_s=tuple(c.get("exposed_w_s", ()))) if c else None
            return SegmentCost(**{**s, "curve": curve})
        d = dict(d)
        d["blocks"] = tuple(seg(b) for b in d["blocks"])
        d["pre"], d["post"] = seg(d["pre"]), seg(d["post"])
        d["pinned_cuts"] = tuple(d.get("pinned_cuts", ()))
        return cls(**d)
