"""torch's min-cut at several budgets often saves the same values (issue P item 3: planning time).
``seeds.baseline_candidates`` tries torch's min-cut at up to 11 settings; a setting whose
choice of saved values an earlier one already made stops right after the choice
(``_compat.min_cut_stops_on_repeat``) and is that earlier candidate again, instead of extracting,
reordering and simulating the same graphs once more.

Reference: the same compile with every setting partitioned in full: the candidates' peaks and
exposed recompute, and the plan, are the same; fewer partitions are extracted."""
import contextlib
import json

from lynx_compile import _compat
from _reach import plan_counting_partitions as _plan
from _reach import reach_model


def test_a_repeated_choice_is_not_partitioned_again(monkeypatch):
    """gpt-tiny at 0.8: lynx's optimizer has no plan, so torch's min-cut is tried at 9 settings
    (0.9 ... 0.1, among them 0.8 x (1, 0.5)); 0.9, 0.8 and 0.7 save the same values."""
    model, x = reach_model("gpt-tiny", monkeypatch)
    once, n_once = _plan(model, x, monkeypatch, memory_budget=0.8)
    monkeypatch.setattr(_compat, "min_cut_stops_on_repeat", lambda seen, label: contextlib.nullcontext())
    every, n_every = _plan(model, x, monkeypatch, memory_budget=0.8)
    assert len(once) == len(every) == 1
    a, b = once[0], every[0]
    assert json.dumps(a.stats["candidates"], sort_keys=True) == json.dumps(b.stats["candidates"], sort_keys=True)
    assert len([k for k in a.stats["candidates"] if k.startswith("torch@")]) == 9
    assert a.plan.decisions.to_dict() == b.plan.decisions.to_dict()
    assert a.plan.peak_bytes == b.plan.peak_bytes and a.plan.solver == b.plan.solver
    assert 0 < n_once < n_every, (n_once, n_every)
