"""Hugging Face's ``Trainer`` with lynx (issue V): the path the docs give Trainer users
(``docs/huggingface.md``): ``model.compile(backend="lynx", options=...)`` before the
``Trainer``, options from ``LYNX_OPTIONS`` or ``options=``, one process and two (``torchrun``,
the Trainer's DDP over gloo). References: the same Trainer run with ``backend="inductor"`` for the
losses and each step's forward + backward peak (``training_step``, measured with the
allocator events; ``.grad`` None at each start, the Trainer's ``zero_grad()``).

``TrainingArguments(torch_compile_backend="lynx")`` cannot work without a change in accelerate
(its ``TorchDynamoPlugin`` accepts only the names of its ``DynamoBackend`` enum): the test pins
that accelerate refuses it before any training, as the docs say.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_trainer import train  # noqa: E402

BUDGET = 0.7
STEPS = 5
RECORDED = 3  # the step lynx records: no profiler of the test's around it
SLACK = 1.02


def _within_budget(lynx: dict, inductor: dict) -> None:
    for step, (mine, ref) in enumerate(zip(lynx["peaks"], inductor["peaks"]), 1):
        if mine is not None:
            assert mine <= BUDGET * SLACK * ref, (step, mine / ref, lynx["peaks"], inductor["peaks"])


def test_trainer_one_process_at_a_budget(tmp_path):
    torch.set_num_threads(1)
    inductor = train("inductor", steps=STEPS, unmeasured=(RECORDED,), out_dir=str(tmp_path / "inductor"))
    lynx = train("lynx", {"memory_budget": BUDGET, "plan_cache": False}, steps=STEPS, unmeasured=(RECORDED,),
                 out_dir=str(tmp_path / "lynx"))
    assert len(lynx["losses"]) == STEPS
    assert lynx["losses"] == inductor["losses"]  # bit for bit: nothing lynx recomputes changes a value
    assert lynx["plans"], "lynx planned no graph"
    for fraction, budget_bytes, _ in lynx["plans"]:
        assert fraction <= BUDGET and budget_bytes is not None
    _within_budget(lynx, inductor)


def test_trainer_torch_compile_backend_lynx_is_refused_by_accelerate(tmp_path):
    """The docs' one line: accelerate's enum refuses the name before anything compiles."""
    from transformers import Trainer, TrainingArguments

    from _hf_trainer import _Tokens, tiny_llama

    args = TrainingArguments(output_dir=str(tmp_path), torch_compile_backend="lynx", use_cpu=True,
                             report_to=[], max_steps=1)
    with pytest.raises(ValueError, match="(?i)lynx.*DynamoBackend"):
        Trainer(model=tiny_llama(), args=args, train_dataset=_Tokens())


@pytest.mark.timeout(900)
def test_trainer_two_processes_ddp_at_a_budget(tmp_path):
    """``torchrun --nproc-per-node 2``: the Trainer wraps the compiled model in DDP (gloo), lynx's
    options from ``LYNX_OPTIONS``; per rank, the losses equal Inductor's and each measured step
    is within the budget of Inductor's; both ranks run the same plans."""
    env = dict(os.environ, LYNX_OPTIONS=json.dumps({"memory_budget": BUDGET, "plan_cache": False}),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).parent / "_hf_trainer.py"), str(STEPS), str(RECORDED)]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=840)
    results = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("result-*.json"))]
    assert done.returncode == 0 and len(results) == 2, done.stdout[-3000:] + done.stderr[-5000:]
    for r in results:
        assert len(r["lynx"]["losses"]) == STEPS
        assert r["lynx"]["losses"] == r["inductor"]["losses"]
        _within_budget(r["lynx"], r["inductor"])
        assert all(fraction <= BUDGET for fraction, _, _ in r["lynx"]["plans"])
    assert [p[2] for p in results[0]["lynx"]["plans"]] == [p[2] for p in results[1]["lynx"]["plans"]]
