"""torchtitan's training step under torchrun, 2 gloo ranks, compiled with ``lynx`` by name
(issue N item 2): ``torchrun --nproc-per-node 2 -m lynx_compile.torchtitan_train`` on
torchtitan 0.3.0's llama3 ``debugmodel`` (SDPA), parallelized by torchtitan's own
``parallelize_llama``, FSDP2 (``--dp-shard 2``) and TP with sequence parallelism (``--tp 2``),
each run with ``--compile-backend`` eager, inductor, lynx (no ``LYNX_OPTIONS``) and lynx with
``LYNX_OPTIONS='{"memory_budget": ...}'``, 4 steps (the budget re-plans at step 3).

Oracles, independent of lynx: ``--compile-backend inductor``'s losses and gradient norms (lynx
with no budget is Inductor's own partition: equal bit for bit), and eager PyTorch's: how far
Inductor is from eager bounds how far lynx at a budget may be from Inductor.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lynx_compile.budget import named_fraction
from lynx_compile.tools.torchtitan_models import available

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MISSING = available()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]

PARALLEL = {"fsdp2": ["--dp-shard", "2"], "tp": ["--tp", "2"]}
BUDGET = {"fsdp2": 0.9, "tp": 0.9}
"""Reachable with a margin. On a quiet machine TP named 0.817 in 3 of 3 runs in session 29
(after the recorded step reads frees made on gloo's worker thread; 0.817-0.941 before), FSDP2
0.586-0.617 over 7 runs; under the load of a parallel test run a TP rerun chose another step
plan, so identical runs are not yet alike there (docs/torchtitan.md)."""
STEPS = 4
ERR_MULTIPLE = 4.0  # lynx at a budget vs Inductor: within this multiple of Inductor's own error vs eager
RUN_TIMEOUT_S = 420


def _launch(tmp_path, name: str, parallel: str, backend: str, options: dict | None = None,
            extra: tuple[str, ...] = (), cache: str | None = None) -> tuple[subprocess.CompletedProcess, object]:
    """The launcher under torchrun: the finished process and the path of rank 0's JSON.
    ``cache``: lynx's plan cache directory (``LYNX_PLAN_CACHE_DIR``); torch.compile's cache
    directory, the calibrated CPU profile and link stay where the other runs keep theirs (a
    fresh Inductor cache would compile every kernel again: ~20 s a run)."""
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "LYNX_OPTIONS"}
    env["OMP_NUM_THREADS"] = "1"
    if options is not None:
        env["LYNX_OPTIONS"] = json.dumps(options)
    if cache is not None:
        from lynx_compile.costs.hardware import cpu_profile_cache_path
        from lynx_compile.distributed.link import link_cache_path

        env.update(LYNX_CPU_PROFILE=str(cpu_profile_cache_path()), LYNX_LINK_PROFILE=str(link_cache_path()),
                   LYNX_PLAN_CACHE_DIR=cache)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "lynx_compile.torchtitan_train", *PARALLEL[parallel], "--compile-backend", backend,
           "--steps", str(STEPS), "--timeout", str(RUN_TIMEOUT_S), "--out", str(out), *extra]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name}: torchrun ran past {RUN_TIMEOUT_S} s; output tail:\n{(e.stdout or '')[-3000:]}")
    return proc, out


def _run(tmp_path, parallel: str, backend: str, options: dict | None = None, name: str | None = None,
         extra: tuple[str, ...] = (), cache: str | None = None) -> dict:
    """The launcher under torchrun (:func:`_launch`); rank 0's JSON (losses, grad norms, lynx's plans)."""
    name = name or f"{parallel}-{backend}" + ("" if options is None else "-budget")
    proc, out = _launch(tmp_path, name, parallel, backend, options, extra, cache)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}"
    return json.loads(out.read_text())


def _refused(tmp_path, name: str, parallel: str, options: dict, extra: tuple[str, ...] = (),
             cache: str | None = None) -> tuple[float, str]:
    """A lynx run that must be refused: the budget it names and its output."""
    proc, _ = _launch(tmp_path, name, parallel, "lynx", options, extra, cache)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "BudgetError" in text, f"{name}: not refused\n{text[-4000:]}"
    named = named_fraction(text)
    assert named is not None, text[-4000:]
    return named, text


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """eager's, inductor's and lynx's (no options) runs of one parallelism, once per module."""
    parallel = request.param
    tmp = tmp_path_factory.mktemp(parallel)
    return parallel, tmp, {name: _run(tmp, parallel, name) for name in ("eager", "inductor", "lynx")}


