"""What does lynx add to the first training step's wall time? (issue P, item 5)

    python benchmarks/bench_compile.py                          # gpt-tiny, hf-llama; whole, per-block; 3 reps
    python benchmarks/bench_compile.py --models gpt-tiny --styles whole --reps 1

The first training step (dynamo's trace + lynx's plan + Inductor's compile + the run of
forward, loss and backward) of a fresh Python process, ``backend="inductor"`` against lynx
(``backend="lynx"``, ``compiler="inductor"``; budget ``none`` is ``policy="none"``, a fraction
``B`` is ``memory_budget=B``, everything else lynx's defaults), each **cold** and **warm**:

- cold: the child runs with a fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` (and ``TRITON_CACHE_DIR``);
- warm: the same child command run again at once with that same directory, which now holds
  Inductor's FX-graph / AOTAutograd caches and lynx's plan cache (``<dir>/lynx/plans``).

Models and compile styles are ``bench_budget``'s (its ``build`` and ``prepare``: 4 layers, batch
3 x sequence 48, float32, one thread): ``gpt-tiny`` (the zoo's preset, the default with
``hf-llama``), ``postln-gqa``, ``hf-llama`` (``foreign_models.hf_llama`` sized like gpt-tiny),
``hf-gpt2``; ``whole`` = ``torch.compile(model)``, ``per-block`` = each block
``block.compile(fullgraph=True)``, the rest eager. torchtitan's debug models (``tt-llama3``,
``tt-qwen3``, ``tt-deepseek``) are built, batched (2 x 256) and compiled as in ``bench_budget``
(``torchtitan_models.step_fn``: the model and torchtitan's loss both compiled, per block with
torchtitan's own ``apply_compile``).

Each child runs ``--steps`` steps (``loss_of(model).backward()``, no optimizer) and prints one
JSON line: ``step_s`` (each step's wall time, ``time.perf_counter``), the number of
``lynx plan cache: hit`` / ``miss`` lines logged on logger ``lynx_compile`` (INFO) in the
process, and the number of lynx plans (``backend.plans``). The parent times the whole process too
(``proc_s``: interpreter start, imports, model build, the steps).

Per-block lynx records step 2 (under the CPU profiler) and recompiles the pieces whose choice
changed at step 3's first forward (``docs/budget_pieces.md``): ``step2_s`` is step 2's time,
``replan_s`` = step 3's time minus the median of the steps after it.

Pairing: for each (model, style) and each repetition, the configurations run in the order
inductor, lynx none, lynx 0.7, lynx 0.5 (each a cold child then a warm one, each configuration
with its own fresh directory); the ratio of a row is the median over repetitions of lynx / that
repetition's inductor run in the same cache state (one inductor run per repetition, not one per
lynx run: on 2 shared cores a full grid had to fit in ~20 minutes). Medians over ``--reps``
repetitions.

Writes ``<out>/compile.csv`` (every child) and ``compile.md`` (medians), rewritten after every
(model, style), so a run stopped early keeps what it measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

RESULTS = os.path.join(HERE, "results")
MODELS = ("gpt-tiny", "hf-llama")
STYLES = ("whole", "per-block")
LYNX = ("none", "0.7", "0.5")
CSV_COLUMNS = ["model", "style", "config", "cache", "rep", "result", "first_step_s", "proc_s", "step2_s", "step3_s",
               "later_s", "replan_s", "hits", "misses", "plans"]


# ------------------------------------------------------------------------------ child

class _CacheLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.hits = self.misses = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("lynx plan cache: hit "):
            self.hits += 1
        elif msg.startswith("lynx plan cache: miss "):
            self.misses += 1


def lynx_options(config: str) -> Optional[dict]:
    if config == "inductor":
        return None
    base = {"compiler": "inductor"}
    return {**base, "policy": "none"} if config == "lynx-none" else {**base, "memory_budget": float(config[5:])}


def run_child(model: str, style: str, config: str, steps: int, threads: int) -> dict:
    import torch

    import bench_budget
    import lynx_compile

    torch.set_num_threads(threads)
    counter = _CacheLines()
    logger = logging.getLogger("lynx_compile")
    logger.addHandler(counter)
    logger.setLevel(logging.INFO)
    opts = lynx_options(config)
    # bench_budget.prepare spells lynx's options with its lynx_opts(compiler, budget); it is given
    # this row's options (policy none is not a budget there).
    bench_budget.lynx_opts = lambda compiler, budget: opts
    if model in bench_budget.TORCHTITAN:  # model and loss compiled as torchtitan's trainer does
        import torchtitan_models as tt

        backend = "inductor" if opts is None else lynx_compile.backend(**opts)
        _, tt_step = tt.step_fn(model, style, backend, bench_budget.TT_SHAPE["batch"], bench_budget.TT_SHAPE["seq"])

        def step() -> None:
            tt_step()  # a torchtitan step runs its backward itself
    else:
        module, loss_of = bench_budget.build(model, style, "default")
        fn = bench_budget.prepare(module, style, "inductor", None if opts is None else 1.0, model)

        def step() -> None:
            loss_of(fn).backward()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    row: dict[str, Any] = {"step_s": times, "hits": counter.hits, "misses": counter.misses}
    if opts is not None:
        row["plans"] = len(lynx_compile.backend(**opts).plans)
    return row


# ------------------------------------------------------------------------------ parent

def run_process(args: argparse.Namespace, model: str, style: str, config: str, cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache, "triton"), TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps([model, style, config]),
           "--steps", str(args.steps), "--threads", str(args.threads)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"result": f"timeout {args.timeout:g} s", "proc_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            child = json.loads(line)
            s = child.pop("step_s")
            later = statistics.median(s[3:]) if len(s) > 3 else None
            return {"result": "ok", "proc_s": wall, "first_step_s": s[0],
                    "step2_s": s[1] if len(s) > 1 else None, "step3_s": s[2] if len(s) > 2 else None,
                    "later_s": later, "replan_s": None if later is None else s[2] - later, **child}
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    named = [ln for ln in tail if "Error:" in ln and "TORCHDYNAMO_VERBOSE" not in ln]  # e.g. lynx's BudgetError
    why = (named or tail or ["no output"])[-1].strip()
    return {"result": f"exit {proc.returncode}: {why[:300]}", "proc_s": wall}


def run_pair(args: argparse.Namespace, model: str, style: str, config: str, rep: int) -> list[dict]:
    """A cold child with a fresh cache directory, then a warm one with the same directory."""
    cache = tempfile.mkdtemp(prefix="bench_compile_cache_")
    out = []
    try:
        for kind in ("cold", "warm"):
            row = {"model": model, "style": style, "config": config, "cache": kind, "rep": rep,
                   **run_process(args, model, style, config, cache)}
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
            out.append(row)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out


def load_rows(path: str) -> list[dict]:
    import csv

    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row: dict[str, Any] = {}
            for k, v in r.items():
                if k in ("model", "style", "config", "cache", "result"):
                    row[k] = v
                elif v in ("", None):
                    row[k] = None
                else:
                    row[k] = int(v) if k == "rep" else float(v)
            rows.append(row)
    return rows


def med(xs: Sequence[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per (model, style, config, cache): medians; the lynx/inductor ratio per repetition is against
    that repetition's inductor run in the same cache state."""
    out = []
    keys = []
    for r in rows:
        k = (r["model"], r["style"], r["config"], r["cache"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        sel = [r for r in rows if (r["model"], r["style"], r["config"], r["cache"]) == k and r["result"] == "ok"]
        s: dict[str, Any] = dict(zip(("model", "style", "config", "cache"), k))
        s["n"] = len(sel)
        for c in ("first_step_s", "proc_s", "step2_s", "replan_s", "later_s"):
            s[c] = med([r.get(c) for r in sel])
        s["hits"] = med([r.get("hits") for r in sel])
        s["misses"] = med([r.get("misses") for r in sel])
        if k[2] != "inductor":
            ratios, pratios = [], []
            for r in sel:
                base = next((b for b in rows if (b["model"], b["style"], b["config"], b["cache"], b["rep"]) ==
                             (r["model"], r["style"], "inductor", r["cache"], r["rep"])), None)
                if base is not None and base.get("result") == "ok":
                    ratios.append(r["first_step_s"] / base["first_step_s"])
                    pratios.append(r["proc_s"] / base["proc_s"])
            s["ratio_first"] = med(ratios)
            s["ratio_proc"] = med(pratios)
        out.append(s)
    return out


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def write(args: argparse.Namespace, rows: Sequence[dict], argv: Sequence[str], started: str) -> None:
    import csv

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compile.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    summ = summarize(rows)
    import torch

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "lynx_compile", "passes"], capture_output=True,
                           text=True, cwd=os.path.dirname(HERE)).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ln.startswith("Model name")), "?")
    lines = [
        "# First training step's wall time: Inductor vs lynx, cold and warm caches (issue P, item 5)", "",
        f"- date: {started} (UTC start), written {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC",
        f"- machine: {cpu}, {os.cpu_count()} shared cores; torch {torch.__version__}, CPU, {args.threads} thread",
        f"- git HEAD {head}" + (" (lynx_compile/ or passes/ had uncommitted changes)" if dirty else ""),
        f"- command: `python benchmarks/{os.path.basename(__file__)} {' '.join(argv)}`",
        f"- {args.reps} repetition(s) per row; medians; {args.steps} steps per process", "",
        "Columns: `first_s` the first step (trace + plan + compile + run of forward, loss, backward) timed in "
        "the child; `proc_s` the whole child process (interpreter, imports, build, all steps); `x_first` / "
        "`x_proc` lynx / the same repetition's inductor run (same repetition, same cache state), median of the "
        "per-repetition ratios; `hit`/`miss` lynx plan-cache log lines in the process; `step2_s` step 2 "
        "(per-block lynx: recorded under the CPU profiler); `replan_s` step 3 minus the median of later steps "
        "(per-block lynx: the recompile of changed pieces); `later_s` the median of steps 4+.", "",
        "| model | style | config | cache | n | first_s | x_first | proc_s | x_proc | hit | miss | step2_s | "
        "replan_s | later_s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summ:
        lines.append("| " + " | ".join([s["model"], s["style"], s["config"], s["cache"], str(s["n"]),
                                         fmt(s["first_step_s"]), fmt(s.get("ratio_first")), fmt(s["proc_s"]),
                                         fmt(s.get("ratio_proc")),
                                         fmt(s["hits"], 0) if s["config"] != "inductor" else "-",
                                         fmt(s["misses"], 0) if s["config"] != "inductor" else "-",
                                         fmt(s["step2_s"], 3), fmt(s["replan_s"], 3),
                                         fmt(s["later_s"], 4)]) + " |")
    bad = [r for r in rows if r["result"] != "ok"]
    if bad:
        lines += ["", "Failed runs:"] + [f"- {r['model']} {r['style']} {r['config']} {r['cache']} rep {r['rep']}: "
                                         f"{r['result']}" for r in bad]
    path = os.path.join(args.out, "compile.md")
    notes = ""
    if os.path.exists(path):  # keep a hand-written conclusion below the marker
        old = open(path).read()
        if "<!-- conclusion -->" in old:
            notes = old[old.index("<!-- conclusion -->"):]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n\n" + (notes or "<!-- conclusion -->\n"))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--styles", default=",".join(STYLES))
    p.add_argument("--lynx", default=",".join(LYNX), help="lynx budgets: none (policy none) and fractions")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--merge", type=lambda v: [x for x in v.split(",") if x], default=[], metavar="CSV,...",
                   help="compile.csv files of earlier runs: their children join the table")
    p.add_argument("--report-only", action="store_true", help="run nothing: write the table of the --merge rows")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        model, style, config = json.loads(args.one)
        print(json.dumps(run_child(model, style, config, args.steps, args.threads)), flush=True)
        return 0
    started = f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M}"
    rows: list[dict] = []
    for path in args.merge:  # earlier runs' compile.csv: their children join the table
        rows += load_rows(path)
    if args.report_only:
        write(args, rows, argv, started)
        return 0
    for model in args.models.split(","):
        for style in args.styles.split(","):
            for rep in range(1, args.reps + 1):
                base = run_pair(args, model, style, "inductor", rep)
                rows += base
                for b in args.lynx.split(","):
                    rows += run_pair(args, model, style, f"lynx-{b}", rep)
            write(args, rows, argv, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
