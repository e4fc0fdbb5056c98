"""The ``lynx`` torch.compile backend.

``torch.compile(model, backend="lynx", options={...})`` reaches :func:`lynx_backend` through the
``torch_dynamo_backends`` entry point; :func:`backend` returns the same backend with options
bound. Both are aot_autograd with lynx's ``partition_fn`` (``lynx_compile.partition``).
"""
from __future__ import annotations

import functools
import itertools
import logging
import threading
from typing import Any, Callable

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.config import LynxConfig, make_config
from lynx_compile.partition import lynx_partition
from lynx_compile.passes import GraphRecord

log = logging.getLogger("lynx_compile")
_graph_ids = itertools.count()


class PlanningDone(Exception):
    """Raised by a ``plan_only`` backend once the graph is partitioned and planned."""


class LynxBackend:
    """A dynamo backend with a bound :class:`LynxConfig`.

    ``records`` holds one :class:`GraphRecord` per compiled graph (a model with graph breaks
    gives several), each with its ``plan``: what was saved and recomputed and the predicted
    memory. ``plans`` is the list of those plans."""

    def __init__(self, config: LynxConfig, *, plan_only: bool = False):
        _compat.check_torch_version()
        self.config = config
        self.plan_only = plan_only
        self.records: list[GraphRecord] = []
        self._lock = threading.Lock()
        self._warned_breaks = False
        if config.verbose:
            _log_to_stderr()

    @property
    def plans(self) -> list:
        return [r.plan for r in self.records if r.plan is not None]

    def __repr__(self) -> str:
        return f"LynxBackend(policy={self.config.policy!r}, graphs={len(self.records)})"

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        if kwargs.get("options"):
            raise ValueError("options were bound already; pass them to lynx_compile.backend(...) "
                             "or to torch.compile(..., backend='lynx', options=...), not both")
        with self._lock:
            record = GraphRecord(graph_id=next(_graph_ids), policy=self.config.policy)
            self.records.append(record)
            if len(self.records) == 2 and not self._warned_breaks:
                self._warned_breaks = True
                log.warning("lynx: compiling more than one graph with these options (graph breaks, "
                            "recompiles, or another model); each graph gets its own plan, listed in "
                            "backend.records. TORCH_LOGS=graph_breaks shows why dynamo split a model.")
        partition_fn = functools.partial(lynx_partition, config=self.config, record=record)
        compiler = self._compiler
        extra = {}
        if self.config.compiler == "inductor":  # Inductor lowers only its own decomposed aten
            extra["decompositions"] = _compat.inductor_decompositions()
        return _compat.aot_autograd(fw_compiler=compiler, bw_compiler=self._bw_compiler,
                                    inference_compiler=compiler,
                                    partition_fn=partition_fn, **extra)(gm, example_inputs)

    def _bw_compiler(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        """The backward, reporting its outputs (gradients) to a running memory measurement."""
        from lynx_compile.memory.measure import record_backward_outputs

        if self.config.trace_recompute:
            from lynx_compile.passes.trace_ranges import trace_ranges_pass

            trace_ranges_pass(gm)
        inner = self._compiler(gm, example_inputs)

        def run(args: list) -> Any:
            out = inner(args)
            record_backward_outputs(out)
            return out

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def _compiler(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        if self.plan_only:  # the partition (and so the plan) is done; nothing needs to run
            raise PlanningDone()
        if self.config.compiler == "inductor":
            return _compat.inductor_compile(gm, example_inputs)
        return _compat.boxed(gm)


def _log_to_stderr() -> None:
    """``verbose=True`` / ``LYNX_DEBUG=1``: show lynx's INFO lines (one per graph decision)."""
    log.setLevel(logging.INFO)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)


@functools.lru_cache(maxsize=None)
def _cached_backend(config: LynxConfig) -> LynxBackend:
    return LynxBackend(config)


def backend(**options: Any) -> LynxBackend:
    """The lynx backend with ``options`` bound (same keys as ``torch.compile(options=...)``).

    Identical options return the same backend object, so
    ``lynx_compile.backend(policy="full").records`` also shows what
    ``torch.compile(m, backend="lynx", options={"policy": "full"})`` decided."""
    return _cached_backend(make_config(options))


def lynx_backend(gm: fx.GraphModule, example_inputs: list, *, options: dict | None = None,
                 **kwargs: Any) -> Callable:
    """Entry point registered as ``lynx`` in ``torch_dynamo_backends``."""
    if kwargs.get("mode") not in (None, "default"):
        raise ValueError(f"backend 'lynx' takes options=..., not mode={kwargs['mode']!r}")
    return backend(**(options or {}))(gm, example_inputs)
