"""``profile_pipeline``: the :class:`PipelineCosts` of a model, from one plan-only lynx trace.

The whole model (one micro-batch) is traced by a plan-only lynx backend: its joint graph gives
per-block forward / backward seconds (the cost model: analytic or measured) and its
``RematProblem`` (the units each block could keep or recompute). Each block's recompute curve
comes from Lynx-HEU solves of that problem at a ladder of budgets: at each budget, the bytes a
block keeps and the seconds of its recompute left on the critical path (recompute the plan
hides in communication windows counts as free). Parameters are attributed by module path
(blocks) and by call order (modules called before the first block are ``pre``, after the last
``post``; a tied weight counts on both sides, because both end stages hold a copy).

Each segment's ``weight_backward_s`` (the W of a zero-bubble schedule) is its ``backward_s`` times
the weight-gradient share of its matmul FLOPs, counted in the same forward run: every forward
matmul has one backward matmul of its own size per operand it differentiates, and for an
operand that is a parameter (``x @ W.T``) that matmul is W (``dW = dy.T @ x``), the rest is B::

    share = FLOPs(forward matmuls reading a parameter) / (2 x FLOPs(all forward matmuls))

A GPT block: 24Bsh^2 / (48Bsh^2 + 8Bs^2h) = 3h / (6h + s). Memory-bound backward work
(norms, softmax, dropout) is scaled with the matmuls, not attributed op by op; the
embedding's scatter-add (a weight gradient without a matmul) counts as B.

Each segment's ``carry_bytes`` (what a micro-batch holds from B to W, ``runtime.weight_split``)
is read off the model's backward graph as lynx's eager compiler builds it when it recomputes
nothing (torch's default partition of the canonicalized joint, traced once more; nothing
runs): B is every node whose value flows into the backward of an earlier segment
(a stage starting at any block computes the gradient of its input through them), W and its
carry are ``weight_split.weight_side`` of that, as ``split_weight_grads`` cuts a stage::

    bw of segments  ... block 3 | block 4 ...     B(stage from block 4) = what reaches block 3
    carry of block 4: inputs of block 4's W (saved x, dy of each linear, ...), by storage

Each storage counts once (``memory.simulate``'s storage keys: saved views of one tensor share
their forward storage), parameters not at all, at the segment whose W reads it. Exact for a stage
that recomputes nothing (``tests/test_pipeline_bw_carry.py`` against ``WeightDeferral``'s real
carry); a stage that recomputes carries what W reads of the recomputed values instead, which
the profile does not trace.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import flop_registry

from lynx_compile import _compat
from lynx_compile.costs.analytic import FLOP_FORMULA_ALIASES
from lynx_compile.pipelining.pipeline_costs import PipelineCosts, SegmentCost
from lynx_compile.pipelining.recompute_curve import RecomputeCurve

log = logging.getLogger("lynx_compile")
BUDGET_LADDER = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1)


def profile_pipeline(module: nn.Module, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                     *, state_bytes_per_param_byte: float = 4.0) -> tuple[PipelineCosts, list[str]]:
    """Costs of ``module`` (whose forward returns the tensor the last stage hands to the loss)
    for one micro-batch ``example_inputs``; also returns the block module paths in order."""
    from lynx_compile.planning import plan_model
    from lynx_compile.remat.heuristic import solve_heu
    from lynx_compile.remat.problem import InfeasibleBudget

    opts = {k: v for k, v in (options or {}).items()
            if k in ("cost_source", "hardware", "link", "measure_repeats", "windows", "compiler", "offload")}
    records = plan_model(module, tuple(example_inputs), policy="lynx", check_plan_agreement=False, **opts)
    record = records[0]
    problem, seg = record.problem, record.segment_costs
    if not record.blocks:
        raise ValueError("lynx found no transformer blocks in this model, so it cannot cut it into "
                         "pipeline stages: put the layers in an nn.ModuleList (paths like layers.3)")
    n = len(record.blocks)
    points: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    by_id = {u.id: u for u in problem.units}
    readers = _unit_readers(problem)

    def saved(keep, recomputed: set[int]) -> list[int]:
        """Per block, the bytes of the kept units a stage saves: those the backward reads, and
        those a recomputed unit reads (an intermediate no op reads otherwise is not saved)."""
        out = [0] * n
        for uid in keep:
            u = by_id[uid]
            if u.block is not None and (u.first_use is not None or any(r in recomputed for r in readers.get(uid, ()))):
                out[u.block] += u.nbytes
        return out

    full = dict(enumerate(saved([u.id for u in problem.units], set())))
    for b in range(n):
        points[b].append((full[b], 0.0))
    solutions = [None]  # per point; None: the first point, nothing recomputed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for frac in BUDGET_LADDER[1:]:
            try:
                sol = solve_heu(problem, int(frac * problem.reference_peak))
            except InfeasibleBudget:
                break
            solutions.append(sol)
            kept = saved(sol.keep, set(sol.demand) | {uid for uid, _ in sol.window})
            exposed = [0.0] * n
            for uid in sol.demand:
                u = by_id[uid]
                if u.block is not None:
                    exposed[u.block] += u.compute_s
            for uid in sol.offload:  # option offload: on the host, not kept; its copies' exposed time
                u = by_id[uid]
                if u.block is not None:
                    exposed[u.block] += u.offload_exposed_s
            for b in range(n):
                points[b].append((kept[b], exposed[b]))
    block_fw = [u.fw_pos for u in problem.units if u.block is not None]
    first_fw = min(block_fw) if block_fw else 0
    outside = [u for u in problem.units if u.block is None and u.first_use is not None]  # saved, nothing recomputed
    pre_act = sum(u.nbytes for u in outside if u.fw_pos < first_fw)
    post_act = sum(u.nbytes for u in outside if u.fw_pos >= first_fw)
    working = max(0, problem.reference_peak - sum(full.values()) - pre_act - post_act)
    params, share = _forward_census(module, example_inputs, record.blocks)
    outputs = _block_output_bytes(problem, n)
    split = _splits_weights(options or {})
    carry, carry_saved, w_only, read_in_b = (weight_split_census(module, example_inputs, record.blocks) if split
                                             else ([0] * (n + 1), [0] * (n + 1), frozenset(), frozenset()))
    exposed_w = (_weight_only_exposed(problem, solutions, w_only, read_in_b, n, readers) if split
                 else [[] for _ in range(n)])
    blocks = tuple(SegmentCost(
        name=path, forward_s=seg["blocks"].get(b, [0.0, 0.0])[0], backward_s=seg["blocks"].get(b, [0.0, 0.0])[1],
        weight_backward_s=share[path] * seg["blocks"].get(b, [0.0, 0.0])[1],
        param_bytes=params[path], activation_bytes=full[b],
        curve=RecomputeCurve(kept_bytes=tuple(p[0] for p in points[b]), exposed_s=tuple(p[1] for p in points[b]),
                             exposed_w_s=tuple(exposed_w[b])),
        output_bytes=outputs[b], carry_bytes=carry[b], carry_saved_bytes=carry_saved[b])
        for b, path in enumerate(record.blocks))
    pre = SegmentCost(name="<pre>", forward_s=seg["pre"][0], backward_s=seg["pre"][1],
                      weight_backward_s=share["<pre>"] * seg["pre"][1],
                      param_bytes=params["<pre>"], activation_bytes=pre_act)
    post = SegmentCost(name="<post>", forward_s=seg["post"][0], backward_s=seg["post"][1],
                       weight_backward_s=share["<post>"] * seg["post"][1],
                       param_bytes=params["<post>"], activation_bytes=post_act, carry_bytes=carry[n],
                       carry_saved_bytes=carry_saved[n])
    costs = PipelineCosts(blocks=blocks, pre=pre, post=post, working_bytes=working,
                          state_bytes_per_param_byte=state_bytes_per_param_byte,
                          p2p_bytes_per_s=_p2p_bandwidth(options or {}),
                          microbatch_size=int(example_inputs[0].shape[0]) if example_inputs else 1,
                          pinned_cuts=tuple(sorted(set(seg.get("pipe_splits", ())))), weight_split=split)
    return costs, list(record.blocks)


def _unit_readers(problem) -> dict[int, list[int]]:
    """Unit id -> the ids of the units whose recomputation reads it (``Unit.inputs`` inverted)."""
    readers: dict[int, list[int]] = {}
    for u in problem.units:
        for i in u.inputs:
            readers.setdefault(i, []).append(u.id)
    return readers


def _weight_only_exposed(problem, solutions: Sequence[Any], w_only: frozenset[str], read_in_b: frozenset[str],
                         n: int, readers: dict[int, list[int]]) -> list[list[float]]:
    """Per block, per curve point (``solutions``: the HEU solution of each, None for the first),
    the exposed recompute seconds of units only W needs: a unit whose every storage the traced
    backward reads only in W (``w_only``; none in ``read_in_b``; from ``weight_split_census``), or an intermediate
    (read by no backward op, only by recomputed units) whose every reader (``readers``,
    ``_unit_readers``) is such a unit."""
    units = {u.id: u for u in problem.units}

    def mine(keys, u) -> bool:
        return any(k == u.name or k.startswith(u.name + "[") for k in keys)

    only_w = {u.id for u in problem.units if u.first_use is not None and mine(w_only, u) and not mine(read_in_b, u)}
    changed = True
    while changed:  # intermediates whose readers are all W's
        changed = False
        for u in problem.units:
            if u.id not in only_w and u.first_use is None and readers.get(u.id) and \
                    all(r in only_w for r in readers[u.id]):
                only_w.add(u.id)
                changed = True
    out = [[] for _ in range(n)]
    for sol in solutions:
        per_block = [0.0] * n
        for uid in (sol.demand if sol is not None else ()):
            u = units[uid]
            if u.block is not None and uid in only_w:
                per_block[u.block] += u.compute_s
        for b in range(n):
            out[b].append(per_block[b])
    return out


def _splits_weights(options: dict[str, Any]) -> bool:
    """Whether stages compiled with ``options`` split B from W (``runtime.weight_split``: the
    eager compiler, or Inductor with ``weight_split``; no side stream)."""
    from lynx_compile.config import LynxConfig

    compiler = options.get("compiler", LynxConfig.__dataclass_fields__["compiler"].default)
    return (compiler == "eager" or bool(options.get("weight_split"))) and not options.get("side_stream", False)


class _Traced(Exception):
    """Raised by the capturing partition once it holds the graphs: nothing needs to run."""


def traced_backward(module: nn.Module,
                    example_inputs: Sequence[Any]) -> tuple[fx.GraphModule, fx.GraphModule, list[bool]]:
    """(forward, backward, per graph input: is it a parameter) of ``module`` on
    ``example_inputs``, partitioned as lynx's eager compiler does when nothing is recomputed
    (``apply.partition_joint`` of the canonicalized joint). Compiles nothing and runs nothing."""
    from lynx_compile.recompute.apply import partition_joint
    from lynx_compile.dynamo_backend import find_backend_error

    got: list = []

    def partition(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **_):
        kw = dict(num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static_lifetime_input_indices)
        got.append(partition_joint(_compat.canonicalize_joint(joint), joint_inputs, kw, inductor=False))
        raise _Traced()

    def backend(gm: fx.GraphModule, inputs: list) -> Callable:
        got.append([isinstance(t, nn.Parameter) for t in inputs])  # dynamo's inputs: the backward's outputs
        return _compat.aot_autograd(fw_compiler=lambda g, _: g, partition_fn=partition)(gm, inputs)

    torch.compiler.reset()
    try:
        with torch.enable_grad():
            torch.compile(module, backend=backend, fullgraph=True)(*example_inputs)
    except Exception as e:  # noqa: BLE001 - dynamo wraps the partition's exception
        if find_backend_error(e, _Traced) is None:
            raise
    finally:
        torch.compiler.reset()
    if len(got) != 2:
        raise RuntimeError("tracing the model's backward gave no partitioned graph")
    (fw, bw), params = got[1], got[0]
    return fw, bw, params


def carry_bytes(module: nn.Module, example_inputs: Sequence[Any], block_paths: Sequence[str]) -> list[int]:
    """Per block of ``block_paths`` and, last, the post-block work: the bytes one micro-batch
    holds from B to W in a stage whose input has a gradient (module docstring)."""
    return weight_split_census(module, example_inputs, block_paths).carry


class WeightSplitCensus(NamedTuple):
    """What ``weight_split_census`` reads off the traced backward."""

    carry: list[int]
    """Per block, and last the post-block work: ``SegmentCost.carry_bytes``."""
    carry_saved: list[int]
    """The part of ``carry`` that is saved forward tensors: alive from F anyway, so B adds only
    the rest (``SegmentCost.carry_saved_bytes``)."""
    w_only: frozenset[str]
    read_in_b: frozenset[str]


def weight_split_census(module: nn.Module, example_inputs: Sequence[Any],
                        block_paths: Sequence[str]) -> WeightSplitCensus:
    """``carry_bytes`` and its saved part; the forward storages (``memory.simulate`` keys: an op's name, or
    ``name[i]`` for output i of a multi-output op) that the traced backward reads only in W; and
    those it reads in B. Read only in W:
    saved tensors no op of B reads, such as the input of a linear layer (``dW = dy.T @ x``; B's
    ``dx = dy @ W`` does not read x). A recompute of one of them runs in W
    (``runtime.weight_split``), where a zero-bubble schedule may place it in a bubble."""
    from lynx_compile.memory.simulate import backward_inputs
    from lynx_compile.memory.storage import allocations, storage_keys
    from lynx_compile.runtime.weight_split import ancestors, weight_side

    fw, bw, params = traced_backward(module, example_inputs)
    n = len(block_paths)
    outs = list(bw.graph.output_node().args[0])
    if len(outs) != len(params):  # the outputs cannot be matched to parameters (as WeightDeferral would not)
        return WeightSplitCensus([0] * (n + 1), [0] * (n + 1), frozenset(), frozenset())
    seg = _backward_segments(fw, bw, block_paths)
    # B: what flows into the backward of an earlier segment (lowest segment reachable, users first)
    low: dict[fx.Node, float] = {}
    for node in reversed(bw.graph.nodes):
        low[node] = min((min(seg.get(u, math.inf), low[u]) for u in node.users if u.op != "output"),
                        default=math.inf)
    b_set = ancestors([u for u in bw.graph.nodes if u.op == "call_function" and u in seg and low[u] < seg[u]])
    roots = [o for o, p in zip(outs, params) if p and isinstance(o, fx.Node)]
    root_set = set(roots)
    w_set, carried = weight_side(bw.graph, b_set, roots)
    input_keys, size = backward_inputs(fw, bw)  # saved tensors: their forward storage; parameters 0
    keys = storage_keys(bw, input_keys)
    for node in bw.graph.nodes:
        size.update(allocations(node))
    read_in_b: set[str] = set()
    read_in_w: set[str] = set()
    for ph in bw.graph.find_nodes(op="placeholder"):
        if ph.name.startswith("tangents") or ph not in keys:
            continue
        for u in ph.users:
            (read_in_w if u in w_set else read_in_b).add(keys[ph])
    saved_keys = {keys[ph] for ph in bw.graph.find_nodes(op="placeholder")
                  if ph in keys and not ph.name.startswith("tangents")}  # a view B takes of one shares it
    out, saved, seen = [0] * (n + 1), [0] * (n + 1), set()
    for c in carried:
        readers = [seg[u] for u in c.users if u in w_set and u in seg]
        readers += [seg[c]] if c in root_set and c in seg else []  # a weight gradient B computed
        if not readers or max(readers) < 0:  # read by the pre-block work's W: the first stage's, counted there
            continue
        multi = isinstance(c.meta.get("val"), (tuple, list))
        for key in ([k for k, _ in allocations(c)] if multi else [keys[c]]):
            if key not in seen:
                seen.add(key)
                out[max(readers)] += size.get(key, 0)
                if key in saved_keys:
                    saved[max(readers)] += size.get(key, 0)
    return WeightSplitCensus(out, saved, frozenset(read_in_w - read_in_b), frozenset(read_in_b))


def _backward_segments(fw: fx.GraphModule, bw: fx.GraphModule, block_paths: Sequence[str]) -> dict[fx.Node, int]:
    """Segment of each backward node: -1 before the blocks, b for block b, len(blocks) after.
    A forward node's is its module's (before / after the first block's first node when outside
    the blocks); a backward op takes its forward op's (``seq_nr``), saved tensors their forward
    value's, the output gradients the last; the rest (a gradient sum with no forward op) the
    latest segment among the gradients it reads."""
    from lynx_compile.passes.find_blocks import module_paths

    index = {p: b for b, p in enumerate(block_paths)}

    def block_of(node: fx.Node) -> int | None:
        for path in module_paths(node):
            parts = path.split(".")
            for k in range(len(parts), 0, -1):
                if ".".join(parts[:k]) in index:
                    return index[".".join(parts[:k])]
        return None

    n, fw_seg, by_seq = len(block_paths), {}, {}
    ops = [node for node in fw.graph.nodes if node.op == "call_function"]
    blocks = [block_of(node) for node in ops]
    inside = [i for i, b in enumerate(blocks) if b is not None]
    last = None
    for i, (node, b) in enumerate(zip(ops, blocks)):
        last = b if b is not None else last
        fw_seg[node.name] = b if b is not None else -1 if not inside or i < inside[0] else n if i > inside[-1] else last
        if "seq_nr" in node.meta:
            by_seq.setdefault(node.meta["seq_nr"], fw_seg[node.name])
    seg: dict[fx.Node, int] = {}
    for node in bw.graph.nodes:
        if node.op == "placeholder":
            if node.name in fw_seg:
                seg[node] = fw_seg[node.name]
            elif node.name.startswith("tangents"):
                seg[node] = n
        elif node.op == "call_function":
            s = by_seq.get(node.meta.get("seq_nr"))
            if s is None:
                grads = [a for a in node.all_input_nodes if a.op != "placeholder" or a.name.startswith("tangents")]
                s = max((seg[a] for a in grads if a in seg), default=None)
            if s is not None:
                seg[node] = s
    return seg


def _block_output_bytes(problem, n: int) -> list[int]:
    """Bytes of each block's last forward unit (the activation a stage boundary would send)."""
    out = [0] * n
    last: dict[int, int] = {}
    for u in problem.units:
        if u.block is not None and u.fw_pos >= last.get(u.block, -1):
            last[u.block] = u.fw_pos
            out[u.block] = u.nbytes
    return out


