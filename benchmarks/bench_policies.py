"""Step time and peak activation memory per recompute policy, GPT small/medium on CPU.

    python benchmarks/bench_policies.py [--models gpt-small gpt-medium] [--steps 6]

Writes benchmarks/results/policies.csv and policies.md (machine, versions, date included).
A benchmark measures; it asserts nothing about speed. Each policy trains a copy of the same
model (same seed, batches and dropout seeds), in its own process, for --steps AdamW steps; step time is the median
of the steps after the first (compile excluded); the peak is one extra fw+bw measured at the
allocator level (lynx_compile.memory.measure_step).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch

from policy_run import run_policy
from lynx_compile.models import build_model, example_batch
from lynx_compile.tools.report import csv_text, environment, markdown_table

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


RUNS = {"eager": (None, {}), "none": ("none", {}), "selective": ("selective", {}), "full": ("full", {})}


def run_one(preset: str, label: str, batch: int, steps: int) -> dict:
    """Train one (model, policy) and return its measurements (run in a fresh process)."""
    policy, options = RUNS[label] if label in RUNS else ("torch", {"memory_budget": float(label.split("@")[1])})
    torch.manual_seed(0)
    base = build_model(preset)
    g = torch.Generator().manual_seed(0)
    batches = [example_batch(base, batch, generator=g) for _ in range(steps)]
    r = run_policy(policy, base, batches, options=options)
    return {"losses": r.losses, "step_s": r.step_s, "peak": r.peak_bytes,
            "predicted": r.predicted_peak_bytes, "saved": r.saved_bytes}


def bench(preset: str, batch: int, steps: int, torch_budgets: list[float]) -> list[dict]:
    # One process per run: CPU step times depend on the allocator's state (glibc's mmap
    # threshold adapts to earlier allocations), so runs sharing a process disturb each other.
    labels = [*RUNS, *(f"torch@{b}" for b in torch_budgets)]
    rows, eager, none_peak = [], None, None
    for label in labels:
        print(f"  {preset}: {label} ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--one", preset, label, str(batch), str(steps)],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        eager = eager or r["losses"]
        none_peak = r["peak"] if label == "none" else none_peak
        mib = lambda b: round(b / 2**20, 3) if b is not None else None  # noqa: E731
        rows.append({
            "model": preset, "batch": batch, "policy": label, "step_ms": round(r["step_s"] * 1e3, 2),
            "peak_MiB": mib(r["peak"]),
            "peak_vs_none": round(r["peak"] / none_peak, 3) if none_peak else None,
            "predicted_peak_MiB": mib(r["predicted"]), "saved_MiB": mib(r["saved"]),
            "loss_equals_eager": all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], eager)),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt-small", "gpt-medium"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--torch-budgets", type=float, nargs="+", default=[0.5])
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--one", nargs=4, metavar=("MODEL", "POLICY", "BATCH", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        preset, label, batch, steps = args.one
        print(json.dumps(run_one(preset, label, int(batch), int(steps))))
        return
    rows = []
    for preset in args.models:
        rows += bench(preset, args.batch, args.steps, args.torch_budgets)
    env = environment()
    stamp = datetime.date.today().isoformat()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "policies.csv"), "w") as f:
        f.write(csv_text(rows))
    header = (f"# Recompute policies on CPU\n\n{stamp}; {env['cpu']}, {env['threads']} torch threads; "
              f"python {env['python']}, torch {env['torch']}. fp32, dropout 0.1, AdamW, "
              f"batch {args.batch}, median of {args.steps - 1} steps after the first.\n"
              f"Command: `python benchmarks/bench_policies.py {' '.join(sys.argv[1:])}`\n\n")
    table = markdown_table(rows)
    with open(os.path.join(args.out, "policies.md"), "w") as f:
        f.write(header + table + "\n")
    print(header + table)


if __name__ == "__main__":
    main()
