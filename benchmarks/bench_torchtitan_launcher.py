"""torchtitan's models under lynx's 2-rank launcher at a budget (issue S, item 4).

    python benchmarks/bench_torchtitan_launcher.py                       # llama3, qwen3, deepseek_v3; FSDP2 and TP; 0.7
    python benchmarks/bench_torchtitan_launcher.py --models qwen3 --parallel fsdp2 --layers 2

For each model (torchtitan's ``debugmodel`` of ``llama3``, ``qwen3``, ``deepseek_v3``, cut to
``--layers`` blocks) and each parallelism (``fsdp2``: ``--dp-shard 2``; ``tp``: ``--tp 2``), it
runs ``torchrun --nproc-per-node 2 -m lynx_compile.torchtitan_train`` (gloo on loopback, one
thread per rank, ``--steps`` steps) with ``--compile-backend eager``, ``inductor`` and ``lynx``
at ``LYNX_OPTIONS='{"memory_budget": B}'``. A budget lynx refuses names the smallest it reaches
(``Use memory_budget >= F``); the run is repeated at F (up to ``--retries`` times: an identical
run may name another F, issue S item 1), so a row says either that B trains, what does, or the
budgets each run named.

Per lynx run: each step's loss against Inductor's (the tolerance: ``ERR_MULTIPLE`` times
Inductor's largest difference from eager, as ``tests/test_torchtitan_trainer.py``), each
rank's measured forward + backward peak per step (the launcher's ``step_peak_bytes_by_rank``:
on CPU the profiler's allocator events, the step lynx records read from lynx's own recording)
against lynx's step budget (``budget_bytes`` of its plans) and against Inductor's peak on the
same rank and step. Writes ``<out>/<stem>.md`` and ``.csv``.

``--peers`` (issue S): beside each lynx row, what a torchtitan user runs today on the same
launcher, model and parallelism: Inductor with torchtitan's own activation checkpointing
(``--ac full``, ``--ac selective``) and with torch.compile's ``activation_memory_budget`` at the
budget asked (``--ac memory_budget``: a fraction of each compiled block's saved activations,
not of the step's peak), and lynx with no budget beside torchtitan's full AC; each run's
measured step peak per rank against Inductor's and rank 0's median step time (steps 5+, under
the CPU profiler that measures the peak: for comparison between rows of one run of this script
only; use ``--steps 6`` or more). Written as a second table.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import torch

from lynx_compile.budget import named_fraction

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
PARALLEL = {"fsdp2": ["--dp-shard", "2"], "tp": ["--tp", "2"], "ep": ["--dp-shard", "2", "--ep", "2"]}
ERR_MULTIPLE = 4.0


def launch(model: str, parallel: str, backend: str, args: argparse.Namespace, work: str,
           options: dict | None = None, extra: Sequence[str] = ()) -> dict:
    """One launcher run; its rank-0 JSON, or {"error": text, "named": F or None}."""
    tag = (f"{model}-{parallel}-{backend}" + ("" if options is None else f"-{options['memory_budget']}")
           + "".join(f"-{a.strip('-')}" for a in extra))
    out = os.path.join(work, tag + ".json")
    env = {k: v for k, v in os.environ.items() if k != "LYNX_OPTIONS"}
    env["OMP_NUM_THREADS"] = "1"
    if options is not None:
        env["LYNX_OPTIONS"] = json.dumps(options)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "lynx_compile.torchtitan_train", "--model", model, *PARALLEL[parallel],
           "--compile-backend", backend, "--steps", str(args.steps), "--timeout", str(args.timeout), "--out", out,
           *extra]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s", "named": None}
    wall = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    if proc.returncode != 0 or not os.path.exists(out):
        lines = text.strip().splitlines()
        # a rank's own exception (torchrun's ChildFailedError report follows it), else the last line
        last = [ln for ln in lines if re.search(r"\w+(Error|Exception): ", ln) and "ChildFailedError" not in ln][-1:] \
            or lines[-1:]
        return {"error": f"exit {proc.returncode}: {last[0][:300] if last else ''}",
                "named": named_fraction(text)}
    with open(out) as f:
        result = json.load(f)
    result["wall_s"] = wall
    return result


def tolerance(inductor: list[float], eager: list[float]) -> float:
    diff = max(abs(x - y) for x, y in zip(inductor, eager))
    ulp = torch.finfo(torch.float32).eps * max(abs(x) for x in inductor)
    return ERR_MULTIPLE * max(diff, ulp)


def row_of(model: str, parallel: str, asked: float, lynx: dict, inductor: dict, eager: dict,
           refused: str | None) -> dict:
    row = {"model": model, "parallel": parallel, "asked": asked, "refused": refused or ""}
    if "error" in lynx:
        row["status"] = lynx["error"]
        return row
    plans = lynx.get("lynx", {}).get("plans", [])
    row["budget"] = lynx.get("lynx", {}).get("options", {}).get("memory_budget")
    budget = max((p["budget_bytes"] or 0 for p in plans), default=0) or None
    worst = max(abs(x - y) for x, y in zip(lynx["losses"], inductor["losses"]))
    tol = tolerance(inductor["losses"], eager["losses"])
    peaks, theirs = _worst_peaks(lynx), _worst_peaks(inductor)
    row.update(status="ok", steps=len(lynx["losses"]), loss_diff=worst, loss_tol=tol, losses_ok=worst <= tol,
               budget_MB=budget / 1e6 if budget else None,
               peak_MB_by_rank=" / ".join(f"{p / 1e6:.2f}" for p in peaks),
               steps_MB_by_rank=" / ".join(",".join("-" if b is None else f"{b / 1e6:.2f}" for b in steps)
                                           for steps in lynx["step_peak_bytes_by_rank"]),
               inductor_MB_by_rank=" / ".join(f"{p / 1e6:.2f}" for p in theirs),
               worst_over_budget=max(peaks) / budget if budget else None,
               last_loss=lynx["losses"][-1], inductor_last_loss=inductor["losses"][-1],
               wall_s=round(lynx["wall_s"], 1))
    return row


PEERS = (("inductor + torchtitan full AC", "inductor", ("--ac", "full")),
         ("inductor + torchtitan selective AC", "inductor", ("--ac", "selective")),
         ("lynx (no budget) + torchtitan full AC", "lynx", ("--ac", "full")))
"""(name, backend, launcher arguments) of the peers ``--peers`` runs; torch.compile's budget at
the budget asked is added by :func:`peer_runs`. lynx with no budget keeps torchtitan's checkpoint
regions as torch.compile partitions them (the model's own checkpointing)."""

TIMED_FROM_STEP = 5
"""Step times are the median of the steps from this one: lynx compiles its pieces again for the
step's plan at step 3 (and on CPU every step but the one lynx records runs under the profiler that
measures its peak)."""


def _worst_peaks(result: dict) -> list[int]:
    """Each rank's largest measured step peak over the steps measured (every step: on CPU the one
    lynx records as lynx measured it, none where it took the step's plan from the plan cache)."""
    return [max(b for b in steps if b is not None) for steps in result["step_peak_bytes_by_rank"]]


def peer_row(model: str, parallel: str, name: str, result: dict, inductor: dict, eager: dict) -> dict:
    """One row of the peers table: ``result``'s measured peaks against Inductor's, its median
    step time (rank 0, steps ``TIMED_FROM_STEP``+; none with fewer steps), its losses against
    Inductor's tolerance."""
    row = {"model": model, "parallel": parallel, "run": name}
    if "error" in result:
        row["status"] = result["error"]
        return row
    peaks, theirs = _worst_peaks(result), _worst_peaks(inductor)
    later = sorted(result["step_s"][TIMED_FROM_STEP - 1:])
    worst = max(abs(x - y) for x, y in zip(result["losses"], inductor["losses"]))
    row.update(status="ok", peak_MB_by_rank=" / ".join(f"{p / 1e6:.2f}" for p in peaks),
               of_inductor=max(p / t for p, t in zip(peaks, theirs)),
               step_ms=1e3 * later[len(later) // 2] if later else None,
               losses_ok=worst <= tolerance(inductor["losses"], eager["losses"]), loss_diff=worst)
    return row


def peer_runs(model: str, parallel: str, args: argparse.Namespace, work: str, ref: dict, lynx: dict) -> list[dict]:
    """The peers table's rows for one model and parallelism: Inductor, its peers, lynx."""
    rows = [peer_row(model, parallel, "inductor", ref["inductor"], ref["inductor"], ref["eager"])]
    peers = (*PEERS, (f"inductor + torch budget {args.budget:g}", "inductor",
                      ("--ac", "memory_budget", "--ac-memory-budget", str(args.budget))))
    for name, backend, extra in peers:
        result = launch(model, parallel, backend, args, work, extra=extra)
        rows.append(peer_row(model, parallel, name, result, ref["inductor"], ref["eager"]))
        print(rows[-1], flush=True)
    at = lynx.get("lynx", {}).get("options", {}).get("memory_budget") if "error" not in lynx else None
    rows.append(peer_row(model, parallel, f"lynx {at if at is not None else args.budget:g}", lynx,
                         ref["inductor"], ref["eager"]))
    return rows


def run(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    rows, peers = [], []
    with tempfile.TemporaryDirectory(prefix="bench_tt_launcher_") as work:
        for model in args.models:
            for parallel in args.parallel:
                ref = {b: launch(model, parallel, b, args, work) for b in ("eager", "inductor")}
                if any("error" in r for r in ref.values()):
                    rows.append({"model": model, "parallel": parallel, "asked": args.budget,
                                 "status": "reference failed: " + "; ".join(
                                     f"{b}: {r['error']}" for b, r in ref.items() if "error" in r)})
                    print(rows[-1], flush=True)
                    continue
                lynx = launch(model, parallel, "lynx", args, work, {"memory_budget": args.budget, "plan_cache": False})
                named = []
                # a run refused names the smallest budget it reaches; the same command at that
                # budget may name another (issue S item 1: the memory outside the compiled pieces
                # is read from each run's allocator events): up to --retries reruns, each named
                while "error" in lynx and lynx["named"] is not None and len(named) < args.retries:
                    named.append(lynx["named"])
                    lynx = launch(model, parallel, "lynx", args, work,
                                  {"memory_budget": lynx["named"], "plan_cache": False})
                refused = ", then ".join(f"named {b:g}" for b in named) or None
                if "error" in lynx and lynx["named"] is not None:
                    refused = (refused + ", then " if refused else "") + f"named {lynx['named']:g}"
                rows.append(row_of(model, parallel, args.budget, lynx, ref["inductor"], ref["eager"], refused))
                print(rows[-1], flush=True)
                if args.peers:
                    peers += peer_runs(model, parallel, args, work, ref, lynx)
    return rows, peers


KEYS = ["model", "parallel", "asked", "refused", "budget", "status", "steps", "losses_ok", "loss_diff", "loss_tol",
        "budget_MB", "peak_MB_by_rank", "steps_MB_by_rank", "inductor_MB_by_rank", "worst_over_budget", "last_loss",
        "inductor_last_loss", "wall_s"]


PEER_KEYS = ["model", "parallel", "run", "status", "peak_MB_by_rank", "of_inductor", "step_ms", "losses_ok", "loss_diff"]


def write(rows: list[dict], args: argparse.Namespace, argv: Sequence[str], peers: Sequence[dict] = ()) -> str:
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.stem)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, KEYS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    from importlib.metadata import version

    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else ("-" if v is None or v == "" else str(v))

    md = ["# torchtitan's models under lynx's 2-rank launcher (CPU, gloo)", "",
          f"{datetime.date.today()}; {platform.machine()} ({os.cpu_count()} cores, shared); torch {torch.__version__}; "
          f"torchtitan {version('torchtitan')}; python {platform.python_version()}.", "",
          f"Command: `python benchmarks/bench_torchtitan_launcher.py {' '.join(argv)}`", "",
          f"debugmodel cut to {args.layers or 'all'} layers, batch 2 x 128 per data-parallel rank, float32, "
          f"{args.steps} steps; peaks: each rank's measured forward + backward step peak (bytes above the step's "
          "start, CPU allocator events; step 2, the step lynx records, from lynx's recording read as the others are: step.measured_peak) over every "
          "step, the worst step (steps_MB_by_rank: each step, by rank); worst_over_budget: the larger rank's peak "
          "over lynx's step budget; losses_ok: every step's loss within "
          f"{ERR_MULTIPLE:g}x Inductor's own largest difference from eager.", "",
          "| " + " | ".join(KEYS) + " |", "|" + "---|" * len(KEYS)]
    md += ["| " + " | ".join(cell(r.get(k)) for k in KEYS) + " |" for r in rows]
    if peers:
        md += ["", "## Beside the peers", "",
               "Each run's worst measured step peak per rank (every step) and, of_inductor, the larger rank's "
               f"over Inductor's on that rank; step_ms: rank 0's median step time over steps {TIMED_FROM_STEP}+ (CPU, under "
               "the profiler that measures the peak; 2 shared cores); losses_ok as above. torch's budget is "
               "torchtitan's `MemoryBudgetAC` (`activation_memory_budget` of each compiled block's saved "
               "activations); lynx's is a fraction of the step's peak.", "",
               "| " + " | ".join(PEER_KEYS) + " |", "|" + "---|" * len(PEER_KEYS)]
        md += ["| " + " | ".join(cell(r.get(k)) for k in PEER_KEYS) + " |" for r in peers]
        with open(stem + "_peers.csv", "w", newline="") as f:
            w = csv.DictWriter(f, PEER_KEYS, extrasaction="ignore")
            w.writeheader()
            w.writerows(peers)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    return stem + ".md"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", type=lambda v: v.split(","), default=["llama3", "qwen3", "deepseek_v3"])
    p.add_argument("--parallel", type=lambda v: v.split(","), default=["fsdp2", "tp"])
    p.add_argument("--budget", type=float, default=0.7)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--retries", type=int, default=2, help="reruns at the budget a refusal names (default 2)")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--stem", default="torchtitan_launcher")
    p.add_argument("--peers", action="store_true",
                   help="also run Inductor with torchtitan's full and selective AC and torch's budget (a second table)")
    args = p.parse_args(argv)
    from lynx_compile.tools.torchtitan_models import available

    if available() is not None:
        p.error(available())
    rows, peers = run(args)
    print(write(rows, args, sys.argv[1:] if argv is None else argv, peers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
