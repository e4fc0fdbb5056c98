"""PP=2 on CPU (gloo): uniform vs compute-only vs lynx's recompute-aware split, with and without
recompute in the gradient wait. Not a test: it measures and writes
``benchmarks/results/pipeline.{csv,md}``.

    python benchmarks/bench_pipeline.py [--model gpt-small] [--layers 8] [--levels 0.6,0.5]

1. Plans the model once with no memory limit (compute-only balance) and takes the largest
   predicted stage peak P (stage 0: it holds the most micro-batches under 1F1B).
2. For each memory level f, ``memory_per_device = f x P``: for every split method (uniform,
   compute, lynx) and recompute-in-wait on/off, one ``torchrun`` launch of 2 ranks trains
   ``--steps`` steps with ``lynx_compile.pipeline`` (1F1B, lynx per stage). A split that cannot
   fit the memory is reported with what it would need, not run.
3. Step time = median of the steps after the compile step (rank 0's wall time per step, both
   ranks barrier-aligned). Memory per stage is *predicted* (CPU has no allocator peak): the
   planner's device peak and the compiled stage's (static + (k-1) x saved + one micro-batch's
   peak, from lynx's exact simulation of the stage graph).

With ``--schedules 1F1B,ZBVZeroBubble,InterleavedZeroBubble`` it compares pipeline schedules
instead and writes ``benchmarks/results/pipeline_schedules.{csv,md}``: per memory level of
``--levels`` and per schedule, the lynx split (one stage per rank for GPipe / 1F1B, two per rank
for the interleaved and zero-bubble schedules), lynx per stage, recompute in the gradient wait
(the eager compiler, which the zero-bubble B/W split needs too), the same measurements, how many
backward graphs per step deferred their weight gradients to W, and the largest relative loss
difference to the same steps trained in one process.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def worker(args) -> None:
    """One launch (inside torchrun): train, then rank 0 writes what every rank measured."""
    import torch.distributed as dist

    import lynx_compile
    from lynx_compile.models import build_model, example_batch
    from lynx_compile.models.common import lm_loss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build_model(args.model, n_layers=args.layers, dropout=0.0)
    g = torch.Generator().manual_seed(1)
    batches = [example_batch(model, args.batch_size, generator=g) for _ in range(args.steps)]
    from lynx_compile.pipelining import StagePlan

    from lynx_compile.pipelining import PipelineCosts

    with open(args.plan) as f:  # the parent's plan: every launch of a configuration runs the same split
        plan = StagePlan.from_dict(json.load(f))
    costs = None
    if args.costs:  # per_microbatch prices each stage's variants from the parent's profile
        with open(args.costs) as f:
            costs = PipelineCosts.from_dict(json.load(f))
    pl = lynx_compile.pipeline(model, (batches[0],), num_stages=plan.num_stages, num_microbatches=args.microbatches,
                               loss_fn=lambda lg, t: lm_loss(lg, t, None), memory_per_device=args.memory,
                               schedule=plan.schedule, method=args.method, recompute_in_wait=args.wait, plan=plan,
                               options={"solver": "heu", "cost_source": args.cost_source, "compiler": args.compiler},
                               per_microbatch=args.per_microbatch, costs=costs)
    opt = torch.optim.AdamW(list(pl.parameters()), lr=1e-3)
    times, losses = [], []
    for step, idx in enumerate(batches):
        if step == 1:  # count early recompute / gradient waits over the steady steps only
            for st in pl.stages:
                st.early_s = st.grad_wait_s = 0.0
                st.deferred_weights = 0
        dist.barrier()
        t0 = time.perf_counter()
        mb_losses: list = []
        pl.step(idx, target=idx, losses=mb_losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        if mb_losses:  # the rank holding the last stage: the step's loss, mean over micro-batches
            losses.append(float(sum(x.detach() for x in mb_losses) / len(mb_losses)))
    measured_peak = _measured_peak(pl, batches[0])
    mine = {}
    for i, backend in pl.backends.items():
        plan = backend.records[0].plan
        info = pl.plan.stages[i]
        mine[i] = {"compiled_peak": info.static_bytes + (info.in_flight - 1) * plan.saved_bytes + plan.peak_bytes,
                   "recomputed": len(plan.recomputed), "budget": plan.budget_bytes,
                   "early": pl.early_recomputes,
                   "early_ms": sum(st.early_s for st in pl.stages if st.stage_index == i) * 1e3 / (args.steps - 1),
                   "grad_wait_ms": sum(st.grad_wait_s for st in pl.stages if st.stage_index == i) * 1e3
                   / (args.steps - 1),
                   "deferred": sum(st.deferred_weights for st in pl.stages if st.stage_index == i)
                   / (args.steps - 1), "rank": rank}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, losses, measured_peak))
    if rank == 0:
        stages = {k: v for d, _, _ in everyone for k, v in d.items()}
        step_losses = next((ls for _, ls, _ in everyone if ls), [])
        mb_plan = pl.microbatch_plan
        with open(args.out, "w") as f:
            json.dump({"times": times, "plan": pl.plan.to_dict(), "stages": stages, "losses": step_losses,
                       "measured_peak": [m for _, _, m in everyone],
                       "choice": [list(r) for r in mb_plan.choice] if mb_plan is not None else None,
                       "mb_plan_step_s": mb_plan.step_s if mb_plan is not None else None,
                       "mb_plan_peaks": list(mb_plan.peak_bytes) if mb_plan is not None else None}, f)
    dist.destroy_process_group()


def _measured_peak(pl, batch) -> int:
    """One more pipeline step (no optimizer step) under the CPU allocator's events: this rank's
    peak above the step's start, gradients not counted (those left in ``.grad`` and those lynx's
    backwards and W return before they are added there, as ``memory.measure_step``): the
    activation memory of ``lynx_compile.memory``. The gloo transfers' buffers count."""
    import torch.distributed as dist

    from lynx_compile.memory import measure

    params = list(pl.parameters())
    for p in params:
        p.grad = None
    dist.barrier()
    measure.BACKWARD_OUTPUTS = set()  # what lynx's backwards and W return: gradients, as measure_step
    try:
        peak = measure.cpu_peak_bytes(
            lambda: pl.step(batch, target=batch, losses=[]),
            exclude=lambda: measure.BACKWARD_OUTPUTS | {p.grad.data_ptr() for p in params if p.grad is not None})
    finally:
        measure.BACKWARD_OUTPUTS = None
    for p in params:
        p.grad = None
    return peak


