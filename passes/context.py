"""What every pass receives besides the graph: the config, and the record it writes into."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lynx_compile.decisions import CandidateKey
from lynx_compile.recompute_plan import RecomputePlan
from lynx_compile.step.model import GraphChoices

if TYPE_CHECKING:  # the config module checks pass names against this package
    from lynx_compile.budget import Budget
    from lynx_compile.config import LynxConfig

    from .user_tags import UserTags


@dataclass(kw_only=True)
class PassTiming:
    name: str
    stage: str
    seconds: float
    skipped: bool = False


@dataclass(kw_only=True)
class GraphRecord:
    """What lynx decided for one compiled graph, and why. One per dynamo subgraph.

    Filled in by the passes and the partitioner; printed by ``lynx plan`` and kept on the
    backend (``backend.records``) so users can inspect it after compiling."""

    graph_id: int
    policy: str
    blocks: list[str] = field(default_factory=list)
    block_hashes: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    """What the passes and the planner counted and read: the costs' source and hardware, the
    candidates weighed, the plan cache's answer, offload and window counts (the decisions
    themselves are ``plan.decisions``)."""
    plan: Any = None  # lynx_compile.recompute_plan.RecomputePlan once partitioned
    reference_peak_bytes: int | None = None  # no-recompute peak (the budget's 100%)
    timings: list[PassTiming] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    saved_names: tuple[str, ...] = ()
    """Backward inputs produced by the forward (saved tensors), in the backward's order."""
    problem: Any = None
    """The ``RematProblem`` lynx solved (policy "lynx"); not serialized with the record."""
    unit_index: Any = None
    """Its ``UnitIndex`` (unit → joint nodes); not serialized either."""
    segment_costs: Any = None
    """Per block and outside blocks: forward / backward seconds (``lynx_compile.pipeline``)."""
    step: Any = None
    """Its candidates for the step's plan across graphs (``lynx_compile.step.model.GraphChoices``)."""
    takes_activations: bool = False
    """An input is an activation with gradients (not a parameter): the graph is a piece of a
    model compiled in pieces and is planned as one (``partition.lynx_partition``); set only
    where the backend plans pieces together (``step.recorder``)."""
    resident: tuple[int, str] | None = None
    """(bytes, what they are) allocated on the device as this graph's step starts (parameters,
    buffers, optimizer state, the batch: ``memory.resident``), read when it compiles, where
    ``device_budget`` is given: the budget of its plan is ``device_budget`` less these
    (:func:`graph_budget`)."""
    fsdp: tuple[int, int, int] | None = None
    """FSDP2's collectives around this graph's backward (``distributed.fsdp.FsdpComm``), when
    its parameters are ``fully_shard``-ed over several ranks."""
    step_choice: CandidateKey | None = None
    """The candidate the step's plan chose for this graph (``lynx_compile.step.recorder``): a
    compile with it set applies that candidate as is."""
    provisional: bool = False
    """A piece's first plan, made before any step was recorded, which the step's plan across
    graphs makes again (``step.recorder``): the candidate of least memory in a step of many calls
    (``step.model.provisional_order``), so that the steps before it hold the budget (slower,
    never above it)."""
    new_grad_bytes: int = 0
    """Bytes of the graph's parameters whose ``.grad`` was None when it compiled: the ``.grad``
    its backward leaves allocated (each call of a piece adds that much to what the step holds
    from then on). 0 where ``.grad`` was allocated (``zero_grad(set_to_none=False)``)."""
    torch_partition: bool = False
    """The partition compiled is of the kind torch.compile makes itself: the user's own
    checkpoint tags (``passes.user_tags``) or torch's min-cut at a budget for a graph planned on
    its own peak (a piece's min-cut candidates compile as lynx's placements: the step's plan
    weighs them by lynx's memory model of that compile). Inductor compiles it with its
    peak-memory reordering on, as torch.compile does (it holds less there), and without lynx's
    post-grad passes (``lynx_compile.compiler.inductor_partition``); buffer reuse stays off (``_compat``)."""
    keep_recompute_apart: bool = False
    """Of a ``torch_partition``: a min-cut candidate that policy lynx chose for a graph planned on
    its own peak. Compiled as torch.compile compiles it, but with no horizontal fusion of a
    recomputed kernel sharing under 1 MiB of reads (``_compat.refusing_recompute_fusion``), the
    fusion that put a block's recomputed norm at the backward's start above the simulated peak."""
    saved_symbols: tuple[str | None, ...] = ()
    """Per SymInt the forward saves for the backward (AOTAutograd's ``ctx.symints``, in order):
    the name of the unbacked symbol it is (``u0``: a data-dependent size, an MoE block's routed
    token count), else None. Read by ``step.sizes`` from the step's backward node."""
    unbacked_sizes: dict[str, int] | None = None
    """The values of the unbacked symbols that sized this graph's plan (``graph.values.sizes_seen``):
    those step 1 ran, the largest over calls and ranks (``step.sizes``); None where the plan
    sized them at ``graph.values.UNBACKED_SIZE_HINT`` (a first compile)."""
    grads_in_graph: Any = None
    """Where the parameter gradients go (``lynx_compile.memory.grad_in_graph.GradsInGraph``: added into
    ``.grad`` inside the backward, or returned at its end, and why), decided when the graph
    compiles; None before."""

    @property
    def reuse_headroom(self) -> int:
        """Bytes Inductor's buffer reuse may hold above the plan's predicted peak
        (``compiler.inductor_partition.BufferReuse``): the budget's bytes above it, for a graph
        planned on its own peak (the budget bounds the step it is); 0 elsewhere (a piece, whose
        budget is of the step's plan across pieces; no budget): there only a buffer freed just
        before its reuse is reused."""
        plan = self.plan
        if plan is None or plan.budget_scope != "peak" or plan.budget_bytes is None or self.step_choice is not None:
            return 0
        return max(0, plan.budget_bytes - plan.peak_bytes)

    @property
    def compiled_peak_bound(self) -> int | None:
        """The most this graph's compiled code may peak at: the plan's predicted peak plus what
        Inductor's buffer reuse held (``stats["buffer_reuse"]``; its headroom where not reported,
        a compile served by a cache)."""
        if self.plan is None:
            return None
        reuse = self.stats.get("buffer_reuse")
        held = reuse["held_bytes"] if reuse else (0 if self.torch_partition else self.reuse_headroom)
        return self.plan.peak_bytes + held

    def to_dict(self) -> dict[str, Any]:
        problem, index, self.problem, self.unit_index = self.problem, self.unit_index, None, None
        try:
            out = dataclasses.asdict(self)
        finally:
            self.problem, self.unit_index = problem, index
        out["plan"] = self.plan.to_dict() if self.plan is not None else None
        out["step"] = self.step.to_dict() if self.step is not None else None
        out["step_choice"] = str(self.step_choice) if self.step_choice is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], **given: Any) -> "GraphRecord":
        """The record ``to_dict`` wrote (``problem`` and ``unit_index`` stay None); ``given``
        fields (e.g. this process's ``graph_id``) replace the written ones. Raises ``TypeError``
        / ``KeyError`` / ``ValueError`` on anything but ``to_dict``'s form."""
        names = {f.name for f in dataclasses.fields(cls)}
        if isinstance(data, dict) and "decisions" in data and "stats" not in data:
            data = {("stats" if k == "decisions" else k): v for k, v in data.items()}  # written before the rename
        if not isinstance(data, dict) or not set(data) <= names:
            raise ValueError(f"expected an object with the fields {sorted(names)}")
        data = {k: v for k, v in data.items() if k not in ("problem", "unit_index")}
        data["timings"] = [PassTiming(**t) for t in data.get("timings", ())]
        data["plan"] = RecomputePlan.from_dict(data["plan"]) if data.get("plan") else None
        data["step"] = GraphChoices.from_dict(data["step"]) if data.get("step") else None
        data["step_choice"] = CandidateKey.parse(data["step_choice"]) if data.get("step_choice") else None
        data["saved_names"] = tuple(data.get("saved_names", ()))
        data["saved_symbols"] = tuple(data.get("saved_symbols", ()))
        data["fsdp"] = tuple(data["fsdp"]) if data.get("fsdp") else None
        data["resident"] = tuple(data["resident"]) if data.get("resident") else None
        seg = data.get("segment_costs")
        if isinstance(seg, dict) and isinstance(seg.get("blocks"), dict):  # JSON made the block indices text
            data["segment_costs"] = {**seg, "blocks": {int(k): v for k, v in seg["blocks"].items()}}
        return cls(**{**data, **given})


