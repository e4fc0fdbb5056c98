"""Train a copy of a model under one lynx policy (or eager) and measure it: the helper of
``bench_policies.py`` and ``bench_remat.py`` (it was ``lynx_compile.demo.run_policy`` until the
demo moved to ``lynx_compile.tools.variants``, 08d0d4e).

Every run trains the same model (same seed, same batches, same dropout seeds) for a few AdamW
steps; the step time is the median of the steps after the first (compile excluded); the peak is
one extra forward + backward measured by ``lynx_compile.memory.measure_step``.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

import lynx_compile
from lynx_compile.memory import measure_step


@dataclass(frozen=True)
class PolicyRun:
    policy: str
    losses: tuple[float, ...]
    step_s: float
    peak_bytes: int
    predicted_peak_bytes: Optional[int]
    saved_bytes: Optional[int]
    recompute_s: Optional[float]


def _train(model: torch.nn.Module, batches: Sequence[torch.Tensor], seed: int) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for step, x in enumerate(batches):
        torch.manual_seed(seed + step)  # the same dropout masks under every policy
        start = time.perf_counter()
        loss = model(x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times


def run_policy(policy: Optional[str], base: torch.nn.Module, batches: Sequence[torch.Tensor], *,
               seed: int = 1234, options: Optional[dict] = None) -> PolicyRun:
    """Train a copy of ``base`` under lynx's ``policy`` (eager when None) and measure it."""
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