def _param_bytes(module: nn.Module, example_inputs: Sequence[Any], block_paths: list[str]) -> dict[str, int]:
    """Parameter bytes per block path, plus ``<pre>`` / ``<post>`` by module call order."""
    return _forward_census(module, example_inputs, block_paths)[0]


def _forward_census(module: nn.Module, example_inputs: Sequence[Any],
                    block_paths: list[str]) -> tuple[dict[str, int], dict[str, float]]:
    """One forward of ``module`` (no grad): per block path and ``<pre>`` / ``<post>`` (module
    call order), its parameter bytes and the weight-gradient share of its backward (module
    docstring)."""
    names = {m: name for name, m in module.named_modules()}
    order: list[str] = []
    matmuls: list[tuple[int, float, bool]] = []  # (index in ``order`` of the module running, FLOPs, reads a parameter)

    def hook(mod: nn.Module, args: Any) -> None:
        if mod in names:
            order.append(names[mod])

    handle = nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        with torch.no_grad(), _MatmulCensus({id(p) for p in module.parameters()},
                                            lambda flops, param: matmuls.append((len(order) - 1, flops, param))):
            module(*example_inputs)
    finally:
        handle.remove()

    # the traced paths (``_fn.__self__.blocks.3`` when the forward is a bound method of the
    # model) name the block modules as dynamo reached them; match them by module
    named = {b: names.get(_resolve(module, b), b) for b in block_paths}

    def block_of(path: str) -> str | None:
        return next((b for b, m in named.items() if path == m or path.startswith(m + ".")), None)

    first = next((i for i, p in enumerate(order) if block_of(p)), 0)
    last = max((i for i, p in enumerate(order) if block_of(p)), default=len(order))

    def side(i: int) -> str:
        blk = block_of(order[i]) if 0 <= i < len(order) else None
        return blk if blk else ("<pre>" if i < first else "<post>" if i > last else "<pre>")

    sides: dict[int, set[str]] = {}
    owner: dict[int, nn.Parameter] = {}
    for i, path in enumerate(order):
        mod = module.get_submodule(path) if path else module
        for p in mod.parameters(recurse=False):
            sides.setdefault(id(p), set()).add(side(i))
            owner[id(p)] = p
    params = {p: 0 for p in block_paths}
    params["<pre>"] = params["<post>"] = 0
    for pid, where in sides.items():
        p = owner[pid]
        for s in where:
            params[s] += p.numel() * p.element_size()
    flops = {s: [0.0, 0.0] for s in params}  # [all matmuls, those reading a parameter]
    for i, f, reads_param in matmuls:
        flops[side(i)][0] += f
        flops[side(i)][1] += f if reads_param else 0.0
    share = {s: w / (2 * total) if total else 0.0 for s, (total, w) in flops.items()}
    return params, share


