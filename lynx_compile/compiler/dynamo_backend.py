"""The ``lynx`` torch.compile backend.

``torch.compile(model, backend="lynx", options={...})`` reaches :func:`lynx_backend` through the
``torch_dynamo_backends`` entry point; :func:`backend` returns the same backend with options
bound. With ``compiler="inductor"`` (the default) the graph goes through Inductor's own
``compile_fx`` with lynx's partition in place of min-cut (``lynx_compile.compiler.inductor_partition``); with
``compiler="eager"`` it is aot_autograd with lynx's ``partition_fn`` and the partitioned graphs
run op by op (the exact reference and debug path, and what side streams / recompute-in-wait
need).
"""
from __future__ import annotations

import functools
import itertools
import logging
import sys
import threading
from typing import Any, Callable

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.caches import autograd as autograd_cache
from lynx_compile.caches.source_digest import lynx_source_digest
from lynx_compile.compiler.eager_compile import EagerCompile
from lynx_compile.compiler.progress import Progress
from lynx_compile.config import OPTIONS_ENV, LynxConfig, make_config, options_from_env
from lynx_compile.decisions import BudgetError, CandidateKey
from lynx_compile.errors import LynxOptionError, shown_as_raised, without_tracebacks
from lynx_compile.memory import optimizer_state
from lynx_compile.memory.resident import resident_bytes
from lynx_compile.passes import GraphRecord, check_pass_names, graph_budget
from lynx_compile.runtime.step_runtimes import StepRuntimes

log = logging.getLogger("lynx_compile")
_graph_ids = itertools.count()
# torch.compile(m) with Inductor imports Inductor's compiler when torch.compile is called; this
# module is loaded at that point too (torch.compile looks the "lynx" entry point up), so lynx,
# which compiles through it by default, pays the import there as well, not in the first step.
_compat.load_inductor_compiler()


