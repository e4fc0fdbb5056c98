"""``lynx demo``: train a small GPT on CPU under every policy and compare with eager.

For each policy the same model (same seed, same batches, same dropout seeds) trains for a few
AdamW steps; the table shows the median step time (compile excluded), the measured and
predicted peak activation memory, and whether every step's loss equals eager's.
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

import lynx_compile
from lynx_compile.memory import measure_step
from lynx_compile.models import build_model, example_batch
from lynx_compile.report import human_bytes

DEMO_POLICIES = ("none", "selective", "full", "torch")


@dataclass(frozen=True)
class PolicyRun:
    policy: str
    losses: tuple[float, ...]
    step_s: float
    peak_bytes: int
    predicted_peak_bytes: int | None
    saved_bytes: int | None
    recompute_s: float | None


def _train(model: torch.nn.Module, batches: Sequence[torch.Tensor], seed: int) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for step, x in enumerate(batches):
        torch.manual_seed(seed + step)  # same dropout masks for every policy
        start = time.perf_counter()
        loss = model(x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times


def run_policy(policy: str | None, base: torch.nn.Module, batches, *, seed: int = 1234,
               options: dict | None = None) -> PolicyRun:
    """Train a copy of ``base`` (eager when ``policy`` is None) and measure it."""
    torch.compiler.reset()
    model = copy.deepcopy(base)
    opts = {"policy": policy, **(options or {})} if policy else None
    runner = torch.compile(model, backend="lynx", options=opts) if policy else model
    losses, times = _train(runner, batches, seed)
    mem = measure_step(lambda: runner(batches[0]).loss.backward(), repeats=1, warmup=0,
                       params=list(model.parameters()))
    plan = lynx_compile.backend(**opts).plans[-1] if policy else None
    return PolicyRun(policy=policy or "eager", losses=tuple(losses),
                     step_s=statistics.median(times[1:] or times), peak_bytes=mem.peak_bytes,
                     predicted_peak_bytes=plan.peak_bytes if plan else None,
                     saved_bytes=plan.saved_bytes if plan else None,
                     recompute_s=plan.recompute_s if plan else None)


def run_demo(preset: str = "gpt-small", *, steps: int = 4, batch_size: int = 4,
             policies: Sequence[str] = DEMO_POLICIES, options: dict | None = None,
             progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)):
    """Rows of the demo table: eager first, then one per policy."""
    torch.manual_seed(0)
    base = build_model(preset)
    g = torch.Generator().manual_seed(0)
    batches = [example_batch(base, batch_size, generator=g) for _ in range(steps)]
    runs = []
    for i, policy in enumerate([None, *policies]):
        start = time.perf_counter()
        extra = dict(options or {})
        if policy == "torch":
            extra.setdefault("memory_budget", 0.5)
        runs.append(run_policy(policy, base, batches, options=extra if policy else None))
        progress(f"[{i + 1}/{len(policies) + 1}] {policy or 'eager'}: {time.perf_counter() - start:.1f} s")
    eager = runs[0]
    rows = []
    for run in runs:
        same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(run.losses, eager.losses))
        rows.append({
            "policy": run.policy, "step_ms": round(run.step_s * 1e3, 2),
            "peak_measured": human_bytes(run.peak_bytes),
            "peak_predicted": human_bytes(run.predicted_peak_bytes),
            "saved_predicted": human_bytes(run.saved_bytes),
            "final_loss": round(run.losses[-1], 6), "loss_equals_eager": "yes" if same else "NO",
        })
    return rows