def launch(args, method: str, wait: bool, memory: int | None, tag: str, plan, costs=None) -> dict:
    """One torchrun launch of ``worker`` running ``plan``; with ``costs`` (the profile the plan
    was made from), the stages choose their recompute per micro-batch (``per_microbatch``)."""
    out = os.path.join(tempfile.mkdtemp(prefix="lynx_pp_"), f"{tag}.json")
    plan_path = out.replace(".json", "_plan.json")
    with open(plan_path, "w") as f:
        f.write(plan.to_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(args.port), os.path.abspath(__file__), "--worker", "--model", args.model, "--layers",
           str(args.layers), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--microbatches", str(args.microbatches), "--method", method, "--out", out,
           "--cost-source", args.cost_source, "--plan", plan_path, "--compiler", args.compiler]
    if wait:
        cmd.append("--wait")
    if costs is not None:
        costs_path = out.replace(".json", "_costs.json")
        with open(costs_path, "w") as f:
            json.dump(costs.to_dict(), f)
        cmd += ["--per-microbatch", "--costs", costs_path]
    if memory is not None:
        cmd += ["--memory", str(memory)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if "Error" in ln or "error" in ln]
        return {"error": (lines[-1] if lines else f"exit {proc.returncode}")[:300]}
    with open(out) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--method", default="lynx", help=argparse.SUPPRESS)
    p.add_argument("--wait", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--memory", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--costs", help=argparse.SUPPRESS)
    p.add_argument("--per-microbatch", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=2, help="launches per configuration, interleaved; "
                   "the table keeps the launch with the lowest median")
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--levels", default="0.6,0.54,0.53", help="memory per device as fractions of the largest "
                   "unconstrained stage peak")
    p.add_argument("--cost-source", default="measured", choices=["analytic", "measured"])
    p.add_argument("--schedules", default=None, help="comma list of pipeline schedules (e.g. "
                   "1F1B,ZBVZeroBubble,InterleavedZeroBubble): compare them instead (lynx split, recompute in the "
                   "gradient wait) and write results/pipeline_schedules.{csv,md}")
    p.add_argument("--compiler", default="eager", choices=["eager", "inductor"],
                   help="what compiles each stage (--schedules only; inductor: no recompute in the gradient "
                        "wait, which needs the eager compiler; the zero-bubble B/W split is compiled by Inductor)")
    p.add_argument("--port", type=int, default=29631)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from lynx_compile.models import build_model, example_batch
    from lynx_compile.pipelining import StagePlanError, plan_pipeline, plan_stages

    torch.manual_seed(0)
    model = build_model(args.model, n_layers=args.layers, dropout=0.0)
    mb = example_batch(model, args.batch_size // args.microbatches)
    opts = {"solver": "heu", "cost_source": args.cost_source, "compiler": args.compiler}
    # profile once: every method and level is planned from the same (measured) costs
    free, costs, _ = plan_pipeline(model, (mb,), num_stages=2, num_microbatches=args.microbatches,
                                   method="compute", options=opts)
    top = max(s.peak_bytes for s in free.stages)
    if args.schedules:
        return _compare_schedules(args, costs, top)
    rows, runs = [], []
    for level in [float(x) for x in args.levels.split(",")]:
        memory = int(level * top)
        for method in ("uniform", "compute", "lynx"):
            try:
                plan = plan_stages(costs, 2, args.microbatches, memory, "1F1B", method=method)
            except StagePlanError as e:
                rows.append(_row(level, memory, method, "-", None, error=str(e)[:160]))
                continue
            if not plan.fits:
                rows.append(_row(level, memory, method, "-", plan, error="does not fit: "
                                 f"stages {[s.index for s in plan.stages if not s.fits]} over the memory even with "
                                 "full recompute"))
                continue
            for wait in (False, True):
                runs.append((level, memory, method, wait, plan, len(rows)))
                rows.append(None)
    launched = _launch_interleaved(args, [(f"{method}_{level}_{int(wait)}", method, wait, memory, plan, slot)
                                          for level, memory, method, wait, plan, slot in runs])
    for level, memory, method, wait, plan, slot in runs:
        best, ok = launched[slot]
        row = _row(level, memory, method, wait, plan, best)
        row["launch_medians_ms"] = _medians(ok)
        rows[slot] = row
    for row in rows:
        row.setdefault("launch_medians_ms", "-")
    _write(args, top, rows)


def _launch_interleaved(args, runs) -> dict[int, tuple[dict, list[dict]]]:
    """Launch every (tag, method, recompute_in_wait, memory, plan, slot[, costs]) ``args.repeats`` times,
    interleaved (a slow spell of the machine hits every configuration); per slot: the launch with
    the fastest median step (the first launch when none succeeded) and the launches that did."""
    results: dict[int, list[dict]] = {}
    for r in range(args.repeats):
        for tag, method, wait, memory, plan, slot, *costs in runs:  # costs: per_microbatch rows
            res = launch(args, method, wait, memory, f"{tag}_{r}", plan, *costs)
            print(f"{tag}_{r}", res.get("error") or round(statistics.median(res["times"][1:]) * 1e3, 1), flush=True)
            results.setdefault(slot, []).append(res)
    out = {}
    for slot, got in results.items():
        ok = [x for x in got if "times" in x]
        out[slot] = (min(ok, key=lambda x: statistics.median(x["times"][1:])) if ok else got[0], ok)
    return out


def _medians(launches: list[dict]) -> str:
    """Each launch's median step time (ms), joined by '/'."""
    return "/".join(f"{statistics.median(x['times'][1:]) * 1e3:.0f}" for x in launches)


def _compare_schedules(args, costs, top: int) -> None:
    """``--schedules``: one row per memory level and schedule (lynx split, recompute in the wait)."""
    from lynx_compile.pipelining import StagePlanError, plan_stages
    from lynx_compile.pipelining.placement import MULTI_STAGE_SCHEDULES

    schedules = [x.strip() for x in args.schedules.split(",") if x.strip()]
    reference = _reference_losses(args)
    rows, runs = [], []
    for level in [float(x) for x in args.levels.split(",")]:
        memory = int(level * top)
        for schedule in schedules:
            stages = 4 if schedule in MULTI_STAGE_SCHEDULES else 2  # two per rank, or one
            try:
                plan = plan_stages(costs, stages, args.microbatches, memory, schedule, method="lynx", ranks=2)
            except StagePlanError as e:  # keep what it would need (the message's end)
                need = re.search(r"needs \d+ B \(([^)]*)\)", str(e))
                why = f"does not fit even with full recompute: needs {need.group(1)}" if need else str(e)[:160]
                rows.append(_schedule_row(level, memory, schedule, stages, None, error=why))
                continue
            if not plan.fits:
                rows.append(_schedule_row(level, memory, schedule, stages, plan, error="does not fit: stages "
                                          f"{[s.index for s in plan.stages if not s.fits]} over the memory even "
                                          "with full recompute"))
                continue
            runs.append((level, memory, schedule, stages, plan, len(rows)))
            rows.append(None)
    wait = args.compiler == "eager"  # recompute in the gradient wait runs the graphs op by op
    launched = _launch_interleaved(args, [(f"{schedule}_{level}", "lynx", wait, memory, plan, slot)
                                          for level, memory, schedule, stages, plan, slot in runs])
    for level, memory, schedule, stages, plan, slot in runs:
        best, ok = launched[slot]
        row = _schedule_row(level, memory, schedule, stages, plan, best, wait=wait)
        row["launch_medians_ms"] = _medians(ok) or "-"
        if ok:  # every launch trains the same steps: the worst loss difference over all of them
            row["max_rel_loss_diff"] = f"{max(_loss_diff(x['losses'], reference) for x in ok):.1e}"
        rows[slot] = row
    _write_schedules(args, top, rows)


def _reference_losses(args) -> list[float]:
    """The launches' steps in this process: one model, eager, the step's loss = mean of the
    micro-batch losses (as a pipeline step), AdamW as the workers run it."""
    from lynx_compile.models import build_model, example_batch

    torch.manual_seed(0)
    model = build_model(args.model, n_layers=args.layers, dropout=0.0)
    g = torch.Generator().manual_seed(1)
    batches = [example_batch(model, args.batch_size, generator=g) for _ in range(args.steps)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for idx in batches:
        loss = sum(model(chunk).loss for chunk in idx.chunk(args.microbatches)) / args.microbatches
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _loss_diff(got: list[float], want: list[float]) -> float:
    if len(got) != len(want):
        return float("inf")
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))


