"""The time-model bench's statistics (benchmarks/bench_time_model.py): what its table claims is
computed as its docstring says, on hand-made rounds."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_time_model  # noqa: E402


def _row(name: str, backward_ms: list[float], peak: float = 0.5) -> dict:
    rounds = [(0.001, b / 1e3) for b in backward_ms]
    ordered = sorted(backward_ms)
    return {"model": "m", "candidate": name, "peak": peak, "rounds": rounds, "bw_ms": ordered[len(ordered) // 2],
            "step_ms": 1.0 + ordered[len(ordered) // 2]}


def test_held_out_ratio_chooses_the_fastest_on_one_half_and_measures_on_the_other():
    """Two candidates whose per-round times swap between even and odd rounds: on the rounds it was
    chosen on each looks 10% faster than the pick, on the held-out rounds it is 10% slower.
    Choosing and measuring on the same rounds (the least of the medians) would call the pick slow."""
    pick = _row("lynx-b0.5", [10.0] * 8)
    lucky_even = _row("a", [9.0, 11.0] * 4)
    lucky_odd = _row("b", [11.0, 9.0] * 4)
    ratio, names = bench_time_model.held_out_ratio(pick, [pick, lucky_even, lucky_odd], part=1)
    assert abs(ratio - 10.0 / 11.0) < 1e-12
    assert names == "a/b"


def test_held_out_ratio_is_paired_per_round():
    """Drift that scales every candidate in a round alike cancels: the pick is 1.02x the other in
    every round, whatever the round's speed."""
    drift = [1.0, 3.0, 1.5, 2.0, 1.0, 2.5]
    pick = _row("lynx-b0.7", [10.2 * d for d in drift])
    other = _row("torch", [10.0 * d for d in drift])
    ratio, names = bench_time_model.held_out_ratio(pick, [pick, other], part=1)
    assert abs(ratio - 1.02) < 1e-9 and names == "torch"


def test_spearman_against_hand_ranks():
    assert bench_time_model.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert bench_time_model.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    # ranks (1, 2, 3, 4) against (2, 1, 4, 3): 1 - 6 * 4 / (4 * 15) = 0.6
    assert abs(bench_time_model.spearman([1, 2, 3, 4], [2, 1, 4, 3]) - 0.6) < 1e-12
