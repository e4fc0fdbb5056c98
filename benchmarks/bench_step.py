"""One training step (forward + loss + backward, no optimizer) under every recompute variant.

    python benchmarks/bench_step.py --quick                      # CPU-sized, a few minutes on 2 cores
    python benchmarks/bench_step.py --quick --model gpt-tiny,gqa:gpt-tiny,hf-llama:gpt-tiny
    python benchmarks/bench_step.py                              # CPU: gpt-small, GQA, HF Llama; fp32, batch 4
    python benchmarks/bench_step.py --device cuda                # gpt-1.3b (24 layers), GQA, HF Llama; bf16
    python benchmarks/bench_step.py --model tt-llama3 --layers 2 --variants inductor,lynx-b0.7   # torchtitan's llama3
    python benchmarks/bench_step.py --device cuda --model gpt-1.3b --layers 4 --attn sdpa --dropout 0.1 \\
        --variants eager,inductor,inductor-b0.5,lynx-b0.5 --solver highs --lynx-compiler eager

Writes ``<out>/step_<device>.csv``, ``.md`` (machine, versions, date, command) and ``.png`` (Pareto
plot: x = peak MiB, y = step ms). ``--quick`` (gpt-tiny with 4 layers and sequence 64, batch 2,
5 timed steps; torch budgets 0.5 and 0.0, lynx none, full, budgets 0.7 and 0.5) writes
``step_<device>_quick.*``. Prints a summary:
for each lynx budget point, the fastest torch.compile point (default or with a memory budget)
whose measured peak is no higher, and the ratio of step times. Exit status 2 for ``--device
cuda`` without CUDA.

Variants (``--variants``, comma list; each runs in its own process: fresh in-memory compile
caches and allocator statistics, and a cold Inductor/Triton on-disk cache directory, or torch's
usual ones, kept across variants and runs, with ``--shared-cache`` / ``--quick``) are
``lynx_compile.tools.variants`` names: ``eager``; ``checkpoint`` (``torch.utils.checkpoint``
per transformer block, eager); ``inductor``, ``inductor-b<B>`` (``torch.compile``, with
``activation_memory_budget = B``); ``lynx-none``, ``lynx-full``, ``lynx-selective``,
``lynx-torch-b<B>``, ``lynx-b<B>`` (policy lynx, ``memory_budget`` B, solver ``--solver``):
``torch.compile(model, backend="lynx", options={..., "compiler": --lynx-compiler})``. A budget
lynx cannot reach (``BudgetError``) is recorded as ``refused: <first line>``; any other
exception as ``error: <type>: <first line>``.

Models (``--model``, comma list): a zoo preset (``gpt-tiny`` ... ``gpt-1.3b``, built by
``lynx_compile.models.build_model`` with ``--layers`` / ``--seq`` / ``--attn`` / ``--dropout``);
``gqa:<preset>``: ``foreign_models.PostLNGQALM`` (post-LN, grouped-query attention with a quarter
of the heads as key/value heads, GELU MLP, tied embeddings; loss inside forward) sized like that
GPT preset; ``hf-llama:<preset>``: HF ``transformers`` ``LlamaForCausalLM`` sized the same way
(skipped, with a note, when ``transformers`` is not installed); ``tt-llama3`` (or
``tt-llama3:debugmodel``): torchtitan's llama3 ``debugmodel`` (dim 256, 16 heads, vocabulary 2048,
SDPA attention; ``lynx_compile.tools.torchtitan_models.build``) with torchtitan's
``CrossEntropyLoss`` inside the compiled module's forward (``TorchtitanLM``), tokens from
``torchtitan_models.batch``: ``--layers`` keeps its first blocks (default all 6), ``--batch`` and
``--seq`` (default 256) size the batch, ``--dtype`` casts its floating tensors (RoPE's complex
cache stays complex), ``--attn`` and ``--dropout`` do not apply;
skipped, with a note, when torchtitan is not installed.

``--interleave ROUNDS``: step times from one process. After the per-variant processes, one
more process prepares every variant that ran (each on its own copy of the model), warms each
up, then runs ROUNDS rounds of one step per variant, rotating the order every round; ``step_ms``
becomes that median and ``step_ms_own_process`` keeps the per-process one. Drift on a shared
machine then falls on every variant alike, which per-process medians minutes apart cannot give;
the summaries' ratios are then medians of per-round ratios (round i of one variant against round
i of the other: ``paired_ratio``), and the report adds, for each torch.compile budget setting,
the fastest lynx point at no more memory (``torch_settings_summary``).

Measurement, per variant (``lynx_compile.tools.variants.run_variant``, as ``lynx demo``): an eager
reference step (fp32 only) from the same seeds; then ``--warmup`` steps (the first compiles;
its wall time is ``first_step_s``, loss ``loss``), then ``--steps`` timed steps, median
``step_ms`` (CUDA: events; CPU: ``time.perf_counter``). Gradients accumulate (no optimizer, no
zeroing). ``peak_MiB``: ``lynx_compile.memory.measure_step`` over one more step, every parameter's
``.grad`` allocated first and the gradients the backward returns counted (the step's peak as a
memory budget bounds it): CUDA: ``max_memory_allocated`` above what was allocated before it;
CPU: the profiler's allocator events.
``predicted_peak_MiB``: the lynx plan's predicted peak (exact for ``compiler="eager"``; Inductor's
fusions change the real one).
``grad_rel_diff``: max over parameters of max|g - g_eager| / max|g_eager| after the first step
(the denominator floored at 1e-6 of the largest gradient of any parameter);
with dropout > 0, Inductor draws its own random numbers, so compiled-by-Inductor variants
cannot equal eager; ``grad_rel_diff_vs_inductor`` then compares them with the ``inductor``
variant's gradients (same seed, same Inductor RNG stream): torch's budget recomputing dropout
with fresh masks shows there.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # sibling benchmark modules, also when imported from tests
    sys.path.insert(0, HERE)

from bench_kernels import environment as gpu_environment  # noqa: E402
from bench_kernels import header_line  # noqa: E402

from lynx_compile.tools import variants  # noqa: E402
from lynx_compile.memory.measure import grad_rel_diff, grad_snapshot  # noqa: E402
from lynx_compile.tools.report import csv_text, markdown_table  # noqa: E402
from lynx_compile.tools.report import environment as host_environment  # noqa: E402
from lynx_compile.tools.variants import (checkpoint_blocks, describe_failure, parse_variant,  # noqa: E402,F401
                                   plot_pareto, transformer_blocks, under_inductor)

RESULTS = os.path.join(HERE, "results")
NO_CUDA_MESSAGE = "bench_step.py --device cuda needs a CUDA GPU; none found"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TORCH_BUDGETS = (1.0, 0.9, 0.7, 0.5, 0.3, 0.1, 0.0)
LYNX_BUDGETS = (0.7, 0.5, 0.3)
QUICK_TORCH_BUDGETS = (0.5, 0.0)  # "inductor" is budget 1.0 (torch's default)
QUICK_LYNX_BUDGETS = (0.7, 0.5)
QUICK_SHAPE = {"model": "gpt-tiny", "layers": 4, "seq": 64}  # 2 layers: the LM head dominates the peak
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
COLUMNS = ["model", "variant", "result", "step_ms", "step_ms_own_process", "peak_MiB", "peak_vs_eager", "first_step_s",
           "predicted_peak_MiB", "loss", "loss_equals_eager", "grad_rel_diff", "grads_equal_eager",
           "grad_rel_diff_vs_inductor"]
MD_COLUMNS = [c for c in COLUMNS if c != "result"] + ["status"]


def default_variants(quick: bool) -> list[str]:
    torch_b = QUICK_TORCH_BUDGETS if quick else TORCH_BUDGETS
    lynx_b = QUICK_LYNX_BUDGETS if quick else LYNX_BUDGETS
    policies = ("none", "full") if quick else ("none", "full", "selective")
    return (["eager", "checkpoint", "inductor", *(f"inductor-b{b}" for b in torch_b),
             *(f"lynx-{p}" for p in policies), *(f"lynx-b{b}" for b in lynx_b)])


@dataclasses.dataclass(frozen=True)
class Settings:
    """One model's run; ``argv()`` passes it to the child process."""

    model: str
    device: str = "cpu"
    dtype: str = "fp32"
    attn: str = "manual"
    dropout: float = 0.0
    layers: Optional[int] = None
    batch: int = 2
    seq: Optional[int] = None
    threads: Optional[int] = None
    warmup: int = 2
    steps: int = 5
    solver: str = "heu"
    lynx_compiler: str = "inductor"
    zero_grad: int = 0
    """1: every step starts with ``.grad`` None (``optimizer.zero_grad()``'s default), the peak
    counting the ``.grad`` the step creates; 0: gradients accumulate across steps."""

    def argv(self) -> list[str]:
        out = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out += ["--" + f.name.replace("_", "-"), str(v)]
        return out


