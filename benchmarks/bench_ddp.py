"""lynx under compiled DDP against torch.compile (Inductor) on the same DDP model: every step's
measured peak, on gloo CPU ranks (issues Q and V).

    python benchmarks/bench_ddp.py --model gpt-tiny-256 --budget 0.7 --grads allocated
    python benchmarks/bench_ddp.py --model hf-llama --budget 0.7 --grads none --out benchmarks/results/ddp.md

``torch.compile(DistributedDataParallel(model, bucket_cap_mb=1), backend=...)``: dynamo's
DDPOptimizer splits the model at bucket boundaries, so lynx plans several graphs as one step
(``lynx_compile.step.recorder``). Each step's peak is the CPU allocator's (``cpu_peak_bytes``),
taken on rank 0, steps 1, 2, 4 and 5; step 3 is the one lynx records (one profiler at a time).
Step 2 is inflated alike in both: DDP rebuilds its buckets as step 2 starts, and the profiler
sees the new buckets allocated but not the old ones freed. ``--grads``: ``allocated``
(``zero_grad(set_to_none=False)``) or ``none`` (``zero_grad()``'s default) before every step.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from _dist import run_ranks  # noqa: E402
from _steps import step_peaks  # noqa: E402

STEPS = 5
RECORDED = 3


def _model(name: str):
    """(model, batch): ``batch(rank)`` gives the (args, kwargs) of that rank's call."""
    if name == "gpt-tiny-256":
        from lynx_compile.models import build_model, example_batch

        model = build_model("gpt-tiny", dropout=0.0, n_layers=2, hidden=256)

        def batch(rank):
            return (example_batch(model, 4, generator=torch.Generator().manual_seed(1 + rank)),), {}
        return model, batch
    if name == "hf-llama":
        from foreign_models import hf_llama

        model = hf_llama(vocab_size=1024, seq_len=64, n_layers=4, hidden=256, n_heads=4, n_kv_heads=2)

        def batch(rank):
            x = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1 + rank))
            return (), {"input_ids": x, "labels": x}
        return model, batch
    raise SystemExit(f"unknown model {name!r}: gpt-tiny-256 or hf-llama")


def _run(rank: int, world: int, name: str, options: dict | None, grads: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lynx_compile

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, batch = _model(name)
    args, kwargs = batch(rank)
    backend = "inductor" if options is None else lynx_compile.backend(**options)
    run = torch.compile(DDP(model, bucket_cap_mb=1), backend=backend)
    peaks, error = [], ""
    try:
        for peak in step_peaks(lambda: run(*args, **kwargs).loss.backward(), list(model.parameters()), STEPS,
                               grads, unmeasured=(RECORDED,)):
            peaks.append(peak)  # (kept up to a refusal)
    except Exception as e:  # noqa: BLE001 (a refusal is a result)
        error = str(e).splitlines()[0][:300]
    graphs = len(lynx_compile.backend(**options).records) if options is not None else 0
    return {"peaks": peaks, "error": error, "graphs": graphs,
            "grads": [p.grad.clone() for p in model.parameters()] if not error else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny-256")
    ap.add_argument("--budget", type=float, default=0.7)
    ap.add_argument("--grads", choices=("allocated", "none"), default="allocated")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", help="append the row to this markdown file")
    a = ap.parse_args()
    options = {"memory_budget": a.budget, "plan_cache": False}
    ref = run_ranks(_run, a.world, a.model, None, a.grads, timeout_s=1200)[0]
    got = run_ranks(_run, a.world, a.model, options, a.grads, timeout_s=1200)[0]
    fracs = ["-" if x is None or y is None else f"{x / y:.3f}" for x, y in zip(got["peaks"], ref["peaks"])]
    fracs += ["-"] * (STEPS - len(fracs))  # (steps after a refusal)
    result = got["error"].split(" The smallest")[0] if got["error"] else "trained"
    same = ("bit for bit" if got["grads"] and all(torch.equal(x, y) for x, y in zip(got["grads"], ref["grads"]))
            else "-" if not got["grads"] else
            f"max diff {max((x - y).abs().max().item() for x, y in zip(got['grads'], ref['grads'])):.2e}")
    row = (f"| {a.model} | {a.world} | {a.grads} | {a.budget} | {got['graphs']} | "
           + " | ".join(fracs) + f" | {same} | {result} |")
    print(json.dumps({"inductor": ref["peaks"], "lynx": got["peaks"]}))
    print(row)
    if a.out:
        new = not os.path.exists(a.out)
        with open(a.out, "a") as f:
            if new:
                commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=HERE).stdout.strip()
                f.write(f"# Compiled DDP: lynx against torch.compile, every step\n\n"
                        f"`benchmarks/bench_ddp.py`; {platform.processor() or platform.machine()}, "
                        f"{os.cpu_count()} cores, torch {torch.__version__}, gloo, fp32, commit {commit}. "
                        "Fractions are of torch.compile's (Inductor's) same step on the same DDP model, "
                        "rank 0; step 3 is lynx's recorded step (not measured); step 2 holds DDP's "
                        "rebuilt buckets in both.\n\n"
                        "| model | ranks | .grad at start | budget | graphs | step 1 | step 2 | step 3 | "
                        "step 4 | step 5 | gradients vs Inductor | result |\n"
                        "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
            f.write(row + "\n")


if __name__ == "__main__":
    main()
