"""``device_budget`` holds the whole step: the optimizer's state, and ``"auto"`` (issue S item 2).

AdamW creates its state (``exp_avg``, ``exp_avg_sq`` and a ``step`` tensor per parameter) at the
first ``optimizer.step()``, after lynx compiled the graph and read the resident bytes. lynx
finds that state (``memory.optimizer_state``: optimizers seen stepping) and checks the budget
again as step 2 starts: a plan that no longer fits beside it is planned again within what is
left, and one that cannot be is refused naming the smallest ``device_budget`` reachable.

References, by hand: the resident bytes are the parameters, the batch and AdamW's state tensors
summed from ``model.parameters()`` and ``optimizer.state``; the step's own peak is measured on the
CPU allocator's events (``cpu_peak_bytes``); their sum must be within ``device_budget``.
"""
import functools

import pytest
import torch

import lynx_compile
from lynx_compile.decisions import BudgetError
from lynx_compile.compiler.dynamo_backend import find_backend_error
from lynx_compile.memory import optimizer_state
from lynx_compile.memory.measure import cpu_peak_bytes
from lynx_compile.models import build_model, example_batch


def _zoo():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layers=2, seq_len=64, dropout=0.0)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    return model, x


def _bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _adamw_state_bytes(model) -> int:
    """By hand: two fp32 tensors of each parameter's size and a one-element step tensor each."""
    return sum(2 * p.numel() * p.element_size() + 4 for p in model.parameters())


def _step(run, x, opt):
    run(x).loss.backward()
    opt.step()
    opt.zero_grad()


def _stepped_once(device: int):
    """gpt-tiny compiled by lynx at ``device_budget=device`` with AdamW, after step 1 (compile,
    backward, the optimizer's first step, which creates its state): (model, x, backend, run, opt)."""
    model, x = _zoo()
    backend = lynx_compile.backend(device_budget=device, plan_cache=False)
    torch._dynamo.reset()
    run = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters())
    _step(run, x, opt)
    return model, x, backend, run, opt


@functools.lru_cache(maxsize=1)
def _numbers():
    """(resident before any optimizer step, no-recompute step peak, the smallest step peak
    reachable, AdamW state bytes)."""
    model, x = _zoo()
    backend = lynx_compile.backend(device_budget="1GiB", plan_cache=False)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x).loss.backward()
    plan = backend.plans[-1]
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(model, backend=lynx_compile.backend(memory_budget=0.01, plan_cache=False))(x).loss.backward()
    smallest = find_backend_error(info.value, BudgetError).smallest_bytes
    return plan.resident_bytes, plan.reference_peak_bytes, smallest, _adamw_state_bytes(model)


def test_state_bytes_are_adamws_tensors():
    """``state_bytes`` counts the state tensors of an optimizer seen stepping, for its parameters
    only, each storage once; nothing before it steps."""
    model, x = _zoo()
    optimizer_state.watch()
    opt = torch.optim.AdamW(model.parameters())
    assert optimizer_state.state_bytes(model.parameters()) == (0, "")
    model(x).loss.backward()
    opt.step()
    total, what = optimizer_state.state_bytes(model.parameters())
    assert total == _adamw_state_bytes(model) and "AdamW" in what
    half = list(model.parameters())[:3]
    assert optimizer_state.state_bytes(half)[0] == _adamw_state_bytes(torch.nn.ParameterList(half))
    assert optimizer_state.state_bytes([torch.nn.Parameter(torch.ones(3))]) == (0, "")


def test_state_created_after_compile_replans_and_the_step_fits():
    """device_budget = resident + AdamW's state + 0.8 of the no-recompute peak: at compile (no
    state yet) nothing needs recomputing; as step 2 starts the state leaves 0.8 of the peak, the
    graph is planned again within it, and the measured step plus everything resident (by hand)
    is within device_budget."""
    resident, reference, _, state = _numbers()
    device = resident + state + int(0.8 * reference)
    model, x, backend, run, opt = _stepped_once(device)
    first = backend.plans[-1]
    assert first.resident_bytes == resident and first.peak_bytes > device - resident - state
    _step(run, x, opt)  # step 2: planned again
    plan = backend.plans[-1]
    assert any("planned again" in n for n in backend.records[-1].notes), backend.records[-1].notes
    assert plan.peak_bytes <= int(0.8 * reference) < first.peak_bytes
    held = _bytes([*model.parameters(), x]) + sum(
        _bytes([v]) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert held == resident + state
    peak = cpu_peak_bytes(lambda: _step(run, x, opt))
    assert held + peak <= device, (held, peak, device)


def test_state_that_leaves_no_plan_is_refused_naming_the_smallest_device_budget():
    """device_budget = resident + AdamW's state + just below the smallest reachable step peak:
    planned at compile (the state is not there yet), refused as step 2 starts, naming a
    device_budget above the one given that counts the state, and why."""
    resident, reference, smallest, state = _numbers()
    device = resident + state + smallest - 1024
    _, x, _, run, opt = _stepped_once(device)
    with pytest.raises(Exception) as info:
        _step(run, x, opt)
    err = find_backend_error(info.value, BudgetError) or info.value
    assert isinstance(err, BudgetError), repr(info.value)
    text = str(err)
    assert "Use device_budget >= " in text and "grew" in text and "AdamW" in text, text
    assert err.smallest_bytes is not None and resident + state + err.smallest_bytes > device


def test_state_there_at_compile_is_resident():
    """Compiled after an optimizer step: the resident bytes read at compile count the state (by
    hand: parameters, batch, AdamW's tensors), and the plan's record says so."""
    model, x = _zoo()
    opt = torch.optim.AdamW(model.parameters())
    model(x).loss.backward()
    opt.step()
    opt.zero_grad()
    backend = lynx_compile.backend(device_budget="1GiB", plan_cache=False)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x).loss.backward()
    plan = backend.plans[-1]
    assert plan.resident_bytes == _bytes([*model.parameters(), x]) + _adamw_state_bytes(model)
    assert "AdamW's state" in plan.resident_source


def test_auto_is_the_cuda_devices_usable_memory_less_headroom(monkeypatch):
    """``device_budget="auto"`` on a CUDA device (its queries stubbed: this machine has none): the
    free bytes plus what this process's allocator reserved, less ``AUTO_HEADROOM`` of them, read
    once when the options are made; without CUDA a ValueError naming the bytes form."""
    from lynx_compile.budget import AUTO_HEADROOM, check_device_budget
    from lynx_compile.config import make_config

    with pytest.raises(ValueError, match="device_budget='auto' reads the free memory of a CUDA device.*'20GiB'"):
        make_config({"device_budget": "auto"})
    free, reserved = 30 << 30, 2 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    expected = int((free + reserved) * (1 - AUTO_HEADROOM))
    assert check_device_budget("auto") == expected
    assert make_config({"device_budget": "auto"}).device_budget == expected
