"""``lynx demo``: a GPT where activation memory matters, one training step, the ways to trade its
memory for time.

The default model is the zoo's ``gpt-small`` at 8 layers and sequence 512 (hidden 128, 4 heads,
manual attention: each block keeps its 512 x 512 attention maps), batch 2, fp32, dropout 0: an
eager step takes about 0.3 s on one CPU thread and its step peaks at ~21x its parameters. The
same model (same weights, same batch) runs forward + loss + backward under

    eager                          eager, torch.utils.checkpoint per block
    torch.compile                  torch.compile + activation_memory_budget=0.5
    lynx at memory_budget 0.7, 0.5 and 0.2 (0.2: near the smallest it reaches)

the compiled ones per block (``--compile per-block``, the default: each transformer block
``block.compile(fullgraph=True)`` as torchtitan's ``apply_compile`` does; the blocks are alike, so
one compile serves all of them and the compile time does not grow with depth; per-block lynx
plans the blocks together from the recorded second step, so every variant warms up for 3 steps).
Each is measured the same way (``lynx_compile.tools.variants.run_variant``, also what
``benchmarks/bench_step.py`` uses): the first step compiles and its gradients are compared with
eager's; then warm-up and timed steps give the median step time and the measured peak step
memory (``lynx_compile.memory.measure_step``: the CUDA allocator, or on CPU the profiler's
allocator events; ``.grad`` allocated first, the returned gradients counted). A budget lynx cannot
reach is a row marked refused (lynx's one-line BudgetError, naming the smallest reachable
budget), not a crash. The table is printed and written as ``demo_<device>.md`` beside
``demo_<device>.png``, peak memory against step time with one labelled point per variant (when
matplotlib is installed).

``--model gpt-tiny`` (any preset; its own layers and sequence, batch 4) runs the old small demo;
``--layers`` / ``--seq-len`` override the shape.

The table's rows are built in ``tools/demo_table.py``, the plot in ``tools/demo_plot.py``.
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

from lynx_compile.tools.report import environment, human_bytes, markdown_table
from lynx_compile.tools.demo_plot import plot_demo
from lynx_compile.tools.demo_table import TABLE_COLUMNS, conclusion, short_result, table_rows, what
from lynx_compile.tools.variants import GRAD_RTOL, run_variant, under_inductor

DEMO_VARIANTS = ("eager", "checkpoint", "inductor", "inductor-b0.5", "lynx-b0.7", "lynx-b0.5", "lynx-b0.2")
DEMO_MODEL, DEMO_LAYERS, DEMO_SEQ, DEMO_BATCH = "gpt-small", 8, 512, 2
"""The default: gpt-small at 8 layers, sequence 512, batch 2 (an eager step ~0.3 s on one
thread); the seven variants (five per-block compiles) take about 2 minutes on two busy CPU
cores, most of it compiling."""
OTHER_PRESET_BATCH = 4
"""Batch for ``--model`` other than the default (gpt-tiny: at 2 its parameter gradients hold the
smallest reachable budget at 0.76 of its step)."""
DEMO_STYLE, DEMO_WARMUP, DEMO_STEPS = "per-block", 3, 10


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
    wall_s: float = 0.0
    """Seconds from building the model to the written report."""


def run_demo(preset: Optional[str] = None, *, batch_size: Optional[int] = None, n_layers: Optional[int] = None,
             seq_len: Optional[int] = None, dropout: float = 0.0, warmup: int = DEMO_WARMUP,
             steps: int = DEMO_STEPS, device: str = "auto", out: Optional[str] = None,
             variants: Sequence[str] = DEMO_VARIANTS, style: str = DEMO_STYLE, solver: str = "auto",
             progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> DemoResult:
    """Run every variant on ``preset`` (shape: ``demo_shape``) and write ``demo_<device>.md`` and
    ``.png`` under ``out`` (default: ``<tmp>/lynx_demo``).
    ``variants``: ``lynx_compile.tools.variants`` names; ``eager`` always runs first (the reference).
    ``style``: ``per-block`` or ``whole`` (``lynx_compile.tools.variants.COMPILE_STYLES``).
    ``warmup``: steps before the timed ones, the compiling first included (per-block lynx takes at
    least 3, ``variants.min_warmup``; every variant gets the same so their steps compare).
    ``dropout`` > 0 shows why Inductor-compiled gradients then differ from eager's.
    On CPU the steps run on one thread (restored after): with more, a loaded machine's other
    processes stall torch's thread barriers and the step times mean little."""
    from lynx_compile.models import build_model, example_batch
    from lynx_compile.tools.variants import min_warmup

    t_start = time.perf_counter()
    device = resolve_device(device)
    preset, batch_size, overrides = demo_shape(preset, batch_size, n_layers, seq_len)
    torch.manual_seed(0)
    base = build_model(preset, device=device, dropout=dropout, **overrides)
    x = example_batch(base, batch_size, generator=torch.Generator().manual_seed(1)).to(device)
    names = ["eager", *(v for v in variants if v != "eager")]
    warmup = max([warmup, *(min_warmup(n, style) for n in names)])
    threads = torch.get_num_threads()
    rows, ref = [], None
    if device == "cpu":  # torch's own line, which lynx cannot keep quiet without risk (docs/demo.md)
        progress("(torch's CPU allocator may write one warning, 'Memory block of unknown size was allocated "
                 "before the profiling started': memory from before a measurement freed during it, which the "
                 "measure leaves out; it changes no number)")
    try:
        if device == "cpu":
            torch.set_num_threads(1)
        for i, name in enumerate(names):
            start = time.perf_counter()
            # said before it runs: a compiled variant is silent while it compiles (~40 s on 2 cores)
            progress(f"[{i + 1}/{len(names)}] {name} ({what({'variant': name, 'style': style})}): "
                     f"{warmup} warm-up step(s), the first compiling, then {steps} timed ...")
            torch.compiler.reset()
            row, grads = run_variant(name, copy.deepcopy(base), lambda m: m(x).loss, device=device, warmup=warmup,
                                     steps=steps, solver=solver, ref_grads=ref, style=style)
            if name == "eager":
                ref, row["grad_rel_diff"] = grads, 0.0
            row["model"] = preset
            row["style"] = style
            row["why_not_equal"] = why_not_equal(row, dropout=dropout)
            row["grads_equal_eager"] = row["why_not_equal"] is None
            rows.append(row)
            status = short_result(row) if row["result"] != "ok" else \
                f"{row['step_ms']:.3g} ms, peak {human_bytes(row['peak_MiB'] * 2**20)}"
            progress(f"[{i + 1}/{len(names)}] {name}: {status} ({time.perf_counter() - start:.1f} s)")
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    cfg = base.config
    shape = (f"{preset} ({cfg.n_layers} layers, hidden {cfg.hidden}, seq {cfg.seq_len}), batch {batch_size}, fp32, "
             f"dropout {dropout:g}")
    return write_report(rows, shape=shape, device=device, threads=used_threads, out=out, warmup=warmup, steps=steps,
                        solver=solver, style=style, started=t_start)


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


