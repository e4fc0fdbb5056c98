"""Plan each baseline, then lynx at the peak it reaches, for the "lynx reaches every baseline" tests.

    rows = plan_reach(model, (x,), BASELINES, cost_source="analytic", hardware="h100-sxm")
    # rows[i]: Reach(name="torch@0.5", base_peak=..., base_exposed=..., lynx_peak=..., ...)

The baselines are planned from one trace, and lynx at every baseline's peak (in bytes) from a
second (``plan_model_variants``). Policy torch refuses a budget below the smallest peak of
lynx's own baselines (a user-facing check, ``decide.smallest_reachable``); torch.compile itself
still partitions there, and that partition is the baseline, so the check is off while the
baselines are planned.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch

from lynx_compile.models import build_model, example_batch
from lynx_compile.planning import plan_model_variants

BASELINES = (
    # full keeps only what leaves each block (the next block's input) and recomputes the rest of
    # the block: checkpointing each block, as torch.utils.checkpoint around every block does.
    ("full", {}),
    ("selective", {}),
    ("torch", {"memory_budget": 0.3}),
    ("torch", {"memory_budget": 0.5}),
    ("torch", {"memory_budget": 0.7}),
)


@dataclass(frozen=True)
class Reach:
    name: str
    base_peak: int
    base_exposed: float
    lynx_peak: int
    lynx_exposed: float
    lynx_solver: str
    candidates: tuple[str, ...]
    """What lynx compared (its optimizer's plan, the baselines it seeds with)."""

    @property
    def ok(self) -> bool:
        return self.lynx_peak <= self.base_peak and self.lynx_exposed <= self.base_exposed * (1 + 1e-9)

    def __str__(self) -> str:
        return (f"{self.name:>10}: base {self.base_peak} B / {self.base_exposed * 1e6:.1f} us, lynx "
                f"{self.lynx_peak} B / {self.lynx_exposed * 1e6:.1f} us ({self.lynx_solver})")


def plan_reach(model, example_inputs: tuple, baselines=BASELINES, **common) -> list[Reach]:
    """One ``Reach`` per baseline: its plan's peak and exposed recompute, and lynx's (HiGHS)
    with that peak as ``memory_budget`` in bytes."""
    # one .grad regime for baselines and lynx: the parameter gradients added into .grad in the
    # graph (lynx's default where it recomputes; torch's own partition returns them by default,
    # which would compare torch@s on another graph than the seed lynx tries as torch@s)
    # (with several ranks they are returned for every policy alike)
    several = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    common = {"accumulate_grad_in_graph": not several, **common}
    with mock.patch("lynx_compile.recompute.decide.smallest_reachable", lambda *a: ("none", 0)):
        base_records = plan_model_variants(model, example_inputs,
                                           [{"policy": p, **o} for p, o in baselines], **common)
    bases = [_one(records) for records in base_records]
    lynx_records = plan_model_variants(
        model, example_inputs, [{"policy": "lynx", "solver": "highs", "memory_budget": b.peak_bytes} for b in bases],
        **common)
    rows = []
    for (policy, options), base, records in zip(baselines, bases, lynx_records):
        name = f"torch@{options['memory_budget']}" if policy == "torch" else policy
        lynx = _one(records)
        candidates = tuple(records[0].stats.get("candidates", {}))
        rows.append(Reach(name, base.peak_bytes, base.exposed_s, lynx.peak_bytes, lynx.exposed_s, lynx.solver,
                          candidates))
    return rows


def _one(records):
    assert len(records) == 1, f"expected one graph, got {len(records)}"
    return records[0].plan


def reach_model(name: str, monkeypatch):
    """(model, token batch), both seeded; the model's output has ``.loss``: a zoo preset
    (dropout 0), or a model lynx was not written for (``benchmarks/foreign_models.py``): HF
    transformers' Llama, 2 layers, loss from ``labels``."""
    torch.manual_seed(0)
    if name != "hf-llama":
        model = build_model(name, dropout=0.0)
        return model, example_batch(model, 2, generator=torch.Generator().manual_seed(1))
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from foreign_models import hf_llama

    class WithLoss(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, idx):
            return self.lm(input_ids=idx, labels=idx)

    lm = hf_llama(vocab_size=128, seq_len=32, n_layers=2, hidden=64, n_heads=4, n_kv_heads=1, attn="eager")
    return WithLoss(lm), torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def plan_counting_partitions(model, x, monkeypatch, **options):
    """Compile ``model`` on ``x`` with lynx (analytic H100 costs, no plan cache, ``options``) and
    run one backward: (the records of this compile's graphs, how many partitions torch
    extracted a forward and backward from)."""
    import lynx_compile

    extracted = []
    original = torch._functorch.partitioners._extract_fwd_bwd_modules

    def counting(*args, **kwargs):
        extracted.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch._functorch.partitioners, "_extract_fwd_bwd_modules", counting)
    backend = lynx_compile.backend(cost_source="analytic", hardware="h100-sxm", plan_cache=False, **options)
    known = len(backend.records)
    torch._dynamo.reset()
    for p in model.parameters():  # each compile from .grad None: the regime lynx plans for is alike
        p.grad = None
    torch.compile(model, backend=backend)(x).loss.backward()
    monkeypatch.setattr(torch._functorch.partitioners, "_extract_fwd_bwd_modules", original)
    return backend.records[known:], len(extracted)
