"""``pipeline(...)``: cut a model into recompute-aware stages and build this rank's part.

``plan_pipeline`` traces, profiles and plans (nothing distributed); ``pipeline`` runs rank 0's
plan on every rank, builds its stages (the model's own ``pipeline_stage`` or torch's split),
compiles each with lynx under its allowance and wraps them in torch's schedule: a
:class:`LocalPipeline`. The package ``lynx_compile.pipelining`` offers these names; this module
holds them so that the planners beside it import without torch.distributed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .pipeline_costs import PipelineCosts
from .placement import MULTI_STAGE_SCHEDULES, ZERO_BUBBLE_SCHEDULES, check_placement, local_stages, schedule_class
from .plan_stages import plan_stages
from .profile import profile_pipeline
from .stage_plan import METHODS, SCHEDULES, StagePlan, StagePlanError
from .stages import LynxPipelineStage, compile_stage, split_model, sync_tied_grads

log = logging.getLogger("lynx_compile")


class _Forward(nn.Module):
    """``model`` with the forward the pipeline cuts (e.g. ``model.logits``, no loss inside)."""

    def __init__(self, model: nn.Module, forward: Callable | None):
        super().__init__()
        self.model = model
        self._fn = forward

    def forward(self, *args: Any) -> Any:
        return self._fn(*args) if self._fn is not None else self.model(*args)


@dataclass
class LocalPipeline:
    """What ``pipeline`` returns on one rank."""

    stages: list[LynxPipelineStage]
    """This rank's stages (one, v for interleaved schedules, two for ZBVZeroBubble)."""
    schedule: Any
    """A torch.distributed.pipelining schedule over ``stages``: ``schedule.step(x, target=y,
    losses=[])`` on the first / last stage ranks; ``schedule.step()`` in between."""
    plan: StagePlan
    costs: PipelineCosts
    modules: dict[int, nn.Module]
    """Stage index -> the stage module (its parameters are the trained ones; uncompiled, except under
    the zero-bubble schedules, which need it compiled in place: ``stages.compile_stage``)."""
    backends: dict[int, Any]
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shapes: dict[str, Any] = field(default_factory=dict)
    group: Any = None
    prefix: str = "model."
    microbatch_plan: Any = None
    """With ``per_microbatch=True``: the :class:`~lynx_compile.pipelining.microbatch_plan.MicrobatchPlan`
    (which variant each stage runs for each micro-batch); its ``table(variants)`` says why."""
    stage_variants: Any = None
    """With ``per_microbatch=True``: the :class:`~lynx_compile.pipelining.stage_variants.StageVariants`
    the plan chose among."""

    @property
    def is_first(self) -> bool:
        return 0 in self.modules

    @property
    def is_last(self) -> bool:
        return self.plan.num_stages - 1 in self.modules

    def parameters(self):
        seen = set()
        for m in self.modules.values():
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_parameters(self):
        """(name in the original model, parameter) for every parameter this rank holds."""
        for i, m in sorted(self.modules.items()):
            for name, p in m.named_parameters():
                yield name.removeprefix(self.prefix), p

    def step(self, *inputs: Any, target: Any = None, losses: list | None = None) -> Any:
        """One pipeline step (forward + backward of every micro-batch); tied grads summed."""
        kwargs = {}
        if self.is_last:
            kwargs = {"target": target, "losses": losses if losses is not None else []}
        try:
            out = self.schedule.step(*(inputs if self.is_first else ()), **kwargs)
        except Exception as e:
            from lynx_compile.compiler.dynamo_backend import find_backend_error
            from lynx_compile.decisions import BudgetError

            budget_error = find_backend_error(e, BudgetError)
            if budget_error is None:
                raise
            local = ", ".join(f"stage {i} (allowance {self.plan.stages[i].budget_bytes} B per micro-batch, "
                              f"{self.plan.stages[i].in_flight} in flight)" for i in sorted(self.modules))
            raise StagePlanError(
                f"the stage plan's memory per device ({self.plan.memory_per_device} B) is below what lynx can "
                f"reach for {local}: {str(budget_error).rstrip('.')}. The planner's stage memory model is approximate; give "
                "each device more memory, use more stages, or smaller micro-batches.") from e
        if self.tied:
            sync_tied_grads(self.modules, self.tied, self.shapes, group=self.group)
        return out

    @property
    def early_recomputes(self) -> int:
        return sum(s.early_recomputes for s in self.stages)


