"""The persistent plan cache: policy lynx's winning plan for a graph, kept on disk per machine.

::

    key fields (graph, options, budget, world, versions, costs) ─sha256─▶ key
    <torch.compile cache dir>/lynx/plans/<key>.json  ◀─ store (after a plan is made)
                                                     ─▶ load (a later compile, any process)

What is kept is what planning produced and the plan reports: the winning ``Decisions`` (of the
optimizer or of a seed), the solver and status that made it, its exposed recompute, the
candidates compared and the notes written while planning (``CachedPlan``), and Inductor's
estimate of the compiled step's peak once a compile has read it (``keep_compiled_peak``;
restored with a hit, ``restore_compiled_peak``: Inductor's FX-graph cache then serves the
compiled graphs and skips the scheduler it is read from). A hit skips the solve and the
seeding; the caller applies the cached decisions once and checks the budget on the exact
simulation again (``optimize.with_plan_cache``).

The key is the sha256 of a canonical JSON (``key_fields``): everything the plan depends on —
the joint graph after the joint passes (its structural hash, and a digest of its wiring and of
every node's cost, which covers the hardware profile, the link and measured costs), every
option of ``LynxConfig`` but those in ``NOT_IN_KEY``, the no-recompute reference peak and the
budget in bytes, the planning world size, torch's version, lynx's version and a digest of its
source (a changed planner never reuses an older plan), and the hardware profile's numbers (the
calibrated CPU profile's contents on a CPU). Rank indices are left out on purpose: plans are
the same on every rank (issue M), so ranks share entries.

Under ``TORCHINDUCTOR_CACHE_DIR`` like torch's own caches (``torch._inductor.utils.fresh_cache()``
gives a fresh one), or in ``$LYNX_PLAN_CACHE_DIR`` where that is set (:func:`plans_dir`). Writes are atomic (a temporary file, then ``os.replace``): a process
reading meanwhile sees the old entry or the new one, never a part; ranks writing the same
entry at once leave one whole. An entry that cannot be read, is not JSON, has another
``SCHEMA`` or does not parse is ignored with a warning and replaced by the next plan. Cleared
by ``lynx cache clear`` (``clear``); ``plan_cache=False`` turns the cache off. No torch.fx here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lynx_compile.decisions import Decisions
from lynx_compile.caches.source_digest import lynx_source_digest

log = logging.getLogger("lynx_compile")

SCHEMA = 1
"""Version of an entry's layout; an entry of another version is stale (ignored, replaced)."""

NOT_IN_KEY = frozenset({"plan_cache", "plan", "check_plan_agreement", "dump_dir", "verbose"})
"""``LynxConfig`` fields that do not change the plan: the cache switch itself, ``plan`` (a plan
file bypasses the cache), the cross-rank check (it compares plans, never changes one), graph
dumps and logging. Every other field is in the key, so an option added later is in it too."""


@dataclass(frozen=True, kw_only=True)
class CachedPlan:
    """One entry: what planning a graph produced, and what the plan reports of it."""

    decisions: Decisions
    """The winning decisions (the optimizer's, or a baseline's that won as a seed)."""
    solver: str = ""
    status: str = ""
    exposed_s: float = 0.0
    solve_s: float = 0.0
    plan_time_s: float = 0.0
    """Seconds the plan took when it was made (a hit reports its own, shorter, time)."""
    candidates: dict = field(default_factory=dict)
    """``record.stats["candidates"]``: each candidate's exposed seconds and peak."""
    notes: tuple[str, ...] = ()
    """Notes planning wrote into the record (the seed that won and why, solver notes)."""
    torch_budget: float | None = None
    """Where a torch min-cut seed won: the setting it was partitioned at (a hit partitions at it
    again; its decisions are a reading of that partition)."""
    compiled_peak_bytes: int | None = None
    """Inductor's estimate of the compiled step's peak, where it was read (None otherwise)."""
    step: dict | None = None
    """A piece of a model compiled in pieces (``decide.decide_piece``): its candidates for the
    step's plan across pieces (``step.model.GraphChoices.to_dict``), ``current`` the one chosen."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(dataclasses.replace(self, decisions=Decisions(policy="none")))
        out["decisions"] = self.decisions.to_dict()
        out["notes"] = list(self.notes)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CachedPlan":
        """Raises ``ValueError`` / ``TypeError`` on anything but a well-formed entry body."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or not set(data) <= names or "decisions" not in data:
            raise ValueError(f"expected an object with the fields {sorted(names)}")
        data = dict(data)
        data["decisions"] = Decisions.from_dict(data["decisions"])
        data["notes"] = tuple(str(n) for n in data.get("notes", ()))
        for name in ("exposed_s", "solve_s", "plan_time_s"):
            data[name] = float(data.get(name, 0.0))
        if not isinstance(data.get("candidates", {}), dict):
            raise ValueError("'candidates' is not an object")
        if data.get("torch_budget") is not None:
            data["torch_budget"] = float(data["torch_budget"])
        if data.get("step") is not None and not isinstance(data["step"], dict):
            raise ValueError("'step' is not an object")
        peak = data.get("compiled_peak_bytes")
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, int)):
            raise ValueError("'compiled_peak_bytes' is not an int")
        return cls(**data)


