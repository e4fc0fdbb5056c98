"""Recompute priced by kernel, as Inductor runs it (issue R item 1; ``costs.inductor_kernels``).

1. The rule on hand-built graphs, against the roofline formula computed by hand: a recomputed
   pointwise value read only by a loop kernel that runs anyway adds its FLOPs (and the bytes it
   reads beyond the saved value's read) to that kernel, no launch; read by a matmul, it is a
   kernel of its own (its reads, its write, a launch).
2. The kernels the model sees against the ones Inductor generated: an MLP model recomputed whole
   (policy ``full``) and compiled by Inductor; for every value the model computes inside another
   node's kernel, Inductor's scheduler lowered it into a kernel together with that node
   (``_compat.recording_kernels``: the FX origins of each scheduler node after fusion).
3. Candidates compete on it: lynx's own plan on gpt-tiny at 0.9 recomputes the GELU (read by a
   matmul: a kernel of its own) and the fc1 matmul, and its exposed recompute as the optimizer
   priced it equals the realized plan's, priced on its compiled backward.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import lynx_compile
from lynx_compile import _compat
from lynx_compile.costs.hardware import HardwareProfile
from lynx_compile.costs.inductor_kernels import kernels, recompute_seconds
from lynx_compile.passes import meta

N = 4096  # elements of each pointwise value (float32)

# round numbers: compute-bound when FLOPs are slow, memory-bound when bytes are
SLOW_FLOPS = HardwareProfile(name="t", peak_flops={"float32": 1e9}, memory_bandwidth_bytes_per_s=1e12,
                             memory_capacity_bytes=1 << 30, launch_overhead_s=1e-5, default_link="pcie4",
                             matmul_efficiency=0.5, memory_efficiency=0.5)
SLOW_BYTES = HardwareProfile(name="t", peak_flops={"float32": 1e15}, memory_bandwidth_bytes_per_s=1e9,
                             memory_capacity_bytes=1 << 30, launch_overhead_s=1e-5, default_link="pcie4",
                             matmul_efficiency=0.5, memory_efficiency=0.5)


def _graph(fn, *shapes):
    gm = make_fx(fn)(*(torch.randn(s) for s in shapes))
    return list(gm.graph.nodes), {n.name: n for n in gm.graph.nodes}


def _pointwise_read_by_pointwise(x):
    y = x * 2.0      # recomputed
    return y + 1.0   # a kernel that runs anyway


def _pointwise_read_by_matmul(x, w):
    y = x * 2.0      # recomputed
    return y @ w     # an extern kernel reads it from a buffer


def test_a_pointwise_recompute_inside_a_kernel_that_runs_anyway_adds_its_flops_and_no_launch():
    nodes, by = _graph(_pointwise_read_by_pointwise, (N,))
    y = by["mul"]
    # the add's kernel computes x * 2 inside it: reads x instead of y (the same bytes)
    assert [k.node.name for k in kernels(nodes)] == ["add"]
    # compute-bound: N more FLOPs at 1e9 * 0.5
    assert recompute_seconds(nodes, {y}, SLOW_FLOPS) == pytest.approx(N / (1e9 * 0.5), rel=1e-12)
    # memory-bound: the kernel reads x instead of y and writes the same: nothing added
    assert recompute_seconds(nodes, {y}, SLOW_BYTES) == 0.0


def test_a_pointwise_recompute_a_matmul_reads_is_a_kernel_of_its_own():
    nodes, by = _graph(_pointwise_read_by_matmul, (64, 64), (64, 64))
    y = by["mul"]
    assert {k.node.name for k in kernels(nodes)} == {"mul", "mm"}
    nbytes = 64 * 64 * 4
    # reads x, writes y, one launch
    expected = max(64 * 64 / (1e15 * 0.5), 2 * nbytes / (1e9 * 0.5)) + 1e-5
    assert recompute_seconds(nodes, {y}, SLOW_BYTES) == pytest.approx(expected, rel=1e-12)


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


class _MLP(nn.Module):
    def __init__(self, d: int = 32, layers: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def test_values_the_model_computes_inside_a_kernel_are_in_that_kernel_in_inductors_code():
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(4, 16, 32)
    compiled = torch.compile(model, backend=lynx_compile.backend(policy="full", plan_cache=False))
    with torch._inductor.config.patch(fx_graph_cache=False), _compat.recording_kernels() as seen:
        compiled(x).backward()
    bw = seen[-1]  # the backward compiles last, at its first run
    nodes = list(bw.graph.nodes)
    recomputed = {n.name for n in nodes if n.meta.get(meta.RECOMPUTED)}
    assert recomputed, "policy full recomputes the blocks"
    where: dict[str, set[int]] = {}
    for i, (names, _) in enumerate(bw.kernels):
        for name in names:
            where.setdefault(name, set()).add(i)
    together, apart, inside_kept = 0, [], 0
    for k in kernels(nodes):
        if not k.loop:
            continue
        for value in k.body[1:]:
            if value.name not in where:  # Inductor names no kernel after it: nothing to compare
                continue
            if where[value.name] & where.get(k.node.name, set()):
                together += 1
                inside_kept += value.name in recomputed and k.node.name not in recomputed
            else:
                apart.append((value.name, k.node.name))
    assert not apart, apart
    assert together >= 10, together
    # the recompute the model prices inside kernels that run anyway (the GELU and the norm inside
    # their gradients' kernels) is there in Inductor's code too
    assert inside_kept >= 2, inside_kept


def test_lynx_plans_price_the_recompute_as_it_is_compiled(monkeypatch):
    from _reach import reach_model
    from lynx_compile.planning import plan_model

    model, x = reach_model("gpt-tiny", monkeypatch)
    for p in model.parameters():
        p.grad = None
    rec, = plan_model(model, (x,), cost_source="analytic", hardware="h100-sxm", plan_cache=False,
                      memory_budget=0.9)
    assert rec.plan.solver == "opt-highs", rec.notes
    lynx = rec.stats["candidates"]["lynx"]
    # what the realized plan exposes, priced by kernel on its compiled backward, is what the
    # optimizer's model priced (one kernel per recomputed unit here: the matmul, and the GELU
    # a matmul reads)
    assert lynx["exposed_s"] > 0
    assert rec.plan.exposed_s == pytest.approx(lynx["exposed_s"], rel=1e-3)
    assert lynx["peak_bytes"] <= 0.9 * rec.reference_peak_bytes


def _held_toy():
    """h: a block's input (10 B) that only the recompute of a reads (not the backward): held.
    a: 100 B, read by the backward at event 1, recomputable from h in 1 ms. The forward peaks at
    110 B (h and a); the backward's start holds 50 B besides the kept units."""
    from lynx_compile.solver.problem import RematProblem, Unit

    h = Unit(id=0, name="h", nbytes=10, compute_s=1e-3, fw_pos=0, fw_last=1, first_use=None,
             need_start=1, need_end=1, recomputable=False)
    a = Unit(id=1, name="a", nbytes=100, compute_s=1e-3, inputs=(0,), fw_pos=1, fw_last=1, first_use=1,
             need_start=1, need_end=1)
    return RematProblem(units=(h, a), num_fw_events=2, num_bw_events=2, fw_base=(0, 0), bw_base=(50, 0),
                        reference_peak=150)


