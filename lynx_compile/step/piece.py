"""A lynx-compiled graph as dynamo calls it, for a model compiled in pieces (``step.recorder``).

``Piece`` is the callable dynamo gets: the compile in use (swapped once the step's plan chose
another candidate, and once where gradients start to accumulate into a kept ``.grad``), telling
the step's recorder of every forward and backward. ``InputSpec``
keeps what compiling the graph again needs of its example inputs without keeping them alive.
"""
from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Callable

import torch

from lynx_compile import _compat
from lynx_compile.decisions import CandidateKey
from lynx_compile.memory import optimizer_state

log = logging.getLogger("lynx_compile")

class InputSpec:
    """What a compile of a graph needs of its example inputs, without keeping them alive: a
    weak reference (parameters stay alive, activations do not) and the tensor's metadata, from
    which an empty tensor of the same layout stands in once it is gone (for a DTensor, a DTensor
    of the same layout, mesh and placements: ``_compat.dtensor_stand_in``)."""

    def __init__(self, example_inputs: list):
        self._items: list[tuple] = []
        for t in example_inputs:
            layout = _compat.dtensor_layout(t) if isinstance(t, torch.Tensor) else None
            if layout is not None:  # a DTensor (TP): its local shard's layout and how it is distributed
                self._items.append(("dtensor", weakref.ref(t), layout[0], layout[1], t.dtype, t.device,
                                    t.requires_grad, isinstance(t, torch.nn.Parameter), layout))
            elif isinstance(t, torch.Tensor):
                self._items.append(("tensor", weakref.ref(t), tuple(t.shape), t.stride(), t.dtype, t.device,
                                    t.requires_grad, isinstance(t, torch.nn.Parameter)))
            else:
                self._items.append(("value", t))

    def inputs(self, fake_mode: Any = None) -> list:
        """The example inputs: those still alive, and stand-ins for the others. With
        ``fake_mode`` (a compile in ``_compat.static_tracing``) an activation's stand-in is a
        fake tensor of that mode, so compiling again inside a step allocates nothing of the
        step's memory (real stand-ins did: 2.6 MB per rank at step 3 of deepseek_v3 under EP)."""
        out = []
        for item in self._items:
            if item[0] == "value":
                out.append(item[1])
                continue
            kind, ref, shape, stride, dtype, device, requires_grad, is_param = item[:8]
            t = ref()
            if t is None and fake_mode is not None and kind == "tensor" and not is_param:
                with fake_mode:
                    out.append(torch.empty_strided(shape, stride, dtype=dtype, device=device)
                               .requires_grad_(requires_grad))
                continue
            if t is None:
                t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                if kind == "dtensor":  # a DTensor stands in for a DTensor (TP's activations)
                    t = _compat.dtensor_stand_in(t, item[8])
                t = torch.nn.Parameter(t, requires_grad) if is_param else t.requires_grad_(requires_grad)
            out.append(t)
        return out


