"""torchtitan 0.3.0's training step on torchtitan's own model, parallelism and loss, one process
per rank, compiled with any torch.compile backend named on the command line:

    torchrun --nproc-per-node 2 -m lynx_compile.torchtitan_train --model llama3 --dp-shard 2 \\
        --compile-backend lynx                      # FSDP2 over 2 ranks
    LYNX_OPTIONS='{"memory_budget": 0.7}' torchrun --nproc-per-node 2 \\
        -m lynx_compile.torchtitan_train --model llama3 --tp 2 --compile-backend lynx

Why not ``torchrun -m torchtitan.train``: on a CPU-only torch with torchtitan's model, config,
loss and compile dependencies (``make install-torchtitan``) its trainer cannot start:

- ``torchtitan/trainer.py:24`` imports ``components/dataloader.py``, which imports ``torchdata``
  (line 20); ``trainer.py:26`` imports ``components/metrics.py``, which imports
  ``torch.utils.tensorboard`` (line 15, needs ``tensorboard``); the llama3 config registry
  (``models/llama3/config_registry.py:21``) imports ``hf_datasets/text_datasets.py``, which
  imports ``datasets`` (line 14). None are installed (torchtitan's trainer dependencies).
- ``tools/utils.py:55``: ``device_type = _get_available_device_type() or "cuda"``: with no
  accelerator it is ``"cuda"``; ``trainer.py:301`` then calls ``torch.cuda.set_device`` (a
  CPU-only torch raises ``AttributeError: module 'torch._C' has no attribute
  '_cuda_setDevice'``), ``distributed/utils.py:512-517`` picks ``"nccl"`` (not built) and
  ``distributed/parallel_dims.py:281`` builds its mesh on ``"cuda"``.
- its data: ``hf_assets_path="./tests/assets/tokenizer"`` (``trainer.py:79``) and the
  ``c4_test`` data set (``hf_datasets/text_datasets.py:45``) are files of torchtitan's
  repository, not of its wheel.

So this module runs what ``Trainer.__init__`` and ``Trainer.train_step`` run, from torchtitan's
own pieces: the registry's ``debugmodel`` (SDPA swapped in: ``tools/torchtitan_models.py``),
built on the meta device; ``ParallelDims`` and its meshes; ``set_determinism``; the model package's own
``ModelSpec.parallelize_fn`` (llama3: ``parallelize_llama``: TP, ``apply_compile`` per block,
FSDP2's ``fully_shard``), ``to_empty`` and ``init_weights``; the loss ``CrossEntropyLoss`` (the
``llama3_debugmodel_ce_loss`` config's; the debugmodel's default ``ChunkedLossWrapper`` is not
used) built with the same ``CompileConfig`` (compiled by torchtitan); torchtitan's AdamW and LR
schedule (``default_adamw``, the debugmodel's warm-up and decay); per step ``zero_grad``, the
global token count summed over the batch mesh, (under ``spmd_types``)
``annotate_input_spmd_types``, forward, loss, backward inside
torchtitan's SPMD context, ``clip_grad_norm_``, optimizer and scheduler steps, and the loss
summed over the loss mesh, as ``train_step`` logs it. The tokens are fixed random ids (one
batch, every step): no data loader, no tokenizer.

Workarounds, each applied here and only here:

- **CPU device** (only when torch has no CUDA, :func:`init_distributed`): the module globals
  ``device_type`` / ``device_module`` of ``torchtitan.tools.utils``,
  ``torchtitan.distributed.parallel_dims`` and ``torchtitan.distributed.utils`` are set to
  ``"cpu"`` / ``torch.cpu``; the process group is gloo, joined here (torchtitan's own
  ``init_distributed`` would pick nccl); autograd multithreading off, as torchtitan's does.
- **gloo has no PREMUL_SUM** (:func:`_sum_reductions_for_gloo`): FSDP2 reduces with SUM
  instead, the same sums.
- **``update_from_config``** (the model config's TP sharding specs, its checks, the RoPE length)
  imports ``torchtitan.trainer`` for one ``isinstance``; when that cannot be imported a
  placeholder module stands in during the call (:func:`_trainer_module`) and the trainer-only
  part is done here (:func:`update_from_config`).
- ``zero_grad(set_to_none=True)``: the trainer's choice when CUDA graphs are off, as they must
  be on a CPU. FSDP2's parameter dtype defaults to float32 here (torchtitan's default is
  bfloat16: ``--mixed-precision-param bfloat16``). ``--spmd-backend partial_dtensor`` by
  default: torchtitan's default, ``spmd_types``, annotates plain local tensors that torch
  2.13's ``fully_shard(dp_mesh_dims=...)`` refuses (``_fsdp_param.py:345``: "all parameters
  must be DTensors"). No activation checkpointing unless ``--ac`` asks for torchtitan's own
  (``--ac full``: ``FullAC``, every block; ``--ac selective``: ``SelectiveAC``, per-op, every
  second matmul recomputed; ``--ac memory_budget --ac-memory-budget F``: ``MemoryBudgetAC``,
  torch.compile's ``activation_memory_budget`` F under Inductor), applied by
  ``parallelize_fn`` before compiling, as the trainer does: the peers lynx is measured against
  (``benchmarks/bench_torchtitan_launcher.py --peers``). With ``--compile-backend lynx`` the
  blocks' checkpoint regions are kept as the user's (``docs/options.md``: the model's own
  checkpointing); torch's budget and lynx's are two planners of one partition, so
  ``memory_budget`` with lynx is refused.

The backend is a name, as ``--compile.backend`` gives it: ``lynx`` reads its options from
``$LYNX_OPTIONS`` (``lynx_compile.config.options_from_env``); ``eager`` compiles nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import sys
import tempfile
import time
import types
from typing import Any, Callable

import torch

from lynx_compile.step.measured_peak import step_peak_bytes
from lynx_compile.tools.torchtitan_models import MODELS, VOCAB, available, batch, compile_config, materialize, \
    model_config, model_spec

_DEVICE_GLOBALS = ("torchtitan.tools.utils", "torchtitan.distributed.parallel_dims",
                   "torchtitan.distributed.utils")
"""Modules holding ``device_type`` (and ``device_module``) as globals, read at import."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float) -> tuple[torch.device, int, int]:
    """(device, rank, world size). Joins torchrun's process group (one process without
    ``RANK``); with no CUDA, points torchtitan's device globals at the CPU (module docstring)."""
    import datetime

    import torch.distributed as dist

    # as torchtitan's init_distributed: spmd_types' backward needs the mesh stack of this thread
    torch.autograd.set_multithreading_enabled(False)
    if torch.cuda.is_available():
        from torchtitan.tools.utils import get_local_device

        device, backend = get_local_device(), "nccl"
        torch.cuda.set_device(device)
    else:
        for mod in _DEVICE_GLOBALS:
            module = importlib.import_module(mod)
            module.device_type = "cpu"
            if hasattr(module, "device_module"):
                module.device_module = torch.cpu
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # one process: a group of one (torchtitan's meshes need one)
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device, dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def _trainer_module():
    """``torchtitan.trainer`` importable for the block: ``Decoder.Config.update_from_config``
    imports it only for ``isinstance(config, Trainer.Config)``; when it cannot be imported
    (torchdata, tensorboard: module docstring) a module whose ``Trainer.Config`` nothing is an
    instance of stands in for the block, so torchtitan takes its path for non-trainer callers."""
    try:
        importlib.import_module("torchtitan.trainer")
    except ImportError:
        pass
    else:
        yield
        return
    placeholder = types.ModuleType("torchtitan.trainer")
    placeholder.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})
    sys.modules["torchtitan.trainer"] = placeholder
    try:
        yield
    finally:
        if sys.modules.get("torchtitan.trainer") is placeholder:
            del sys.modules["torchtitan.trainer"]


