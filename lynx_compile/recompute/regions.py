"""Budgets per region of the model (issue U item 2): a part of the forward with its own budget
for the activations it saves, next to the step's budget.

A region is annotated with torch's own per-region budget,
``torch.autograd.graph.region_activation_memory_budget(f)`` (torch 2.13), or with
``lynx_compile.region_budget(f, name=...)`` (any supported torch; it writes the same annotation,
and a name). Dynamo puts the annotation on every node traced under it (``meta["custom"]``);
this module reads it off the joint graph before any partitioner sees it::

    joint (custom[KEY] = f on the region's nodes)
      └─ read_regions ─▶ (Region(name, f, nodes), ...)   annotation removed from the joint: torch's
                                                         min-cut, which lynx calls, would apply it
                                                         graph-wide or reject a partial one
    extract_remat_problem ─▶ RegionCap(units, max_bytes = f × the region's no-recompute saved bytes)
    solvers (MILP row, HEU fit_regions) ─▶ plan within every region's cap
    saved_by_region(fw, bw) ─▶ what a realized plan saves per region (the check every candidate passes)

``f`` is a fraction of what the region saves for the backward with no recompute: 1 leaves it to
the step's budget, 0 recomputes everything the region can recompute (torch: 0 is the region
fully checkpointed, 1 its default). Consecutive forward ops with the same annotation are one
region; two ``with`` blocks with the same budget are two regions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.decisions import BudgetError
from lynx_compile.memory.simulate import backward_inputs
from lynx_compile.passes.find_blocks import module_paths

KEY = _compat.REGION_BUDGET_KEY
NAME_KEY = "lynx_region"


def region_budget(fraction: float, name: str | None = None):
    """Context manager: the forward code under it is a region with its own activation budget,
    ``fraction`` in [0, 1] of what it saves for the backward with no recompute (under
    ``torch.compile(..., backend="lynx")``). It writes torch's own annotation (what
    ``torch.autograd.graph.region_activation_memory_budget`` writes) and ``name``, which lynx's
    records and refusals use (default: the region's module path). No effect in eager mode.

    ::

        with lynx_compile.region_budget(0.25, name="attention"):
            y = self.attn(x)
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"lynx_compile.region_budget: fraction must be a number in [0, 1] (of what the region "
                         f"saves with no recompute), got {fraction!r}")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"lynx_compile.region_budget: name must be a string, got {name!r}")
    annotation = {KEY: float(fraction)}
    if name is not None:
        annotation[NAME_KEY] = name
    return _compat.annotate_region(annotation)


class RegionBudgetError(BudgetError):
    """A region's own budget cannot be met (the message names the region and the smallest
    budget it reaches); raised whatever the step's budget, and not retried with other plans."""


@dataclass(frozen=True)
class Region:
    """One annotated region: its name, budget fraction and forward node names (joint graph)."""

    name: str
    fraction: float
    nodes: frozenset[str]


def _annotation(node: fx.Node) -> tuple[float, str | None] | None:
    custom = node.meta.get("custom")
    if not isinstance(custom, dict) or KEY not in custom:
        return None
    return float(custom[KEY]), custom.get(NAME_KEY)


def _common_path(nodes: list[fx.Node]) -> str:
    paths = [module_paths(n)[-1] for n in nodes if module_paths(n)]
    if not paths:
        return ""
    parts = [p.split(".") for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def read_regions(joint: fx.GraphModule, forward_names: frozenset[str]) -> tuple[Region, ...]:
    """The annotated regions of ``joint``'s forward, in forward order, and the annotation taken
    off every node (forward and backward). Raises ValueError for a fraction outside [0, 1]."""
    runs: list[tuple[tuple[float, str | None], list[fx.Node]]] = []
    for node in joint.graph.nodes:
        if node.op != "call_function" or node.name not in forward_names:
            continue
        ann = _annotation(node)
        if ann is None:
            if runs and runs[-1][0] is not None:
                runs.append((None, []))
            continue
        if not 0.0 <= ann[0] <= 1.0:
            raise ValueError(f"region budget {ann[0]} on {node.name}: a region's budget is a fraction in [0, 1] "
                             "of what the region saves with no recompute")
        if not runs or runs[-1][0] != ann:
            runs.append((ann, []))
        runs[-1][1].append(node)
    for node in joint.graph.nodes:
        custom = node.meta.get("custom")
        if isinstance(custom, dict) and KEY in custom:
            node.meta["custom"] = {k: v for k, v in custom.items() if k not in (KEY, NAME_KEY)}
    regions, seen = [], {}
    for ann, nodes in runs:
        if ann is None or not nodes:
            continue
        name = ann[1] or _common_path(nodes) or f"region {len(regions)}"
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name} #{seen[name]}"
        regions.append(Region(name=name, fraction=ann[0], nodes=frozenset(n.name for n in nodes)))
    return tuple(regions)


def saved_by_region(fw: fx.GraphModule, bw: fx.GraphModule, regions: tuple[Region, ...]) -> tuple[int, ...]:
    """Bytes the forward ``fw`` saves for ``bw`` whose storage a node of each region produced
    (views of one storage once; a multi-output op's outputs each)."""
    _, live = backward_inputs(fw, bw)
    out = [0] * len(regions)
    for key, nbytes in live.items():
        if key.startswith("bw:"):
            continue
        producer = key.split("[", 1)[0]
        for r, region in enumerate(regions):
            if producer in region.nodes:
                out[r] += nbytes
    return tuple(out)


