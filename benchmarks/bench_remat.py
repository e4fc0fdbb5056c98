"""Lynx-OPT / Lynx-HEU against the baselines at 30/50/70% of the no-recompute peak.

    python benchmarks/bench_remat.py [--models gpt-small gpt-medium llama-small llama-medium]

Writes benchmarks/results/remat.{csv,md} and remat_search.{csv,md}. A benchmark measures and
asserts nothing. Per (model, method, budget), in a fresh process: train --steps AdamW steps
(fp32, dropout on), report the median step time after the first, the allocator-measured peak
activation memory (gradients excluded, lynx_compile.memory.measure_step), the plan's
prediction, plan time (extract + solve + check) and the solver's exposed-time objective.
`full` and `selective` do not depend on the budget (run once per model); `torch@b` is
min-cut under activation_memory_budget=b; `sac_ilp@b` is torch's selective-checkpoint MILP,
planning only (benchmarks/sac_ilp_baseline.py; its memory includes parameters and gradients,
so its numbers are not comparable one to one). The search table plans gpt-1.3b-style models
(48 layers x seq 512, and the preset's 24 x 2048) on the meta device and runs HEU, OPT-HiGHS
(and OPT-GLPK once) on the same problem at budgets 0.4 / 0.5 / 0.7.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHODS = {"heu": {"policy": "lynx", "solver": "heu"}, "opt-highs": {"policy": "lynx", "solver": "highs"},
           "opt-glpk": {"policy": "lynx", "solver": "glpk", "time_limit_s": 20.0},
           "torch": {"policy": "torch"}, "full": {"policy": "full"}, "selective": {"policy": "selective"}}


def run_one(preset: str, method: str, budget: float | None, batch: int, steps: int) -> dict:
    import torch

    from policy_run import run_policy
    from lynx_compile.models import build_model, example_batch

    options = dict(METHODS[method])
    policy = options.pop("policy")
    if budget is not None:
        options["memory_budget"] = budget
    torch.manual_seed(0)
    base = build_model(preset)
    g = torch.Generator().manual_seed(0)
    batches = [example_batch(base, batch, generator=g) for _ in range(steps)]
    import lynx_compile

    try:
        r = run_policy(policy, base, batches, options=options)
    except Exception as e:  # noqa: BLE001 - an infeasible budget is a result, reported as such
        msg = str(e)
        return {"error": msg[msg.find("smallest reachable"):][:90] if "smallest reachable" in msg else msg[-200:]}
    plan = lynx_compile.backend(policy=policy, **options).plans[-1]
    return {"step_s": r.step_s, "peak": r.peak_bytes, "predicted": r.predicted_peak_bytes,
            "plan_s": plan.plan_time_s, "solve_s": plan.solve_s, "exposed_s": plan.exposed_s,
            "status": plan.solver_status, "reference": plan.reference_peak_bytes}


def _child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", *args], capture_output=True, text=True)
    lines = [ln for ln in out.stdout.strip().splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (out.stderr or "no output")[-200:]}


def bench_model(preset: str, budgets: list[float], batch: int, steps: int) -> list[dict]:
    rows = []
    runs = [(m, None) for m in ("full", "selective")]
    runs += [(m, b) for b in budgets for m in ("heu", "opt-highs", "opt-glpk", "torch")]
    for method, budget in runs:
        print(f"  {preset} {method} @ {budget} ...", file=sys.stderr, flush=True)
        r = _child(preset, method, str(budget), str(batch), str(steps))
        ref = r.get("reference") or 0
        mib = lambda b: round(b / 2**20, 2) if b else None  # noqa: E731
        rows.append({
            "model": preset, "budget": budget if budget is not None else "-", "method": method,
            "step_ms": round(r["step_s"] * 1e3, 1) if "step_s" in r else None,
            "peak_MiB": mib(r.get("peak")), "peak_frac": round(r["peak"] / ref, 3) if ref and r.get("peak") else None,
            "predicted_MiB": mib(r.get("predicted")),
            "plan_s": round(r["plan_s"], 3) if r.get("plan_s") else None,
            "exposed_ms": round(r["exposed_s"] * 1e3, 3) if "exposed_s" in r else None,
            "status": r.get("status") or r.get("error", ""),
        })
    for budget in budgets:
        rows.append(_sac_ilp_row(preset, budget, batch))
    return rows


def _sac_ilp_row(preset: str, budget: float, batch: int) -> dict:
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from sac_ilp_baseline import plan_with_sac_ilp

        from lynx_compile.models import build_model, example_batch

        model = build_model(preset)
        r = plan_with_sac_ilp(model, example_batch(model, batch), budget)
        status, plan_s = r.get("status", ""), r.get("plan_s")
        pred = r.get("predicted_peak_bytes")
    except Exception as e:  # noqa: BLE001 - planning-only baseline; report why it did not run
        status, plan_s, pred = f"not run: {e}"[:80], None, None
    return {"model": preset, "budget": budget, "method": "sac_ilp (plan only)", "step_ms": None,
            "peak_MiB": None, "peak_frac": None,
            "predicted_MiB": round(pred / 2**20, 2) if pred and pred > 0 else None,
            "plan_s": round(plan_s, 3) if plan_s else None, "exposed_ms": None, "status": status[:60]}


SEARCH_CONFIGS = ((48, 512), (24, 2048))
"""(layers, sequence length) of the gpt-1.3b-style models the search table plans (24 x 2048:
the preset itself, what ``lynx plan --model gpt-1.3b`` plans)."""
SEARCH_BUDGETS = (0.4, 0.5, 0.7)


def _problem(layers: int, seq: int):
    """The recompute problem of a gpt-1.3b-style model (meta device, analytic H100 costs) and
    the seconds the whole plan took (trace + extract + HEU + check)."""
    from lynx_compile.models import build_model, example_batch
    from lynx_compile.planning import plan_model

    model = build_model("gpt-1.3b", device="meta", n_layers=layers, seq_len=seq)
    x = example_batch(model, 1, device="meta")
    start = time.perf_counter()
    record = plan_model(model, (x,), policy="lynx", solver="heu", memory_budget=0.5, hardware="h100-sxm",
                        plan_cache=False)[0]
    return record.problem, time.perf_counter() - start


def search_table() -> list[dict]:
    """Plan search on gpt-1.3b-style models planned on the meta device: HEU against the exact
    MILP (HiGHS; GLPK at budget 0.5 on the 48-layer model) on the same problem, per budget;
    ``vs_highs`` is HEU's exposed time over HiGHS's optimum."""
    from lynx_compile.solver.solve import solve_remat

    rows = []
    for layers, seq in SEARCH_CONFIGS:
        problem, plan_s = _problem(layers, seq)
        name = f"gpt-1.3b-style, {layers} layers, seq {seq}"
        for frac in SEARCH_BUDGETS:
            budget = int(frac * problem.reference_peak)
            got = {}
            solvers = ("heu", "highs") + (("glpk",) if frac == 0.5 and layers == 48 else ())
            for solver in solvers:
                t = time.perf_counter()
                try:
                    sol = solve_remat(problem, budget, solver=solver, time_limit_s=120.0)
                    got[solver] = sol.exposed_s
                    rows.append({"model": name, "units": len(problem.units), "budget": frac, "solver": solver,
                                 "solve_s": round(time.perf_counter() - t, 3),
                                 "exposed_ms": round(sol.exposed_s * 1e3, 3), "status": sol.status, "vs_highs": None})
                except Exception as e:  # noqa: BLE001
                    rows.append({"model": name, "units": len(problem.units), "budget": frac, "solver": solver,
                                 "solve_s": round(time.perf_counter() - t, 3), "exposed_ms": None,
                                 "status": str(e)[:80], "vs_highs": None})
            for row in rows[-len(solvers):]:
                if "heu" in got and "highs" in got and got["highs"] > 0 and row["solver"] == "heu":
                    row["vs_highs"] = round(got["heu"] / got["highs"], 3)
        rows.append({"model": f"{name}: trace + extract + HEU + check (whole lynx plan)", "units": len(problem.units),
                     "budget": 0.5, "solver": "heu", "solve_s": round(plan_s, 3), "exposed_ms": None,
                     "status": "end to end", "vs_highs": None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt-small", "gpt-medium", "llama-small", "llama-medium"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-search", action="store_true")
    ap.add_argument("--search-only", action="store_true")
    ap.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        preset, method, budget, batch, steps = args.one
        print(json.dumps(run_one(preset, method, None if budget == "None" else float(budget), int(batch), int(steps))))
        return
    from lynx_compile.tools.report import csv_text, environment, markdown_table

    env = environment()
    head = (f"{datetime.date.today().isoformat()}; {env['cpu']}, {env['threads']} torch threads; python "
            f"{env['python']}, torch {env['torch']}. Command: `python benchmarks/bench_remat.py "
            f"{' '.join(sys.argv[1:])}`\n\n")
    os.makedirs(RESULTS, exist_ok=True)
    if not args.search_only:
        rows = [row for preset in args.models for row in bench_model(preset, args.budgets, args.batch, args.steps)]
        with open(os.path.join(RESULTS, "remat.csv"), "w") as f:
            f.write(csv_text(rows))
        with open(os.path.join(RESULTS, "remat.md"), "w") as f:
            f.write("# Recompute planners on CPU\n\n" + head + markdown_table(rows) + "\n")
        print(markdown_table(rows))
    if not args.skip_search:
        search = search_table()
        with open(os.path.join(RESULTS, "remat_search.csv"), "w") as f:
            f.write(csv_text(search))
        with open(os.path.join(RESULTS, "remat_search.md"), "w") as f:
            f.write("# Plan search: HEU against the exact MILP, gpt-1.3b-style models\n\n" + head
                    + markdown_table(search) + "\n")
        print(markdown_table(search))


if __name__ == "__main__":
    main()
