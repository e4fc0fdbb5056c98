"""What Inductor compiles, as lynx shapes and reports it (``lynx_compile.compiler.inductor_partition``): the
post-grad passes ``split_late_addmm_pass`` (Inductor's ``mm + add -> addmm`` fusion moved a tied
weight's gradient matmul to the end of the backward), ``split_shared_pointwise_pass`` and no
wrapper buffer reuse (Llama's recomputed MLP held past its matmuls), run by the pass runner
(``disable_passes``, timings in the record), and ``CompiledPeak`` (Inductor's own memory
estimate of the fused schedule, recorded on the plan).

References: the CPU allocator's measured peak of the step (``measure_step``), eager PyTorch for
values, and hand-built FX graphs for the pass's placement.
"""
import copy
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import lynx_compile
from lynx_compile import _compat
from lynx_compile.compiler.dynamo_backend import find_backend_error
from lynx_compile.decisions import BudgetError
from lynx_compile.config import make_config
from lynx_compile.memory import measure_step
from lynx_compile.models import build_model, example_batch
from lynx_compile.passes import GraphRecord, PassContext, split_late_addmm_pass, split_shared_pointwise_pass

aten = torch.ops.aten


def _run(post_grad_pass, g: fx.Graph) -> None:
    """``post_grad_pass`` on ``g`` in place, as Inductor's post-grad hook runs it (the graph's
    module, a context)."""
    ctx = PassContext(config=make_config({}), record=GraphRecord(graph_id=0, policy="full"), num_fwd_outputs=0)
    assert post_grad_pass(fx.GraphModule({}, g), ctx).graph is g


def _graph(late_inp: bool, rows: int = 64):
    """``addmm(inp, a, b)`` with a (rows x 8) @ (8 x 4) matmul; ``inp`` computed after both
    operands (``late_inp``, as a tied weight's second gradient) or a graph input (a bias)."""
    g = fx.Graph()
    x, w, c = g.placeholder("x"), g.placeholder("w"), g.placeholder("c")
    vals = {"x": torch.randn(8, rows), "w": torch.randn(rows, 4), "c": torch.randn(8, 4)}
    a = g.call_function(aten.relu.default, (x,))
    b = g.call_function(aten.neg.default, (w,))
    filler = g.call_function(aten.sin.default, (c,))
    inp = g.call_function(aten.cos.default, (filler,)) if late_inp else c
    mm = g.call_function(aten.addmm.default, (inp, a, b))
    g.output(mm)
    fake = {"x": vals["x"], "w": vals["w"], "c": vals["c"]}
    for n in g.nodes:  # the metadata Inductor's post-grad graphs carry
        if n.op == "placeholder":
            n.meta["val"] = fake[n.name]
        elif n.op == "call_function":
            args = [m.meta["val"] if isinstance(m, fx.Node) else m for m in n.args]
            n.meta["val"] = n.target(*args)
    return g, vals


def test_split_late_addmm_moves_the_matmul_to_its_operands():
    g, vals = _graph(late_inp=True)
    want = fx.GraphModule({}, copy.deepcopy(g))(**vals)
    _run(split_late_addmm_pass, g)
    nodes = [n for n in g.nodes if n.op == "call_function"]
    assert [n.target for n in nodes] == [aten.relu.default, aten.neg.default, aten.mm.default,
                                         aten.sin.default, aten.cos.default, aten.add.Tensor]
    torch.testing.assert_close(fx.GraphModule({}, g)(**vals), want)


@pytest.mark.parametrize("case", ["bias", "output_larger"])
def test_split_late_addmm_leaves_other_addmms(case):
    """A bias addmm (``inp`` before the operands), and a late one whose matmul output is larger
    than the operands it would free (rows=2: 8x4 out vs 8x2 + 2x4), stay fused."""
    g, _ = _graph(late_inp=case == "output_larger", rows=2 if case == "output_larger" else 64)
    before = [n.target for n in g.nodes]
    _run(split_late_addmm_pass, g)
    assert [n.target for n in g.nodes] == before


