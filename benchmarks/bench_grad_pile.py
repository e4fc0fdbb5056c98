"""The gradient pile (issue M): a model compiled whole returns every parameter gradient at the
end of its compiled backward, so the step's peak holds them all. This measures what lowers it.

Rows (each in its own process, with its own empty torch.compile cache):

- ``eager``: no compile;
- ``inductor``: ``torch.compile(backend="inductor")``;
- ``inductor+ca`` / ``lynx+ca``: the same under compiled autograd
  (``torch._dynamo.compiled_autograd._enable`` around forward and backward, its graph compiled
  by the same backend; lynx's step recorder is off, its hooks cannot be traced there);
- ``lynx``: ``backend="lynx"`` at a budget (``none``: policy none, no recompute);
- ``lynx+acc``: the same with ``accumulate_grad_in_graph=True`` (``lynx_compile.memory.grad_in_graph``).

Columns: ``peak_MiB`` = ``measure_step(params=...)`` (every parameter has a ``.grad`` before the
measured step, the gradients the step allocates count while alive); ``frac`` = that over the
inductor row's; ``pred_MiB`` = lynx's predicted peak of the plan; ``grad_diff`` =
``grad_rel_diff`` of the first step's gradients vs eager's; ``first_s`` = the first step
(compiles included, cold cache).

``python benchmarks/bench_grad_pile.py`` (CPU, 1 thread; ~25 min) writes
``benchmarks/results/grad_pile.md``; ``--one JSON`` runs one row and prints it as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MIB = 2 ** 20


def build(model: str):
    from bench_step import Settings
    from bench_step import build as step_build

    name = {"gpt-tiny": "gpt-tiny", "hf-llama": "hf-llama:gpt-tiny"}[model]
    return step_build(Settings(model=name, attn="manual" if model == "gpt-tiny" else "sdpa", dropout=0.0,
                               layers=4, batch=3, seq=48))


def run_row(model: str, variant: str, budget: str | None) -> dict:
    import torch

    import lynx_compile
    from lynx_compile.budget import named_fraction
    from lynx_compile.compiler.dynamo_backend import find_backend_error
    from lynx_compile.decisions import BudgetError
    from lynx_compile.memory.measure import grad_rel_diff, grad_snapshot, measure_step

    torch.set_num_threads(1)
    ref_model, ref_loss = build(model)
    ref_loss(ref_model).backward()
    ref = grad_snapshot(ref_model)
    module, loss_of = build(model)
    params = list(module.parameters())
    row: dict = {"model": model, "variant": variant, "budget": budget or "-", "result": "ok"}
    backend = None
    ca = variant.endswith("+ca")
    if variant == "eager":
        fn, kw = module, None
    elif variant.startswith("inductor"):
        kw = {"backend": "inductor"}
        fn = torch.compile(module, **kw)
    else:
        opts: dict = {"policy": "none"} if budget in (None, "none") else {"memory_budget": float(budget)}
        if variant == "lynx+acc":
            opts["accumulate_grad_in_graph"] = True
        backend = lynx_compile.backend(**opts)
        if ca:
            backend.step_recorder = None  # its hooks would be traced into compiled autograd's graph
        kw = {"backend": backend}
        fn = torch.compile(module, **kw)

    def ctx():
        if not ca:
            return contextlib.nullcontext()
        return torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, fullgraph=True, **kw))

    def step() -> None:
        with ctx():
            loss_of(fn).backward()

    try:
        t0 = time.perf_counter()
        step()
        row["first_s"] = round(time.perf_counter() - t0, 1)
        row["grad_diff"] = grad_rel_diff(grad_snapshot(module), ref)
        for p in params:
            p.grad = None
        m = measure_step(step, device="cpu", repeats=2, warmup=1, params=params)
        row["peak_MiB"] = m.peak_bytes / MIB
        row["step_ms"] = m.step_s * 1e3
        if backend is not None and backend.plans:
            plan = backend.plans[-1]
            row["pred_MiB"] = plan.peak_bytes / MIB
            row["recomputed"] = len(plan.recomputed)
            row["exposed_ms"] = plan.exposed_s * 1e3
            row["moved"] = backend.records[-1].stats.get("grads_in_graph")
    except Exception as exc:  # noqa: BLE001 - a refusal is a result
        refusal = find_backend_error(exc, BudgetError)
        text = " ".join(str(refusal if refusal is not None else exc).split())
        row["result"] = ("refused: " if refusal is not None else "failed: ") + text[-400:]
        if (named := named_fraction(text)) is not None:
            row["smallest"] = named
    return row


def child(model: str, variant: str, budget: str | None, timeout: float = 900) -> dict:
    cache = tempfile.mkdtemp(prefix="grad_pile_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), TRANSFORMERS_VERBOSITY="error",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps([model, variant, budget])]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "variant": variant, "budget": budget or "-", "result": f"timeout {timeout}s"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"model": model, "variant": variant, "budget": budget or "-",
            "result": "failed: " + " ".join(out.stderr.split())[-300:]}


def smallest(model: str, variant: str) -> tuple[float | None, dict]:
    """The smallest budget lynx accepts (from its refusal at 0.05), rounded up to 3 places."""
    row = child(model, variant, "0.05")
    return row.get("smallest"), row


def rows_for(model: str, log) -> list[dict]:
    rows = []

    def add(r):
        rows.append(r)
        log(json.dumps(r))

    add(child(model, "eager", None))
    add(child(model, "inductor", None))
    add(child(model, "inductor+ca", None))
    for variant in ("lynx", "lynx+acc"):
        add(child(model, variant, "none"))
        add(child(model, variant, "0.7"))
    low, refusal = smallest(model, "lynx")
    low_acc, refusal_acc = smallest(model, "lynx+acc")
    log(f"smallest lynx {low}, lynx+acc {low_acc}")
    if low:
        add(child(model, "lynx", f"{low:.3f}"))
        add(child(model, "lynx+ca", f"{low:.3f}"))
    if low_acc:
        add(child(model, "lynx+acc", f"{low_acc:.3f}"))
    return rows


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> list[str]:
    base = {r["model"]: r.get("peak_MiB") for r in rows if r["variant"] == "inductor"}
    out = ["| model | variant | budget | peak MiB | / inductor | predicted MiB | grad diff vs eager | "
           "recomputed | exposed ms (model) | first step s | step ms | grads in graph | result |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = r.get("peak_MiB")
        frac = peak / base[r["model"]] if peak and base.get(r["model"]) else None
        res = r["result"] if len(r["result"]) < 90 else r["result"][:87] + "..."
        out.append(f"| {r['model']} | {r['variant']} | {r['budget']} | {fmt(peak)} | {fmt(frac)} | "
                   f"{fmt(r.get('pred_MiB'))} | {fmt(r.get('grad_diff'), '.1e')} | {r.get('recomputed', '-')} | "
                   f"{fmt(r.get('exposed_ms'), '.2f')} | {fmt(r.get('first_s'), '.1f')} | "
                   f"{fmt(r.get('step_ms'), '.1f')} | {r.get('moved', '-') if r.get('moved') is not None else '-'} | {res} |")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--one", help="JSON [model, variant, budget]: run one row, print it as JSON")
    p.add_argument("--models", default="gpt-tiny,hf-llama")
    p.add_argument("--out", default=os.path.join(HERE, "results", "grad_pile.md"))
    args = p.parse_args(argv)
    if args.one:
        model, variant, budget = json.loads(args.one)
        print(json.dumps(run_row(model, variant, budget)))
        return 0
    import torch

    rows = []
    for model in args.models.split(","):
        rows += rows_for(model, lambda s: print(s, flush=True))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    lines = ["# The gradient pile: measured (issue M)", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.node()} "
             f"({platform.processor() or platform.machine()}), CPU, 1 thread; torch {torch.__version__}; "
             f"commit {commit}{' + uncommitted changes' if dirty else ''}; "
             f"`python benchmarks/bench_grad_pile.py`.", "",
             "4 layers, batch 3, seq 48, fp32, dropout 0, compiled whole. peak = `measure_step(params=...)` "
             "(`.grad` allocated before the step). Budget `none` = policy none; the last rows per model are "
             "at the smallest budget each accepts (from its refusal at 0.05).", ""]
    lines += table(rows)
    lines += ["", "Raw rows:", "", "```", *[json.dumps(r) for r in rows], "```", ""]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
