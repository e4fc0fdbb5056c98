"""Bad input fails loudly with the fix in the message; nothing silently falls back."""
import logging

import pytest
import torch

import lynx_compile
from lynx_compile.compiler.dynamo_backend import find_backend_error
from lynx_compile.config import make_config
from lynx_compile.models import build_model, example_batch
from lynx_compile.decisions import BudgetError

NO_COSTS = ("annotate_costs_pass",)


def _budget_error(compiled, x) -> BudgetError:
    """The BudgetError compiling and running a step of ``compiled(x)`` raises, under dynamo's
    wrappers (a whole graph's refusal comes at the end of step 1: step.recorder.StepRecorder.defer)."""
    with pytest.raises(Exception) as info:
        compiled(x).loss.backward()
    err = find_backend_error(info.value, BudgetError)
    assert isinstance(err, BudgetError), info.value
    return err


def test_unknown_option_names_valid_ones():
    with pytest.raises(ValueError, match=r"unknown lynx option\(s\) \['polcy'\]; did you mean 'policy' for 'polcy'\? valid options are .*'policy'"):
        make_config({"polcy": "full"})


def test_unknown_option_through_torch_compile():
    model = build_model("gpt-tiny")
    compiled = torch.compile(model, backend="lynx", options={"budget": 0.5})
    with pytest.raises(Exception, match="valid options are"):
        compiled(example_batch(model, 2))


@pytest.mark.parametrize("key,value,match", [
    ("policy", "fast", r"policy='fast' is not valid; choose one of \['lynx', 'none', 'full', 'selective', 'torch'\]"),
    ("plan", "/nonexistent/plan.json", "no such file"),
    ("mip_gap", 1.5, "mip_gap"),
    ("solver", "cplex", "choose one of"),
    ("memory_budget", 1.5, r"must lie in \(0, 1\]"),
    ("memory_budget", 0.0, r"must lie in \(0, 1\]"),
    ("memory_budget", -5, "must be positive"),
    ("memory_budget", 0, r"an int is a number of bytes.*a float in \(0, 1\], e.g. memory_budget=0.5"),
    ("memory_budget", "half", "must be a float"),
    ("hardware", "tpu-v9", "choose one of"),
])
def test_bad_values(key, value, match):
    with pytest.raises(ValueError, match=match):
        make_config({key: value})


def test_budget_below_smallest_reachable_names_it():
    model = build_model("gpt-tiny")
    x = example_batch(model, 4)
    compiled = torch.compile(model, backend="lynx",
                             options={"policy": "full", "memory_budget": 0.05, "disable_passes": NO_COSTS,
                                      "compiler": "eager"})
    err = _budget_error(compiled, x)
    assert "smallest reachable peak is" in str(err) and "with policy 'full'" in str(err)
    assert "Use memory_budget >=" in str(err)


def test_lynx_budget_below_every_plan_says_where_the_peak_is():
    # a large vocabulary and a short sequence: the step's peak is the logits / embedding
    # gradient, which no recompute lowers; the error says where the lowest plan peaks and why
    # recompute cannot help there (not only the fraction)
    from lynx_compile.models import GPTConfig

    model = build_model(GPTConfig(vocab_size=4096, seq_len=8, n_layers=2, hidden=32, n_heads=4, dropout=0.0))
    x = example_batch(model, 2)
    compiled = torch.compile(model, backend="lynx", options={"policy": "lynx", "memory_budget": 0.3,
                                                             "solver": "heu", "plan_cache": False})
    err = _budget_error(compiled, x)
    msg = str(err)
    assert "the lowest of lynx's candidates, " in msg and " peaks at " in msg, msg
    assert "recompute cannot lower it" in msg, msg


def test_budget_in_bytes_accepted_when_reachable(caplog):
    """A size far above the step's peak is accepted, with one warning that it constrains nothing."""
    from lynx_compile.recompute import partition

    partition._warned_loose.discard("memory_budget='953.68MiB'")
    model = build_model("gpt-tiny")
    x = example_batch(model, 4)
    backend = lynx_compile.backend(policy="full", memory_budget=10**9, disable_passes=NO_COSTS, compiler="eager")
    with caplog.at_level("WARNING", logger="lynx_compile"):
        torch.compile(model, backend=backend)(x).loss.backward()
    assert backend.plans[-1].budget_bytes == 10**9
    assert caplog.text.count("constrains nothing") == 1, caplog.text
    # the bytes as typed beside the rounded size ('1GB' is 10**9 B, 953.68 MiB)
    assert "memory_budget='953.68MiB' (1000000000 B) is at or above this graph's no-recompute peak" in caplog.text
    # a device budget is meant to hold a step that fits: no such warning
    caplog.clear()
    torch._dynamo.reset()
    backend = lynx_compile.backend(policy="full", device_budget=10**9, disable_passes=NO_COSTS, compiler="eager")
    with caplog.at_level("WARNING", logger="lynx_compile"):
        torch.compile(model, backend=backend)(x).loss.backward()
    assert "constrains nothing" not in caplog.text, caplog.text


class _Broken(torch.nn.Module):
    """A model with a graph break in the middle (a print)."""

    def __init__(self):
        super().__init__()
        self.inner = build_model("gpt-tiny", dropout=0.0)

    def forward(self, x):
        h = self.inner.wte(x)
        torch._dynamo.graph_break()
        return h.sum()


def test_graph_breaks_compile_each_subgraph_and_say_so_once(caplog):
    caplog.set_level(logging.WARNING, logger="lynx_compile")
    model = _Broken()
    x = example_batch(model.inner, 2)
    from lynx_compile.compiler.dynamo_backend import LynxBackend
    from lynx_compile.config import make_config

    # a fresh backend (lynx_compile.backend() returns the cached one an earlier test with the
    # same options may have used, which has said it already)
    backend = LynxBackend(make_config(dict(policy="none", disable_passes=NO_COSTS, verbose=False, dump_dir=None,
                                           compiler="eager")))
    compiled = torch.compile(model, backend=backend)
    out = compiled(x)
    out.backward()
    assert len(backend.records) >= 2
    warnings = [r for r in caplog.records if "more than one graph" in r.getMessage()]
    assert len(warnings) == 1
    assert torch.allclose(out, model(x))
