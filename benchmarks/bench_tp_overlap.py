"""TP=2 on CPU with an EMULATED link: does lynx hide recompute inside the collectives?

Not a test: it measures and writes ``benchmarks/results/tp_overlap.{csv,md}``.

    python benchmarks/bench_tp_overlap.py [--model gpt-small] [--budget 0.5] [--comm-fraction 0.3]

1. Runs the no-recompute model on an emulated link with no latency and unbounded bandwidth:
   its step time is the compute-only step T0, and the emulated link's log gives the bytes the
   collectives move per step.
2. Picks the emulated bandwidth so that the collectives' alpha-beta time is ``comm-fraction``
   of the no-recompute step (T0 + comm), the PCIe-like ratio the issue asks for (alpha is
   PCIe 4's 5.7 us per hop scaled by the same factor as the bandwidth, so the latency/bandwidth
   balance stays PCIe-like).
3. Runs each policy on that link (one ``torchrun`` per run, 2 ranks, gloo underneath):
   none (unconstrained), full, selective, torch's min-cut at the budget, lynx on-demand only
   (``--no-windows``), lynx with windows. Step time = median of the untraced steady steps;
   lynx runs also trace their last steps and report the share of recompute that ran while a
   collective was in flight.
4. H = (T_full - T_lynx) / (T_full - T_none): the fraction of full recompute's overhead lynx
   hides (1 = all of it).

Every number is labelled with the machine, versions, and "emulated link".
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PCIE4_ALPHA_S, PCIE4_BW = 5.7e-6, 31.5e9


def _launch(args, policy: str, link: str, extra: list[str], tag: str, trace: bool) -> dict:
    out = os.path.join(tempfile.mkdtemp(prefix="lynx_tp_"), f"{tag}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(args.port), "-m", "lynx_compile.train", "--model", args.model, "--tp", "2",
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--policy", policy,
           "--emulate-link", link, "--json", out, "--solver", args.solver,
           "--cost-source", args.cost_source, *extra]
    if args.dropout is not None:
        cmd += ["--dropout", str(args.dropout)]
    if trace:
        cmd += ["--trace", os.path.join(os.path.dirname(out), "trace"), "--trace-steps", str(args.trace_steps)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not os.path.exists(out):
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines()
                 if ln.strip() and not ln.startswith(("W1", "E1", "USDT", "I1")) and "Warning" not in ln]
        useful = [ln for ln in lines if not ln.startswith((" ", "Traceback", "torch.distributed.elastic"))]
        return {"error": next((ln for ln in useful if "rror" in ln or "lynx" in ln), useful[-1] if useful else "?")}
    with open(out) as f:
        res = json.load(f)
    res["wall_s"] = wall
    return res


def _row(name: str, res: dict, budget: str) -> dict:
    if "error" in res:
        return {"config": name, "budget": budget, "step_ms": None, "error": res["error"][:160]}
    steady = [res["step_s"][i] for i in res["timed_steps"]]
    plans = res["plans"]
    peak = max(p["peak_bytes"] for p in plans) if plans else None
    ref = max(p["reference_peak_bytes"] for p in plans) if plans else None
    ov = res.get("overlap") or {}
    return {"config": name, "budget": budget, "step_ms": statistics.median(steady) * 1e3,
            "step_ms_min": min(steady) * 1e3, "steps_timed": len(steady),
            "pred_peak_MiB": peak / 2**20 if peak else None,
            "peak_vs_none": peak / ref if peak and ref else None,
            "pred_exposed_ms": sum(p["exposed_s"] for p in plans) * 1e3 if plans else None,
            "pred_recompute_ms": sum(p["recompute_s"] for p in plans) * 1e3 if plans else None,
            "window_units": sum(p["windows"] for p in plans) if plans else None,
            "overlap_share": ov.get("share"), "overlap_source": ov.get("source"),
            "traced_recompute_ms": ov["recompute_s"] * 1e3 if ov else None, "error": ""}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--trace-steps", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.55)
    p.add_argument("--cost-source", default="measured", choices=["analytic", "measured"],
                   help="lynx's per-node costs (the CPU roofline underprices recompute several-fold)")
    p.add_argument("--comm-fraction", type=float, default=0.3)
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--solver", default="auto")
    p.add_argument("--repeats", type=int, default=2,
                   help="launches per configuration, interleaved; the launch with the lowest median is kept "
                        "(CPU timings on a shared 2-core machine swing by tens of percent)")
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=os.path.join(RESULTS, "tp_overlap"))
    args = p.parse_args()

    probe = _launch(args, "none", "0,1e15", [], "probe", trace=False)
    if "error" in probe:
        raise SystemExit(f"probe run failed: {probe['error']}")
    t0 = statistics.median(probe["step_s"][i] for i in probe["timed_steps"])
    nbytes = probe["comm_bytes_per_step"]
    target = args.comm_fraction / (1 - args.comm_fraction) * t0  # comm / (T0 + comm) = fraction
    # all_reduce on 2 ranks: 2 alpha + B / bw each; 16 per step for 4 layers. Scale PCIe 4 by s:
    # alpha = s * 5.7 us, bw = PCIe4 / s, so time = s * (n_ops * 2 * 5.7us + bytes / PCIe4).
    n_ops = probe.get("comm_ops_per_step") or 0
    scale = target / (n_ops * 2 * PCIE4_ALPHA_S + nbytes / PCIE4_BW)
    alpha, bw = PCIE4_ALPHA_S * scale, PCIE4_BW / scale
    link = f"{alpha:.6g},{bw:.6g}"
    print(f"compute-only step T0 = {t0 * 1e3:.1f} ms, collectives move {nbytes / 2**20:.2f} MiB/step "
          f"({n_ops:.0f} ops); emulated link alpha={alpha * 1e6:.1f} us, bw={bw / 1e6:.1f} MB/s "
          f"(PCIe 4 slowed {scale:.0f}x) -> {target * 1e3:.1f} ms of communication per step", flush=True)

    budget = str(args.budget)
    runs = [("none (no recompute)", "none", [], "-", False),
            ("full", "full", [], "-", False),
            ("selective", "selective", [], "-", False),
            (f"torch min-cut @{budget}", "torch", ["--memory-budget", budget], budget, False),
            (f"lynx on-demand only @{budget}", "lynx", ["--memory-budget", budget, "--no-windows"], budget, True),
            (f"lynx with windows @{budget}", "lynx", ["--memory-budget", budget], budget, True)]
    best: dict[str, dict] = {}
    for rep in range(args.repeats):  # interleaved, so a slow spell hits every configuration alike
        for k, (name, policy, extra, b, trace) in enumerate(runs):
            res = _launch(args, policy, link, extra, f"{policy}{k}r{rep}", trace)
            row = _row(name, res, b)
            if "error" not in res and res.get("comm_modeled_s_per_step") is not None:
                row["comm_ms_modeled"] = res["comm_modeled_s_per_step"] * 1e3
            row["launch_medians_ms"] = best.get(name, {}).get("launch_medians_ms", "")
            if row["step_ms"] is not None:
                row["launch_medians_ms"] = "/".join(filter(None, [row["launch_medians_ms"], f"{row['step_ms']:.0f}"]))
            if name not in best or (row["step_ms"] is not None and
                                    (best[name]["step_ms"] is None or row["step_ms"] < best[name]["step_ms"])):
                best[name] = row
            else:
                best[name]["launch_medians_ms"] = row["launch_medians_ms"]
            print({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in row.items()}, flush=True)
    rows = [best[name] for name, *_ in runs]

    t = {r["config"].split(" ")[0] + (" windows" if "windows" in r["config"] else ""): r["step_ms"] for r in rows}
    t_none, t_full, t_lynx = t.get("none"), t.get("full"), t.get("lynx windows")
    h = (t_full - t_lynx) / (t_full - t_none) if None not in (t_none, t_full, t_lynx) and t_full != t_none else None
    t_od = t.get("lynx")
    h_od = (t_full - t_od) / (t_full - t_none) if None not in (t_none, t_full, t_od) and t_full != t_none else None
    _write(args, rows, t0, link, alpha, bw, scale, target, nbytes, h, h_od)


def _write(args, rows, t0, link, alpha, bw, scale, target, nbytes, h, h_od) -> None:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    keys = ["config", "budget", "step_ms", "launch_medians_ms", "step_ms_min", "pred_peak_MiB", "peak_vs_none", "pred_recompute_ms",
            "pred_exposed_ms", "window_units", "overlap_share", "traced_recompute_ms", "comm_ms_modeled", "error"]
    with open(args.out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)

    def fmt(v):
        if v is None or v == "":
            return "-"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [
        f"{time.strftime('%Y-%m-%d')}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"python {platform.python_version()}, torch {torch.__version__}. TP=2 (2 processes, gloo underneath), "
        f"{args.model}, batch {args.batch_size}, {args.steps} steps per launch, step_ms = median of the untraced steps "
        f"after the compile step, best of {args.repeats} interleaved launches (all launches' medians listed).",
        "",
        f"**EMULATED link** (lynx_compile.distributed.emulated_link): alpha = {alpha * 1e6:.1f} us, bandwidth = "
        f"{bw / 1e6:.1f} MB/s (PCIe 4's alpha and bandwidth slowed {scale:.0f}x so that communication, "
        f"{target * 1e3:.1f} ms/step for {nbytes / 2**20:.2f} MiB, is {args.comm_fraction:.0%} of the no-recompute "
        f"step; compute-only step T0 = {t0 * 1e3:.1f} ms). Collectives complete no earlier than this link "
        "allows; the CPU is free while they are in flight.",
        "",
        f"Command: `python benchmarks/bench_tp_overlap.py --model {args.model} --budget {args.budget} "
        f"--comm-fraction {args.comm_fraction} --cost-source {args.cost_source}` (lynx plans from "
        f"{args.cost_source} per-node costs; solver {args.solver}).",
        "",
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
    ]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    lines += ["", f"H = (T_full - T_lynx) / (T_full - T_none) = **{fmt(h)}** with windows; "
                  f"{fmt(h_od)} on-demand only (target >= 0.8)."]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
