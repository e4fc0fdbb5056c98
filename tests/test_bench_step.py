"""benchmarks/bench_step.py: rows of the quick shape from its function API, and its reporting.

The lynx variant uses ``compiler="eager"`` to stay cheap (an Inductor compile on CPU takes
tens of seconds); the script's own default is ``"inductor"``.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_step  # noqa: E402

QUICK = bench_step.Settings(model="gpt-tiny", layers=4, seq=64, batch=2, warmup=2, steps=2, lynx_compiler="eager")


def test_eager_and_lynx_none_rows_have_the_fields_and_the_eager_loss():
    threads = torch.get_num_threads()
    try:
        eager = bench_step.run_variant("eager", QUICK)  # in this process (it sets 1 thread)
    finally:
        torch.set_num_threads(threads)
    lynx = bench_step.run_in_subprocess("lynx-none", QUICK, timeout_s=240)
    for row in (eager, lynx):
        assert row["result"] == "ok", row
        for key in ("step_ms", "peak_MiB", "first_step_s", "loss", "loss_equals_eager", "grad_rel_diff"):
            assert row[key] is not None, (row["variant"], key)
        assert row["peak_MiB"] > 0 and row["step_ms"] > 0
        assert row["grads_equal_eager"]
    assert lynx["loss"] == pytest.approx(eager["loss"], rel=1e-6)
    assert lynx["predicted_peak_MiB"] == pytest.approx(lynx["peak_MiB"], rel=0.02)  # eager compiler: exact
    assert lynx["lynx_graphs"] == 1


def test_foreign_model_builds_and_checkpoints_its_layers():
    s = bench_step.Settings(model="gqa:gpt-tiny", attn="manual", dropout=0.1)
    model, loss_of = bench_step.build(s)
    assert bench_step.transformer_blocks(model) == list(model.layers)
    bench_step.checkpoint_blocks(model)
    torch.manual_seed(0)
    loss_of(model).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_budget_error_is_a_refusal_and_anything_else_an_error():
    from lynx_compile.decisions import BudgetError

    try:
        try:
            raise BudgetError("memory_budget=0.5 is below what can be reached\nsecond line")
        except BudgetError as inner:
            raise RuntimeError("backend failed") from inner
    except RuntimeError as exc:
        assert bench_step.describe_failure(exc) == "refused: memory_budget=0.5 is below what can be reached"
    assert bench_step.describe_failure(KeyError("x")) == "error: KeyError: 'x'"


def test_reporting_pairs_each_lynx_budget_with_the_fastest_torch_point_below_it(tmp_path):
    rows = [{"model": "m", "variant": v, "result": "ok", "step_ms": ms, "peak_MiB": mib}
            for v, ms, mib in [("eager", 10.0, 100.0), ("inductor", 8.0, 90.0), ("inductor-b0.5", 9.0, 60.0),
                               ("inductor-b0.0", 12.0, 50.0), ("lynx-b0.5", 11.0, 55.0), ("lynx-b0.3", 13.0, 40.0)]]
    rows.append({"model": "m", "variant": "lynx-b0.1", "result": "refused: too low"})
    lines = bench_step.summary(rows)
    assert "inductor-b0.0" in lines[0] and "lynx / torch = 0.917" in lines[0]
    assert "no torch.compile point" in lines[1]
    assert lines[2] == "m lynx-b0.1: refused: too low"
    text = bench_step.write_results(str(tmp_path), "step_cpu", rows, [bench_step.Settings(model="m")], ["--quick"],
                                    [])
    assert "| model" in text and "- m lynx-b0.1: refused: too low" in text
    for ext in ("csv", "md", "png"):
        assert (tmp_path / f"step_cpu.{ext}").stat().st_size > 0


def test_each_torch_setting_is_paired_with_the_fastest_lynx_point_at_no_more_memory():
    """Issue R's measure: for each torch.compile budget setting, the fastest lynx point whose peak
    is no higher; with interleaved rounds the ratio is the median of per-round ratios (drift
    cancels: here every round of lynx is 0.95x the same round of torch, though their medians
    differ more)."""
    torch_rounds = [10.0, 10.0, 20.0, 20.0, 20.0]
    rows = [{"model": "m", "variant": "inductor-b0.5", "result": "ok", "step_ms": 20.0, "peak_MiB": 60.0,
             "step_rounds": torch_rounds},
            {"model": "m", "variant": "inductor-b0.1", "result": "ok", "step_ms": 9.0, "peak_MiB": 30.0},
            {"model": "m", "variant": "lynx-b0.5", "result": "ok", "step_ms": 19.0, "peak_MiB": 55.0,
             "step_rounds": [0.95 * t for t in torch_rounds]},
            {"model": "m", "variant": "lynx-b0.7", "result": "ok", "step_ms": 25.0, "peak_MiB": 58.0},
            {"model": "m", "variant": "lynx-b0.4", "result": "refused: too low"}]
    lines = bench_step.torch_settings_summary(rows)
    assert lines[0].startswith("m inductor-b0.5 (20 ms at 60 MiB): fastest lynx at or below: lynx-b0.5")
    assert lines[0].endswith("lynx / torch = 0.95")
    assert lines[1] == "m inductor-b0.1 (9 ms at 30 MiB): no lynx point at or below that peak"
    assert bench_step.paired_ratio(rows[3], rows[0]) == 25.0 / 20.0  # no rounds: ratio of medians


def test_interleaved_rounds_become_the_rows_step_time():
    """``take_interleaved`` (bench_step and gpu_session.sh alike): a timed row's step_ms is the
    median of its rounds, its own process's time kept; a row not timed is left as it was."""
    rows = [{"variant": "a", "step_ms": 5.0}, {"variant": "b", "step_ms": 7.0}]
    bench_step.take_interleaved(rows, {"a": [3.0, 1.0, 2.0]})
    assert rows[0] == {"variant": "a", "step_ms": 2.0, "step_ms_own_process": 5.0, "step_rounds": [3.0, 1.0, 2.0]}
    assert rows[1] == {"variant": "b", "step_ms": 7.0}


