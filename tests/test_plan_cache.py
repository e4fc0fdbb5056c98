"""The persistent plan cache (``lynx_compile.caches.plans``, used by ``optimize.with_plan_cache``).

A second compile in a fresh process hits and compiles the same plan as the miss (decisions,
predicted peak, what the plan reports, gradients); another budget, option or graph misses; an
entry that is corrupted, stale or does not apply is ignored with a warning and replaced;
``lynx cache clear`` empties the cache; two processes writing one entry at once leave a valid
one; under Inductor, its FX-graph cache serves a cached plan's graphs and the compiled-peak
estimate comes back from the entry. Every test has its own ``TORCHINDUCTOR_CACHE_DIR``.
gpt-tiny, mostly under the eager compiler, with a datasheet profile (h100-sxm): cheap, and no
CPU timing in the costs. Timings are never asserted.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from lynx_compile.caches import plans as plan_cache
from lynx_compile.config import make_config
from lynx_compile.decisions import DEMAND, Decisions
from lynx_compile.tools.cli import main

OPTIONS = dict(policy="lynx", compiler="eager", hardware="h100-sxm", check_plan_agreement=False)
BUDGET = 0.9
"""gpt-tiny (eager, dropout 0.1, batch 2) reaches it (and 0.75)."""


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "inductor_cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    monkeypatch.delenv(plan_cache.PLANS_DIR_ENV, raising=False)
    return path


def _gpt_tiny(device: str = "cpu", attn: str = "manual"):
    from lynx_compile.models import build_model, example_batch

    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.1, attn_impl=attn).to(device)
    return model, example_batch(model, 2, generator=torch.Generator().manual_seed(1)).to(device)


def _plan(variants: list[dict], model=None, x=None):
    """Records of each variant of gpt-tiny (one trace), planned only."""
    from lynx_compile.planning import plan_model_variants

    if model is None:
        model, x = _gpt_tiny()
    return [recs[0] for recs in plan_model_variants(model, (x,), variants, **OPTIONS)]


def _entries(cache_dir) -> list:
    d = cache_dir / "lynx" / "plans"
    return sorted(d.glob("*.json")) if d.is_dir() else []


# --- one compile and train step per process --------------------------------------------------

def _step(budget: float | None, compiler: str = "eager", policy: str = "lynx", device: str = "cpu") -> dict:
    """One compiled training step of gpt-tiny: the plan, the gradients, Inductor's FX-graph
    cache counters."""
    import lynx_compile
    from torch._dynamo.utils import counters

    model, x = _gpt_tiny(device, "sdpa" if device == "cuda" else "manual")
    budget_kw = {} if budget is None else {"memory_budget": budget}
    backend = lynx_compile.backend(**budget_kw, **{**OPTIONS, "compiler": compiler, "policy": policy})
    compiled = torch.compile(model, backend=backend)
    compiled(x).loss.backward()  # compiles (planning may draw random numbers or not)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # dropout draws the same numbers in every process
    compiled(x).loss.backward()
    record = backend.records[0]
    plan = record.plan
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).cpu()
    return {"units": plan.decisions.to_dict()["units"], "members": plan.decisions.to_dict()["members"],
            "source": plan.decisions.source, "peak_bytes": plan.peak_bytes, "saved_bytes": plan.saved_bytes,
            "solver": plan.solver, "status": plan.solver_status, "exposed_s": plan.exposed_s,
            "notes": list(plan.notes), "candidates": record.stats.get("candidates"),
            "cache": record.stats.get("plan_cache"), "grads": grads.tolist(),
            "compiled_peak": plan.compiled_peak_bytes, "served_by": record.stats.get("served_by"),
            "fx": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
            "aot": {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}}


def _step_in_subprocess(cache_dir, budget: float | None, compiler: str = "eager", env: dict | None = None,
                        policy: str = "lynx", device: str = "cpu") -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1", **(env or {})}
    out = subprocess.run([sys.executable, __file__, "step", str(budget), compiler, policy, device], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert policy != "lynx" or "lynx plan cache: " in out.stderr, "no hit / miss log line"
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


@pytest.mark.parametrize("budget", [BUDGET, 0.75])
def test_fresh_process_hits_and_compiles_the_same_plan(cache_dir, budget):
    miss = _step_in_subprocess(cache_dir, budget)
    assert miss["cache"] == "miss" and len(_entries(cache_dir)) == 1
    hit = _step_in_subprocess(cache_dir, budget)
    assert hit["cache"] == "hit" and hit["source"] == "cache"
    for field in ("units", "members", "peak_bytes", "saved_bytes", "solver", "status", "exposed_s",
                  "notes", "candidates"):
        assert hit[field] == miss[field], field
    assert hit["grads"] == miss["grads"]  # bit-identical: the same graphs ran


@pytest.fixture(scope="module")
def inductor_miss(tmp_path_factory):
    """A fresh cache directory after the first Inductor step at ``BUDGET`` (a miss of every
    cache), and that step: the state the Inductor-cache tests start from. Each test takes a
    copy of the directory as its own (``_start_from``), so none sees another's entries; the
    compile that fills it is made once."""
    path = tmp_path_factory.mktemp("inductor_miss") / "inductor_cache"
    return path, _step_in_subprocess(path, BUDGET, "inductor")


def _start_from(filled, cache_dir) -> dict:
    """``cache_dir`` (empty: this test's) as a copy of ``filled`` = (directory, its step)."""
    path, step = filled
    shutil.copytree(path, cache_dir)
    return step


def test_inductor_autograd_cache_serves_the_plan(cache_dir, inductor_miss):
    """Under Inductor a fresh process is served by torch's AOTAutograd cache (keyed on lynx's
    partitioner uuid): nothing is partitioned or planned, and the record of the plan (its
    decisions, predicted and compiled peaks) comes back from the entry kept beside it."""
    miss = _start_from(inductor_miss, cache_dir)
    assert miss["cache"] == "miss" and not miss["aot"].get("autograd_cache_hit")
    assert miss["compiled_peak"] is not None
    hit = _step_in_subprocess(cache_dir, BUDGET, "inductor")
    assert hit["cache"] == "hit" and hit["served_by"] == "autograd_cache"
    assert hit["aot"].get("autograd_cache_hit") == 1 and not hit["aot"].get("autograd_cache_miss"), hit["aot"]
    for field in ("units", "peak_bytes", "compiled_peak", "solver", "status", "notes", "candidates"):
        assert hit[field] == miss[field], field
    assert hit["grads"] == miss["grads"]  # bit-identical to the compile that missed both caches


def test_inductor_fx_graph_cache_serves_a_cached_plan(cache_dir, inductor_miss):
    """With AOTAutograd's cache off (here by torch's own switch; lynx keeps it off for several
    planning ranks) the partitioner runs in every process, its plan from the plan cache;
    Inductor's FX-graph cache then serves both compiled graphs, and the compiled-peak estimate
    (read from the scheduler, which a hit skips) comes from the entry. The miss is the module's
    (``inductor_miss``): a miss of every cache compiles and writes the plan's entry and both
    FX-graph entries whether AOTAutograd's cache is on or off (it only adds its own entry), so
    the process with that cache off starts from it rather than compiling the same miss again."""
    off = {"TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    miss = _start_from(inductor_miss, cache_dir)
    assert miss["cache"] == "miss" and not miss["fx"].get("fxgraph_cache_hit")
    assert miss["compiled_peak"] is not None
    hit = _step_in_subprocess(cache_dir, BUDGET, "inductor", env=off)
    assert hit["cache"] == "hit" and hit["served_by"] is None
    assert hit["fx"].get("fxgraph_cache_hit") == 2 and not hit["fx"].get("fxgraph_cache_miss"), hit["fx"]
    for field in ("units", "peak_bytes", "compiled_peak", "solver", "status"):
        assert hit[field] == miss[field], field
    assert hit["grads"] == miss["grads"]


def test_autograd_cache_hit_without_its_record_compiles_again(cache_dir, inductor_miss):
    """``lynx cache clear`` removes lynx's records, not torch's entries: a process then served by
    AOTAutograd's cache has no plan to restore, warns, and compiles with that cache off."""
    miss = _start_from(inductor_miss, cache_dir)
    assert main(["cache", "clear"]) == 0
    again = _step_in_subprocess(cache_dir, BUDGET, "inductor")
    assert "record of its plan is missing" in again["stderr"]
    assert again["cache"] == "miss" and again["served_by"] is None  # planned again (its plan cache was cleared too)
    # (Inductor's FX-graph cache serves the graphs, skipping the scheduler; its compiled-peak
    # estimate was in the plan cache's entry, cleared too: it is not asserted here)
    for field in ("units", "peak_bytes"):
        assert again[field] == miss[field], field
    assert again["grads"] == miss["grads"]
    hit = _step_in_subprocess(cache_dir, BUDGET, "inductor")  # the record is kept again
    assert hit["served_by"] == "autograd_cache" and hit["units"] == miss["units"]


def test_torch_seed_is_partitioned_again_at_its_setting(cache_dir, monkeypatch):
    """A winning torch min-cut seed's decisions are a reading of its partition; a hit partitions
    at its setting again (applied as tags they would partition differently and peak higher).
    The optimizer and the other baselines are taken out so that a torch seed wins."""
    from lynx_compile.recompute import optimize, seeds
    from lynx_compile.decisions import BudgetError

    def no_plan(*args, **kwargs):
        raise BudgetError("taken out by the test")

    monkeypatch.setattr(optimize, "plan_lynx", no_plan)
    monkeypatch.setattr(seeds, "BASELINES", ())
    miss = _plan([{"memory_budget": BUDGET}])[0]
    assert miss.stats["plan_cache"] == "miss" and miss.plan.solver.startswith("baseline:torch")
    hit = _plan([{"memory_budget": BUDGET}])[0]
    assert hit.stats["plan_cache"] == "hit" and hit.plan.solver == miss.plan.solver
    assert hit.plan.decisions.units == miss.plan.decisions.units
    assert hit.plan.peak_bytes == miss.plan.peak_bytes
    assert [d.name for d in hit.plan.saved] == [d.name for d in miss.plan.saved]
    assert [d.name for d in hit.plan.recomputed] == [d.name for d in miss.plan.recomputed]


# --- what misses -----------------------------------------------------------------------------

def test_other_budget_option_or_graph_misses(cache_dir, lynx_log):
    first = _plan([{"memory_budget": BUDGET}])[0]
    assert first.stats["plan_cache"] == "miss"
    again, budget, option = _plan([{"memory_budget": BUDGET}, {"memory_budget": 0.95},
                                   {"memory_budget": BUDGET, "windows": False}])
    assert again.stats["plan_cache"] == "hit"
    assert again.plan.decisions.units == first.plan.decisions.units
    assert budget.stats["plan_cache"] == "miss" and option.stats["plan_cache"] == "miss"
    from lynx_compile.models import example_batch

    model, _ = _gpt_tiny()
    graph = _plan([{"memory_budget": 0.95}], model, example_batch(model, 3))[0]  # another graph (batch 3)
    assert graph.stats["plan_cache"] == "miss"
    assert len(_entries(cache_dir)) == 4
    assert sum("lynx plan cache: hit" in r.message for r in lynx_log.records) == 1


def test_options_that_do_not_plan_share_the_key():
    base = make_config({**OPTIONS, "memory_budget": BUDGET})

    def key(config, **overrides):
        fields = dict(graph_hash="g", graph_digest="d", reference_peak=100, budget=70, world_size=1,
                      profile={"hardware": {}}) | overrides
        return plan_cache.plan_key(plan_cache.key_fields(config, **fields))

    same = make_config({**OPTIONS, "memory_budget": BUDGET, "verbose": True, "dump_dir": "/x", "plan_cache": True})
    assert key(same) == key(base)
    for change in ({"solver": "heu"}, {"mip_gap": 0.01}, {"offload": True}, {"cost_source": "measured"}):
        assert key(make_config({**OPTIONS, "memory_budget": BUDGET, **change})) != key(base), change
    for field, value in (("budget", 71), ("reference_peak", 101), ("world_size", 2), ("graph_digest", "e"),
                         ("profile", {"hardware": {"x": 1}})):
        assert key(base, **{field: value}) != key(base), field


def test_plan_cache_false_writes_nothing(cache_dir):
    record = _plan([{"memory_budget": BUDGET, "plan_cache": False}])[0]
    assert "plan_cache" not in record.stats and not _entries(cache_dir)


# --- entries never trusted -------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["garbage", "truncated", "schema", "unknown unit"])
def test_damaged_entry_is_ignored_with_a_warning_and_replaced(cache_dir, caplog, damage):
    first = _plan([{"memory_budget": BUDGET}])[0]
    (path,) = _entries(cache_dir)
    good = json.loads(path.read_text())
    if damage == "garbage":
        path.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        path.write_text(path.read_text()[:200])
    elif damage == "schema":
        path.write_text(json.dumps({**good, "schema": plan_cache.SCHEMA - 1}))
    else:  # parses, but names a node this graph does not have
        bad = Decisions.make("lynx", {"no_such_node": DEMAND}).to_dict()
        path.write_text(json.dumps({**good, "plan": {**good["plan"], "decisions": bad}}))
    caplog.set_level(logging.INFO, logger="lynx_compile")
    again = _plan([{"memory_budget": BUDGET}])[0]
    assert any(r.levelno == logging.WARNING and "lynx plan cache" in r.message for r in caplog.records)
    assert again.stats["plan_cache"] == "miss"
    assert again.plan.decisions.units == first.plan.decisions.units
    replaced = plan_cache.load(path.stem)  # by the new plan
    assert replaced is not None and replaced.decisions.units == first.plan.decisions.units


def test_entry_above_the_budget_is_not_used(cache_dir, caplog):
    _plan([{"memory_budget": BUDGET}])
    (path,) = _entries(cache_dir)
    good = json.loads(path.read_text())
    keep_all = Decisions.make("lynx", {}).to_dict()  # recomputes nothing: the no-recompute peak
    path.write_text(json.dumps({**good, "plan": {**good["plan"], "decisions": keep_all}}))
    again = _plan([{"memory_budget": BUDGET}])[0]
    assert again.stats["plan_cache"] == "miss"
    assert any("above the budget" in r.message for r in caplog.records if r.levelno == logging.WARNING)
    assert again.plan.peak_bytes <= again.plan.budget_bytes


# --- clearing, concurrent writers ------------------------------------------------------------

def test_cli_cache_path_and_clear(cache_dir, capsys):
    _plan([{"memory_budget": BUDGET}])
    assert len(_entries(cache_dir)) == 1
    assert main(["cache", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(cache_dir / "lynx" / "plans")
    assert main(["cache", "clear"]) == 0
    assert "removed 1 plan" in capsys.readouterr().out
    assert not _entries(cache_dir)
    assert main(["cache", "clear"]) == 0  # nothing there: fine


def test_plans_in_a_directory_of_their_own(cache_dir, tmp_path, monkeypatch, capsys):
    """``LYNX_PLAN_CACHE_DIR``: the plans kept there, not under torch.compile's cache directory;
    a later compile is served from there; ``lynx cache path`` names it."""
    own = tmp_path / "plans_elsewhere"
    monkeypatch.setenv(plan_cache.PLANS_DIR_ENV, str(own))
    first = _plan([{"memory_budget": BUDGET}])[0]
    assert first.stats["plan_cache"] == "miss"
    assert len(list(own.glob("*.json"))) == 1 and not _entries(cache_dir)
    assert main(["cache", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(own)
    again = _plan([{"memory_budget": BUDGET}])[0]
    assert again.stats["plan_cache"] == "hit" and again.plan.decisions == first.plan.decisions


def _write_many(key: str, marker: int, times: int) -> None:
    """Store a large entry under ``key`` ``times`` times (one writer of the concurrency test)."""
    units = {f"node_{marker}_{i}": DEMAND for i in range(2000)}
    entry = plan_cache.CachedPlan(decisions=Decisions.make("lynx", units), solver=f"writer-{marker}")
    for _ in range(times):
        plan_cache.store(key, entry)


def test_concurrent_writers_leave_a_valid_entry(cache_dir):
    key = "ab" * 32
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    writers = [subprocess.Popen([sys.executable, __file__, "write", key, str(m), "30"], env=env,
                                stderr=subprocess.PIPE, text=True) for m in (1, 2)]
    for w in writers:
        assert w.wait(timeout=300) == 0, w.stderr.read()[-2000:]
    entry = plan_cache.load(key)
    assert entry is not None and entry.solver in ("writer-1", "writer-2")
    assert len(entry.decisions) == 2000
    assert [p.name for p in (cache_dir / "lynx" / "plans").iterdir()] == [f"{key}.json"]  # no temporaries left


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_session.sh compile runs it)")
def test_cuda_autograd_cache_serves_a_plan_that_replays_dropout(cache_dir):
    """On CUDA a recomputed SDPA with dropout (gpt-tiny with ``attn_impl="sdpa"`` there) is
    replayed in the backward with the forward's generator state (``graphsafe_run_with_rng_state``),
    which torch 2.11 does not mark cacheable, so
    Inductor's FX-graph cache, and with it AOTAutograd's, bypassed every such graph and a warm
    run compiled again. lynx marks it around its own compiles (``_compat``); a fresh process is
    then served by AOTAutograd's cache, with the gradients of the compile that missed."""
    from torch._prims.rng_prims import graphsafe_run_with_rng_state

    if not graphsafe_run_with_rng_state.cacheable():  # torch 2.11: the graph replays random numbers
        unmarked = _step_in_subprocess(cache_dir / "unmarked", None, "inductor", policy="full", device="cuda",
                                       env={"LYNX_TEST_UNMARKED_RNG_REPLAY": "1"})
        assert unmarked["fx"].get("fxgraph_cache_bypass"), unmarked["fx"]
    miss = _step_in_subprocess(cache_dir, None, "inductor", policy="full", device="cuda")
    assert not miss["fx"].get("fxgraph_cache_bypass") and not miss["aot"].get("autograd_cache_hit"), \
        (miss["fx"], miss["aot"])
    hit = _step_in_subprocess(cache_dir, None, "inductor", policy="full", device="cuda")
    assert hit["served_by"] == "autograd_cache"
    assert hit["aot"].get("autograd_cache_hit") == 1 and not hit["aot"].get("autograd_cache_miss"), hit["aot"]
    assert hit["units"] == miss["units"]
    assert hit["grads"] == miss["grads"]  # the same dropout masks, replayed by the cached code


if __name__ == "__main__":  # the subprocesses of the tests above
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("torch").setLevel(logging.ERROR)
    if sys.argv[1] == "step":
        if os.environ.get("LYNX_TEST_UNMARKED_RNG_REPLAY"):  # torch's own caching rule for the RNG replay
            from lynx_compile._compat import inductor as _inductor_compat
            _inductor_compat._cacheable_rng_replay = dict
        print(json.dumps(_step(None if sys.argv[2] == "None" else float(sys.argv[2]), *sys.argv[3:6])))
    else:
        _write_many(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