_AT_BUDGET: dict = {}


def _at_budget(parallel: str, tmp) -> tuple[dict, dict, str]:
    """lynx's run at ``BUDGET[parallel]`` in a fresh plan cache (once per parallelism and
    session): its JSON, its options and the cache directory it kept its plans in."""
    options = {"memory_budget": BUDGET[parallel]}
    cache = str(tmp / "cache")
    if parallel not in _AT_BUDGET:
        _AT_BUDGET[parallel] = _run(tmp, parallel, "lynx", options, cache=cache)
    return _AT_BUDGET[parallel], options, cache


def _tolerance(a: list[float], b: list[float]) -> float:
    """``ERR_MULTIPLE`` x the largest per-step difference of Inductor from eager, at least that
    multiple of float32's relative precision at the largest value (Inductor may equal eager
    exactly)."""
    diff = max(abs(x - y) for x, y in zip(a, b))
    ulp = torch.finfo(torch.float32).eps * max(abs(x) for x in a)
    return ERR_MULTIPLE * max(diff, ulp)


@pytest.mark.parametrize("runs", sorted(PARALLEL), indirect=True)
def test_runs_are_torchtitans_two_rank_training(runs):
    parallel, _, r = runs
    for name, run in r.items():
        assert run["world_size"] == 2 and len(run["losses"]) == STEPS, name
        assert run["losses"][-1] < run["losses"][0], f"{name}: the loss did not fall: {run['losses']}"


@pytest.mark.parametrize("runs", sorted(PARALLEL), indirect=True)
def test_lynx_without_options_is_inductor_bit_for_bit(runs):
    parallel, _, r = runs
    assert r["lynx"]["lynx"]["options"] == {}
    assert r["lynx"]["losses"] == r["inductor"]["losses"]
    assert r["lynx"]["grad_norms"] == r["inductor"]["grad_norms"]


