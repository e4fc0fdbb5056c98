"""``Decisions``: the one record every recompute policy produces and the apply path reads.

Every policy answers the same question per *unit* (a forward op, with the views, getitems and
fused pointwise ops that live and die with it): keep its output saved, recompute it on demand
before its first backward use, recompute it inside a backward collective's window, or save it
in host memory between the forward and the backward (offload, ``LynxConfig.offload``)::

    policy none / full / selective ─┐
    policy lynx (solver, seeds) ────┼─▶ Decisions ─apply_decisions_pass─▶ tagged joint ─▶ partition
    policy torch (min-cut) ─────────┘   (read back from the partition torch's min-cut chose)

Plain data: frozen, hashable, JSON round-trips (plan files, the plan cache, the cross-rank
agreement check). No torch import. A window is the typed value ``Window(collective=<name>)``
naming the backward collective whose issue → wait it hides in, never a string to split.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Union


class BudgetError(ValueError):
    """The memory budget is below what the chosen policy (or any policy) reaches. Raised through
    ``lynx_compile.budget.budget_error``: ``smallest_bytes`` is the smallest peak known to be
    reachable (None when not known), ``why`` the reason without the budget and the fix."""

    def __init__(self, message: str, *, smallest_bytes: int | None = None, why: str = ""):
        super().__init__(message)
        self.smallest_bytes = smallest_bytes
        self.why = why or message


CANDIDATE_POLICIES = ("none", "full", "selective", "user", "torch", "lynx", "plan")
"""What a candidate compile of a graph can be: the baselines, the user's own checkpoint tags
(``user``), torch's min-cut (``torch``), lynx's optimizer (``lynx``) and a whole graph's plan
held within the step's plan (``plan``)."""


@dataclass(frozen=True, eq=False)
class CandidateKey:
    """Which compile of a graph a candidate is: the key by which the step's plan across pieces,
    the caches and the plan's notes name it.

    ``setting``: torch's ``activation_memory_budget`` (policy ``torch``, required). ``nbytes``:
    the peak a ``lynx`` or ``plan`` candidate was planned within (None: at the graph's own
    budget). ``smallest``: lynx's optimizer at its own smallest peak. ``str(key)`` is its text in
    logs, JSON and cache entries (``torch@0.25``, ``plan@1048576``, ``lynx@smallest``), which
    :meth:`parse` reads back. Comparing a key with a string raises ``TypeError``: text is for
    people and files, code compares keys."""

    policy: str
    setting: float | None = None
    nbytes: int | None = None
    smallest: bool = False

    def __post_init__(self) -> None:
        if self.policy not in CANDIDATE_POLICIES:
            raise ValueError(f"candidate policy {self.policy!r} is not one of {CANDIDATE_POLICIES}")
        if (self.setting is not None) != (self.policy == "torch"):
            raise ValueError(f"a 'torch' candidate, and only it, has a setting (got {self.policy!r}, {self.setting!r})")
        if self.nbytes is not None and (self.policy not in ("lynx", "plan") or self.nbytes <= 0):
            raise ValueError(f"only 'lynx' and 'plan' candidates hold a positive peak (got {self.policy!r}, {self.nbytes!r})")
        if self.smallest and (self.policy != "lynx" or self.nbytes is not None):
            raise ValueError("only a 'lynx' candidate with no peak given plans at its smallest peak")

    @property
    def plan_within(self) -> int | None:
        """The peak a whole graph's plan is held within (a ``plan`` key with a peak: what the
        step's plan or a step hint gave it), else None."""
        return self.nbytes if self.policy == "plan" else None

    def _fields(self) -> tuple:
        return self.policy, self.setting, self.nbytes, self.smallest

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CandidateKey):
            return self._fields() == other._fields()
        if isinstance(other, str):
            raise TypeError(f"candidate key {self} compared with the string {other!r}: compare CandidateKeys")
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._fields())

    def __str__(self) -> str:
        if self.setting is not None:
            return f"torch@{self.setting:g}"
        if self.smallest:
            return "lynx@smallest"
        return self.policy if self.nbytes is None else f"{self.policy}@{self.nbytes}"

    @classmethod
    def parse(cls, text: str) -> "CandidateKey":
        """The key ``str(key)`` wrote; ``ValueError`` for any other text."""
        policy, at, arg = str(text).partition("@")
        try:
            if not at:
                return cls(policy)
            if policy == "torch":
                return cls(policy, setting=float(arg))
            if policy == "lynx" and arg == "smallest":
                return cls(policy, smallest=True)
            return cls(policy, nbytes=int(arg))
        except ValueError as e:
            raise ValueError(f"not a candidate key: {text!r} ({e})") from None


