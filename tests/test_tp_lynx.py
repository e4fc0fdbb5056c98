"""lynx on tensor-parallel graphs, real gloo ranks: same numbers as one process, recompute
placed inside the collectives' windows, ranks that agree on the plan, failures that say who.

Each test is one run of all ranks (``_dist.run_ranks``); inside it every rank runs several
configurations in turn (compilation dominates the runtime). The Inductor tests share one run
(``inductor_runs``): each process's first Inductor compile pays for warming Inductor up.
"""
from __future__ import annotations

import datetime
import functools
import os
import time

import pytest
import torch
import torch.distributed as dist

import lynx_compile
from _dist import free_port, mp_context, run_ranks
from lynx_compile.distributed.tensor_parallel import (
    full_gradients,
    sync_sequence_parallel_grads,
    tensor_parallelize,
)
from lynx_compile.models import GPTConfig, LlamaConfig, build_model

# Small enough for 4 ranks on 2 cores; long enough sequences that block activations, not the
# logits, dominate memory, so a budget forces recompute inside the blocks.
CONFIGS = {
    "gpt": GPTConfig(vocab_size=32, seq_len=128, n_layers=2, hidden=32, n_heads=8, dropout=0.0),
    "llama": LlamaConfig(vocab_size=32, seq_len=128, n_layers=2, hidden=32, n_heads=8, n_kv_heads=4,
                         ffn_hidden=64, dropout=0.0),
}
BATCH = 2
BUDGET = 0.85
WINDOW_BUDGET = 0.75
"""Low enough that the plan recomputes matmuls in windows under Inductor (at 0.85, with lynx's
model of Inductor's kernels in ``memory/inductor_model.py``, it recomputes only pointwise ops there)."""
RTOL = 1e-5


def _batch(cfg) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=torch.Generator().manual_seed(3))


def _reference(cfg):
    torch.manual_seed(0)
    model = build_model(cfg)
    loss = model(_batch(cfg)).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_close(name, got, want):
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= RTOL * max(scale, 1e-3), f"{name}: max abs error {err:.3g} vs scale {scale:.3g}"


def _assert_matches_one_process(what, cfg, sp, model, loss):
    """The sharded ``model``'s ``loss`` and its full gradients (after its backward) are the
    single-process model's."""
    ref_loss, ref_grads = _reference(cfg)
    if sp:
        sync_sequence_parallel_grads(model, dist.group.WORLD)
    _assert_close(f"{what} loss", loss.detach(), ref_loss)
    grads = full_gradients(model, dist.group.WORLD)
    assert set(grads) == set(ref_grads)
    for pname, g in grads.items():
        _assert_close(f"{what} grad {pname}", g, ref_grads[pname])


def _lynx_tp_matches(rank, world, configs, compiler="eager"):
    """``configs``: (model, sequence parallel[, budget]); budget ``BUDGET`` unless given."""
    out = []
    for name, sp, *given in configs:
        budget = given[0] if given else BUDGET
        cfg = CONFIGS[name]
        torch.manual_seed(0)
        model = tensor_parallelize(build_model(cfg), dist.group.WORLD, sequence_parallel=sp)
        torch._dynamo.reset()
        backend = lynx_compile.backend(policy="lynx", memory_budget=budget, solver="highs",
                                       plan_cache=False, hardware="cpu", link="pcie4",
                                       compiler=compiler)
        loss = torch.compile(model, backend=backend)(_batch(cfg)).loss
        loss.backward()
        _assert_matches_one_process(f"{name} sp={sp}", cfg, sp, model, loss)
        plan = backend.plans[-1]
        counts = plan.decisions.counts()
        out.append({"name": name, "sp": sp, "budget": budget, "peak_fraction": plan.peak_fraction,
                    "recomputed": counts["demand"] + counts["window"],
                    "windowed": counts["window"],
                    "moved": backend.records[-1].stats.get("recompute_nodes_in_windows", 0),
                    "fingerprint": backend.records[-1].stats["plan_fingerprint"]})
    return out


