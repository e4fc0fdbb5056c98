"""Issue 13 on a tensor-parallel model: a DTensor TP=2 Llama on 2 gloo ranks (loopback).

On every rank: each baseline (full = checkpointing each block, selective, torch's min-cut at
0.5) is planned, then lynx with the peak it reached as its budget in bytes; lynx's plan peaks no
higher and exposes no more recompute. And lynx at memory_budget=0.53 plans, where only torch's
min-cut reaches (the issue saw a BudgetError at 0.5 on a 2-rank DTensor model, with the larger
reference of before alias_clones_pass) and the compiled step's gradients equal eager's on
that rank. With several ranks torch's min-cut was no seed at all (its partition may differ per
rank), so at torch@0.5's peak (0.49 of the no-recompute peak, below what lynx's optimizer
reaches) lynx fell back to full: 246 us of exposed recompute against torch's 114 us. One run
of both ranks does everything.
"""
from __future__ import annotations

import pytest
import torch

import lynx_compile
from _dist import run_ranks
from _reach import plan_reach
from lynx_compile.models import LlamaConfig, build_model

# Tiny, and shardable 2 ways (grouped-query attention: 2 query heads per kv head on each rank).
CONFIG = LlamaConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=8, n_kv_heads=4, ffn_hidden=48)
BATCH = 2
BASELINES = (("full", {}), ("selective", {}), ("torch", {"memory_budget": 0.5}))
LYNX_BUDGET = 0.53
"""Below full's peak (0.549 of the no-recompute peak) and above torch's min-cut at 0.5 / 0.4
(0.522 / 0.520): only a torch seed reaches it, which with several ranks is one only where every
rank partitioned it alike. (It was 0.5 before alias_clones_pass: the eager compiler's reference
no longer counts the copies eager PyTorch does not save, and 0.5 of it is below what any plan
reaches, 0.520.)"""
# compiler="eager": lynx's exact reference partition. What several ranks change (torch's
# min-cut as a seed only where every rank partitions it alike) does not depend on the compiler,
# and Inductor's joint passes and min-cut base make each plan about twice as slow on these
# graphs; tests/test_lynx_policy.py covers Inductor on one process.
COMMON = dict(cost_source="analytic", hardware="h100-sxm", compiler="eager")
RTOL = 1e-5


def _dtensor_llama(mesh):
    from lynx_compile.distributed.dtensor_tp import dtensor_parallelize

    torch.manual_seed(0)
    return dtensor_parallelize(build_model(CONFIG), mesh)


def _local_grads(model) -> dict[str, torch.Tensor]:
    """This rank's gradient of every parameter (a DTensor's local shard)."""
    return {n.removeprefix("_orig_mod."): (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
            for n, p in model.named_parameters()}


def _reach_ranks(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len), generator=torch.Generator().manual_seed(1))
    model = _dtensor_llama(mesh)
    # torch's min-cut below budget 1 sizes every graph input and raises on the process group a
    # DTensor graph takes as one (a FakeScriptObject) unless told it is zero bytes, which it is
    # as activation memory: the baseline is what torch.compile does with that flag set.
    with torch._functorch.config.patch(unsafe_treat_script_objects_as_zero_size=True):
        rows = plan_reach(model, (idx,), BASELINES, plan_cache=False, **COMMON)

    eager = _dtensor_llama(mesh)
    eager(idx).loss.backward()
    backend = lynx_compile.backend(policy="lynx", memory_budget=LYNX_BUDGET, solver="highs", **COMMON)
    twin = _dtensor_llama(mesh)
    torch.compile(twin, backend=backend)(idx).loss.backward()
    want, got = _local_grads(eager), _local_grads(twin)
    errors = {n: ((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-6)).item() for n, g in want.items()}
    plan = backend.plans[-1]
    return {"rows": rows, "grad_errors": errors, "fraction": plan.peak_fraction, "solver": plan.solver}


@pytest.mark.timeout(420)
def test_dtensor_tp2_lynx_reaches_each_baseline_and_plans_half():
    results = run_ranks(_reach_ranks, 2, timeout_s=400)
    for rank, r in enumerate(results):
        report = "\n".join(map(str, r["rows"]))
        print(f"rank {rank}:\n{report}\nlynx@{LYNX_BUDGET}: {r['fraction']:.3f} of the no-recompute peak ({r['solver']})")
        assert all(row.ok for row in r["rows"]), f"rank {rank}:\n{report}"
        assert r["fraction"] <= LYNX_BUDGET, r
        worst = max(r["grad_errors"], key=r["grad_errors"].get)
        assert r["grad_errors"][worst] <= RTOL, (rank, worst, r["grad_errors"][worst])
    # both ranks plan the same graph: the same numbers
    assert [str(x) for x in results[0]["rows"]] == [str(x) for x in results[1]["rows"]]