def test_match_torch_puts_lynx_at_each_torch_settings_measured_peak():
    """``--match-torch``: lynx's budget at torch's measured peak over the no-recompute one, rounded
    up at the sixth digit (torch's own plan, one of lynx's candidates, fits it; rounded down at
    the third it missed by up to 0.1%); one variant per distinct fraction."""
    rows = [{"model": "m", "variant": "inductor", "result": "ok", "peak_MiB": 10.0, "step_ms": 1.0},
            {"model": "m", "variant": "inductor-b0.5", "result": "ok", "peak_MiB": 6.7779, "step_ms": 1.0},
            {"model": "m", "variant": "inductor-b0.3", "result": "ok", "peak_MiB": 6.7771, "step_ms": 1.0},
            {"model": "m", "variant": "inductor-b0.1", "result": "error: x"},
            {"model": "n", "variant": "inductor-b0.5", "result": "ok", "peak_MiB": 3.0, "step_ms": 1.0}]
    assert bench_step.matching_lynx_variants(rows, "m") == ["lynx-b0.67779", "lynx-b0.67771"]
    rows[1] = {**rows[1], "peak_MiB": 6.77791}
    assert bench_step.matching_lynx_variants(rows, "m")[0] == "lynx-b0.677791"
    assert bench_step.matching_lynx_variants(rows, "n") == []  # no inductor row: nothing to match


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_cuda_without_a_gpu_exits_2():
    assert bench_step.main(["--device", "cuda"]) == 2


def test_copies_at_different_torch_budgets_each_compile_their_own_graph():
    """``--interleave`` times every variant in one process, each on its own copy of the model.
    dynamo shares a compiled frame between copies compiled with the same backend (its guards are
    on the parameters' shapes), so ``inductor-b<B>`` compiles with a backend of its own per
    budget: three copies at three settings give three compiled graphs, not one."""
    from torch._dynamo.utils import counters

    from lynx_compile.tools import variants

    torch.compiler.reset()
    before = counters["stats"]["unique_graphs"]
    for name in ("inductor", "inductor-b0.5", "inductor-b0.0"):
        model, loss_of = bench_step.build(QUICK)
        # the forward compiles the graph dynamo counts (and partitions it at the budget); the
        # backward, compiled lazily at its first call, adds no graph to the count
        loss_of(variants.prepare(name, model))
    assert counters["stats"]["unique_graphs"] - before == 3