@pytest.mark.parametrize("runs", sorted(PARALLEL), indirect=True)
def test_lynx_at_a_budget_is_within_inductors_tolerance(runs):
    parallel, tmp, r = runs
    # in a plan cache of its own, fresh: the step is recorded (step 2) and re-planned at step 3,
    # as on a fresh machine; a cache kept by an earlier run would swap its plan in at step 2.
    # TP: the pieces are compiled again at step 3 on stand-ins for their gone inputs, DTensors
    # whose local shard (block 0's input under sequence parallelism) is an unwaited
    # AsyncCollectiveTensor (step.piece.InputSpec, _compat.dtensor_stand_in): a plain stand-in
    # made code that segfaulted reading the wrapper's null data pointer
    budget, options, _ = _at_budget(parallel, tmp)
    lynx = budget["lynx"]
    assert lynx["options"] == options
    assert not any(p["step_plan_cached"] for p in lynx["plans"]), lynx["plans"]
    # planned on the recorded step (step 2) and in force from step 3: lynx's own prediction
    assert lynx["plans"] and all(p["budget_scope"] == "step" for p in lynx["plans"]), lynx
    for p in lynx["plans"]:
        assert p["step_peak_bytes"] <= BUDGET[parallel] * p["step_reference_bytes"] * 1.001, p
    # each rank's measured forward + backward peak, every step (CPU: step 2, the step lynx
    # records, from lynx's recording, read as the other steps are measured), printed against Inductor's and the plans' step
    # budget: not asserted
    # against either, as under gloo the step's memory moves between identical runs (TP at 0.97:
    # lynx 1.06x Inductor's on one rank in one run, 0.95x in another; docs/torchtitan.md)
    budget_bytes = max(p["budget_bytes"] for p in lynx["plans"])
    for rank, (mine, theirs) in enumerate(zip(budget["step_peak_bytes_by_rank"],
                                              r["inductor"]["step_peak_bytes_by_rank"], strict=True)):
        assert len(mine) == len(theirs) == STEPS, (mine, theirs)
        assert all(isinstance(b, int) and b > 0 for b in mine + theirs), (mine, theirs)
        print(f"{parallel} rank {rank}: measured step peaks lynx@{BUDGET[parallel]} {mine}, inductor "
              f"{theirs}, lynx's step budget {budget_bytes} B")
    for key in ("losses", "grad_norms"):
        tol = _tolerance(r["inductor"][key], r["eager"][key])
        worst = max(abs(x - y) for x, y in zip(budget[key], r["inductor"][key]))
        print(f"{parallel} {key}: lynx@{BUDGET[parallel]} vs inductor {worst:.3g}, tolerance {tol:.3g} "
              f"(inductor vs eager x {ERR_MULTIPLE}); lynx {budget[key]}, inductor {r['inductor'][key]}, "
              f"eager {r['eager'][key]}")
        assert worst <= tol, (key, budget[key], r["inductor"][key], r["eager"][key])


@pytest.mark.parametrize("runs", sorted(PARALLEL), indirect=True)
def test_the_same_command_again_plans_alike(runs):
    """Issue S item 1: the same command run again on a fresh machine (the plan cache off: the
    step recorded again, planned again) makes the same plans on every rank (their fingerprints,
    as the ranks compared them), predicts the same step peak, and gives losses within Inductor's
    tolerance of the first run's. The recorded step once read a buffer handed to gloo as freed
    by gloo's worker thread in one run and by the block in another: FSDP2's copy of a
    reduce-scatter's input (deepseek_v3: 0.777 or 0.851 named by one command), TP's functional
    all-gather output (a 256 KiB move of llama3's backward segment, and one of two reruns chose
    another plan for one graph). Both are now held to the next piece boundary
    (``step.memory_marks.held_to_next_mark``, ``_compat.collective_held_allocations``), and
    since session 42 read as freed where the step's thread let go of it however late the worker
    frees it (TP at 0.9 on the launcher: 8 of 8 fresh runs alike; before, one of three runs of
    this test under load recorded a no-recompute step 261,120 B larger and planned two of four
    graphs otherwise, and TP reran from the plan cache here)."""
    parallel, tmp, r = runs
    first, options, cache = _at_budget(parallel, tmp)
    again = _run(tmp, parallel, "lynx", {**options, "plan_cache": False}, name=f"{parallel}-budget-again",
                 cache=cache)
    cached = [p["step_plan_cached"] for p in again["lynx"]["plans"]]
    assert cached and not any(cached), again["lynx"]
    for key in ("fingerprint", "step_peak_bytes"):
        values = [[p[key] for p in run["lynx"]["plans"]] for run in (first, again)]
        assert values[0] == values[1] and all(v is not None for v in values[0]), (key, values)
    # the step without recompute (the budget's 100%) within 0.01%: a small buffer of another
    # thread's can read in one run and not the other
    for key in ("step_reference_bytes", "budget_bytes"):
        values = [[p[key] for p in run["lynx"]["plans"]] for run in (first, again)]
        assert all(abs(a - b) <= 1e-4 * a for a, b in zip(*values, strict=True)), (key, values)
    tol = _tolerance(r["inductor"]["losses"], r["eager"]["losses"])
    assert max(abs(x - y) for x, y in zip(first["losses"], again["losses"])) <= tol, (first["losses"], again["losses"])


