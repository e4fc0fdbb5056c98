"""The step's plan across pieces as the plan cache keeps it (``caches.plans``: ``step_key``,
``load_step``, ``store_step``): looked up at the end of step 1 (a script run before), stored
once the recorded step chose. An entry is a plan (one candidate per call, by its text, with the
numbers it was chosen by) or a refusal (the step's smallest budget, kept so that the same
command refused again names the same one, whatever the recorded step's measure would read in
that run: under gloo the memory outside the compiled pieces moves between runs)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from lynx_compile.decisions import CandidateKey
from lynx_compile.step.model import Assignment, StepChoice, StepModel

log = logging.getLogger("lynx_compile")


@dataclasses.dataclass(frozen=True)
class Refusal:
    predicted: int
    reference: int
    why: str


@dataclasses.dataclass(frozen=True)
class Kept:
    """A step plan from the cache: per graph (in the step's order) the candidates of its calls,
    and the numbers it was chosen by."""

    pick: dict[int, Assignment]
    predicted: int
    reference: int
    budget_bytes: int
    outside: int

    def model_and_choice(self, calls: list[Any]) -> tuple[StepModel, StepChoice]:
        """The step's model (no segments: nothing recorded) and its choice, for piece ``calls``."""
        by_key = {p.key: p for p in calls}
        model = StepModel(graphs={g: by_key[g].record.step for g in self.pick},
                          calls=tuple(p.key for p in calls), segments=())
        return model, StepChoice(pick=self.pick, predicted=self.predicted,
                                 exposed_s=model.exposed_s(self.pick), fits=True)


def key(calls: list[Any], config: Any) -> str | None:
    """The plan cache's key of this step's plan (``plan_cache.step_key``), from the piece
    ``calls`` of step 1; None when a piece has no plan-cache key or the cache is off."""
    keys = [p.record.stats.get("plan_cache_key") for p in calls]
    if not keys or not all(keys) or not config.plan_cache:
        return None
    from lynx_compile.caches import plans as plan_cache

    return plan_cache.step_key(keys, config.budget.given())


def refusal_of(entry: dict | None) -> Refusal | None:
    """The refusal an entry keeps; None for any other entry (a plan, nothing, or a malformed
    refusal, then recorded again)."""
    refused = (entry or {}).get("refused")
    try:
        return Refusal(int(refused["predicted"]), int(refused["reference"]), str(refused["why"])) if refused else None
    except (KeyError, TypeError, ValueError):
        return None


def lookup(step_key: str | None, calls: list[Any]) -> Kept | Refusal | None:
    """What the plan cache keeps under ``step_key`` for step 1's piece ``calls``: a plan (its
    candidates found among each piece's), a refusal, or None (nothing, or a plan that does not
    fit this step: said, then recorded again)."""
    from lynx_compile.caches import plans as plan_cache

    entry = plan_cache.load_step(step_key) if step_key else None
    if entry is None:
        return None
    refused = refusal_of(entry)
    if refused is not None:
        return refused
    try:
        graphs = list(dict.fromkeys(p.key for p in calls))
        by_key = {p.key: p for p in calls}
        pick = {g: tuple(by_key[g].record.step.named(CandidateKey.parse(n)) for n in names)
                for g, names in zip(graphs, entry["graphs"], strict=True)}
        return Kept(pick=pick, **{k: int(entry[k]) for k in ("predicted", "reference", "budget_bytes", "outside")})
    except (KeyError, TypeError, ValueError) as e:
        log.warning("lynx plan cache: the step plan %s does not fit this step (%s); the step is recorded "
                    "instead", step_key[:12], e)
        return None


def store(step_key: str | None, model: StepModel, choice: StepChoice, reference: int, budget_bytes: int,
          outside: list[int]) -> None:
    """Keep a fitting choice under ``step_key`` (nothing without a key)."""
    if not step_key or not choice.fits:
        return
    from lynx_compile.caches import plans as plan_cache

    order = list(dict.fromkeys(model.calls))
    plan_cache.store_step(step_key, {
        "graphs": [[str(c.name) for c in choice.pick[g]] for g in order],
        "predicted": choice.predicted, "reference": reference, "budget_bytes": budget_bytes,
        "outside": max(outside, default=0)})


def store_refusal(step_key: str | None, refusal: Refusal) -> None:
    """Keep the step's refusal under ``step_key`` (nothing without a key)."""
    if not step_key:
        return
    from lynx_compile.caches import plans as plan_cache

    plan_cache.store_step(step_key, {"refused": dataclasses.asdict(refusal)})