def update_from_config(config: Any, parallelism: Any, training: Any, debug: Any) -> None:
    """What ``Trainer.__init__`` does with ``model_config.update_from_config(config=...)``:
    torchtitan's own checks (TP divides the heads) and TP sharding configs (llama3:
    ``set_llama3_sharding_config``), then its trainer-only part (``decoder.py:166-181``): RoPE
    caches sized to ``training.seq_len``, the MoE router's debug flag."""
    with _trainer_module():
        config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism, training=training,
                                                               debug=debug))
    if training.seq_len > config.max_seq_len:
        raise SystemExit(f"--seq {training.seq_len} exceeds the model's RoPE maximum {config.max_seq_len}")
    for layer in config.layers:
        if getattr(layer, "attention", None) is not None:
            layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=training.seq_len)
        if getattr(layer, "moe", None) is not None:
            layer.moe.router._debug_force_load_balance = debug.moe_force_load_balance


def _sum_reductions_for_gloo(model: torch.nn.Module) -> None:
    """torchtitan turns FSDP's gradient division off (``fsdp.py:316``, factor 1.0: it divides by
    the global token count itself), and FSDP2 then reduce-scatters with ``PREMUL_SUM(1.0)``
    (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:850``), which gloo does not have.
    ``set_force_sum_reduction_for_comms(True)`` makes it ``SUM`` followed by a division by the
    same factor 1.0, which FSDP skips: the same sums."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


@dataclasses.dataclass
class Run:
    """What ``Trainer.__init__`` builds and ``train_step`` uses."""

    dims: Any  # ParallelDims
    model: torch.nn.Module
    loss_fn: Any
    optimizers: Any
    schedulers: Any
    training: Any  # TrainingConfig
    train_context: Any
    gc_handler: Any


def build_run(args: argparse.Namespace, device: torch.device, world: int) -> Run:
    """``Trainer.__init__``'s order: parallel dims, GC, determinism, model config and meta
    model, loss (compiled by torchtitan), ``parallelize_fn``, weights, optimizer, LR schedule."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils as tt_utils

    parallelism = ParallelismConfig(data_parallel_shard_degree=args.dp_shard, tensor_parallel_degree=args.tp,
                                    expert_parallel_degree=args.ep, spmd_backend=args.spmd_backend)
    if args.dp_shard * args.tp != world:
        raise SystemExit(f"--dp-shard {args.dp_shard} x --tp {args.tp} != {world} processes; launch with "
                         f"`torchrun --nproc-per-node {args.dp_shard * args.tp} -m lynx_compile.torchtitan_train ...`")
    dims = ParallelDims.from_config(parallelism, world)
    training = TrainingConfig(local_batch_size=args.batch_size, seq_len=args.seq, steps=args.steps,
                              mixed_precision_param=args.mixed_precision_param)
    gc_handler = tt_utils.GarbageCollection(gc_freq=training.gc_freq)  # automatic GC off, as the trainer
    dist_utils.set_spmd_backend(args.spmd_backend)
    debug = DebugConfig(seed=args.seed)
    dist_utils.set_determinism(dims, device, debug, distinct_seed_mesh_dims=["pp"])

    config = model_config(args.model, layers=args.layers)
    update_from_config(config, parallelism, training, debug)
    with torch.device("meta"):
        model = config.build()
    compile_cfg = compile_config(args.compile_backend)
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build(compile_config=compile_cfg)
    with tempfile.TemporaryDirectory() as dump_folder:
        model = model_spec(args.model).parallelize_fn(
            model, parallel_dims=dims, training=training, parallelism=parallelism, compile_config=compile_cfg,
            ac_config=ac_config(args.ac, args.ac_memory_budget), dump_folder=dump_folder)
    if device.type == "cpu":
        _sum_reductions_for_gloo(model)
    model = materialize(model, device)
    optimizers = default_adamw(lr=args.lr).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                              min_lr_factor=0.0).build(optimizers=optimizers,
                                                                       training_steps=args.steps)
    train_context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)
    return Run(dims, model, loss_fn, optimizers, schedulers, training, train_context, gc_handler)


