"""benchmarks/bench_peers.py: its smallest rows in-process on gpt-tiny (eager peers, no compile),
and its report (table, pairs, plot) from rows made up here."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_peers  # noqa: E402


@pytest.mark.parametrize("peer", ["checkpoint-full/eager", "sac-mm/eager", "torch_remat-save-attn/eager"])
def test_row_gpt_tiny(peer):
    if peer.startswith("torch_remat") and importlib.util.find_spec("torch_remat") is None:
        pytest.skip("torch_remat not installed")
    eager = bench_peers.run_row("gpt-tiny", "eager", None, warmup=1, steps=1, threads=1)
    row = bench_peers.run_row("gpt-tiny", peer, None, warmup=1, steps=1, threads=1)
    assert eager["result"] == "ok" and row["result"] == "ok", (eager, row)
    assert row["grad_diff"] <= 1e-6  # eager recompute replays the same ops
    assert 0 < row["ms_MiB"] < eager["ms_MiB"]  # recomputing blocks keeps less than eager


def test_not_applicable_rows():
    assert bench_peers.not_applicable("tt-ac-full", "gpt-tiny").startswith("n/a")
    assert bench_peers.not_applicable("tt-ac-full", "tt-llama3") is None
    assert bench_peers.not_applicable("tt-ac-selective-layer", "tt-llama3").startswith("n/a")


def test_report_pairs_and_plot(tmp_path):
    ok = dict(result="ok", tree="x", wall_s=1.0, grad_diff=1e-7, first_step_s=1.0)
    rows = [
        {**ok, "model": "m", "peer": "inductor", "budget": None, "ms_MiB": 4.0, "step_ms": 10.0},
        {**ok, "model": "m", "peer": "checkpoint-full/eager", "budget": None, "ms_MiB": 1.0, "step_ms": 20.0},
        {**ok, "model": "m", "peer": "torch-budget@0.5", "budget": 0.5, "ms_MiB": 2.6, "step_ms": 12.0},
        {"model": "m", "peer": "tt-ac-full", "budget": None, "result": "n/a: torchtitan AC applies to torchtitan models"},
    ]
    assert bench_peers.lynx_budgets(rows, "m") == [0.25, 0.65]
    near = {**ok, "model": "m", "peer": "sac-mm/eager", "budget": None, "ms_MiB": 1.06, "step_ms": 30.0}
    assert bench_peers.lynx_budgets(rows + [near], "m") == [0.25, 0.26, 0.65]
    rows += [
        {"model": "m", "peer": "lynx@0.25", "budget": 0.25, "result": "refused: use memory_budget >= 0.4"},
        {**ok, "model": "m", "peer": "lynx@0.65", "budget": 0.65, "ms_MiB": 2.5, "step_ms": 11.0},
        {**ok, "model": "m", "peer": "lynx@min", "budget": 0.4, "ms_MiB": 1.6, "step_ms": 13.0},
    ]
    text = bench_peers.write(str(tmp_path), "peers", rows, ["--quick"], [], "env", "git", done=True)
    pairs = bench_peers.pair_lines(bench_peers.finish(rows))
    assert any("below lynx's smallest reachable budget" in p and "less: checkpoint-full/eager" in p for p in pairs)
    assert any(p.startswith("m: lynx@0.65 vs torch-budget@0.5") and "less: lynx" in p for p in pairs)
    assert "lynx@min=0.4" in text
    assert (tmp_path / "peers.csv").exists() and (tmp_path / "peers.png").exists()