@dataclass(frozen=True)
class RegionCheck:
    """A realized plan's bytes saved per region against each region's cap."""

    regions: tuple[Region, ...]
    reference: tuple[int, ...]
    """What each region saves with no recompute (the untagged partition)."""

    def caps(self) -> tuple[int, ...]:
        return tuple(int(r.fraction * ref) for r, ref in zip(self.regions, self.reference))

    def over(self, fw: fx.GraphModule, bw: fx.GraphModule,
             saved: tuple[int, ...] | None = None) -> dict[str, tuple[int, int]]:
        """Region name → (saved, cap) for each region the plan saves more of than its cap
        (``saved``: ``saved_by_region`` of the plan, when already taken)."""
        saved = saved_by_region(fw, bw, self.regions) if saved is None else saved
        return {r.name: (s, c) for r, s, c in zip(self.regions, saved, self.caps()) if s > c and r.fraction < 1.0}

    def report(self, fw: fx.GraphModule, bw: fx.GraphModule) -> tuple[list[dict], dict[str, tuple[int, int]]]:
        """What the plan record says of each region (the user's decision, and what the plan
        saves), and :meth:`over` of the same plan."""
        saved = saved_by_region(fw, bw, self.regions)
        rows = [{"name": r.name, "budget": r.fraction, "reference_bytes": ref, "max_bytes": cap, "saved_bytes": s}
                for r, ref, cap, s in zip(self.regions, self.reference, self.caps(), saved)]
        return rows, self.over(fw, bw, saved)


def bind(regions: tuple[Region, ...], fw_ref: fx.GraphModule, bw_ref: fx.GraphModule) -> RegionCheck | None:
    """The check of ``regions`` against the no-recompute partition (``fw_ref``, ``bw_ref``)."""
    if not regions:
        return None
    return RegionCheck(regions=regions, reference=saved_by_region(fw_ref, bw_ref, regions))


def tightened(problem, check: RegionCheck, over: dict[str, tuple[int, int]], kept: frozenset[int]):
    """``problem`` with the caps of the regions in ``over`` lowered so that the next plan fits
    what the partition saves: the realized plan saved ``hidden`` bytes in the region beyond the
    units the optimizer kept (``kept``: unit ids), e.g. a tensor read across the region's edge
    that the partition saves whatever is recomputed, so the units get the region's bytes less
    those. Raises ``RegionBudgetError`` when that leaves less than the units must keep."""
    from lynx_compile.solver.problem import region_must_bytes

    by_id = {u.id: u.nbytes for u in problem.units}
    reference = {r.name: ref for r, ref in zip(check.regions, check.reference)}
    caps, refused = [], {}
    for cap in problem.region_caps:
        if cap.name not in over:
            caps.append(cap)
            continue
        saved, most = over[cap.name]
        hidden = max(0, saved - sum(by_id[u] for u in cap.units if u in kept))
        must = region_must_bytes(problem, cap)
        left = min(most - hidden, cap.max_bytes - (saved - most))
        if left < must:
            refused[cap.name] = (hidden + must, reference[cap.name])
            continue
        caps.append(dataclasses.replace(cap, max_bytes=left))
    if refused:
        raise unreachable(check, refused)
    return dataclasses.replace(problem, region_caps=tuple(caps))


def problem_caps(check: RegionCheck | None, units) -> tuple:
    """``RegionCap``s of the optimizer's ``units`` (``remat.problem.Unit``): a unit is in a
    region when the node producing its storage is; the cap is the region's fraction of the bytes
    its units keep with no recompute (those the backward reads, and those always kept), in the
    model's own unit bytes."""
    from lynx_compile.solver.problem import RegionCap

    if check is None:
        return ()
    caps = []
    for region in check.regions:
        if region.fraction >= 1.0:
            continue  # 1: the region is left to the step's budget
        # a held unit (a block's input a recompute reads) is left to the check of the compiled
        # graphs: kept whenever a unit reading it is recomputed, in the model it could make a
        # region unreachable that the check then refuses naming the region's smallest budget
        mine = [u for u in units if u.name in region.nodes and u.recomputable]
        ref = sum(u.nbytes for u in mine if u.first_use is not None or u.must_keep)
        caps.append(RegionCap(name=region.name, units=tuple(u.id for u in mine), max_bytes=int(region.fraction * ref),
                              fraction=region.fraction, reference_bytes=ref))
    return tuple(caps)


def refusal(error) -> RegionBudgetError:
    """The ``RegionBudgetError`` of a ``remat.problem.InfeasibleRegion``."""
    return RegionBudgetError(f"lynx: {error}", why=str(error))


def unreachable(check: RegionCheck, least: dict[str, tuple[int, int]]) -> RegionBudgetError:
    """The refusal of region budgets below what the partition keeps saved in them: ``least`` maps
    a region's name to (the fewest bytes it saves, what it saves with no recompute); the smallest
    budget named is their ratio, rounded up."""
    from lynx_compile.solver.problem import smallest_fraction

    fraction = {r.name: r.fraction for r in check.regions}
    parts = []
    for name, (least_bytes, reference) in least.items():
        smallest = smallest_fraction(least_bytes, reference)
        parts.append(f"region {name!r}: budget {fraction[name]:g} ({int(fraction[name] * reference)} B of the "
                     f"{reference} B it saves with no recompute) is below the {least_bytes} B it keeps saved "
                     f"whatever lynx recomputes (tensors read across the region's edge, or never recomputed); "
                     f"use a region budget >= {smallest:.3f}")
    message = "; ".join(parts)
    return RegionBudgetError(f"lynx: {message}", why=message)
