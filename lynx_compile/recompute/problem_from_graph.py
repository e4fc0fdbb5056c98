"""Extract the recompute optimizer's ``RematProblem`` from a cost-annotated joint graph.

Reads ``meta.COST``, ``meta.BLOCK``, the record's block hashes, and the no-recompute partition
(``fw_ref``, ``bw_ref``: torch's default partition of the untagged joint graph), whose node
order is the event order of the problem. Returns the problem (plain data, no fx objects) and a
``UnitIndex`` mapping each unit back to the joint-graph nodes that make it up (its op, and the
views and getitems that alias its storage); ``unit_decisions`` turns a solution into the
``Decisions`` record ``apply_decisions_pass`` tags.

    joint ──(default partition, untagged)──▶ fw_ref, bw_ref ──simulate──▶ timelines
                                                   │
      units = forward storages (views folded into their base; a multi-output op is one unit)
      events = fw_ref nodes, then bw_ref nodes; need intervals from direct backward reads,
      closed over recompute consumers; windows = collective issue → wait in bw_ref
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch.fx as fx

from lynx_compile.costs import is_free_node, tensor_bytes_of
from lynx_compile.graph.collectives import is_collective_node, is_wait_node
from lynx_compile.memory.inductor_model import index_values, is_loop_kernel, reads_in_loop, written_to_be_saved
from lynx_compile.decisions import DEMAND, KEEP, OFFLOAD, Decisions
from lynx_compile.decisions import Window as DecisionWindow
from lynx_compile.memory.simulate import backward_inputs, held_tangents, simulate_graph
from lynx_compile.memory.storage import allocations, storage_keys
from lynx_compile.recompute.regions import problem_caps
from lynx_compile.solver.problem import CommWindow, RematProblem, Unit

from lynx_compile.passes import meta
from lynx_compile.passes.context import PassContext
from lynx_compile.passes.find_blocks import structural_hash
from lynx_compile.passes.offload import copy_seconds, cover_after


@dataclass(frozen=True)
class UnitIndex:
    """unit id → names of the joint nodes to tag when the unit is recomputed."""

    nodes: tuple[tuple[str, ...], ...]
    free: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(name, its nodes) of each value every plan of the solver recomputes and no unit holds:
    under Inductor, one computed from constants alone (``inductor_model.index_values``: a causal
    mask), which each kernel reading it computes from its indices at no cost; saving it costs a
    write and a read from memory in every reader."""


def _cost(node: fx.Node | None) -> float:
    c = node.meta.get(meta.COST) if node is not None else None
    return c.runtime_s if c is not None else 0.0