def _schedule_row(level, memory, schedule, stages, plan, res=None, error="", wait=True) -> dict:
    base = _row(level, memory, "lynx", wait, plan, res, error=error)
    row = {"memory_level": level, "memory_MiB": base["memory_MiB"], "schedule": schedule,
           "stages_per_rank": stages // 2, "layers": base["layers"], "pred_step_ms": base["pred_step_ms"],
           "step_ms": base["step_ms"], "fastest_step_ms": base["fastest_step_ms"], "launch_medians_ms": "-",
           "pred_peak_MiB": base["pred_peak_MiB"], "compiled_peak_MiB": base["compiled_peak_MiB"],
           "rank_compiled_peak_sum_MiB": "-", "recomputed_ops": base["recomputed_ops"],
           "early_ms": base["early_ms"], "grad_wait_ms": base["grad_wait_ms"], "deferred_W_per_step": "-",
           "max_rel_loss_diff": "-", "error": base["error"]}
    if res and "times" in res:
        st = res["stages"]
        keys = sorted(st, key=int)
        row["deferred_W_per_step"] = "/".join(f"{st[k]['deferred']:g}" for k in keys)
        ranks = sorted({st[k]["rank"] for k in keys})
        row["rank_compiled_peak_sum_MiB"] = "/".join(
            f"{sum(st[k]['compiled_peak'] for k in keys if st[k]['rank'] == r) / 2**20:.1f}" for r in ranks)
    return row


