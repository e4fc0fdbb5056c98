"""The exceptions lynx raises to its callers (plain classes; no other lynx module imported
but ``_compat``, so any module may raise them without an import cycle). ``BudgetError`` (a budget
no plan reaches) lives with the decision record, ``lynx_compile.decisions``."""
from __future__ import annotations

from lynx_compile import _compat


class PlanningDone(Exception):
    """Raised by a ``plan_only`` backend once the graph is partitioned and planned."""


class LynxOptionError(ValueError, _compat.dynamo_passthrough_error()):
    """A bad lynx option. A ``ValueError``; raised from the backend, dynamo passes it on as is
    (not wrapped in ``BackendCompilerFailed``) under a traceback of the user's frames and the line
    that raised it, so lynx's message is the one the user reads."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)


_SHOWN: dict[type, type] = {}


def shown_as_raised(error: BaseException) -> BaseException:
    """``error`` made an instance of a subclass of its own class that dynamo re-raises as is
    (``_compat.dynamo_passthrough_error``): raised from the backend, the user reads lynx's message
    (a refused budget: the fix first) under a traceback of their own frames and the one that raised
    it, instead of torch's ``BackendCompilerFailed`` with ~100 lines of dynamo's, AOTAutograd's and
    Inductor's frames. ``except BudgetError`` and its attributes hold as before; the message
    stays lynx's one line (dynamo ends it with a newline)."""
    base = _compat.dynamo_passthrough_error()
    if isinstance(error, base):
        return error
    cls = type(error)
    sub = _SHOWN.get(cls)
    if sub is None:
        sub = _SHOWN[cls] = type(cls.__name__, (cls, base), {"__module__": cls.__module__,
                                                             "__qualname__": cls.__qualname__})
    # the traceback starts where lynx raised it (torch's frames between the backend and that
    # point, AOTAutograd's and Inductor's, are dynamo's to strip: TORCHDYNAMO_VERBOSE=1 keeps them)
    error.__class__ = sub
    return error


def without_tracebacks(error: BaseException) -> BaseException:
    """``error`` with its traceback and those of the exceptions it was raised from or during
    cleared, to be kept past the ``except`` block (a refusal deferred to the step's end, a
    failure handed to the next candidate). A kept traceback keeps every frame it went through
    alive, and each frame its caller's: up to dynamo's ``compile_wrapper``, whose result is the
    model's output of the call that compiled the graph. Kept in a local of a frame on its own
    traceback, it is a cycle only the garbage collector frees: HF Llama's logits and KV-cache
    tensors of step 1 (+136 KB on a 2-layer model) stayed alive through step 1's backward."""
    stack, seen = [error], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        stack += [e.__cause__, e.__context__]
    return error
