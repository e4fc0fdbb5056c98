"""The one place lynx reaches into private torch APIs.

Everything here is called by keyword and filtered against the installed signature, because
these helpers change between releases (lynx supports torch 2.11 on the GPU machines and 2.13
here). When a helper moves, only this file changes.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._functorch import config as _functorch_config
from torch._functorch import partitioners as _partitioners
from torch.utils.checkpoint import CheckpointPolicy

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
SUPPORTED_TORCH = ((2, 11), (2, 13))


def check_torch_version() -> None:
    """Raise a clear error when the installed torch is outside the supported range."""
    lo, hi = SUPPORTED_TORCH
    if not (lo <= TORCH_VERSION <= hi):
        raise RuntimeError(
            f"lynx_compile supports torch {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}, found {torch.__version__}; "
            f"install a supported build first, e.g. `pip install torch==2.13.0`."
        )


def _call_by_keyword(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` passing only the keyword arguments its installed signature accepts."""
    params = inspect.signature(fn).parameters
    accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not accepts_var_kw:
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def aot_autograd(**kwargs: Any) -> Any:
    """``torch._dynamo.backends.common.aot_autograd`` (stable across 2.11-2.13)."""
    from torch._dynamo.backends.common import aot_autograd as _aot

    return _aot(**kwargs)


def default_partition(joint_gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                      static_lifetime_input_indices: list[int] | None = None):
    """torch's default partitioner. With ``node.meta["recompute"]`` tags it is the
    selective-activation-checkpoint partitioner: tagged nodes are recomputed, untagged
    producers of tagged nodes are saved, recomputed RNG ops replay their saved RNG state."""
    return _call_by_keyword(
        _partitioners.default_partition, joint_gm, joint_inputs,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
    )


def min_cut_partition(joint_gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                      static_lifetime_input_indices: list[int] | None = None,
                      memory_budget: float = 1.0):
    """torch's min-cut partitioner with ``activation_memory_budget`` set for this call only."""
    with _functorch_config.patch(activation_memory_budget=float(memory_budget)):
        return _call_by_keyword(
            _partitioners.min_cut_rematerialization_partition, joint_gm, joint_inputs,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )


def forward_node_names(joint_gm: fx.GraphModule) -> set[str]:
    """Names of the joint-graph nodes traced in the forward.

    aot_autograd traces the forward first and appends the backward, whose first node reads a
    tangent (named ``tangents_*``). Forward nodes are the ones before that point that do not
    depend on a tangent. This includes values only the backward reads (e.g. the ``detach`` of a
    softmax output saved by autograd), which torch's ``classify_nodes`` leaves unclaimed, and
    excludes backward-generated nodes that happen not to read a tangent (``t(weight)``)."""
    backward: set[fx.Node] = set()
    forward: set[str] = set()
    seen_backward = False
    for node in joint_gm.graph.nodes:
        if (node.op == "placeholder" and str(node.target).startswith("tangents")) or any(
                a in backward for a in node.all_input_nodes):
            backward.add(node)
            seen_backward = seen_backward or node.op != "placeholder"
        elif not seen_backward and node.op != "output":
            forward.add(node.name)
    return forward


def is_sym_node(node: fx.Node) -> bool:
    from torch.fx.experimental.proxy_tensor import is_sym_node as _is_sym

    return bool(_is_sym(node))


def tag_recompute(node: fx.Node, group: int) -> None:
    """Tag a joint-graph node for recomputation in checkpoint region ``group``.

    Consecutive regions with different ids keep their boundary tensor saved (torch's
    ``cleanup_recompute_tags``), which is how each block input stays saved under ``full``."""
    node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    node.meta["ac_graph_id"] = group


def is_recompute_tagged(node: fx.Node) -> bool:
    return node.meta.get("recompute") in (
        CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def boxed(gm: fx.GraphModule) -> Callable[[list], Any]:
    """Compile ``gm`` to a Python function with the boxed calling convention.

    The generated code takes one list and clears it, so saved activations passed to the
    backward are freed at their last use instead of living until the backward returns."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def inductor_decompositions() -> dict:
    """The decomposition table Inductor expects its aten graphs to be traced with."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_compile(gm: fx.GraphModule, example_inputs: list) -> Callable:
    """Compile an aten-level fw/bw graph with Inductor (``compile_fx_inner``)."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs)


def node_is_random(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and hasattr(target, "tags")
            and torch.Tag.nondeterministic_seeded in target.tags)


def is_rng_replay(node: fx.Node) -> bool:
    """A backward node that re-runs an RNG op from its saved state (``run_with_rng_state``)."""
    return node.target is getattr(torch._prims.rng_prims, "run_with_rng_state", None)


@contextlib.contextmanager
def eager_dispatch():
    """Run real ops at eager speed from inside a compile.

    aot_autograd calls the partitioner with the Python dispatcher enabled and its fake mode on
    the mode stack; real ops run under them cost ~100 us of Python each (measured: a 256x64x192
    mm took 150 us inside the partitioner, 35 us outside). Measured costs must not include that."""
    from torch._dispatch.python import no_python_dispatcher
    from torch.utils._python_dispatch import _disable_current_modes

    with no_python_dispatcher(), _disable_current_modes():
        yield