def extract_remat_problem(joint: fx.GraphModule, fw_ref: fx.GraphModule, bw_ref: fx.GraphModule,
                          ctx: PassContext) -> tuple[RematProblem, UnitIndex]:
    fw_nodes = list(fw_ref.graph.nodes)
    bw_nodes = list(bw_ref.graph.nodes)
    joint_by_name = {n.name: n for n in joint.graph.nodes}
    fw_keys = storage_keys(fw_ref, {})

    # Units: forward ops that allocate. key (storage) → unit op.
    unit_ops = [n for n in fw_nodes if allocations(n) and n.name in ctx.forward_names]
    owner: dict[str, fx.Node] = {k: op for op in unit_ops for k, _ in allocations(op)}
    owner.update({op.name: op for op in unit_ops})  # a multi-output op's own key
    members: dict[fx.Node, list[str]] = defaultdict(list)  # unit op → itself, views, getitems
    for n in fw_nodes:
        if n.op == "call_function" and fw_keys[n] in owner:
            members[owner[fw_keys[n]]].append(n.name)
    pos_fw = {n: i for i, n in enumerate(fw_nodes)}

    # Forward reads, and the unit inputs of each unit's recomputation.
    fw_last: dict[fx.Node, int] = {op: pos_fw[op] for op in unit_ops}
    inputs: dict[fx.Node, set[fx.Node]] = defaultdict(set)
    readers: dict[str, set[fx.Node]] = defaultdict(set)  # storage key → units whose op reads it
    for n in fw_nodes[:-1]:
        for a in n.all_input_nodes:
            src = owner.get(fw_keys[a])
            if src is None or fw_keys[n] == fw_keys[a]:
                continue  # a view of the storage reads nothing: its own readers do (the views
                # min-cut makes at the forward's end to save are no forward read)
            fw_last[src] = max(fw_last[src], pos_fw[n])
            user_unit = owner.get(fw_keys[n]) if n.op == "call_function" else None
            if user_unit is not None and user_unit is not src:
                inputs[user_unit].add(src)
                readers[fw_keys[a]].add(user_unit)

    # Direct backward reads of each unit's storage.
    input_keys, _ = backward_inputs(fw_ref, bw_ref)
    bw_keys = storage_keys(bw_ref, input_keys)
    uses: dict[fx.Node, list[int]] = defaultdict(list)
    bw_reads: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = defaultdict(list)  # (reader, value read)
    bw_read: set[str] = set()
    for p, n in enumerate(bw_nodes[:-1]):
        for a in n.all_input_nodes:
            src = owner.get(bw_keys[a])
            if src is not None:
                uses[src].append(p)
                bw_reads[src].append((n, a))
                bw_read.add(bw_keys[a])

    region = {op: joint_by_name[op.name].meta.get(meta.BLOCK) if op.name in joint_by_name else None
              for op in unit_ops}
    if ctx.config.compiler == "inductor":
        unit_ops = _fold_fused(unit_ops, inputs, uses, region, members, joint_by_name)
    # A tensor that crosses a block boundary (the residual stream into the next block) stays
    # saved, as every block-wise checkpointing scheme does: it keeps each block's recompute
    # local, so need intervals are closed over consumers of the same block only.
    boundary = {i for op, ins in inputs.items() for i in ins if region[i] != region[op]}
    local_inputs = {op: {i for i in ins if region[i] == region[op]} for op, ins in inputs.items()}
    # a unit that is never recomputed (a collective: an expert-parallel all-to-all) reads its
    # inputs in the forward only: it does not make them needed in the backward
    fixed = {op for op in unit_ops if not _recomputable(joint_by_name.get(op.name), ctx)}
    need = _need_intervals(unit_ops, {op: ins for op, ins in local_inputs.items() if op not in fixed}, uses)
    # a boundary tensor the backward does not read that a unit's recompute reads (the residual
    # stream a block's first norm is recomputed from) is a unit too, held: kept when a
    # recomputed unit reads it, else dropped; never recomputed (block-local recompute)
    held = set()
    for op in [op for op in unit_ops if op in need and op not in fixed]:
        for i in inputs[op]:
            if region[i] != region[op] and (i not in need or i in held):
                start, end = need[op]
                need[i] = (min(start, need[i][0]), max(end, need[i][1])) if i in held else (start, end)
                held.add(i)
    kept = [op for op in unit_ops if op in need]
    free = _free_units(kept, members, joint, joint_by_name) if ctx.config.compiler == "inductor" else []
    kept = [op for op in kept if op not in free]
    ids = {op: i for i, op in enumerate(kept)}
    must = {op: (op in boundary and op not in held) or not _recomputable(joint_by_name.get(op.name), ctx)
            for op in kept}
    parts = {op: _output_bytes(op, fw_keys, fw_nodes, bw_read, readers, must, joint_by_name, ctx) for op in kept}
    profile = joint.meta.get(meta.KERNEL_PROFILE)  # Inductor: priced by kernel
    written = written_to_be_saved(fw_nodes) if profile is not None else set()
    units = []
    for op in kept:
        start, end = need[op]
        units.append(Unit(
            id=ids[op], name=op.name,
            nbytes=sum(parts[op]),
            compute_s=_unit_seconds(op, members[op], joint_by_name, bw_reads[op], profile),
            write_s=profile.memory_seconds(parts[op][0]) if op in written and parts[op][0] else 0.0,
            inputs=tuple(sorted(ids[i] for i in inputs[op] if i in ids)),
            block=region[op], fw_pos=pos_fw[op], fw_last=fw_last[op],
            first_use=min(uses[op]) if uses[op] else None, need_start=start, need_end=end,
            must_keep=must[op], recomputable=op not in held))
    if ctx.config.offload:
        units = _price_offload(units, kept, fw_nodes, bw_nodes, joint_by_name,
                               lambda nbytes: copy_seconds(ctx, nbytes))

    fused = ctx.config.compiler == "inductor"  # bytes outside the units: as Inductor runs them
    # the reference saves what the backward reads directly (to the forward's end); the other
    # outputs a recompute may read are freed after their last forward read, there
    fw_base = _base(simulate_graph(fw_ref, live_inputs={}, input_keys={}, fused=fused).timeline,
                    [iv for op, u in zip(kept, units) for iv in (
                        (u.fw_pos, len(fw_nodes) - 1, parts[op][0]), (u.fw_pos, u.fw_last, parts[op][1]))])
    _, live = backward_inputs(fw_ref, bw_ref)
    # the gradients the backward returns pile up to its end whatever is recomputed: base bytes
    bw_mem = simulate_graph(bw_ref, live_inputs=live, input_keys=input_keys, count_outputs=True, fused=fused,
                            held_inputs=held_tangents(live))
    bw_base = _base(bw_mem.timeline, [(0, max(uses[op]), parts[op][0]) for op in kept if uses[op]])
    problem = RematProblem(
        units=tuple(units), num_fw_events=len(fw_nodes), num_bw_events=len(bw_nodes),
        fw_base=fw_base, bw_base=bw_base,
        windows=_windows(bw_nodes, joint_by_name, ctx.record.stats.get("fsdp_window_s", 0.0))
        if ctx.config.windows else (),
        block_groups=_block_groups(ctx.record.block_hashes), reference_peak=ctx.record.reference_peak_bytes or 0,
        graph_hash=structural_hash(list(joint.graph.nodes)),
        region_caps=problem_caps(ctx.region_check, units))
    return problem, UnitIndex(nodes=tuple(tuple(members[op]) for op in kept),
                              free=tuple((op.name, tuple(members[op])) for op in free))


