"""``lynx train``: tensor-parallel training of a zoo model compiled by lynx, one process per rank.

    torchrun --nproc-per-node 2 -m lynx_compile.train --model gpt-small --tp 2 \\
        --policy lynx --memory-budget 0.4 --steps 10

Same code path on CPU (gloo) and GPU (NCCL, one device per rank). Every rank builds the full
model from the same seed, keeps its tensor-parallel shard (``--tp-impl megatron``: lynx's
column/row-parallel layers; ``dtensor``: ``torch.distributed.tensor.parallel``), compiles it
with the lynx backend and trains on the same batches. Rank 0 prints loss, step time and peak
memory per step, then the plan. ``--check`` also trains the unsharded model in this process on
the same batches and prints both losses. ``--emulate-link pcie4`` (or ``alpha_s,bytes_per_s``)
delays every collective's completion to that link's alpha-beta time: for CPU benchmarks, and
labelled as emulation in the output. ``--trace DIR`` writes a per-rank Chrome trace and the
share of recompute time that ran while a collective was in flight.

A rank that fails names the ranks that stopped (``lynx_compile.distributed.failures``); ranks
that planned differently stop together (``lynx_compile.distributed.agreement``).

What a rank builds before its first step is in ``tools/train_setup.py``; what it measures and
rank 0 prints, in ``tools/train_result.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

import torch

from lynx_compile.budget import DEVICE_BUDGET_FORMS, device_budget_argument
from lynx_compile.config import BUDGET_FORMS, budget_argument
from lynx_compile.tools.train_result import TrainResult, comm_stats, emulated_log_module, finish_trace, peak_meter, \
    record_plans, start_trace, step_line, summary
from lynx_compile.tools.train_setup import backend_options, batches_from_args, init_distributed, local_device, \
    model_from_args, parallelize


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-small", help="zoo preset (gpt-*/llama-*)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: world size)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (Megatron) with --tp-impl megatron")
    p.add_argument("--tp-impl", default="megatron", choices=["megatron", "dtensor"],
                   help="tensor parallelism: lynx's Megatron-style layers, or torch's DTensor parallelize_module")
    p.add_argument("--policy", default="lynx", choices=["lynx", "none", "full", "selective", "torch", "eager"],
                   help="'eager' trains without torch.compile (the reference)")
    p.add_argument("--memory-budget", type=budget_argument, default=None, metavar="BUDGET",
                   help=f"activation memory budget: {BUDGET_FORMS} (see LynxConfig.memory_budget)")
    p.add_argument("--device-budget", type=device_budget_argument, default=None, metavar="SIZE",
                   help=f"everything on the device during the step: {DEVICE_BUDGET_FORMS} (see "
                        "LynxConfig.device_budget; AdamW's state, created by the first step, is not counted)")
    p.add_argument("--solver", default="auto", choices=["auto", "glpk", "highs", "heu"],
                   help="policy lynx: MILP solver (auto: HiGHS, else GLPK) or the heuristic (heu)")
    p.add_argument("--compiler", default=None, choices=["inductor", "eager"],
                   help="what compiles the step around lynx's partition (default inductor; eager "
                        "when --trace, --side-stream or pipeline recompute-in-wait need it)")
    p.add_argument("--time-limit", type=float, default=60.0, help="MILP time limit, seconds (best plan found is used)")
    p.add_argument("--no-windows", action="store_true",
                   help="policy lynx: ignore communication windows (recompute on demand only)")
    p.add_argument("--link", default="auto", help="link that prices collectives (LynxConfig.link)")
    p.add_argument("--hardware", default="auto", help="hardware profile for costs (auto: this device; e.g. h100-sxm)")
    p.add_argument("--cost-source", default="analytic", choices=["analytic", "measured"],
                   help="per-node costs for planning (measured: run on this device; rank 0's are used)")
    p.add_argument("--emulate-link", default=None,
                   help="CPU: delay collectives to this link's time (name in LINKS or 'alpha_s,bytes_per_s')")
    p.add_argument("--fuse-kernels", action="store_true", help="fused Triton recompute kernels (LynxConfig.fuse_kernels)")
    p.add_argument("--side-stream", action="store_true", help="recompute on a secondary CUDA stream (LynxConfig.side_stream)")
    p.add_argument("--offload", action="store_true",
                   help="policy lynx may also offload saved activations to host memory (LynxConfig.offload); "
                   "with --pp also --no-recompute-in-wait")
    p.add_argument("--steps", type=int, default=10, help="training steps (the first compiles)")
    p.add_argument("--batch-size", type=int, default=4, help="global batch size (sequences per step)")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--dropout", type=float, default=None, help="override the preset's dropout")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=1234, help="seed for the weights and the batches")
    p.add_argument("--check", action="store_true", help="also train unsharded in one process; print both losses")
    p.add_argument("--trace", default=None, metavar="DIR", help="per-rank Chrome trace + overlap figure")
    p.add_argument("--trace-steps", type=int, default=2,
                   help="profile the last N steps (the step-time median uses the untraced ones)")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group timeout, seconds")
    p.add_argument("--json", default=None, metavar="PATH", help="rank 0 writes the results here")
    from lynx_compile.tools.train_pp import add_pipeline_arguments

    add_pipeline_arguments(p)


def train(args: argparse.Namespace, *, on_step: Callable[[int], None] | None = None,
          say: Callable[[str], None] = print) -> TrainResult:
    """Run ``args.steps`` training steps on this rank (torch.distributed already initialized
    for more than one rank). ``on_step(i)`` runs before step i (tests inject failures)."""
    from lynx_compile.distributed.failures import Heartbeat

    rank, world = init_distributed(args)
    if args.pp > 1:
        if getattr(args, "device_budget", None) is not None:
            raise SystemExit("lynx train: --device-budget is not supported with --pp (each stage's budget "
                             "comes from the pipeline plan); use --memory-budget")
        return _train_pipeline(args, rank, world, say)
    if args.tp is not None and args.tp != world:
        raise SystemExit(f"lynx train: --tp {args.tp} but {world} processes; this launcher runs "
                         f"tensor parallelism only, so --tp must equal --nproc-per-node")
    device = local_device()
    torch.set_num_threads(max(1, torch.get_num_threads() if world == 1 else
                              (os.cpu_count() or world) // world))
    model = model_from_args(args, device)
    batches = batches_from_args(args, model.config, device)
    model, group = parallelize(model, args, world)
    step_model, backend = _compile(model, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    reset, read, method = peak_meter(device)
    result = TrainResult(rank=rank, world_size=world, peak_method=method)
    heartbeat = None
    if world > 1:
        from lynx_compile import _compat

        heartbeat = Heartbeat(_compat.default_store(), rank, world).start()
    prof = None
    # The trace covers the last --trace-steps steps (never the compile step); step times are
    # taken from the untraced steps in between (the profiler slows CPU execution).
    trace_from = max(1, args.steps - args.trace_steps) if args.trace else args.steps
    result.timed_steps = list(range(1, trace_from)) or [i for i in range(args.steps) if i > 0] or [0]
    emulated = emulated_log_module() if world > 1 else None
    try:
        for i, idx in enumerate(batches):
            if on_step is not None:
                on_step(i)
            if emulated is not None and i == 1:
                emulated.clear_collective_log()
            if emulated is not None and i == trace_from:
                comm_stats(result, emulated, world, trace_from - 1)
            if args.trace and i == trace_from:
                prof = start_trace(args)
            start_mem = reset()
            t0 = time.perf_counter()
            loss = step_model(idx).loss
            loss.backward()
            if args.sp and group is not None:
                from lynx_compile.distributed.tensor_parallel import sync_sequence_parallel_grads

                sync_sequence_parallel_grads(model, group)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            result.losses.append(float(loss.detach()))
            result.step_s.append(dt)
            result.peak_bytes.append(read(start_mem))
            if i == 0 and backend is not None:
                record_plans(result, backend)
            if rank == 0:
                say(step_line(result, i, compiled=backend is not None))
    except Exception as e:
        if heartbeat is not None:
            heartbeat.stop(f"failed: {_first_line(e)}")
            if _is_communication_failure(e):
                raise RuntimeError(heartbeat.explain(e)) from e
        raise
    if emulated is not None and trace_from == args.steps:
        comm_stats(result, emulated, world, args.steps - 1)
    if prof is not None:
        result.overlap = finish_trace(prof, args, rank)
    if heartbeat is not None:
        heartbeat.stop("ok")
    if args.check and rank == 0:
        result.reference_losses = _reference_losses(args)
    if rank == 0:
        summary(result, args, say)
    return result


def _compile(model: torch.nn.Module, args: argparse.Namespace) -> tuple[Callable, object | None]:
    """``(step model, lynx backend)``: ``model`` compiled by a lynx backend of the command line's
    options, or ``(model, None)`` for ``--policy eager``."""
    import lynx_compile

    if args.policy == "eager":
        return model, None
    options = backend_options(args)
    if getattr(args, "device_budget", None) is not None:
        options["device_budget"] = args.device_budget
    backend = lynx_compile.backend(**options)
    return torch.compile(model, backend=backend), backend


def _train_pipeline(args: argparse.Namespace, rank: int, world: int, say) -> TrainResult:
    from lynx_compile.tools.train_pp import train_pipeline

    losses, times, pl = train_pipeline(args, rank, world, say)
    result = TrainResult(rank=rank, world_size=world, losses=losses, step_s=times, peak_method="predicted",
                         timed_steps=list(range(1, len(times))) or [0])
    result.plans = [pl.plan.to_dict()]
    if args.check and rank == 0:
        from lynx_compile.tools.train_pp import default_microbatches, pipeline_stages

        micro = args.microbatches or default_microbatches(args.batch_size, pipeline_stages(args))
        result.reference_losses = _reference_losses(args, microbatches=micro)
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result.losses, result.reference_losses))
        say("check: step  pipeline loss    single-process loss")
        for i, (a, b) in enumerate(zip(result.losses, result.reference_losses)):
            say(f"       {i:4d}  {a:.8f}     {b:.8f}")
        say(f"check: max relative loss difference {worst:.2e}")
        p = args.dropout if args.dropout is not None else getattr(model_from_args(args, torch.device("meta")).config, "dropout", 0)
        if p:
            say(f"check: dropout {p} draws different masks per rank than in one process, so the losses "
                "agree only statistically; --dropout 0 checks exactly")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(result.__dict__, f, indent=2)
    return result


def _reference_losses(args: argparse.Namespace, microbatches: int = 1) -> list[float]:
    """The same steps, unsharded, eager, in this process."""
    device = local_device()
    model = model_from_args(args, device)
    batches = batches_from_args(args, model.config, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for idx in batches:
        # mean of the micro-batch losses, as a pipeline step computes it
        loss = sum(model(chunk).loss for chunk in idx.chunk(microbatches)) / microbatches
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _unwrap(e: BaseException) -> BaseException:
    """The backend's own error when dynamo wrapped it (BackendCompilerFailed), else ``e``."""
    inner = getattr(e, "inner_exception", None)
    return inner if inner is not None else e


def _first_line(e: BaseException) -> str:
    e = _unwrap(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _is_communication_failure(e: BaseException) -> bool:
    """A collective that failed because a peer is gone or stuck (not a local bug)."""
    import torch.distributed as dist

    while e is not None:
        if isinstance(e, getattr(dist, "DistError", ())):
            return True
        text = str(e)
        if any(k in text for k in ("Connection closed", "Connection reset", "timed out", "Timed out",
                                   "Broken pipe", "ProcessGroupGloo", "NCCL")):
            return True
        e = e.__cause__ or getattr(e, "inner_exception", None)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lynx train", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """``train(args)`` with errors as one message on stderr and exit status 1."""
    try:
        train(args)
    except Exception as e:
        import traceback

        if os.environ.get("LYNX_DEBUG"):
            traceback.print_exc()
        print(f"{_unwrap(e)}", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