# ------------------------------------------------------------------------------------- models

def build(s: Settings) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    """(model on the device in the dtype, loss_of(callable model) -> scalar loss). Weights from
    ``torch.manual_seed(0)``, the batch from its own generator: the same in every process."""
    from lynx_compile.models import build_model, example_batch, get_config

    if s.model.split(":")[0] == "tt-llama3":
        return build_torchtitan(s)
    kind, _, preset = s.model.rpartition(":")
    shape = {"n_layers": s.layers, "seq_len": s.seq}
    shape = {k: v for k, v in shape.items() if v is not None}
    cfg = get_config(preset, **shape)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    idx = example_batch(cfg, s.batch, generator=gen).to(s.device)
    targets = example_batch(cfg, s.batch, generator=gen).to(s.device)
    dtype = DTYPES[s.dtype]
    if kind == "":
        model = build_model(cfg, device=s.device, dtype=dtype, dropout=s.dropout, attn_impl=s.attn)
        return model, lambda m: m(idx).loss
    dims = dict(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                n_kv_heads=max(1, cfg.n_heads // 4), dropout=s.dropout)
    if kind == "gqa":
        from foreign_models import PostLNGQAConfig, PostLNGQALM

        attn = "sdpa" if s.attn == "sdpa" else "explicit"
        with torch.device(s.device):
            model = PostLNGQALM(PostLNGQAConfig(d_model=cfg.hidden, attn=attn, **dims))
        return model.to(dtype), lambda m: m(idx, targets)[1]
    if kind == "hf-llama":
        from foreign_models import hf_llama

        with torch.device(s.device):
            model = hf_llama(hidden=cfg.hidden, attn="sdpa" if s.attn == "sdpa" else "eager", **dims)
        return model.to(dtype), lambda m: m(input_ids=idx, labels=targets).loss
    raise ValueError(f"unknown model {s.model!r}: a zoo preset, gqa:<preset>, hf-llama:<preset> or tt-llama3")


TT_FLAVORS = ("debugmodel",)
TT_SEQ = 256  # bench_budget.TT_SHAPE's sequence: the default when --seq is not given


class TorchtitanLM(torch.nn.Module):
    """torchtitan's model with torchtitan's loss in its forward: ``forward(tokens, labels)`` ->
    scalar loss, so that compiling this module compiles model and loss as one graph, as the
    other kinds (loss inside the model's forward) do."""

    def __init__(self, model: torch.nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(tokens), labels)


def build_torchtitan(s: Settings) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    """``tt-llama3`` / ``tt-llama3:debugmodel``: torchtitan's llama3 ``debugmodel``
    (``lynx_compile.tools.torchtitan_models.build``: SDPA attention, meta-device build,
    ``init_weights`` under ``torch.manual_seed(0)``), its first ``s.layers`` blocks (None: all 6),
    wrapped with torchtitan's ``CrossEntropyLoss`` (eager-built, summed / the number of tokens)
    in ``TorchtitanLM``; tokens and labels from ``torchtitan_models.batch(s.batch, s.seq or
    TT_SEQ)`` (seed 1). ``s.attn`` and ``s.dropout`` do not apply (SDPA, no dropout)."""
    import torchtitan_models as tt

    name, _, flavor = s.model.partition(":")
    if flavor not in ("", *TT_FLAVORS):
        raise ValueError(f"model {s.model!r}: torchtitan's {name} is built as {', '.join(TT_FLAVORS)} only")
    why = tt.available()
    if why is not None:
        raise RuntimeError(why)
    model = TorchtitanLM(tt.build(name, seed=0, layers=s.layers), tt.loss(None)).to(s.device)
    dtype = DTYPES[s.dtype]
    if dtype != torch.float32:  # floating tensors only: Module.to(dtype) drops RoPE's complex cache's imaginary part
        model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    tokens, labels = (t.to(s.device) for t in tt.batch(s.batch, s.seq or TT_SEQ, seed=1))
    return model, lambda m: m(tokens, labels)


# ----------------------------------------------------------------------------------- variants

def check_variant(variant: str) -> str:
    try:
        parse_variant(variant)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return variant


# -------------------------------------------------------------------------------- measurement

def eager_reference(s: Settings) -> tuple[float, list]:
    """Loss and gradients of one eager step from the same seeds (fp32 only)."""
    model, loss_of = build(s)
    torch.manual_seed(1234)
    loss = loss_of(model)
    loss.backward()
    out = loss.item(), grad_snapshot(model)
    del model
    return out


def run_variant(variant: str, s: Settings, ref_grads_path: Optional[str] = None) -> dict:
    """Measure ``variant`` in this process (``lynx_compile.tools.variants.run_variant``); one result row
    (see the module docstring). ``ref_grads_path``: the ``inductor`` variant writes its
    first-step gradients there (fp32); the other compiled variants compare with them when the
    file exists."""
    check_variant(variant)
    if s.device == "cpu":
        torch.set_num_threads(s.threads or 1)
    elif s.threads:
        torch.set_num_threads(s.threads)
    row: dict[str, Any] = {"model": s.model, "variant": variant, "result": "ok"}
    fp32 = s.dtype == "fp32"
    try:
        loss_ref, grads_ref = eager_reference(s) if fp32 else (None, None)
        model, loss_of = build(s)
    except Exception as exc:  # noqa: BLE001 - reported as the row's result
        return {**row, "result": describe_failure(exc)}
    measured, grads = variants.run_variant(variant, model, loss_of, device=s.device, warmup=s.warmup,
                                           steps=s.steps, solver=s.solver, compiler=s.lynx_compiler,
                                           ref_grads=grads_ref, zero_grad=bool(s.zero_grad))
    row.update(measured)
    save_plans(variant, s)
    if fp32 and grads is not None:
        row["loss_equals_eager"] = abs(row["loss"] - loss_ref) <= LOSS_RTOL * abs(loss_ref)
        row["grads_equal_eager"] = row["grad_rel_diff"] <= GRAD_RTOL
        if ref_grads_path and variant == "inductor":
            torch.save(grads, ref_grads_path)
        elif ref_grads_path and os.path.exists(ref_grads_path) and under_inductor(variant, s.lynx_compiler):
            row["grad_rel_diff_vs_inductor"] = grad_rel_diff(grads, torch.load(ref_grads_path))
    return row


PLANS_DIR_ENV = "LYNX_BENCH_PLANS_DIR"
"""When set, a folder where each lynx variant's process writes its plans as JSON
(``<model>_<variant>_<i>.json``, ``RecomputePlan.to_json``: what it saved and recomputed, with
bytes and seconds), so a run on a machine one cannot keep (a lent GPU) leaves what lynx decided
beside what it measured."""


def save_plans(variant: str, s: Settings) -> None:
    folder = os.environ.get(PLANS_DIR_ENV)
    options = variants.lynx_options(variant, solver=s.solver, compiler=s.lynx_compiler)
    if not folder or options is None:
        return
    import lynx_compile

    os.makedirs(folder, exist_ok=True)
    stem = "".join(c if c.isalnum() or c in "-." else "_" for c in f"{s.model}_{variant}")
    for i, plan in enumerate(lynx_compile.backend(**options).plans):
        with open(os.path.join(folder, f"{stem}_{i}.json"), "w") as f:
            f.write(plan.to_json())


def time_interleaved(names: Sequence[str], s: Settings, rounds: int) -> dict[str, list[float]]:
    """Step ms per round of every variant in ``names``, all prepared in this process (each on its
    own copy of the model) and timed in ``rounds`` rounds of one step each, the order rotated every
    round: the machine's drift (other processes, clocks) falls on all variants alike, and round i
    of one variant pairs with round i of another (``paired_ratio``). Variants that fail are left
    out."""
    import time

    if s.device == "cpu":
        torch.set_num_threads(s.threads or 1)
    # one compiled entry per model copy of the same forward: dynamo's per-code cache must hold all
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(names))
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit,
                                                            8 * len(names))
    steps: dict[str, Callable[[], None]] = {}
    for name in names:
        model, loss_of = build(s)
        try:
            fn = variants.prepare(name, model, solver=s.solver, compiler=s.lynx_compiler)

            def step(fn=fn, loss_of=loss_of, params=list(model.parameters())) -> None:
                if s.zero_grad:
                    for p in params:
                        p.grad = None
                loss_of(fn).backward()

            for _ in range(max(2, s.warmup)):
                step()
        except Exception as exc:  # noqa: BLE001 - reported by its own-process row already
            print(f"interleaved timing: {name} left out: {describe_failure(exc)}", file=sys.stderr)
            continue
        steps[name] = step
    times: dict[str, list[float]] = {n: [] for n in steps}
    order = list(steps)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            variants._sync(s.device)
            t0 = time.perf_counter()
            steps[name]()
            variants._sync(s.device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def take_interleaved(rows: Sequence[dict], timed: dict[str, list[float]]) -> None:
    """Rows of the variants ``time_interleaved`` timed take its rounds (``step_rounds``, for
    ``paired_ratio``) and their median as ``step_ms``; ``step_ms_own_process`` keeps the
    variant's own process's."""
    for r in rows:
        if r["variant"] in timed:
            r["step_rounds"] = timed[r["variant"]]
            r["step_ms_own_process"], r["step_ms"] = r["step_ms"], statistics.median(r["step_rounds"])


def paired_ratio(a: dict, b: dict) -> float:
    """Row ``a``'s step time over row ``b``'s: the median of per-round ratios where both were timed
    in the same interleaved rounds (``step_rounds``), else the ratio of their medians."""
    ra, rb = a.get("step_rounds"), b.get("step_rounds")
    if ra and rb and len(ra) == len(rb):
        return statistics.median(x / y for x, y in zip(ra, rb))
    return a["step_ms"] / b["step_ms"]


def run_interleaved_in_subprocess(names: Sequence[str], s: Settings, rounds: int, *, timeout_s: float) -> dict:
    """``time_interleaved`` in a fresh process (torch's usual compile caches)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--interleave-timing", ",".join(names),
           "--rounds", str(rounds), *s.argv()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"interleaved timing timed out after {timeout_s:g} s", file=sys.stderr)
        return {}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    print(f"interleaved timing failed: {proc.stderr.strip().splitlines()[-1:] }", file=sys.stderr)
    return {}


# ------------------------------------------------------------------------ one process per run

def run_in_subprocess(variant: str, s: Settings, *, timeout_s: float = 1800,
                      ref_grads_path: Optional[str] = None, shared_cache: bool = False) -> dict:
    """``run_variant`` in a fresh Python process. Inductor / Triton on-disk caches: a fresh
    directory (a cold compile), or with ``shared_cache`` torch's usual ones (kept across runs)."""
    env = dict(os.environ)
    cache = None
    if not shared_cache:
        cache = tempfile.mkdtemp(prefix="bench_step_cache_")
        env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    cmd = [sys.executable, os.path.abspath(__file__), "--one", variant, *s.argv()]
    if ref_grads_path:
        cmd += ["--ref-grads", ref_grads_path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"model": s.model, "variant": variant, "result": f"error: timed out after {timeout_s:g} s"}
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return {"model": s.model, "variant": variant,
            "result": f"error: process exited {proc.returncode}: {tail[-1] if tail else 'no output'}"}


# ------------------------------------------------------------------------------------ reporting

def finish_rows(rows: list[dict]) -> list[dict]:
    """Rows with every column, rounded, ``peak_vs_eager`` filled in, ``status`` for the table."""
    eager_peak = {r["model"]: r.get("peak_MiB") for r in rows if r["variant"] == "eager"}
    out = []
    for r in rows:
        r = dict(r)
        base = eager_peak.get(r["model"])
        if r.get("peak_MiB") is not None and base:
            r["peak_vs_eager"] = r["peak_MiB"] / base
        for k in ("step_ms", "step_ms_own_process", "peak_MiB", "predicted_peak_MiB", "first_step_s", "peak_vs_eager"):
            if isinstance(r.get(k), float):
                r[k] = float(f"{r[k]:.4g}")
        r["status"] = r["result"].split(":")[0]
        out.append({k: r.get(k) for k in COLUMNS + ["status"]})
    return out


def torch_points(rows: Sequence[dict], model: str) -> list[dict]:
    """torch.compile points (default and every budget) of ``model`` that ran."""
    return [r for r in rows if r["model"] == model and r["result"] == "ok"
            and (r["variant"] == "inductor" or r["variant"].startswith("inductor-b"))]


def fastest_at_or_below(points: Sequence[dict], peak_mib: float) -> dict | None:
    """The fastest of ``points`` (rows that ran) whose measured peak is at most ``peak_mib``."""
    return min((p for p in points if p["peak_MiB"] <= peak_mib), key=lambda p: p["step_ms"], default=None)


def summary(rows: Sequence[dict]) -> list[str]:
    """For each lynx budget point: the fastest torch.compile point with a peak no higher."""
    lines = []
    for r in rows:
        if not r["variant"].startswith("lynx-b"):
            continue
        head = f"{r['model']} {r['variant']}"
        if r["result"] != "ok":
            lines.append(f"{head}: {r['result']}")
            continue
        best = fastest_at_or_below(torch_points(rows, r["model"]), r["peak_MiB"])
        if best is None:
            lines.append(f"{head}: {r['step_ms']:.4g} ms at {r['peak_MiB']:.4g} MiB; no torch.compile point "
                         "at or below that peak")
            continue
        lines.append(f"{head}: {r['step_ms']:.4g} ms at {r['peak_MiB']:.4g} MiB; fastest torch.compile at or "
                     f"below: {best['variant']} {best['step_ms']:.4g} ms at {best['peak_MiB']:.4g} MiB; "
                     f"lynx / torch = {paired_ratio(r, best):.3g}")
    return lines


def matching_lynx_variants(rows: Sequence[dict], model: str) -> list[str]:
    """``--match-torch``: ``lynx-b<F>`` at each torch.compile budget setting's measured peak, F its
    fraction of the no-recompute (``inductor``) peak rounded up at the sixth digit: lynx at
    torch's memory (within a few bytes), not only at the round budgets near it. Rounded down at
    the third digit (until session 31) the budget fell up to 0.1% below torch's peak, and
    torch's own plan, one of lynx's candidates, did not fit it."""
    import math

    base = next((r["peak_MiB"] for r in rows if r["model"] == model and r["variant"] == "inductor"
                 and r["result"] == "ok"), None)
    if not base:
        return []
    out = []
    for t in torch_points(rows, model):
        if t["variant"].startswith("inductor-b"):
            f = math.ceil(round(t["peak_MiB"] / base * 1e6, 3)) / 1e6  # (round: 0.67779 * 1e6 is 677790.0000000001)
            if 0 < f < 1:
                out.append(f"lynx-b{f:g}")
    return list(dict.fromkeys(out))


def torch_settings_summary(rows: Sequence[dict]) -> list[str]:
    """For each of torch.compile's budget settings: the fastest lynx budget point at no more memory
    and its step time over torch's (issue R: at equal memory, lynx at least as fast at each of
    torch's settings). Ratios are paired per interleaved round where the rows have them."""
    lines = []
    for t in rows:
        if not t["variant"].startswith("inductor-b") or t["result"] != "ok":
            continue
        lynx = [r for r in rows if r["model"] == t["model"] and r["variant"].startswith("lynx-b") and r["result"] == "ok"]
        best = fastest_at_or_below(lynx, t["peak_MiB"])
        head = f"{t['model']} {t['variant']} ({t['step_ms']:.4g} ms at {t['peak_MiB']:.4g} MiB)"
        if best is None:
            lines.append(f"{head}: no lynx point at or below that peak")
            continue
        lines.append(f"{head}: fastest lynx at or below: {best['variant']} {best['step_ms']:.4g} ms at "
                     f"{best['peak_MiB']:.4g} MiB; lynx / torch = {paired_ratio(best, t):.3g}")
    return lines


def plot(rows: Sequence[dict], path: str, title: str) -> None:
    """Pareto plot per model (``lynx_compile.tools.variants.plot_pareto``)."""
    plot_pareto(rows, path, title)


def write_results(out: str, stem: str, rows: list[dict], settings: Sequence[Settings], argv: Sequence[str],
                  notes: Sequence[str]) -> str:
    """Writes ``<out>/<stem>.csv``, ``.md``, ``.png``; returns the markdown."""
    os.makedirs(out, exist_ok=True)
    device = settings[0].device
    table_rows = finish_rows(rows)
    with open(os.path.join(out, stem + ".csv"), "w") as f:
        f.write(csv_text([{k: r[k] for k in COLUMNS} for r in table_rows]))
    env = gpu_environment(device if device == "cuda" else "cpu")
    host = host_environment()
    machine = header_line(env) if device == "cuda" else (
        f"{env['date']}; CPU {host['cpu']} ({os.cpu_count()} cores); torch {env['torch']}, "
        f"triton {env['triton']}; python {env['python']}.")
    s = settings[0]
    lines = [f"# One training step per recompute variant ({device})", "", machine, "",
             "Command: `" + " ".join(["python benchmarks/bench_step.py", *argv]) + "`", "",
             f"{s.dtype}, batch {s.batch}, attention {s.attn}, dropout {s.dropout}, "
             f"layers {s.layers or 'preset'}, seq {s.seq or 'preset'}, threads {s.threads or ('1' if device == 'cpu' else 'default')}; "
             f"{s.warmup} warm-up steps (the first compiles: first_step_s), median of {s.steps} timed steps; "
             f"lynx solver {s.solver}, lynx compiler {s.lynx_compiler}. Step = forward + loss + backward, "
             + ("no optimizer, .grad set to None before each step (zero_grad()'s default)" if s.zero_grad
                else "no optimizer, gradients accumulated across steps")
             + "; each variant in its own process"
             + ("; step_ms: the median of all variants timed in one more process, one step each in "
                "rotated rounds (step_ms_own_process: the variant's own process)" if any(
                    r.get("step_ms_own_process") is not None for r in rows) else "")
             + ". peak = step memory: "
             + "`lynx_compile.memory.measure_step` over one step, "
             + (".grad None first, the .grad the step creates counted (" if s.zero_grad
                else ".grad allocated first, returned gradients counted (")
             + ("`max_memory_allocated` above the start)." if device == "cuda" else "CPU allocator events).")
             + f" grads_equal_eager: max relative difference <= {GRAD_RTOL:g} after the first step (fp32 only).",
             "", markdown_table(table_rows, MD_COLUMNS)]
    failed = [r for r in rows if r["result"] != "ok"]
    if failed:
        lines += ["", "Not ok:", ""] + [f"- {r['model']} {r['variant']}: {r['result']}" for r in failed]
    lines += ["", "lynx budget points against torch.compile at no more memory:", ""]
    lines += [f"- {ln}" for ln in summary(rows)] or ["- (no lynx budget point ran)"]
    lines += ["", "torch.compile's budget settings against the fastest lynx point at no more memory"
              + (" (ratios: median of per-round ratios, interleaved)" if any(r.get("step_rounds") for r in rows)
                 else "") + ":", ""]
    lines += [f"- {ln}" for ln in torch_settings_summary(rows)] or ["- (no torch.compile budget point ran)"]
    if notes:
        lines += ["", *(f"Note: {n}" for n in notes)]
    lines += ["", f"![Pareto plot]({stem}.png)"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(text)
    plot(rows, os.path.join(out, stem + ".png"), machine)
    return text


# ------------------------------------------------------------------------------------------ CLI

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="comma list of zoo presets, gqa:<preset>, hf-llama:<preset>, tt-llama3 (or "
                        "tt-llama3:debugmodel: torchtitan's llama3 debugmodel, --layers keeps its first blocks, "
                        "--seq default 256) (default: gpt-small on CPU, gpt-1.3b on CUDA, each also as gqa: "
                        "and hf-llama:; --quick: gpt-tiny only)")
    p.add_argument("--attn", default="manual", choices=["manual", "sdpa"])
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--layers", type=int, default=None, help="override the preset's layers")
    p.add_argument("--batch", type=int, default=None, help="default 2 (CUDA, --quick), 4 (CPU)")
    p.add_argument("--seq", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default 1 on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps incl. the compiling one (default 2, CUDA 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5 --quick, 10 CPU, 20 CUDA)")
    p.add_argument("--variants", type=lambda v: [check_variant(x.strip()) for x in v.split(",") if x.strip()],
                   default=None, help="comma list (default: all; --quick: fewer budgets)")
    p.add_argument("--solver", default="heu", help="lynx solver for lynx-b<B> (heu, highs, glpk, auto)")
    p.add_argument("--lynx-compiler", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--zero-grad", type=int, default=0, choices=[0, 1],
                   help="1: .grad set to None before every step (optimizer.zero_grad()'s default), the peak "
                        "counting the .grad each step creates; 0 (default): gradients accumulate across steps")
    p.add_argument("--quick", action="store_true",
                   help="CPU-sized: gpt-tiny with 4 layers, seq 64, 5 steps, fewer variants, shared compile cache")
    p.add_argument("--shared-cache", action="store_true",
                   help="use torch's usual Inductor/Triton on-disk caches, kept across variants and runs "
                        "(default: a cold one per variant, so first_step_s is a cold compile); on with --quick")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per variant process")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--match-torch", action="store_true",
                   help="after the variants, run lynx at each torch.compile budget setting's measured peak "
                        "(lynx-b<F>, F = that peak over inductor's, rounded down at the third digit; needs "
                        "inductor among the variants)")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="also time every variant of a model in one process, ROUNDS rounds of one step "
                        "each in rotated order; step_ms is then that median (step_ms_own_process: the "
                        "variant's own process). Peaks and gradients stay per process.")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--interleave-timing", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--ref-grads", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace, model: str) -> Settings:
    cuda = args.device == "cuda"
    return Settings(model=model, device=args.device, dtype=args.dtype or ("bf16" if cuda else "fp32"),
                    attn=args.attn, dropout=args.dropout,
                    layers=args.layers or (QUICK_SHAPE["layers"] if args.quick else None),
                    batch=args.batch or (2 if cuda or args.quick else 4),
                    seq=args.seq or (QUICK_SHAPE["seq"] if args.quick else None), threads=args.threads,
                    warmup=args.warmup or (3 if cuda else 2),
                    steps=args.steps or (20 if cuda else 5 if args.quick else 10),
                    solver=args.solver, lynx_compiler=args.lynx_compiler, zero_grad=args.zero_grad)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(run_variant(args.one, settings_from(args, args.model), args.ref_grads)))
        return 0
    if args.interleave_timing:
        print(json.dumps(time_interleaved(args.interleave_timing.split(","), settings_from(args, args.model),
                                          args.rounds)))
        return 0
    from foreign_models import hf_available
    from torchtitan_models import available as tt_available

    preset = "gpt-1.3b" if args.device == "cuda" else "gpt-small"
    default = QUICK_SHAPE["model"] if args.quick else f"{preset},gqa:{preset},hf-llama:{preset}"
    models = [m.strip() for m in (args.model or default).split(",") if m.strip()]
    shared = args.shared_cache or args.quick
    variants = args.variants or default_variants(args.quick)
    rows, notes, settings = [], [], []
    load = os.getloadavg()
    work = tempfile.mkdtemp(prefix="bench_step_")
    try:
        for model in models:
            if model.startswith("hf-llama:") and not hf_available():
                notes.append(f"{model} skipped: `transformers` is not installed (optional; "
                             "`pip install transformers` to include HF LlamaForCausalLM).")
                print(notes[-1], file=sys.stderr)
                continue
            if model.split(":")[0] == "tt-llama3" and tt_available() is not None:
                notes.append(f"{model} skipped: {tt_available()}.")
                print(notes[-1], file=sys.stderr)
                continue
            s = settings_from(args, model)
            if model.split(":")[0] == "tt-llama3":
                notes.append(f"{model}: torchtitan's llama3 debugmodel, {s.layers or 'all 6'} layers, seq "
                             f"{s.seq or TT_SEQ}, SDPA attention, no dropout (--attn / --dropout do not apply), "
                             "torchtitan's CrossEntropyLoss compiled with the model.")
            settings.append(s)
            ref = os.path.join(work, f"grads_{len(settings)}.pt")
            def run(v: str) -> None:
                print(f"{model} {v} ...", end=" ", file=sys.stderr, flush=True)
                row = run_in_subprocess(v, s, timeout_s=args.timeout, ref_grads_path=ref,
                                        shared_cache=shared)
                rows.append(row)
                print(row["result"] if row["result"] != "ok" else
                      f"{row['step_ms']:.4g} ms, {row['peak_MiB']:.4g} MiB", file=sys.stderr, flush=True)

            for v in variants:
                run(v)
            if args.match_torch:  # then lynx at each torch setting's measured peak
                for v in matching_lynx_variants(rows, model):
                    if v not in variants:
                        run(v)
            if args.interleave:
                ok = [r["variant"] for r in rows if r["model"] == model and r["result"] == "ok"]
                print(f"{model}: timing {len(ok)} variants in one process, {args.interleave} rounds ...",
                      file=sys.stderr, flush=True)
                timed = run_interleaved_in_subprocess(ok, s, args.interleave, timeout_s=args.timeout)
                take_interleaved([r for r in rows if r["model"] == model], timed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not rows:
        print("nothing ran", file=sys.stderr)
        return 1
    stem = f"step_{args.device}" + ("_quick" if args.quick else "")
    notes.append("Inductor/Triton on-disk caches: " + (
        "torch's usual ones, kept across variants and runs (first_step_s may reuse compiled kernels)."
        if shared else "a cold one per variant (first_step_s includes a cold compile)."))
    notes.append(f"load average (1 min) before / after the run: {load[0]:.2f} / {os.getloadavg()[0]:.2f} "
                 f"on {os.cpu_count()} CPUs (other processes disturb the step times).")
    print(write_results(args.out, stem, rows, settings, argv, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
