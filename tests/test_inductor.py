"""compiler="inductor" (the default): lynx's partition inside torch.compile's own Inductor pipeline.

References: plain ``torch.compile`` (Inductor, no lynx) from the same seed — with dropout on,
Inductor draws its own Philox numbers, so eager is no reference there, but Inductor without any
recompute is: every lynx policy must give its loss and gradients, which only holds when every
recomputed dropout mask equals the forward's. With dropout 0, eager is the reference (≤1e-5).
The dropout-replay and dropout-0 tests also run on CUDA (ids ``[<name>-cuda]``, skipped without a
GPU; ``benchmarks/gpu_session.sh checks`` runs them on a lent GPU).
"""
import copy

import pytest
import torch

import lynx_compile
from lynx_compile.memory import measure_step
from lynx_compile.models import build_model, example_batch

OPTIONS = {
    "none": {"policy": "none"},
    "full": {"policy": "full"},
    "selective": {"policy": "selective"},
    "torch@0.8": {"policy": "torch", "memory_budget": 0.8},
    "lynx@0.9": {"policy": "lynx", "memory_budget": 0.9, "solver": "heu"},
}


def _step(model, x, seed):
    torch.manual_seed(seed)
    loss = model(x).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.detach().clone()
                           for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _on_devices(names):
    """``(name, device)`` cases: the CPU cases keep their plain ids (``[full]``), the CUDA ones
    add ``-cuda`` and are skipped without a GPU (``benchmarks/gpu_session.sh checks`` runs them)."""
    return ([pytest.param(n, "cpu", id=n) for n in names]
            + [pytest.param(n, "cuda", id=f"{n}-cuda", marks=NEEDS_CUDA) for n in names])


@pytest.fixture(scope="module")
def dropout_reference():
    """gpt-tiny, dropout 0.1: plain torch.compile's loss and gradients, seed 7, per device
    (``dropout_reference(device)``; computed on first use). Weights and batch are built on the
    CPU, so every device starts from the same ones."""
    cache = {}

    def get(device):
        if device not in cache:
            torch.manual_seed(0)
            model = build_model("gpt-tiny", dropout=0.1).to(device)
            x = example_batch(model, 2, generator=torch.Generator().manual_seed(1)).to(device)
            torch.compiler.reset()
            ref = _step(torch.compile(copy.deepcopy(model)), x, seed=7)
            cache[device] = model, x, ref
        return cache[device]

    return get


@pytest.mark.slow
# every policy that recomputes (none recomputes no mask: its partition is torch.compile's, checked
# bit for bit in test_grad_in_graph and test_torchtitan)
@pytest.mark.parametrize("name,device", _on_devices([n for n in OPTIONS if n != "none"]))
def test_dropout_masks_replay_under_inductor(dropout_reference, name, device):
    model, x, (ref_loss, ref_grads) = dropout_reference(device)
    backend = lynx_compile.backend(**OPTIONS[name])
    torch.compiler.reset()
    loss, grads = _step(torch.compile(copy.deepcopy(model), backend=backend), x, seed=7)
    assert _rel(loss, ref_loss) <= 1e-6
    for key, ref in ref_grads.items():
        assert _rel(grads[key], ref) <= 1e-5, key
    plan = backend.plans[-1]
    assert plan.recomputed, "nothing was recomputed, so no mask was replayed"
    # The one random source left after Inductor's RNG replacement is saved, never redrawn.
    assert not any("inductor_seeds" in r.name for r in plan.recomputed)


@pytest.mark.slow
@pytest.mark.parametrize("name,device", _on_devices(["full", "lynx@0.9"]))
def test_dropout0_gradients_equal_eager_under_inductor(name, device):
    torch.manual_seed(0)
    model = build_model("llama-tiny", dropout=0.0).to(device)
    x = example_batch(model, 2, generator=torch.Generator().manual_seed(1)).to(device)
    ref_loss, ref_grads = _step(copy.deepcopy(model), x, seed=3)
    torch.compiler.reset()
    loss, grads = _step(torch.compile(copy.deepcopy(model), backend="lynx", options=OPTIONS[name]), x, seed=3)
    assert _rel(loss, ref_loss) <= 1e-5
    for key, ref in ref_grads.items():
        assert _rel(grads[key], ref) <= 1e-5, key