def _free_units(ops: list[fx.Node], members: dict[fx.Node, list[str]], joint: fx.GraphModule,
                joint_by_name: dict[str, fx.Node]) -> list[fx.Node]:
    """The units among ``ops`` whose nodes are all computed from constants alone
    (``UnitIndex.free``)."""
    constant = index_values(list(joint.graph.nodes))
    return [op for op in ops if all(joint_by_name.get(m) in constant for m in members[op])]


def _output_bytes(op, fw_keys, fw_nodes, bw_read, readers, must, joint_by_name, ctx) -> tuple[int, int]:
    """(bytes the backward reads directly, bytes only a recompute may read) of a unit's outputs.

    A single-output op's storage is both what the backward reads and its unit. An output of a
    multi-output op that neither the backward reads nor any recomputable op does (dropout's
    output feeding the block's last residual add: only its mask is saved) is freed after its
    last forward read under every plan: it is not the unit's, so no plan keeps it."""
    taken = [(k, b) for k, b in allocations(op) if _taken(k, op, fw_keys, fw_nodes)]
    if len(taken) <= 1:
        total = sum(b for _, b in taken)
        return (total, 0) if any(k in bw_read for k, _ in taken) else (0, total)
    direct = sum(b for k, b in taken if k in bw_read)

    def recomputable(reader) -> bool:
        return not must[reader] if reader in must else _recomputable(joint_by_name.get(reader.name), ctx)
    via = sum(b for k, b in taken if k not in bw_read and any(recomputable(r) for r in readers.get(k, ())))
    return direct, via


def _price_offload(units, ops, fw_nodes, bw_nodes, joint_by_name, copy_s) -> list[Unit]:
    """Units read by the backward that hold a floating-point tensor get their offload price
    and live intervals (the copy model of ``passes/offload.py``, on the reference schedule)."""
    import dataclasses

    import torch

    fw_cost = [_cost(joint_by_name.get(n.name) or n) for n in fw_nodes[:-1]]
    bw_cost = [_cost(joint_by_name.get(n.name) or n) if n.op != "placeholder" else 0.0 for n in bw_nodes]
    out = []
    for u, op in zip(units, ops):
        val = op.meta.get("val")
        if u.first_use is None or not u.nbytes or not isinstance(val, torch.Tensor) \
                or not val.dtype.is_floating_point:
            out.append(u)
            continue
        t = copy_s(u.nbytes)
        k_fw, exp_fw = cover_after(fw_cost[u.fw_pos + 1:], t)
        k_bw, exp_bw = cover_after(bw_cost[:u.need_start][::-1], t)
        out.append(dataclasses.replace(u, offload_s=t, offload_exposed_s=exp_fw + exp_bw,
                                       offload_fw_end=max(u.fw_last, u.fw_pos + k_fw),
                                       offload_bw_start=u.need_start - k_bw))
    return out


