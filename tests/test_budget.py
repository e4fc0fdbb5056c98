"""The memory budget (``lynx_compile.budget``): one meaning, held on the measured step.

A budget bounds the step's peak: what a forward + backward allocates above what is allocated
when it starts (the parameter gradients left in ``.grad`` aside: ``measure_step(params=...)``).
A fraction is of the same compiler's no-recompute step:
under Inductor torch.compile's own (``backend="inductor"``), measured by the same allocator
events. References: the allocator's measured peak of ``backend="inductor"`` and of plain eager
PyTorch, and ``parse_budget`` reading back the budget an error names.
"""
import re
import sys
from pathlib import Path

import pytest
import torch

import lynx_compile
from lynx_compile.compiler.dynamo_backend import find_backend_error
from lynx_compile.budget import Budget, format_bytes, parse_budget
from lynx_compile.decisions import BudgetError
from lynx_compile.memory import measure_step
from lynx_compile.models import build_model, example_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from foreign_models import PostLNGQAConfig, PostLNGQALM  # noqa: E402

TOLERANCE = 0.02  # the issue's: measured peak within 2% of the budget or below


def _gqa():
    torch.manual_seed(0)
    model = PostLNGQALM(PostLNGQAConfig(vocab_size=64, seq_len=48, n_layers=2, d_model=64, n_heads=4,
                                        n_kv_heads=2))
    idx = torch.randint(0, 64, (4, 48), generator=torch.Generator().manual_seed(1))
    return model, (idx, idx), lambda out: out[1]


def _zoo():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layers=2, seq_len=64)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    return model, (x,), lambda out: out.loss


def _measured(build, backend):
    """(measured step peak, the backend's plans) of one model under ``backend`` (None: eager)."""
    model, inputs, loss_of = build()
    run = model if backend is None else torch.compile(model, backend=backend)
    torch._dynamo.reset()
    for p in model.parameters():  # the regime measured, from the compiling step on (lynx plans for it)
        p.grad = torch.zeros_like(p)
    m = measure_step(lambda: loss_of(run(*inputs)).backward(), repeats=1, warmup=1,
                     params=list(model.parameters()))
    return m.peak_bytes, getattr(backend, "plans", [])


@pytest.fixture(scope="module")
def inductor_none():
    """torch.compile's own measured step peak, per model: what a fraction is of."""
    return {name: _measured(build, "inductor")[0] for name, build in (("gqa", _gqa), ("zoo", _zoo))}


@pytest.mark.parametrize("name,build", [("gqa", _gqa), ("zoo", _zoo)])
def test_reference_is_torch_compiles_own_step(name, build, inductor_none):
    """lynx's no-recompute reference under Inductor is torch.compile's step as lynx's fused
    model predicts it: policy none measures exactly ``backend="inductor"``'s peak, and the
    reference is at most that (+2%), so a fraction is never of more than torch.compile's step.
    It is below it by up to 10%: Inductor's wrapper frees a kernel's inputs after the next
    extern call allocates its output, which the model does not follow (GQA here: 4.2% below)."""
    measured, plans = _measured(build, lynx_compile.backend(policy="none"))
    reference = plans[-1].reference_peak_bytes
    assert plans[-1].peak_bytes == reference
    assert measured == inductor_none[name]
    assert 0.9 * measured <= reference <= (1 + TOLERANCE) * measured, (measured, reference)


@pytest.mark.parametrize("name,build,budgets", [("gqa", _gqa, (0.8,)), ("zoo", _zoo, (0.9, 0.8))])
def test_fractions_hold_on_the_measured_step_and_are_monotone(name, build, budgets, inductor_none):
    """lynx at 0.9 / 0.8: measured peak <= fraction x torch.compile's measured peak (+2%), and a
    smaller budget never measures a larger peak."""
    peaks = []
    for budget in budgets:
        measured, plans = _measured(build, lynx_compile.backend(memory_budget=budget))
        assert measured <= (budget + TOLERANCE) * inductor_none[name], (budget, measured, inductor_none[name])
        assert plans[-1].peak_bytes <= plans[-1].budget_bytes
        peaks.append(measured)
    assert peaks == sorted(peaks, reverse=True), peaks


def test_eager_compiler_fraction_is_of_eagers_step():
    """``compiler="eager"``: measured <= 0.8 x plain eager PyTorch's measured step (+2%)."""
    eager, _ = _measured(_zoo, None)
    measured, plans = _measured(_zoo, lynx_compile.backend(memory_budget=0.8, compiler="eager"))
    assert measured <= (0.8 + TOLERANCE) * eager, (measured, eager)
    assert abs(measured - plans[-1].peak_bytes) <= 64  # eager: the prediction is the allocator's peak


def test_a_size_is_the_peak_in_bytes(inductor_none):
    """``memory_budget="<n>MiB"`` (a string, as on the command line) bounds the measured peak in
    bytes, and equals the int form."""
    size = format_bytes(int(0.85 * inductor_none["zoo"]))
    assert lynx_compile.backend(memory_budget=size) is lynx_compile.backend(memory_budget=parse_budget(size))
    measured, plans = _measured(_zoo, lynx_compile.backend(memory_budget=size))
    assert plans[-1].budget_bytes == parse_budget(size)
    assert measured <= parse_budget(size) * (1 + TOLERANCE)


@pytest.mark.parametrize("given", [0.05, "4KiB"])
def test_refusal_names_the_smallest_reachable_budget_in_the_users_units(given):
    """An unreachable budget is one BudgetError naming the smallest reachable budget in the
    form the user gave (a fraction, or a size with a unit); that budget is then accepted."""
    model, inputs, loss_of = _zoo()
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        loss_of(torch.compile(model, backend=lynx_compile.backend(memory_budget=given))(*inputs)).backward()
    err = find_backend_error(info.value, BudgetError)
    assert err is not None and err.smallest_bytes is not None, info.value
    text = str(err)
    m = re.search(r"Use memory_budget >= (\S+)", text)
    assert m, text
    suggested = m.group(1).strip("'")
    assert (suggested.endswith("iB") or suggested.endswith("B")) == isinstance(given, str), text
    value = parse_budget(suggested)
    assert Budget.of(value) is not None
    measured, plans = _measured(_zoo, lynx_compile.backend(memory_budget=value))
    assert plans[-1].peak_bytes <= plans[-1].budget_bytes


def test_budget_strings_parse_and_bad_ones_name_the_forms():
    assert lynx_compile.backend(memory_budget="0.5").config.memory_budget == 0.5
    assert lynx_compile.backend(memory_budget="2KiB").config.memory_budget == 2048
    with pytest.raises(ValueError, match="48MiB"):
        lynx_compile.backend(memory_budget="lots")
    assert parse_budget(format_bytes(123456789)) >= 123456789


def test_named_fraction_reads_the_fraction_a_refusal_names():
    """``named_fraction`` reads back the fraction ``budget_error`` writes (rounded up at the third
    digit: 501 of 1000 bytes is 0.501), and nothing where the refusal names a size or nothing."""
    from lynx_compile.budget import budget_error, named_fraction

    refusal = budget_error(Budget.of(0.3), reference=1000, smallest=501, why="hand-made")
    assert "Use memory_budget >= 0.501" in str(refusal)
    assert named_fraction(str(refusal)) == 0.501
    assert named_fraction(str(budget_error(Budget.of(100), reference=1000, smallest=501, why="x"))) is None
    assert named_fraction(str(budget_error(Budget.of(0.3), reference=1000, smallest=None, why="x"))) is None