def _mlp_graph(g_read_later: bool):
    """Llama's recomputed MLP in the backward, by hand: ``s = silu(g)`` read by ``h = s * u``
    (whose matmul ``dwd`` comes first) and by ``dhs = dh * s`` (which waits for the matmul
    ``dh``). ``g_read_later``: g is also an output (alive to the end, as Llama's silu backward
    reads it), else the silu is its last reader."""
    g = fx.Graph()
    ph = {k: g.placeholder(k) for k in ("x", "wg", "wu", "wd", "dy")}
    vals = {"x": torch.randn(6, 4), "wg": torch.randn(4, 5), "wu": torch.randn(4, 5),
            "wd": torch.randn(5, 3), "dy": torch.randn(6, 3)}
    gate = g.call_function(aten.mm.default, (ph["x"], ph["wg"]))
    up = g.call_function(aten.mm.default, (ph["x"], ph["wu"]))
    s = g.call_function(aten.silu.default, (gate,))
    h = g.call_function(aten.mul.Tensor, (s, up))
    dwd = g.call_function(aten.mm.default, (g.call_function(aten.t.default, (h,)), ph["dy"]))
    dh = g.call_function(aten.mm.default, (ph["dy"], g.call_function(aten.t.default, (ph["wd"],))))
    dhs = g.call_function(aten.mul.Tensor, (dh, s))
    g.output((dwd, dhs, gate) if g_read_later else (dwd, dhs))
    for n in g.nodes:
        if n.op == "placeholder":
            n.meta["val"] = vals[n.name]
        elif n.op == "call_function":
            n.meta["val"] = n.target(*[m.meta["val"] if isinstance(m, fx.Node) else m for m in n.args])
    return g, vals


def test_split_shared_pointwise_gives_the_late_consumer_its_own_silu():
    """Fused with both consumers, the silu's kernel would wait for ``dh`` and ``h`` with it;
    after the pass ``h``'s kernel can run before ``dwd``, and ``dhs`` recomputes the silu."""
    g, vals = _mlp_graph(g_read_later=True)
    want = fx.GraphModule({}, copy.deepcopy(g))(**vals)
    _run(split_shared_pointwise_pass, g)
    silus = [n for n in g.nodes if n.target is aten.silu.default]
    assert len(silus) == 2 and all(len(s.users) == 1 for s in silus)
    order = {n: i for i, n in enumerate(g.nodes)}
    late = max(silus, key=order.get)
    (consumer,) = late.users
    assert consumer.args[0].target is aten.mm.default and order[consumer.args[0]] < order[late]  # after dh
    for got, ref in zip(fx.GraphModule({}, g)(**vals), want):
        torch.testing.assert_close(got, ref)


def test_split_shared_pointwise_keeps_one_silu_when_a_copy_would_hold_its_input():
    """A copy for ``dhs`` would keep g alive until ``dh``, where it is otherwise freed: no copy."""
    g, _ = _mlp_graph(g_read_later=False)
    before = [n.target for n in g.nodes]
    _run(split_shared_pointwise_pass, g)
    assert [n.target for n in g.nodes] == before


class _TiedLM(torch.nn.Module):
    """An embedding tied to the LM head: the weight's gradient is the head's matmul plus the
    embedding's scatter, which Inductor fuses into one ``addmm`` at the scatter, at the end of
    the backward (what ``split_late_addmm_pass`` undoes)."""

    def __init__(self, vocab: int = 128, dim: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)

    def forward(self, ids):
        logits = torch.relu(self.mix(self.emb(ids))) @ self.emb.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _tied_backward_code(disabled: tuple[str, ...]):
    """(Inductor's generated backward, the graph's record) of ``_TiedLM`` under ``full``."""
    from torch._inductor.utils import run_and_get_code

    torch.compiler.reset()
    torch.manual_seed(0)
    model = _TiedLM()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    backend = lynx_compile.backend(policy="full", plan_cache=False, disable_passes=disabled)
    compiled = torch.compile(model, backend=backend)
    with _no_fx_cache():  # a hit would skip the post-grad passes (and their timings)
        _, codes = run_and_get_code(lambda: compiled(ids).backward())
    return codes[-1], backend.records[-1]


def test_disable_passes_turns_a_post_grad_pass_off_and_times_the_others():
    """The post-grad passes run in the pass runner: ``disable_passes`` turns
    ``split_late_addmm_pass`` off (Inductor's generated backward keeps its ``addmm`` of the tied
    weight's gradient; with the pass that is an ``mm`` and an add), and every post-grad pass of
    the forward and the backward has a timing in the record, stage ``"post_grad"``, the
    disabled one marked skipped."""
    names = ["split_late_addmm_pass", "split_shared_pointwise_pass", "pin_windows_pass"]
    on, on_record = _tied_backward_code(())
    off, off_record = _tied_backward_code(("split_late_addmm_pass",))
    assert off.count("extern_kernels.addmm(") == on.count("extern_kernels.addmm(") + 1, (on, off)
    assert off.count("extern_kernels.mm(") == on.count("extern_kernels.mm(") - 1, (on, off)
    ran = [(t.name, t.skipped) for t in on_record.timings if t.stage == "post_grad"]
    assert ran == [(n, False) for n in names] * 2, ran  # the forward's, then the backward's
    skipped = [(t.name, t.skipped) for t in off_record.timings if t.stage == "post_grad"]
    assert skipped == [(n, n == "split_late_addmm_pass") for n in names] * 2, skipped