def _refuse_tensor_parallel(model: nn.Module) -> None:
    """TP x PP is not supported: say so instead of training with wrong gradients."""
    from torch.distributed.tensor import DTensor

    from lynx_compile.distributed.tensor_parallel import TP_SHARD_ATTR

    if any(hasattr(p, TP_SHARD_ATTR) or isinstance(p, DTensor) for p in model.parameters()):
        raise NotImplementedError(
            "lynx_compile.pipeline got a tensor-parallel model without a pipeline_stage() method. "
            "Without one, stages come from torch.export, which keeps the forward of the "
            "tensor-parallel autograd functions but not their backward collectives (gradients come "
            "out wrong). Give the model pipeline_stage(start, end, first=, last=) as the zoo "
            "models have (lynx_compile.models.common.PipelineStageShell), or pipeline an unsharded model.")


def _tied_parameters(model: nn.Module, stage_modules: dict[int, nn.Module], prefix: str):
    """Parameters of ``model`` that more than one stage parameter copies or shares (a tied
    embedding and LM head): canonical name -> ((stage, stage parameter name), ...), and shapes."""
    canonical: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        alias[prefix + name] = canonical.setdefault(id(p), name)
    where: dict[str, list[tuple[int, str]]] = {}
    shapes = {}
    for i, module in sorted(stage_modules.items()):
        for name, p in module.named_parameters(remove_duplicate=False):
            c = alias.get(name, name)
            where.setdefault(c, []).append((i, name))
            shapes[c] = (p.shape, p.dtype)
    tied = {c: tuple(occ) for c, occ in where.items() if len(occ) > 1}
    return tied, {c: shapes[c] for c in tied}


def _stage_modules(model: nn.Module, wrapped: nn.Module, plan: StagePlan, mb: tuple):
    """Every stage's module and the prefix of its parameter names: the model's own stages when
    it can build them (``model.pipeline_stage``: shares modules, keeps tensor-parallel layers
    intact), else torch's export-based split of ``wrapped`` at the plan's cuts."""
    n = plan.num_stages
    if hasattr(model, "pipeline_stage"):
        return {i: model.pipeline_stage(s.blocks[0], s.blocks[1], first=i == 0, last=i == n - 1)
                for i, s in enumerate(plan.stages)}, ""
    _refuse_tensor_parallel(model)
    # pipe_split() markers in the model split it by themselves; SplitPoints only for the rest
    cuts = [s.block_names[0] for s in plan.stages[1:] if s.blocks[0] not in plan.marker_cuts]
    pipe = split_model(wrapped, mb, cuts)
    if pipe.num_stages != n:
        raise StagePlanError(f"torch split the model into {pipe.num_stages} stages, not {n} "
                             f"(cuts {list(plan.cuts)}); does the model contain pipe_split() markers?")
    return {i: pipe.get_stage_module(i) for i in range(n)}, "model."


def plan_pipeline(model: nn.Module, example_microbatch: Sequence[Any], *, num_stages: int, num_microbatches: int,
                  memory_per_device: int | None = None, schedule: str = "1F1B", method: str = "lynx",
                  forward: Callable | None = None, options: dict[str, Any] | None = None,
                  pinned_cuts: Sequence[int] | None = None,
                  ranks: int | None = None) -> tuple[StagePlan, PipelineCosts, list[str]]:
    """Trace, profile and plan (nothing runs distributed); returns (plan, costs, block paths).
    ``ranks``: the pipeline group size (see :func:`plan_stages`)."""
    wrapped = _Forward(model, forward if forward is not None else getattr(model, "logits", None))
    # pipeline() stages run eager unless told otherwise (recompute in the gradient wait)
    options = {"compiler": "eager", **(options or {})}
    costs, paths = profile_pipeline(wrapped, example_microbatch, options)
    plan = plan_stages(costs, num_stages, num_microbatches, memory_per_device, schedule, method=method,
                       pinned_cuts=pinned_cuts, ranks=ranks)
    return plan, costs, paths


