"""The peak the step's plan across pieces gave a whole graph, remembered for the next run.

A model compiled as a whole graph beside other compiled graphs (torchtitan's trainer compiles
the model and its loss apart) plans the model graph within the budget's fraction of its own peak
at step 1; when the step recorded at step 2 does not fit, ``step.recorder`` plans that graph again
within a lower peak (``step_choice.plan_within``) and compiles it again at step 3. A rerun of the
same script would compile it twice again. Here the lower peak is kept in the plan cache
directory, keyed by what the graph's first compile sees (the dynamo graph and its inputs, lynx's
options and budget, the hardware profile, lynx's source), and the rerun's first compile plans
within it at once: the step's plan then finds it fits, and nothing is compiled twice. If the
step has changed (another loss, another batch), step 2's recording still decides: the graph is
planned lower again if the step does not fit (it is never planned higher than the hint).

Off where AOTAutograd's cache for lynx is off (several planning ranks, ``plan_cache=False``, a
plan file, measured costs, offload): every rank must compile alike.
"""
from __future__ import annotations

import logging
from typing import Any

import torch.fx as fx

from lynx_compile.caches import plans as plan_cache
from lynx_compile.config import LynxConfig
from lynx_compile.decisions import CandidateKey

log = logging.getLogger("lynx_compile")


def key(gm: fx.GraphModule, example_inputs: list, config: LynxConfig) -> str | None:
    """The hint's key for a graph's first compile, or None where hints are off."""
    from lynx_compile.caches import autograd as autograd_cache

    if config.policy != "lynx" or config.budget is None or not autograd_cache.keeps_plans(config):
        return None
    return plan_cache.plan_key({**autograd_cache.graph_fields(gm, example_inputs, config, "step_hint"),
                                "budget": config.budget.given()})


def load(hint_key: str | None) -> CandidateKey | None:
    """The ``plan`` choice within a peak kept under ``hint_key``, or None (none kept, or an entry
    that is not one)."""
    data = plan_cache.load_record(hint_key) if hint_key else None
    text = data.get("step_choice") if isinstance(data, dict) else None
    try:
        choice = CandidateKey.parse(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return choice if choice is not None and choice.plan_within is not None else None


def keep(record: Any) -> None:
    """After the step's plan: keep ``record``'s choice when it plans a whole graph lower than its
    first compile did (a ``plan`` within a peak), under the key of that first compile."""
    hint_key = record.stats.get("step_hint_key")
    choice = record.step_choice
    if hint_key and choice is not None and choice.plan_within is not None and load(hint_key) != choice:
        plan_cache.store_record(hint_key, {"step_choice": str(choice)})
