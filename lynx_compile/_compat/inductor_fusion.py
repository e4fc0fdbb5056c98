"""Which horizontal fusions Inductor's scheduler may make in lynx's own placements: all but
those of a kernel lynx recomputes in the backward with an independent kernel sharing less than
1 MiB of reads (``RECOMPUTE_FUSION_SHARED_BYTES``).

Horizontal fusion puts two kernels with no producer/consumer relation into one, which runs once
both kernels' inputs are ready. Inductor proposes it for kernels reading a common buffer, however
small. In a recomputing backward that moves a recompute away from where lynx's partition put it:

- the causal mask, read by every block's softmax, made block 0's recomputed softmax one kernel
  with block 1's, so block 0's recompute ran while block 1's activations were alive (gpt-tiny,
  CPU, policy full: batch 1, 403 KB measured, 214 KB predicted; batch 8, 1.18x the prediction);
- HF Llama's recomputed ``silu(gate) * up`` fused with its block's gradient ``dh * silu(gate)``
  (both read gate) waited for the matmul ``dh``, holding gate, up and dh together (2 layers,
  batch 2, full: 1.05x the prediction with only cross-block fusions refused).

Until 2026-11-27 lynx refused every horizontal fusion sharing less than 1 MiB
(``score_fusion_memory_threshold``); the rule here keeps Inductor's default for kernels that are
not recomputed, which is every kernel of torch.compile's own partitions. Vertical fusions are
untouched. Fusions sharing at least 1 MiB stay allowed, as lynx's memory model fuses them
(``memory.inductor_model.fused_order``: a SwiGLU backward's kernels reading the same gate and up).

:func:`refusing_recompute_fusion` wraps an ``inner_compile`` of ``compile_fx`` (it runs for the
forward and for the backward, which AOTAutograd compiles lazily at the first backward) so that,
while it compiles, Inductor's choices handler (``V.choices``) refuses those fusions and otherwise
answers as the handler in place before (Inductor's own, or a user's)::

    scheduler.can_fuse(n1, n2) -> [independent] V.choices.can_fuse_horizontal(scheduler, n1, n2, shared)
                                   = False if shared < 1 MiB and n1 or n2 lowers a recomputed FX node
                                     else the previous handler's answer

Torch APIs used, in 2.13 and 2.11 (checked in 2.11.0: the same ``can_fuse_horizontal``
signature, ``V.set_choices_handler`` present; ``.ci/smoke_torch211.sh`` compiles lynx's
placements there): ``torch._inductor.virtualized.V.choices`` and ``V.set_choices_handler`` (a context manager
restoring the previous handler), the scheduler's ``V.choices.can_fuse_horizontal(scheduler,
node1, node2, shared_data_score)``, a scheduler node's ``get_nodes()`` and each one's
``node.origins`` (the FX nodes it was lowered from, carrying lynx's ``node.meta``).

Not in Inductor's FX-graph cache key: lynx compiles its placements with the rule always (and
with ``post_grad_custom_post_pass`` keyed on lynx's passes), other compiles never; a test or a
benchmark that compiles one graph with and without it turns the cache off or uses a cold one."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

RECOMPUTED_KEY = "lynx_recomputed"
"""``passes.meta.RECOMPUTED`` (a ``_compat`` module imports nothing of lynx's passes)."""


def _origins(snode: Any) -> list:
    """The FX nodes a (possibly fused) scheduler node was lowered from."""
    out = []
    for sub in snode.get_nodes():
        ir = getattr(sub, "node", None)
        out.extend(getattr(ir, "origins", None) or ())
    return out


RECOMPUTE_FUSION_SHARED_BYTES = 1 << 20
"""Bytes of reads a recomputed kernel must share with an independent kernel to be fused with it
(lynx's memory model, ``memory.inductor_model.fused_order``, fuses at this size: a SwiGLU
backward's kernels reading the same gate and up, a recomputed ``silu(gate) * up`` among them)."""


def refuses_horizontal_fusion(node1: Any, node2: Any, shared_data_score: int = 0) -> bool:
    """True when the independent scheduler nodes ``node1`` and ``node2`` must stay apart: one
    of them was lowered from a node lynx recomputes in the backward and they share fewer than
    :data:`RECOMPUTE_FUSION_SHARED_BYTES` of reads (``shared_data_score``, Inductor's count). A
    fusion without a recompute is Inductor's to decide."""
    if shared_data_score >= RECOMPUTE_FUSION_SHARED_BYTES:
        return False
    return any(n.meta.get(RECOMPUTED_KEY) for n in _origins(node1) + _origins(node2))


class _KeepRecomputeApart:
    """A choices handler: ``can_fuse_horizontal`` refuses :func:`refuses_horizontal_fusion`'s
    fusions, everything else is the wrapped handler's."""

    def __init__(self, inner: Any):
        self._inner = inner

    def can_fuse_horizontal(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        if refuses_horizontal_fusion(node1, node2, shared_data_score):
            return False
        return self._inner.can_fuse_horizontal(scheduler, node1, node2, shared_data_score)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def refusing_recompute_fusion(inner_compile: Callable) -> Callable:
    """``inner_compile`` (``compile_fx_inner`` or a wrapper of it) running with Inductor's
    choices handler refusing :func:`refuses_horizontal_fusion`'s fusions; the handler before is
    restored when it returns (also on an error), so no other compile sees the rule."""
    from torch._inductor.virtualized import V

    @functools.wraps(inner_compile)
    def compile_keeping_recompute_apart(*args: Any, **kwargs: Any) -> Any:
        with V.set_choices_handler(_KeepRecomputeApart(V.choices)):
            return inner_compile(*args, **kwargs)

    return compile_keeping_recompute_apart


class CompiledKernels:
    """What one Inductor compile generated: ``graph`` (the FX graph it lowered, after its
    post-grad passes) and ``kernels``: per scheduler node in run order, the names of the FX nodes
    it was lowered from and whether it is a loop kernel (not an extern kernel: a matmul, a
    fallback)."""

    def __init__(self, graph: Any, kernels: list[tuple[frozenset[str], bool]]):
        self.graph, self.kernels = graph, kernels


@contextlib.contextmanager
def recording_kernels():
    """Yields a list that receives a :class:`CompiledKernels` for every graph Inductor compiles
    inside the block (the forward and, once it runs, the backward). Reads the scheduler's nodes
    when it generates code (``Scheduler.codegen``, torch 2.11-2.13): fusion is done by then."""
    from torch._inductor import scheduler as _scheduler
    from torch._inductor.virtualized import V

    seen: list[CompiledKernels] = []
    original = _scheduler.Scheduler.codegen

    def codegen(self: Any) -> Any:
        kernels = []
        for snode in self.nodes:
            names = frozenset(n.name for n in _origins(snode) if getattr(n, "op", None) == "call_function")
            extern = isinstance(snode, _scheduler.ExternKernelSchedulerNode)
            if names:
                kernels.append((names, not extern and not isinstance(snode, _scheduler.NopKernelSchedulerNode)))
        seen.append(CompiledKernels(V.graph.graph, kernels))
        return original(self)

    _scheduler.Scheduler.codegen = codegen
    try:
        yield seen
    finally:
        _scheduler.Scheduler.codegen = original
