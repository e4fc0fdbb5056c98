"""How far the step simulator is from measured runs: issue C (TP=2) and D (PP=2) on CPU gloo.

Not a test. Reads the measured results the TP and pipeline benchmarks committed
(``results/tp_overlap.{md,csv}``, ``results/pipeline.csv``), rebuilds each configuration's
simulator input from what lynx predicted for it, replays it with ``lynx_compile.sim``, and writes
``results/sim_validation.md`` with the error per configuration (target: within 15%).

    python benchmarks/validate_sim.py

TP runs (emulated link): one stage of 4 identical layers; the compute-only step T0 the benchmark
measured is split F : B = 1 : 2 over the layers; the modeled communication per step is split over
two all-reduces per layer each way (blocking, as the simulator assumes); the recompute each plan
predicts is on demand (``pred_exposed_ms``) or inside the windows (the rest). A second row per
configuration drops the collectives (hidden behind independent compute, as gloo's asynchronous
collectives allow on CPU), leaving T0 plus the exposed recompute.
Pipeline runs: the prediction is the stage planner's timeline (``pipelining.schedule_sim``, which
``sim.step`` reproduces to 1e-12 on one-layer stages, tested) from the profiled per-stage costs.
"""
from __future__ import annotations

import csv
import dataclasses
import os
import re
import sys

from lynx_compile.sim import LayerSim, StageSim, StepSim, simulate_iteration

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LAYERS = 4  # gpt-small


def tp_rows() -> list[dict]:
    text = open(os.path.join(RESULTS, "tp_overlap.md")).read()
    t0 = float(re.search(r"compute-only step T0 = ([\d.]+) ms", text).group(1)) / 1e3
    comm = float(re.search(r"communication, ([\d.]+) ms/step", text).group(1)) / 1e3
    rows = []
    for r in csv.DictReader(open(os.path.join(RESULTS, "tp_overlap.csv"))):
        if r["error"]:
            continue
        rec, exposed = float(r["pred_recompute_ms"]) / 1e3, float(r["pred_exposed_ms"]) / 1e3
        c = comm / (4 * LAYERS)  # two all-reduces forward, two backward, per layer
        window = max(rec - exposed, 0.0) / LAYERS
        layer = LayerSim(forward_s=t0 / 3 / LAYERS, backward_s=2 * t0 / 3 / LAYERS,
                         tp_forward_comm_s=(c, c), tp_backward_comm_s=(c, c),
                         recompute_on_demand_s=exposed / LAYERS,
                         recompute_in_window_s=(window / 2, window / 2) if window else ())
        sim = simulate_iteration(StepSim(stages=(StageSim(layers=(layer,) * LAYERS),), num_microbatches=1))
        rows.append(_row("C: TP=2 gpt-small, emulated link, collectives blocking", r["config"],
                         sim.iteration_s * 1e3, float(r["step_ms"])))
        # the same with the collectives hidden behind independent compute (what gloo's async
        # collectives under the emulated link allow): only recompute adds to T0
        free = dataclasses.replace(layer, tp_forward_comm_s=(), tp_backward_comm_s=(),
                                   recompute_in_window_s=())
        sim = simulate_iteration(StepSim(stages=(StageSim(layers=(free,) * LAYERS),), num_microbatches=1))
        rows.append(_row("C: same, collectives overlapped", r["config"], sim.iteration_s * 1e3,
                         float(r["step_ms"])))
    return rows


def pp_rows() -> list[dict]:
    rows = []
    for r in csv.DictReader(open(os.path.join(RESULTS, "pipeline.csv"))):
        if r["error"] or r["pred_step_ms"] in ("", "-"):
            continue
        name = f"memory {r['memory_level']}, {r['split']}, layers {r['layers']}, in-wait {r['recompute_in_wait']}"
        rows.append(_row("D: PP=2 gpt-small (8 layers), 1F1B, no link emulation", name,
                         float(r["pred_step_ms"]), float(r["step_ms"])))
    return rows


def _row(group: str, config: str, predicted_ms: float, measured_ms: float) -> dict:
    err = (predicted_ms - measured_ms) / measured_ms
    return {"runs": group, "config": config, "predicted_ms": predicted_ms, "measured_ms": measured_ms,
            "error": err, "within_15pct": abs(err) <= 0.15}


def calibrate(rows: list[dict]) -> None:
    """Per group of runs, one factor measured / predicted taken from its first configuration and
    applied to the rest: how well the simulator ranks and spaces configurations once its
    absolute scale is fixed (the first row of each group is the calibration point, error 0)."""
    for group in dict.fromkeys(r["runs"] for r in rows):
        members = [r for r in rows if r["runs"] == group]
        factor = members[0]["measured_ms"] / members[0]["predicted_ms"]
        for r in members:
            r["calibrated_ms"] = r["predicted_ms"] * factor
            r["calibrated_error"] = (r["calibrated_ms"] - r["measured_ms"]) / r["measured_ms"]


def main() -> int:
    rows = tp_rows() + pp_rows()
    calibrate(rows)
    keys = list(rows[0])
    lines = ["Simulator against measured step times (CPU, gloo; the measurements are the committed results of "
             "bench_tp_overlap.py and bench_pipeline.py: 2-core x86_64, torch 2.13.0+cpu).", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:+.1%}" if k.endswith("error") else f"{v:.1f}" if isinstance(v, float)
                                         else str(v) for k, v in r.items()) + " |")
    within = sum(r["within_15pct"] for r in rows)
    mean_abs = sum(abs(r["error"]) for r in rows) / len(rows)
    rest = [r for r in rows if r["calibrated_ms"] != r["measured_ms"]]
    cal_within = sum(abs(r["calibrated_error"]) <= 0.15 for r in rest)
    cal_mean = sum(abs(r["calibrated_error"]) for r in rest) / len(rest)
    lines += ["", f"Uncalibrated: {within} of {len(rows)} configurations within 15%; mean |error| {mean_abs:.1%}. "
              f"Calibrated (one factor per group from its first row, which is then excluded): {cal_within} of "
              f"{len(rest)} within 15%; mean |error| {cal_mean:.1%}."]
    with open(os.path.join(RESULTS, "sim_validation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
