"""Is lynx's generated code heavier than torch.compile's? (issue P item 4)

    python benchmarks/bench_codegen.py                          # gpt-tiny, hf-llama, hf-gpt2 (~25 min)
    python benchmarks/bench_codegen.py --models gpt-tiny,hf-llama   # results/codegen.md (~18 min)
    python benchmarks/bench_codegen.py --models gpt-tiny --out /tmp/cg

lynx compiles its own placements with two Inductor settings changed
(``_compat.INDUCTOR_KEEP_PLACEMENT``: ``reorder_for_peak_memory=False``,
``allow_buffer_reuse=False``) and one fusion rule (``_compat.refusing_recompute_fusion``: no
horizontal fusion of a kernel lynx recomputes with an independent kernel sharing less than 1 MiB
of reads). Until 2026-11-27 the rule was a third setting, ``score_fusion_memory_threshold=1 MiB``:
no horizontal fusion of any unrelated kernels sharing less than 1 MiB. Policies ``none`` and
``torch`` keep Inductor's defaults (``backend._compile_inductor``, ``own_placement``). This script
counts what each costs in the code Inductor generates for one training step (forward + loss +
backward, fp32, CPU, one thread), with Inductor's own counters (``torch._inductor.metrics``,
reset before the compile).

Rows (``variant``), each in its own process with a cold ``TORCHINDUCTOR_CACHE_DIR``:

- ``inductor``: ``torch.compile(model)``, torch.compile's own.
- ``none``: ``backend="lynx"``, ``policy="none"`` as the library runs it (torch.compile's
  partition and Inductor's settings): any difference from ``inductor`` is lynx's plumbing.
- ``none+keep``: ``none`` with both settings and the rule forced on, as lynx's own policies get
  them (benchmark-only monkeypatch of ``_compat.inductor_compile_with_partitioner``): their cost
  at torch.compile's partition. ``none+keep threshold``: the same with the 1 MiB threshold in
  place of the rule (lynx's settings before 2026-11-27). ``none+keep-reorder`` / ``-reuse`` (not
  in the default run): one setting given back to Inductor's default.
- ``lynx@0.7`` / ``lynx@0.5``: the default policy at ``memory_budget`` 0.7 / 0.5 (its recompute
  partition, the settings and the rule, lynx's post-grad passes). ``lynx@0.7 threshold``: with
  the threshold in place of the rule (as before 2026-11-27); ``lynx@0.7 no-fusion-rule``: with
  neither; ``lynx@0.7 inductor-settings``: no setting and no rule: their cost at lynx's own
  partition.

Columns (summed over every graph Inductor compiled in the step, forward and backward):

- ``kernels``: the fused kernels in Inductor's output code (``cpp_fused_*`` definitions, read
  from ``GraphLowering.save_output_code``); ``fw_kernels``: those of the graphs compiled before
  the first backward (the forward; AOTAutograd compiles the backward lazily, at the first
  backward). ``extern``: calls to extern kernels (mm, bmm, SDPA, ...); ``allocs``: buffers the
  wrapper allocates (``empty_strided`` calls; fewer where buffers are reused); ``code_kB``: the
  size of the output code (wrapper and kernel sources).
- ``kernel_objs``: Inductor's ``metrics.generated_kernel_count``. On CPU this counts every
  kernel object the C++ backend creates (each loop nest's scalar, vectorized and tail variants,
  and C++ kernels fused into one function), not the kernels in the code: about 8x ``kernels``.
- ``bytes``: ``metrics.num_bytes_accessed``: per scheduler node after fusion, the bytes of the
  buffers it reads and writes (Inductor's ``GraphLowering.count_bytes``; counted only while the
  ``inductor_metrics`` log is on, which the child turns on with a null handler). Fewer kernels
  reading shared inputs once count fewer bytes.
- ``ir_nodes``: ``metrics.ir_nodes_pre_fusion`` (scheduler nodes before fusion: grows with
  recomputation, not with fusion settings).
- ``graphs``: Inductor graph compiles (FX-graph cache misses + bypasses).
- ``kernels_x`` / ``kernel_objs_x`` / ``bytes_x`` / ``allocs_x``: the row's value / the same model's ``inductor`` row.
- ``peak_x``: the step's measured peak (``measure_step(step, repeats=1, warmup=1, params=...)``,
  CPU profiler allocator events, parameter gradients counted) / the ``inductor`` row's.
- ``first_step_s``: the compiling step's wall time (2 shared cores: indicative only).

These are counts of generated code on CPU (C++ backend); they say nothing about GPU speed.
Writes ``<out>/codegen.csv`` and ``.md``, rewritten after every row.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

MODELS = ("gpt-tiny", "hf-llama", "hf-gpt2")
SETTINGS = {"reorder": "reorder_for_peak_memory", "reuse": "allow_buffer_reuse"}
THRESHOLD = {"score_fusion_memory_threshold": 1 << 20}  # lynx's horizontal-fusion setting until 2026-11-27
# variant -> (lynx options or None for backend="inductor", keep: None = library behaviour,
#             else the settings (short names) forced on for every lynx graph, fusion: with keep,
#             "rule" = lynx's fusion rule, "threshold" = THRESHOLD instead, None = neither)
VARIANTS: dict[str, tuple[Optional[dict], Optional[tuple[str, ...]], Optional[str]]] = {
    "inductor": (None, None, None),
    "none": ({"policy": "none"}, None, None),
    "none+keep": ({"policy": "none"}, tuple(SETTINGS), "rule"),
    **{f"none+keep-{s}": ({"policy": "none"}, tuple(k for k in SETTINGS if k != s), "rule") for s in SETTINGS},
    "none+keep threshold": ({"policy": "none"}, tuple(SETTINGS), "threshold"),
    "lynx@0.7": ({"memory_budget": 0.7}, None, None),
    "lynx@0.7 threshold": ({"memory_budget": 0.7}, tuple(SETTINGS), "threshold"),
    "lynx@0.7 no-fusion-rule": ({"memory_budget": 0.7}, tuple(SETTINGS), None),
    "lynx@0.5": ({"memory_budget": 0.5}, None, None),
    "lynx@0.7 inductor-settings": ({"memory_budget": 0.7}, (), None),
}
DEFAULT_VARIANTS = ("inductor", "none", "none+keep", "none+keep threshold", "lynx@0.7", "lynx@0.7 threshold",
                    "lynx@0.7 no-fusion-rule", "lynx@0.5", "lynx@0.7 inductor-settings")
COLUMNS = ["model", "variant", "result", "graphs", "kernels", "fw_kernels", "extern", "allocs", "code_kB",
           "kernel_objs", "bytes", "ir_nodes", "kernels_x", "kernel_objs_x", "bytes_x", "allocs_x", "peak_MiB", "peak_x",
           "first_step_s", "wall_s"]
KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(", re.MULTILINE)
MIB = 2 ** 20


# ------------------------------------------------------------------------------ one row (child)

def build(model: str) -> tuple[Any, Callable[[Callable], Any]]:
    """(module to compile, loss_of(compiled) -> scalar loss); same weights and batch every process."""
    import torch

    if model == "gpt-tiny":
        from lynx_compile.models import build_model, example_batch

        torch.manual_seed(0)
        lm = build_model("gpt-tiny", n_layers=4)
        x = example_batch(lm, 4, generator=torch.Generator().manual_seed(1))
        return lm, lambda m: m(x).loss
    from bench_budget import build as budget_build  # HF Llama / GPT-2 as bench_budget builds them

    return budget_build(model, "whole", "default")


def keep_only(names: tuple[str, ...], fusion: Optional[str]) -> None:
    """Benchmark-only: every lynx graph compiles with ``INDUCTOR_KEEP_PLACEMENT`` reduced to
    ``names`` (policy none included), the other settings left at Inductor's defaults; with
    lynx's horizontal-fusion rule (``fusion="rule"``), the 1 MiB threshold lynx used before it
    (``"threshold"``) or neither."""
    from lynx_compile import _compat

    _compat.INDUCTOR_KEEP_PLACEMENT = {SETTINGS[n]: v for n, v in (
        (n, _compat.INDUCTOR_KEEP_PLACEMENT[SETTINGS[n]]) for n in names)}
    if fusion == "threshold":
        _compat.INDUCTOR_KEEP_PLACEMENT.update(THRESHOLD)
    if fusion != "rule":
        _compat.refusing_recompute_fusion = lambda inner_compile: inner_compile
    compile_ = _compat.inductor_compile_with_partitioner
    _compat.inductor_compile_with_partitioner = lambda *a, keep_placement=True, **kw: compile_(
        *a, keep_placement=bool(names) or fusion is not None, **kw)


def run_row(model: str, variant: str) -> dict:
    import torch

    from lynx_compile import _compat
    from lynx_compile.compiler.dynamo_backend import find_backend_error
    from lynx_compile.decisions import BudgetError
    from lynx_compile.memory.measure import measure_step
    from lynx_compile.tools.variants import describe_failure

    torch.set_num_threads(1)
    options, keep, fusion = VARIANTS[variant]
    if keep is not None:
        keep_only(keep, fusion)
    row: dict[str, Any] = {"result": "ok"}
    try:
        module, loss_of = build(model)
        fn = torch.compile(module, backend="inductor") if options is None else torch.compile(
            module, backend="lynx", options=options)
        params = list(module.parameters())
        metrics, counters = _compat.inductor_metrics(), _compat.dynamo_counters()  # (num_bytes_accessed on)
        metrics.reset()
        t0 = time.perf_counter()
        with _compat.inductor_output_code() as codes:
            loss = loss_of(fn)
            row["fw_kernels"] = sum(len(set(KERNEL_DEF.findall(c))) for c in codes)
            loss.backward()
        row["first_step_s"] = time.perf_counter() - t0
        row.update(kernels=sum(len(set(KERNEL_DEF.findall(c))) for c in codes),
                   extern=sum(c.count("extern_kernels.") for c in codes),
                   allocs=sum(c.count("empty_strided") for c in codes),
                   code_kB=sum(len(c) for c in codes) / 1e3,
                   kernel_objs=metrics.generated_kernel_count, bytes=metrics.num_bytes_accessed,
                   ir_nodes=metrics.ir_nodes_pre_fusion,
                   graphs=counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"])
        row["peak_MiB"] = measure_step(lambda: loss_of(fn).backward(), repeats=1, warmup=1,
                                       params=params).peak_bytes / MIB
    except Exception as exc:  # noqa: BLE001 - a failing row is a result
        refusal = find_backend_error(exc, BudgetError)
        row["result"] = ("refused: " + " ".join(str(refusal).split())) if refusal else describe_failure(exc)
    return row


# --------------------------------------------------------------------------- rows (parent side)

def run_in_subprocess(model: str, variant: str, timeout: float) -> dict:
    cache = tempfile.mkdtemp(prefix="bench_codegen_cache_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRANSFORMERS_VERBOSITY="error")
    from bench_budget import run_json_child

    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps([model, variant])]
    return run_json_child(cmd, env, timeout, cache)


def add_ratios(rows: list[dict]) -> None:
    for row in rows:
        ref = next((r for r in rows if r["model"] == row["model"] and r["variant"] == "inductor"), {})
        for col, base in (("kernels_x", "kernels"), ("kernel_objs_x", "kernel_objs"), ("bytes_x", "bytes"),
                          ("allocs_x", "allocs"), ("peak_x", "peak_MiB")):
            if row.get(base) is not None and ref.get(base):
                row[col] = row[base] / ref[base]


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def table(rows: list[dict]) -> list[str]:
    cols = [c for c in COLUMNS if c not in ("result", "wall_s")]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [fmt(r.get(c)) for c in cols]
        if r["result"] != "ok":
            cells[2] = r["result"].split(":")[0]  # refused / error, in place of graphs
        out.append("| " + " | ".join(cells) + " |")
    return out


def write(out: str, rows: list[dict], argv: list[str], code: str) -> None:
    from bench_budget import environment_line

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "codegen.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    notes = [f"- {r['model']} {r['variant']}: {r['result']}" for r in rows if r["result"] != "ok"]
    doc = __doc__.split("\n\n", 2)[2]  # what the rows and columns mean
    lines = ["# Generated code: lynx's Inductor settings against torch.compile's (issue P item 4)", "",
             environment_line(), "",
             f"Command: `python benchmarks/bench_codegen.py {' '.join(argv)}`", "",
             f"Code measured: {code} (when the run started).", "",
             "gpt-tiny: the zoo's preset with 4 layers (dropout 0.1), batch 4 x seq 32, loss `model(x).loss`; "
             "hf-llama, hf-gpt2: as `bench_budget.build(model, 'whole', 'default')` builds them "
             "(4 layers, batch 3 x seq 48, dropout 0, SDPA).", "",
             *table(rows), "", *(["Not ok:", "", *notes, ""] if notes else []),
             "## What the rows and columns mean", "", doc.strip(), ""]
    with open(os.path.join(out, "codegen.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated row names (see the docstring), of {', '.join(VARIANTS)}")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per row")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_row(*json.loads(args.one))))
        return 0
    from bench_budget import git_state

    code, rows = git_state(), []
    for model in args.models.split(","):
        for variant in args.variants.split(","):
            rows.append({"model": model, "variant": variant, **run_in_subprocess(model, variant, args.timeout)})
            add_ratios(rows)
            print(f"{model} {variant}: {rows[-1]['result']} ({rows[-1]['wall_s']:.0f} s)", flush=True)
            write(args.out, rows, argv, code)
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