def test_post_grad_hook_cache_key_names_the_passes_that_run():
    """Inductor's FX-graph cache keys the post-grad hook by its uuid: the same in every compile
    of one configuration, different when a pass is disabled (a graph compiled without the pass
    is not served the code of one compiled with it) or when lynx's sources change (its digest)."""
    from lynx_compile._compat.keyed_passes import _chained_post_grad_pass
    from lynx_compile.compiler.inductor_partition import LynxPostGrad

    def uuid(digest="lynx-sources", **options):
        record = GraphRecord(graph_id=0, policy="full")
        return _chained_post_grad_pass(None, LynxPostGrad(make_config(options), record), digest).uuid()

    assert uuid() == uuid()
    assert uuid(digest="other-sources") != uuid()
    assert uuid(disable_passes=("pin_windows_pass",)) != uuid()
    assert uuid(disable_passes=("pin_windows_pass",)) == uuid(disable_passes=("pin_windows_pass",))


def _llama_full_peak(lynx_settings: bool) -> tuple[int, int]:
    """HF Llama (2 layers, hidden 64, seq 64, batch 2, eager attention) under ``full``:
    (measured step peak, lynx's predicted peak). ``lynx_settings=False``: as before the fix,
    Inductor's wrapper buffer reuse on and ``split_shared_pointwise_pass`` disabled."""
    from foreign_models import hf_llama

    torch.compiler.reset()
    torch.manual_seed(0)
    model = hf_llama(vocab_size=128, seq_len=64, n_layers=2, hidden=64, n_heads=4, n_kv_heads=1,
                             attn="eager")
    idx = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    disabled = () if lynx_settings else ("split_shared_pointwise_pass",)
    # the gradients returned (the pile), as when these numbers were taken: the test is of Inductor's fusion
    # before: Inductor's own buffer reuse rule (lynx's, option buffer_reuse, holds nothing above the plan)
    backend = lynx_compile.backend(policy="full", plan_cache=False, disable_passes=disabled,
                                   accumulate_grad_in_graph=False, buffer_reuse=lynx_settings)
    first = len(backend.records)  # the backend is shared with every compile of the same options
    compiled = torch.compile(model, backend=backend)
    saved = _compat.INDUCTOR_KEEP_PLACEMENT["allow_buffer_reuse"]
    if not lynx_settings:
        _compat.INDUCTOR_KEEP_PLACEMENT["allow_buffer_reuse"] = True
    try:
        with _no_fx_cache():
            compiled(input_ids=idx, labels=idx).loss.backward()
    finally:
        _compat.INDUCTOR_KEEP_PLACEMENT["allow_buffer_reuse"] = saved
    m = measure_step(lambda: compiled(input_ids=idx, labels=idx).loss.backward(), repeats=1, warmup=0,
                     params=list(model.parameters()))
    _LLAMA_PARAMS[:] = list(model.parameters())
    return m.peak_bytes, max(r.plan.peak_bytes for r in backend.records[first:] if r.plan is not None)


_LLAMA_PARAMS: list = []