TP_CONFIGS = {
    2: [("gpt", False), ("gpt", True), ("llama", False), ("llama", True)],
    # GPT at TP=4 at 0.93, not BUDGET. Its backward's four all-reduce windows (35.8 us each on
    # pcie4) can take only block 0's units (block 1's recompute is needed from backward event
    # 78, before the first window opens at 103). Under the eager compiler, with
    # alias_clones_pass (the F.dropout(p=0) copy of the attention probabilities gone), lynx's
    # optimizer reaches no peak below about 0.87 of the no-recompute peak (its model counts the
    # recomputed softmax beside the whole bmm -> mul -> masked_fill chain that makes it: an
    # upper bound), and down to 0.9 its plan recomputes attention on demand (129 us at 0.9), so
    # a baseline wins there, all on demand (0.9: torch's min-cut, 61 us; 0.85: selective).
    # Until the pass the optimizer's own plan fitted 0.85 with 6 units in windows, that copy
    # among them (a clone of the kept softmax, 36 us, in all_reduce_5's window). At 0.93 (and
    # 0.96) its plan recomputes only in windows: 7 units (layer norms, the first MLP matmul,
    # gelu, residual adds, the position arange), nothing on demand, predicted peak 0.905.
    4: [("gpt", False, 0.93), ("llama", True)],
}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp", [2, 4])
def test_lynx_tensor_parallel_matches_single_process(tp):
    """lynx's plan on the sharded graph gives the single-process loss and gradients, fits the
    budget, recomputes inside the collectives' windows, and is the same plan on every rank.

    TP=2 runs every model with and without sequence parallelism. TP=4 runs two of the four
    (Megatron-style GPT, sequence-parallel Llama with one kv head per rank): what four ranks add
    is the four-way shards of both models and both collective patterns (all-reduce; all-gather
    and reduce-scatter) and the plan agreed on by four ranks, which those two cover; lynx's
    passes see the same ops at either degree (only the shapes differ), and each of four
    processes on two cores plans at half speed, so the other two doubled the test's time."""
    results = run_ranks(_lynx_tp_matches, tp, TP_CONFIGS[tp], timeout_s=380)
    windowed: dict[str, int] = {}
    for per_rank in zip(*results):
        # every rank ran the same plan
        assert len({r["fingerprint"] for r in per_rank}) == 1, per_rank
        r = per_rank[0]
        assert r["peak_fraction"] <= r["budget"] + 0.02, r
        assert r["recomputed"] > 0 and (r["windowed"] > 0) == (r["moved"] > 0), r
        windowed[r["name"]] = windowed.get(r["name"], 0) + r["windowed"]
    # every model recomputes in its collectives' windows, with or without sequence parallelism.
    # Not each variant: GPT with sequence parallelism at 0.85 (TP=2) is planned by HiGHS with its
    # four recomputed units all on demand (0.644 ms exposed; highspy 1.16, torch 2.13), the same
    # plan at this commit and the one before the test last passed in CI
    assert all(n > 0 for n in windowed.values()), windowed


def _lynx_tp_dropout_matches_eager_tp(rank, world):
    """With dropout on, lynx's TP run (windows, RNG replay) equals the eager TP run."""
    cfg = GPTConfig(vocab_size=32, seq_len=128, n_layers=2, hidden=32, n_heads=8, dropout=0.1)
    grads = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = tensor_parallelize(build_model(cfg), dist.group.WORLD)
        run = model
        if compiled:
            run = torch.compile(model, backend=lynx_compile.backend(
                policy="lynx", memory_budget=BUDGET, solver="heu", plan_cache=False, hardware="cpu",
                link="pcie4", compiler="eager"))
        torch.manual_seed(7)
        run(_batch(cfg)).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        _assert_close(f"dropout grad {n}", grads[1][n], grads[0][n])
    return True


@pytest.mark.timeout(200)
def test_lynx_tensor_parallel_dropout_replays_rng():
    assert run_ranks(_lynx_tp_dropout_matches_eager_tp, 2, timeout_s=180) == [True, True]


def _mismatched_budgets(rank, world):
    cfg = CONFIGS["gpt"]
    torch.manual_seed(0)
    model = tensor_parallelize(build_model(cfg), dist.group.WORLD)
    budget = 0.85 if rank == 0 else 1.0  # a per-rank option: the plans differ
    backend = lynx_compile.backend(policy="lynx", memory_budget=budget, solver="heu", plan_cache=False,
                                   hardware="cpu", link="pcie4", compiler="eager")
    try:
        torch.compile(model, backend=backend)(_batch(cfg)).loss.backward()
    except Exception as e:  # dynamo wraps backend errors
        inner = getattr(e, "inner_exception", e)
        return type(inner).__name__, str(inner)
    return "no error", ""


@pytest.mark.timeout(200)
def test_plan_mismatch_stops_every_rank_with_one_error():
    results = run_ranks(_mismatched_budgets, 2, timeout_s=180)
    for kind, msg in results:
        assert kind == "PlanMismatchError", (kind, msg)
        assert "ranks [0] planned" in msg and "ranks [1] planned" in msg
    assert results[0][1] == results[1][1]  # the same message on every rank


