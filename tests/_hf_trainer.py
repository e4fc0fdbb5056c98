"""Hugging Face ``Trainer`` runs of a tiny ``LlamaForCausalLM``, compiled with Inductor or lynx as
the docs tell Trainer users to (``model.compile(backend="lynx")`` before the ``Trainer``; options
from ``LYNX_OPTIONS`` or ``options=``), each step's forward + backward measured.

Imported by ``tests/test_hf_trainer.py`` (one process) and run as a script under ``torchrun``
(several processes: the Trainer wraps the model in DDP over gloo), writing one JSON file per rank,
``result-RANK.json`` in the working directory (not stdout, where the Trainer's own prints of another
rank can land inside a line): ``python tests/_hf_trainer.py STEPS UNMEASURED`` runs Inductor, then
lynx with ``LYNX_OPTIONS``.
"""
from __future__ import annotations

import json
import os
import sys

import torch

import lynx_compile  # registers backend="lynx"
from lynx_compile.config import options_from_env
from lynx_compile.distributed.agreement import plan_fingerprint
from lynx_compile.memory.measure import cpu_peak_bytes

UNMEASURED_DEFAULT = (3,)
"""The step lynx records (a step lynx records must have no other profiler around it)."""


class _Tokens(torch.utils.data.Dataset):
    """64 fixed sequences of 32 tokens; ``labels`` = ``input_ids`` (the model shifts them)."""

    def __init__(self):
        self.x = torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_llama():
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads, vocab 128), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def train(backend: str, options: dict | None = None, steps: int = 5, unmeasured=UNMEASURED_DEFAULT,
          out_dir: str = "/tmp/lynx-hf-trainer", **train_args) -> dict:
    """Train ``steps`` steps with the Trainer on one process, or on every rank of a ``torchrun``
    launch. ``backend``: ``"inductor"`` or ``"lynx"`` (``options=None``: from ``LYNX_OPTIONS``).
    Returns the logged losses, each step's measured peak (None where unmeasured) and, for lynx,
    each graph's (peak fraction, budget, plan fingerprint)."""
    from transformers import Trainer, TrainingArguments

    peaks: list = []

    class MeasuredTrainer(Trainer):
        def training_step(self, *args, **kwargs):
            if len(peaks) + 1 in unmeasured:
                peaks.append(None)
                return super().training_step(*args, **kwargs)
            box = []
            peaks.append(cpu_peak_bytes(lambda: box.append(super(MeasuredTrainer, self).training_step(*args, **kwargs))))
            return box[0]

    torch._dynamo.reset()
    model = tiny_llama()
    if backend == "lynx":
        model.compile(backend="lynx", **({} if options is None else {"options": options}))
    else:
        model.compile(backend="inductor")
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4, max_steps=steps, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        seed=0, data_seed=0, **({"ddp_backend": "gloo"} if "WORLD_SIZE" in os.environ else {}), **train_args)
    trainer = MeasuredTrainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    out = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "peaks": peaks}
    if backend == "lynx":
        bound = lynx_compile.backend(**(options if options is not None else options_from_env() or {}))
        out["plans"] = [(r.plan.peak_fraction, r.plan.budget_bytes, plan_fingerprint(r.plan))
                        for r in bound.records]
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    steps, unmeasured = int(sys.argv[1]), tuple(int(s) for s in sys.argv[2].split(",") if s)
    result = {"rank": int(os.environ.get("RANK", 0)),
              "inductor": train("inductor", steps=steps, unmeasured=unmeasured),
              "lynx": train("lynx", steps=steps, unmeasured=unmeasured)}
    with open(f"result-{result['rank']}.json.part", "w") as f:
        json.dump(result, f)
    os.replace(f"result-{result['rank']}.json.part", f"result-{result['rank']}.json")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # no interpreter finalization (as python -m lynx_compile.torchtitan_train): under load a rank
    # aborted there, "terminate called without an active exception", after its results were written
    sys.stderr.flush()
    os._exit(0)
