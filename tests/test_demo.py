"""``lynx demo`` (lynx_compile/tools/demo.py, demo_table.py, demo_plot.py) and what it is built
from: variant names and the per-block compile style (lynx_compile/tools/variants.py), the plot's label
placement, and the profiler's log filter (lynx_compile/memory/measure.py)."""
import argparse
import os

import pytest
import torch

from lynx_compile.memory.measure import cpu_peak_bytes, without_kineto_log
from lynx_compile.tools import cli
from lynx_compile.tools.demo import DEMO_BATCH, DEMO_LAYERS, DEMO_MODEL, DEMO_SEQ, DEMO_VARIANTS, cmd_demo, demo_shape, \
    run_demo, why_not_equal
from lynx_compile.tools.demo_plot import _centre, _crosses, _overlap, _segments_cross, label_boxes, plot_demo
from lynx_compile.tools.demo_table import short_result
from lynx_compile.tools.variants import describe, lynx_options, min_warmup, parse_variant, prepare

# the demo's code path on a small shape: the default model (gpt-small) at 2 layers and sequence
# 128, per-block compiles; lynx at 0.7 (reachable: ~0.52 here) and at 0.1 (refused)
SMALL = dict(n_layers=2, seq_len=128, steps=1, device="cpu")
SMALL_VARIANTS = ("eager", "checkpoint", "inductor", "lynx-b0.7", "lynx-b0.1")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_per_block_rows_gradients_budget_refusal_table_and_plot(tmp_path, capfd):
    pytest.importorskip("matplotlib")
    result = run_demo(**SMALL, variants=SMALL_VARIANTS, out=str(tmp_path))
    out, err = capfd.readouterr()
    print(result.text)  # shown on failure
    assert [r["variant"] for r in result.rows] == list(SMALL_VARIANTS)
    by_name = {r["variant"]: r for r in result.rows}
    for name in ("eager", "checkpoint", "inductor", "lynx-b0.7"):
        r = by_name[name]
        assert r["result"] == "ok", r
        assert r["step_ms"] > 0 and r["peak_MiB"] > 0, r
        # dropout 0, fp32: every variant that ran, compiled by Inductor or not, has eager's gradients
        assert r["grads_equal_eager"] and r["why_not_equal"] is None, r
        assert r["style"] == "per-block"
    assert by_name["checkpoint"]["grad_rel_diff"] == 0.0  # the same ops, recomputed: bit-identical
    lynx, compiled = by_name["lynx-b0.7"], by_name["inductor"]
    # the step plan holds (planned at step 2, run from step 3, before the timed steps), and the
    # measured peak is below torch.compile's without a budget (of which 0.7 is the fraction)
    assert lynx["peak_MiB"] < compiled["peak_MiB"]
    assert lynx["peak_MiB"] <= 0.7 * compiled["peak_MiB"] * 1.05
    assert lynx["predicted_peak_MiB"] > 0 and lynx["lynx_graphs"] >= 1
    # a budget no plan reaches is a row marked refused, naming the smallest reachable budget
    refused = by_name["lynx-b0.1"]
    assert refused["result"].startswith("refused: ") and "memory_budget >=" in refused["result"], refused
    assert short_result(refused).startswith("refused (reachable >= 0.")
    assert "USDT" not in err and "USDT" not in out  # the profiler's start/stop lines are dropped
    # each variant said before it runs (compiling is silent otherwise), then its result
    n = len(SMALL_VARIANTS)
    for i, name in enumerate(SMALL_VARIANTS):
        before = err.index(f"[{i + 1}/{n}] {name} (")
        assert "the first compiling" in err[before:].splitlines()[0]
        assert err.index(f"[{i + 1}/{n}] {name}: ", before) > before
    assert result.table_path == str(tmp_path / "demo_cpu.md") and result.plot_path == str(tmp_path / "demo_cpu.png")
    assert os.path.getsize(result.plot_path) > 0
    table = (tmp_path / "demo_cpu.md").read_text()
    for name in SMALL_VARIANTS:
        assert f"| {name} " in table
    assert "![peak memory vs step time" in table and "torch.compile per block" in table
    assert "refused (reachable >= 0." in table and "- lynx-b0.1: refused: " in table
    assert "gpt-small (2 layers, hidden 128, seq 128), batch 2" in table
    # the plot of these rows: one label per variant that ran, none overlapping
    fig = plot_demo(result.rows, str(tmp_path / "again.png"), "t", keep_open=True)
    boxes = label_boxes(fig)
    assert len(boxes) == 4
    assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if _overlap(a, b) > 0]