def test_hf_llama_full_measured_peak_near_the_prediction(monkeypatch):
    """The cause, measured on CPU: in each block's recomputed MLP, Inductor fused ``silu(gate)``
    with both its consumers, so ``h = silu(gate) * up`` waited for the matmul ``dh`` and gate,
    up, dh, h and ``dh * silu(gate)`` were alive at once (lynx frees h first); and its wrapper
    kept freed buffers (a block's attention scores) alive to reuse their storage later. Before:
    1.21x the prediction (4 layers: 1.20x); with ``split_shared_pointwise_pass`` and no buffer reuse
    1.02x; since lynx's fused model reads ``dh * up`` where the silu-backward kernel computes it
    (after the input-gradient matmuls, so dh and up live until then), computes constants inline
    and writes kernels in place (``memory.simulate``), within 0.5% (4 layers: 921600 B
    predicted, 921608 B measured)."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    after, predicted = _llama_full_peak(lynx_settings=True)
    before, _ = _llama_full_peak(lynx_settings=False)
    # the step's peak counts the gradients the backward returns (lynx_compile.budget); the
    # settings act on the activations, what is above them (params: every gradient's bytes)
    grads = sum(p.numel() * p.element_size() for p in _LLAMA_PARAMS)
    assert before - predicted > 0.15 * (predicted - grads), (before, predicted, grads)
    assert abs(after - predicted) <= 0.005 * predicted, (after, predicted)


@pytest.mark.slow
def test_hf_llama_at_half_budget_measures_within_it(monkeypatch):
    """HF Llama (4 layers, hidden 64, seq 64, batch 4, eager attention) at ``memory_budget=0.5``
    under Inductor: the measured step peak is within the budget, and the prediction is within
    1% of it. Before lynx's fused model read a fused pointwise op's inputs where its kernel runs
    (``inductor_model.kernel_positions``) and counted Inductor's in-place buffers, it measured
    1825820 B against a budget of 1825280 B (predicted 1824256 B; batch 2, gradients not
    counted)."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from foreign_models import hf_llama

    torch.compiler.reset()
    torch.manual_seed(0)
    model = hf_llama(vocab_size=128, seq_len=64, n_layers=4, hidden=64, n_heads=4, n_kv_heads=1, attn="eager")
    # batch 4: with the parameter gradients in the step's peak (issue M) batch 2 reaches 0.502
    idx = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    backend = lynx_compile.backend(policy="lynx", memory_budget=0.5, plan_cache=False)
    compiled = torch.compile(model, backend=backend)
    with _no_fx_cache():
        compiled(input_ids=idx, labels=idx).loss.backward()
    m = measure_step(lambda: compiled(input_ids=idx, labels=idx).loss.backward(), repeats=1, warmup=0,
                     params=list(model.parameters()))
    plan = backend.plans[-1]
    assert m.peak_bytes <= plan.budget_bytes, (m.peak_bytes, plan.budget_bytes, plan.peak_bytes)
    assert abs(m.peak_bytes - plan.peak_bytes) <= 0.01 * plan.peak_bytes, (m.peak_bytes, plan.peak_bytes)


def _no_fx_cache():
    """Inductor's FX-graph cache off: a hit (the same graph compiled in an earlier test or run)
    skips the scheduler, so no compiled peak is read."""
    return torch._inductor.config.patch(fx_graph_cache=False)


def _full_step_peak(batch: int, split: bool) -> tuple[int, object]:
    torch.compiler.reset()
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    x = example_batch(model, batch)
    disabled = () if split else ("split_late_addmm_pass",)
    backend = lynx_compile.backend(policy="full", plan_cache=False, disable_passes=disabled)
    compiled = torch.compile(model, backend=backend)
    with _no_fx_cache():
        compiled(x).loss.backward()
    m = measure_step(lambda: compiled(x).loss.backward(), repeats=1, warmup=0, params=list(model.parameters()))
    return m.peak_bytes, backend.plans[-1]


def test_tied_lm_head_gradient_no_longer_held_through_the_backward():
    """gpt-tiny ties its embedding and LM head. Under ``full``, with the split the measured step
    peak is lower than without it (Inductor's addmm kept the logits' gradient, 8 x 32 x 128
    floats, alive to the end of the backward; measured 1.72 MB against 1.79 MB, and on
    gpt-small, batch 2, 3.75 MB against 4.40 MB)."""
    with_split, plan = _full_step_peak(8, split=True)
    without, _ = _full_step_peak(8, split=False)
    assert with_split < without, (with_split, without)
    assert plan.compiled_peak_bytes is not None


