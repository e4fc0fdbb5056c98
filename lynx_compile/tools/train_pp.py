"""``lynx train --pp N`` / ``torchrun --nproc-per-node N -m lynx_compile.train --pp N``: train a zoo
model with lynx's recompute-aware pipeline on N ranks (one stage per rank, or more with
``--schedule Interleaved1F1B|InterleavedZeroBubble --stages``; two per rank, in V order, with
``--schedule ZBVZeroBubble``). Rank 0 prints the stage plan; the last stage's rank reports the
loss (mean over micro-batches), which rank 0 prints each step."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from lynx_compile.pipelining.placement import stage_rank
from lynx_compile.pipelining.stage_plan import SCHEDULES


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (ranks in the pipeline)")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default --pp, 2 x --pp with "
                   "--schedule ZBVZeroBubble; a multiple of --pp with Interleaved1F1B or InterleavedZeroBubble)")
    p.add_argument("--microbatches", type=int, default=None, help="micro-batches per step (default: the most, "
                   "up to 2 x stages, that split --batch-size evenly)")
    p.add_argument("--schedule", default="1F1B", choices=sorted(SCHEDULES),
                   help="pipeline schedule (torch.distributed.pipelining). ZBVZeroBubble (two stages per rank, "
                   "V order) and InterleavedZeroBubble run each stage's backward as B (input gradients) then W "
                   "(weight gradients), split by lynx; with --no-recompute-in-wait (Inductor) B runs the whole "
                   "backward and W nothing")
    p.add_argument("--memory-per-device", type=_bytes, default=None,
                   help="bytes per device for the stage plan, e.g. 30000000, 48MiB, 2GiB (default: no limit)")
    p.add_argument("--split", default="lynx", choices=["lynx", "compute", "uniform"],
                   help="stage split: recompute-aware (lynx), compute-only balance, or equal layers")
    p.add_argument("--no-recompute-in-wait", action="store_true",
                   help="run recompute only after the gradient arrives")
    p.add_argument("--per-microbatch", action="store_true",
                   help="zero-bubble schedules with --memory-per-device: choose each stage's recompute per "
                   "micro-batch (an MILP over the schedule's timeline and each rank's memory walk)")


def pipeline_stages(args: argparse.Namespace) -> int:
    """``--stages``, or its default: ``--pp`` (``ZBVZeroBubble``: 2 x ``--pp``)."""
    if args.stages:
        return args.stages
    return 2 * args.pp if getattr(args, "schedule", None) == "ZBVZeroBubble" else args.pp


def default_microbatches(batch_size: int, stages: int) -> int:
    """The most micro-batches up to 2 x stages that split the batch evenly (>= stages)."""
    for m in range(min(batch_size, 2 * stages), stages - 1, -1):
        if batch_size % m == 0:
            return m
    raise SystemExit(f"lynx train: --batch-size {batch_size} cannot feed {stages} stages: use a batch size that is "
                     f"a multiple of a micro-batch count >= {stages} (e.g. --batch-size {2 * stages}), or --microbatches")


def _bytes(text: str) -> int:
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    t = text.strip().upper()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def train_pipeline(args: argparse.Namespace, rank: int, world: int, say: Callable[[str], None] = print):
    """The pipeline training loop; returns (losses, step seconds, plan) on every rank."""
    import lynx_compile
    from lynx_compile.models.common import lm_loss
    from lynx_compile.tools.train_setup import backend_options, batches_from_args, local_device, model_from_args

    tp = args.tp or 1
    if args.pp * tp != world:
        raise SystemExit(f"lynx train: --pp {args.pp} x --tp {tp} = {args.pp * tp} ranks but {world} processes; "
                         f"launch with `torchrun --nproc-per-node {args.pp * tp} -m lynx_compile.train "
                         f"--pp {args.pp} --tp {tp} ...`")
    if tp > 1 and args.tp_impl != "megatron":
        raise SystemExit("lynx train: --pp with --tp needs --tp-impl megatron")
    # ranks [s*tp, (s+1)*tp) hold stage s (one TP group each); PP groups take one rank per stage
    tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(args.pp)]
    pp_groups = [dist.new_group([s * tp + t for s in range(args.pp)]) for t in range(tp)]
    tp_group, pp_group = tp_groups[rank // tp], pp_groups[rank % tp]
    stages = pipeline_stages(args)
    micro = args.microbatches or default_microbatches(args.batch_size, stages)
    device = local_device()
    model = model_from_args(args, device)
    batches = batches_from_args(args, model.config, device)
    if tp > 1:
        from lynx_compile.distributed.tensor_parallel import tensor_parallelize

        tensor_parallelize(model, tp_group, sequence_parallel=args.sp)
    options = backend_options(args)
    options.pop("memory_budget", None)  # per stage, from the plan
    pl = lynx_compile.pipeline(model, (batches[0],), num_stages=stages, num_microbatches=micro,
                               loss_fn=lambda logits, idx: lm_loss(logits, idx, None),
                               memory_per_device=args.memory_per_device, schedule=args.schedule,
                               method=args.split, recompute_in_wait=not args.no_recompute_in_wait,
                               options=options, group=pp_group,
                               planning_group=tp_group if tp > 1 else None,
                               per_microbatch=getattr(args, "per_microbatch", False))
    if rank == 0:
        say(pl.plan.table())
        if pl.microbatch_plan is not None:
            say(pl.microbatch_plan.table(pl.stage_variants.variants))
    opt = torch.optim.AdamW(list(pl.parameters()), lr=args.lr)
    last_rank = stage_rank(args.schedule, stages - 1, stages, args.pp) * tp
    losses, times = [], []
    for i, idx in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        mb_losses: list = []
        pl.step(idx, target=idx, losses=mb_losses)
        if args.sp and tp > 1:
            from lynx_compile.distributed.tensor_parallel import sync_sequence_parallel_grads

            sync_sequence_parallel_grads(model, tp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        loss = torch.tensor([float(sum(x.detach() for x in mb_losses) / len(mb_losses)) if mb_losses else 0.0])
        dist.broadcast(loss, src=last_rank)
        losses.append(float(loss))
        times.append(dt)
        if rank == 0:
            say(f"step {i:3d}  loss {losses[-1]:.6f}  time {dt * 1e3:9.2f} ms{' (compile)' if i == 0 else ''}")
    if rank == 0 and len(times) > 1:
        say(f"median step time (steps 1..{len(times) - 1}): {statistics.median(times[1:]) * 1e3:.2f} ms  "
            f"[PP {args.pp} x TP {tp}, {stages} stages, {micro} micro-batches, {args.schedule}, split {args.split}, "
            f"recompute in wait: {not args.no_recompute_in_wait}]")
    return losses, times, pl