@pytest.mark.slow
def test_none_under_inductor_is_torch_compiles_partition():
    """lynx none = torch.compile's default min-cut: it saves no more than the everything-saved
    reference, and what it saves is what plain torch.compile saves (same forward outputs)."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    x = example_batch(model, 2)
    backend = lynx_compile.backend(policy="none")
    torch.compiler.reset()
    torch.compile(copy.deepcopy(model), backend=backend)(x).loss.backward()
    plan = backend.plans[-1]
    # the everything-saved reference: the eager compiler's default partition of the joint as
    # traced (alias_clones_pass off; with it the eager path shares storages eager PyTorch shares)
    eager_plan = lynx_compile.backend(policy="none", compiler="eager", disable_passes=("alias_clones_pass",))
    torch.compiler.reset()
    torch.compile(copy.deepcopy(model), backend=eager_plan)(x).loss.backward()
    assert plan.saved_bytes < eager_plan.plans[-1].saved_bytes  # fused pointwise ops recomputed


@pytest.mark.slow
def test_measured_peak_under_inductor_within_budget_and_monotone():
    """CPU allocator peak of the Inductor-compiled step: within the budget and falling with it.
    Before ``split_late_addmm_pass`` the budget held only on the unfused graphs' prediction:
    0.508 measured at 0.5 (gpt-small ties its LM head to its embedding, and Inductor's addmm
    fusion kept the logits' gradient alive through the backward)."""
    torch.manual_seed(0)
    model = build_model("gpt-small", dropout=0.0)
    # batch 4: the step's peak counts the parameter gradients (issue M), which at batch 2 hold
    # the smallest reachable peak at 0.505 of none's
    x = example_batch(model, 4)
    peaks = []
    for budget in (0.9, 0.7, 0.5):
        twin = copy.deepcopy(model)
        backend = lynx_compile.backend(policy="lynx", memory_budget=budget, solver="heu")
        torch.compiler.reset()
        compiled = torch.compile(twin, backend=backend)
        compiled(x).loss.backward()  # compiles and plans
        plan = backend.plans[-1]
        m = measure_step(lambda: compiled(x).loss.backward(), repeats=1, warmup=0,
                         params=twin.parameters(), plan=plan)
        assert plan.peak_bytes <= plan.budget_bytes
        assert m.peak_bytes <= plan.budget_bytes, (budget, m.peak_bytes, plan.peak_bytes)
        peaks.append(m.peak_bytes)
    assert peaks == sorted(peaks, reverse=True), peaks


@pytest.mark.parametrize("batch", [1, 4])
def test_inductor_keeps_recompute_where_the_partition_put_it(batch):
    """Inductor's peak-memory reordering and horizontal fusion once pulled block 0's recompute to
    the start of the backward (gpt-tiny, batch 1: policy full measured 403 KB, above no recompute's
    380 KB, predicted 214 KB). With lynx's Inductor settings, full's measured peak is below
    none's, and at batch 1 within 1% below to 4% above the prediction: 221960 B measured, 221952 B
    predicted (torch 2.13; 214280 B before lynx's fused model held the tied LM head's addmm
    operands, the logits' gradient among them, to the end of the backward, where Inductor's
    ``mm + add -> addmm`` runs it). It read exactly 214280 while Inductor's wrapper reused
    buffers: an 8 KB recomputed projection's storage was handed on until it became a weight
    gradient, which the measurement leaves out; with reuse off
    (``_compat.INDUCTOR_KEEP_PLACEMENT``) it is counted."""
    from lynx_compile.memory.measure import measure_step

    peaks = {}
    # batch 1 checks full against its own prediction; none is compiled only where it is compared
    for policy in ("none", "full") if batch == 4 else ("full",):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model("gpt-tiny", dropout=0.0)
        x = example_batch(model, batch)
        backend = lynx_compile.backend(policy=policy, compiler="inductor", plan_cache=False)
        compiled = torch.compile(model, backend=backend)
        for p in model.parameters():  # the .grad regime measured below, from the compiling step on
            p.grad = torch.zeros_like(p)
        compiled(x).loss.backward()
        measured = measure_step(lambda: compiled(x).loss.backward(), repeats=1, warmup=1,
                                params=list(model.parameters()))
        peaks[policy] = (measured.peak_bytes, backend.plans[-1].peak_bytes)
    # Since the step's peak counts the parameter gradients the backward returns (issue M), at
    # batch 1 full's peak is at the end of the backward, where block 0's recompute meets every
    # other gradient, and is above none's (515848 B measured against 482312 B, torch 2.13): the
    # ordering claim is made where activations, not gradients, set the peak.
    if batch == 4:
        assert peaks["full"][0] < peaks["none"][0], peaks
    if batch == 1:  # (before the Inductor settings it was 88% above)
        assert 0.99 * peaks["full"][1] <= peaks["full"][0] <= 1.04 * peaks["full"][1], peaks