def _rank1_solves_differently(rank, world):
    """Rank 1's solver answers the same problem with another plan (as a MILP stopped by its time
    limit on a loaded machine may): every rank still compiles rank 0's plan, with no error."""
    from lynx_compile.distributed.agreement import plan_fingerprint
    from lynx_compile.solver import solve as solve_module

    differed = []
    if rank == 1:
        real = solve_module.solve_remat

        def other(problem, target, **kw):  # the plan of a slightly smaller target, where that is another plan
            from lynx_compile.solver.problem import InfeasibleBudget

            own = real(problem, target, **kw)
            for fraction in (0.97, 0.93, 0.9):
                try:
                    tighter = real(problem, int(target * fraction), **kw)
                except InfeasibleBudget:
                    break
                if (tighter.keep, tighter.demand, tighter.window) != (own.keep, own.demand, own.window):
                    differed.append(True)
                    return tighter
            differed.append(False)
            return own

        solve_module.solve_remat = other
    cfg = CONFIGS["gpt"]
    torch.manual_seed(0)
    model = tensor_parallelize(build_model(cfg), dist.group.WORLD)
    backend = lynx_compile.backend(policy="lynx", memory_budget=BUDGET, solver="heu", plan_cache=False,
                                   hardware="cpu", link="pcie4", compiler="eager")
    torch.compile(model, backend=backend)(_batch(cfg)).loss.backward()
    return plan_fingerprint(backend.records[0].plan), differed


@pytest.mark.timeout(200)
def test_every_rank_compiles_rank0s_solve():
    (fp0, _), (fp1, rank1_differed) = run_ranks(_rank1_solves_differently, 2, timeout_s=180)
    assert any(rank1_differed), rank1_differed  # rank 1's own answer was another plan ...
    assert fp0 == fp1      # ... yet both ranks compiled the same one


def _train_until_rank1_dies(rank, world, port, path):
    import argparse

    from lynx_compile.tools.train import add_train_arguments, train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    args = p.parse_args(["--model", "gpt-tiny", "--policy", "eager", "--steps", "6", "--dropout", "0"])

    def die(step):
        if rank == 1 and step == 2:
            os._exit(7)  # no clean-up, no message: a crashed rank

    t0 = time.monotonic()
    try:
        train(args, on_step=die, say=lambda s: None)
        msg = "finished"
    except Exception as e:
        msg = str(e)
    with open(path, "w") as f:
        f.write(f"{time.monotonic() - t0:.1f}\n{msg}")
    os._exit(0)


