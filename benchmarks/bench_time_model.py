"""lynx's recompute time model against the backward and step times Inductor's code measures (issue R, item 3).

    python benchmarks/bench_time_model.py                         # gpt-tiny, HF Llama, post-LN GQA; 4 layers
    python benchmarks/bench_time_model.py --model gpt-tiny --rounds 9
    python benchmarks/bench_time_model.py --model tt-llama3 --layers 2   # torchtitan's llama3 debugmodel

For each model (``bench_step.build``: zoo preset, ``hf-llama:<preset>``, ``gqa:<preset>``,
``tt-llama3``: torchtitan's llama3 ``debugmodel`` cut to ``--layers`` blocks, its loss compiled
with it; fp32, one thread, batch ``--batch`` x ``--seq``), every candidate is compiled by lynx with Inductor in
one process, each on its own copy of the model (``lynx_compile.tools.variants.prepare``):
``lynx-none``, ``lynx-full``, ``lynx-selective``, torch's min-cut at ``--torch-budgets``
(``lynx-torch-b<B>``) and lynx's own choice at ``--budgets`` (``lynx-b<B>``; a refused budget is a
row saying so). Then ``--rounds`` rounds run one step per candidate, the order rotating each
round, and time its forward (``loss_of(fn)``: model and loss) and its backward
(``loss.backward()``) apart: drift on a shared machine falls on every candidate alike.

Per candidate: ``predicted_ms``, the recompute its plans expose on demand in lynx's model
(``RecomputePlan.exposed_s`` summed over the compiled graphs: what candidates compete on);
``measured_ms``, its median backward time minus ``lynx-none``'s (what the recompute costs as
Inductor runs it; the error is taken on ``predicted_ms`` minus ``lynx-none``'s, as Inductor's own
partition recomputes cheap pointwise ops too); ``bw_ms``, ``fw_ms``: median backward and forward
times; ``step_ms``: the median of forward + backward per round; ``measured_step_ms``: ``step_ms``
minus ``lynx-none``'s (what the plan costs over the whole step: a plan also changes the forward,
which saves less and may fuse differently); ``peak``: the plans' predicted peak as a fraction of the no-recompute one.
Per model: Spearman's rank correlation of predicted against measured (backward) over the
candidates, and the mean absolute error; per budget: lynx's pick against the fastest candidate
by measured backward whose predicted peak fits the budget, and (``step`` line) against the
fastest fitting one by measured step time.

Run it with another checkout's package first on ``PYTHONPATH`` to measure that code's model
(the script uses only public APIs): the plans of ``none``, ``full``, ``selective`` and torch's
min-cut are the same, only their prices differ.
"""
from __future__ import annotations

import argparse
import copy
import csv
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

RESULTS = os.path.join(HERE, "results")
MODELS = ("gpt-tiny", "hf-llama:gpt-tiny", "gqa:gpt-tiny")
EXTRA_MODELS = ("tt-llama3",)  # accepted by --model, not run by default (torchtitan is optional)
TORCH_BUDGETS = (0.9, 0.7, 0.5, 0.3, 0.1)
BUDGETS = (0.9, 0.8, 0.7, 0.6, 0.5)


