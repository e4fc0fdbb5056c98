"""Pipeline parallelism with recompute-aware stages: ``lynx_compile.pipeline(...)``.

::

    model ─profile_pipeline─▶ PipelineCosts ─plan_stages─▶ StagePlan (cuts, per-stage budgets)
      │                                                        │
      └─ torch pipeline() split at the cuts ◀──────────────────┘
             │ local stage(s)
             ▼
      torch.compile(stage, backend=lynx(memory_budget=stage allowance, recompute_in_wait))
             │ (in place, stage.compile(...), for the zero-bubble schedules)
             ▼
      LynxPipelineStage ──▶ torch schedule (GPipe / 1F1B / Interleaved1F1B /
                            ZBVZeroBubble / InterleavedZeroBubble: lynx splits each backward into B and W)

Every rank traces and plans the whole model (deterministically, from the same costs: rank 0's
when measured) and builds only its own stages.

The stage planner (``plan_stages`` and the modules it stands on, plain data in and out) and the
schedule simulator (``schedule_sim``) import without torch, so that ``lynx_compile.sim`` can
build on them: the package loads ``pipeline``, ``plan_pipeline``, ``LocalPipeline`` and
``profile_pipeline`` (torch.distributed, tracing) on first use, as ``lynx_compile`` loads its
names.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lynx_compile._lazy import lazy_names

from .pipeline_costs import PipelineCosts
from .plan_stages import plan_stages
from .stage_plan import StagePlan, StagePlanError

#: public name -> the module that defines it, loaded on first use
_LAZY = {
    "LocalPipeline": "lynx_compile.pipelining.local_pipeline",
    "pipeline": "lynx_compile.pipelining.local_pipeline",
    "plan_pipeline": "lynx_compile.pipelining.local_pipeline",
    "profile_pipeline": "lynx_compile.pipelining.profile",
}

__all__ = ["LocalPipeline", "PipelineCosts", "StagePlan", "StagePlanError", "pipeline", "plan_pipeline",
           "plan_stages", "profile_pipeline"]

if TYPE_CHECKING:
    from .local_pipeline import LocalPipeline, pipeline, plan_pipeline
    from .profile import profile_pipeline


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
