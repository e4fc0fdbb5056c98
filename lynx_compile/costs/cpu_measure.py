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


def best_time(fn: Callable[[], Any], budget_s: float, max_reps: int = 50, min_reps: int = 2) -> float:
    """Fastest of repeated ``fn()`` calls within ``budget_s`` (at least ``min_reps`` timed runs:
    on a loaded machine a few runs may all be preempted)."""
    fn()  # warm-up: first-call allocation, library init
    best, reps, deadline = float("inf"), 0, time.perf_counter() + budget_s
    while reps < min_reps or (time.perf_counter() < deadline and reps < max_reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return max(best, 1e-9)


def cache_bytes() -> int:
    """One core's L2 cache (Linux sysfs), else 256 KiB."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index2/size") as f:
            text = f.read().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        return int(text.rstrip("KM")) * scale
    except (OSError, ValueError):
        return 256 << 10


def measure(budget: float) -> dict[str, Any]:
    """fp32 mm FLOP/s at sizes 32 to 512 (the best is the peak), bf16/fp16 mm FLOP/s (256), copy
    and add bandwidth over 64 MB buffers, copy bandwidth within one core's L2 cache, and the
    median time of a 1-element add (dispatch overhead)."""
    fp32, rates = 0.0, []
    for n in (32, 64, 128, 256, 512):
        a, b = torch.randn(n, n), torch.randn(n, n)
        rate = 2 * n**3 / best_time(lambda: torch.mm(a, b), 0.4 * budget / 5)
        rates.append((2 * n**3, rate))
        fp32 = max(fp32, rate)
    low: dict[str, float] = {}
    for dt in (torch.bfloat16, torch.float16):
        a, b = torch.randn(256, 256, dtype=dt), torch.randn(256, 256, dtype=dt)
        low[str(dt).removeprefix("torch.")] = 2 * 256**3 / best_time(lambda: torch.mm(a, b), 0.1 * budget)
    n = 16 << 20  # 16M float32 = 64 MB per buffer, past typical last-level caches
    src, dst, other = torch.randn(n), torch.empty(n), torch.randn(n)
    copy_bw = 2 * 4 * n / best_time(lambda: dst.copy_(src), 0.15 * budget)
    add_bw = 3 * 4 * n / best_time(lambda: torch.add(src, other, out=dst), 0.15 * budget)
    del src, dst, other
    l2 = cache_bytes()
    k = l2 // 4 // 4  # two buffers of a quarter of the cache each (fp32 elements)
    small_src, small_dst = torch.randn(k), torch.empty(k)
    cache_bw = 2 * 4 * k / best_time(lambda: small_dst.copy_(small_src), 0.05 * budget, max_reps=2000,
                                   min_reps=200)  # ~10 us each
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
        "matmul_rates": rates,
        "cache_bytes": l2,
        "cache_bytes_per_s": cache_bw,
    }


if __name__ == "__main__":
    torch.set_num_threads(int(sys.argv[2]))
    print(json.dumps(measure(float(sys.argv[1]))))