AC_MODES = ("none", "full", "selective", "memory_budget")


def ac_config(mode: str, memory_budget: float) -> Any:
    """torchtitan's activation checkpointing config for ``--ac`` (its trainer's
    ``activation_checkpoint`` choices): None for ``none``."""
    from torchtitan.distributed import activation_checkpoint as ac

    if mode == "none":
        return None
    if mode == "memory_budget":
        return ac.MemoryBudgetAC.Config(memory_budget=memory_budget)
    return {"full": ac.FullAC, "selective": ac.SelectiveAC}[mode].Config()


def train_step(run: Run, step: int, tokens: torch.Tensor, labels: torch.Tensor, spmd_backend: str,
               measure: Callable[[Callable[[], Any]], int | None] | None = None) -> tuple[float, float, int | None]:
    """``Trainer.train_step`` for one micro-batch (no gradient accumulation, no PP): the loss as
    the trainer logs it (summed over the loss mesh), the gradient norm before clipping, and what
    ``measure(forward_and_backward)`` returns (the peak bytes of the step's forward and backward:
    :func:`lynx_compile.step.measured_peak.step_peak_bytes`; None without it)."""
    import spmd_types as spmd
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    dims = run.dims
    run.gc_handler.run(step)
    run.optimizers.zero_grad(set_to_none=True)
    local_valid_tokens = (labels != IGNORE_INDEX).sum()
    global_valid_tokens = (dist_utils.dist_sum_tensor(local_valid_tokens, dims.get_mesh("batch"))
                           if dims.dp_enabled else local_valid_tokens)
    inputs, targets, extra = tokens, labels, {}
    if spmd_backend == "spmd_types":
        inputs, targets, extra = annotate_input_spmd_types(dims, inputs, targets, extra)
    out: dict[str, torch.Tensor] = {}

    def forward_and_backward() -> None:
        with run.train_context():
            pred = run.model(inputs, **extra)
            out["loss"], _ = run.loss_fn(pred, targets, global_valid_tokens)
            del pred
            with spmd.no_typecheck():
                out["loss"].backward()

    peak = measure(forward_and_backward) if measure is not None else forward_and_backward()
    loss = out["loss"]
    grad_norm = dist_utils.clip_grad_norm_(list(run.model.parameters()), run.training.max_norm, foreach=True,
                                           pp_mesh=None, ep_enabled=dims.ep_enabled)
    run.optimizers.step()
    run.schedulers.step()
    loss = loss.detach()
    global_loss = (dist_utils.dist_sum(loss, dims.get_optional_mesh("loss")) if dims.dp_cp_enabled
                   else float(loss.item()))
    return global_loss, float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm), peak


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.steps`` training steps on one fixed batch (each data-parallel rank its rows);
    returns (on every rank) the per-step losses and gradient norms."""
    device, rank, world = init_distributed(args.timeout)
    run = build_run(args, device, world)
    batch_rank, batch_degree = 0, 1
    if run.dims.dp_enabled:
        batch_mesh = run.dims.get_mesh("batch")
        batch_degree, batch_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    tokens, labels = batch(args.batch_size * batch_degree, args.seq, seed=args.seed + 1)
    rows = slice(batch_rank * args.batch_size, (batch_rank + 1) * args.batch_size)
    tokens, labels = tokens[rows].to(device), labels[rows].to(device)  # (local batch, seq) each
    losses, grad_norms, peaks, seconds = [], [], [], []
    recorder = _lynx_bound().step_recorder if args.compile_backend == "lynx" else None
    measure = functools.partial(step_peak_bytes, device=device, recorder=recorder)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        loss, grad_norm, peak = train_step(run, step, tokens, labels, args.spmd_backend,
                                           measure=measure)
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        grad_norms.append(grad_norm)
        peaks.append(peak)
        if rank == 0:
            print(f"step {step:2d}  loss {loss!r}  grad_norm {grad_norm!r}", flush=True)
    import torch.distributed as dist

    by_rank = [None] * world
    dist.all_gather_object(by_rank, peaks)
    return {"losses": losses, "grad_norms": grad_norms, "rank": rank, "world_size": world,
            "device": str(device), "backend": args.compile_backend, "ac": args.ac,
            # rank 0's wall seconds per step (the loss read back ends each step: the ranks' last
            # collective); steps 1-2 compile, and on CPU steps 3+ run under the profiler's
            # allocator events that measure the peak
            "step_s": seconds,
            # each rank's forward + backward peak per step, bytes above the step's start (None:
            # not measured; on CPU the step lynx records is measured by lynx's recording:
            # step.measured_peak.step_peak_bytes)
            "step_peak_bytes_by_rank": by_rank}


def lynx_summary() -> dict[str, Any]:
    """What the ``lynx`` backend compiled in this process (the bound backend of the options in
    ``$LYNX_OPTIONS``, or of none): its options and, per graph plan, what it recomputed and the
    step's predicted peak against the step without recompute."""
    options = _lynx_options()
    bound = _lynx_bound(options)
    # each plan with its fingerprint as the ranks compared it (check_plan_agreement; None: not compared)
    plans = [{"fingerprint": r.stats.get("plan_fingerprint"), "solver": str(p.solver),
              "recomputed": len(p.recomputed), "saved": len(p.saved), "budget_scope": p.budget_scope,
              "step_peak_bytes": p.step_peak_bytes, "step_reference_bytes": p.step_reference_bytes,
              "budget_bytes": p.budget_bytes,
              # the step's plan taken from the plan cache (a run before kept it), not recorded
              "step_plan_cached": any(n.startswith("from the plan cache") for n in p.notes)}
             for r in bound.records if (p := r.plan) is not None]
    return {"options": options, "graphs": len(bound.records), "plans": plans}


