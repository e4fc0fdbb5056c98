"""Issue 16, items 3 and 4: errors name the fix (one line, exit code 2 on the command line),
options are checked before anything compiles, bytes and fractions stay apart, and a MILP solve
reports progress without the solver's log (no log loop through Pyomo's output capture)."""
import io
import logging
import sys

import pytest
import torch

import lynx_compile
from lynx_compile.compiler.dynamo_backend import LynxOptionError, _log_to_stderr
from lynx_compile.config import make_config, parse_budget
from lynx_compile.models import build_model, example_batch
from lynx_compile.tools.cli import build_parser, main


@pytest.fixture
def lynx_logging():
    """Clean lynx loggers for a test that installs lynx's stderr handler (an earlier test with
    ``verbose=True`` leaves the solver's log on for the process), restored after it."""
    loggers = [logging.getLogger("lynx_compile"), logging.getLogger("lynx_compile.solver")]
    saved = [(lg, lg.level, list(lg.handlers)) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.NOTSET)
        lg.handlers[:] = []
    yield
    for lg, level, handlers in saved:
        lg.setLevel(level)
        lg.handlers[:] = handlers


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- budgets: bytes vs fraction ---------------------------------------------------------------

def test_budget_bytes_and_fraction_are_different_backends():
    as_bytes, as_fraction = lynx_compile.backend(memory_budget=1), lynx_compile.backend(memory_budget=1.0)
    assert as_bytes is not as_fraction
    assert type(as_bytes.config.memory_budget) is int and type(as_fraction.config.memory_budget) is float
    assert lynx_compile.backend(memory_budget=1.0) is as_fraction


@pytest.mark.parametrize("text,value", [("0.5", 0.5), ("1", 1.0), ("48MiB", 48 * 2**20), ("2GiB", 2 * 2**30),
                                        ("512KB", 512_000), ("1000000B", 1_000_000), ("1.5 GiB", 3 * 2**29)])
def test_parse_budget_accepts_fractions_and_units(text, value):
    got = parse_budget(text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["2", "1.5", "0", "-0.5", "48M", "half", ""])
def test_parse_budget_refuses_the_rest_naming_the_accepted_forms(text):
    with pytest.raises(ValueError, match=r"\(0, 1\].*48MiB, 2GiB, 512KB"):
        parse_budget(text)


def test_cli_budget_2_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", "gpt-tiny", "--memory-budget", "2"])
    assert info.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--memory-budget" in line and "'2'" in line and "48MiB" in line and "(0, 1]" in line


def test_cli_budget_with_a_unit_is_bytes(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--policy", "none", "--memory-budget", "1GiB",
                 "--out", str(out)]) == 0
    import json

    assert json.loads(out.read_text())[0]["budget_bytes"] == 2**30


# ---- plan files -------------------------------------------------------------------------------

@pytest.fixture
def corrupt_plan(tmp_path):
    path = tmp_path / "corrupt_plan.json"
    path.write_text('[{"graph_hash": "abc", "decisions": {')
    return str(path)


def test_corrupt_plan_file_is_named_when_the_backend_is_built(corrupt_plan):
    with pytest.raises(ValueError, match=r"plan='.*corrupt_plan\.json' is not a lynx plan file \(JSONDecodeError"):
        lynx_compile.backend(plan=corrupt_plan)