@dataclass(kw_only=True)
class PassContext:
    """Per-graph state shared by passes. Passes read ``config`` and ``num_fwd_outputs`` and
    write only into ``record`` and ``node.meta`` (keys from ``passes/meta.py``)."""

    config: LynxConfig
    record: GraphRecord
    num_fwd_outputs: int
    joint_inputs: Any = None
    forward_names: frozenset[str] = frozenset()
    decisions: Any = None
    """The ``lynx_compile.decisions.Decisions`` being applied (read by ``apply_decisions_pass``)."""
    untagged: "TakeOnce | None" = None
    """The untagged joint's (fw, bw), partitioned for the reference: the first to need that
    partition as is takes it (``decide._problem_base``); contexts copied from this one share it."""
    user_tags: "UserTags | None" = None
    """The user's checkpoint regions and SAC policies on the joint as traced (``user_tags.read``):
    ``apply_decisions_pass`` keeps their MUST_SAVE values saved under any decision."""
    region_check: Any = None
    """Regions of the model with their own budget (``lynx_compile.recompute.regions.RegionCheck``,
    bound to the no-recompute partition); None: none annotated, or a policy other than lynx."""

    @property
    def budget(self) -> "Budget | None":
        """This graph's budget: :func:`graph_budget`."""
        return graph_budget(self.config, self.record)


def graph_budget(config: "LynxConfig", record: GraphRecord) -> "Budget | None":
    """The budget the options give (``config.budget``) for the graph of ``record``: a device
    budget with the bytes resident as the graph's step starts (``record.resident``)."""
    budget = config.budget
    if budget is not None and record.resident is not None:  # (unchanged without a device budget)
        budget = budget.with_resident(*record.resident)
    return budget


class TakeOnce:
    """A value the first ``take()`` gets; later ones get None (graphs one user may change)."""

    def __init__(self, value: Any):
        self._value = value

    def take(self) -> Any:
        value, self._value = self._value, None
        return value
