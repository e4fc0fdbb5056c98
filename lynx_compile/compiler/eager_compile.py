"""``compiler="eager"``: lynx's partition through AOTAutograd, the partitioned graphs run op by op
(``_compat.boxed``), with the runtimes the options ask for.

    dynamo graph ──aot_autograd(partition_fn=lynx_partition)──▶ forward, backward
        forward  ── recompute_in_wait: runtime.prefetch.GraphRuntime (the backward's recompute
                    prefix run early, at a pipeline's gradient wait)
        backward ── side_stream: runtime.side_stream_runner.SideStreamRunner (recompute on a second stream)
                 ── otherwise: runtime.weight_split.WeightDeferral (weight gradients left for later)
                 ── every backward reports its gradients to a running memory measurement

``LynxBackend`` (``compiler.dynamo_backend``) owns one ``EagerCompile`` and calls it for each graph
when ``config.compiler == "eager"`` (and for meta-device models, which Inductor cannot compile).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.config import LynxConfig
from lynx_compile.errors import PlanningDone
from lynx_compile.passes import GraphRecord
from lynx_compile.recompute.partition import lynx_partition
from lynx_compile.runtime.step_runtimes import StepRuntimes


class EagerCompile:
    """The eager compiler's path for one backend: ``config`` (the backend's options: side stream,
    recompute in wait, tracing), ``runtimes`` (the backend's ``runtime.step_runtimes.StepRuntimes``:
    what each compiled graph runs with goes there), ``plan_only`` (stop once the plan is made)."""

    def __init__(self, config: LynxConfig, runtimes: StepRuntimes, *, plan_only: bool = False):
        self.config = config
        self.runtimes = runtimes
        self.plan_only = plan_only

    def __call__(self, gm: fx.GraphModule, example_inputs: list, record: GraphRecord, group: Any) -> Callable:
        """``gm`` compiled, planned in the ranks of ``group``."""
        partition_fn = functools.partial(lynx_partition, config=self.config, record=record)
        compiler = fw_compiler = self._compiler
        deferral = None
        if not self.config.side_stream and not self.plan_only:
            from lynx_compile.runtime.weight_split import WeightDeferral

            # dynamo hands a module's parameters to the backend as graph inputs
            deferral = WeightDeferral([t if isinstance(t, torch.nn.Parameter) else None for t in example_inputs],
                                      grads_in_graph=bool(record.grads_in_graph and record.grads_in_graph.applies))
            self.runtimes.weight_deferrals.append(deferral)
        bw_compiler = functools.partial(self._bw_compiler, deferral=deferral)
        if self.config.recompute_in_wait and not self.plan_only:
            from lynx_compile.runtime.prefetch import GraphRuntime

            runtime = GraphRuntime()
            self.runtimes.prefetch.append(runtime)
            fw_compiler = functools.partial(self._fw_compiler_early, runtime=runtime, record=record)
            bw_compiler = functools.partial(self._bw_compiler, runtime=runtime, deferral=deferral)
        from lynx_compile.distributed.agreement import planning_group

        with planning_group(group):
            return _compat.aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                        inference_compiler=compiler,
                                        partition_fn=partition_fn)(gm, example_inputs)

    def _fw_compiler_early(self, gm: fx.GraphModule, example_inputs: list, *, runtime, record) -> Callable:
        runtime.saved_names = record.saved_names
        return runtime.wrap_forward(gm, self._compiler(gm, example_inputs))

    def _bw_compiler(self, gm: fx.GraphModule, example_inputs: list, runtime=None, deferral=None) -> Callable:
        """The backward, reporting its outputs (gradients) to a running memory measurement.
        ``deferral``: can leave the weight gradients for later (``runtime.weight_split``)."""
        from lynx_compile.memory.measure import record_backward_outputs

        def compile_one(g: fx.GraphModule) -> Callable:
            if self.config.trace_recompute:
                from lynx_compile.passes.trace_ranges import trace_ranges_pass

                trace_ranges_pass(g)
            return self._compiler(g, example_inputs)

        compile_bw = compile_one if deferral is None else functools.partial(deferral.wrap, compile_fn=compile_one)
        if runtime is not None:
            inner = runtime.wrap_backward(gm, compile_bw, self.config.recompute_in_wait_bytes)
        elif self.config.side_stream:
            inner = self._side_stream_runner(gm, compile_one)
        else:
            inner = compile_bw(gm)

        def run(args: list) -> Any:
            out = inner(args)
            record_backward_outputs(out)
            return out

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def _side_stream_runner(self, gm: fx.GraphModule, compile_one: Callable) -> Callable:
        """The backward cut at its side-stream markers: CUDA streams when the graph runs on a
        GPU, else the same pieces inline (``lynx_compile.runtime.side_stream_runner``)."""
        from lynx_compile.runtime.side_stream_runner import CudaStreams, InlineStreams, SideStreamRunner

        devices = {v.device for p in gm.graph.find_nodes(op="placeholder")
                   if isinstance(v := p.meta.get("val"), torch.Tensor)}
        cuda = [d for d in devices if d.type == "cuda"]
        streams = CudaStreams(cuda[0]) if cuda else InlineStreams()
        runner = SideStreamRunner(gm, compile_one, streams)
        self.runtimes.side_stream_runners.append(runner)
        return runner

    def _compiler(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        if self.plan_only:  # the partition (and so the plan) is done; nothing needs to run
            raise PlanningDone()
        return _compat.boxed(gm)
