"""Smoke test for every supported torch (2.11-2.13): lynx imports, and one training step of the
smallest zoo model compiled with ``backend="lynx"`` gives eager's loss and gradients under every
policy, with both compilers.

CI runs this file on torch 2.11 too (``.ci/smoke_torch211.sh``); in the normal suite it runs on
whatever torch is installed. fp32, dropout 0: loss and every gradient within 1e-5 (relative
norm) of eager.
"""
import copy

import pytest
import torch

import lynx_compile
from lynx_compile import _compat
from lynx_compile.models import build_model, example_batch

POLICY_OPTIONS = {
    "none": {},
    "full": {},
    "selective": {},
    "torch": {"memory_budget": 0.8},
    "lynx": {"memory_budget": 0.9, "solver": "heu"},  # gpt-tiny, batch 2: its parameter gradients hold the smallest at ~0.83
}
COMPILERS = ["eager", "inductor"]
PRESET = "gpt-tiny"  # the smallest preset (2 layers, hidden 64, seq 32)


def test_torch_version_is_supported():
    lo, hi = _compat.SUPPORTED_TORCH
    assert lo <= _compat.TORCH_VERSION <= hi, torch.__version__
    _compat.check_torch_version()
    assert callable(lynx_compile.backend)


def test_compat_wrappers_run_on_this_torch():
    # the wrappers for APIs that differ between 2.11 and 2.13 resolve on the installed torch
    assert _compat.optimization_hint(7) == 7
    assert _compat.qualified_op_name(torch.ops.aten.add.Tensor) == "aten::add.Tensor"
    assert _compat.is_op_overload(torch.ops.aten.add) and not _compat.is_op_overload(len)
    assert _compat.tree_leaves({"a": [1, (2, 3)]}) == [1, 2, 3]
    enter, exit_ = _compat.record_function_ops()
    assert enter is not None and exit_ is not None


def _step(model, x):
    loss = model(x).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = build_model(PRESET, dropout=0.0)
    x = example_batch(model, 2, generator=torch.Generator().manual_seed(1))
    loss, grads = _step(copy.deepcopy(model), x)
    return model, x, loss, grads


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("policy", list(POLICY_OPTIONS))
def test_compiled_step_matches_eager(reference, policy, compiler):
    model, x, ref_loss, ref_grads = reference
    options = {"policy": policy, "compiler": compiler, **POLICY_OPTIONS[policy]}
    compiled = torch.compile(copy.deepcopy(model), backend="lynx", options=options)
    loss, grads = _step(compiled, x)
    assert _rel(loss, ref_loss) <= 1e-5, (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert _rel(grads[name], ref) <= 1e-5, name
    plans = lynx_compile.backend(**options).plans
    assert plans and plans[-1].policy == policy
    if policy in ("full", "selective"):
        assert plans[-1].recomputed, "policy recomputed nothing"


def test_weight_split_under_inductor_matches_eager(reference):
    # the zero-bubble B/W split compiled by Inductor (inner_compile, donated backward inputs)
    from lynx_compile.runtime.weight_split import defer_weights

    model, x, ref_loss, ref_grads = reference
    backend = lynx_compile.backend(policy="full", weight_split=True)
    compiled = torch.compile(copy.deepcopy(model), backend=backend)
    with defer_weights(0):
        loss = compiled(x).loss
        loss.backward()
    assert backend.runtimes.run_weights(0) == 1
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in compiled.named_parameters()}
    assert _rel(loss.detach(), ref_loss) <= 1e-5
    for name, ref in ref_grads.items():
        assert _rel(grads[name], ref) <= 1e-5, name


@pytest.mark.parametrize("compiler", COMPILERS)
def test_per_microbatch_variants_match_eager(reference, compiler):
    # one compile per variant from one dynamo graph (runtime.per_microbatch copies the graph):
    # micro-batch 0 runs policy none, micro-batch 1 policy full, each the whole batch; gradients
    # accumulate over both, so they are twice eager's
    from lynx_compile.runtime.per_microbatch import PerMicrobatchBackend
    from lynx_compile.runtime.prefetch import microbatch

    model, x, ref_loss, ref_grads = reference
    # backends of their own: lynx_compile.backend returns one cached per options, shared with other tests
    backend = PerMicrobatchBackend([lynx_compile.LynxBackend(lynx_compile.make_config({"policy": p, "compiler": compiler}))
                                    for p in ("none", "full")], {0: 0, 1: 1})
    compiled = torch.compile(copy.deepcopy(model), backend=backend)
    for j in (0, 1):
        with microbatch(j):
            loss = compiled(x).loss
            loss.backward()
        assert _rel(loss.detach(), ref_loss) <= 1e-5
    assert backend.calls == {0: 1, 1: 1} and [p.policy for p in backend.plans] == ["none", "full"]
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in compiled.named_parameters()}
    for name, ref in ref_grads.items():
        assert _rel(grads[name], 2 * ref) <= 1e-5, name


def test_region_budget_on_this_torch(reference):
    """``lynx_compile.region_budget`` (torch's per-region annotation, which torch 2.11 lacks as a
    function) reaches lynx on every supported torch: the region is planned and held, the step is
    eager's."""
    model, x, loss, grads = reference
    model = copy.deepcopy(model)
    mlp = model.blocks[0].mlp

    class Budgeted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = mlp

        def forward(self, h):
            with lynx_compile.region_budget(0.0, name="mlp0"):
                return self.inner(h)

    model.blocks[0].mlp = Budgeted()
    backend = lynx_compile.LynxBackend(lynx_compile.make_config({"solver": "heu", "plan_cache": False}))
    got_loss, got = _step(torch.compile(model, backend=backend), x)
    assert _rel(got_loss, loss) < 1e-5
    for name, g in grads.items():
        assert _rel(got[name.replace("mlp.", "mlp.inner.") if name.startswith("blocks.0.mlp.") else name], g) < 1e-5
    (region,) = backend.records[0].stats["regions"]
    assert region["name"] == "mlp0" and region["saved_bytes"] == 0 < region["reference_bytes"]
