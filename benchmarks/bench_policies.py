"""Step time and peak activation memory per recompute policy, GPT small/medium on CPU.

    python benchmarks/bench_policies.py [--models gpt-small gpt-medium] [--steps 6]

Writes benchmarks/results/policies.csv and policies.md (machine, versions, date included).
A benchmark measures; it asserts nothing about speed. Each policy trains a copy of the same
model (same seed, batches and dropout seeds) for --steps AdamW steps; step time is the median
of the steps after the first (compile excluded); the peak is one extra fw+bw measured at the
allocator level (lynx_compile.memory.measure_step).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

from lynx_compile.demo import run_policy
from lynx_compile.models import build_model, example_batch
from lynx_compile.report import csv_text, environment, markdown_table

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def bench(preset: str, batch: int, steps: int, torch_budgets: list[float]) -> list[dict]:
    torch.manual_seed(0)
    base = build_model(preset)
    g = torch.Generator().manual_seed(0)
    batches = [example_batch(base, batch, generator=g) for _ in range(steps)]
    runs = [("eager", None, None), ("none", "none", {}), ("selective", "selective", {}),
            ("full", "full", {})]
    runs += [(f"torch@{b}", "torch", {"memory_budget": b}) for b in torch_budgets]
    rows = []
    eager_losses = None
    none_peak = None
    for label, policy, options in runs:
        print(f"  {preset}: {label} ...", file=sys.stderr, flush=True)
        r = run_policy(policy, base, batches, options=options)
        if eager_losses is None:
            eager_losses = r.losses
        if label == "none":
            none_peak = r.peak_bytes
        rows.append({
            "model": preset, "batch": batch, "policy": label,
            "step_ms": round(r.step_s * 1e3, 2),
            "peak_MiB": round(r.peak_bytes / 2**20, 3),
            "peak_vs_none": round(r.peak_bytes / none_peak, 3) if none_peak else None,
            "predicted_peak_MiB": round(r.predicted_peak_bytes / 2**20, 3) if r.predicted_peak_bytes else None,
            "saved_MiB": round(r.saved_bytes / 2**20, 3) if r.saved_bytes is not None else None,
            "loss_equals_eager": all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r.losses, eager_losses)),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt-small", "gpt-medium"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--torch-budgets", type=float, nargs="+", default=[0.5])
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
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
