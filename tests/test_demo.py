"""``lynx demo`` (lynx_compile/demo.py) and what it is built from: variant names
(lynx_compile/variants.py) and the profiler's log filter (lynx_compile/memory/measure.py)."""
import os

import pytest
import torch

from lynx_compile import cli
from lynx_compile.demo import DEMO_VARIANTS, run_demo, why_not_equal
from lynx_compile.memory.measure import cpu_peak_bytes, without_kineto_log
from lynx_compile.variants import describe, lynx_options, parse_variant


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_runs_every_variant_with_eager_gradients_and_writes_table_and_plot(tmp_path, capfd):
    pytest.importorskip("matplotlib")
    # batch 4: at batch 1 gpt-tiny's full recompute peaks at 0.507 of its no-recompute peak (the
    # fused memory model), so the demo's budget 0.5 is below what anything reaches there
    result = run_demo("gpt-tiny", batch_size=4, warmup=1, steps=1, device="cpu", out=str(tmp_path))
    out, err = capfd.readouterr()
    print(result.text)  # shown on failure
    assert [r["variant"] for r in result.rows] == list(DEMO_VARIANTS)
    for r in result.rows:
        assert r["result"] == "ok", r
        assert r["step_ms"] > 0 and r["peak_MiB"] > 0, r
        # dropout 0, fp32: every variant, compiled by Inductor or not, has eager's gradients
        assert r["grads_equal_eager"] and r["why_not_equal"] is None, r
        if r["variant"].startswith("lynx-"):
            assert r["predicted_peak_MiB"] > 0 and r["lynx_graphs"] >= 1, r
    by_name = {r["variant"]: r for r in result.rows}
    assert by_name["checkpoint"]["grad_rel_diff"] == 0.0  # the same ops, recomputed: bit-identical
    assert "USDT" not in err and "USDT" not in out  # the profiler's start/stop lines are dropped
    assert result.table_path == str(tmp_path / "demo_cpu.md") and result.plot_path == str(tmp_path / "demo_cpu.png")
    assert os.path.getsize(result.plot_path) > 0
    table = (tmp_path / "demo_cpu.md").read_text()
    for name in DEMO_VARIANTS:
        assert f"| {name} " in table
    assert "![Pareto plot" in table and "torch.compile, activation_memory_budget=0.5" in table


def test_profiler_log_lines_are_dropped_and_other_stderr_is_kept(capfd):
    assert cpu_peak_bytes(lambda: torch.ones(4096).sum()) >= 4096 * 4
    with without_kineto_log():
        os.write(2, b"USDT:2026-01-01 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"STAGE:2026-01-01 1:1 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n")
        os.write(2, b"a real warning\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "STAGE" not in err
    assert "a real warning" in err


def test_variant_names_parse_describe_and_give_lynx_options():
    assert parse_variant("inductor-b0.5").budget == 0.5
    assert parse_variant("lynx-torch-b0.5").policy == "torch"
    assert lynx_options("lynx-torch-b0.5") == {"policy": "torch", "compiler": "inductor", "memory_budget": 0.5}
    assert lynx_options("lynx-b0.7", solver="heu")["solver"] == "heu"
    assert lynx_options("lynx-none") == {"policy": "none", "compiler": "inductor"}
    assert lynx_options("checkpoint") is None
    assert describe("inductor-b0.5") == "torch.compile, activation_memory_budget=0.5"
    assert describe("checkpoint") == "eager, torch.utils.checkpoint per block"
    for bad in ("lynx-b0", "inductor-b1.5", "lynx-torch", "compiled"):
        with pytest.raises(ValueError, match="known: eager, checkpoint"):
            parse_variant(bad)


def test_why_gradients_differ_is_said():
    row = {"variant": "lynx-b0.5", "result": "ok", "grad_rel_diff": 3e-3}
    assert why_not_equal(row, dropout=0.1) == "Inductor draws its own dropout masks"
    assert why_not_equal(row, dropout=0.1, lynx_compiler="eager") == "differs by 3.0e-03 (> 1e-05)"
    assert why_not_equal({**row, "grad_rel_diff": 1e-7}, dropout=0.0) is None
    assert why_not_equal({"variant": "lynx-b0.5", "result": "refused: too low"}, dropout=0.0) == "did not run"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_demo_on_cuda_without_a_gpu_is_one_line_and_exit_2(capsys):
    assert cli.main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "lynx: error: --device cuda: no CUDA device is available (use --device cpu or auto)"
