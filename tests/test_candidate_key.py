"""``decisions.CandidateKey``: the typed name of a candidate compile (the step's plan, the caches,
the notes), its text form read back exactly, and no silent comparison with a string."""
from __future__ import annotations

import json

import pytest
import torch

from lynx_compile.decisions import CandidateKey
from lynx_compile.step.model import Candidate, GraphChoices

KEYS = [CandidateKey("none"), CandidateKey("full"), CandidateKey("selective"), CandidateKey("user"),
        CandidateKey("torch", setting=0.25), CandidateKey("lynx"), CandidateKey("lynx", nbytes=123456),
        CandidateKey("lynx", smallest=True), CandidateKey("plan"), CandidateKey("plan", nbytes=1 << 20)]
TEXTS = ["none", "full", "selective", "user", "torch@0.25", "lynx", "lynx@123456", "lynx@smallest", "plan",
         "plan@1048576"]


def test_text_is_written_and_read_back():
    assert [str(k) for k in KEYS] == TEXTS
    assert [CandidateKey.parse(t) for t in TEXTS] == KEYS
    assert len(set(KEYS)) == len(KEYS) and {CandidateKey.parse(t): t for t in TEXTS}[KEYS[4]] == "torch@0.25"


@pytest.mark.parametrize("text", ["torch", "torch@x", "plan@-3", "none@5", "half", "lynx@smallest@1", ""])
def test_other_text_is_refused(text):
    with pytest.raises(ValueError, match="not a candidate key"):
        CandidateKey.parse(text)


def test_a_key_compared_with_a_string_raises():
    with pytest.raises(TypeError, match="compare CandidateKeys"):
        CandidateKey("full") == "full"  # noqa: B015
    assert CandidateKey("full") != None  # noqa: E711 (an absent choice is None)


def test_graph_choices_round_trip_through_json():
    def cand(key, saved):
        return Candidate(name=key, exposed_s=0.5, saved_bytes=saved, forward_peak_bytes=saved + 1,
                         backward_peak_bytes=saved + 2)

    choices = GraphChoices(reference=cand(KEYS[0], 100), choices=(cand(KEYS[4], 40), cand(KEYS[7], 10)),
                           current=KEYS[4], incoming_bytes=8)
    assert GraphChoices.from_dict(json.loads(json.dumps(choices.to_dict()))) == choices


def test_only_a_plan_with_a_peak_is_held_within_it():
    """``plan_within``: the step's plan or a step hint holding a whole graph lower; lynx's optimizer
    at a peak (a piece's candidate) is not that."""
    assert CandidateKey("plan", nbytes=4096).plan_within == 4096
    assert [k.plan_within for k in KEYS if k != CandidateKey("plan", nbytes=1 << 20)] == [None] * (len(KEYS) - 1)


def test_a_plan_chosen_at_lynxs_smallest_peak_names_it_in_text():
    """gpt-tiny (2 layers, batch 4 x 64) at 0.6 is reached by lynx's own optimizer at its smallest
    peak alone; the plan's ``solver`` is the text "lynx@smallest" and the plan writes its JSON (the
    typed key there made ``to_json`` raise and broke a bench joining solvers)."""
    from lynx_compile.models import build_model, example_batch
    from lynx_compile.planning import plan_model

    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layers=2, seq_len=64, dropout=0.0)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    plan = plan_model(model, (x,), memory_budget=0.6, plan_cache=False)[-1].plan
    assert plan.solver == "lynx@smallest" and isinstance(plan.solver, str), repr(plan.solver)
    assert json.loads(plan.to_json())["solver"] == "lynx@smallest"
