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

from lynx_compile.tools.torchtitan_models import available

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MISSING = available()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]

PARALLEL = {"fsdp2": ["--dp-shard", "2"], "tp": ["--tp", "2"]}
BUDGET = {"fsdp2": 0.9, "tp": 0.85}
"""Reachable with a margin. TP names 0.817 in every run (3 runs, session 29); FSDP2 0.586-0.617
(7 runs): the unsharded LM head, all-gathered for the forward, is freed by gloo's worker thread
at its next collective in some runs, by the step's own thread in others, and the step with no
recompute reads 2 MiB apart (docs/torchtitan.md). Before session 29 a buffer freed on the
worker read as live to the step's end: 0.614-0.812 for FSDP2, 0.817-0.941 for TP."""
STEPS = 4
ERR_MULTIPLE = 4.0  # lynx at a budget vs Inductor: within this multiple of Inductor's own error vs eager
RUN_TIMEOUT_S = 420


def _launch(tmp_path, name: str, parallel: str, backend: str, options: dict | None = None,
            extra: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, object]:
    """The launcher under torchrun: the finished process and the path of rank 0's JSON."""
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "LYNX_OPTIONS"}
    env["OMP_NUM_THREADS"] = "1"
    if options is not None:
        env["LYNX_OPTIONS"] = json.dumps(options)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "lynx_compile.torchtitan_train", *PARALLEL[parallel], "--compile-backend", backend,
           "--steps", str(STEPS), "--timeout", str(RUN_TIMEOUT_S), "--out", str(out), *extra]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name}: torchrun ran past {RUN_TIMEOUT_S} s; output tail:\n{(e.stdout or '')[-3000:]}")
    return proc, out


def _run(tmp_path, parallel: str, backend: str, options: dict | None = None, name: str | None = None,
         extra: tuple[str, ...] = ()) -> dict:
    """The launcher under torchrun; rank 0's JSON (losses, grad norms, lynx's plans)."""
    name = name or f"{parallel}-{backend}" + ("" if options is None else "-budget")
    proc, out = _launch(tmp_path, name, parallel, backend, options, extra)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """eager's, inductor's and lynx's (no options) runs of one parallelism, once per module."""
    parallel = request.param
    tmp = tmp_path_factory.mktemp(parallel)
    return parallel, tmp, {name: _run(tmp, parallel, name) for name in ("eager", "inductor", "lynx")}


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


_AT_BUDGET: dict = {}


def _at_budget(parallel: str, tmp) -> tuple[dict, dict]:
    """lynx's run at ``BUDGET[parallel]`` (once per parallelism and session) and its options."""
    # plan_cache off: a step plan cached by an earlier run (any earlier test session on this
    # machine) would be swapped in at step 2 instead of re-planned at step 3, a different path
    options = {"memory_budget": BUDGET[parallel], "plan_cache": False}
    if parallel not in _AT_BUDGET:
        _AT_BUDGET[parallel] = _run(tmp, parallel, "lynx", options)
    return _AT_BUDGET[parallel], options


@pytest.mark.parametrize("runs", sorted(PARALLEL), indirect=True)
def test_lynx_at_a_budget_is_within_inductors_tolerance(runs):
    parallel, tmp, r = runs
    # TP: the pieces are compiled again at step 3 on stand-ins for their gone inputs, DTensors
    # whose local shard (block 0's input under sequence parallelism) is an unwaited
    # AsyncCollectiveTensor (step.piece.InputSpec, _compat.dtensor_stand_in): a plain stand-in
    # made code that segfaulted reading the wrapper's null data pointer
    budget, options = _at_budget(parallel, tmp)
    lynx = budget["lynx"]
    assert lynx["options"] == options
    # planned on the recorded step (step 2) and in force from step 3: lynx's own prediction
    assert lynx["plans"] and all(p["budget_scope"] == "step" for p in lynx["plans"]), lynx
    for p in lynx["plans"]:
        assert p["step_peak_bytes"] <= BUDGET[parallel] * p["step_reference_bytes"] * 1.001, p
    # each rank's measured forward + backward peak (CPU: from step 3, when lynx's own record of
    # the step is done), printed against Inductor's and the plans' step budget: not asserted
    # against either, as under gloo the step's memory moves between identical runs (TP at 0.97:
    # lynx 1.06x Inductor's on one rank in one run, 0.95x in another; docs/torchtitan.md)
    budget_bytes = max(p["budget_bytes"] for p in lynx["plans"])
    for rank, (mine, theirs) in enumerate(zip(budget["step_peak_bytes_by_rank"],
                                              r["inductor"]["step_peak_bytes_by_rank"], strict=True)):
        assert len(mine) == STEPS and all(isinstance(b, int) and b > 0 for b in mine[2:]), mine
        print(f"{parallel} rank {rank}: measured step peaks lynx@{BUDGET[parallel]} {mine[2:]}, inductor "
              f"{theirs[2:]}, lynx's step budget {budget_bytes} B")
    for key in ("losses", "grad_norms"):
        tol = _tolerance(r["inductor"][key], r["eager"][key])
        worst = max(abs(x - y) for x, y in zip(budget[key], r["inductor"][key]))
        print(f"{parallel} {key}: lynx@{BUDGET[parallel]} vs inductor {worst:.3g}, tolerance {tol:.3g} "
              f"(inductor vs eager x {ERR_MULTIPLE}); lynx {budget[key]}, inductor {r['inductor'][key]}, "
              f"eager {r['eager'][key]}")
        assert worst <= tol, (key, budget[key], r["inductor"][key], r["eager"][key])


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


@pytest.mark.parametrize("runs", ["tp"], indirect=True)
def test_the_same_tp_command_plans_alike_every_run(runs, tmp_path):
    """Issue S item 1: the same command run again (plan cache off: the step recorded and planned
    again) gives the same plans (their fingerprints, as the ranks compared them) at ``BUDGET``.
    Under gloo the recorded step read up to 1.4 MiB apart between identical runs before session
    29 (a collective's buffers, freed on gloo's worker thread, read as live to the step's end)."""
    parallel, tmp, _ = runs
    first, options = _at_budget(parallel, tmp)
    again = _run(tmp_path, parallel, "lynx", options, name="tp-budget-again")
    fingerprints = [[p["fingerprint"] for p in run["lynx"]["plans"]] for run in (first, again)]
    assert fingerprints[0] == fingerprints[1] and all(fingerprints[0]), fingerprints


def test_the_same_tp_command_refused_names_one_smallest_budget(tmp_path):
    """Issue S item 1: llama3 under TP cut to 2 blocks at 0.7, out of reach beside the LM head
    and loss, run twice with the plan cache off: both runs refused naming the same smallest
    budget (before session 29: 0.817-0.941 over six runs on 6 blocks). FSDP2 is not tested so:
    the same command named 0.785 and 0.808 in session 29 (``BUDGET``'s note)."""
    from lynx_compile.budget import named_fraction

    parallel = "tp"
    named = []
    for i in range(2):
        proc, _ = _launch(tmp_path, f"{parallel}-0.7-{i}", parallel, "lynx", {"memory_budget": 0.7, "plan_cache": False},
                          ("--layers", "2"))
        text = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "BudgetError" in text, text[-4000:]
        named.append(named_fraction(text))
    print(f"{parallel} at 0.7: refused naming {named}")
    assert named[0] is not None and named[0] == named[1] and 0.7 < named[0] <= 1.0, named


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
