"""The peak of one training step as a tool that measures every step reads it, lynx's recorded
step included (``benchmarks/bench_every_step.py``, the torchtitan launcher's ``--out``).

On CPU the peak is read from a memory-profiling profiler's allocator events
(``memory.measure.cpu_peak_bytes``). The step lynx records (``recorder.RECORDED_STEP``, a model
compiled in pieces with choices to plan together) runs under lynx's own profiler, and lynx records nothing while another one
runs (it would record the next step, unmeasured then): that step's peak is the one lynx's
recording measured, read as the other steps are (``StepRecorder.recorded_peak_bytes``). On CUDA
the other steps are measured by the caching allocator (``max_memory_allocated``), and the recorded
one by lynx's recording, from the same allocator's statistics (which it resets at each mark).
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def step_peak_bytes(fn: Callable[[], Any], device: torch.device, recorder: Any = None) -> int | None:
    """Run ``fn`` (one step's forward and backward); the highest bytes allocated while it runs,
    above what was allocated as it started. ``recorder``: the lynx backend's ``step_recorder``
    (None for another backend). The step lynx records (``StepRecorder.records_next_step``) is
    read from its recording on CUDA too: the recording resets the caching allocator's peak at
    each mark, so ``max_memory_allocated`` after the step would give the last segment's. None
    where lynx recorded nothing then (a step plan from the plan cache): it ran unmeasured."""
    if recorder is not None and recorder.records_next_step():
        before = recorder.recorded_peak_bytes
        fn()
        return recorder.recorded_peak_bytes if before is None else None
    from lynx_compile.memory.measure import cpu_peak_bytes, cuda_peak_bytes

    return cuda_peak_bytes(fn, device) if device.type == "cuda" else cpu_peak_bytes(fn)