def _unit_seconds(op: fx.Node, members: list[str], joint_by_name: dict[str, fx.Node],
                  bw_reads: list[tuple[fx.Node, fx.Node]], profile) -> float:
    """Seconds recomputing unit ``op`` (its nodes: ``members``) costs: the sum of its nodes'
    costs, or, priced by kernel (``profile``: Inductor compiles the graph), a unit of loop ops
    costs what ``costs.inductor_kernels.fused_unit_seconds`` says: what it adds to the kernels
    reading it where every backward reader reads it in a loop kernel, else one
    kernel of its own (``bw_reads``: each backward node reading it, and the value it reads). Its recomputed forward readers are not known here: a matmul among them
    reads it from a buffer, which this price leaves out."""
    nodes = [n for m in dict.fromkeys(members) if (n := joint_by_name.get(m)) is not None]
    if profile is None or not nodes or not all(is_loop_kernel(n) or is_free_node(n) for n in nodes):
        return sum(_cost(n) for n in nodes)
    from lynx_compile.costs.inductor_kernels import fused_unit_seconds

    inside = set(nodes)
    external = [i for n in nodes for i in n.all_input_nodes if i not in inside]
    out = joint_by_name.get(op.name, op)
    in_loop = bool(bw_reads) and all(reads_in_loop(r, a) for r, a in bw_reads)
    return fused_unit_seconds([n for n in nodes if not is_free_node(n)], external,
                              tensor_bytes_of(out), in_loop, profile)


def _fold_fused(unit_ops, inputs, uses, region, members, joint_by_name) -> list[fx.Node]:
    """Under Inductor, fold pointwise intermediates into the units that consume them.

    A pointwise op (or a constant: an op with no inputs, e.g. ``full``) whose output the
    backward never reads directly, and whose consumers all lie in its block, is recomputed (if
    at all) inside its consumer's fused kernel: it never materializes, so it is no unit of its
    own (as a unit, the memory model would count it live beside its consumer). Its nodes join
    each consumer's members (tagged with it; the unit's cost is its members' costs, each node
    once), its inputs become the consumer's inputs. Forward order, so chains fold whole. Mutates ``inputs`` and ``members``; returns the remaining unit ops."""
    consumers: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for op, ins in inputs.items():
        for i in ins:
            consumers[i].append(op)
    folded: set[fx.Node] = set()
    for op in unit_ops:
        joint_node = joint_by_name.get(op.name)
        cons = consumers.get(op, [])
        fusible = joint_node is not None and (_is_pointwise(joint_node) or not joint_node.all_input_nodes)
        if uses.get(op) or not cons or not fusible or any(region[c] != region[op] for c in cons):
            continue
        folded.add(op)
        for c in cons:
            inputs[c].discard(op)
            inputs[c].update(inputs.get(op, ()))
            members[c].extend(members[op])
            for i in inputs.get(op, ()):
                consumers[i].append(c)
    for op in folded:
        inputs.pop(op, None)
    return [op for op in unit_ops if op not in folded]


def _is_pointwise(node: fx.Node) -> bool:
    import torch

    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.pointwise in tags


def _taken(key: str, op: fx.Node, keys: dict, nodes: list) -> bool:
    """Whether output ``key`` of ``op`` outlives the op (some getitem takes it)."""
    return not key.endswith("]") or any(keys.get(n) == key for n in op.users)


def _need_intervals(unit_ops, inputs, uses) -> dict[fx.Node, tuple[int, int]]:
    """[need_start, need_end] per unit needed by the backward, directly or through a
    recomputed consumer (consumers first: reverse forward order)."""
    consumers: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for op, ins in inputs.items():
        for i in ins:
            consumers[i].append(op)
    need: dict[fx.Node, tuple[int, int]] = {}
    for op in reversed(unit_ops):
        starts = [need[c][0] for c in consumers[op] if c in need]
        direct = uses.get(op, [])
        if not direct and not starts:
            continue
        need[op] = (min([*direct, *starts]), max([*direct, *starts]))
    return need


