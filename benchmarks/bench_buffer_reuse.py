"""lynx's plan compiled with Inductor's buffer reuse under lynx's rule (option ``buffer_reuse``,
the default since session 32), without it (``buffer_reuse=False``, how lynx compiled before), and
with Inductor's own rule (its check against its own estimate), against torch.compile at an
``activation_memory_budget``: the measured step peak, the step time (interleaved rounds, paired
ratios), the reuse Inductor's code makes, and gradients against eager.

Not a test: it measures and prints a markdown table (``--out`` writes it too).

    python benchmarks/bench_buffer_reuse.py --case gpt-small:0.626951:0.5 --case gpt-tiny:0.593718:0.5

A case is ``model:lynx_budget:torch_setting`` (models as ``bench_step.py --model``). Each
variant is compiled in this process with Inductor's FX-graph cache off (a compile is its own);
``Inductor's rule`` runs with ``buffer_reuse=False`` and ``_compat.INDUCTOR_KEEP_PLACEMENT``
rebound without ``allow_buffer_reuse`` while its graphs compile (forward and, lazily, backward:
the first two steps). 4 layers, batch 4 x 64, fp32, one thread, ``.grad`` None before every step.
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_step  # noqa: E402


def _variant(name: str, s: "bench_step.Settings", placement: dict | None, reuse: bool):
    from lynx_compile import _compat
    from lynx_compile.memory.measure import cpu_peak_bytes, grad_snapshot
    from lynx_compile.tools import variants

    model, loss_of = bench_step.build(s)
    options = variants.lynx_options(name, solver="auto")
    if options is None:
        fn = variants.prepare(name, model, solver="auto")
    else:
        fn = torch.compile(model, backend="lynx", options={**options, "buffer_reuse": reuse})
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        loss_of(fn).backward()

    saved = _compat.INDUCTOR_KEEP_PLACEMENT
    if placement is not None:
        _compat.INDUCTOR_KEEP_PLACEMENT = placement
    try:
        torch.manual_seed(1234)
        with _compat.inductor_output_code() as codes:
            step()
        first = grad_snapshot(model)
        step()
    finally:
        _compat.INDUCTOR_KEEP_PLACEMENT = saved
    gc.collect()  # (garbage of earlier variants freed inside the measured step would read as negative)
    reuse = sum(c.count("# reuse") for c in codes)
    allocations = sum(len(re.findall(r"empty_strided_\w+\(", c)) for c in codes)
    return step, cpu_peak_bytes(step), first, reuse, allocations


def run_case(case: str, rounds: int) -> list[dict]:
    from lynx_compile.memory.measure import grad_rel_diff

    model_name, budget, setting = case.rsplit(":", 2)
    s = bench_step.Settings(model=model_name, layers=4, seq=64, batch=4, zero_grad=1)
    _, ref = bench_step.eager_reference(s)
    from lynx_compile import _compat

    plain = {k: v for k, v in _compat.INDUCTOR_KEEP_PLACEMENT.items() if k != "allow_buffer_reuse"}
    # a hair apart: one lynx backend per budget (dynamo shares a backend's code between copies)
    names = {"lynx": (f"lynx-b{budget}", None, True),
             "lynx, buffer_reuse=False": (f"lynx-b{float(budget) + 1e-7:.7f}", None, False),
             "lynx, Inductor's rule": (f"lynx-b{float(budget) + 2e-7:.7f}", plain, False),
             "torch.compile": (f"inductor-b{setting}", None, False)}
    rows, steps = [], {}
    for label, (name, placement, on) in names.items():
        step, peak, grads, reuse, allocs = _variant(name, s, placement, on)
        steps[label] = step
        rows.append({"model": model_name, "variant": label, "as": name, "peak_MiB": round(peak / 2**20, 3),
                     "reused": reuse, "allocated": allocs, "grad_rel_diff_vs_eager": f"{grad_rel_diff(grads, ref):.2e}"})
    times: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps)
    for r in range(rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            t = time.perf_counter()
            steps[k]()
            times[k].append(time.perf_counter() - t)
    for row in rows:
        t = times[row["variant"]]
        row["step_ms"] = round(statistics.median(t) * 1e3, 3)
        row["vs_torch"] = round(statistics.median(a / b for a, b in zip(t, times["torch.compile"])), 3)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", required=True, help="model:lynx_budget:torch_setting")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config

    from lynx_compile.tools.report import environment, markdown_table

    inductor_config.fx_graph_cache = False
    torch._dynamo.config.cache_size_limit = 64
    rows = [row for case in args.case for row in run_case(case, args.rounds)]
    env = "; ".join(f"{k} {v}" for k, v in environment().items())
    text = (f"# Inductor's buffer reuse under lynx's plans (CPU)\n\n{time.strftime('%Y-%m-%d')}; {env}\n\n"
            f"Command: `python benchmarks/bench_buffer_reuse.py {' '.join(sys.argv[1:])}`\n\n"
            "peak: measured step peak (.grad None first); reused / allocated: `# reuse` lines and "
            "`empty_strided` calls in Inductor's generated code (forward and backward); step_ms: median "
            f"of {args.rounds} interleaved rounds; vs_torch: median of per-round ratios.\n\n" + markdown_table(rows) + "\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