@pytest.mark.parametrize("solver", ["highs", "heu"])
def test_a_held_unit_is_kept_when_a_recompute_reads_it_and_never_recomputed(solver):
    """Hand-computed: at 160 B nothing is recomputed and h is dropped (the backward's start:
    50 + 100 B); at 120 B a is recomputed from h, which is then kept and counted (the backward:
    50 + 10 B at its start, 10 + 100 B at a's use; the forward's 110 B is the peak), never
    recomputed itself (the model holds the block input a recompute reads)."""
    from lynx_compile.solver.evaluate import evaluate
    from lynx_compile.solver.problem import InfeasibleBudget
    from lynx_compile.solver.solve import solve_remat

    pytest.importorskip("highspy") if solver == "highs" else None
    roomy = solve_remat(_held_toy(), 160, solver=solver)
    assert set(roomy.keep) == {1} and not roomy.demand and roomy.peak_bytes == 150
    tight = solve_remat(_held_toy(), 120, solver=solver)
    assert set(tight.demand) == {1} and set(tight.keep) == {0} and tight.peak_bytes == 110
    # below that, only a recomputed h would do, and it is not recomputable
    with pytest.raises(InfeasibleBudget):
        solve_remat(_held_toy(), 105, solver=solver)
    # the evaluator refuses a held unit recomputed
    assert evaluate(_held_toy(), ((), (0, 1))).violations


def _saved_index_values(fw_graph) -> set[str]:
    """Names of the values ``fw_graph`` (a forward Inductor compiled) saves for the backward
    that it computes from constants alone."""
    from lynx_compile.memory.inductor_model import index_values

    nodes = list(fw_graph.nodes)
    constant = index_values(nodes)
    out, = [n for n in nodes if n.op == "output"]
    return {a.name for a in out.all_input_nodes if a in constant}


def _node(graph, name):
    return next(n for n in graph.nodes if n.name == name)