def candidates(torch_budgets: Sequence[float], budgets: Sequence[float]) -> list[str]:
    return (["lynx-none", "lynx-full", "lynx-selective"] + [f"lynx-torch-b{b:g}" for b in torch_budgets]
            + [f"lynx-b{b:g}" for b in budgets])


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def run_model(model_name: str, args: argparse.Namespace) -> list[dict]:
    import lynx_compile
    from bench_step import Settings, build
    from lynx_compile.tools import variants
    from lynx_compile.decisions import BudgetError

    torch.set_num_threads(args.threads)
    # every candidate compiles the same code on its own copy: past dynamo's recompile limit (8)
    # the later ones would silently run eager
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    s = Settings(model=model_name, layers=args.layers, batch=args.batch, seq=args.seq, solver="auto")
    base, loss_of = build(s)
    ready, rows = {}, []
    for name in candidates(args.torch_budgets, args.budgets):
        options = variants.lynx_options(name, solver="auto", compiler="inductor")
        backend = lynx_compile.backend(**options)
        before = len(backend.plans)
        model = copy.deepcopy(base)
        fn = variants.prepare(name, model, solver="auto", compiler="inductor")
        row = {"model": model_name, "candidate": name}
        t0 = time.perf_counter()
        try:
            for _ in range(2):  # the first compiles the forward and (at its backward) the backward
                loss_of(fn).backward()
                # .grad None at every step, as in the timed rounds (zero_grad()'s default): a
                # .grad kept into the next step is gradient accumulation, which lynx compiles for
                # (the gradients added in the graph: step.piece.Piece)
                for p in model.parameters():
                    p.grad = None
        except BudgetError as e:
            row["status"] = "refused: " + str(e).split(". ")[1][:60]
            rows.append(row)
            print(f"{model_name} {name}: {row['status']}", flush=True)
            continue
        plans = backend.plans[before:]
        row.update(status="ok", compile_s=round(time.perf_counter() - t0, 1),
                   predicted_ms=sum(p.exposed_s for p in plans) * 1e3,
                   peak=max((p.peak_fraction for p in plans), default=1.0),
                   solver=",".join(sorted({p.solver for p in plans})))
        ready[name] = (fn, model)
        rows.append(row)
        print(f"{model_name} {name}: predicted {row['predicted_ms']:.3f} ms, peak {row['peak']:.3f} "
              f"({row['solver']})", flush=True)
    times = {n: [] for n in ready}  # (forward s, backward s) per round
    names = list(ready)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, model = ready[name]
            t0 = time.perf_counter()
            loss = loss_of(fn)
            t1 = time.perf_counter()
            loss.backward()
            times[name].append((t1 - t0, time.perf_counter() - t1))
            for p in model.parameters():
                p.grad = None

    def median_ms(name: str, part: slice) -> float:
        return statistics.median(sum(t[part]) for t in times[name]) * 1e3

    fw, bw, step = slice(0, 1), slice(1, 2), slice(0, 2)
    none_bw, none_step = median_ms("lynx-none", bw), median_ms("lynx-none", step)
    for row in rows:
        if row["candidate"] in times:
            name = row["candidate"]
            row["bw_ms"] = median_ms(name, bw)
            row["measured_ms"] = row["bw_ms"] - none_bw
            row["fw_ms"] = median_ms(name, fw)
            row["step_ms"] = median_ms(name, step)
            row["measured_step_ms"] = row["step_ms"] - none_step
            row["rounds"] = times[name]  # (forward s, backward s) per round, in round order
    return rows


def summarize(rows: list[dict], budgets: Sequence[float]) -> list[str]:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ok = [r for r in rows if r["model"] == model and "measured_ms" in r]
        fixed = [r for r in ok if not r["candidate"].startswith("lynx-b")]
        none = next(r["predicted_ms"] for r in ok if r["candidate"] == "lynx-none")
        # both relative to lynx-none (Inductor's own partition recomputes cheap pointwise ops too)
        pred, meas = [r["predicted_ms"] - none for r in ok], [r["measured_ms"] for r in ok]
        mae = statistics.fmean(abs(p - m) for p, m in zip(pred, meas))
        lines.append(f"- {model}: Spearman {spearman(pred, meas):.2f} over {len(ok)} candidates "
                     f"({spearman([r['predicted_ms'] for r in fixed], [r['measured_ms'] for r in fixed]):.2f} "
                     f"over the {len(fixed)} fixed policies); mean |predicted - measured| {mae:.3f} ms")
        for b in budgets:
            pick = next((r for r in ok if r["candidate"] == f"lynx-b{b:g}"), None)
            fits = [r for r in ok if r["peak"] <= b + 1e-9]
            if pick is None or not fits:
                continue
            for part, key, what in ((1, "bw_ms", "backward"), (None, "step_ms", "step")):
                best = min(fits, key=lambda r: r[key])
                held = held_out_ratio(pick, fits, part) if "rounds" in pick else None
                lines.append(f"  - budget {b:g}{'' if part else ' step'}: lynx picks {pick['solver']} "
                             f"({pick[key]:.2f} ms {what}); fastest fitting{'' if part else ' by step'} "
                             f"{best['candidate']} ({best[key]:.2f} ms): {pick[key] / best[key]:.3f}x"
                             + (f"; held out: {held[0]:.3f}x against {held[1]}" if held else ""))
    return lines


def _round_ms(row: dict, part: int | None) -> list[float]:
    """``row``'s time per round in ms: its backward (``part`` 1), forward (0) or both (None)."""
    return [(t[part] if part is not None else t[0] + t[1]) * 1e3 for t in row["rounds"]]