def demo_shape(preset: Optional[str], batch_size: Optional[int], n_layers: Optional[int],
               seq_len: Optional[int]) -> tuple[str, int, dict]:
    """``(preset, batch, config overrides)``: None for ``preset`` is the default demo model
    (``DEMO_MODEL`` at ``DEMO_LAYERS`` layers, sequence ``DEMO_SEQ``, batch ``DEMO_BATCH``); a
    named preset keeps its own shape (batch ``OTHER_PRESET_BATCH``). ``n_layers`` / ``seq_len``
    / ``batch_size`` given override either."""
    if preset is None:
        preset, overrides, batch = DEMO_MODEL, {"n_layers": DEMO_LAYERS, "seq_len": DEMO_SEQ}, DEMO_BATCH
    else:
        overrides, batch = {}, OTHER_PRESET_BATCH
    overrides.update({k: v for k, v in (("n_layers", n_layers), ("seq_len", seq_len)) if v is not None})
    return preset, batch if batch_size is None else batch_size, overrides


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


def write_report(rows: Sequence[dict], *, shape: str, device: str, threads: int, out: Optional[str], warmup: int,
                 steps: int, solver: str, style: str = DEMO_STYLE, started: Optional[float] = None) -> DemoResult:
    """Write ``demo_<device>.md`` (and ``.png`` when matplotlib is present) under ``out``."""
    out = out or os.path.join(tempfile.gettempdir(), "lynx_demo")
    os.makedirs(out, exist_ok=True)
    env = environment()
    machine = env.get("gpu") if device == "cuda" else f"{env['cpu']}, {os.cpu_count()} cores, {threads} thread(s)"
    header = f"lynx demo on {device} ({machine}; torch {env['torch']}, python {env['python']})"
    stem = os.path.join(out, f"demo_{device}")
    plot_path, plot_note = stem + ".png", None
    title = f"lynx demo: {shape}\n{device}: {machine}; torch {env['torch']}"
    try:
        plot_demo(rows, plot_path, title)
    except ImportError:
        plot_path, plot_note = None, "no plot: matplotlib is not installed (pip install matplotlib)"
    compiled = "each transformer block compiled on its own (torchtitan's apply_compile)" if style == "per-block" \
        else "the whole model compiled"
    lines = [header, "", f"{shape}; {compiled}. Step = forward + loss + backward (no optimizer); {warmup} warm-up "
             f"step(s) (the first compiles: first_step_s), median of {steps} timed steps. peak = step memory "
             "measured by `lynx_compile.memory.measure_step` (" + (
                 "CUDA allocator" if device == "cuda" else "the profiler's CPU allocator events")
             + "; .grad allocated first, the returned gradients counted); peak_vs_compile = of torch.compile's "
             "own step (what a lynx memory_budget fraction is of); predicted_peak = lynx's plan of the step. "
             f"grads_equal_eager: first-step gradients within {GRAD_RTOL:g} relative of eager's (grad_rel_diff). "
             f"lynx: solver {solver}, compiler inductor.",
             "", markdown_table(table_rows(rows), TABLE_COLUMNS)]
    failed = [r for r in rows if r["result"] != "ok"]
    if failed:
        lines += ["", *(f"- {r['variant']}: {r['result']}" for r in failed)]
    if said := conclusion(rows):
        lines += ["", *said]
    wall_s = time.perf_counter() - started if started is not None else 0.0
    if started is not None:
        lines += ["", f"Wall time: {wall_s:.0f} s (model, every variant's compile and steps, the report)."]
    text = "\n".join(lines)
    picture = f"![peak memory vs step time, one point per variant]({os.path.basename(stem)}.png)" if plot_path \
        else f"({plot_note})"
    markdown = f"# {text}\n\n{picture}\n"
    with open(stem + ".md", "w") as f:
        f.write(markdown)
    return DemoResult(rows=list(rows), text=text, markdown=markdown, table_path=stem + ".md", plot_path=plot_path,
                      plot_note=plot_note, device=device, wall_s=wall_s)