def write_table(name: str, head: str, cmd: str, cols: list[str], rows: list[dict]) -> None:
    """``results/<name>.csv`` and ``results/<name>.md`` (``head``, the command, a markdown table of
    ``cols``), the markdown also printed."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    lines = [head, "", f"Command: `{cmd}`", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _write_schedules(args, top: int, rows: list[dict]) -> None:
    name = "pipeline_schedules" if args.compiler == "eager" else f"pipeline_schedules_{args.compiler}"
    head = (f"{time.strftime('%Y-%m-%d')}; {platform.machine()}, {os.cpu_count()} cores; python "
            f"{platform.python_version()}, torch {torch.__version__}. 2 processes (gloo, CPU), {args.model} with "
            f"{args.layers} layers, batch {args.batch_size} in {args.microbatches} micro-batches; per schedule the "
            f"lynx split (1F1B / GPipe: one stage per rank; interleaved and zero-bubble schedules: two per rank, "
            f"ZBVZeroBubble in V order, rank 0 holding the first and the last stage), lynx per stage (Lynx-HEU, "
            f"{args.cost_source} costs, one profile for every row), "
            + ("recompute in the gradient wait on (eager compiler), " if args.compiler == "eager" else
               "stages compiled by Inductor (no recompute in the gradient wait; the zero-bubble schedules' B and W "
               "compiled as two Inductor graphs, option weight_split), ")
            + f"{args.steps} steps per launch, step_ms = median "
            f"of the steps after the compile step, best of {args.repeats} interleaved launches (all launches' "
            f"medians listed). Memory per device = level x the largest unconstrained 1F1B stage peak the planner "
            f"predicts ({top / 2**20:.1f} MiB); the planner prices each stage as if it had the device to itself. "
            f"Peaks are PREDICTED (CPU has no allocator peak), per stage: planner, and compiled = static + "
            f"(in-flight - 1) x saved + one micro-batch's exact simulated peak; rank_compiled_peak_sum_MiB sums "
            f"a rank's stages' compiled peaks (the memory W's deferred inputs hold between B and W is in the "
            f"planner's peaks, not in these). deferred_W_per_step: per stage, backward graphs per step whose weight gradients ran in W "
            f"(LynxPipelineStage.deferred_weights). max_rel_loss_diff: the largest relative difference of a "
            f"step's loss to the same {args.steps} AdamW steps in one process (eager, unsplit), over all launches."
            f"\n\nCPU step times on a 2-core machine are noisy (two processes share the two cores; launches of one "
            f"configuration differ by several ms); gloo transfers on one machine are cheap, so there are few "
            f"communication bubbles to fill. The zero-bubble schedules' benefit (W filling the bubbles) is "
            f"expected on GPUs with real communication; where it does not appear below, it is not shown here.")
    cmd = (f"python benchmarks/bench_pipeline.py --model {args.model} --layers {args.layers} --levels {args.levels} "
           f"--schedules {args.schedules} --steps {args.steps} --repeats {args.repeats} "
           f"--cost-source {args.cost_source}" + (f" --compiler {args.compiler}" if args.compiler != "eager" else ""))
    write_table(name, head, cmd, list(rows[0]), rows)


def _row(level, memory, method, wait, plan, res=None, error="") -> dict:
    row = {"memory_level": level, "memory_MiB": round(memory / 2**20, 2), "split": method,
           "recompute_in_wait": wait, "layers": "-", "pred_step_ms": "-", "step_ms": "-",
           "fastest_step_ms": "-", "pred_peak_MiB": "-", "compiled_peak_MiB": "-", "pred_recompute_ms": "-",
           "recomputed_ops": "-", "early_runs": "-", "early_ms": "-", "grad_wait_ms": "-", "error": error or (res or {}).get("error", "")}
    if plan is not None:
        row["layers"] = "/".join(map(str, plan.layers_per_stage))
        step = plan.predicted_step_in_wait_s if wait is True else plan.predicted_step_s
        row["pred_step_ms"] = round(step * 1e3, 1)
        row["pred_peak_MiB"] = "/".join(f"{s.peak_bytes / 2**20:.1f}" for s in plan.stages)
        row["pred_recompute_ms"] = "/".join(f"{s.recompute_s * 1e3:.2f}" for s in plan.stages)
    if res and "times" in res:
        ran = res["plan"]  # what the ranks ran (the plan this script made)
        row["layers"] = "/".join(map(str, ran["layers_per_stage"]))
        row["pred_step_ms"] = round((ran["predicted_step_in_wait_s"] if wait is True else ran["predicted_step_s"]) * 1e3, 1)
        row["pred_peak_MiB"] = "/".join(f"{s['peak_bytes'] / 2**20:.1f}" for s in ran["stages"])
        row["pred_recompute_ms"] = "/".join(f"{s['recompute_s'] * 1e3:.2f}" for s in ran["stages"])
        steady = res["times"][1:]
        row["step_ms"] = round(statistics.median(steady) * 1e3, 1)
        row["fastest_step_ms"] = round(min(steady) * 1e3, 1)
        st = res["stages"]
        keys = sorted(st, key=int)
        row["compiled_peak_MiB"] = "/".join(f"{st[k]['compiled_peak'] / 2**20:.1f}" for k in keys)
        row["recomputed_ops"] = "/".join(str(st[k]["recomputed"]) for k in keys)
        row["early_runs"] = "/".join(str(st[k]["early"]) for k in keys)
        row["early_ms"] = "/".join(f"{st[k]['early_ms']:.1f}" for k in keys)
        row["grad_wait_ms"] = "/".join(f"{st[k]['grad_wait_ms']:.1f}" for k in keys) if wait else "-"
    return row


def _write(args, top: int, rows: list[dict]) -> None:
    head = (f"{time.strftime('%Y-%m-%d')}; {platform.machine()}, {os.cpu_count()} cores; python "
            f"{platform.python_version()}, torch {torch.__version__}. PP=2 (2 processes, gloo), "
            f"{args.model} with {args.layers} layers, batch {args.batch_size} in {args.microbatches} micro-batches, "
            f"1F1B, lynx per stage (Lynx-HEU, {args.cost_source} costs), {args.steps} steps per launch, step_ms = "
            f"median of the steps after the compile step, best of {args.repeats} interleaved launches (all "
            f"launches' medians listed; fastest_step_ms: that launch's fastest step); every launch of a row runs "
            f"the same stage plan, made once by this script. early_ms / grad_wait_ms: per step, the time a stage "
            f"spent recomputing before its gradient arrived, and the time it then still waited. Memory levels "
            f"are fractions of "
            f"the largest unconstrained stage peak the planner predicts ({top / 2**20:.1f} MiB, stage 0). "
            f"Peaks per stage are PREDICTED (CPU has no allocator peak): planner, and compiled = static + "
            f"(in-flight - 1) x saved + one micro-batch's exact simulated peak.")
    cmd = (f"python benchmarks/bench_pipeline.py --model {args.model} --layers {args.layers} "
           f"--levels {args.levels} --cost-source {args.cost_source}")
    write_table("pipeline", head, cmd, [c for c in rows[0] if c != "error"] + ["error"], rows)


if __name__ == "__main__":
    main()