def test_a_causal_mask_is_recomputed_inside_the_kernels_that_read_it():
    """A causal mask built in the graph (``ones(T, T).triu(1)``) is computed from constants
    alone. torch.compile's own partition saves it (a bool tensor: the cheapest to keep by bytes),
    so its forward writes it and its softmax kernels read it back; lynx under a budget recomputes
    it, and Inductor computes it inside the kernels that read it, in the forward and the
    backward: no kernel of its own, nothing saved, gradients as Inductor's."""
    from lynx_compile.models import build_model, example_batch

    torch.manual_seed(0)
    base = build_model("gpt-tiny", n_layers=2, seq_len=64, dropout=0.0, attn_impl="manual")
    idx = example_batch(base, 4)
    grads = {}
    for name, backend in (("inductor", "inductor"),
                          ("lynx", lynx_compile.backend(memory_budget=0.8, plan_cache=False))):
        torch._dynamo.reset()
        model = __import__("copy").deepcopy(base)
        with torch._inductor.config.patch(fx_graph_cache=False), _compat.recording_kernels() as seen:
            loss = torch.compile(model, backend=backend)(idx, idx)
            loss = loss[0] if isinstance(loss, tuple) else loss
            loss.backward()
        grads[name] = [p.grad for p in model.parameters()]
        fw, bw = seen[0], seen[-1]
        if name == "inductor":  # the reference: torch's partition saves the masks
            assert _saved_index_values(fw.graph), "torch.compile saves no mask"
            continue
        assert not _saved_index_values(fw.graph)
        from lynx_compile.memory.inductor_model import index_values

        constant = {n.name for n in index_values(list(bw.graph.nodes))}
        masks = {n for n in constant if getattr(_node(bw.graph, n).meta.get("val"), "dtype", None) == torch.bool}
        assert any(_node(bw.graph, m).meta.get(meta.RECOMPUTED) for m in masks), masks
        # no recomputed constant in a kernel of its own (the backward's own constants may be: torch
        # 2.11 writes out a `full` of its own); each mask is in a loop kernel with the ops reading it
        recomputed = {n.name for n in bw.graph.nodes if n.meta.get(meta.RECOMPUTED)}
        assert not [names for names, _ in bw.kernels if names <= constant and names & recomputed]
        for m in masks:
            assert any(loop and m in names and names - constant for names, loop in bw.kernels), m
    for a, b in zip(grads["inductor"], grads["lynx"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _win_toy():
    """a: 100 B read by the backward at event 1, recomputed in 1 us, its forward write 3 us
    (``Unit.write_s``); b: 100 B read at event 0, recomputed in 5 us, written anyway (write_s 0).
    Both kept, the backward's event 0 holds 200 B; a recomputed, 100 B at every event."""
    from lynx_compile.solver.problem import RematProblem, Unit

    a = Unit(id=0, name="a", nbytes=100, compute_s=1e-6, write_s=3e-6, fw_pos=0, fw_last=0, first_use=1,
             need_start=1, need_end=1)
    b = Unit(id=1, name="b", nbytes=100, compute_s=5e-6, fw_pos=1, fw_last=1, first_use=0, need_start=0,
             need_end=0)
    return RematProblem(units=(a, b), num_fw_events=2, num_bw_events=2, fw_base=(0, 0), bw_base=(0, 0),
                        reference_peak=200)


@pytest.mark.parametrize("solver", ["highs", "heu"])
def test_a_recompute_cheaper_than_its_forward_write_is_taken_at_any_budget(solver):
    """Hand-computed: with room for everything, recomputing a (1 us) saves its 3 us write, so the
    best plan recomputes it and keeps b: exposed 1 - 3 = -2 us; at 100 B one of them must go and
    it is a again (b would expose 5 us)."""
    from lynx_compile.solver.solve import solve_remat

    pytest.importorskip("highspy") if solver == "highs" else None
    for budget in (1000, 100):
        sol = solve_remat(_win_toy(), budget, solver=solver)
        assert set(sol.demand) == {0} and set(sol.keep) == {1}, (budget, sol)
        assert sol.exposed_s == pytest.approx(-2e-6, abs=1e-12)


def test_a_value_written_only_to_be_saved_is_computed_in_its_readers_kernel():
    """The values ``written_to_be_saved`` names in torch.compile's forward (its own partition,
    nothing recomputed) are returned for the backward and, in Inductor's generated code, computed
    in one kernel with a reader of theirs that is no output: not saved, they would be that
    kernel's interior values. The norm's normalized input (read only by its affine multiply) is
    among them; lynx's unit for it is priced at its write (``Unit.write_s``)."""
    from lynx_compile.memory.inductor_model import written_to_be_saved, value_readers

    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(4, 16, 32)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), _compat.recording_kernels() as seen:
        torch.compile(model, backend="inductor")(x).backward()
    fw = seen[0]
    nodes = list(fw.graph.nodes)
    written = written_to_be_saved(nodes)
    assert written, "torch.compile's forward saves no value of a norm"
    out, = [n for n in nodes if n.op == "output"]
    returned = {a for a in out.all_input_nodes}
    for v in written:
        readers = {r.name for r in value_readers(v) if r.op != "output"}
        assert v in returned or any(u in returned for u in v.users), v
        assert any(loop and v.name in names and names & readers for names, loop in fw.kernels), v.name