@pytest.mark.parametrize("policy,slack", [("none", 1.1), ("full", 1.5)])
def test_compiled_peak_bounds_the_measured_peak(policy, slack):
    """``compiled_peak_bytes`` (Inductor's estimate) is recorded once the backward compiled and
    is at least the measured peak: close for none (gpt-tiny +4%, gpt-small +0.0%), loose when the backward
    recomputes (gpt-tiny full: 1.46x; Inductor's model counts a kernel's output and the input
    it overwrites in place apart).
    Reading it leaves the generated code unchanged: the measured peak equals that of a compile
    without it."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    x = example_batch(model, 2)
    backend = lynx_compile.backend(policy=policy, plan_cache=False)
    compiled = torch.compile(model, backend=backend)
    with _no_fx_cache():
        compiled(x).loss.backward()
    m = measure_step(lambda: compiled(x).loss.backward(), repeats=1, warmup=0, params=list(model.parameters()))
    estimate = backend.plans[-1].compiled_peak_bytes
    assert m.peak_bytes <= estimate <= slack * m.peak_bytes, (m.peak_bytes, estimate)

    torch.compiler.reset()
    twin = build_model("gpt-tiny", dropout=0.0)
    twin.load_state_dict(model.state_dict())
    unread = lynx_compile.backend(policy=policy, plan_cache=False)
    original = _compat.inductor_compile_with_partitioner

    def without_reading(*args, **kwargs):
        kwargs["post_fusion"] = None
        return original(*args, **kwargs)

    _compat.inductor_compile_with_partitioner = without_reading
    try:
        again = torch.compile(twin, backend=unread)
        again(x).loss.backward()
    finally:
        _compat.inductor_compile_with_partitioner = original
    m2 = measure_step(lambda: again(x).loss.backward(), repeats=1, warmup=0, params=list(twin.parameters()))
    assert m2.peak_bytes == m.peak_bytes
    assert unread.plans[-1].compiled_peak_bytes is None


def test_fx_graph_cache_hit_leaves_no_compiled_peak_and_same_code():
    """With Inductor's FX-graph cache on, a second compile of the same graph is a hit (the pass
    is part of the key, so caching still works): its scheduler does not run, the compiled peak
    is None, and the measured peak is the same."""
    peaks, estimates = [], []
    for _ in range(2):
        torch.compiler.reset()
        torch.manual_seed(0)
        model = build_model("gpt-tiny", dropout=0.0)
        x = example_batch(model, 2)
        backend = lynx_compile.backend(policy="full", plan_cache=False)
        compiled = torch.compile(model, backend=backend)
        with torch._inductor.config.patch(fx_graph_cache=True):
            compiled(x).loss.backward()
        m = measure_step(lambda: compiled(x).loss.backward(), repeats=1, warmup=0, params=list(model.parameters()))
        peaks.append(m.peak_bytes)
        estimates.append(backend.plans[-1].compiled_peak_bytes)
    assert peaks[0] == peaks[1]
    assert estimates[1] is None


def test_eager_compiler_reports_no_compiled_peak():
    torch.compiler.reset()
    model = build_model("gpt-tiny", dropout=0.0)
    backend = lynx_compile.backend(policy="full", compiler="eager", plan_cache=False)
    torch.compile(model, backend=backend)(example_batch(model, 1)).loss.backward()
    assert backend.plans[-1].compiled_peak_bytes is None


class _EmbeddingLM(torch.nn.Module):
    """An embedding whose gradient is the step's peak (a vocabulary of 16384 x 64 against 512
    tokens), then a bias-free linear layer."""

    def __init__(self, vocab: int = 16384, dim: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.lin = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, ids):
        return self.lin(self.emb(ids)).float().pow(2).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_gradient_is_one_buffer(dtype):
    """Inductor computes an embedding's gradient, ``index_put(zeros, [ids], grad)`` (torch 2.13:
    ``_unsafe_masked_index_put_accumulate``), as a copy of the zeros that a scatter kernel writes
    into: one buffer (fp32: the decomposition accumulates in fp32). lynx's model counted the zeros
    and the gradient apart: predicted 1.91x the measured peak here in fp32, 1.33x in bf16, and on
    an H200 (torch 2.11, a 4-layer GPT-1.3B, bf16) it put every plan's floor at the embedding's
    backward, 364 MiB above what ran. Now within 1.5% (bf16 on CPU: Inductor's C++ kernel also
    takes the conversion to bf16 into the scatter, which holds the scatter's input 64 KiB longer)."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = _EmbeddingLM().to(dtype)
    ids = torch.randint(0, 16384, (4, 128), generator=torch.Generator().manual_seed(1))
    backend = lynx_compile.backend(policy="none", plan_cache=False)
    compiled = torch.compile(model, backend=backend)
    with _no_fx_cache():
        compiled(ids).backward()
    m = measure_step(lambda: compiled(ids).backward(), repeats=1, warmup=0, params=list(model.parameters()))
    predicted = backend.plans[-1].peak_bytes
    zeros = 16384 * 64 * 4
    assert m.peak_bytes > zeros, m.peak_bytes  # the gradient's buffer is in the measured peak
    assert abs(predicted - m.peak_bytes) <= 0.015 * m.peak_bytes, (predicted, m.peak_bytes)
