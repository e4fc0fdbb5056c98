"""What ``lynx train`` and its pipeline loop (``pipelining/train_pp.py``) both build from the
command line: the device of this rank, the model, its batches, the backend options."""
from __future__ import annotations

import argparse
import os

import torch


def local_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def batches_from_args(args: argparse.Namespace, config, device: torch.device) -> list[torch.Tensor]:
    from lynx_compile.models import example_batch

    g = torch.Generator().manual_seed(args.seed + 1)
    return [example_batch(config, args.batch_size, generator=g).to(device) for _ in range(args.steps)]


def model_from_args(args: argparse.Namespace, device: torch.device):
    from lynx_compile.models import build_model

    overrides = {}
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    torch.manual_seed(args.seed)
    return build_model(args.model, device=device, **overrides)


def backend_options(args: argparse.Namespace) -> dict:
    opts = {"policy": args.policy, "solver": args.solver, "time_limit_s": args.time_limit,
            "link": args.link, "hardware": args.hardware, "plan_cache": False,
            "cost_source": args.cost_source,
            "trace_recompute": bool(args.trace), "windows": not args.no_windows,
            "fuse_kernels": args.fuse_kernels, "side_stream": args.side_stream,
            "offload": getattr(args, "offload", False)}
    if args.memory_budget is not None:
        opts["memory_budget"] = args.memory_budget
    if args.compiler is not None:
        opts["compiler"] = args.compiler
    return opts