def cmd_demo(args: Any) -> int:
    """``lynx demo``: run, print the table and where the files are; exit 1 when a variant failed
    with an error or its gradients differ from eager's (a refused budget is a result, not a
    failure; ``--device cuda`` without CUDA: ValueError, which the CLI prints as one line with
    exit 2)."""
    steps = getattr(args, "steps", None)
    result = run_demo(getattr(args, "model", None), batch_size=getattr(args, "batch_size", None),
                      n_layers=getattr(args, "layers", None), seq_len=getattr(args, "seq_len", None),
                      steps=DEMO_STEPS if steps is None else steps, device=args.device, out=args.out,
                      style=getattr(args, "compile", None) or DEMO_STYLE)
    print("\n" + result.text)
    print(f"\ntable: {result.table_path}")
    print(f"plot:  {result.plot_path}" if result.plot_path else f"plot:  {result.plot_note}")
    ran = [r for r in result.rows if not r["result"].startswith("refused")]
    bad = [r["variant"] for r in ran if not r["grads_equal_eager"]]
    refused = [r["variant"] for r in result.rows if r["result"].startswith("refused")]
    print("\nevery variant that ran has eager's gradients" if not bad else f"\nnot equal to eager: {', '.join(bad)}",
          flush=True)
    if refused:
        print(f"refused (budget below what lynx reaches): {', '.join(refused)}", flush=True)
    return 1 if bad else 0