@dataclass(frozen=True)
class Keep:
    """The unit's output is saved by the forward for the backward."""

    def __str__(self) -> str:
        return "keep"


@dataclass(frozen=True)
class Demand:
    """Recomputed in the backward right before its first use."""

    def __str__(self) -> str:
        return "demand"


@dataclass(frozen=True)
class Window:
    """Recomputed right after ``collective`` (a backward collective's node name) is issued, so
    it runs while that collective is in flight, before its wait."""

    collective: str

    def __str__(self) -> str:
        return f"window:{self.collective}"


@dataclass(frozen=True)
class Offload:
    """Saved for the backward, but in host memory in between: copied device to host right after
    its producer in the forward, host to device before its first backward use
    (``passes/offload.py``; ops ``torch.ops.lynx.offload`` / ``lynx.reload``)."""

    def __str__(self) -> str:
        return "offload"


Decision = Union[Keep, Demand, Window, Offload]
KEEP, DEMAND, OFFLOAD = Keep(), Demand(), Offload()
KINDS = ("keep", "demand", "window", "offload")


def _decision_to_json(d: Decision) -> Any:
    return {"window": d.collective} if isinstance(d, Window) else str(d)


def _decision_from_json(x: Any) -> Decision:
    if x == "keep":
        return KEEP
    if x == "demand":
        return DEMAND
    if x == "offload":
        return OFFLOAD
    if isinstance(x, dict) and set(x) == {"window"} and isinstance(x["window"], str):
        return Window(x["window"])
    raise ValueError(f"not a lynx decision: {x!r} (expected 'keep', 'demand', 'offload' or "
                     "{'window': '<collective node name>'}; plans written by lynx before the typed "
                     "decision record used 'window:<index>': re-plan them)")


@dataclass(frozen=True, kw_only=True)
class Decisions:
    """Per unit (by the name of its op in the joint graph): its ``Decision``.

    ``members`` lists, for units that cover more than their own op, every joint node the unit
    covers (tagged with it). Units not listed are kept."""

    policy: str
    """Which policy decided: "none", "full", "selective", "user", "torch" or "torch@<setting>",
    "lynx", "lynx@smallest" (a candidate's, its key's text: ``str(CandidateKey)``)."""
    units: tuple[tuple[str, Decision], ...] = ()
    members: tuple[tuple[str, tuple[str, ...]], ...] = ()
    source: str = ""
    """Where a lynx plan came from: "solver", "cache", "file", "no budget", "seed"."""
    _by_name: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", dict(self.units))

    @classmethod
    def make(cls, policy: str, units: dict[str, Decision], members: dict[str, tuple[str, ...]] | None = None,
             source: str = "") -> "Decisions":
        """From plain dicts; units in a canonical (sorted) order so equal plans compare equal."""
        members = {k: tuple(v) for k, v in (members or {}).items() if tuple(v) != (k,)}
        return cls(policy=policy, units=tuple(sorted(units.items())), members=tuple(sorted(members.items())),
                   source=source)

    def __getitem__(self, name: str) -> Decision:
        return self._by_name.get(name, KEEP)

    def __iter__(self) -> Iterator[tuple[str, Decision]]:
        return iter(self.units)

    def __len__(self) -> int:
        return len(self.units)

    def recomputed(self) -> Iterator[tuple[str, Decision]]:
        """(unit, decision) for every unit recomputed, on demand or in a window."""
        return ((n, d) for n, d in self.units if isinstance(d, (Demand, Window)))

    def offloaded(self) -> Iterator[str]:
        """Every unit decided ``Offload()``."""
        return (n for n, d in self.units if isinstance(d, Offload))

    def nodes_of(self, unit: str) -> tuple[str, ...]:
        """The joint nodes a unit covers (itself unless ``members`` says more)."""
        return dict(self.members).get(unit, (unit,))

    def counts(self) -> dict[str, int]:
        """Units per kind: {"keep": k, "demand": d, "window": w, "offload": o}."""
        out = dict.fromkeys(KINDS, 0)
        for _, d in self.units:
            out[str(d).split(":")[0]] += 1
        return out

    def with_source(self, source: str) -> "Decisions":
        return Decisions(policy=self.policy, units=self.units, members=self.members, source=source)

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "source": self.source,
                "units": {n: _decision_to_json(d) for n, d in self.units},
                "members": {n: list(m) for n, m in self.members}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Decisions":
        if not isinstance(data, dict) or "units" not in data:
            raise ValueError("not a lynx decision record (expected an object with 'policy' and 'units')")
        return cls.make(data.get("policy", "lynx"), {n: _decision_from_json(d) for n, d in data["units"].items()},
                        {n: tuple(m) for n, m in data.get("members", {}).items()}, data.get("source", ""))


NO_DECISIONS = Decisions(policy="none")