def test_corrupt_plan_file_on_the_command_line(corrupt_plan, capsys):
    assert main(["plan", "--model", "gpt-tiny", "--plan", corrupt_plan]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("lynx: error: plan=") and "corrupt_plan.json" in line and "lynx plan" in line


# ---- options checked before any compile, lynx's message first at the first call ----------------

@pytest.mark.parametrize("options,match", [
    ({"time_limit_s": "fast"}, r"time_limit_s='fast' is not valid; use a number of seconds > 0"),
    ({"windows": "yes"}, r"windows='yes' is not valid; choose True or False"),
    ({"measure_repeats": 0}, r"measure_repeats=0 is not valid; use an int >= 1"),
    ({"disable_passes": ("no_such_pass",)}, r"unknown pass\(es\) \['no_such_pass'\]; passes are \[.*'find_blocks_pass'"),
    ({"policy": "fastest"}, r"policy='fastest' is not valid; choose one of \['lynx'"),
    ({"budget": 0.5}, r"unknown lynx option\(s\) \['budget'\]; did you mean '(memory|device)_budget' for 'budget'\? valid options are .*'memory_budget'"),
])
def test_options_are_checked_when_the_backend_is_built(options, match):
    with pytest.raises(ValueError, match=match):
        lynx_compile.backend(**options)


def test_bad_option_at_first_call_is_lynxs_error_not_dynamos():
    model = build_model("gpt-tiny")
    compiled = torch.compile(model, backend="lynx", options={"policy": "full", "budget": 0.5})
    with pytest.raises(LynxOptionError) as info:  # not torch's BackendCompilerFailed
        compiled(example_batch(model, 2))
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith("unknown lynx option(s) ['budget']")
    _assert_traceback_is_the_callers_then_lynxs(info.value)


def _assert_traceback_is_the_callers_then_lynxs(error: BaseException) -> str:
    """``error``'s printed traceback: the caller's frames down to torch.compile's entry, then the
    frame where lynx raised it, none of dynamo's tracing, AOTAutograd's or Inductor's in
    between, and no chained cause; its text."""
    import traceback

    text = "".join(traceback.format_exception(error))
    assert "BackendCompilerFailed" not in text and "The above exception" not in text, text
    frames = [line for line in text.splitlines() if line.lstrip().startswith("File ")]
    assert "lynx_compile" in frames[-1] and "eval_frame.py" in frames[-2], text
    assert not any(part in text for part in ("_functorch", "_inductor", "convert_frame.py")), text
    assert len(frames) <= 8, text
    return text


def test_a_refused_budget_at_first_call_is_lynxs_error_with_the_fix_first():
    """A budget no plan reaches, refused while dynamo compiles: lynx's BudgetError as raised
    (not torch's BackendCompilerFailed, whose text asks the user to report a bug to PyTorch),
    its first line naming the fix, dynamo's frames stripped from the traceback."""
    from lynx_compile.decisions import BudgetError

    model = build_model("gpt-tiny")
    compiled = torch.compile(model, backend=lynx_compile.backend(policy="full", memory_budget=0.05))
    with pytest.raises(BudgetError) as info:
        compiled(example_batch(model, 2))
    _assert_traceback_is_the_callers_then_lynxs(info.value)
    assert str(info.value).startswith("memory_budget=0.05") and "Use memory_budget >=" in str(info.value).split(". ")[1]
    assert info.value.smallest_bytes > 0


def test_policy_lynxs_refusal_names_one_budget_and_lynx_plan_names_it_too(capsys):
    """Policy lynx at a budget below every candidate, the model compiled whole: one refusal at
    the end of step 1, naming one smallest budget, the lowest peak of every candidate tried.
    Before session 41 it was chained to the optimizer's own refusal, which named a higher one
    (gpt-tiny: 0.832 printed first, then 0.728, which is accepted). ``lynx plan`` with the same
    model, batch and budget names the same budget: it plans the graph the compile makes, the
    gradients returned where ``.grad`` is None (before: added into ``.grad`` in the graph, and
    it named 0.704, which the compile refused)."""
    import traceback

    from lynx_compile.budget import named_fraction
    from lynx_compile.decisions import BudgetError

    model = build_model("gpt-tiny")
    compiled = torch.compile(model, backend=lynx_compile.backend(memory_budget=0.05))
    with pytest.raises(BudgetError) as info:
        compiled(example_batch(model, 2)).loss.backward()
    text = "".join(traceback.format_exception(info.value))
    assert "The above exception" not in text and text.count("Use memory_budget >=") == 1, text
    assert "the lowest of lynx's candidates" in str(info.value), text
    torch._dynamo.reset()
    assert main(["plan", "--model", "gpt-tiny", "--batch-size", "2", "--memory-budget", "0.05"]) == 2
    said = _one_error_line(capsys.readouterr().err)
    assert named_fraction(said) == named_fraction(str(info.value)), (said, str(info.value))


def test_make_config_keeps_plain_types():
    cfg = make_config({"time_limit_s": 5, "measure_repeats": 3})
    assert cfg.time_limit_s == 5.0 and type(cfg.time_limit_s) is float


# ---- the command line: one line, exit 2, --debug for the traceback ----------------------------

def test_cli_error_is_one_line_with_the_fix(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--policy", "full", "--memory-budget", "0.05",
                 "--compiler", "eager"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("lynx: error: memory_budget=0.05") and "Use memory_budget >=" in line


def test_cli_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--policy", "fastest"])
    assert info.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "invalid choice: 'fastest'" in line and "lynx plan --help" in line


@pytest.mark.parametrize("argv, says", [
    (["plan", "--model", "gpt-tiny", "--memory-budjet", "0.5"],
     "unrecognized arguments: --memory-budjet 0.5; did you mean '--memory-budget' for '--memory-budjet'?"),
    (["plan", "--solver", "higs"], "invalid choice: 'higs' (choose from 'auto', 'glpk', 'highs', 'heu'); did you mean 'highs'?"),
    (["plan", "--model", "gpt-tiny", "--zzz"], "unrecognized arguments: --zzz (see"),  # nothing close: no guess
])
def test_cli_guesses_a_misspelled_option_or_choice(capsys, argv, says):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert says in _one_error_line(capsys.readouterr().err)


def test_cli_debug_shows_the_traceback(corrupt_plan, monkeypatch):
    with pytest.raises(ValueError, match="corrupt_plan.json"):
        main(["--debug", "plan", "--model", "gpt-tiny", "--plan", corrupt_plan])
    monkeypatch.setenv("LYNX_DEBUG", "1")
    with pytest.raises(ValueError, match="corrupt_plan.json"):
        main(["plan", "--model", "gpt-tiny", "--plan", corrupt_plan])


def test_cli_help_every_flag_and_strategy_values():
    parser = build_parser()
    assert "arrives with issue" not in parser.format_help()
    subs = parser._subparsers._group_actions[0].choices
    for name in ("plan", "demo", "simulate"):
        sub = subs[name]
        missing = [a.option_strings for a in sub._actions if a.option_strings and not a.help]
        assert not missing, f"lynx {name}: flags without help: {missing}"
    simulate_help = subs["simulate"].format_help()
    assert "lynx-opt" in simulate_help and "selective" in simulate_help


# ---- MILP progress and the solver log (item 3) ------------------------------------------------

@pytest.mark.parametrize("solver", ["highs", "glpk"])
def test_milp_progress_lines_without_the_solver_log(solver, lynx_logging, capsys, monkeypatch):
    from lynx_compile.solver import milp_solvers
    from lynx_compile.solver.solve import solve_remat
    from lynx_compile.solver.synthetic import synthetic_problem

    if solver not in milp_solvers.available_solvers():
        pytest.skip(f"{solver} is not installed")
    monkeypatch.setattr(milp_solvers, "PROGRESS_EVERY_S", 0.0)  # every solver callback gives a line
    _log_to_stderr()  # what `lynx plan` does; the handler follows sys.stderr (pytest's capture here)
    log = logging.getLogger("lynx_compile")
    problem = synthetic_problem(2, 12, 1)
    solve_remat(problem, int(0.7 * problem.reference_peak), solver=solver, time_limit_s=30,
                progress=lambda line: log.info("lynx: %s", line))
    captured = capsys.readouterr()
    err = captured.err
    assert "lynx: lynx:" not in err
    progress = [line for line in err.splitlines() if "incumbent" in line]
    assert progress and all(line.startswith(f"lynx: lynx-opt[{solver}]: ") and "gap" in line for line in progress)
    assert all(line.startswith("lynx: ") for line in err.splitlines()), err  # nothing of the solver's own log
    assert captured.out == ""


def test_solver_log_once_when_verbose(lynx_logging, capsys):
    from lynx_compile.solver import milp_solvers
    from lynx_compile.solver.solve import solve_remat
    from lynx_compile.solver.synthetic import synthetic_problem

    if "highs" not in milp_solvers.available_solvers():
        pytest.skip("HiGHS is not installed")
    _log_to_stderr(solver_log=True)
    problem = synthetic_problem(2, 12, 1)
    solve_remat(problem, int(0.7 * problem.reference_peak), solver="highs", time_limit_s=30)
    err = capsys.readouterr().err
    assert err.count("Presolving model") == 1 and "lynx:" not in err


def test_stderr_handler_follows_sys_stderr(lynx_logging, monkeypatch):
    _log_to_stderr()
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    logging.getLogger("lynx_compile").info("lynx: hello")
    assert later.getvalue() == "lynx: hello\n"


def test_train_parser_reads_budgets_as_lynx_plan_does_and_documents_every_flag():
    """``python -m lynx_compile.train`` (what torchrun runs) parses ``--memory-budget`` like
    ``lynx plan``: ``2`` is refused (bytes need a unit), ``48MiB`` is bytes, ``0.5`` a fraction."""
    import argparse

    from lynx_compile.tools.train import add_train_arguments

    p = argparse.ArgumentParser(prog="lynx train")
    add_train_arguments(p)  # (includes the pipeline flags)
    assert p.parse_args(["--memory-budget", "0.5"]).memory_budget == 0.5
    assert p.parse_args(["--memory-budget", "48MiB"]).memory_budget == 48 * 2**20
    with pytest.raises(SystemExit):
        p.parse_args(["--memory-budget", "2"])
    undocumented = [a.option_strings for a in p._actions if a.option_strings and not a.help]
    assert not undocumented, undocumented
