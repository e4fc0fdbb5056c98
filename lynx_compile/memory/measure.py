"""Measure a training step: peak activation memory and wall time.

On CUDA the peak comes from the caching allocator (``max_memory_allocated`` above the bytes
allocated before the step). On CPU it comes from allocator-level events: the profiler's memory
events (every allocation and free the CPU allocator performs, in order), whose running sum
from the start of the step gives live bytes; the peak is its maximum. Either way the number
is what the step allocates beyond what was already live (parameters, gradients, optimizer
state, inputs), which is what ``lynx_compile.memory.simulate`` predicts.

Step time is measured in separate runs without the profiler (it slows CPU execution).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class StepMeasurement:
    """What one measured step used."""

    peak_bytes: int
    """Peak bytes allocated during the step above the bytes live when it started."""
    step_s: float
    """Median wall time of the step (seconds)."""
    step_times_s: tuple[float, ...]
    device: str
    method: str
    """``cuda-allocator`` or ``cpu-profiler-memory-events``."""
    predicted_peak_bytes: int | None = None
    """The plan's predicted peak (when a plan was passed), for side-by-side reporting."""
    predicted_saved_bytes: int | None = None
    """The plan's predicted saved-activation bytes (when a plan was passed)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of live CPU-allocator bytes while ``fn`` runs, relative to its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        fn()
    # Only CPU-allocator events: on a CUDA build the same trace also holds device allocations.
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and int(e.device_type()) == 0]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def cuda_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def measure_step(step_fn: Callable[[], Any], *, device: str | torch.device = "cpu",
                 repeats: int = 3, warmup: int = 1, plan: Any = None) -> StepMeasurement:
    """Run ``step_fn`` (a forward + backward) ``warmup`` times, then time it ``repeats`` times
    and measure its peak memory once more.

    Call it with gradients already allocated (``zero_grad(set_to_none=False)``), so that the
    peak reflects activations and transient gradients, not first-step ``.grad`` creation."""
    device = torch.device(device)
    for _ in range(warmup):
        step_fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step_fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak, method = cuda_peak_bytes(step_fn, device), "cuda-allocator"
    else:
        peak, method = cpu_peak_bytes(step_fn), "cpu-profiler-memory-events"
    return StepMeasurement(peak_bytes=peak, step_s=statistics.median(times),
                           step_times_s=tuple(times), device=str(device), method=method,
                           predicted_peak_bytes=plan.peak_bytes if plan is not None else None,
                           predicted_saved_bytes=plan.saved_bytes if plan is not None else None)