PLANS_DIR_ENV = "LYNX_PLAN_CACHE_DIR"


def plans_dir() -> Path:
    """``$LYNX_PLAN_CACHE_DIR`` where set (plans kept apart from torch's compiled code: a shared
    directory for many jobs, or a fresh one beside a warm Inductor cache), else ``lynx/plans``
    under torch.compile's cache directory (``TORCHINDUCTOR_CACHE_DIR``)."""
    from lynx_compile import _compat

    env = os.environ.get(PLANS_DIR_ENV)
    return Path(env).expanduser() if env else Path(_compat.inductor_cache_dir()) / "lynx" / "plans"


def key_fields(config: Any, *, graph_hash: str, graph_digest: str, reference_peak: int, budget: int,
               world_size: int, profile: dict) -> dict[str, Any]:
    """The canonical inputs of the key (see the module docstring). ``graph_digest``: the
    joint's wiring and node costs (``optimize.graph_digest``); ``profile``: the hardware
    profile's numbers (``HardwareProfile.to_dict()``)."""
    import torch

    from lynx_compile._version import __version__

    return {"schema": SCHEMA, "graph_hash": graph_hash, "graph_digest": graph_digest,
            "options": planning_options(config),
            "reference_peak_bytes": int(reference_peak), "budget_bytes": int(budget),
            "world_size": int(world_size), "torch": torch.__version__,
            "lynx": {"version": __version__, "source": lynx_source_digest()}, "profile": profile}


def planning_options(config: Any) -> dict[str, Any]:
    """Every ``LynxConfig`` field that can change a plan (all but ``NOT_IN_KEY``)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in NOT_IN_KEY}


def plan_key(fields: dict[str, Any]) -> str:
    """sha256 (hex) of ``fields`` as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def entry_path(key: str) -> Path:
    return plans_dir() / f"{key}.json"