def find_backend_error(e: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The ``kind`` exception a lynx backend raised, found under dynamo's wrappers
    (``BackendCompilerFailed.inner_exception``, ``__cause__``, ``__context__``); None if absent."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, kind):
            return inner
        e = e.__cause__ or e.__context__
    return None


def runs_as_pieces(config: LynxConfig) -> bool:
    """Whether a compile under ``config`` runs each graph as a ``step.piece.Piece``, the step's
    pieces planned together (``step.recorder``): policy lynx under a budget."""
    return config.policy == "lynx" and config.budget is not None


class LynxBackend:
    """A dynamo backend with a bound :class:`LynxConfig`.

    ``records`` holds one :class:`GraphRecord` per compiled graph (a model with graph breaks
    gives several), each with its ``plan``: what was saved and recomputed and the predicted
    memory. ``plans`` is the list of those plans. ``plan_pieces``: with policy lynx under a
    budget, plan the graphs of a model compiled in pieces together on the recorded step
    (``lynx_compile.step.recorder``); lynx's pipeline stages, sized by the pipeline planner, turn it
    off."""

    def __init__(self, config: LynxConfig, *, plan_only: bool = False, plan_pieces: bool = True):
        _compat.check_torch_version()
        self.config = config
        self.plan_only = plan_only
        self.records: list[GraphRecord] = []
        self.runtimes = StepRuntimes()
        """What the compiled graphs run with besides their code (prefetch, side-stream runners,
        weight deferrals), for the caller that drives micro-batches (``runtime.step_runtimes``)."""
        self.eager = EagerCompile(config, self.runtimes, plan_only=plan_only)  # compiler="eager" (and meta-device models)
        from lynx_compile.distributed.agreement import WORLD

        self.planning_group = WORLD
        """Ranks compiling the same graphs (see ``distributed.agreement.planning_group``)."""
        self._lock = threading.Lock()
        self._warned_breaks = False
        self.step_recorder = None
        """Plans the compiled pieces of one step together (``lynx_compile.step.recorder``): with
        policy lynx under a budget, when the model runs as several compiled graphs."""
        self.runs_pieces = plan_pieces and runs_as_pieces(config)
        """Each graph runs as a ``step.piece.Piece`` (under the step recorder); a plan-only backend
        plans the graphs such a compile would make (their gradients returned where ``.grad`` is
        None: ``memory.grad_in_graph.decide``), so ``lynx plan`` names what ``torch.compile`` does."""
        if self.runs_pieces and not plan_only:
            from lynx_compile.step.recorder import StepRecorder

            self.step_recorder = StepRecorder(self)
        if config.verbose:
            _log_to_stderr(solver_log=True)

    @property
    def plans(self) -> list:
        return [r.plan for r in self.records if r.plan is not None]

    def __repr__(self) -> str:
        return f"LynxBackend(policy={self.config.policy!r}, graphs={len(self.records)})"

    def __call__(self, gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        if kwargs.get("options"):
            raise LynxOptionError("options were bound already; pass them to lynx_compile.backend(...) "
                                  "or to torch.compile(..., backend='lynx', options=...), not both")
        with self._lock:
            record = GraphRecord(graph_id=next(_graph_ids), policy=self.config.policy)
            self.records.append(record)
            if len(self.records) == 2 and not self._warned_breaks:
                self._warned_breaks = True
                log.warning("lynx: compiling more than one graph with these options (graph breaks, "
                            "recompiles, or another model); each graph gets its own plan, listed in "
                            "backend.records. TORCH_LOGS=graph_breaks shows why dynamo split a model.")
        from lynx_compile.memory import grad_in_graph

        # (a graph run as a Piece may return its gradients while .grad is None: compiled again with
        # them in the graph at the first call that finds .grad kept)
        record.grads_in_graph = grad_in_graph.decide(self.config, example_inputs, switchable=self.runs_pieces)
        if self.step_recorder is not None:
            # an activation with gradients comes in: the graph is a piece of a model compiled in
            # pieces (per block, after a graph break), whatever modules it holds
            record.takes_activations = any(isinstance(t, torch.Tensor) and t.requires_grad
                                           and not isinstance(t, torch.nn.Parameter) for t in example_inputs)
            record.provisional = not self.plan_only
            record.new_grad_bytes = sum(t.untyped_storage().nbytes() for t in example_inputs
                                        if isinstance(t, torch.nn.Parameter) and t.requires_grad and t.grad is None)
        from lynx_compile.distributed.fsdp import comm_of

        fsdp = comm_of(example_inputs)  # FSDP2's collectives around this graph's backward
        record.fsdp = fsdp.as_tuple() if fsdp is not None else None
        hint_key = None
        if self.step_recorder is not None and not record.takes_activations and not self.plan_only:
            from lynx_compile.step import hint as step_hint

            # a whole graph beside other compiled graphs: the lower peak the step's plan gave it
            # in an earlier run, planned at once (lynx_compile.step.hint)
            hint_key = step_hint.key(gm, example_inputs, self.config)
            record.step_choice = step_hint.load(hint_key)
            if record.step_choice is not None:
                log.info("lynx plan cache: step hint %s: graph %d planned within its peak %s at once, as the "
                         "step's plan across graphs chose in an earlier run", hint_key[:12], record.graph_id,
                         record.step_choice.plan_within)
        try:
            with Progress(f"graph {record.graph_id} ({len(gm.graph.nodes)} nodes): tracing, planning and compiling"):
                compiled = self._compile(gm, example_inputs, record)
        except BudgetError as e:
            if record.step_choice is None:  # a first compile: its refusal left to the step where it can be
                compiled = self._deferred(gm, example_inputs, record, e)
                if compiled is None:
                    raise shown_as_raised(e)  # the refusal as lynx words it, not wrapped by dynamo
            else:
                log.warning("lynx plan cache: step hint %s no longer applies to graph %d (%s); planning it as a "
                            "first compile does", hint_key[:12], record.graph_id, e)
                record.step_choice = None
                compiled = self._compile(gm, example_inputs, record)
        if hint_key is not None:
            record.stats["step_hint_key"] = hint_key
        if self.step_recorder is None:
            return compiled
        from lynx_compile.step.piece import InputSpec

        devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
        return self.step_recorder.piece(compiled, record, functools.partial(self._rebuild, gm, InputSpec(example_inputs)),
                                        device_type="cuda" if "cuda" in devices else "cpu",
                                        # (whose optimizer state device_budget counts)
                                        params=tuple(t for t in example_inputs if isinstance(t, torch.nn.Parameter))
                                        if self.config.device_budget is not None else (),
                                        returned=tuple(t for t in example_inputs if isinstance(t, torch.nn.Parameter)
                                                       and t.requires_grad)
                                        if record.grads_in_graph.returned_while_none else ())

    def _deferred(self, gm: fx.GraphModule, example_inputs: list, record: GraphRecord,
                  refusal: BudgetError) -> Callable | None:
        """A whole graph whose budget is out of reach on its own peak, where the step may hold
        other compiled graphs (a loss compiled apart, torchtitan's trainer): compiled at its
        smallest peak, and the refusal kept for the step to decide (``step.recorder``: raised at
        the end of step 1 when no other graph with choices shares the step; otherwise the step's
        plan across graphs names the step's own smallest budget, the one asking for which is
        accepted). None where the refusal stands at once (no step recorder, a region budget, no
        smallest peak named)."""
        from lynx_compile.recompute.regions import RegionBudgetError

        if (self.step_recorder is None or record.takes_activations or isinstance(refusal, RegionBudgetError)
                or refusal.smallest_bytes is None):
            return None
        record.step_choice = CandidateKey("plan", nbytes=refusal.smallest_bytes)
        try:
            compiled = self._compile(gm, example_inputs, record)
        except BudgetError:
            record.step_choice = None
            return None
        self.step_recorder.defer(record, without_tracebacks(refusal))  # kept: no frames with it
        note = (f"{str(refusal).split('. Use ')[0]}: compiled at its smallest peak ({refusal.smallest_bytes} B) "
                "until the step shows whether other compiled graphs share it (step.recorder): refused at the end "
                "of step 1 if none does")
        record.notes.append(note)
        log.info("lynx: graph %d: %s", record.graph_id, note)
        return compiled

    def _rebuild(self, gm: fx.GraphModule, inputs, old: GraphRecord, choice: CandidateKey | None, *,
                 replace: bool = True, grads_in_graph=None,
                 unbacked_sizes: dict[str, int] | None = None) -> tuple[Callable, GraphRecord]:
        """``gm`` compiled again with candidate ``choice`` (the step's plan, ``step.recorder``;
        None: as a first compile plans it) and ``old``'s gradient regime unless
        ``grads_in_graph`` is given (``step.piece.Piece``: gradient accumulation seen), its
        data-dependent sizes at ``old``'s unless ``unbacked_sizes`` is given (those step 1 ran:
        ``step.sizes``); its record replaces ``old`` in ``records`` (``replace``) or follows it
        (a graph whose calls run two compiles)."""
        record = GraphRecord(graph_id=old.graph_id, policy=self.config.policy, step_choice=choice,
                             takes_activations=old.takes_activations, fsdp=old.fsdp,
                             grads_in_graph=grads_in_graph or old.grads_in_graph, new_grad_bytes=old.new_grad_bytes,
                             provisional=old.provisional and unbacked_sizes is not None,
                             unbacked_sizes=unbacked_sizes if unbacked_sizes is not None else old.unbacked_sizes)
        if "step_hint_key" in old.stats:
            record.stats["step_hint_key"] = old.stats["step_hint_key"]
        from lynx_compile.step import sizes as step_sizes

        why = (f"as the step's plan chose ('{choice}')" if choice is not None
               else f"with the data-dependent sizes step 1 ran ({step_sizes.text(unbacked_sizes)})"
               if unbacked_sizes is not None
               else "with its gradients added into .grad (gradient accumulation seen)")
        with Progress(f"graph {old.graph_id} ({len(gm.graph.nodes)} nodes): planning and compiling again {why}"):
            if self.config.compiler == "inductor" and not self.config.weight_split:
                # dynamo's tracing context is gone: one of our own, so torch's caches serve it
                with _compat.static_tracing(inputs.inputs) as example_inputs:  # (activations: fakes)
                    compiled = self._compile(gm, example_inputs, record)
            else:  # (the eager path's weight deferral holds the real parameters)
                compiled = self._compile(gm, inputs.inputs(), record)
        with self._lock:
            at = next(i for i, r in enumerate(self.records) if r is old)
            self.records[at:at + 1] = [record] if replace else [old, record]
        return compiled, record

    def _compile(self, gm: fx.GraphModule, example_inputs: list, record: GraphRecord) -> Callable:
        config = self.config
        if config.device_budget is not None:  # what is on the device as this graph's step starts
            record.resident = resident_bytes(example_inputs, plan_only=self.plan_only)
            graph_budget(config, record)  # (a BudgetError when they alone fill device_budget)
        on_meta = any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in example_inputs)
        if config.compiler == "inductor" and not on_meta:
            # (Meta-device models — paper-scale planning — take the aot_autograd path below: the
            # same min-cut base, without Inductor's joint passes, which reject meta tensors.)
            return self._compile_inductor(gm, example_inputs, record)
        return self.eager(gm, example_inputs, record, self.planning_group)

    def _compile_inductor(self, gm: fx.GraphModule, example_inputs: list, record: GraphRecord) -> Callable:
        """Inductor's pipeline with lynx's partition (``lynx_compile.compiler.inductor_partition``); Inductor's own
        estimate of the compiled step's peak goes on the plan once the backward is compiled."""
        from lynx_compile.distributed.agreement import planning_group
        from lynx_compile.compiler.inductor_partition import (BufferReuse, CompiledPeak, LynxPartitioner, LynxPostGrad,
                                                              WeightSplitCompile)

        # policy lynx with no budget (and no plan file) keeps torch.compile's own partition: no
        # placement of lynx's to keep, so Inductor runs as in torch.compile (bit for bit: its
        # addmm of a tied weight's two gradients is not split, qwen3's tied embedding)
        config = self.config
        own_placement = config.policy not in ("none", "torch") and not (
            config.policy == "lynx" and config.budget is None and not config.plan)
        split = None
        if config.weight_split and not self.plan_only:
            from lynx_compile.runtime.weight_split import WeightDeferral

            deferral = WeightDeferral([t if isinstance(t, torch.nn.Parameter) else None for t in example_inputs])
            self.runtimes.weight_deferrals.append(deferral)
            split = WeightSplitCompile(deferral)
        # Inductor's estimate reads the forward and one backward; B and W are two graphs
        peak = None if self.plan_only or split is not None else CompiledPeak(record=record)
        key = None
        with planning_group(self.planning_group):
            if not self.plan_only and split is None:
                key = autograd_cache.cache_key(gm, example_inputs, config, record)
            for cached in ((True, False) if key is not None else (False,)):
                partitioner = LynxPartitioner(config, record, plan_only=self.plan_only, peak=peak, cache_key=key)
                hits = _compat.dynamo_counters()["aot_autograd"]["autograd_cache_hit"]
                compiled = _compat.inductor_compile_with_partitioner(
                    gm, example_inputs, partitioner,
                    # torch.compile's kind of partition chosen (the user's tags, a torch min-cut):
                    # reordered for peak memory as torch.compile does
                    keep_placement=own_placement and (lambda: not record.torch_partition),
                    keep_recompute_apart=lambda: record.keep_recompute_apart,
                    post_grad=LynxPostGrad(config, record) if own_placement else None, post_fusion=peak,
                    inner_compile=split, autograd_cache=cached,
                    reuse=BufferReuse(record) if own_placement and config.buffer_reuse else None,
                    source_digest=lynx_source_digest())
                served = _compat.dynamo_counters()["aot_autograd"]["autograd_cache_hit"] > hits
                # served by AOTAutograd's cache, not partitioned: the plan is the one kept
                if not served or partitioner.ran or autograd_cache.restore(record, key):
                    return compiled
        return compiled


# device_budget counts the optimizer state off CUDA (created by the first optimizer.step(), after
# the first compile): every optimizer that steps once this module is loaded (torch.compile with
# backend="lynx" loads it) is remembered, weakly (one set insertion per optimizer.step())
optimizer_state.watch()

class _StderrHandler(logging.StreamHandler):
    """A handler writing to ``sys.stderr`` as it is at each record, not the object it was when
    the handler was installed (pytest's capture, a redirect made later). lynx's messages carry
    their own ``lynx:`` prefix; the format adds none."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ / setStream assign it: ignored
        pass


def _log_to_stderr(solver_log: bool = False) -> None:
    """Show lynx's INFO lines (one per graph decision, MILP progress every few seconds) on
    stderr; ``solver_log``: also the MILP solver's own log (``lynx_compile.solver`` at DEBUG).
    ``verbose=True`` / ``LYNX_DEBUG=1`` and ``lynx plan --verbose`` turn both on. Adds one
    handler, once, unless the application configured its own."""
    log.setLevel(logging.INFO)
    if solver_log:
        logging.getLogger("lynx_compile.solver").setLevel(logging.DEBUG)
    if not log.handlers:
        log.addHandler(_StderrHandler())


@functools.lru_cache(maxsize=None)
def _cached_backend(config: LynxConfig, budget_type: type) -> LynxBackend:
    # budget_type: memory_budget=1 (bytes) and 1.0 (a fraction) are equal configs to Python
    return LynxBackend(config)


def backend(**options: Any) -> LynxBackend:
    """The lynx backend with ``options`` bound (same keys as ``torch.compile(options=...)``).

    Identical options return the same backend object, so
    ``lynx_compile.backend(policy="full").records`` also shows what
    ``torch.compile(m, backend="lynx", options={"policy": "full"})`` decided. Options are
    validated here, before anything compiles: ``LynxOptionError`` (a ``ValueError``) names the
    option and its valid values."""
    try:
        config = make_config(options)
        check_pass_names(config.disable_passes)
    except ValueError as e:
        raise LynxOptionError(str(e)) from None
    return _cached_backend(config, type(config.memory_budget))


def lynx_backend(gm: fx.GraphModule, example_inputs: list, *, options: dict | None = None,
                 **kwargs: Any) -> Callable:
    """Entry point registered as ``lynx`` in ``torch_dynamo_backends``. Without ``options=``
    the options come from ``$LYNX_OPTIONS`` (``lynx_compile.config.options_from_env``: a JSON
    object or the path of a JSON file), for launchers that take only the backend's name; both
    given is a ``LynxOptionError`` (one source of options per compile)."""
    if kwargs.get("mode") not in (None, "default"):
        raise LynxOptionError(f"backend 'lynx' takes options=..., not mode={kwargs['mode']!r}")
    try:
        env_options = options_from_env()
    except ValueError as e:
        raise LynxOptionError(str(e)) from None
    if options and env_options is not None:
        raise LynxOptionError(f"backend 'lynx' got options={options!r} and {OPTIONS_ENV} is set too; "
                              f"unset {OPTIONS_ENV} or drop options=")
    return backend(**(options or env_options or {}))(gm, example_inputs)
