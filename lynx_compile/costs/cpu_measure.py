"""The measurements behind the ``"cpu"`` hardware profile, run in a child process.

Measuring memory bandwidth needs buffers larger than the last-level cache (three of 64 MB).
Run in the user's process during the first compile, they would be that step's peak on a CPU
device; so :func:`lynx_compile.costs.hardware.calibrate_cpu_profile` runs this file's source in a
fresh interpreter (``python -c``) and reads one JSON line back. It imports only torch and the
standard library, so the child starts in the time ``import torch`` takes.

    python -c "$(cat cpu_measure.py)" <seconds_budget> <torch_threads>
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable

import torch


def best_time(fn: Callable[[], Any], budget_s: float, max_reps: int = 50) -> float:
    """Fastest of repeated ``fn()`` calls within ``budget_s`` (at least 2 timed runs)."""
    fn()  # warm-up: first-call allocation, library init
    best, reps, deadline = float("inf"), 0, time.perf_counter() + budget_s
    while reps < 2 or (time.perf_counter() < deadline and reps < max_reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return max(best, 1e-9)


def measure(budget: float) -> dict[str, Any]:
    """fp32 mm FLOP/s (best of sizes 128, 256, 512), bf16/fp16 mm FLOP/s (256), copy and add
    bandwidth over 64 MB buffers, and the median time of a 1-element add (dispatch overhead)."""
    fp32 = 0.0
    for n in (128, 256, 512):
        a, b = torch.randn(n, n), torch.randn(n, n)
        fp32 = max(fp32, 2 * n**3 / best_time(lambda: torch.mm(a, b), 0.4 * budget / 3))
    low: dict[str, float] = {}
    for dt in (torch.bfloat16, torch.float16):
        a, b = torch.randn(256, 256, dtype=dt), torch.randn(256, 256, dtype=dt)
        low[str(dt).removeprefix("torch.")] = 2 * 256**3 / best_time(lambda: torch.mm(a, b), 0.1 * budget)
    n = 16 << 20  # 16M float32 = 64 MB per buffer, past typical last-level caches
    src, dst, other = torch.randn(n), torch.empty(n), torch.randn(n)
    copy_bw = 2 * 4 * n / best_time(lambda: dst.copy_(src), 0.15 * budget)
    add_bw = 3 * 4 * n / best_time(lambda: torch.add(src, other, out=dst), 0.15 * budget)
    x = torch.ones(1)
    per_op = []
    deadline = time.perf_counter() + 0.1 * budget
    while time.perf_counter() < deadline or len(per_op) < 3:
        t0 = time.perf_counter()
        for _ in range(100):
            torch.add(x, x)
        per_op.append((time.perf_counter() - t0) / 100)
    return {
        "peak_flops": {"float32": fp32, **low},
        "copy_bytes_per_s": copy_bw,
        "add_bytes_per_s": add_bw,
        "launch_overhead_s": statistics.median(per_op),
    }


if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[2]))
    print(json.dumps(measure(float(sys.argv[1]))))
