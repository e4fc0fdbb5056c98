"""``RecomputePlan``: what one compiled graph saves and recomputes, as plain data.

Keyed by node *names*, frozen, JSON-serializable: the CLI prints it, tests compare it, plan
files store it. Built from the applied ``Decisions`` record (``lynx_compile.decisions``) and the
exact simulation of the graphs it produced.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lynx_compile.decisions import Decisions


@dataclass(frozen=True, kw_only=True)
class TensorDecision:
    """One forward value the plan saves or recomputes."""

    name: str
    block: int | None
    nbytes: int
    recompute_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class BlockSummary:
    """Per-block totals (bytes saved, nodes and seconds recomputed)."""

    block: int
    path: str
    saved_bytes: int
    saved: tuple[str, ...]
    recomputed: tuple[str, ...]
    recompute_s: float


@dataclass(frozen=True, kw_only=True)
class RecomputePlan:
    """The partition decision of one graph and its predicted memory and time."""

    policy: str
    graph_hash: str
    saved: tuple[TensorDecision, ...]
    recomputed: tuple[TensorDecision, ...]
    blocks: tuple[BlockSummary, ...] = ()
    saved_bytes: int = 0
    peak_bytes: int = 0
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0
    peak_at: str = ""
    recompute_s: float = 0.0
    reference_peak_bytes: int = 0
    budget_bytes: int | None = None
    budget_scope: str = "peak"
    """What ``budget_bytes`` bounds: ``"peak"`` (the step's peak; a graph holding the model's
    blocks), ``"saved"`` (the activations the graph saves for its backward; a graph that is one
    block or a piece of a model, planned provisionally, before a step has run) or ``"step"`` (the
    peak of the whole step, its compiled pieces planned together from a recorded step:
    ``lynx_compile.step.recorder``; ``step_peak_bytes`` is then the step's predicted peak)."""
    step_peak_bytes: int | None = None
    """Scope ``"step"``: the whole step's predicted peak with every piece as planned (measured
    outside the pieces, modelled inside them)."""
    step_reference_bytes: int | None = None
    """Scope ``"step"``: the same step with no piece recomputing anything (torch.compile's own
    step; a ``memory_budget`` fraction is of this)."""
    device_budget_bytes: int | None = None
    """``device_budget`` in bytes (everything on the device during the step); None without one.
    ``budget_bytes`` is then at most ``device_budget_bytes - resident_bytes``."""
    resident_bytes: int | None = None
    """With ``device_budget``: the bytes allocated when the step starts, read when lynx compiled
    this graph; ``resident_source`` says what they are and how they were read (CUDA's
    ``memory_allocated``, or the graph's inputs on CPU and for ``lynx plan``)."""
    resident_source: str = ""
    compiled_peak_bytes: int | None = None
    """``compiler="inductor"``: the step's activation peak as Inductor compiled it, from its own
    memory estimate of the fused schedules (``lynx_compile.compiler.inductor_partition.CompiledPeak``; not what the
    budget is checked on); None for the eager compiler, for ``lynx plan`` (nothing compiles),
    until the backward is compiled (at the first backward), and when Inductor's FX-graph cache
    served either graph (its scheduler did not run) unless the plan came from lynx's plan cache
    holding the estimate of an earlier compile (``lynx_compile.caches.plans``; set at the forward)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    decisions: Decisions = field(default_factory=lambda: Decisions(policy="none"))
    """Per unit (forward op): ``Keep()`` / ``Demand()`` / ``Window(collective)``, as the policy
    decided (every policy; for ``torch``, read back from its min-cut partition)."""
    solver: str = ""
    solver_status: str = ""
    exposed_s: float = 0.0
    """Predicted recompute time on the critical path (demand + window overflow)."""
    offload_bytes: int = 0
    """Bytes sent to host memory per step (policy lynx with ``offload=True``)."""
    offload_copy_s: float = 0.0
    """Their copy time one way on the host link, and the part of it not hidden by compute."""
    offload_exposed_s: float = 0.0
    plan_time_s: float = 0.0
    """Time spent extracting, solving and checking (0 when reused from a file or the cache)."""
    solve_s: float = 0.0
    """Time inside the solver(s) alone."""
    block_ops: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    """policy "lynx": per block path, its forward aten ops in order with each op's decision
    ("keep" / "demand" / "window:<collective>"); what ``lynx_compile.sac`` exports."""

    @property
    def peak_fraction(self) -> float:
        """Predicted peak as a fraction of the no-recompute peak."""
        return self.peak_bytes / self.reference_peak_bytes if self.reference_peak_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, decisions=Decisions(policy=self.policy)))
        out["decisions"] = self.decisions.to_dict()
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RecomputePlan":
        data = dict(data)
        data["saved"] = tuple(TensorDecision(**d) for d in data["saved"])
        data["recomputed"] = tuple(TensorDecision(**d) for d in data["recomputed"])
        data["blocks"] = tuple(
            BlockSummary(**{**b, "saved": tuple(b["saved"]), "recomputed": tuple(b["recomputed"])})
            for b in data.get("blocks", ()))
        data["notes"] = tuple(data.get("notes", ()))
        data["decisions"] = Decisions.from_dict(data["decisions"]) if data.get("decisions") else \
            Decisions(policy=data.get("policy", "none"))
        data["block_ops"] = {k: [tuple(x) for x in v] for k, v in data.get("block_ops", {}).items()}
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "RecomputePlan":
        return cls.from_dict(json.loads(text))
