"""Plans do not depend on the process: the same model, options, torch and world size give the same
decisions and the same predicted peak whatever ``PYTHONHASHSEED`` is (torchrun does not fix it,
and ranks that plan differently deadlock or fail the plan agreement check).

The planner runs in two subprocesses with ``PYTHONHASHSEED`` 1 and 2 (string hashes, and so
the iteration order of every set or dict of node names, differ between them; fx nodes hash by
``id``, which differs anyway), each planning the cases below, and every case's records must be
identical across the two (three until 2026-11-28: two seeds already iterate sets in different
orders, and the third process made this the suite's slowest setup on two cores). Costs come from a datasheet profile (``HARDWARE``) and, for tensor
parallelism, a named link: the default ``hardware="auto"`` on a CPU-only machine *calibrates*
the CPU in each process (a timing), and a fake process group calibrates its link, so those costs
legitimately differ from process to process (under torchrun every rank plans from rank 0's
profile, ``annotate_costs_pass``, and from a link calibration max-reduced across ranks).

Cases (gpt-tiny, dropout 0.1 so the RNG replay is in the graphs; each plan-only, nothing runs):

- ``inductor``: the default compiler; the optimizer (HiGHS) at budget 0.8, Lynx-HEU at 0.75.
  Every lynx plan here also partitions with torch's min-cut (the base partition, and the
  ``torch@`` seeds at the budget and half of it).
- ``eager``: ``compiler="eager"`` at 0.7, ``offload=True`` at 0.65, and 0.6, where the
  optimizer finds no plan and torch's min-cut is tried at every setting 0.9 ... 0.1 (one of
  them is the plan).
- ``tp``: two tensor-parallel ranks (a fake process group, meta device) at 0.7: recompute placed
  in the collectives' communication windows.
- ``cpu``: the default ``hardware="auto"`` on this CPU-only machine at 0.8: the CPU is timed
  once per machine (``costs.hardware.cpu_profile_cache_path``, here a fresh file the two
  processes start on together: one measures under a file lock, the others read its profile).
  Before that file, each process timed the CPU itself and planned from its own costs.

A case whose budget no plan reaches records the ``BudgetError`` message, which must be the same
in every process too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

HASH_SEEDS = ("1", "2")
HARDWARE = "h100-sxm"
LINK = "nvlink4"
CASES = ("inductor", "eager", "tp", "cpu")


TIMINGS = ("plan_time_s", "solve_s")
"""Fields of a plan's JSON measured on the clock, the only ones allowed to differ."""


def _records(records) -> list[dict]:
    """What must agree between processes: the whole plan (``RecomputePlan.to_json()``: decisions,
    predicted peak, what is saved and recomputed, solver, notes) but its timings, and the
    candidates lynx compared."""
    out = []
    for r in records:
        plan = {k: v for k, v in json.loads(r.plan.to_json()).items() if k not in TIMINGS}
        out.append({"plan": plan, "decisions": r.plan.decisions.to_dict(), "counts": r.plan.decisions.counts(),
                    "candidates": r.stats.get("candidates")})
    return out


def _plan_variants(model, inputs, variants: list[dict], **common) -> list:
    """Each variant's records, or the ``BudgetError`` message when no plan reaches its budget
    (one trace per variant then: a failing variant would end a shared trace)."""
    from lynx_compile.compiler.dynamo_backend import find_backend_error
    from lynx_compile.decisions import BudgetError
    from lynx_compile.planning import plan_model_variants

    try:
        return [_records(recs) for recs in plan_model_variants(model, inputs, variants, **common)]
    except Exception:  # noqa: BLE001 - dynamo wraps the backend's BudgetError
        pass
    out = []
    for v in variants:
        try:
            out.append(_records(plan_model_variants(model, inputs, [v], **common)[0]))
        except Exception as e:  # noqa: BLE001
            err = find_backend_error(e, BudgetError)
            if err is None:
                raise
            out.append({"error": str(err)})
    return out


def _gpt_tiny(device: str = "cpu", batch: int = 2):
    import torch

    from lynx_compile.models import build_model, example_batch

    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.1, device=device)
    x = example_batch(model, batch, generator=torch.Generator().manual_seed(1)).to(device)
    return model, x


