"""The backward pass at run time: the autograd engine's Python entry and its callbacks, and what
AOTAutograd's compiled backward holds (its incoming gradients) and donates (its saved tensors)."""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

import torch

from lynx_compile._compat.versions import TORCH_VERSION


def engine_run_backward_code() -> Any:
    """The code object of the Python function that calls the autograd engine
    (``torch.autograd.graph._engine_run_backward``: ``Tensor.backward`` and ``autograd.grad``
    both go through it), or None where it is not there. Once it returns, the engine has
    restored the thread's state it saved when the backward started."""
    try:
        from torch.autograd.graph import _engine_run_backward

        return _engine_run_backward.__code__
    except (ImportError, AttributeError):
        return None


def backward_roots(frame: Any) -> Any:
    """The roots (tensors or gradient edges) of a backward, from the frame of a call of
    :func:`engine_run_backward_code`'s function (its first argument, ``t_outputs``)."""
    return frame.f_locals.get("t_outputs", ())


def python_backward_code(node: Any) -> Any:
    """The code object of the Python ``backward`` that autograd node ``node`` runs (the
    ``torch.autograd.Function`` it belongs to: AOTAutograd's ``CompiledFunction`` for a compiled
    graph), or None for a node without one. That frame's return is the node's end, seen without a
    post hook (``Node.register_hook``), which makes the engine hold the node's incoming gradients
    until it returns."""
    cls = getattr(node, "_forward_cls", None)
    backward = getattr(cls, "backward", None)
    return getattr(backward, "__code__", None)


def saved_symints(node: Any) -> list | None:
    """The sizes AOTAutograd's compiled forward saved for its backward (``ctx.symints`` of the
    ``CompiledFunction`` whose backward node is ``node``: plain ints at run time, in the order of
    the forward graph's trailing SymInt outputs), or None where the node has none (torch 2.11-2.13
    set it in ``runtime_wrappers``)."""
    values = getattr(node, "symints", None)
    return list(values) if isinstance(values, (list, tuple)) else None


def watch_frame(code: Any, event: str, fn: Callable[[Any], None]) -> bool:
    """Call ``fn(frame)`` at the next ``event`` (``"call"`` or ``"return"``) of a frame running
    ``code`` in this thread, once, through Python's profile hook (which is removed then). False,
    and nothing set, where ``code`` is None or another tool holds the profile hook; the caller
    removes a watch that never fired with ``sys.setprofile(None)``."""
    if code is None or sys.getprofile() is not None:
        return False

    def watch(frame: Any, ev: str, arg: Any) -> None:
        if ev == event and frame.f_code is code:
            sys.setprofile(None)
            fn(frame)

    sys.setprofile(watch)
    return True


def in_backward() -> bool:
    """Whether this thread runs inside autograd's engine (a backward pass)."""
    return torch._C._current_graph_task_id() != -1


def current_autograd_node() -> Any:
    """The autograd node the engine runs now (an ``autograd.Function``'s backward: its context),
    or None outside a backward."""
    return torch._C._current_autograd_node()


def will_engine_execute_node(node: Any) -> bool:
    """Whether the running backward executes ``node`` (False for a leaf's ``AccumulateGrad`` that
    ``backward(inputs=...)`` leaves out); a RuntimeError where ``torch.autograd.grad`` captures
    the leaf's gradient instead."""
    return torch._C._will_engine_execute_node(node)


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass now executing ends (call from inside it: a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


@functools.lru_cache(maxsize=None)
def backward_holds_grad_inputs() -> bool:
    """Whether aot_autograd's ``CompiledFunction.backward`` keeps the incoming output gradients
    (the backward graph's ``tangents_*``) alive until the compiled backward returns.

    torch 2.11 passes them as the ``*flat_args`` tuple of ``backward(ctx, *flat_args)`` and holds
    it for the whole call, so the boxed backward cannot free them at their last use (measured: a
    gpt-tiny step peaks one logits gradient, 64 KiB, above the prediction). torch 2.13's
    generated backward prologue clears ``flat_args`` first (``flat_args.clear()``), so they die
    at their last use like every other input."""
    try:
        from torch._functorch._aot_autograd import runtime_wrappers

        return "flat_args.clear()" not in inspect.getsource(runtime_wrappers)
    except (ImportError, OSError, TypeError):
        return TORCH_VERSION < (2, 13)


def backward_donates_saved() -> bool:
    """Whether AOTAutograd lets Inductor write into the backward's saved tensors once they die
    (``torch._functorch.config.donated_buffer``, on by default in 2.11 and 2.13: the saved
    tensors that alias no forward input or output are ``bw_donated_idxs``)."""
    from torch._functorch import config as functorch_config

    return bool(getattr(functorch_config, "donated_buffer", False))