def test_tp_with_the_eager_compiler_names_one_budget_twice_and_trains_at_it(tmp_path):
    """llama3 on 2 blocks under TP, ``compiler="eager"``, at 0.5: out of reach beside the LM head
    and loss, refused naming the step's smallest budget; the same command again on a fresh
    machine (the plan cache off: the step recorded again) is refused naming the same budget
    (issue S item 1; fresh runs named 0.817-0.941 on 6 blocks before session 29; 0.857 then 0.839
    in session 41's suite; 0.859 in 1 of 16 runs in session 42, a sequence-parallel all-gather's
    input freed by gloo's worker read live through its segment's peak: read since session 43 as
    freed where the all-gather ended, ``step.memory_marks.handed_gone_at_last_use``, 48 of 48
    fresh runs 0.857, 8 of them beside a spinning process). Asking for the
    named budget trains 4 steps (issue S item 3; under load, at most the budget that run names
    once more, within 0.03 of the first: issue S item 1 is open): every piece compiled again at step 3 with the
    step's choice, losses within 4 x float32's precision of eager's (no compile). Before session
    30 the named budget was refused at step 3: torch's partition of the piece compiled again left
    a dead copy of the forward's SDPA (a random op, which FX's dead-code pass keeps) at the
    backward's start, raising its no-recompute peak above what the step had planned it at.
    FSDP2's refusal run twice: ``tests/test_fsdp2.py``."""
    parallel, extra, cache = "tp", ("--layers", "2"), str(tmp_path / "cache")
    options = {"memory_budget": 0.5, "compiler": "eager"}
    named, _ = _refused(tmp_path, "tp-eager-0.5", parallel, options, extra, cache)
    again, text = _refused(tmp_path, "tp-eager-0.5-again", parallel, {**options, "plan_cache": False}, extra)
    assert "from the plan cache" not in text, text[-3000:]
    assert again == named and 0.5 < named < 1.0, (named, again)
    eager = _run(tmp_path, parallel, "eager", name="tp-eager-2-blocks", extra=extra)
    at = named
    proc, out = _launch(tmp_path, "tp-eager-named", parallel, "lynx", {**options, "memory_budget": named},
                        extra, cache)
    if proc.returncode == 0:
        run = json.loads(out.read_text())
    else:
        # the named budget's run records its own step (another budget: another plan cache key,
        # other provisional plans); under a parallel test run's load gloo's worker frees a
        # collective's buffer at another time, and that step can name a budget a little higher
        # (session 36's suite: 0.839, then 0.857; 0.857 both times alone). Once, and close by:
        # the named budgets are not yet alike in every fresh run (issue S item 1)
        text = proc.stdout + proc.stderr
        at = named_fraction(text)
        assert "BudgetError" in text and at is not None and named < at <= named + 0.03, text[-4000:]
        run = _run(tmp_path, parallel, "lynx", {**options, "memory_budget": at}, name="tp-eager-named-again",
                   extra=extra, cache=cache)
    plans = run["lynx"]["plans"]
    assert plans and all(p["budget_scope"] == "step" for p in plans), plans
    assert any(p["recomputed"] for p in plans), plans
    tol = _tolerance(eager["losses"], eager["losses"])
    worst = max(abs(x - y) for x, y in zip(run["losses"], eager["losses"]))
    print(f"tp, compiler='eager', 2 blocks: 0.5 named {named}, again {again}; at {at}, losses {run['losses']} vs "
          f"eager {eager['losses']}: {worst:.3g} (tolerance {tol:.3g})")
    assert worst <= tol, (run["losses"], eager["losses"])