def plan_case(case: str) -> list:
    """The records of one case (see the module docstring), as plain data."""
    # plan_cache=False: every process plans (a plan cache shared between them, under the same
    # torch.compile cache directory, would give some processes another's plan; test_plan_cache.py)
    if case == "inductor":
        model, x = _gpt_tiny()
        return _plan_variants(model, (x,), [{"memory_budget": 0.9}, {"memory_budget": 0.88, "solver": "heu"}],
                              hardware=HARDWARE, plan_cache=False)
    if case == "eager":
        # batch 16: the step's peak counts the parameter gradients (issue M); at batch 2 they set
        # it, and offloading an activation lowers nothing
        model, x = _gpt_tiny(batch=16)
        return _plan_variants(model, (x,), [{"memory_budget": 0.7}, {"memory_budget": 0.65, "offload": True},
                                            {"memory_budget": 0.6}],
                              hardware=HARDWARE, compiler="eager", plan_cache=False)
    if case == "cpu":
        model, x = _gpt_tiny()
        return _plan_variants(model, (x,), [{"memory_budget": 0.9}], plan_cache=False)
    if case == "tp":
        import torch
        import torch.distributed as dist

        from lynx_compile import _compat
        from lynx_compile.distributed.tensor_parallel import tensor_parallelize
        from lynx_compile.models import build_model, example_batch

        dist.init_process_group("fake", rank=0, world_size=2, store=_compat.fake_store())
        try:
            torch.manual_seed(0)
            model = build_model("gpt-tiny", device="meta", dtype=torch.bfloat16, dropout=0.0)
            tensor_parallelize(model, dist.group.WORLD)
            x = example_batch(model, 2).to("meta")
            return _plan_variants(model, (x,), [{"memory_budget": 0.85}], hardware=HARDWARE, link=LINK,
                                  plan_cache=False)
        finally:
            dist.destroy_process_group()
    raise ValueError(f"unknown case {case!r}")


def _run(seed: str, profile: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1", "LYNX_CPU_PROFILE": profile}
    out = subprocess.run([sys.executable, __file__, *CASES], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, f"PYTHONHASHSEED={seed}: planner failed\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plans_by_seed(tmp_path_factory) -> dict[str, dict]:
    profile = str(tmp_path_factory.mktemp("machine") / "cpu_profile.json")  # not measured yet
    with ThreadPoolExecutor(len(HASH_SEEDS)) as pool:
        return dict(zip(HASH_SEEDS, pool.map(_run, HASH_SEEDS, [profile] * len(HASH_SEEDS))))


def _diff(a, b, path: str = "") -> str:
    """The first place two records differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _diff(a.get(k), b.get(k), f"{path}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _diff(x, y, f"{path}[{i}]")
    return f"{path}: {json.dumps(a)[:400]} != {json.dumps(b)[:400]}"


@pytest.mark.parametrize("case", CASES)
def test_same_plan_whatever_the_hash_seed(plans_by_seed, case):
    first = plans_by_seed[HASH_SEEDS[0]][case]
    assert first, f"case {case} planned nothing"
    for seed in HASH_SEEDS[1:]:
        other = plans_by_seed[seed][case]
        assert other == first, (f"case {case}: PYTHONHASHSEED={seed} planned differently from "
                                f"PYTHONHASHSEED={HASH_SEEDS[0]} at {_diff(first, other)}")


def test_cases_plan_what_they_cover(plans_by_seed):
    """The cases exercise what they are for: lynx plans (not only errors), an offloading plan,
    recompute placed in communication windows."""
    plans = plans_by_seed[HASH_SEEDS[0]]
    inductor, eager, tp = plans["inductor"], plans["eager"], plans["tp"]
    assert all("error" not in v for v in inductor + eager[:2] + tp + plans["cpu"]), json.dumps(plans)[:2000]
    assert eager[1][0]["counts"]["offload"] > 0
    assert tp[0][0]["counts"]["window"] > 0


if __name__ == "__main__":  # one subprocess of the test: plan the cases named, print their records
    import logging

    logging.disable(logging.WARNING)
    import warnings

    warnings.simplefilter("ignore")
    print(json.dumps({case: plan_case(case) for case in sys.argv[1:]}, sort_keys=True))
