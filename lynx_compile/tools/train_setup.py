"""What ``lynx train`` (``tools/train.py``) builds from its command line before the first step:
this rank's process group and device, the model and its tensor-parallel shard, the batches, the
backend's options. Its pipeline loop (``tools/train_pp.py``) builds from the same."""
from __future__ import annotations

import argparse
import datetime
import os

import torch


def init_distributed(args: argparse.Namespace) -> tuple[int, int]:
    """Join the process group torchrun set up (env:// rendezvous); (rank, world_size)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        if (args.tp or 1) > 1 or getattr(args, "pp", 1) > 1:
            n = max(args.tp or 1, getattr(args, "pp", 1))
            raise SystemExit(f"lynx train: --tp/--pp {n} needs {n} processes; launch with "
                             f"`torchrun --nproc-per-node {n} -m lynx_compile.train ...`")
        return 0, 1
    timeout = datetime.timedelta(seconds=args.timeout)
    if local_device().type == "cuda":
        torch.cuda.set_device(local_device())
        backend = "nccl"
    elif args.emulate_link:
        from lynx_compile.distributed.emulated_link import BACKEND_NAME, configure_emulated_link, parse_link

        configure_emulated_link(parse_link(args.emulate_link))
        backend = BACKEND_NAME
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def local_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def model_from_args(args: argparse.Namespace, device: torch.device):
    from lynx_compile.models import build_model

    overrides = {}
    if args.seq_len is not None:
        overrides["seq_len"] = args.seq_len
    if args.dropout is not None:
        overrides["dropout"] = args.dropout
    torch.manual_seed(args.seed)
    return build_model(args.model, device=device, **overrides)


def batches_from_args(args: argparse.Namespace, config, device: torch.device) -> list[torch.Tensor]:
    from lynx_compile.models import example_batch

    g = torch.Generator().manual_seed(args.seed + 1)
    return [example_batch(config, args.batch_size, generator=g).to(device) for _ in range(args.steps)]


def parallelize(model, args: argparse.Namespace, world: int):
    """``(model, group)``: this rank's tensor-parallel shard of ``model`` over every rank
    (``--tp-impl``), and the process group of lynx's Megatron layers (None for DTensor or one
    process)."""
    import torch.distributed as dist

    if world == 1:
        return model, None
    if args.tp_impl == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        from lynx_compile.distributed.dtensor_tp import dtensor_parallelize

        if args.sp:
            raise SystemExit("lynx train: --sp is supported with --tp-impl megatron")
        mesh = init_device_mesh(local_device().type, (world,))
        return dtensor_parallelize(model, mesh), None
    from lynx_compile.distributed.tensor_parallel import tensor_parallelize

    group = dist.group.WORLD
    return tensor_parallelize(model, group, sequence_parallel=args.sp), group


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
