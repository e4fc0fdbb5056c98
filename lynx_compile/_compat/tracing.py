"""Tracing outside and beside dynamo: a tracing context of lynx's own (``static_tracing``) and
the unbacked symbols a graph compiled again in it binds, fake modes, eager dispatch from inside
a compile, the dispatch-mode base class, and the exception dynamo passes on as is."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

REGION_BUDGET_KEY: str = getattr(fx_traceback, "MEMORY_BUDGET_ANNOTATION_KEY", "_region_activation_memory_budget")
"""The ``meta["custom"]`` key of torch's per-region activation budget
(``torch.autograd.graph.region_activation_memory_budget``, torch 2.13; the same string where
torch does not define it)."""


def annotate_region(annotation: dict[str, Any]):
    """``torch.fx.traceback.annotate(annotation)``: dynamo puts ``annotation`` in
    ``meta["custom"]`` of every node traced inside it (forward and backward)."""
    return fx_traceback.annotate(annotation)


@contextlib.contextmanager
def static_tracing(example_inputs: list | Callable[[Any], list]):
    """A tracing context like dynamo's, for compiling a graph again outside dynamo (a piece
    recompiled with the step's plan): a fake mode with its own ``ShapeEnv``, and the example
    inputs as fake tensors of static shapes in it (yielded). Without a shape env AOTAutograd's
    and Inductor's caches bypass the compile ("No shape env"); real inputs would be fakified
    with dynamic sizes there, a symbolic compile of another graph. ``example_inputs`` may be a
    function of the fake mode giving them (some already fake tensors of it)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    if callable(example_inputs):
        example_inputs = example_inputs(mode)
    fakes = [t if isinstance(t, FakeTensor) and t.fake_mode is mode
             else mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t
             for t in example_inputs]
    with tracing(TracingContext(mode)):
        yield fakes


def adopt_unbacked_symbols(gm: fx.GraphModule) -> None:
    """Declare the unbacked symbols ``gm``'s nodes bind (``node.meta["unbacked_bindings"]``:
    ``u0``, ``u1``, ... of a ``.tolist()`` / ``.item()``, e.g. expert-parallel token counts) in
    the current tracing context's ``ShapeEnv`` where it lacks them, and number its new ones past
    them. Needed when a dynamo graph is traced again in a ``ShapeEnv`` of its own
    (``static_tracing``: a piece compiled again with the step's plan): the retrace makes new
    symbols and ``rebind_unbacked`` renames each to the name the node recorded, which fails
    when the new one has that name ("u0 possible memo disaster", counters that both start at 0)
    or when the name is unknown to the ShapeEnv (``var_to_range`` None). A no-op in dynamo's
    own ShapeEnv (it made them). Private: ``ShapeEnv.unbacked_symint_counter``,
    ``create_unbacked_symint``, ``var_to_range``, ``pending_fresh_unbacked_symbols`` (torch 2.13)."""
    from torch._guards import TracingContext
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    ctx = TracingContext.try_get()
    env = getattr(getattr(ctx, "fake_mode", None), "shape_env", None)
    if env is None:
        return
    names = {s for n in gm.graph.nodes for s in (n.meta.get("unbacked_bindings") or {})}
    missing = sorted((s for s in names if s not in env.var_to_range and symbol_is_type(s, SymT.UNBACKED_INT)),
                     key=lambda s: int(str(s)[1:]))
    if not missing:
        return
    top = max(int(str(s)[1:]) for s in names if symbol_is_type(s, SymT.UNBACKED_INT))
    for s in missing:
        env.unbacked_symint_counter = int(str(s)[1:])
        made = env.create_unbacked_symint().node.expr
        if made != s:
            raise RuntimeError(f"lynx: cannot declare the unbacked symbol {s} of a graph compiled again "
                               f"(made {made}); compile without the step's plan (budget_scope 'saved')")
        # declared, not the output of an op being traced: nothing is to bind it
        env.pending_fresh_unbacked_symbols[:] = [p for p in env.pending_fresh_unbacked_symbols if p != s]
    env.unbacked_symint_counter = max(env.unbacked_symint_counter, top + 1)


def refuse_unbacked_retrace(gm: fx.GraphModule) -> None:
    """Raise (one line) when ``gm`` binds unbacked symbols and no tracing context is active:
    AOTAutograd would fakify real example inputs without a ``ShapeEnv`` and fail deep inside
    with ``DataDependentOutputException: aten._local_scalar_dense`` (the ``.item()`` /
    ``.tolist()`` that made them). Seen when ``compiler="eager"`` compiles a piece again with
    the step's plan (real inputs, no ``static_tracing``) on expert-parallel MoE."""
    from torch._guards import TracingContext

    if TracingContext.try_get() is not None:
        return
    names = sorted({str(s) for n in gm.graph.nodes for s in (n.meta.get("unbacked_bindings") or {})})
    if names:
        raise NotImplementedError(
            f"lynx: compiler='eager' cannot compile again, for the step's plan, a graph with data-dependent "
            f"sizes (aten._local_scalar_dense: .item()/.tolist(), unbacked {', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}; e.g. expert-parallel token counts); use compiler='inductor' "
            "(the default)")


def is_plain_fake(t: Any) -> bool:
    """``t`` is a plain fake tensor (``FakeTensor``, not a wrapper subclass around fakes such as a
    fake DTensor): dynamo's DDPOptimizer hands each bucket's graph fake parameters."""
    from torch._subclasses.fake_tensor import FakeTensor

    return type(t) is FakeTensor


def detect_fake_mode(values: Any) -> Any:
    """The FakeTensorMode of ``values`` (``torch._guards.detect_fake_mode``), or None."""
    from torch._guards import detect_fake_mode as _detect

    return _detect(values)


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


def dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``, the base class of a mode that sees
    every aten op a forward runs (same module and interface on 2.11 and 2.13)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


@functools.lru_cache(maxsize=None)
def dynamo_passthrough_error() -> type:
    """A subclass of ``torch._dynamo.exc.ShortenTraceback``: an exception a backend raises that
    dynamo re-raises as is (any other is wrapped in ``BackendCompilerFailed``, whose message starts
    with dynamo's text). Its ``first_useful_frame``, where dynamo cuts its own frames off the
    traceback, is the frame that raised it (the last of its traceback; writes are dropped): the
    user reads their own frames, then the line that raised it (``TORCHDYNAMO_VERBOSE=1`` keeps
    every frame). It never holds a ``real_stack`` (reads raise AttributeError, writes are dropped):
    dynamo attaches one to an exception leaving a traced frame (``TracingContext.current_frame``)
    and ``exc.augment_exc_message`` then appends ``from user code`` and a ``TORCHDYNAMO_VERBOSE``
    hint to its message, which is lynx's one line (same on 2.11 and 2.13). One class per process."""
    from torch._dynamo.exc import ShortenTraceback

    class LynxPassthrough(ShortenTraceback):
        @property
        def first_useful_frame(self):
            tb = self.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            return tb.tb_frame if tb is not None else None

        @first_useful_frame.setter
        def first_useful_frame(self, value) -> None:
            pass

        @property
        def real_stack(self):
            raise AttributeError("real_stack")

        @real_stack.setter
        def real_stack(self, value) -> None:
            pass

    return LynxPassthrough