def _lynx_options() -> dict[str, Any]:
    from lynx_compile.config import options_from_env

    return options_from_env() or {}


def _lynx_bound(options: dict[str, Any] | None = None) -> Any:
    """The ``lynx`` backend ``--compile-backend lynx`` compiles with: the one bound to the options
    in ``$LYNX_OPTIONS`` (``options``, where already read; ``lynx_compile.backend``: identical
    options, the same backend)."""
    import lynx_compile

    return lynx_compile.backend(**(_lynx_options() if options is None else options))


def _options_problem(backend: str) -> str | None:
    """``$LYNX_OPTIONS`` checked before anything is built: a bad value, or a value that no
    backend would read (it configures only ``lynx``)."""
    from lynx_compile.config import OPTIONS_ENV, options_from_env

    try:
        options = options_from_env()
    except ValueError as e:
        return str(e)
    if options is not None and backend != "lynx":
        return (f"{OPTIONS_ENV} is set but --compile-backend is {backend!r}: it configures only the lynx "
                f"backend; unset {OPTIONS_ENV} or use --compile-backend lynx")
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lynx_compile.torchtitan_train",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3", choices=sorted(MODELS.values()),
                   help="torchtitan model package; its registry's debugmodel is trained")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N blocks (default: all)")
    p.add_argument("--dp-shard", type=int, default=1, help="FSDP2 degree (data_parallel_shard_degree)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (tensor_parallel_degree)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree (expert_parallel_degree; MoE models; borrowed from --dp-shard "
                        "x --tp as torchtitan does: `--dp-shard 2 --ep 2` on 2 ranks)")
    p.add_argument("--spmd-backend", default="partial_dtensor", choices=["partial_dtensor", "spmd_types"],
                   help="torchtitan's parallelism.spmd_backend (its default, spmd_types, fails in torch "
                        "2.13's fully_shard: docs/torchtitan.md)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend name, as --compile.backend (inductor, lynx, aot_eager), "
                        "or eager (no compile); lynx reads its options from $LYNX_OPTIONS")
    p.add_argument("--ac", default="none", choices=AC_MODES,
                   help="torchtitan's own activation checkpointing (activation_checkpoint.mode): full, "
                        "selective (per-op), memory_budget (torch.compile's activation_memory_budget, "
                        "--ac-memory-budget; Inductor only); none (default)")
    p.add_argument("--ac-memory-budget", type=float, default=0.5,
                   help="--ac memory_budget's activation_memory_budget, 0-1 (torchtitan's default 0.5)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2, help="local batch size (per data-parallel rank)")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--lr", type=float, default=8e-4, help="AdamW learning rate (debugmodel's)")
    p.add_argument("--mixed-precision-param", default="float32", choices=["float32", "bfloat16"],
                   help="FSDP2's parameter dtype (torchtitan's default is bfloat16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="process group timeout, seconds")
    p.add_argument("--out", default=None, help="rank 0 writes losses, grad norms, each rank's measured step "
                                                "peaks and lynx's plans here (JSON)")
    return p.parse_args(argv)


def _ac_problem(args: argparse.Namespace) -> str | None:
    """Why ``--ac`` cannot apply as asked; None where it can."""
    if args.ac != "memory_budget":
        return None
    if not 0.0 <= args.ac_memory_budget <= 1.0:
        return f"--ac-memory-budget {args.ac_memory_budget:g}: torch's activation_memory_budget is a fraction, 0 to 1"
    if args.compile_backend == "lynx":
        return ("--ac memory_budget with --compile-backend lynx: torch's budget and lynx's would plan one partition; "
                "give lynx the budget instead (LYNX_OPTIONS='{\"memory_budget\": F}') or compile with inductor")
    if args.compile_backend != "inductor":
        return (f"--ac memory_budget with --compile-backend {args.compile_backend}: torch's activation_memory_budget "
                "is applied by Inductor's partitioner; use --compile-backend inductor")
    return None


def _expert_problem(args: argparse.Namespace) -> str | None:
    """Why ``--ep`` cannot apply to the model asked for (no MoE block: torchtitan would train
    it with no expert parallelism, saying nothing); None where it can."""
    if args.ep <= 1:
        return None
    config = model_config(args.model, layers=args.layers)
    if any(getattr(layer, "moe", None) is not None for layer in config.layers):
        return None
    cut = f" cut to {args.layers} block(s)" if args.layers else ""
    return (f"--ep {args.ep}: {args.model}'s debugmodel{cut} has no MoE block, no experts to place "
            "(deepseek_v3's MoE blocks start at its second block: --model deepseek_v3 --layers 2 or more)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (why := available() or _options_problem(args.compile_backend) or _ac_problem(args)
            or _expert_problem(args)) is not None:
        print(f"lynx_compile.torchtitan_train: {why}", file=sys.stderr)
        return 2
    result = train(args)
    if result["rank"] == 0:
        if args.compile_backend == "lynx":
            result["lynx"] = lynx_summary()
            print(f"lynx: {json.dumps(result['lynx'])}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    import torch.distributed as dist

    if dist.is_initialized():
        # every rank done with its collectives before any tears the group down (seen once under
        # load: a rank aborted in gloo's teardown, "terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