class Piece:
    """What dynamo calls for one lynx-compiled graph: the compile in use (swapped once, after the
    recorded step), with the recorder told of every forward and backward.

    After the step's plan a graph called several times per step may run two compiles: the
    ``k``-th call of a step (counting calls with gradients on) runs ``by_call[k]``. ``recorder``
    is the backend's ``step.recorder.StepRecorder`` (told of each forward and backward)."""

    def __init__(self, recorder: Any, compiled: Callable, record: Any,
                 rebuild: Callable[..., tuple[Callable, Any]], params: tuple = (), returned: tuple = ()):
        self.recorder = recorder
        self._returned = [weakref.ref(p) for p in returned]
        """The parameters whose gradients the graph returns because their ``.grad`` were None
        when it compiled (``grad_in_graph.RETURNED_NEW``): the first call that finds one of them
        kept compiles it again with the gradients added in the graph (:meth:`_accumulate_in_graph`)."""
        self._params = [weakref.ref(p) for p in params]
        self.state_at_compile = optimizer_state.state_bytes(params)[0] if params else 0
        """Bytes of its parameters' optimizer state when it compiled (in its plan's
        ``resident_bytes`` off CUDA; ``memory.optimizer_state``)."""
        self.compiled = compiled
        self.record = record
        self.rebuild = rebuild
        self.key = len(recorder.pieces)
        self.records = [record]
        """Its records since the step's plan (two when its calls run two compiles)."""
        self.by_call: list[Callable] | None = None
        self._call_records: list = [record]
        self._count = 0

    def __call__(self, *args: Any) -> Any:
        rec = self.recorder
        if rec.tracking and _compat.detect_fake_mode(args) is not None:
            # a call on fake tensors while dynamo compiles (DDPOptimizer runs each bucket's
            # compiled graph on fakes to trace the next): no step's call, no backward to follow
            return self.compiled(*args)
        if self._returned and torch.is_grad_enabled() and any(
                p is not None and p.grad is not None for p in (r() for r in self._returned)):
            rec.outside_recording(self._accumulate_in_graph)
        rec.before_forward()
        if not rec.tracking or not torch.is_grad_enabled():
            out = self._current()(*args)
            if self.record.unbacked_sizes and torch.is_grad_enabled():
                rec.check_sizes(self, out)
            return out
        call = rec.begin_forward(self, args)
        out = self.compiled(*args)
        rec.end_forward(call, out)
        return out

    def _accumulate_in_graph(self) -> None:
        """A ``.grad`` kept from an earlier backward (gradient accumulation): returned
        gradients would pile up beside it, a second copy of them at the backward's end that the
        plan does not hold. Each of the graph's compiles is built again with the gradients added
        into ``.grad`` where computed (the same choice, so the same plan: :meth:`_choice_in_use`),
        once."""
        self._returned = []
        from lynx_compile.memory.grad_in_graph import GradsInGraph

        regime = GradsInGraph(True, True, "")
        fresh = {}
        for old in self.records:
            fresh[id(old)] = self.rebuild(old, self._choice_in_use(old), grads_in_graph=regime)
        if self.by_call is not None:
            self.by_call = [fresh[id(r)][0] for r in self._call_records]
            self._call_records = [fresh[id(r)][1] for r in self._call_records]
        self.compiled, self.record = fresh[id(self.record)]
        self.records = [fresh[id(r)][1] for r in self.records]
        log.info("lynx: graph %d: a .grad kept from an earlier backward (gradient accumulation): compiled again "
                 "with its gradients added into .grad where computed, so that they do not pile up beside it "
                 "(accumulate_grad_in_graph=True does so from the first compile)", self.record.graph_id)

    def _choice_in_use(self, record: Any) -> Any:
        """The candidate ``record``'s compile runs: its ``step_choice`` where the step's plan
        compiled it again; the candidate the step was recorded with where the plan kept that
        compile (its ``step_choice`` stays None, as before any plan: compiled again with None it
        would be planned afresh on its own, off the step's plan: gpt-tiny per block at 0.5, a call
        kept at 'torch@0.3' came back as a plan of its own saving 68,608 B more, and the step
        measured 1,405,704 B against the 1,303,304 it was planned and measured at)."""
        if record.step_choice is not None or self.recorder.state != "done" or record.step is None:
            return record.step_choice
        return record.step.current

    def replan(self, unbacked_sizes: dict[str, int]) -> None:
        """Compile again as a first compile plans it, with its data-dependent sizes at
        ``unbacked_sizes`` (those step 1 ran: ``step.sizes``), before any step's plan assigned it."""
        self.compiled, self.record = self.rebuild(self.record, self.record.step_choice, unbacked_sizes=unbacked_sizes)
        self.records = [self.record]
        self._call_records = [self.record]

    def params(self) -> list:
        """The parameters among its inputs (those still alive)."""
        return [p for p in (r() for r in self._params) if p is not None]

    def _current(self) -> Callable:
        if self.by_call is None or not torch.is_grad_enabled():
            return self.compiled
        fn = self.by_call[self._count % len(self.by_call)]
        self._count += 1
        return fn

    def assign(self, names: tuple[CandidateKey, ...]) -> list[str]:
        """Compile (once per candidate) and use candidate ``names[k]`` for the ``k``-th call of
        each step; returns what changed, for the log."""
        current = self.record.step.current
        compiled = {current: self.compiled}
        records = {current: self.record}
        anchor = self.record  # where the next record goes in backend.records
        for name in dict.fromkeys(names):
            if name not in compiled:
                replace = current not in names and anchor is self.record  # the first drops the old one
                compiled[name], records[name] = self.rebuild(anchor, name, replace=replace)
                anchor = records[name]
        self.compiled, self.record = compiled[names[-1]], records[names[-1]]
        self.records = [records[n] for n in dict.fromkeys(names)]
        self.by_call = None if len(set(names)) == 1 else [compiled[n] for n in names]
        self._call_records = [records[n] for n in names]
        self._count = 0
        if names == (current,) * len(names):
            return []
        runs = [(n, sum(1 for _ in grp)) for n, grp in itertools.groupby(names)]
        first, parts = 1, []
        for n, count in runs:
            span = f"call {first}" if count == 1 else f"calls {first}-{first + count - 1}"
            parts.append(f"{span} '{n}'")
            first += count
        return [f"graph {self.record.graph_id}: '{current}' -> " + (", ".join(parts) if len(runs) > 1 else f"'{names[0]}'")]
