"""``torch.compile(..., backend="lynx")`` without ``options=`` reads ``$LYNX_OPTIONS``
(``lynx_compile.config.options_from_env``): for launchers that pass the backend by name only,
e.g. torchtitan's ``--compile.backend lynx``. No torchtitan needed.

Oracles: the options reach the backend iff the bound backend of those same options
(``lynx_compile.backend(**options)``, one object per set of options) recorded the graph; the
compiled model's gradients equal eager PyTorch's.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

import lynx_compile
from lynx_compile.compiler.dynamo_backend import LynxOptionError
from lynx_compile.config import OPTIONS_ENV, options_from_env

OPTIONS = {"policy": "full", "compiler": "eager"}  # eager compiler: no Inductor compile, quick


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn(torch.ones(3, 8)).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("form", ["json", "file"])
def test_string_backend_takes_its_options_from_the_environment(monkeypatch, tmp_path, form):
    torch._dynamo.reset()
    if form == "file":
        path = tmp_path / "lynx.json"
        path.write_text(json.dumps(OPTIONS))
        monkeypatch.setenv(OPTIONS_ENV, str(path))
    else:
        monkeypatch.setenv(OPTIONS_ENV, json.dumps(OPTIONS))
    bound = lynx_compile.backend(**OPTIONS)
    before = len(bound.records)
    model = _model()
    got = _grads(model, torch.compile(model, backend="lynx"))
    assert len(bound.records) == before + 1, "the graph did not go through the LYNX_OPTIONS backend"
    assert bound.records[-1].plan is not None and bound.records[-1].plan.policy == "full"
    for g, e in zip(got, _grads(model, model)):
        torch.testing.assert_close(g, e)


def test_unset_or_blank_is_no_options(monkeypatch):
    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    assert options_from_env() is None
    assert options_from_env({OPTIONS_ENV: "  "}) is None
    assert options_from_env({OPTIONS_ENV: ' {"memory_budget": 0.7} '}) == {"memory_budget": 0.7}


@pytest.mark.parametrize("value, says", [
    ('{"memory_budget": 0.7', "is not JSON"),
    ('{"memory_budjet": 0.7}', "unknown lynx option(s) ['memory_budjet']"),
    ('{"policy": "fast"}', "policy='fast' is not valid"),
    ("no/such/lynx.json", "cannot read it as a file"),
])
def test_bad_value_is_one_line_naming_the_variable(value, says):
    with pytest.raises(ValueError) as e:
        options_from_env({OPTIONS_ENV: value})
    msg = str(e.value)
    assert msg.startswith(OPTIONS_ENV) and says in msg and "\n" not in msg


@pytest.mark.parametrize("body, says", [('{"solver": "cplex"}', "solver='cplex' is not valid"),
                                        ("[0.7]", "is not a JSON object")])
def test_bad_file_names_the_file(tmp_path, body, says):
    path = tmp_path / "lynx.json"
    path.write_text(body)
    with pytest.raises(ValueError, match=rf"^{OPTIONS_ENV} file .*lynx.json.*{re.escape(says)}"):
        options_from_env({OPTIONS_ENV: str(path)})


def test_compile_with_a_bad_variable_fails_with_lynx_message(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setenv(OPTIONS_ENV, '{"memory_budjet": 0.7}')
    model = _model()
    with pytest.raises(LynxOptionError, match=f"^{OPTIONS_ENV}=.*unknown lynx option"):
        torch.compile(model, backend="lynx")(torch.ones(3, 8))


def test_options_and_variable_together_are_refused(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setenv(OPTIONS_ENV, json.dumps(OPTIONS))
    model = _model()
    with pytest.raises(LynxOptionError, match=f"unset {OPTIONS_ENV} or drop options="):
        torch.compile(model, backend="lynx", options={"policy": "none"})(torch.ones(3, 8))


def test_bound_backend_ignores_the_variable(monkeypatch):
    monkeypatch.setenv(OPTIONS_ENV, '{"memory_budjet": 0.7}')  # would be refused if read
    assert lynx_compile.backend(policy="none").config.policy == "none"
