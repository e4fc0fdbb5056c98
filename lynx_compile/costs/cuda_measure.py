"""The measurements behind a CUDA device's measured profile, run in a child process (issue R,
item 2: on a GPU as on the CPU, the profile is measured, the datasheet only a fallback).

Like ``cpu_measure``, this file's source runs in a fresh interpreter
(:func:`lynx_compile.costs.hardware.calibrate_cuda_profile`) and prints one JSON line, so that
nothing it allocates is the training process's: its buffers (~0.9 GB at most, freed when it
exits) live in the child's own CUDA context, before the first step of the process that asked.
It imports only torch and the standard library.

    python -c "$(cat cuda_measure.py)" <seconds_budget> <device_index>
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable

import torch


def best_time(fn: Callable[[], Any], budget_s: float, max_reps: int = 50) -> float:
    """Fastest of repeated ``fn()`` calls on the GPU timeline (CUDA events), within ``budget_s``
    of host time (at least 2 timed runs)."""
    import time

    fn()
    torch.cuda.synchronize()
    best, reps, deadline = float("inf"), 0, time.perf_counter() + budget_s
    while reps < 2 or (time.perf_counter() < deadline and reps < max_reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
        reps += 1
    return max(best, 1e-9)


def measure(budget: float, index: int) -> dict[str, Any]:
    """bf16 mm FLOP/s at sizes 256 to 8192 (the best is the peak), fp32 and fp16 mm FLOP/s
    (4096), copy and add bandwidth over 256 MB buffers, copy bandwidth within the L2 cache, and
    the GPU time of one tiny kernel among 200 queued back to back (the launch gap)."""
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    rates, bf16 = [], 0.0
    for n in (256, 512, 1024, 2048, 4096, 8192):
        a, b = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        rate = 2 * n**3 / best_time(lambda: torch.mm(a, b), 0.4 * budget / 6)
        rates.append((2 * n**3, rate))
        bf16 = max(bf16, rate)
        del a, b
    peak = {"bfloat16": bf16}
    for dt in (torch.float32, torch.float16):
        n = 4096
        a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
        peak[str(dt).removeprefix("torch.")] = 2 * n**3 / best_time(lambda: torch.mm(a, b), 0.1 * budget)
        del a, b
    n = 64 << 20  # 64M float32 = 256 MB per buffer, past any GPU's L2
    src, dst, other = torch.randn(n, device=dev), torch.empty(n, device=dev), torch.randn(n, device=dev)
    copy_bw = 2 * 4 * n / best_time(lambda: dst.copy_(src), 0.15 * budget)
    add_bw = 3 * 4 * n / best_time(lambda: torch.add(src, other, out=dst), 0.15 * budget)
    del src, dst, other
    l2 = int(getattr(props, "L2_cache_size", 0) or (40 << 20))
    k = l2 // 4 // 4  # two buffers of a quarter of the L2 each
    small_src, small_dst = torch.randn(k, device=dev), torch.empty(k, device=dev)
    cache_bw = 2 * 4 * k / best_time(lambda: small_dst.copy_(small_src), 0.05 * budget, max_reps=500)
    x = torch.ones(1, device=dev)

    def tiny_kernels():
        for _ in range(200):
            x.add_(1.0)

    launch = best_time(tiny_kernels, 0.1 * budget) / 200
    return {
        "device_name": torch.cuda.get_device_name(dev),
        "memory_capacity_bytes": int(props.total_memory),
        "peak_flops": peak,
        "copy_bytes_per_s": copy_bw,
        "add_bytes_per_s": add_bw,
        "launch_overhead_s": launch,
        "matmul_rates": rates,
        "cache_bytes": l2,
        "cache_bytes_per_s": cache_bw,
    }


if __name__ == "__main__":
    print(json.dumps(measure(float(sys.argv[1]), int(sys.argv[2]))))