def load(key: str) -> CachedPlan | None:
    """The entry stored under ``key``; None when there is none, or (with a warning) when it
    cannot be read, is not JSON, is of another ``SCHEMA``, belongs to another key or does not
    parse: such an entry is never trusted, and the next ``store`` replaces it."""
    path = entry_path(key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        return _ignored(path, f"unreadable ({type(e).__name__}: {e})")
    try:
        data = json.loads(text)
    except ValueError as e:
        return _ignored(path, f"not JSON ({e})")
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else None
        return _ignored(path, f"stale (schema {found!r}, this lynx writes {SCHEMA})")
    if data.get("key") != key:
        return _ignored(path, "written for another key")
    try:
        return CachedPlan.from_dict(data.get("plan"))
    except (ValueError, TypeError, KeyError) as e:
        return _ignored(path, f"malformed ({e})")


def _ignored(path: Path, why: str) -> None:
    log.warning("lynx plan cache: ignoring %s: %s; re-planning (the new plan replaces it)", path, why)
    return None


def store(key: str, entry: CachedPlan, fields: dict[str, Any] | None = None) -> Path | None:
    """Write ``entry`` under ``key`` atomically; ``fields`` (the key's inputs) are kept beside
    it for inspection. Returns the path, or None (with a warning) when it cannot be written:
    the plan is still used, only not kept."""
    return _write(entry_path(key), {"schema": SCHEMA, "key": key, "plan": entry.to_dict(), "key_fields": fields})


def step_key(piece_keys: list[str], budget: str) -> str:
    """The key of a step's plan across pieces: the plan keys of its piece calls in call order
    (each holds the graph, options, versions and costs) and the budget as given."""
    return plan_key({"schema": SCHEMA, "step": list(piece_keys), "budget": budget})


def load_step(key: str) -> dict | None:
    """The step plan stored under ``key`` (``store_step``), or None; an unreadable or malformed
    one is ignored with a warning, as a plan is."""
    return _load_body(key, "step", "a step plan")


def store_step(key: str, step: dict) -> Path | None:
    """Write a step plan (per graph of the step, its candidate per call, and the numbers its
    log line reports) atomically under ``key``."""
    return _write(entry_path(key), {"schema": SCHEMA, "key": key, "step": step})


def store_record(key: str, record: dict) -> Path | None:
    """Write a graph's record (``GraphRecord.to_dict``) atomically under ``key``: what a later
    process restores when torch's AOTAutograd cache serves the graph's compile and lynx's
    partitioner does not run (``lynx_compile.caches.autograd``)."""
    return _write(entry_path(key), {"schema": SCHEMA, "key": key, "record": record})


def load_record(key: str) -> dict | None:
    """The record stored under ``key`` (``store_record``), or None; an unreadable or malformed
    one is ignored with a warning, as a plan is."""
    return _load_body(key, "record", "a graph record")


def _load_body(key: str, name: str, what: str) -> dict | None:
    """The object ``name`` of the entry stored under ``key``, or None (with a warning when the
    entry cannot be read or is not ``what`` of this lynx)."""
    path = entry_path(key)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return _ignored(path, f"unreadable ({type(e).__name__}: {e})")
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("key") != key \
            or not isinstance(data.get(name), dict):
        return _ignored(path, f"not {what} of this lynx")
    return data[name]


def _write(path: Path, body: dict) -> Path | None:
    """``body`` as JSON at ``path``, atomically; None (with a warning) when it cannot be written."""
    key = path.stem
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:12]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1, sort_keys=True, default=repr)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("lynx plan cache: could not write %s: %s", path, e)
        return None
    return path


def restore_compiled_peak(record: Any) -> None:
    """On a hit, the compiled-peak estimate its entry holds goes on ``record.plan``: Inductor's
    FX-graph cache serves the graphs of a plan compiled before, and a hit there skips the
    scheduler, where ``inductor.CompiledPeak`` reads the estimate (a compile whose scheduler
    runs replaces it with its own)."""
    peak = record.stats.get("cached_compiled_peak_bytes")
    if peak is not None and record.plan is not None:
        record.plan = dataclasses.replace(record.plan, compiled_peak_bytes=peak)


def keep_compiled_peak(record: Any, peak: int) -> None:
    """Add Inductor's estimate ``peak`` to the entry of ``record``'s plan (found or stored under
    ``record.stats["plan_cache_key"]``), for later processes whose compile it serves."""
    key = record.stats.get("plan_cache_key")
    entry = load(key) if key else None
    if entry is None or entry.compiled_peak_bytes == peak:
        return
    try:
        fields = json.loads(entry_path(key).read_text()).get("key_fields")
    except (OSError, ValueError):
        fields = None
    store(key, dataclasses.replace(entry, compiled_peak_bytes=int(peak)), fields)


def clear() -> int:
    """Remove every entry (and any temporary file left by a killed writer); returns how many
    entries were removed."""
    root = plans_dir()
    if not root.is_dir():
        return 0
    removed = 0
    for path in root.iterdir():
        if path.suffix in (".json", ".tmp") and path.is_file():
            try:
                path.unlink()
                removed += path.suffix == ".json"
            except FileNotFoundError:  # another process removed or replaced it meanwhile
                pass
    return removed