def _row(variant, peak, ms, result="ok"):
    return {"variant": variant, "result": result, "peak_MiB": peak, "step_ms": ms, "model": "m", "style": "per-block"}


@pytest.mark.parametrize("rows", [
    # the default demo's shape of result (2026-11-27): lynx and torch.compile+budget close together
    [_row("eager", 141.4, 305), _row("checkpoint", 31.1, 390), _row("inductor", 137.1, 269),
     _row("inductor-b0.5", 55.8, 255), _row("lynx-b0.7", 92.8, 267), _row("lynx-b0.5", 63.3, 265),
     _row("lynx-b0.2", 26.8, 270), _row("lynx-b0.1", None, None, "refused: ... Use memory_budget >= 0.188 (...)")],
    # crowded: every point within a few percent of the others (a tiny model's step)
    [_row("eager", 1.38, 3.3), _row("checkpoint", 0.86, 6.4), _row("inductor", 1.45, 2.1),
     _row("inductor-b0.5", 0.95, 2.1), _row("lynx-b0.8", 1.11, 2.2), _row("lynx-b0.7", 0.91, 2.24),
     _row("lynx-b0.6", 0.93, 2.2), _row("lynx-b0.5", 0.92, 2.21)],
], ids=["demo", "crowded"])
def test_plot_labels_overlap_nothing_and_stay_inside(tmp_path, rows):
    pytest.importorskip("matplotlib")
    fig = plot_demo(rows, str(tmp_path / "p.png"), "title", keep_open=True)
    assert (tmp_path / "p.png").stat().st_size > 0
    boxes = label_boxes(fig)
    ran = [r for r in rows if r["result"] == "ok"]
    assert len(boxes) == len(ran)
    assert not [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if _overlap(a, b) > 0]
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    for box in boxes:  # inside the axes
        assert frame.x0 <= box[0] and box[2] <= frame.x1 and frame.y0 <= box[1] and box[3] <= frame.y1, box
    anchors = [tuple(ax.transData.transform(t.xy)) for t in ax.texts]
    crossing = [(i, j) for i, b in enumerate(boxes) for j, other in enumerate(boxes)
                if i != j and _crosses(anchors[i], _centre(b), other)]
    assert not crossing  # no label's line runs through another label
    assert not [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes))
                if _segments_cross(anchors[i], _centre(boxes[i]), anchors[j], _centre(boxes[j]))]  # nor another line
    for r in ran:  # no label covers a marker
        cx, cy = ax.transData.transform((r["peak_MiB"], r["step_ms"]))
        assert not [b for b in boxes if b[0] < cx < b[2] and b[1] < cy < b[3]], r["variant"]
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "lynx, memory_budget 0.5" in texts and "torch.compile, activation_memory_budget 0.5" in texts
    if rows[-1]["result"] != "ok":  # the refused variant is said under the plot
        assert any("lynx-b0.1 refused (reachable >= 0.188)" in t.get_text() for t in fig.texts)
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_demo_shape_defaults_and_overrides():
    assert demo_shape(None, None, None, None) == (DEMO_MODEL, DEMO_BATCH, {"n_layers": DEMO_LAYERS,
                                                                          "seq_len": DEMO_SEQ})
    assert (DEMO_MODEL, DEMO_LAYERS, DEMO_SEQ) == ("gpt-small", 8, 512)
    assert demo_shape(None, None, 2, 64) == ("gpt-small", DEMO_BATCH, {"n_layers": 2, "seq_len": 64})
    assert demo_shape("gpt-tiny", None, None, None) == ("gpt-tiny", 4, {})  # the old small demo
    assert demo_shape("gpt-tiny", 2, None, 16) == ("gpt-tiny", 2, {"seq_len": 16})
    assert set(DEMO_VARIANTS) >= {"eager", "checkpoint", "inductor", "inductor-b0.5", "lynx-b0.7", "lynx-b0.5"}


