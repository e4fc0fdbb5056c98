"""Plan the compiled pieces of one training step together, from a recorded step (issue M item 3;
the design: ``docs/budget_pieces.md``; the arithmetic: ``lynx_compile.step.model``).

A model compiled per block (torchtitan's ``apply_compile``) or split by graph breaks runs as
several compiled graphs with eager code between them. Dynamo compiles each lazily, during the
first step, so when a piece is planned nothing is known of the others: each gets a provisional
plan (``decide.decide_piece``: its saved bytes within the budget's fraction of its own). Then:

1. **step 1** runs on the provisional plans (and compiles every piece);
2. **step 2 is recorded** from its start, the call of the module that was outermost when step 1
   called its first piece (``step.memory_marks``: the profiler's allocator events on CPU, the
   allocator's peaks on CUDA), cut at the start and end of every piece call's forward and
   backward, giving each segment's measured peak; lynx knows what the plans that ran
   contribute, the rest is ``outside`` (measured, not modelled: embedding, LM head, loss,
   gradient accumulation);
3. at the end of step 2's backward, one choice per call (``step.model.choose``: a graph called
   several times may take two candidates, split at one call): the least exposed recompute whose
   predicted step peak is within the budget, a fraction being of the same step with every graph
   at no recompute (torch.compile's own per-block step);
4. at the first forward of **step 3**, graphs whose choice changed are compiled again with each
   new candidate (``GraphRecord.step_choice``) and swapped in; ``backend.records`` and the log
   say what changed.

The plan cache keeps the step's plan (keyed by step 1's piece plan keys and the budget): a rerun
takes it at the end of step 1, records nothing and swaps the compiles in at step 2.

Step 1 is not recorded because it compiles (the compiler's own allocations would count as the
step's) and creates ``.grad``. Only the first two steps pay anything: after the re-plan a piece
call is one Python function call more than the compiled graph. With several ranks the
measurements are combined (the highest per segment) so every rank chooses alike.

When no choice fits, lynx raises ``BudgetError`` at step 3 naming the smallest step peak
reachable and what lies outside the compiled pieces (compiling it too is the fix).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import weakref
from typing import Any, Callable

import torch

from lynx_compile import _compat
from lynx_compile.budget import budget_error, format_bytes
from lynx_compile.decisions import BudgetError, CandidateKey
from lynx_compile.memory.param_grads import GradWatch
from lynx_compile.step import cached, device_budget, sizes
from lynx_compile.step.memory_marks import AllocatorRecording, ProfilerRecording
from lynx_compile.step.model import USER, StepChoice, StepModel, choose, recorded
from lynx_compile.step.piece import Piece

log = logging.getLogger("lynx_compile")
RECORDED_STEP = 2
"""Which step is recorded (see the module docstring for why not the first)."""
NOISE = 1000
"""A plan predicted above the budget by at most 1/NOISE of the step's reference is accepted: the
recorded step's measure moves by that little between runs, and a refusal names its budget to the
third digit (``budget.budget_error``), so asking for the named budget is accepted."""


def _backward_node(out: Any) -> Any:
    """The autograd node of a compiled graph's backward among the outputs' ``grad_fn`` (an
    output that is a view of another has a view node above it)."""
    nodes = [t.grad_fn for t in _compat.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for node in nodes + [n for g in nodes for n, _ in g.next_functions if n is not None]:
        if "CompiledFunction" in type(node).__name__ or "CompiledFunction" in node.name():
            return node
    return None


def _activation_bytes(args: tuple) -> int:
    """Bytes of the distinct storages of ``args``' tensors that are activations: not parameters
    and with gradients on (a buffer passed to every block, torchtitan's ``freqs_cis``, was
    allocated before the step; the embedding's output feeding the first block, in it)."""
    seen: dict[int, int] = {}
    for t in _compat.tree_leaves(args):
        if isinstance(t, torch.Tensor) and t.requires_grad and not isinstance(t, torch.nn.Parameter) \
                and t.device.type != "meta":
            local = getattr(t, "_local_tensor", t)  # a DTensor (TP): its shard on this rank
            if type(local) is not torch.Tensor:  # another subclass (an async collective's result): not counted
                continue
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _skipped() -> bool:
    """A call of the step's module its hooks let pass: one dynamo traces (the hooks are lynx's,
    not the model's) or one recomputed inside a backward."""
    return torch.compiler.is_compiling() or _compat.in_backward()


def _with_choices(steps) -> bool:
    """Some graph's ``GraphChoices`` (None for a graph with none) offers more than one candidate:
    there is something to plan together."""
    return any(step is not None and len(step.choices) > 1 for step in steps)


def _users_pick(model: StepModel):
    """Every call compiled as the user's own checkpoint tags (candidate ``USER``), where every
    graph of the step has that candidate; None otherwise."""
    try:
        return model.uniform({g: gc.named(CandidateKey(USER)) for g, gc in model.graphs.items()})
    except KeyError:
        return None


class StepRecorder:
    """One per backend: the step's piece calls, the recording of step ``RECORDED_STEP``, the
    choice and its application."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.pieces: list[Piece] = []
        self.state = "warming"  # -> recording -> ending -> recorded -> done
        self.steps_seen = 0
        self.calls: list[Piece] = []
        self.open: set[int] = set()  # calls whose backward has not ended
        self.marks: list[tuple[int, str]] = []  # (call, fw0 / fw1 / bw0 / bw1 / end)
        self.mark_grads: list[int] = []  # per mark: .grad bytes accumulated into so far (GradWatch)
        self._grads: GradWatch | None = None
        self.grads_note = ""
        self.measured_note = ""
        """The transients of the candidates that ran, where the recording measured them other
        than lynx's memory model (``StepModel.measured``), for the step's log line."""
        self.recorded_peak_bytes: int | None = None
        """The recorded step's peak as this process measured it, once recorded: the highest bytes
        allocated above the step's start (the activation inputs of its first call counted) from
        its first piece call to its backward's end. A tool measuring every step reads it for the
        step lynx recorded, which its own profiler cannot measure (on CPU the recording is a
        profiler: ``step.memory_marks``). It is read as every other step is measured
        (``ProfilerRecording.peak_bytes``: a collective's buffers freed where the allocator freed
        them), not as the step is planned from (held to the next piece boundary, so that runs
        read alike): under gloo that reading is above any measured one (qwen3 under FSDP2, 2
        ranks: 82.08 MB against 74.24 measured at the steps after, session 43)."""
        self._before = 0
        """Bytes the step allocated before the recording started, added to every segment: the
        activation inputs (the embedding's output) of the call it started at, the step's module
        call or its first piece call."""
        self._root: weakref.ref | None = None
        """The module whose call was outermost when step 1 called its first piece: where the
        recorded step starts (``_wait_for_start``)."""
        self._root_hooks: _compat.ModuleCallHooks | None = None
        self._depth = 0  # calls of the root running, while its hooks wait
        self._entered = False  # the outermost of them was one with gradients on: the step's start
        self._from_start = False  # the recording started at the root's call
        self._queued = False
        self._recording: ProfilerRecording | AllocatorRecording | None = None
        self._device_type = "cpu"
        self._resident: tuple[int, str] = (0, "")
        self.model: StepModel | None = None
        self.choice: StepChoice | None = None
        self.budget_bytes: int | None = None
        self._key: str | None = None  # the plan cache's key of the step's plan
        self._cached = False  # the step's plan came from the plan cache
        self._refused: cached.Refusal | None = None  # a refusal from the plan cache
        self.refusals: dict[int, BudgetError] = {}
        """Per graph id: a whole graph's budget refused on its own peak (``defer``)."""
        self._sizes: dict[int, dict[str, int]] = {}
        """Per piece (``Piece.key``): the data-dependent sizes step 1 ran, largest over its calls
        (``step.sizes``), planned with at the start of step 2 (``sizes.plan_again``)."""
        self._sizes_over: set[int] = set()  # pieces said to run sizes above their plan's (check_sizes)
        self._step1: list[Piece] | None = None
        """Step 1's calls, kept where the plan cache's step plan is looked up at the start of step
        2 (after the pieces with data-dependent sizes were planned again with those it ran)."""

    @property
    def tracking(self) -> bool:
        return self.state in ("warming", "recording")

    def records_next_step(self) -> bool:
        """The next step is the one this recorder records (step ``RECORDED_STEP`` or, where a
        profiler ran over that one, the first after it without one): some piece has choices. On
        CPU it runs under lynx's profiler, and a tool measuring it reads ``recorded_peak_bytes``
        (``step.measured_peak``). A step plan taken from the plan cache as the step starts
        records nothing: ``recorded_peak_bytes`` stays None."""
        return self._recording_due() and _with_choices(p.record.step for p in self.pieces)

    def _recording_due(self) -> bool:
        """Step ``RECORDED_STEP`` or later is next, and none has been recorded yet."""
        return self.state == "warming" and self.steps_seen + 1 >= RECORDED_STEP

    def piece(self, compiled: Callable, record: Any, rebuild: Callable, device_type: str,
              params: tuple = (), returned: tuple = ()) -> Piece:
        """The callable to give dynamo for a graph compiled on ``device_type`` as ``compiled``;
        ``params``: the parameters among its inputs whose optimizer state ``device_budget``
        counts (``memory.optimizer_state``; none without a device budget); ``returned``: those
        whose gradients it returns while their ``.grad`` is None (``Piece``)."""
        if device_type == "cuda":
            self._device_type = "cuda"
        p = Piece(self, compiled, record, rebuild, params, returned)
        self.pieces.append(p)
        if self.state == "done":  # a graph new since the plan (another model, a recompile): again
            self.state, self.steps_seen = "warming", 0
        return p

    def defer(self, record: Any, refusal: BudgetError) -> None:
        """A whole graph's budget was out of reach on its own peak; the graph runs at its smallest
        peak. The budget is of the step: where the step holds other compiled graphs with choices
        (a loss compiled apart), the step's plan decides and names the step's own smallest budget
        (``_apply``); where it holds none, ``refusal`` is raised at the end of step 1."""
        self.refusals[record.graph_id] = refusal

    def _refuse_alone(self) -> None:
        """At the end of a step: the deferred refusal of a whole graph the step called, raised
        when no other graph with choices shared the step (the refusal on its own peak was the
        step's), or when no step plan is to come (the recorder is past its recording: the graph
        is another model's, compiled with these options after the first one's plan). Kept after
        it is raised: the same model called again is refused again, never run above the budget;
        and the step count restarts, so a model compiled next with these options is refused at
        its own step 1 (a notebook cell run again after a refusal)."""
        deferred = [p for p in self.calls if p.record.graph_id in self.refusals]
        if not deferred:
            return
        others = [p for p in self.calls if p.record.graph_id not in self.refusals]
        if self.state != "warming" or not _with_choices(p.record.step for p in others):
            self.calls, self.marks, self.mark_grads = [], [], []
            self.steps_seen = 0
            raise self.refusals[deferred[0].record.graph_id]
        for p in deferred:
            self.refusals.pop(p.record.graph_id, None)
        log.info("lynx: graph(s) %s out of reach on their own peak share the step with other compiled graphs: "
                 "the step's plan decides (step %d recorded)",
                 ", ".join(str(i) for i in dict.fromkeys(p.record.graph_id for p in deferred)), RECORDED_STEP)

    # -- the step's calls --------------------------------------------------------------------
    def before_forward(self, module_call: bool = False) -> None:
        """Before a piece call (``module_call``: before a call of the step's module,
        ``_wait_for_start``)."""
        if not module_call and not self.calls and torch.is_grad_enabled():  # the step's first piece call
            self._unhook()
        if self.state == "ending":  # the recording could not be stopped as the backward returned
            self._finish_recording()
        if self._step1 is not None and not self.calls and torch.is_grad_enabled():
            calls, self._step1 = self._step1, None
            seen, self._sizes = self._sizes, {}
            sizes.plan_again(self.pieces, seen, self.backend.planning_group)
            self._cached_step(calls)
        if self.state == "recorded":
            self._apply()
        elif self._recording_due() and not self.calls and torch.is_grad_enabled():
            self._start_recording()

    def _wait_for_start(self) -> None:
        """At the end of the step before the recorded one: record from the recorded step's start,
        the call of the module that was outermost when step 1 called its first piece, not from
        that piece call. What the step allocates before its first piece and holds past it is the
        step's as the user measures it: under torchtitan's TP on 2 ranks (qwen3, 2 blocks) the
        root module's all-gathered embedding, norm and LM head (2 MiB) and block 0's input (a
        reduce-scatter's result), recorded from the first piece call, were outside the step,
        and a step planned at budget 1.0 measured 40.96 MB against a budget of 38.73 MB.

        Hooks on that module alone (before its own pre-hooks: FSDP2's all-gather) start the
        recording at its next call with gradients on; that call returning without a piece call
        drops the recording and the hooks (the recorded step then starts at its first piece
        call, as it does where step 1 called its first piece outside any module, or from a
        module whose call ``module.compile()`` compiled: hooks on it would be traced). The
        hooks go at the first piece call, and hold the recorder weakly."""
        root = self._root() if self._root is not None else None
        if root is None or self._root_hooks is not None or _compat.call_is_compiled(root):
            return
        self._depth, self._entered = 0, False
        me = weakref.ref(self)

        def enters(args: tuple) -> None:
            recorder = me()
            if recorder is None:  # the backend is gone
                hooks.remove()
            elif not _skipped():
                recorder._root_enters(args)

        def leaves() -> None:
            recorder = me()
            if recorder is not None and not _skipped():
                recorder._root_leaves()

        hooks = self._root_hooks = _compat.ModuleCallHooks(root, enters, leaves)

    def _root_enters(self, args: tuple) -> None:
        depth, self._depth = self._depth, self._depth + 1
        if depth or self.calls or not torch.is_grad_enabled():  # (evaluation under no_grad: not the step)
            return
        self._entered = True
        self.before_forward(module_call=True)
        if self.state == "recording":
            self._from_start = True
            self._before = _activation_bytes(args)

    def _root_leaves(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self._entered and not self.calls:
            self._entered = False
            if self.state == "recording":  # the call returned without calling a piece: not the step
                self._cancel_recording()
            self._unhook()

    def outside_recording(self, compile_again: Callable[[], None]) -> None:
        """A piece compiles again before the step's first piece call (``Piece._accumulate_in_graph``):
        a recording started at the step's module call would count the compile, so it starts
        again at the piece call instead (``_before``): the recording's window is cut there
        (``restart``), the profiler running on through the compile.

        Not stopped and a new one started: this call runs inside the frames dynamo compiled
        (their "Torch-Compiled Region" profiler ranges began under the recording's profiler),
        and when a range that began under a stopped profiler ends while another one is on,
        torch's exit callback writes the range's end into the stopped profiler's freed event
        storage (torch 2.13, ``onFunctionExit``: it checks that a profiler is on, not which).
        That heap corruption crashed the process about once in 50 runs of
        ``test_piece_budget.py``'s HF GPT-2 test, later and elsewhere (in the garbage
        collector, a compiled backward, the profiler's stop)."""
        if self.state != "recording" or self.calls:
            compile_again()
            return
        self._stop_grad_watch()  # the compile's own backward (AOTAutograd's trace) is not the step's
        self.state, self._from_start = "warming", False
        try:
            compile_again()
        except BaseException:
            self._cancel_recording()  # (no profiler of lynx's starts before these frames return)
            raise
        if not _with_choices(p.record.step for p in self.pieces):
            # nothing to plan together any more (_start_recording's "done", at the piece call):
            # stopped here, with no profiler of lynx's started before these frames return
            self._cancel_recording()
            return
        gc.collect()  # as _start_recording collects before it starts
        self._recording.restart()
        self._window_opened()

    def _unhook(self) -> None:
        if self._root_hooks is not None:
            self._root_hooks.remove()
            self._root_hooks = None

    def begin_forward(self, piece: Piece, args: tuple = ()) -> int:
        call = len(self.calls)
        if call == 0 and self.state == "recording" and not self._from_start:
            self._before = _activation_bytes(args)
        if call == 0 and self.state == "warming" and self.steps_seen == 0:
            root = _compat.outermost_module_call()
            self._root = weakref.ref(root) if root is not None else None
        self.calls.append(piece)
        self.open.add(call)
        self._mark(call, "fw0")
        return call

    def end_forward(self, call: int, out: Any) -> None:
        self._mark(call, "fw1")
        node = _backward_node(out)
        if node is None:  # nothing to differentiate (or an output lynx cannot follow)
            self.open.discard(call)
            return
        piece = self.calls[call]
        if self.state == "warming" and self.steps_seen == 0 and piece.record.saved_symbols:
            seen = sizes.seen_at(piece.record.saved_symbols, node)
            self._sizes[piece.key] = sizes.merged(self._sizes.get(piece.key, {}), seen)
        node.register_prehook(lambda grads: self._begin_backward(call, node))

    def _begin_backward(self, call: int, node: Any) -> None:
        self._mark(call, "bw0")
        # every backward begun ends within this backward pass (at _backward_done, at the latest)
        self.open.discard(call)
        if self.state == "recording":
            self._watch_end(call, node)
        if not self._queued:
            self._queued = True
            _compat.queue_backward_callback(self._backward_done)

    def _watch_end(self, call: int, node: Any) -> None:
        """Mark the end of ``call``'s backward (the recorded step's segments need it): the return
        of the node's Python ``backward`` frame, seen by Python's profile hook in the thread
        running it (the engine's). Not a post hook on the node: with one the engine holds the
        gradients the node receives until it returns, where the compiled backward frees them at
        their last use, and the recording counted them as memory outside the pieces
        (torchtitan's llama3, model and loss compiled apart: the 4 MiB logits' gradient, and
        lynx named 0.413 of the step as its smallest budget where ``full`` measures 0.349).
        Where another tool holds the profile hook, the post hook (that memory counted: the plan
        errs low)."""
        if not _compat.watch_frame(_compat.python_backward_code(node), "return",
                                   lambda frame: self._end_backward(call)):
            node.register_hook(lambda grads_in, grads_out: self._end_backward(call))

    def _end_backward(self, call: int) -> None:
        self._mark(call, "bw1")

    def _backward_done(self) -> None:
        """End of a backward pass: the step ended when every piece call's backward ran."""
        self._queued = False
        if self.open or not self.calls:
            return
        self.steps_seen += 1
        if self.refusals:
            self._refuse_alone()
        if self.state == "warming" and self.steps_seen == 1:
            if any(p.record.saved_symbols for p in self.pieces):
                # planned again with the sizes step 1 ran first, at the start of step 2: the step
                # plan kept for this step names the candidates of those plans
                self._step1 = self.calls
                self.calls, self.marks, self.mark_grads = [], [], []
                self._wait_for_start()
                return
            if self._cached_step(self.calls):
                self.calls, self.marks, self.mark_grads = [], [], []
                return
        if self.state == "warming" and self.steps_seen + 1 == RECORDED_STEP:
            self._wait_for_start()
        if self.state == "recording":
            self._mark(-1, "end")
            self.state = "ending"
            self._recording.stop_after_backward(self._finish_recording)
            return
        self.calls, self.marks, self.mark_grads = [], [], []

    def _cached_step(self, calls: list[Piece]) -> bool:
        """At the end of step 1 (where a piece has data-dependent sizes: at the start of step 2,
        after ``sizes.plan_again``): the step's plan, or its refusal, from the plan cache (a
        script run before), for step 1's piece ``calls``, applied (or raised) at step 2's first
        forward without recording; every rank must hit alike. Each rank reads its own entry (a
        rank's graphs may hold constants of their own, the vocabulary offset of a
        tensor-parallel loss, and so keys of their own). Taking
        rank 0's entry on every rank (a broadcast here) was tried in session 30 and withdrawn: two
        of three full suite runs after it failed FSDP tests (ranks planning apart, once a hang),
        which passed alone; the cause was not found in the session."""
        from lynx_compile.distributed.agreement import gather_values, planning_group

        self._key = cached.key(calls, self.backend.config)
        found = cached.lookup(self._key, calls)
        # one all-gather whatever this rank found: every rank takes the same path. What each
        # found is compared, not its text: a refusal's reason names the rank's own measurements
        # (the transients it measured), which differ between ranks that refused alike
        with planning_group(self.backend.planning_group), _compat.eager_dispatch():
            if len(set(gather_values((isinstance(found, cached.Refusal), isinstance(found, cached.Kept))))) > 1:
                return False
        if isinstance(found, cached.Refusal):
            log.info("lynx plan cache: hit %s (the step's refusal: nothing recorded)", self._key[:12])
            self._refused = found
            self.state = "recorded"
            return True
        if found is None:
            return False
        log.info("lynx plan cache: hit %s (the step's plan across pieces: nothing recorded)", self._key[:12])
        self.model, self.choice = found.model_and_choice(calls)
        self.reference, self.budget_bytes = found.reference, found.budget_bytes
        self.outside = [found.outside]
        self._cached = True
        self.state = "recorded"
        return True

    def check_sizes(self, piece: Piece, out: Any) -> None:
        """After the plans: a call of a graph planned with the sizes step 1 ran that runs larger
        ones is said once per graph (``sizes.ran_above_plan``)."""
        if piece.key not in self._sizes_over and sizes.ran_above_plan(piece, _backward_node(out)):
            self._sizes_over.add(piece.key)

    def _mark(self, call: int, kind: str) -> None:
        if self.state == "recording":
            self.marks.append((call, kind))
            self.mark_grads.append(self._grads.accumulated if self._grads is not None else 0)
            self._recording.mark(len(self.marks) - 1)

    # -- recording ---------------------------------------------------------------------------
    def _start_recording(self) -> None:
        if not _with_choices(p.record.step for p in self.pieces):
            self.state = "done"  # whole graphs only, each planned on its own peak: nothing to plan together
            device_budget.recheck(self.pieces, self.backend.config.budget, self._device_type, RECORDED_STEP)
            return
        # (some piece has choices; whether this step calls one is known when it ends: a step of
        # whole graphs only is then left as it is, _finish_recording)
        recording = AllocatorRecording() if self._device_type == "cuda" else ProfilerRecording()
        # garbage left by earlier steps (reference cycles holding tensors), freed wherever the
        # collector happened to run, moved the recorded step's peaks run to run (gpt-tiny per
        # block: 48 KiB, naming 0.467 or 0.477): collected now, the collector's schedule inside
        # the step is the same in every run
        gc.collect()
        if not recording.start():
            return
        self._recording = recording
        self._window_opened()

    def _window_opened(self) -> None:
        """The recording's window starts here (``_start_recording``, or cut again by
        ``outside_recording``): what the device holds besides the step, read now, and the watch of
        ``.grad``."""
        self._resident = device_budget.resident_bytes(self.pieces, self._device_type, RECORDED_STEP)
        self._grads = GradWatch()
        if not self._grads.start():
            self._grads = None
        self.state = "recording"

    def _stop_grad_watch(self) -> None:
        if self._grads is not None:
            self._grads.stop()
            self._grads = None

    def _cancel_recording(self) -> None:
        """Drop a recording that started at a module call that was not the step's (nothing marked)."""
        self._recording.cancel()
        self._recording = None
        self._stop_grad_watch()
        self.state, self._from_start = "warming", False

    def _finish_recording(self) -> None:
        if self.state != "ending":
            return
        peaks, levels = self._recording.finish(len(self.marks))
        measured = self._recording.peak_bytes
        self._recording = None
        if self._grads is not None:
            self._grads.stop()
            held = self._grads.held_bytes
            self.grads_note = (f"parameter gradients: {format_bytes(held)} of .grad were allocated as step "
                               f"{RECORDED_STEP} started; planned within the budget both as it ran and for a step "
                               "that allocates them (.grad None at the start, torch's zero_grad default), "
                               "each of its own step with no recompute") if held else ""
        else:
            self.grads_note = (f"parameter gradients: planned as step {RECORDED_STEP} ran (another tool holds "
                               "Python's profile hook, so lynx could not see whether .grad was allocated)")
            self.mark_grads = [0] * len(self.marks)
        self._grads = None
        seen = [p for p in peaks if p is not None]
        self.recorded_peak_bytes = measured + self._before if seen and measured is not None else None
        self.model, as_ran = self._model(peaks, levels)
        if not _with_choices(self.model.graphs.values()):
            # the step called whole graphs only (another model compiled whole with the same
            # options, after one compiled in pieces): each keeps the plan it has alone
            self.state, self.model = "done", None
            return
        self._choose(as_ran)
        self.state = "recorded"
        cached.store(self._key, self.model, self.choice, self.reference, self.budget_bytes, self.outside)

    def _model(self, peaks: list[int | None], levels: list[int | None]) -> tuple[StepModel, StepModel]:
        """The recorded step as segments (``step.model.recorded``): the step as if it allocated its
        parameter gradients (``.grad`` None at its start), and as it ran; the transients measured
        other than lynx's memory model are said in ``self.measured_note``."""
        calls, marks, self.calls, self.marks = self.calls, self.marks, [], []
        grads, self.mark_grads = self.mark_grads, []
        before, self._before, self._from_start = self._before, 0, False
        peaks, levels, grads, before = self._every_ranks(marks, peaks, levels, grads, before)
        model, as_ran, changes = recorded({p.key: p.record.step for p in calls}, tuple(p.key for p in calls),
                                          marks, peaks, levels, grads, before)
        self.measured_note = "; ".join(
            f"graph {g} '{model.graphs[g].current}' {kind} peak {format_bytes(new)} as measured "
            f"(lynx's memory model: {format_bytes(old)})" for g, kind, old, new in changes)
        return model, as_ran

    def _every_ranks(self, marks: list, peaks: list[int | None], levels: list[int | None], grads: list[int],
                     before: int) -> tuple[list[int | None], list[int | None], list[int], int]:
        """The step as every rank of the planning group measured it: each mark's peak, level and
        ``.grad`` bytes, the highest any rank measured (a mark one rank did not see: unseen). The
        ranks' measurements differ (under gloo a collective's buffer is freed by another thread,
        sometimes after the mark that follows it); a model built from each rank's own chose
        differently per rank, and then the ranks' plans of one graph disagreed
        (``PlanMismatchError`` at step 3, session 32's suite). Built from the highest, the step's
        model and choice are the same on every rank, and hold each rank's measured step."""
        from lynx_compile.distributed.agreement import gather_values, planning_group

        with planning_group(self.backend.planning_group), _compat.eager_dispatch():
            everyone = gather_values((len(marks), peaks, levels, grads, before))
        if len({e[0] for e in everyone}) > 1:
            raise RuntimeError("lynx: the ranks recorded steps of different shapes (marks per step "
                               f"{[e[0] for e in everyone]}); every rank must run the same compiled pieces")

        def highest(column):
            return None if any(v is None for v in column) else max(column)

        return ([highest(c) for c in zip(*(e[1] for e in everyone))],
                [highest(c) for c in zip(*(e[2] for e in everyone))],
                [max(c) for c in zip(*(e[3] for e in everyone))], max(e[4] for e in everyone))

    # -- choosing and applying ---------------------------------------------------------------
    def _choose(self, as_ran: StepModel) -> None:
        """The choice for the recorded step. ``self.model`` is the step that allocates its
        gradients (``.grad`` None at its start: ``zero_grad()``'s default, the first micro-batch),
        ``as_ran`` the step as it ran. Where ``.grad`` was allocated as it started
        (``zero_grad(set_to_none=False)``, a later micro-batch, DDP's buckets) a plan must hold
        the budget in both, each a fraction of the same step with no recompute (torch.compile's
        own step in that regime); where none does, the step is planned as it ran (within the
        budget of that step) and the peak a step from None would reach is said (``grads_note``)."""
        from lynx_compile.distributed.agreement import gather_values, planning_group

        model = self.model
        with planning_group(self.backend.planning_group), _compat.eager_dispatch():
            everyone = gather_values((model.outside(), as_ran.outside()))
        if len({len(o[0]) for o in everyone}) > 1:
            raise RuntimeError("lynx: the ranks recorded steps of different shapes (piece calls per step "
                               f"{[len(o[0]) for o in everyone]}); every rank must run the same compiled pieces")
        outside = [max(col) for col in zip(*(o[0] for o in everyone))]
        outside_as_ran = [max(col) for col in zip(*(o[1] for o in everyone))]
        allocated = outside_as_ran != outside
        # the budget's 100%: the step with no recompute, which returns its gradients at its end
        # (each compiled graph's, which autograd adds into .grad once it returns), per regime
        reference, reference_as_ran = model.reference(outside), as_ran.reference(outside_as_ran)
        budget = self.backend.config.budget
        if budget.needs_resident:
            budget = budget.with_resident(*self._resident)
        self.budget_bytes, budget_as_ran = budget.bytes_of(reference), budget.bytes_of(reference_as_ran)
        mine = _users_pick(model)
        if mine is not None:  # the user's checkpointing on every piece: never more memory than it
            # gives, in either .grad regime (issue U)
            self.budget_bytes = min(self.budget_bytes, model.predicted(mine, outside))
            budget_as_ran = min(budget_as_ran, as_ran.predicted(as_ran.own(mine), outside_as_ran))
        accept = (lambda pick: as_ran.predicted(as_ran.own(pick), outside_as_ran) <= budget_as_ran) if allocated else None  # noqa: E731
        self.outside, self.reference = outside, reference
        self.choice = choose(model, self.budget_bytes, outside, accept)
        if self.choice.fits or not allocated:
            return
        # no choice holds a step that allocates its gradients: plan the step as it ran
        ran = choose(as_ran, budget_as_ran, outside_as_ran)
        self.grads_note = (f"parameter gradients: .grad were allocated as step {RECORDED_STEP} started, and the "
                           f"step is planned so, within the budget of that step with no recompute "
                           f"({format_bytes(reference_as_ran)}); a step starting with .grad None allocates "
                           f"them and would peak at {format_bytes(model.predicted(model.own(ran.pick), outside))} with this "
                           f"plan (no plan fits it within {format_bytes(self.budget_bytes)})")
        if ran.fits:
            log.warning("lynx: %s", self.grads_note)
        self.model, self.outside, self.choice = as_ran, outside_as_ran, ran
        self.reference, self.budget_bytes = reference_as_ran, budget_as_ran

    def _tighten(self, choice: StepChoice, rounds: int = 3) -> StepChoice:
        """When no choice of the pieces fits: the graphs planned on their own peak (whole graphs
        beside a graph break) planned again, each within its peak less the step's overshoot,
        up to ``rounds`` times. The pieces' choices are made again with each."""
        model, budget = self.model, self.budget_bytes
        fixed = [p for p in self.pieces if p.key in model.graphs and len(model.graphs[p.key].choices) == 1
                 and model.graphs[p.key].choices[0].name.policy == "plan"]
        for _ in range(rounds):
            if choice.fits or not fixed:
                return choice
            over = choice.predicted - budget
            graphs = dict(model.graphs)
            for piece in fixed:
                target = max(1, piece.record.plan.peak_bytes - over)  # (a fraction below 0 is torch's error)
                try:
                    piece.compiled, piece.record = piece.rebuild(piece.record, CandidateKey("plan", nbytes=target))
                except BudgetError as e:  # that graph reaches no lower peak: its smallest, once
                    if e.smallest_bytes is None:
                        return choice
                    floor = CandidateKey("plan", nbytes=e.smallest_bytes)
                    if piece.record.step_choice == floor:
                        return choice
                    try:
                        piece.compiled, piece.record = piece.rebuild(piece.record, floor)
                    except BudgetError:
                        return choice
                    fixed = [f for f in fixed if f is not piece]
                graphs[piece.key] = dataclasses.replace(graphs[piece.key], choices=piece.record.step.choices)
            model = dataclasses.replace(model, graphs=graphs)
            choice = choose(model, budget, self.outside)
        return choice

    def _apply(self) -> None:
        self.state = "done"
        if self._refused is not None:  # a refusal from the plan cache: the same as when recorded
            r = self._refused
            raise budget_error(self.backend.config.budget, r.reference, r.predicted, r.why + " (the step's refusal "
                               f"from the plan cache, as when step {RECORDED_STEP} was recorded)")
        choice, model = self.choice, self.model
        outside_peak = max(self.outside, default=0)
        seen = "from the plan cache" if self._cached else f"step {RECORDED_STEP} recorded"
        summary = (f"{seen}: {len(model.calls)} piece calls of {len(model.graphs)} "
                   f"graph(s); outside the compiled pieces up to {format_bytes(outside_peak)}; the step with no "
                   f"piece recomputing peaks at {format_bytes(self.reference)}"
                   + (f"; {self.grads_note}" if self.grads_note else "")
                   + (f"; {self.measured_note}" if self.measured_note else ""))
        if not choice.fits:
            choice = self._tighten(choice)
        if not choice.fits and choice.predicted <= self.budget_bytes + self.reference // NOISE:
            # within what the recorded step's measure moves between runs (seen: 512 B of 2.7 MB), less
            # than the last digit of the budget a refusal names: the budget named is accepted
            log.info("lynx: the step's plan predicts %s, %d B above the budget (%s): within the measure's noise "
                     "(1/%d of the step), accepted", format_bytes(choice.predicted),
                     choice.predicted - self.budget_bytes, format_bytes(self.budget_bytes), NOISE)
            choice = dataclasses.replace(choice, fits=True)
        if not choice.fits:
            config = self.backend.config
            why = (f"the compiled pieces of this step ({summary}) cannot be planned within "
                   f"{format_bytes(self.budget_bytes)}; what runs outside them (embedding, LM head, "
                   "loss) is not recomputed: compile it too (the whole model, or the module "
                   "computing the loss) or raise the budget")
            cached.store_refusal(self._key, cached.Refusal(int(choice.predicted), int(self.reference), why))
            raise budget_error(config.budget, self.reference, choice.predicted, why)
        changed = [f"graph {p.record.graph_id}: its own peak planned within {format_bytes(p.record.step_choice.plan_within)}"
                   for p in self.pieces if p.record.step_choice is not None and p.record.step_choice.plan_within is not None]
        planned = [p for p in self.pieces if p.key in choice.pick]
        for piece in planned:
            changed += piece.assign(tuple(c.name for c in choice.pick[piece.key]))
        what = "; ".join(changed) if changed else "the provisional plans kept"
        line = (f"{summary}; planned together: {what}; step peak predicted {format_bytes(choice.predicted)} "
                f"(budget {format_bytes(self.budget_bytes)})")
        from lynx_compile.step import hint as step_hint

        for piece in self.pieces:  # a whole graph planned lower: at once in the next run
            step_hint.keep(piece.record)
        for record in (r for p in planned for r in p.records):
            plan = record.plan
            record.plan = dataclasses.replace(
                plan, budget_scope="step", budget_bytes=self.budget_bytes, step_peak_bytes=choice.predicted,
                step_reference_bytes=self.reference, notes=(*plan.notes, line))
            record.notes.append(line)
        log.info("lynx: %s", line)