@pytest.mark.timeout(120)
def test_a_dead_rank_is_named_by_the_survivors(tmp_path):
    ctx = mp_context()
    port = free_port()
    path = str(tmp_path / "rank0.txt")
    procs = [ctx.Process(target=_train_until_rank1_dies, args=(r, 2, port, path)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=90)
        assert procs[0].exitcode == 0, "rank 0 did not exit on its own within 90 s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    assert procs[1].exitcode == 7
    elapsed, msg = open(path).read().split("\n", 1)
    assert "rank 1 stopped (no heartbeat)" in msg, msg
    assert float(elapsed) < 60  # well within the 30 s process-group timeout plus start-up


def _inductor_ranks(rank, world):
    """What the Inductor tests below check, one after another in one process per rank:
    ``matches`` (``_lynx_tp_matches`` under Inductor: sequence-parallel Llama), then ``windows``
    and ``no_windows`` (``_inductor_window_code`` with windows on and off: Megatron-style GPT,
    checked against one process too). A part that raises stops the rank (the others would wait
    in its collectives), naming the part."""
    parts = {"matches": (_lynx_tp_matches, ([("llama", True)], "inductor")),
             "windows": (_inductor_window_code, (True,)),
             "no_windows": (_inductor_window_code, (False,))}
    out = {}
    for name, (fn, args) in parts.items():
        try:
            out[name] = fn(rank, world, *args)
        except Exception as e:
            raise RuntimeError(f"part {name!r} of _inductor_ranks failed on rank {rank}") from e
    return out


@pytest.fixture(scope="module")
def inductor_runs():
    """Rank 0's and 1's ``_inductor_ranks`` results: one run of 2 ranks for the module's
    Inductor tests (if it fails, each of them fails with its error)."""
    return run_ranks(_inductor_ranks, 2, timeout_s=1100)


@pytest.mark.timeout(1200)
def test_lynx_tensor_parallel_under_inductor_matches_single_process(inductor_runs):
    """TP=2 on gloo with the default compiler (Inductor): Megatron-style GPT and sequence-
    parallel Llama give the single-process loss and gradients (checked on every rank), with
    recompute inside the budget. The GPT runs are the window test's (at ``WINDOW_BUDGET``, where
    the plan recomputes matmuls in the windows, with and without windows): one compile of the
    same model and path serves both tests."""
    results = [r["matches"] for r in inductor_runs]
    for per_rank in zip(*results):
        r = per_rank[0]
        assert r["name"] == "llama" and r["sp"], r
        assert r["peak_fraction"] <= BUDGET + 0.02 and r["recomputed"], r
    for part in ("windows", "no_windows"):
        r = inductor_runs[0][part]
        assert r["peak_fraction"] <= WINDOW_BUDGET + 0.02 and r["recomputed"], (part, r)


def _kernels_inside_windows(code: str, prefix: tuple[str, ...] = ("extern_kernels.", "cpp_fused")) -> int:
    """Kernel calls the generated backward makes between a collective's issue and its wait
    (``prefix``: which calls count; extern kernels are matmuls, never fused)."""
    inside, count = False, 0
    for line in code.splitlines():
        line = line.strip()
        if "_c10d_functional.all_reduce_" in line or "_c10d_functional.reduce_scatter" in line \
                or "_c10d_functional.all_gather" in line:
            inside = True
        elif "_c10d_functional.wait_tensor" in line:
            inside = False
        elif inside and (line.startswith(prefix) or ".run(" in line):
            count += 1
    return count


MATMULS = ("mm", "bmm", "addmm", "baddbmm")


def _inductor_window_code(rank, world, windows, pin=True):
    from torch._inductor.utils import run_and_get_code

    import lynx_compile.compiler.inductor_partition as lynx_inductor
    from lynx_compile.decisions import Window
    from lynx_compile.passes import meta

    window_matmuls = []
    pipeline = lynx_inductor.POST_GRAD_PIPELINE
    *before, real_pin = pipeline
    assert real_pin.__name__ == "pin_windows_pass", pipeline

    @functools.wraps(real_pin)
    def counting_pin(gm, ctx):  # count the recomputed matmuls the plan put in windows, then pin
        window_matmuls.extend(n.name for n in gm.graph.nodes if isinstance(n.meta.get(meta.DECISION), Window)
                              and n.meta.get(meta.RECOMPUTED)  # (the forward's originals carry it too)
                              and getattr(n.target, "__name__", "").split(".")[0] in MATMULS)
        return real_pin(gm, ctx) if pin else gm

    lynx_inductor.POST_GRAD_PIPELINE = (*before, counting_pin)
    try:
        cfg = CONFIGS["gpt"]
        torch.manual_seed(0)
        model = tensor_parallelize(build_model(cfg), dist.group.WORLD)
        torch._dynamo.reset()
        backend = lynx_compile.backend(policy="lynx", memory_budget=WINDOW_BUDGET, solver="highs",
                                       plan_cache=False, hardware="cpu", link="pcie4", windows=windows)
        compiled = torch.compile(model, backend=backend)
        # no FX-graph cache: an earlier compile of the same graph (in this process, or an earlier
        # test or run) would serve it without running the post-grad passes (the code is the same;
        # the count above would be empty)
        losses = []

        def step():
            loss = compiled(_batch(cfg)).loss
            loss.backward()
            losses.append(loss)

        with torch._inductor.config.patch(fx_graph_cache=False):
            _, codes = run_and_get_code(step)
    finally:
        lynx_inductor.POST_GRAD_PIPELINE = pipeline
    _assert_matches_one_process(f"gpt under Inductor, windows={windows}", cfg, False, model, losses[0])
    plan = backend.plans[-1]
    counts = plan.decisions.counts()
    moved = backend.records[-1].stats.get("recompute_nodes_in_windows", 0)
    return {"inside": _kernels_inside_windows(codes[-1]), "moved": moved, "window_matmuls": window_matmuls,
            "matmuls_inside": _kernels_inside_windows(codes[-1], ("extern_kernels.",)),
            "ordered": codes[-1].count("Unsorted Source Nodes"),
            "peak_fraction": plan.peak_fraction, "recomputed": counts["demand"] + counts["window"]}


@pytest.mark.timeout(1200)
def test_inductor_keeps_recompute_inside_the_windows(inductor_runs):
    """Under Inductor, lynx's ``pin_windows_pass`` post-grad pass adds ordering edges (torch's
    ``control_deps``): the wait runs after the window's recomputes, which run after the issue.
    Checked on the generated backward: every recomputed matmul the plan put in a window is an
    extern-kernel call between a collective's issue and its wait, and more kernels run inside
    windows than without them."""
    with_windows, without = inductor_runs[0]["windows"], inductor_runs[0]["no_windows"]
    assert with_windows["moved"] > 0 and without["moved"] == 0, (with_windows, without)
    assert with_windows["inside"] > without["inside"], (with_windows, without)
    assert with_windows["window_matmuls"] and with_windows["ordered"] > 0, with_windows
    assert with_windows["matmuls_inside"] >= len(with_windows["window_matmuls"]), with_windows