def test_per_block_style_compiles_each_block_and_lynx_warms_up_three_steps():
    from lynx_compile.models import build_model

    model = build_model("gpt-tiny", dropout=0.0)
    assert prepare("inductor", model, style="per-block") is model  # blocks compiled in place
    assert all(type(b).__name__ == "OptimizedModule" or getattr(b, "_compiled_call_impl", None) is not None
               for b in model.blocks)
    assert min_warmup("lynx-b0.5", "per-block") == 3  # step plan recorded at step 2, swapped in at 3
    assert min_warmup("lynx-b0.5", "whole") == 1 and min_warmup("inductor", "per-block") == 1
    with pytest.raises(ValueError, match="compile style"):
        prepare("inductor", model, style="blocks")


def test_refusal_is_shortened_for_the_table():
    row = {"variant": "lynx-b0.1", "result": "refused: memory_budget=0.1 (...) ... Use memory_budget >= 0.188 "
           "(a peak of 25.64MiB)."}
    assert short_result(row) == "refused (reachable >= 0.188)"
    assert short_result({"variant": "x", "result": "error: RuntimeError: " + "x" * 100}).endswith("...")


def test_cmd_demo_reads_the_cli_arguments(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_run_demo(preset, **kw):
        seen.update(kw, preset=preset)
        return _fake_result(tmp_path)

    monkeypatch.setattr("lynx_compile.tools.demo.run_demo", fake_run_demo)
    args = argparse.Namespace(model=None, batch_size=None, layers=2, seq_len=64, steps=None, compile=None,
                              device="cpu", out=str(tmp_path))
    assert cmd_demo(args) == 0
    assert seen["preset"] is None and seen["n_layers"] == 2 and seen["seq_len"] == 64
    assert seen["style"] == "per-block" and seen["steps"] == 10
    assert "refused (budget below what lynx reaches): lynx-b0.1" in capsys.readouterr().out


def _fake_result(tmp_path):
    from lynx_compile.tools.demo import DemoResult

    rows = [{**_row("eager", 1.0, 1.0), "grads_equal_eager": True},
            {**_row("lynx-b0.1", None, None, "refused: x"), "grads_equal_eager": False}]
    return DemoResult(rows=rows, text="t", markdown="m", table_path=str(tmp_path / "t.md"), plot_path=None,
                      plot_note="n", device="cpu")


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


def test_the_demo_concludes_what_its_rows_show():
    """``demo_table.conclusion``: per peer, the fastest lynx row at no more memory and its step
    time as a multiple of the peer's; then lynx's lowest peak against the peers' (hand-made rows)."""
    from lynx_compile.tools.demo_table import conclusion

    def row(variant, peak, ms, result="ok"):
        return {"variant": variant, "peak_MiB": peak, "step_ms": ms, "result": result}

    rows = [row("eager", 100.0, 50.0), row("checkpoint", 40.0, 80.0), row("inductor", 90.0, 40.0),
            row("inductor-b0.5", 50.0, 44.0), row("lynx-b0.7", 63.0, 42.0), row("lynx-b0.5", 45.0, 43.0),
            row("lynx-b0.2", 20.0, 60.0), row("lynx-b0.1", None, 0.0, result="refused (reachable >= 0.18)")]
    lines = conclusion(rows)
    assert lines[0].startswith("What this table shows")
    by_peer = {line.split(" than ")[1].split(" (")[0]: line for line in lines[1:] if " than " in line}
    assert "lynx-b0.7 (63.00 MiB) takes 0.84x its step time (faster)" in by_peer["eager"]          # 42 / 50
    assert "lynx-b0.2 (20.00 MiB) takes 0.75x its step time (faster)" in by_peer["checkpoint"]     # 60 / 80
    assert "lynx-b0.7 (63.00 MiB) takes 1.05x its step time (slower)" in by_peer["inductor"]       # 42 / 40
    assert "lynx-b0.5 (45.00 MiB) takes 0.98x its step time (faster)" in by_peer["inductor-b0.5"]  # 43 / 44
    assert lines[-1] == ("- lowest memory: lynx-b0.2 at 20.00 MiB, 0.50x the lowest of the others (checkpoint, "
                         "40.00 MiB), at 0.75x its step time")
    assert conclusion([row("eager", 100.0, 50.0)]) == []
