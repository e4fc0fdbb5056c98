"""Does ``memory_budget`` hold for the measured peak of a whole training step? (issue M, item 6)

    python benchmarks/bench_budget.py --quick      # gpt-tiny, post-LN GQA, HF Llama; whole; inductor; none/0.7/0.5
    python benchmarks/bench_budget.py              # every model x style x compiler x budget below
    python benchmarks/bench_budget.py --models hf-gpt2 --styles graph-break --compilers inductor,eager

A table of model x compile style x compiler x budget. Each row runs in its own Python process
(fresh dynamo / Inductor caches, a cold Inductor on-disk cache directory of its own, so that
Inductor's scheduler runs and its estimate exists), with a timeout; a crash or hang is that
row's ``result``, the other rows still run.

Models (4 layers, batch 3 x sequence 48, float32, dropout 0, one thread): ``gpt-tiny`` (the zoo's
preset, ``lynx_compile.models.build_model``, hidden 64, 4 heads, vocabulary 128), ``postln-gqa``
(``foreign_models.PostLNGQALM``), ``hf-llama`` (``foreign_models.hf_llama``, called with
``labels=``: no graph break), sized like gpt-tiny (built by ``bench_step.build``), and
``hf-gpt2`` (transformers ``GPT2LMHeadModel``, n_embd 64, 4 heads, vocabulary 128). Attention:
each model's own default (``--attn default``: the zoo's manual attention, SDPA for the other
three) or ``--attn manual`` / ``sdpa`` for all.
torchtitan 0.3.0 (``pip install -e ".[torchtitan]"``): ``tt-llama3``, ``tt-qwen3``, ``tt-deepseek``
(MoE): each package's own ``debugmodel`` (``benchmarks/torchtitan_models.py``: every layer and
width of the registry's model, SDPA in place of FlexAttention as torchtitan's graph_trainer tests
do, float32, torchtitan's ``init_weights``), batch 2 x sequence 256 (``TT_SHAPE``; ``--attn`` does
not apply). Their ``per-block`` style is torchtitan's own ``torchtitan.distributed.compile.apply_compile``
with ``CompileConfig(backend=...)`` set to ``"inductor"`` or the lynx backend object
(``lynx_compile.backend(memory_budget=B, ...)``), ``whole`` is ``torch.compile(model, backend=...)``;
in both the loss (torchtitan's ``CrossEntropyLoss``) is compiled with the same backend by
torchtitan's own ``BaseLoss._maybe_compile``, as its trainer does (a graph after the model's).
``graph-break`` is not run for them.

Compile styles: ``whole``: ``torch.compile(model)``; ``per-block``: each transformer block (the
model's largest ``nn.ModuleList``) compiled on its own, ``block.compile(backend=...,
fullgraph=True)`` as torchtitan's ``apply_compile`` does, the rest eager; ``graph-break``:
``torch.compile(model)`` with a graph break: HF GPT-2 called with ``labels=`` (its loss call
breaks the graph), the other models with a ``print`` in a forward pre-hook of ``lm_head``
(``add_print_break``).
For GPT-2, ``whole`` and ``per-block`` compute the loss from the logits inside the compiled
wrapper (no ``labels=``, no break).

Compilers: ``inductor`` (budget ``none``: ``torch.compile(model)``, ``backend="inductor"``, no
lynx); ``eager`` (budget ``none``: plain eager PyTorch, nothing compiled; lynx rows use lynx's
option ``compiler="eager"``). Budgets: ``none`` (no lynx, the reference of its compiler and
style), a fraction ``B`` (``backend="lynx", options={"memory_budget": B, "compiler": ...}``,
everything else lynx's defaults), ``min``: the smallest budget lynx accepts: first
``--min-probe`` (0.05); when lynx refuses (``BudgetError``, ``Use memory_budget >= X``) again at X
(X + 0.001 when the same X is named twice), up to 4 tries; the refusals are kept (``refusals``).

Per row, the step is ``loss_of(model).backward()``, no optimizer. ``--warmup`` steps (the first
compiles: ``first_step_s``; gradients accumulate), then three peaks, each from the CPU profiler's
allocator events over one step (``lynx_compile.memory.measure.cpu_peak_bytes``), above what is
allocated when that step starts:

- ``step_ms``, ``ms_MiB``: ``lynx_compile.memory.measure.measure_step(step, params=...)`` as the
  working tree defines it when the row runs (``--steps`` timed steps, median; then its peak).
  At commit 9a7432c it excluded the parameter gradients; the uncommitted tree of 2026-11-26
  (``lynx_compile.budget``) gives every parameter a ``.grad`` before the measured step and counts
  the gradients the backward returns until autograd has added them into ``.grad``.
- ``act_MiB``: the parameter gradients excluded (9a7432c's ``measure_step(params=...)``, spelled
  with the same helpers: ``.grad`` set to None first, then ``cpu_peak_bytes`` with ``exclude`` =
  the storages left in ``.grad`` and those a lynx backward reports to
  ``measure.BACKWARD_OUTPUTS``): activation memory as lynx's plans count it.
- ``step_MiB``: every ``.grad`` set to None first (torch's default ``zero_grad(set_to_none=True)``),
  nothing excluded: everything the step allocates, parameter gradients from when the backward
  creates them.
- ``ms_frac`` / ``act_frac`` / ``step_frac``: the row's peak / the same model, style and compiler's
  ``none`` row.
- ``pred_graphs``: each lynx plan compiled in the row's process, in compile order,
  ``peak/no-recompute-peak MiB (scope)`` (``scope``: what lynx checked the budget on:
  ``peak`` = the graph's activation peak, ``saved`` = the activations the graph saves, for a
  graph that is a piece of the model planned provisionally, ``step`` = the whole step's peak, the
  pieces planned together); ``pred_max_MiB`` / ``pred_sum_MiB``: the largest / the sum of
  the plans' predicted peaks, ``pred_frac``: the largest plan's peak / its no-recompute peak.
  For one graph (``whole``) the three agree and are lynx's prediction of ``act_MiB``. With several
  graphs neither is the step's peak: the forwards of earlier graphs keep their saved activations
  while later graphs run, so the step peak is above the max and below the sum (for per-block
  with one graph reused by every block, the max is one block's peak, far below the step's).
- ``pred_step_MiB`` / ``pred_step_ref_MiB``: where lynx planned the pieces together from the
  recorded second step (``lynx_compile.step.recorder``; scope ``step``): its prediction of the
  whole step's peak, and of the same step with no piece recomputing (what a fraction is of).
- ``inductor_est_MiB``: ``RecomputePlan.compiled_peak_bytes`` (Inductor's estimate of the compiled
  graph's peak; lynx rows under ``compiler="inductor"`` only), max over graphs (per graph in
  ``inductor_est_graphs``).

``tree``: a hash of every ``.py`` file under ``lynx_compile/`` and ``passes/`` when the row started
(the code being measured; other people change it while a run goes on).

Summary (printed and in the .md): per budget row whether ms, act and step are <= budget + 0.02 of
``none``, and per (model, style, compiler) whether each measure is monotone in the budget (a
smaller budget never measures a larger peak).

Writes ``<out>/budget.csv`` and ``.md`` (``budget_quick.*`` with ``--quick``, ``<stem>.*`` with ``--stem``), rewritten after
every row, so a run stopped early keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

RESULTS = os.path.join(HERE, "results")
MODELS = ("gpt-tiny", "postln-gqa", "hf-llama", "hf-gpt2", "tt-llama3", "tt-qwen3", "tt-deepseek")
TORCHTITAN = ("tt-llama3", "tt-qwen3", "tt-deepseek")
STYLES = ("whole", "per-block", "graph-break")
COMPILERS = ("inductor", "eager")
BUDGETS = ("none", "0.7", "0.5", "min")
QUICK = dict(models="gpt-tiny,postln-gqa,hf-llama", styles="whole", compilers="inductor", budgets="none,0.7,0.5")
SHAPE = dict(layers=4, batch=3, seq=48)
TT_SHAPE = dict(batch=2, seq=256)  # torchtitan's debug models keep their own layers and widths
TOLERANCE = 0.02
MAX_MIN_TRIES = 4
MIB = 2 ** 20
COLUMNS = ["model", "style", "compiler", "budget", "budget_value", "result", "graphs", "pred_graphs",
           "pred_max_MiB", "pred_sum_MiB", "pred_frac", "pred_step_MiB", "pred_step_ref_MiB", "inductor_est_MiB",
           "inductor_est_graphs", "ms_MiB",
           "ms_frac", "act_MiB", "act_frac", "step_MiB", "step_frac", "step_ms", "first_step_s", "wall_s", "tree",
           "refusals"]
MD_COLUMNS = ["model", "style", "compiler", "budget", "budget_value", "graphs", "pred_graphs", "pred_max_MiB",
              "pred_sum_MiB", "pred_frac", "pred_step_MiB", "pred_step_ref_MiB", "inductor_est_MiB", "ms_MiB", "ms_frac", "act_MiB", "act_frac",
              "step_MiB", "step_frac", "step_ms", "first_step_s", "tree", "status"]
USE_RE = re.compile(r"use (?:memory_budget|a budget) >= ([0-9]*\.?[0-9]+)", re.IGNORECASE)


# ------------------------------------------------------------------------------------- models

def _gpt2(attn: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_positions=SHAPE["seq"], n_embd=64, n_layer=SHAPE["layers"], n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                     eos_token_id=0, attn_implementation=attn)
    return GPT2LMHeadModel(cfg)


def build(model: str, style: str, attn: str) -> tuple[Any, Callable[[Callable], Any]]:
    """(module to compile, loss_of(callable) -> scalar loss); same weights and batch every process."""
    import torch
    import torch.nn.functional as F

    if model == "hf-gpt2":
        hf_attn = "eager" if attn == "manual" else "sdpa"
        torch.manual_seed(0)
        lm = _gpt2(hf_attn)
        gen = torch.Generator().manual_seed(1)
        idx = torch.randint(0, 128, (SHAPE["batch"], SHAPE["seq"]), generator=gen)
        targets = torch.randint(0, 128, (SHAPE["batch"], SHAPE["seq"]), generator=gen)
        if style == "graph-break":
            return lm, lambda m: m(input_ids=idx, labels=targets).loss

        class WithLoss(torch.nn.Module):  # loss inside the compiled region, no labels=: no break
            def __init__(self, lm):
                super().__init__()
                self.lm = lm

            def forward(self, idx, targets):
                logits = self.lm(input_ids=idx).logits
                return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())

        return WithLoss(lm), lambda m: m(idx, targets)
    from bench_step import Settings
    from bench_step import build as step_build

    if attn == "default":
        attn = "manual" if model == "gpt-tiny" else "sdpa"
    name = {"gpt-tiny": "gpt-tiny", "postln-gqa": "gqa:gpt-tiny", "hf-llama": "hf-llama:gpt-tiny"}[model]
    return step_build(Settings(model=name, attn=attn, dropout=0.0, layers=SHAPE["layers"], batch=SHAPE["batch"],
                               seq=SHAPE["seq"]))


def add_print_break(module: Any) -> None:
    """A ``print`` in a forward pre-hook of the LM head (``lm_head``, called after the block loop):
    dynamo breaks the graph there, between the blocks and the loss, as GPT-2's ``labels=`` does.
    (A ``print`` inside a block, in the loop, makes dynamo skip the whole forward and compile each
    block's frame alone: per-block, not a break.)"""
    sink = open(os.devnull, "w")
    module.lm_head.register_forward_pre_hook(lambda mod, args: print("lm_head", file=sink))


def lynx_opts(compiler: str, budget: Optional[float]) -> Optional[dict]:
    return None if budget is None else {"memory_budget": budget, "compiler": compiler}


def prepare(module: Any, style: str, compiler: str, budget: Optional[float], model: str) -> Callable:
    import torch

    from lynx_compile.tools.variants import compile_blocks

    opts = lynx_opts(compiler, budget)
    if opts is None and compiler == "eager":
        return module  # the eager reference: nothing compiled
    kw = {"backend": "inductor"} if opts is None else {"backend": "lynx", "options": opts}
    if style == "per-block":
        return compile_blocks(module, **kw)  # torchtitan's apply_compile
    if style == "graph-break" and model != "hf-gpt2":
        add_print_break(module)
    return torch.compile(module, **kw)


# ------------------------------------------------------------------------------ one row (child)

def run_row(model: str, style: str, compiler: str, budget: Optional[float], attn: str, warmup: int,
            steps: int, threads: int) -> dict:
    import torch

    import lynx_compile
    import lynx_compile.memory.measure as measure_mod
    from lynx_compile.compiler.dynamo_backend import find_backend_error
    from lynx_compile.decisions import BudgetError
    from lynx_compile.memory.measure import cpu_peak_bytes, measure_step
    from lynx_compile.tools.variants import describe_failure

    torch.set_num_threads(threads)
    row: dict[str, Any] = {"result": "ok"}
    opts = lynx_opts(compiler, budget)
    try:
        known = len(lynx_compile.backend(**opts).plans) if opts else 0
        if model in TORCHTITAN:  # model and loss compiled as torchtitan does (torchtitan_models)
            import torchtitan_models as tt

            backend = (lynx_compile.backend(**opts) if opts else None if compiler == "eager" else "inductor")
            module, tt_step = tt.step_fn(model, style, backend, TT_SHAPE["batch"], TT_SHAPE["seq"])
            fn, loss_of = tt_step, lambda f: f()
        else:
            module, loss_of = build(model, style, attn)
            fn = prepare(module, style, compiler, budget, model)
        params = list(module.parameters())

        def zero() -> None:
            for p in params:
                p.grad = None

        def step() -> None:
            loss = loss_of(fn)
            if model not in TORCHTITAN:  # a torchtitan step runs its backward itself
                loss.backward()

        t0 = time.perf_counter()
        step()
        row["first_step_s"] = time.perf_counter() - t0
        for _ in range(warmup - 1):
            step()
        m = measure_step(step, device="cpu", repeats=steps, warmup=0, params=params)
        row["step_ms"] = m.step_s * 1e3
        row["ms_MiB"] = m.peak_bytes / MIB
        zero()  # act: gradients excluded (what a lynx backward returns, what is left in .grad)
        measure_mod.BACKWARD_OUTPUTS = set()
        try:
            row["act_MiB"] = cpu_peak_bytes(step, lambda: set(measure_mod.BACKWARD_OUTPUTS) | {
                p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}) / MIB
        finally:
            measure_mod.BACKWARD_OUTPUTS = None
        zero()  # step: everything, gradients included
        row["step_MiB"] = cpu_peak_bytes(step) / MIB
        if opts:
            plans = lynx_compile.backend(**opts).plans[known:]
            row["graphs"] = len(plans)
            row["pred_graphs"] = "; ".join(
                f"{p.peak_bytes / MIB:.3f}/{p.reference_peak_bytes / MIB:.3f} ({p.budget_scope})" for p in plans)
            if plans:
                row["pred_max_MiB"] = max(p.peak_bytes for p in plans) / MIB
                row["pred_sum_MiB"] = sum(p.peak_bytes for p in plans) / MIB
                big = max(plans, key=lambda p: p.peak_bytes)
                row["pred_frac"] = big.peak_fraction
            step = [p for p in plans if p.budget_scope == "step"]
            if step:
                row["pred_step_MiB"] = step[-1].step_peak_bytes / MIB
                row["pred_step_ref_MiB"] = step[-1].step_reference_bytes / MIB
            est = [p.compiled_peak_bytes for p in plans]
            if compiler == "inductor":
                row["inductor_est_graphs"] = "; ".join("-" if e is None else f"{e / MIB:.3f}" for e in est)
                if any(e is not None for e in est):
                    row["inductor_est_MiB"] = max(e for e in est if e is not None) / MIB
    except Exception as exc:  # noqa: BLE001 - a failing row is a result
        refusal = find_backend_error(exc, BudgetError)
        if refusal is not None:
            row["result"] = "refused: " + " ".join(str(refusal).split())
        else:
            row["result"] = describe_failure(exc)
    return row


# --------------------------------------------------------------------------- rows (parent side)

def run_in_subprocess(args: argparse.Namespace, model: str, style: str, compiler: str,
                      budget: Optional[float]) -> dict:
    cache = tempfile.mkdtemp(prefix="bench_budget_cache_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache, "triton"), TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, os.path.abspath(__file__), "--one",
           json.dumps({"model": model, "style": style, "compiler": compiler, "budget": budget}),
           "--attn", args.attn, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    return run_json_child(cmd, env, args.timeout, cache)


def run_json_child(cmd: list[str], env: dict, timeout: float, cache: str) -> dict:
    """Run one row's child process (``cmd``, ``env``); its last JSON line on stdout, plus its
    ``wall_s``, or an ``error: ...`` result naming the timeout or the last line on stderr.
    ``cache`` (the child's cache directory) is removed afterwards."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"result": f"error: TimeoutExpired: no result after {timeout:g} s",
                "wall_s": time.perf_counter() - t0}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return {**json.loads(line), "wall_s": wall}
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return {"result": f"error: process exited {proc.returncode}: {tail[-1] if tail else 'no output'}",
            "wall_s": wall}


def measure(args: argparse.Namespace, model: str, style: str, compiler: str, budget: str) -> dict:
    """One table row; ``budget`` ``min`` probes and follows lynx's refusals."""
    base = {"model": model, "style": style, "compiler": compiler, "budget": budget, "tree": tree_hash()}
    if budget != "min":
        value = None if budget == "none" else float(budget)
        return {**base, "budget_value": value, **run_in_subprocess(args, model, style, compiler, value)}
    value, refusals, wall = args.min_probe, [], 0.0
    for _ in range(MAX_MIN_TRIES):
        row = run_in_subprocess(args, model, style, compiler, value)
        wall += row.get("wall_s", 0.0)
        if not row["result"].startswith("refused"):
            break
        refusals.append(f"{value:g}: {row['result']}")
        named = USE_RE.search(row["result"])
        if not named:
            break
        nxt = float(named.group(1))
        value = round(value + 0.001, 3) if nxt <= value else nxt
        if value > 1.0:
            break
    return {**base, "budget_value": value, **row, "wall_s": wall, "refusals": " | ".join(refusals) or None}


def tree_hash() -> str:
    """sha256 (8 hex) of every .py under lynx_compile/ and passes/: the code a row measured."""
    import hashlib

    root = os.path.dirname(HERE)
    h = hashlib.sha256()
    for top in ("lynx_compile", "passes"):
        for d, dirs, files in sorted(os.walk(os.path.join(root, top))):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(d, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:8]


def git_state() -> str:
    root = os.path.dirname(HERE)
    git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = (git("diff", "--name-only", "HEAD", "--", "lynx_compile", "passes").split()
             + git("ls-files", "--others", "--exclude-standard", "--", "lynx_compile", "passes").split())
    return (f"git HEAD {git('rev-parse', '--short', 'HEAD')}" + (
        f", with uncommitted changes (other people's work in progress) in {', '.join(dirty)}" if dirty else ""))


# ------------------------------------------------------------------------------------ reporting

def finish(rows: Sequence[dict]) -> list[dict]:
    """Rows with every column: fractions of the ``none`` row, rounded, ``status``."""
    ref = {(r["model"], r["style"], r["compiler"]): r for r in rows if r["budget"] == "none" and r["result"] == "ok"}
    out = []
    for r in rows:
        r = dict(r)
        base = ref.get((r["model"], r["style"], r["compiler"]))
        if base is not None and r["result"] == "ok":
            for k in ("ms", "act", "step"):
                if r.get(f"{k}_MiB") is not None and base.get(f"{k}_MiB"):
                    r[f"{k}_frac"] = r[f"{k}_MiB"] / base[f"{k}_MiB"]
        for k, v in list(r.items()):
            if isinstance(v, float) and k != "budget_value":
                r[k] = float(f"{v:.4g}")
        r["status"] = r["result"] if r["result"] == "ok" else r["result"].split(":")[0]
        out.append({k: r.get(k) for k in COLUMNS + ["status"]})
    return out


def summary(rows: Sequence[dict]) -> list[str]:
    """Budget check per row and monotonicity per (model, style, compiler)."""
    lines = []
    for r in rows:
        if r["budget"] in ("none", "-"):
            continue
        head = f"{r['model']} {r['style']} {r['compiler']} budget {r['budget']}"
        if r["budget"] == "min" and r.get("budget_value") is not None:
            head += f" (= {r['budget_value']:g}" + ("" if r.get("refusals") else
                                                   ": the probe itself was accepted, nothing lower tried") + ")"
        if r["result"] != "ok":
            lines.append(f"{head}: {r['result'][:200]}")
            continue
        b = r["budget_value"]
        parts = []
        for k in ("ms", "act", "step"):
            f = r.get(f"{k}_frac")
            parts.append(f"{k} {'-' if f is None else f'{f:.3f}'} "
                         + ("(no none row)" if f is None else "<= budget + 0.02: " + ("yes" if f <= b + TOLERANCE
                                                                                     else "NO")))
        lines.append(f"{head}: " + "; ".join(parts))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["result"] == "ok" and r["budget"] != "-":
            groups.setdefault((r["model"], r["style"], r["compiler"]), []).append(r)
    for key, rs in groups.items():
        rs = sorted(rs, key=lambda r: -(r["budget_value"] if r["budget_value"] is not None else 2.0))
        if len(rs) < 2:
            continue
        parts = []
        for k in ("ms", "act", "step"):
            vals = [(r["budget"], r.get(f"{k}_MiB")) for r in rs]
            bad = [f"{a} {va:.4g} < {b} {vb:.4g}" for (a, va), (b, vb) in zip(vals, vals[1:])
                   if va is not None and vb is not None and vb > va]
            parts.append(f"{k} monotone: " + ("yes" if not bad else "NO (" + ", ".join(bad) + ")"))
        order = " > ".join(r["budget"] if r["budget"] != "min" else f"min={r['budget_value']:g}" for r in rs)
        lines.append(f"{' '.join(key)} [{order}]: " + "; ".join(parts))
    return lines


def environment_line() -> str:
    import torch

    from lynx_compile.tools.report import environment

    env = environment()
    try:
        import transformers
        tv = transformers.__version__
    except Exception:  # noqa: BLE001
        tv = "not installed"
    try:
        from importlib.metadata import version
        ttv = version("torchtitan")
    except Exception:  # noqa: BLE001
        ttv = "not installed"
    return (f"{datetime.date.today().isoformat()}; CPU {env['cpu']} ({os.cpu_count()} cores, shared); "
            f"torch {torch.__version__}, transformers {tv}, torchtitan {ttv}; python {platform.python_version()}.")


def write(out: str, stem: str, rows: Sequence[dict], argv: Sequence[str], notes: Sequence[str],
          env_line: str, done: bool, pending: Sequence[tuple] = (), git_state_start: str = "",
          attn: str = "default") -> str:
    from lynx_compile.tools.report import csv_text, markdown_table

    os.makedirs(out, exist_ok=True)
    table = finish(rows)
    with open(os.path.join(out, stem + ".csv"), "w") as f:
        f.write(csv_text([{k: r[k] for k in COLUMNS} for r in table]))
    lines = ["# memory_budget against the measured peak of a training step (CPU)", "", env_line, "",
             "Command: `" + " ".join(["python benchmarks/bench_budget.py", *argv]) + "`", "",
             "Code measured: " + git_state_start + "; `tree` column: hash of lynx_compile/ and passes/ "
             "*.py when the row started (rows with different hashes measured different code).", "",
             f"{SHAPE['layers']} layers, batch {SHAPE['batch']} x seq {SHAPE['seq']} (torchtitan's tt-* models: "
             f"their debugmodel's own layers, batch {TT_SHAPE['batch']} x seq {TT_SHAPE['seq']}, SDPA; "
             "per-block = torchtitan's apply_compile), fp32, dropout 0, "
             "one thread, attention " + attn + "; step = forward + loss + backward, no optimizer; each row "
             "in its own process (cold Inductor cache). Peaks from the CPU profiler's allocator events "
             "over one step, above what is allocated when it starts: ms = the tree's "
             "`measure_step(params=...)` (uncommitted tree: .grad allocated before the step, returned "
             "gradients counted until added into .grad); act = .grad None first, parameter gradients "
             "excluded (9a7432c's measure_step); step = .grad None first, everything counted "
             "(gradients included). "
             "*_frac = / the same model, style and compiler's `none` row. pred_graphs: per lynx graph "
             "`predicted peak / no-recompute peak MiB (budget scope)`; pred_max / pred_sum: max and sum "
             "over graphs (one graph: lynx's prediction of act; several: the step's peak lies between "
             "them, see the script's docstring); inductor_est: `RecomputePlan.compiled_peak_bytes`, "
             "max over graphs. See `benchmarks/bench_budget.py` for the details.", ""]
    if not done:
        lines += [f"**Partial: the run was still going (or was stopped) when this was written; "
                  f"{len(pending)} rows of its selection had not run (listed at the end).**", ""]
    lines += [markdown_table(table, MD_COLUMNS)]
    failed = [r for r in rows if r["result"] != "ok" or r.get("refusals")]
    if failed:
        lines += ["", "Not ok, refusals:", ""]
        for r in failed:
            head = f"- {r['model']} {r['style']} {r['compiler']} budget {r['budget']}"
            if r["result"] != "ok":
                lines.append(f"{head}: {r['result']}")
            if r.get("refusals"):
                lines.append(f"{head}: refusals on the way: {r['refusals']}")
    lines += ["", "Summary (budget + 0.02; monotone in the budget):", ""]
    lines += [f"- {ln}" for ln in summary(table)] or ["- (nothing)"]
    if notes:
        lines += ["", *(f"Note: {n}" for n in notes)]
    if pending:
        lines += ["", f"Not run ({len(pending)} of the selection; model, style, compiler, budget):", "",
                  ", ".join(" ".join(p) for p in pending)]
    text = "\n".join(lines) + "\n"
    write_atomic(os.path.join(out, stem + ".md"), text)
    return text


def write_atomic(path: str, text: str) -> None:
    """``text`` into ``path`` through a temporary file beside it, so a reader never sees half."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ CLI

def _list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        for x in items:
            if x not in choices and not (choices is BUDGETS and _is_fraction(x)):
                raise argparse.ArgumentTypeError(f"{x!r}: choose from {', '.join(choices)}"
                                                 + (" or a fraction in (0, 1]" if choices is BUDGETS else ""))
        return items
    return parse


def _is_fraction(x: str) -> bool:
    try:
        return 0 < float(x) <= 1
    except ValueError:
        return False


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="gpt-tiny, postln-gqa, hf-llama; whole; inductor; "
                   "budgets none, 0.7, 0.5 (about 10 minutes on 2 cores)")
    p.add_argument("--models", type=_list(MODELS), default=None, help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--styles", type=_list(STYLES), default=None, help=f"comma list of {', '.join(STYLES)}")
    p.add_argument("--compilers", type=_list(COMPILERS), default=None, help="comma list of inductor, eager")
    p.add_argument("--budgets", type=_list(BUDGETS), default=None,
                   help="comma list of none, fractions, min (default none,0.7,0.5,min)")
    p.add_argument("--min-probe", type=float, default=0.05, help="first budget tried for 'min'")
    p.add_argument("--attn", default="default", choices=["default", "manual", "sdpa"])
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps, the first compiles")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900, help="seconds per row process")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--stem", default=None, help="file name of the results, without .csv/.md (default budget, "
                   "budget_quick with --quick)")
    p.add_argument("--merge", type=lambda v: [x for x in v.split(",") if x], default=[], metavar="CSV,...",
                   help="budget.csv files of earlier runs of this script: their rows join the table (a row "
                        "run now replaces a merged one with the same model, style, compiler, budget); their "
                        ".md's command, code and wall-time lines become notes")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the table of the --merge rows (rows of the selection that none "
                        "of them has are listed as not run)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


INT_COLUMNS = ("graphs",)
TEXT_COLUMNS = ("model", "style", "compiler", "budget", "result", "pred_graphs", "inductor_est_graphs", "tree",
                "refusals")


def load_rows(path: str) -> tuple[list[dict], list[str]]:
    """Rows of an earlier run's CSV (numbers parsed back) and notes from its .md: the command,
    the code line, the wall time."""
    import csv

    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row: dict[str, Any] = {}
            for k, v in r.items():
                if v == "":
                    row[k] = None
                elif k in TEXT_COLUMNS:
                    row[k] = v
                else:
                    row[k] = int(float(v)) if k in INT_COLUMNS else float(v)
            rows.append(row)
    notes = []
    md = os.path.splitext(path)[0] + ".md"
    if os.path.exists(md):
        with open(md) as f:
            keep = [ln.strip() for ln in f if ln.startswith(("Command:", "Code measured:", "Note: wall time",
                                                             "Note: code at the end", "**Partial"))]
        notes.append(f"rows from `{path}`: " + " ".join(keep))
    return rows, notes


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        spec = json.loads(args.one)
        with contextlib.redirect_stdout(sys.stderr):  # libraries' prints must not mix with the result
            row = run_row(spec["model"], spec["style"], spec["compiler"], spec["budget"], args.attn, args.warmup,
                          args.steps, args.threads)
        print(json.dumps(row))
        return 0
    pick = lambda given, key, full: given or (QUICK[key].split(",") if args.quick else list(full))  # noqa: E731
    models, styles = pick(args.models, "models", MODELS), pick(args.styles, "styles", STYLES)
    compilers, budgets = pick(args.compilers, "compilers", COMPILERS), pick(args.budgets, "budgets", BUDGETS)
    if "none" in budgets:  # the reference first: fractions are of it
        budgets = ["none"] + [b for b in budgets if b != "none"]
    stem = args.stem or ("budget_quick" if args.quick else "budget")
    env_line = environment_line()
    info = {"git_state_start": git_state(), "attn": {"default": "each model's default (zoo: manual; "
            "post-LN GQA, HF Llama, HF GPT-2: SDPA)"}.get(args.attn, args.attn)}
    start, load = time.time(), os.getloadavg()
    rows: list[dict] = []
    notes: list[str] = []
    key = lambda r: (r["model"], r["style"], r["compiler"], r["budget"])  # noqa: E731
    for path in args.merge:
        merged, more = load_rows(path)
        rows += [r for r in merged if key(r) not in {key(x) for x in rows}]
        notes += more
    if args.merge:
        info["git_state_start"] = ("rows from several runs (see the notes); this report written with "
                                   + git_state())
    # compiler outermost (Inductor, the default, first), then style, then model: a run stopped
    # early has every model under the first styles rather than every style of the first models
    todo = [(m, st, c, b) for c in compilers for st in styles for m in models for b in budgets]
    if args.report_only:
        have = {key(r) for r in rows}
        missing = [t for t in todo if t not in have]
        order = {t: i for i, t in enumerate(todo)}
        rows.sort(key=lambda r: order.get(key(r), -1))
        print(write(args.out, stem, rows, argv, notes, env_line, done=True, pending=missing, **info))
        return 0
    for i, (model, style, compiler, budget) in enumerate(todo):
        print(f"{model} {style} {compiler} {budget} ...", end=" ", file=sys.stderr, flush=True)
        row = measure(args, model, style, compiler, budget)
        rows = [r for r in rows if key(r) != key(row)] + [row]
        print(row["result"][:300] if row["result"] != "ok" else
              f"act {row['act_MiB']:.4g} MiB, step {row['step_MiB']:.4g} MiB, {row['step_ms']:.4g} ms"
              f" ({row.get('wall_s', 0):.0f} s)", file=sys.stderr, flush=True)
        write(args.out, stem, rows, argv, notes, env_line, done=False, pending=todo[i + 1:], **info)
    notes.append(f"wall time {(time.time() - start) / 60:.1f} min; load average (1 min) before / after: "
                 f"{load[0]:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (a shared machine: other "
                 "processes disturb step_ms; the peaks are allocator events and do not depend on load).")
    notes.append(f"code at the end of the run: {git_state()}.")
    print(write(args.out, stem, rows, argv, notes, env_line, done=True, **info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