class _MatmulCensus(_compat.dispatch_mode_base()):
    """Reports the FLOPs of every matmul-like aten op (torch's flop formulas) a forward runs and
    whether an operand is a parameter or a view of one (``W.t()``)."""

    def __init__(self, param_ids: set[int], report: Callable[[float, bool], None]):
        super().__init__()
        self.param_ids, self.report = param_ids, report

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        formula = flop_registry.get(FLOP_FORMULA_ALIASES.get(packet, packet))
        if formula is not None:
            try:
                flops = float(formula(*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a formula this op's arguments do not fit: not a matmul here
                return out
            self.report(flops, any(self._is_param(a) for a in args))
        return out

    def _is_param(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and (id(t) in self.param_ids or
                                                (t._base is not None and id(t._base) in self.param_ids))


def _resolve(module: nn.Module, path: str) -> Any:
    """The object at dotted ``path`` from ``module`` (attributes and module-list indices), or None."""
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _p2p_bandwidth(options: dict[str, Any]) -> float:
    """Bandwidth of the named ``link`` option, else of the hardware profile's default link."""
    from lynx_compile.costs import LINKS, get_profile

    link = options.get("link", "auto")
    if link in LINKS:
        return LINKS[link].bandwidth_bytes_per_s
    return LINKS[get_profile(options.get("hardware", "auto")).default_link].bandwidth_bytes_per_s


def output_selector(model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """For zoo-style models with ``logits(idx)``: the loss-free forward a pipeline should cut."""
    return getattr(model, "logits", None)
