"""What one rank of ``lynx train`` (``tools/train.py``) measured, and what rank 0 prints of it:
per-step loss, time and peak memory, the plans lynx made, the collectives on an emulated link, the
recompute / collective overlap read from a profiler trace."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class TrainResult:
    """What one rank measured."""

    rank: int
    world_size: int
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_bytes: list[int | None] = field(default_factory=list)
    peak_method: str = ""
    predicted_peak_bytes: int | None = None
    exposed_s: float | None = None
    plans: list[dict] = field(default_factory=list)
    link: str = ""
    overlap: dict | None = None
    reference_losses: list[float] | None = None
    comm_bytes_per_step: float | None = None
    """Emulated link only: payload bytes and modeled seconds of this rank's collectives per
    steady step (steps after the first, before any trace)."""
    comm_modeled_s_per_step: float | None = None
    comm_ops_per_step: float | None = None
    timed_steps: list[int] = field(default_factory=list)
    """Steps whose times enter the median: after the compile step, before the traced ones."""


def peak_meter(device: torch.device):
    """(reset, read) for per-step peak bytes above the step's start; CPU has no allocator
    statistics, so there the column is the plan's prediction (labelled)."""
    if device.type == "cuda":
        def reset():
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            return torch.cuda.memory_allocated(device)

        def read(start):
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - start
        return reset, read, "cuda-allocator"
    return (lambda: 0), (lambda start: None), "predicted"


def step_line(result: TrainResult, i: int, *, compiled: bool) -> str:
    """Rank 0's line for step ``i`` (the last one recorded): loss, time, peak (the plan's
    prediction where the device has no allocator statistics)."""
    peak = result.peak_bytes[-1]
    mem = f"{peak / 2**20:.2f} MiB" if peak is not None else (
        f"{result.predicted_peak_bytes / 2**20:.2f} MiB (predicted)"
        if result.predicted_peak_bytes is not None else "-")
    return (f"step {i:3d}  loss {result.losses[-1]:.6f}  time {result.step_s[-1] * 1e3:9.2f} ms"
            f"{' (compile)' if i == 0 and compiled else ''}  peak {mem}")


def record_plans(result: TrainResult, backend) -> None:
    plans = backend.plans
    result.plans = [{"policy": p.policy, "peak_bytes": p.peak_bytes,
                     "reference_peak_bytes": p.reference_peak_bytes, "exposed_s": p.exposed_s,
                     "recompute_s": p.recompute_s, "windows": p.decisions.counts()["window"],
                     "offloaded": p.decisions.counts()["offload"]}
                    for p in plans]
    if plans:
        result.predicted_peak_bytes = max(p.peak_bytes for p in plans)
        result.exposed_s = sum(p.exposed_s for p in plans)
    links = {r.stats.get("link") for r in backend.records if r.stats.get("link")}
    result.link = ",".join(sorted(links))


def comm_stats(result: TrainResult, emulated, world: int, steps: int) -> None:
    if steps < 1:
        return
    log = emulated.collective_log()
    result.comm_bytes_per_step = sum(r.nbytes for r in log) / steps
    result.comm_ops_per_step = len(log) / steps
    result.comm_modeled_s_per_step = _modeled_seconds(log, emulated.emulated_link_of(), world) / steps


def _modeled_seconds(log, link, world: int) -> float:
    """Sum of each logged collective's alpha-beta time on ``link`` (no queueing)."""
    from lynx_compile.costs.comm import collective_time
    from lynx_compile.graph.collectives import COLLECTIVE_KINDS

    return sum(collective_time(r.kind, r.nbytes, world, link) for r in log if r.kind in COLLECTIVE_KINDS)


def emulated_log_module():
    from lynx_compile.distributed import emulated_link

    return emulated_link if emulated_link.emulated_link_of() is not None else None


def start_trace(args: argparse.Namespace):
    """Start the profiler and stamp the clock-sync range (maps perf_counter onto trace time)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from lynx_compile.distributed.overlap import CLOCK_SYNC

    os.makedirs(args.trace, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    prof.__enter__()
    emulated = emulated_log_module()
    if emulated is not None:
        emulated.clear_collective_log()
    prof._lynx_sync = time.perf_counter()  # type: ignore[attr-defined]
    with record_function(CLOCK_SYNC):
        pass
    return prof


def finish_trace(prof, args: argparse.Namespace, rank: int) -> dict:
    from lynx_compile.distributed.overlap import overlap_report

    prof.__exit__(None, None, None)
    path = os.path.join(args.trace, f"trace_rank{rank}.json")
    prof.export_chrome_trace(path)
    emulated = emulated_log_module()
    log = list(emulated.collective_log()) if emulated is not None else None
    report = overlap_report(path, log, prof._lynx_sync)
    return {"trace": path, "share": report.share, "recompute_s": report.recompute_s,
            "overlapped_s": report.overlapped_s, "window_recompute_s": report.window_recompute_s,
            "collectives": report.collectives, "source": report.source}


def summary(result: TrainResult, args: argparse.Namespace, say: Callable[[str], None]) -> None:
    steady = [result.step_s[i] for i in result.timed_steps]
    say(f"median step time (steps {result.timed_steps[0]}..{result.timed_steps[-1]}): "
        f"{statistics.median(steady) * 1e3:.2f} ms"
        f"  [{result.world_size} rank(s), {'TP ' + str(result.world_size) if result.world_size > 1 else 'single process'}"
        f"{', sequence parallel' if args.sp else ''}, policy {args.policy}]")
    if args.emulate_link:
        say(f"link: EMULATED ({args.emulate_link}): collective completion delayed to the alpha-beta time")
        if result.comm_modeled_s_per_step is not None:
            say(f"collectives per step (rank 0): {result.comm_bytes_per_step / 2**20:.2f} MiB, "
                f"{result.comm_modeled_s_per_step * 1e3:.2f} ms modeled on the emulated link")
    if result.link:
        say(f"collectives priced on: {result.link}")
    for i, p in enumerate(result.plans):
        say(f"plan {i}: predicted peak {p['peak_bytes'] / 2**20:.2f} MiB "
            f"({p['peak_bytes'] / max(1, p['reference_peak_bytes']):.2f} of no-recompute), recompute "
            f"{p['recompute_s'] * 1e3:.2f} ms, exposed {p['exposed_s'] * 1e3:.2f} ms, "
            f"{p['windows']} units in windows"
            + (f", {p['offloaded']} offloaded to host" if args.offload else ""))
    if result.overlap:
        o = result.overlap
        say(f"overlap: {o['share'] * 100:.1f}% of {o['recompute_s'] * 1e3:.2f} ms recompute ran while a "
            f"collective was in flight ({o['source']}); trace: {o['trace']}")
    if result.reference_losses is not None:
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result.losses, result.reference_losses))
        say("check: step  lynx/TP loss     single-process loss")
        for i, (a, b) in enumerate(zip(result.losses, result.reference_losses)):
            say(f"       {i:4d}  {a:.8f}     {b:.8f}")
        say(f"check: max relative loss difference {worst:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.__dict__, f, indent=2)
