"""The record the cost model attaches to every node.

``NodeCost`` is what ``annotate_costs_pass`` stores under ``node.meta[COST]``: plain numbers, so a
plan that copies costs out of a graph stays picklable and JSON-serializable. The size helpers
it is built on are ``lynx_compile.graph.values``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

#: Where a ``NodeCost.runtime_s`` came from.
CostSource = Literal["analytic", "measured", "zero"]
COST_SOURCES: frozenset[str] = frozenset({"analytic", "measured", "zero"})


@dataclass(frozen=True)
class NodeCost:
    """Cost of executing one FX node once.

    Contract: all fields are non-negative; ``source == "zero"`` means the node does no work
    (placeholder, output, getitem, view, wait) and then ``runtime_s == 0``.
    """

    runtime_s: float
    """Seconds to run the node (roofline estimate, measurement, or communication time)."""
    out_bytes: int
    """Bytes of new storage the node allocates (0 for views, aliases and in-place ops)."""
    flops: float
    """Floating point operations (torch's flop_counter formulas, else ~1 per element)."""
    bytes_moved: int
    """Bytes read plus bytes written (for collectives: the payload sent over the link)."""
    source: str
    """``"analytic"``, ``"measured"`` or ``"zero"``."""

    def __post_init__(self) -> None:
        if self.source not in COST_SOURCES:
            raise ValueError(f"NodeCost.source must be one of {sorted(COST_SOURCES)}, got {self.source!r}")

    @classmethod
    def zero(cls) -> NodeCost:
        """The cost of a node that does no work."""
        return cls(runtime_s=0.0, out_bytes=0, flops=0.0, bytes_moved=0, source="zero")

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-serializable)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeCost:
        """Inverse of :meth:`to_dict`; ignores unknown keys so old records still load."""
        return cls(
            runtime_s=float(d["runtime_s"]),
            out_bytes=int(d["out_bytes"]),
            flops=float(d["flops"]),
            bytes_moved=int(d["bytes_moved"]),
            source=str(d["source"]),
        )
