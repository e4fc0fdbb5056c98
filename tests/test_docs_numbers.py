"""Numbers the README quotes from a command are the command's answer today (issue T, item 1):
each quote is found in the README's text and the command is run; a change in lynx that moves
the number fails here until the README says what the tool says."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lynx_compile.tools.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"

pytestmark = pytest.mark.timeout(600)


def _readme() -> str:
    return " ".join(README.read_text().split())  # quotes may wrap across lines


def test_the_refusal_the_readme_quotes_is_the_one_lynx_plan_answers(capsys):
    quote = re.search(r"`lynx plan --model (\S+) --memory-budget ([\d.]+)`: `Use memory_budget >= ([\d.]+)`",
                      _readme())
    assert quote is not None, "the README no longer quotes lynx plan's refusal: drop this test with it"
    model, budget, smallest = quote.groups()
    assert main(["plan", "--model", model, "--memory-budget", budget]) == 2
    err = capsys.readouterr().err
    answered = re.search(r"Use memory_budget >= ([\d.]+)", err)
    assert answered is not None, err
    assert answered.group(1) == smallest, (f"README quotes `Use memory_budget >= {smallest}` for "
                                           f"`lynx plan --model {model} --memory-budget {budget}`; "
                                           f"the tool answers {answered.group(1)}")