def pipeline(model: nn.Module, example_inputs: Sequence[Any], *, num_stages: int, num_microbatches: int,
             loss_fn: Callable, memory_per_device: int | None = None, schedule: str = "1F1B",
             method: str = "lynx", recompute_in_wait: bool = True, forward: Callable | None = None,
             options: dict[str, Any] | None = None, group=None, device: torch.device | str | None = None,
             pinned_cuts: Sequence[int] | None = None, plan: StagePlan | None = None,
             planning_group=None, per_microbatch: bool = False,
             costs: PipelineCosts | None = None) -> LocalPipeline:
    """Cut ``model`` into ``num_stages`` recompute-aware stages and return this rank's part.

    ``example_inputs``: one full batch (split into ``num_microbatches`` along dim 0).
    ``loss_fn(output, target)``: the loss of the last stage's output. ``forward``: what the
    pipeline runs (default ``model.logits`` when the model has it, else ``model``); its output
    must be the tensor ``loss_fn`` takes. ``memory_per_device``: bytes per device (None: no
    limit, nothing recomputed). ``schedule``: ``GPipe``, ``1F1B``, ``Interleaved1F1B`` or
    ``InterleavedZeroBubble`` (``num_stages`` a multiple of the group size), ``ZBVZeroBubble``
    (``num_stages`` twice the group size; rank r holds stages r and 2 x size - 1 - r). Under the
    zero-bubble schedules lynx splits each stage's compiled backward into B (input gradients) and
    W (weight gradients), with either compiler (option ``weight_split``; see
    ``lynx_compile.pipelining.stages``).
    ``method``: ``lynx`` (recompute-aware), ``compute`` or ``uniform`` (baselines). ``options``: lynx backend options for every stage
    (``memory_budget`` is set per stage). Needs torch.distributed initialized; ``group``
    (default: world) holds one rank per stage (or per ``num_stages / size`` stages).
    ``planning_group``: the ranks that compile the same stage (the tensor-parallel group under
    TP x PP); None: each rank plans its stages alone.
    ``per_microbatch``: choose each stage's recompute per micro-batch (zero-bubble schedules, a
    ``memory_per_device``): every stage gets variants (keep everything, the stage plan's allowance,
    the least recompute curve point; ``pipeline.stage_variants``), an MILP over the schedule's
    timeline picks one per (stage, micro-batch) under each rank's memory walk
    (``pipeline.microbatch_plan``), and each stage compiles the variants it uses and runs, per
    micro-batch, the chosen one (``runtime.per_microbatch``). With ``plan=`` it needs the
    ``costs=`` that plan was made from (``plan_pipeline`` returns both)."""
    from lynx_compile.compiler.dynamo_backend import LynxBackend
    from lynx_compile.config import make_config
    from lynx_compile.distributed.agreement import SOLO

    if schedule not in SCHEDULES:
        raise StagePlanError(f"schedule={schedule!r} is not valid; choose one of {sorted(SCHEDULES)}")
    if method not in METHODS:
        raise StagePlanError(f"method={method!r} is not valid; choose one of {sorted(METHODS)}")
    if (options or {}).get("offload") and recompute_in_wait and (options or {}).get("compiler", "eager") == "eager":
        raise StagePlanError("options offload=True and recompute_in_wait=True are not combined yet (the early "
                             "recompute keeps saved tensors per micro-batch, offload moves them): pass "
                             "recompute_in_wait=False (lynx train: --no-recompute-in-wait)")
    if not dist.is_initialized():
        raise RuntimeError("lynx_compile.pipeline needs torch.distributed initialized (launch with torchrun "
                           "and call torch.distributed.init_process_group)")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    why = check_placement(schedule, num_stages, size)
    if why:
        raise StagePlanError(why)
    batch = example_inputs[0].shape[0]
    if batch % num_microbatches:
        raise StagePlanError(f"batch size {batch} does not split into num_microbatches={num_microbatches} "
                             "equal micro-batches")
    mb = tuple(x[: batch // num_microbatches] if torch.is_tensor(x) else x for x in example_inputs)
    options = dict(options or {})
    # Stages run the eager compiler when they recompute in the gradient wait (it splits their
    # backward at runtime); profile them with the compiler they will run under.
    options.setdefault("compiler", "eager" if recompute_in_wait else "inductor")
    if schedule in ZERO_BUBBLE_SCHEDULES and not options.get("side_stream"):
        options["weight_split"] = True  # B and W compiled apart (Inductor); eager cuts at runtime
    if per_microbatch:
        _check_per_microbatch(schedule, memory_per_device, method, plan, costs)
    if plan is None:
        plan, costs, paths = plan_pipeline(model, mb, num_stages=num_stages, num_microbatches=num_microbatches,
                                           memory_per_device=memory_per_device, schedule=schedule, method=method,
                                           forward=forward, options=options, pinned_cuts=pinned_cuts,
                                           ranks=size)
    # measured costs differ per rank: every rank runs rank 0's plan, or the stages would not match
    variants = mb_plan = None
    if per_microbatch:
        variants, mb_plan = _plan_microbatches(plan, costs, size, options)
    box = [plan, variants, mb_plan]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    plan, variants, mb_plan = box
    log.info("lynx: %s", plan.table())
    if mb_plan is not None:
        log.info("lynx: %s", mb_plan.table(variants.variants))
    wrapped = _Forward(model, forward if forward is not None else getattr(model, "logits", None))
    all_modules, prefix = _stage_modules(model, wrapped, plan, mb)
    tied, shapes = _tied_parameters(model, all_modules, prefix)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    local = local_stages(schedule, rank, num_stages, size)
    stages, modules, backends = [], {}, {}
    held: set[int] = set()  # parameters of this rank's earlier stages (a tied embedding on both ends)
    for i in local:
        info = plan.stages[i]
        mod = all_modules[i].to(dev)
        stage_opts = dict(options)
        if info.budget_bytes is not None and stage_opts.get("policy", "lynx") == "lynx":
            stage_opts["memory_budget"] = int(info.budget_bytes)
        wait = recompute_in_wait and stage_opts.get("compiler", "eager") == "eager"
        if wait:
            stage_opts["recompute_in_wait"] = True
            if memory_per_device is not None:  # the headroom the rank's fit test leaves (its stages together)
                bound = plan.rank_bound_bytes[rank] if len(plan.rank_bound_bytes) == size else info.peak_bytes
                stage_opts["recompute_in_wait_bytes"] = max(0, memory_per_device - bound)
        if mb_plan is not None:
            backend = _per_microbatch_backend(stage_opts, variants.budgets[i], mb_plan.choice[i])
        else:
            backend = LynxBackend(make_config(stage_opts), plan_pieces=False)
        backend.planning_group = planning_group if planning_group is not None else SOLO
        compiled = compile_stage(mod, backend, in_place=schedule in ZERO_BUBBLE_SCHEDULES)
        ids = {id(p) for p in mod.parameters()}
        stages.append(LynxPipelineStage(submodule=compiled, stage_index=i, num_stages=num_stages, device=dev,
                                        group=group, lynx_backend=backend, recompute_in_wait=wait,
                                        scaled_elsewhere=frozenset(ids & held)))
        held |= ids
        modules[i], backends[i] = mod, backend
    sched = schedule_class(schedule)(stages if schedule in MULTI_STAGE_SCHEDULES else stages[0],
                                     n_microbatches=num_microbatches, loss_fn=loss_fn)
    return LocalPipeline(stages=stages, schedule=sched, plan=plan, costs=costs, modules=modules, backends=backends,
                         tied=tied, shapes=shapes, group=group, prefix=prefix, microbatch_plan=mb_plan,
                         stage_variants=variants)


def _check_per_microbatch(schedule: str, memory_per_device: int | None, method: str, plan, costs) -> None:
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        raise StagePlanError(f"per_microbatch=True plans recompute per micro-batch over a zero-bubble schedule's "
                             f"timeline; use schedule='ZBVZeroBubble' or 'InterleavedZeroBubble' (got {schedule!r})")
    if memory_per_device is None:
        raise StagePlanError("per_microbatch=True needs memory_per_device: without a limit nothing is recomputed")
    if method != "lynx":
        raise StagePlanError(f"per_microbatch=True needs method='lynx' (got {method!r}): the variants come from "
                             "the recompute curves lynx's stage plan is priced with")
    if plan is not None and costs is None:
        raise StagePlanError("per_microbatch=True with plan= also needs costs=: the PipelineCosts the plan was "
                             "made from (plan_pipeline returns both), which price each stage's variants")


def _plan_microbatches(plan: StagePlan, costs: PipelineCosts, ranks: int, options: dict[str, Any]):
    """The stages' variants and the per-(stage, micro-batch) choice among them."""
    from .microbatch_plan import MicrobatchPlanError, plan_microbatches
    from .placement import zero_bubble_orders
    from .stage_variants import send_seconds, stage_variants

    variants = stage_variants(plan, costs, ranks=ranks)
    orders = zero_bubble_orders(plan.schedule, ranks, plan.num_stages, plan.num_microbatches)
    solver = options.get("solver", "auto")
    try:
        mb_plan = plan_microbatches(orders, variants.variants, send_seconds(plan, costs), variants.memory_limit,
                                    solver=solver, progress=lambda line: log.info("lynx: %s", line))
    except MicrobatchPlanError as e:
        raise StagePlanError(f"no per-micro-batch choice of the stages' variants fits memory_per_device="
                             f"{plan.memory_per_device} B on every rank: {e}. Give each device more memory, "
                             "use more stages, or smaller micro-batches.") from e
    return variants, mb_plan


def _per_microbatch_backend(stage_opts: dict[str, Any], budgets, choice):
    """A ``PerMicrobatchBackend`` over one lynx backend per variant (``memory_budget`` None: policy none)."""
    from lynx_compile.compiler.dynamo_backend import LynxBackend
    from lynx_compile.config import make_config
    from lynx_compile.runtime.per_microbatch import PerMicrobatchBackend

    backends = []
    for budget in budgets:
        opts = dict(stage_opts)
        if budget is None:
            opts.pop("memory_budget", None)
            opts["policy"] = "none"
        else:
            opts["memory_budget"] = int(budget)
        backends.append(LynxBackend(make_config(opts), plan_pieces=False))
    return PerMicrobatchBackend(backends, dict(enumerate(choice)))
