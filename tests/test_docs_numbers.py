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


DEMO_RESULT = README.parent / "benchmarks" / "results" / "demo" / "demo_cpu.md"
DEMO_DOC = README.parent / "docs" / "demo.md"


def _table(text: str) -> list[dict]:
    """The rows of the first markdown table in ``text``, by column."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def _mib(cell: str) -> float:
    assert cell.endswith(" MiB"), cell
    return float(cell[:-4])


def test_the_demo_table_the_docs_quote_is_the_demos_and_says_what_the_text_says():
    """docs/demo.md's table is the one ``lynx demo`` wrote (benchmarks/results/demo/demo_cpu.md),
    the conclusion under it is what ``demo_table.conclusion`` says of that table today, and the
    README's and the page's numbers are the table's. (The demo itself takes ~100 s on 2 cores, so
    it is not rerun here: a new table comes from running it, `lynx demo --out benchmarks/results/demo`.)"""
    from lynx_compile.tools.demo_table import conclusion

    result, doc = DEMO_RESULT.read_text(), DEMO_DOC.read_text()
    rows = _table(result)
    assert _table(doc) == rows, "docs/demo.md's table is not benchmarks/results/demo/demo_cpu.md's"
    as_run = [{"variant": r["variant"], "result": "ok", "peak_MiB": _mib(r["peak"]), "step_ms": float(r["step_ms"])}
              for r in rows]
    said = conclusion(as_run)
    assert said and all(line in result and line in doc for line in said), said
    by = {r["variant"]: r for r in rows}
    lynx = sorted((v for v in by if v.startswith("lynx-b")), key=lambda v: -float(v[len("lynx-b"):]))
    for v in lynx:  # the budget is a bound on the measured step, and the gradients are eager's
        assert float(by[v]["peak_vs_compile"]) <= float(v[len("lynx-b"):]) and by[v]["grads_equal_eager"] == "yes"
    ratios = " / ".join(by[v]["peak_vs_compile"] for v in lynx)
    readme, page = _readme(), " ".join(doc.split())
    assert f"measures {ratios} of torch.compile's peak" in readme, ratios
    assert f"measures {', '.join(by[v]['peak_vs_compile'] for v in lynx[:-1])} and {by[lynx[-1]]['peak_vs_compile']}" \
        in page
    low, ck = by[lynx[-1]], by["checkpoint"]
    pair = f"({low['peak'].removesuffix(' MiB')} against {ck['peak']})"
    speed = f"{float(low['step_ms']) / float(ck['step_ms']):.2f}x its step time"
    assert pair in readme and speed in readme, (pair, speed)
