"""lynx's partition inside Inductor's own pipeline (``compiler="inductor"``, the default).

::

    dynamo graph ─compile_fx─▶ aot_autograd joint graph
        ─Inductor joint passes (RNG → inductor_random(seeds), pattern rewrites)─▶
        LynxPartitioner = lynx_partition(base = torch's min-cut) ─▶ (fw, bw)
        ─Inductor post-grad passes, scheduling, fused Triton / C++ codegen─▶ compiled step

``torch._inductor.config.custom_partitioner_fn`` replaces only the partition step: everything
``torch.compile`` does before and after it runs unchanged, so lynx's graphs are compiled exactly
as torch.compile's own. Two consequences:

* **RNG.** Inductor's ``replace_random`` joint pass has already rewritten every dropout into
  ``inductor_random(shape, inductor_lookup_seed(inductor_seeds(n), i))``. lynx never recomputes
  ``inductor_seeds`` (``passes.policies._recomputable``), so it is saved and every recomputed
  random op draws the forward's numbers. lynx creates no new RNG ops after the joint passes.
* **Caching.** AOTAutograd's cache is off while lynx compiles
  (``_compat.inductor_compile_with_partitioner``): a hit would skip the partitioner and leave
  the backend's ``records`` without a plan. Inductor's kernel and FX-graph caches stay on (they
  key on the partitioned graphs, after lynx decided). ``uuid()`` is None.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.config import LynxConfig
from lynx_compile.passes import GraphRecord


class LynxPartitioner(_compat.inductor_partitioner_base()):
    """The partitioner Inductor calls with its joint graph: lynx's decisions, min-cut base.

    ``plan_only``: stop the compile (``PlanningDone``) once the plan is in ``record``, so
    ``lynx plan`` plans exactly the graph a training run compiles (same joint passes, same
    graph hash for ``options={"plan": ...}``)."""

    def __init__(self, config: LynxConfig, record: GraphRecord, *, plan_only: bool = False):
        self.config = config
        self.record = record
        self.plan_only = plan_only

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        from lynx_compile.backend import PlanningDone
        from lynx_compile.partition import lynx_partition

        fw, bw = lynx_partition(gm, joint_inputs, config=self.config, record=self.record, **kwargs)
        if self.plan_only:
            raise PlanningDone()
        return fw, bw

    def uuid(self) -> None:
        return None
