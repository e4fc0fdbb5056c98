"""The step's plan kept by the plan cache, on ranks whose machines kept different caches (issue S
item 1): every rank takes rank 0's entry, as it takes rank 0's calibrated link and CPU profile.

Two gloo ranks each train gpt-tiny compiled per block (4 pieces, ``compiler="eager"``) at
``memory_budget=0.5``, each rank with a torch.compile cache directory of its own (two machines).
The first run records step 2 and keeps the step's plan on both; then rank 1's cache is deleted
(a fresh machine) and the same script runs again: both ranks take rank 0's plan at the end of
step 1, nothing recorded, the same choices as the first run. Before session 30 each rank read
only its own cache: rank 1 found nothing, and every rank recorded the step again.
"""
from __future__ import annotations

import os
import shutil

import torch

from _dist import run_ranks

BUDGET = 0.5


def _train(rank: int, world: int, root: str, steps: int) -> dict:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, f"machine{rank}")
    from lynx_compile.compiler.dynamo_backend import LynxBackend
    from lynx_compile.config import make_config
    from lynx_compile.models import build_model, example_batch

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=4)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    backend = LynxBackend(make_config({"policy": "lynx", "memory_budget": BUDGET, "compiler": "eager"}))
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        model(x).loss.backward()
    recorder = backend.step_recorder
    return {"state": recorder.state, "cached": recorder._cached, "steps_seen": recorder.steps_seen,
            "choices": [str(r.step_choice) for r in backend.records],
            "grads": [p.grad.clone() for p in model.parameters()]}


def test_a_rank_whose_machine_kept_no_plan_takes_rank_0s(tmp_path):
    root = str(tmp_path)
    first = run_ranks(_train, 2, root, 3, timeout_s=300)
    assert all(r["state"] == "done" and not r["cached"] for r in first), first
    assert first[0]["choices"] == first[1]["choices"] and any(c != "None" for c in first[0]["choices"])
    shutil.rmtree(os.path.join(root, "machine1"))  # rank 1 on a fresh machine

    again = run_ranks(_train, 2, root, 2, timeout_s=300)
    for rank, r in enumerate(again):
        # the step's plan taken at the end of step 1, in force at step 2: nothing recorded
        assert r["state"] == "done" and r["cached"] and r["steps_seen"] == 1, (rank, r["state"], r["cached"])
        assert r["choices"] == first[0]["choices"], (rank, r["choices"], first[0]["choices"])
    # the same plan on both ranks: the same gradients (each rank trains the same batch alone)
    assert all(torch.equal(a, b) for a, b in zip(again[0]["grads"], again[1]["grads"]))
