"""``lynx demo``: one small GPT, one training step, every way to trade its memory for time.

The same model (same weights, same batch, dropout 0, fp32) runs forward + loss + backward under

    eager                         eager, torch.utils.checkpoint per block
    torch.compile                 torch.compile + activation_memory_budget=0.5
    lynx none / selective / full  lynx torch (budget 0.5)    lynx at budgets 0.7 and 0.6

each measured the same way (``lynx_compile.variants.run_variant``, also what
``benchmarks/bench_step.py`` uses): the first step compiles and its gradients are compared with
eager's; then warm-up and timed steps give the median step time and the measured peak
step memory (``lynx_compile.memory.measure_step``: the CUDA allocator, or on CPU the
profiler's allocator events; ``.grad`` allocated first, the returned gradients counted). The
table is printed and written as ``demo_<device>.md`` beside ``demo_<device>.png``, a Pareto plot
of peak memory against step time (when matplotlib is installed).
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from lynx_compile.report import environment, human_bytes, markdown_table
from lynx_compile.variants import GRAD_RTOL, describe, plot_pareto, run_variant, under_inductor

DEMO_VARIANTS = ("eager", "checkpoint", "inductor", "inductor-b0.5", "lynx-none", "lynx-selective", "lynx-full",
                 "lynx-torch-b0.5", "lynx-b0.8", "lynx-b0.7")
DEMO_MODEL, DEMO_BATCH = "gpt-tiny", 4
"""The default size: the ten variants (eight compiles) take about 100 s on two busy CPU cores;
the compiles are nearly all of it (a 4-layer model takes twice as long)."""
TABLE_COLUMNS = ["variant", "what", "step_ms", "peak", "peak_vs_eager", "predicted_peak", "grads_equal_eager",
                 "grad_rel_diff", "first_step_s"]


@dataclass(frozen=True)
class DemoResult:
    """What ``run_demo`` measured and wrote."""

    rows: list[dict]
    """One per variant: ``variant``, ``result`` (``ok`` / ``refused: ...`` / ``error: ...``),
    ``step_ms``, ``peak_MiB``, ``grad_rel_diff``, ``grads_equal_eager`` (bool),
    ``why_not_equal`` (None when equal), ``predicted_peak_MiB`` (lynx), ``first_step_s``."""
    text: str
    """What ``lynx demo`` prints: what ran and how it was measured, the table, refusals."""
    markdown: str
    """The report written to ``table_path``: ``text`` under a title, and the plot."""
    table_path: str
    plot_path: Optional[str]
    """None when matplotlib is not installed (``plot_note`` says so)."""
    plot_note: Optional[str]
    device: str


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` when a CUDA device is present, else ``cpu``; ``cuda`` without one
    raises ValueError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}: auto, cpu or cuda")
    return device


def why_not_equal(row: dict, *, dropout: float, lynx_compiler: str = "inductor") -> Optional[str]:
    """None when the row's first-step gradients equal eager's (``GRAD_RTOL``), else why not."""
    if row["result"] != "ok":
        return "did not run"
    diff = row.get("grad_rel_diff")
    if diff is not None and diff <= GRAD_RTOL:
        return None
    if dropout > 0 and under_inductor(row["variant"], lynx_compiler):
        return "Inductor draws its own dropout masks"
    return f"differs by {diff:.1e} (> {GRAD_RTOL:g})"


def run_demo(preset: str = DEMO_MODEL, *, batch_size: int = DEMO_BATCH, n_layers: Optional[int] = None,
             seq_len: Optional[int] = None, dropout: float = 0.0, warmup: int = 2, steps: int = 20,
             device: str = "auto", out: Optional[str] = None, variants: Sequence[str] = DEMO_VARIANTS,
             solver: str = "auto",
             progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> DemoResult:
    """Run every variant on ``preset`` (``n_layers`` / ``seq_len``: None keeps the preset's) and
    write ``demo_<device>.md`` and ``.png`` under ``out`` (default: ``<tmp>/lynx_demo``).
    ``variants``: ``lynx_compile.variants`` names; ``eager`` always runs first (the reference).
    ``dropout`` > 0 shows why Inductor-compiled gradients then differ from eager's.
    On CPU the steps run on one thread (restored after): with more, a loaded machine's other
    processes stall torch's thread barriers and the step times mean little."""
    from lynx_compile.models import build_model, example_batch

    device = resolve_device(device)
    overrides = {k: v for k, v in (("n_layers", n_layers), ("seq_len", seq_len)) if v is not None}
    torch.manual_seed(0)
    base = build_model(preset, device=device, dropout=dropout, **overrides)
    x = example_batch(base, batch_size, generator=torch.Generator().manual_seed(1)).to(device)
    names = ["eager", *(v for v in variants if v != "eager")]
    threads = torch.get_num_threads()
    rows, ref = [], None
    try:
        if device == "cpu":
            torch.set_num_threads(1)
        for i, name in enumerate(names):
            start = time.perf_counter()
            torch.compiler.reset()
            row, grads = run_variant(name, copy.deepcopy(base), lambda m: m(x).loss, device=device, warmup=warmup,
                                     steps=steps, solver=solver, ref_grads=ref)
            if name == "eager":
                ref, row["grad_rel_diff"] = grads, 0.0
            row["model"] = preset
            row["why_not_equal"] = why_not_equal(row, dropout=dropout)
            row["grads_equal_eager"] = row["why_not_equal"] is None
            rows.append(row)
            status = row["result"] if row["result"] != "ok" else \
                f"{row['step_ms']:.3g} ms, peak {human_bytes(row['peak_MiB'] * 2**20)}"
            progress(f"[{i + 1}/{len(names)}] {name}: {status} ({time.perf_counter() - start:.1f} s)")
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    cfg = base.config
    shape = (f"{preset} ({cfg.n_layers} layers, hidden {cfg.hidden}, seq {cfg.seq_len}), batch {batch_size}, fp32, "
             f"dropout {dropout:g}")
    return write_report(rows, shape=shape, device=device, threads=used_threads, out=out, warmup=warmup, steps=steps,
                        solver=solver)


def table_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows as the printed table shows them."""
    eager_peak = next((r.get("peak_MiB") for r in rows if r["variant"] == "eager"), None)
    out = []
    for r in rows:
        ok = r["result"] == "ok"
        peak = r.get("peak_MiB")
        predicted = r.get("predicted_peak_MiB")
        out.append({
            "variant": r["variant"], "what": describe(r["variant"]),
            "step_ms": round(r["step_ms"], 2) if ok else r["result"],
            "peak": human_bytes(peak * 2**20) if ok else "-",
            "peak_vs_eager": round(peak / eager_peak, 3) if ok and eager_peak else None,
            "predicted_peak": human_bytes(predicted * 2**20) if predicted is not None else "-",
            "grads_equal_eager": "yes" if r["grads_equal_eager"] else f"no: {r['why_not_equal']}",
            "grad_rel_diff": f"{r['grad_rel_diff']:.1e}" if r.get("grad_rel_diff") is not None else "-",
            "first_step_s": round(r["first_step_s"], 1) if r.get("first_step_s") is not None else None,
        })
    return out


def write_report(rows: Sequence[dict], *, shape: str, device: str, threads: int, out: Optional[str], warmup: int,
                 steps: int, solver: str) -> DemoResult:
    """Write ``demo_<device>.md`` (and ``.png`` when matplotlib is present) under ``out``."""
    out = out or os.path.join(tempfile.gettempdir(), "lynx_demo")
    os.makedirs(out, exist_ok=True)
    env = environment()
    machine = env.get("gpu") if device == "cuda" else f"{env['cpu']}, {os.cpu_count()} cores, {threads} thread(s)"
    header = f"lynx demo on {device} ({machine}; torch {env['torch']}, python {env['python']})"
    stem = os.path.join(out, f"demo_{device}")
    plot_path, plot_note = stem + ".png", None
    try:
        plot_pareto(rows, plot_path, f"{header}\n{shape}")
    except ImportError:
        plot_path, plot_note = None, "no Pareto plot: matplotlib is not installed (pip install matplotlib)"
    lines = [header, "", f"{shape}. Step = forward + loss + backward (no optimizer); {warmup} warm-up step(s) (the "
             f"first compiles: first_step_s), median of {steps} timed steps. peak = step memory measured by "
             "`lynx_compile.memory.measure_step` (" + (
                 "CUDA allocator" if device == "cuda" else "the profiler's CPU allocator events")
             + "; .grad allocated first, the returned gradients counted); predicted_peak = lynx's plan. grads_equal_eager: first-step gradients "
             f"within {GRAD_RTOL:g} relative of eager's (grad_rel_diff). lynx: solver {solver}, compiler inductor.",
             "", markdown_table(table_rows(rows), TABLE_COLUMNS)]
    failed = [r for r in rows if r["result"] != "ok"]
    if failed:
        lines += ["", *(f"- {r['variant']}: {r['result']}" for r in failed)]
    text = "\n".join(lines)
    picture = f"![Pareto plot: peak activation memory vs step time]({os.path.basename(stem)}.png)" if plot_path \
        else f"({plot_note})"
    markdown = f"# {text}\n\n{picture}\n"
    with open(stem + ".md", "w") as f:
        f.write(markdown)
    return DemoResult(rows=list(rows), text=text, markdown=markdown, table_path=stem + ".md", plot_path=plot_path,
                      plot_note=plot_note, device=device)


def cmd_demo(args: Any) -> int:
    """``lynx demo``: run, print the table and where the files are; exit 1 when a variant failed
    or its gradients differ from eager's (``--device cuda`` without CUDA: ValueError, which the
    CLI prints as one line with exit 2)."""
    result = run_demo(args.model, batch_size=args.batch_size, steps=args.steps, device=args.device, out=args.out)
    print("\n" + result.text)
    print(f"\ntable: {result.table_path}")
    print(f"plot:  {result.plot_path}" if result.plot_path else f"plot:  {result.plot_note}")
    bad = [r["variant"] for r in result.rows if not r["grads_equal_eager"]]
    print("\nevery variant's gradients equal eager's" if not bad else f"\nnot equal to eager: {', '.join(bad)}",
          flush=True)
    return 1 if bad else 0
