"""The peak of one training step as a tool that measures every step reads it, lynx's recorded
step included (``benchmarks/bench_every_step.py``, the torchtitan launcher's ``--out``).

On CPU the peak is read from a memory-profiling profiler's allocator events
(``memory.measure.cpu_peak_bytes``). The step lynx records (``recorder.RECORDED_STEP``, a model
compiled in pieces with choices to plan together) runs under lynx's own profiler, and lynx records nothing while another one
runs (it would record the next step, unmeasured then): that step's peak is the one lynx's
recording measured, read as the other steps are (``StepRecorder.recorded_peak_bytes``). On CUDA
every step is measured by the caching allocator (``max_memory_allocated``), lynx's recorded one
too.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def step_peak_bytes(fn: Callable[[], Any], device: torch.device, recorder: Any = None) -> int | None:
    """Run ``fn`` (one step's forward and backward); the highest bytes allocated while it runs,
    above what was allocated as it started. ``recorder``: the lynx backend's ``step_recorder``
    (None for another backend). None where the step is the one lynx records on CPU
    (``StepRecorder.records_next_step``) and lynx recorded nothing (a step plan from the plan
    cache): it ran unmeasured."""
    if device.type == "cuda":
        from lynx_compile.memory.measure import cuda_peak_bytes

        return cuda_peak_bytes(fn, device)
    if recorder is not None and recorder.records_next_step():
        before = recorder.recorded_peak_bytes
        fn()
        return recorder.recorded_peak_bytes if before is None else None
    from lynx_compile.memory.measure import cpu_peak_bytes

    return cpu_peak_bytes(fn)
