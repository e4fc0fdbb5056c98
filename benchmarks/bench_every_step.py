"""The peak of every training step, steps 1-2 included, side by side with the peers (issue Q's
measure: a run that needs its budget must hold it from step 1).

    python benchmarks/bench_every_step.py --models hf-llama,tt-llama3 \
        --peers inductor,checkpoint-full/inductor,tt-ac-full,torch-budget@0.5,lynx@0.7,lynx@0.6,lynx/per-block@0.7

Each row in its own process (``bench_peers.prepare``: the same models, batches and peers as
``bench_peers.py``). Every step starts with ``.grad`` None (``zero_grad()``'s default), so the
gradients the step creates count. Every step is measured
(``lynx_compile.step.measured_peak.step_peak_bytes``: the CPU allocator's events, bytes above
the step's start); step 2 of lynx with a model compiled in pieces is the step lynx records, read
from lynx's own recording as the other steps are ("-": lynx recorded nothing there, a model
compiled whole or a plan from the plan cache; it ran unmeasured). ``worst``: the highest measured step as a
fraction of ``inductor``'s highest (torch.compile with no recompute, the budget's 100%);
``budget``: lynx's budget in bytes as a fraction of the same (each plan's own reference may
differ by the memory outside its graphs).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MIB = 2 ** 20
RESULTS = os.path.join(HERE, "results")


def run_row(model: str, peer: str, steps: int) -> dict[str, Any]:
    """In the row's own process: each step's measured peak (None: not measured, lynx's recorded
    step where lynx recorded nothing)."""
    import torch

    import bench_peers
    from lynx_compile.compiler.dynamo_backend import find_backend_error
    from lynx_compile.decisions import BudgetError
    from lynx_compile.step.measured_peak import step_peak_bytes

    torch.set_num_threads(1)
    module, make_loss = bench_peers.build(model)
    fn, loss_backend = bench_peers.prepare(peer, model, module, bench_peers.peer_budget(peer))
    loss_of = make_loss(loss_backend)
    params = [p for p in module.parameters() if p.requires_grad]
    recorder = getattr(loss_backend, "step_recorder", None)  # lynx's (None: another peer)
    peaks: list[int | None] = []
    try:
        for _ in range(steps):
            for p in params:
                p.grad = None
            peaks.append(step_peak_bytes(lambda: loss_of(fn).backward(), torch.device("cpu"), recorder))
    except Exception as exc:  # noqa: BLE001 - a refusal is a result
        refusal = find_backend_error(exc, BudgetError)
        return {"model": model, "peer": peer, "peaks": peaks,
                "result": "refused: " + " ".join(str(refusal).split()) if refusal is not None else repr(exc)[:300]}
    records = getattr(loss_backend, "records", None) or []  # lynx's backend (None: another peer)
    plans = [r.plan for r in records if r.plan is not None and r.plan.budget_bytes is not None]
    budget = max((p.budget_bytes for p in plans), default=None)
    return {"model": model, "peer": peer, "peaks": peaks, "budget_bytes": budget, "result": "ok"}


def _child(model: str, peer: str, steps: int, timeout: float) -> dict[str, Any]:
    code = (f"import json, sys; sys.path.insert(0, {HERE!r}); import bench_every_step as b; "
            f"print('ROW ' + json.dumps(b.run_row({model!r}, {peer!r}, {steps})))")
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"model": model, "peer": peer, "peaks": [], "result": f"timeout after {timeout:.0f} s"}
    rows = [line[4:] for line in out.stdout.splitlines() if line.startswith("ROW ")]
    if not rows:
        return {"model": model, "peer": peer, "peaks": [], "result": "failed: " + (out.stderr or out.stdout)[-300:]}
    row = json.loads(rows[-1])
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def table(rows: list[dict[str, Any]], steps: int) -> list[str]:
    head = ["model", "peer", *[f"step {i} MiB" for i in range(1, steps + 1)], "worst", "budget", "result"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ref = next((max(p for p in x["peaks"] if p) for x in rows
                    if x["model"] == r["model"] and x["peer"] == "inductor" and x["result"] == "ok"), None)
        measured = [p for p in r["peaks"] if p]
        cells = [f"{p / MIB:.3f}" if p else "-" for p in r["peaks"]]
        cells += ["-"] * (steps - len(cells))
        worst = f"{max(measured) / ref:.3f}" if ref and measured else "-"
        budget = f"{r['budget_bytes'] / ref:.3f}" if ref and r.get("budget_bytes") else "-"
        lines.append("| " + " | ".join([r["model"], r["peer"], *cells, worst, budget, r["result"][:120]]) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda v: v.split(","), default=["hf-llama", "tt-llama3"])
    p.add_argument("--peers", type=lambda v: v.split(","),
                   default=["inductor", "checkpoint-full/inductor", "tt-ac-full", "torch-budget@0.5", "lynx@0.7",
                            "lynx@0.6", "lynx/per-block@0.7"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--stem", default="every_step")
    args = p.parse_args(argv)
    rows = []
    import bench_peers

    for model in args.models:
        for peer in args.peers:
            if bench_peers.not_applicable(peer, model):
                continue
            rows.append(_child(model, peer, args.steps, args.timeout))
            print(rows[-1], flush=True)
    import torch

    os.makedirs(args.out, exist_ok=True)
    md = ["# The peak of every step, side by side (CPU)", "",
          f"{time.strftime('%Y-%m-%d')}; {platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
          f"python {platform.python_version()}.", "",
          f"Command: `python benchmarks/bench_every_step.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
          (__doc__ or "").split("\n\n", 2)[2].strip(), "", *table(rows, args.steps), ""]
    with open(os.path.join(args.out, f"{args.stem}.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(args.out, f"{args.stem}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