@pytest.mark.parametrize("value, backend, says", [
    ('{"memory_budjet": 0.9}', "lynx", "unknown lynx option(s) ['memory_budjet']"),
    ('{"memory_budget": 0.9}', "inductor", "LYNX_OPTIONS is set but --compile-backend is 'inductor'"),
])
def test_launcher_refuses_bad_options_before_building(monkeypatch, capsys, value, backend, says):
    from lynx_compile.tools.torchtitan_train import main

    monkeypatch.setenv("LYNX_OPTIONS", value)
    assert main(["--compile-backend", backend]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


@pytest.mark.parametrize("argv", [["--model", "llama3", "--ep", "2"], ["--model", "deepseek_v3", "--layers", "1", "--ep", "2"]])
def test_launcher_refuses_expert_parallelism_without_experts(capsys, argv):
    """torchtitan trains a model with no MoE block at ``--ep 2`` as if it were 1, silently;
    the launcher says so before building (deepseek_v3's first block is dense)."""
    from lynx_compile.tools.torchtitan_train import main

    assert main([*argv, "--dp-shard", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no MoE block" in err and "--layers 2" in err and "\n" not in err


def test_deepseek_v3_under_tp_at_a_budget_gives_inductors_gradients(tmp_path):
    """deepseek_v3 (1 block: MLA attention, dense MLP) under TP at 0.99: lynx's plan recomputes
    the first RMSNorm's ``pow``/``mean`` from the saved ``wait_tensor`` of the block's input (an
    unwaited sequence-parallel collective). ``wait_tensor`` returns its argument's storage, and
    AOTAutograd donated it to the backward, where Inductor wrote the recomputed ``pow`` over the
    input the backward read again: gradient norms 3e-4 apart from Inductor's at step 1 (session
    29). lynx saves the input itself (``_compat.inputs_saved_for_their_waits``): both steps' losses
    and gradient norms equal Inductor's."""
    # steps 1-2, on the block's own plan (at step 3 the step's plan refuses 0.99 on 1 block: the
    # LM head and loss outside it leave nothing to gain)
    extra = ("--model", "deepseek_v3", "--layers", "1", "--steps", "2")
    inductor = _run(tmp_path, "tp", "inductor", name="ds-tp-inductor", extra=extra)
    lynx = _run(tmp_path, "tp", "lynx", {"memory_budget": 0.99, "plan_cache": False}, name="ds-tp-lynx", extra=extra)
    assert any(p["recomputed"] > 1 for p in lynx["lynx"]["plans"]), lynx["lynx"]["plans"]
    assert len(lynx["losses"]) == 2 and lynx["losses"] == inductor["losses"], (lynx["losses"], inductor["losses"])
    assert lynx["grad_norms"] == inductor["grad_norms"], (lynx["grad_norms"], inductor["grad_norms"])


@pytest.mark.parametrize("argv, says", [
    (["--compile-backend", "lynx", "--ac", "memory_budget"], "torch's budget and lynx's would plan one partition"),
    (["--compile-backend", "eager", "--ac", "memory_budget"], "use --compile-backend inductor"),
    (["--compile-backend", "inductor", "--ac", "memory_budget", "--ac-memory-budget", "1.5"], "a fraction, 0 to 1"),
])
def test_launcher_refuses_torchs_budget_where_it_cannot_apply(capsys, argv, says):
    """``--ac memory_budget`` is torch.compile's ``activation_memory_budget``: Inductor's
    partitioner applies it; beside lynx's budget it would be a second planner of one partition."""
    from lynx_compile.tools.torchtitan_train import main

    assert main([*argv, "--dp-shard", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


def test_launcher_ac_is_torchtitans_own():
    """``--ac``: torchtitan's activation checkpointing configs, as its trainer's
    ``activation_checkpoint`` builds them."""
    from torchtitan.distributed import activation_checkpoint as ac

    from lynx_compile.tools.torchtitan_train import ac_config

    assert ac_config("none", 0.5) is None
    assert type(ac_config("full", 0.5)) is ac.FullAC.Config
    assert type(ac_config("selective", 0.5)) is ac.SelectiveAC.Config
    budget = ac_config("memory_budget", 0.3)
    assert type(budget) is ac.MemoryBudgetAC.Config and budget.memory_budget == 0.3
