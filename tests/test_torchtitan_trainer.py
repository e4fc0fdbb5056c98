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
BUDGET = {"fsdp2": 0.9, "tp": 0.9}
"""Reachable with a margin. On a quiet machine TP named 0.817 in 3 of 3 runs in session 29
(after the recorded step reads frees made on gloo's worker thread; 0.817-0.941 before), FSDP2
0.586-0.617 over 7 runs; under the load of a parallel test run a TP rerun chose another step
plan, so identical runs are not yet alike there (docs/torchtitan.md)."""
STEPS = 4
ERR_MULTIPLE = 4.0  # lynx at a budget vs Inductor: within this multiple of Inductor's own error vs eager
RUN_TIMEOUT_S = 420


def _run(tmp_path, parallel: str, backend: str, options: dict | None = None, name: str | None = None,
         extra: tuple[str, ...] = ()) -> dict:
    """The launcher under torchrun; rank 0's JSON (losses, grad norms, lynx's plans)."""
    name = name or f"{parallel}-{backend}" + ("" if options is None else "-budget")
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


@pytest.mark.parametrize("runs", sorted(PARALLEL), indirect=True)
def test_lynx_at_a_budget_is_within_inductors_tolerance(runs):
    parallel, tmp, r = runs
    # plan_cache off: a step plan cached by an earlier run (any earlier test session on this
    # machine) would be swapped in at step 2 instead of re-planned at step 3, a different path
    options = {"memory_budget": BUDGET[parallel], "plan_cache": False}
    # TP: the pieces are compiled again at step 3 on stand-ins for their gone inputs, DTensors
    # whose local shard (block 0's input under sequence parallelism) is an unwaited
    # AsyncCollectiveTensor (step.piece.InputSpec, _compat.dtensor_stand_in): a plain stand-in
    # made code that segfaulted reading the wrapper's null data pointer
    budget = _run(tmp, parallel, "lynx", options)
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