def held_out_ratio(pick: dict, fits: list[dict], part: int | None) -> tuple[float, str]:
    """The pick's time against the fastest fitting candidate, that candidate chosen on one half of
    the rounds (even, then odd) and the ratio measured on the other, as the median of per-round
    ratios (each round runs every candidate once, so drift cancels); the mean of the two halves.

    The fastest of a dozen noisy medians is faster than its true time (the least of many draws):
    taken on the same rounds, a pick as fast as the best reads a few percent slower. Choosing on
    half the rounds and measuring on the other half removes that bias."""
    ratios, names = [], []
    for chosen, measured in ((0, 1), (1, 0)):
        best = min(fits, key=lambda r: statistics.median(_round_ms(r, part)[chosen::2]))
        p, q = _round_ms(pick, part)[measured::2], _round_ms(best, part)[measured::2]
        ratios.append(statistics.median(a / b for a, b in zip(p, q)))
        names.append(best["candidate"])
    return statistics.fmean(ratios), "/".join(dict.fromkeys(names))


def write(rows: list[dict], lines: list[str], args: argparse.Namespace, argv: Sequence[str]) -> str:
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.stem)
    keys = ["model", "candidate", "status", "solver", "peak", "predicted_ms", "measured_ms", "bw_ms", "fw_ms",
            "step_ms", "measured_step_ms", "compile_s"]
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(stem + "_rounds.csv", "w", newline="") as f:  # every timed round, for paired analyses
        w = csv.writer(f)
        w.writerow(["model", "candidate", "round", "fw_ms", "bw_ms"])
        for r in rows:
            for i, (fw, bw) in enumerate(r.get("rounds", ())):
                w.writerow([r["model"], r["candidate"], i, f"{fw * 1e3:.4f}", f"{bw * 1e3:.4f}"])
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        head = "?"
    import lynx_compile

    md = ["# Recompute time model vs measured backward and step (CPU, Inductor)", "",
          f"{datetime.date.today()}; {platform.processor() or platform.machine()} ({os.cpu_count()} cores, shared); "
          f"torch {torch.__version__}; python {platform.python_version()}; {args.threads} thread(s); "
          f"git HEAD {head}; lynx_compile from {os.path.dirname(lynx_compile.__file__)}.", "",
          f"Command: `python benchmarks/bench_time_model.py {' '.join(argv)}`", "",
          f"Batch {args.batch} x seq {args.seq}, {args.layers} layers, median of {args.rounds} rounds. "
          "bw_ms / fw_ms: median backward / forward (model and loss); step_ms: median of forward + backward; "
          "measured_ms / measured_step_ms: bw_ms / step_ms minus lynx-none's.", "",
          "| " + " | ".join(keys[:-1]) + " |",
          "|" + "---|" * len(keys[:-1])]
    for r in rows:
        md.append("| " + " | ".join(f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "-"))
                                     for k in keys[:-1]) + " |")
    md += ["", "Summary (per budget: lynx's pick against the fastest candidate whose predicted peak fits, by the "
           "medians; \"held out\": that candidate chosen on the even rounds and the ratio measured on the odd ones, "
           "then the other way, each the median of per-round ratios, averaged; the every-round CSV is "
           f"{os.path.basename(stem)}_rounds.csv):", "", *lines, ""]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md))
    return stem + ".md"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=lambda v: [m.strip() for m in v.split(",") if m.strip()], default=list(MODELS),
                   help="comma list of bench_step models: zoo presets, hf-llama:<preset>, gqa:<preset>, tt-llama3 "
                        f"(torchtitan's llama3 debugmodel, --layers keeps its first blocks; {','.join(EXTRA_MODELS)} "
                        f"needs torchtitan) (default: {','.join(MODELS)})")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--torch-budgets", type=lambda v: [float(x) for x in v.split(",")], default=list(TORCH_BUDGETS))
    p.add_argument("--budgets", type=lambda v: [float(x) for x in v.split(",")], default=list(BUDGETS))
    p.add_argument("--out", default=RESULTS, help="folder of <stem>.csv and <stem>.md (default benchmarks/results)")
    p.add_argument("--stem", default="time_model")
    args = p.parse_args(argv)
    if any(m.split(":")[0] in EXTRA_MODELS for m in args.model):
        from torchtitan_models import available

        if available() is not None:
            p.error(f"tt-llama3: {available()}")
    rows = []
    for m in args.model:
        rows += run_model(m, args)
    lines = summarize(rows, args.budgets)
    print("\n".join(lines))
    print(write(rows, lines, args, sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