def _recomputable(node: fx.Node | None, ctx: PassContext) -> bool:
    from lynx_compile.recompute.baselines import _recomputable as policy_recomputable

    return node is not None and policy_recomputable(node, ctx) and not is_collective_node(node)


def _base(timeline: list[tuple[str, int]], intervals: list[tuple[int, int, int]]) -> tuple[int, ...]:
    """Timeline bytes minus the units' own bytes over their no-recompute live intervals."""
    delta = [0] * (len(timeline) + 1)
    for start, end, nbytes in intervals:
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    out, running = [], 0
    for t, (_, total) in enumerate(timeline):
        running += delta[t]
        out.append(max(0, total - running))
    return tuple(out)


def _windows(bw_nodes: list[fx.Node], joint_by_name: dict, fsdp_s: float = 0.0) -> tuple[CommWindow, ...]:
    """The backward's collectives, issue to wait; with ``fsdp_s`` > 0 first FSDP2's window at
    the backward's start (``distributed/fsdp.py``: the collectives outside the graph that
    outlast its compute by ``fsdp_s``)."""
    pos = {n: i for i, n in enumerate(bw_nodes)}
    windows = []
    if fsdp_s > 0:
        from lynx_compile.distributed.fsdp import WINDOW

        start = next((i for i, n in enumerate(bw_nodes) if n.op != "placeholder"), 0)
        windows.append(CommWindow(id=0, start=start, end=start, duration_s=fsdp_s, kind="fsdp", name=WINDOW))
    for n in bw_nodes:
        if not is_collective_node(n):
            continue
        waits = [u for u in n.users if is_wait_node(u)]
        if not waits:
            continue
        windows.append(CommWindow(id=len(windows), start=pos[n], end=min(pos[w] for w in waits),
                              duration_s=_cost(joint_by_name.get(n.name) or n), kind=str(n.target),
                              name=n.name))
    return tuple(windows)


def _block_groups(hashes: list[str]) -> tuple[tuple[int, ...], ...]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, h in enumerate(hashes):
        groups[h].append(i)
    return tuple(tuple(g) for g in groups.values())


def unit_decisions(problem: RematProblem, index: UnitIndex, solution, source: str = "solver") -> Decisions:
    """The solver's ``RematSolution`` as the typed record: per unit keep / demand / window
    (named by its collective) / offload, each unit covering the joint nodes ``index`` lists."""
    units = {u.name: KEEP for u in problem.units}
    for i in solution.demand:
        units[problem.units[i].name] = DEMAND
    windows = {w.id: w.name for w in problem.windows}
    for i, w in solution.window:
        units[problem.units[i].name] = DecisionWindow(windows[w])
    for i in getattr(solution, "offload", ()):
        units[problem.units[i].name] = OFFLOAD
    members = {u.name: names for u, names in zip(problem.units, index.nodes)}
    for name, names in index.free:
        units[name], members[name] = DEMAND, names
    return Decisions.make("lynx", units, members, source)


def decisions_from_backward(bw: fx.GraphModule, policy: str, problem: RematProblem | None,
                            index: UnitIndex | None) -> Decisions:
    """What a partition that was not made from a ``Decisions`` record (torch's min-cut)
    recomputes, read back from its backward (after ``mark_recomputed_pass``): per unit of
    ``problem`` when there is one (demand if any of its nodes is recomputed), else per node."""
    recomputed = {n.meta.get(meta.RECOMPUTED_FROM) for n in bw.graph.nodes if n.meta.get(meta.RECOMPUTED)}
    if problem is None or index is None:
        return Decisions.make(policy, dict.fromkeys((r for r in recomputed if r), DEMAND))
    units = {u.name: DEMAND if recomputed.intersection(names) else KEEP
             for u, names in zip(problem.units, index.nodes)}
    return Decisions.make(policy, units, {u.name: names for u, names in zip(problem.units, index.nodes)})
