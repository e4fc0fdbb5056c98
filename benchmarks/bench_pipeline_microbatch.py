"""Recompute chosen per micro-batch under ZBVZeroBubble, against one plan for every micro-batch
and against 1F1B, on 2 gloo CPU ranks. Not a test: it measures and writes
``benchmarks/results/pipeline_per_microbatch.{csv,md}``.

    python benchmarks/bench_pipeline_microbatch.py [--model gpt-small] [--layers 8] [--levels 1.2,1.0]

1. Profiles the model once (``plan_pipeline``, measured costs) and takes the largest stage peak
   P of an unconstrained ZBV plan (4 stages on 2 ranks).
2. Per memory level f (``memory_per_device = f x P``), three rows, each launched ``--repeats``
   times interleaved (``bench_pipeline.launch``; each launch trains ``--steps`` AdamW steps):
   - ``1F1B``: the lynx split into 2 stages, one allowance per stage;
   - ``ZBV``: the lynx split into 4 stages in V order, one allowance per stage (as today);
   - ``ZBV per-mb``: the same split, each stage's variant chosen per micro-batch
     (``per_microbatch=True``: ``pipeline.stage_variants`` + the MILP of ``pipeline.microbatch_plan``).
3. Columns: the predicted step (the stage planner's timeline; per-mb: the MILP choice replayed),
   the measured step (median after the compile step, best launch; every launch's median listed),
   the predicted per-rank activation peak of the rank's memory walk (``microbatch_replay.replay``:
   for the uniform rows every micro-batch at the stage's allowance, the ``plan`` variant), the
   measured per-rank peak (CPU allocator events over one more step, gradients left out, gloo
   buffers in), and the largest relative loss difference to the same steps in one process.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pipeline import _launch_interleaved, _loss_diff, _medians, _reference_losses, write_table  # noqa: E402


def _rank_activation(sv, walk) -> str:
    """Per rank, the walk's peak plus what the limit set aside (``StageVariants.reserved_bytes``):
    the predicted activation peak, comparable with the allocator's measured one (gradients,
    parameters and optimizer state in neither), in MiB joined by '/'."""
    return "/".join(f"{(w + r) / 2**20:.2f}" for w, r in zip(walk, sv.reserved_bytes))


def _uniform_walk(plan, costs):
    """Predicted (step s, per-rank peak B) of ``plan`` with every micro-batch of a stage at its
    allowance: the ``plan`` variant (``keep`` where the stage recomputes nothing) for all."""
    from lynx_compile.pipelining.microbatch_replay import replay
    from lynx_compile.pipelining.placement import zero_bubble_orders
    from lynx_compile.pipelining.stage_variants import send_seconds, stage_variants

    sv = stage_variants(plan, costs, ranks=2)
    choice = []
    for vs in sv.variants:
        names = [v.name for v in vs]
        v = names.index("plan") if "plan" in names else 0
        choice.append(tuple([v] * plan.num_microbatches))
    orders = zero_bubble_orders(plan.schedule, 2, plan.num_stages, plan.num_microbatches)
    step, peaks = replay(orders, sv.variants, tuple(choice), send_seconds(plan, costs))
    return step, peaks, sv


def _short(name: str) -> str:
    """keep -> k, plan -> p, least -> l, curve<k> -> c<k>."""
    return "c" + name[5:] if name.startswith("curve") else name[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--levels", default="1.2,1.0")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cost-source", default="measured", choices=["analytic", "measured"])
    p.add_argument("--port", type=int, default=29641)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    args.compiler = "eager"  # recompute in the gradient wait and lynx's runtime B/W cut

    from lynx_compile.models import build_model, example_batch
    from lynx_compile.pipelining import StagePlanError, plan_pipeline, plan_stages
    from lynx_compile.pipelining.microbatch_plan import MicrobatchPlanError, plan_microbatches
    from lynx_compile.pipelining.placement import stage_rank, zero_bubble_orders
    from lynx_compile.pipelining.stage_variants import send_seconds

    torch.manual_seed(0)
    model = build_model(args.model, n_layers=args.layers, dropout=0.0)
    mb = example_batch(model, args.batch_size // args.microbatches)
    opts = {"solver": "heu", "cost_source": args.cost_source, "compiler": "eager"}
    free, costs, _ = plan_pipeline(model, (mb,), num_stages=4, num_microbatches=args.microbatches,
                                   schedule="ZBVZeroBubble", options=opts, ranks=2)
    top = max(s.peak_bytes for s in free.stages)
    reference = _reference_losses(args)
    orders = zero_bubble_orders("ZBVZeroBubble", 2, 4, args.microbatches)
    rows, runs = [], []
    for level in [float(x) for x in args.levels.split(",")]:
        memory = int(level * top)
        for name, schedule, stages in (("1F1B", "1F1B", 2), ("ZBV", "ZBVZeroBubble", 4),
                                       ("ZBV per-mb", "ZBVZeroBubble", 4)):
            row = {"memory_level": level, "memory_MiB": round(memory / 2**20, 2), "row": name, "layers": "-",
                   "pred_step_ms": "-", "step_ms": "-", "launch_medians_ms": "-", "pred_rank_peak_MiB": "-",
                   "rank_limit_MiB": "-", "pred_rank_activation_MiB": "-", "planner_rank_activation_MiB": "-",
                   "measured_rank_peak_MiB": "-", "variants (stage: per micro-batch)": "-",
                   "max_rel_loss_diff": "-", "error": ""}
            rows.append(row)
            try:
                plan = plan_stages(costs, stages, args.microbatches, memory, schedule, method="lynx", ranks=2)
            except StagePlanError as e:
                row["error"] = str(e)[:160]
                continue
            row["layers"] = "/".join(map(str, plan.layers_per_stage))
            static = [0, 0]
            for st in plan.stages:
                static[stage_rank(schedule, st.index, stages, 2)] += st.static_bytes
            row["planner_rank_activation_MiB"] = "/".join(f"{(pk - sb) / 2**20:.2f}"
                                                          for pk, sb in zip(plan.rank_peak_bytes, static))
            row["pred_step_ms"] = round(plan.predicted_step_in_wait_s * 1e3, 2)
            extra = ()
            if schedule == "ZBVZeroBubble":
                _, peaks, sv = _uniform_walk(plan, costs)
                row["pred_rank_peak_MiB"] = "/".join(f"{b / 2**20:.2f}" for b in peaks)
                row["rank_limit_MiB"] = "/".join(f"{b / 2**20:.2f}" for b in sv.memory_limit)
                row["pred_rank_activation_MiB"] = _rank_activation(sv, peaks)
            if name == "ZBV per-mb":  # sv: this plan's variants, from _uniform_walk above
                try:
                    mbp = plan_microbatches(orders, sv.variants, send_seconds(plan, costs), sv.memory_limit,
                                            solver="auto")
                except MicrobatchPlanError as e:
                    row["error"] = str(e)[:160]
                    continue
                row["pred_step_ms"] = round(mbp.step_s * 1e3, 2)
                row["pred_rank_peak_MiB"] = "/".join(f"{b / 2**20:.2f}" for b in mbp.peak_bytes)
                row["pred_rank_activation_MiB"] = _rank_activation(sv, mbp.peak_bytes)
                row["variants (stage: per micro-batch)"] = " ".join(
                    f"{i}:" + ",".join(_short(sv.variants[i][v].name) for v in r) for i, r in enumerate(mbp.choice))
                extra = (costs,)
            runs.append((f"{name.replace(' ', '_')}_{level}", "lynx", True, memory, plan, len(rows) - 1, *extra))
    launched = _launch_interleaved(args, runs)
    for tag, _, _, _, _, slot, *_ in runs:
        best, ok = launched[slot]
        row = rows[slot]
        if not ok:
            row["error"] = best.get("error", "failed")
            continue
        row["step_ms"] = round(statistics.median(best["times"][1:]) * 1e3, 1)
        row["launch_medians_ms"] = _medians(ok)
        row["measured_rank_peak_MiB"] = "/".join(f"{b / 2**20:.2f}" for b in best["measured_peak"])
        row["max_rel_loss_diff"] = f"{max(_loss_diff(x['losses'], reference) for x in ok):.1e}"
    _write(args, top, rows)


def _write(args, top: int, rows: list[dict]) -> None:
    head = (f"{time.strftime('%Y-%m-%d')}; {platform.machine()}, {os.cpu_count()} cores; python "
            f"{platform.python_version()}, torch {torch.__version__}. 2 processes (gloo, CPU), {args.model} with "
            f"{args.layers} layers, batch {args.batch_size} in {args.microbatches} micro-batches, lynx per stage "
            f"(Lynx-HEU, {args.cost_source} costs, one profile for every row), eager compiler with recompute in "
            f"the gradient wait, {args.steps} steps per launch, step_ms = median of the steps after the compile "
            f"step, best of {args.repeats} interleaved launches (all medians listed). Memory per device = level x "
            f"the largest stage peak of an unconstrained ZBV plan ({top / 2**20:.2f} MiB). pred_rank_peak_MiB: "
            f"each rank's activation walk (microbatch_replay.replay; ZBV: every micro-batch at its stage's "
            f"allowance), against rank_limit_MiB (memory per device less the rank's static bytes, one "
            f"micro-batch's working bytes and a block's backward transient); pred_rank_activation_MiB adds "
            f"the working and transient bytes back (what the allocator measures). planner_rank_activation_MiB: "
            f"the stage plan's device peak per rank (StagePlan.rank_peak_bytes: its stages together, "
            f"pipeline.rank_memory) less the rank's static bytes. measured_rank_peak_MiB: CPU "
            f"allocator events over one more step, gradients left out. Variants: k = keep (nothing "
            f"recomputed), p = the stage plan's allowance, l = the least recompute-curve point, c<k> = the "
            f"stage's bytes at the profile's k-th budget-ladder point (pipeline.stage_variants).")
    cmd = (f"python benchmarks/bench_pipeline_microbatch.py --model {args.model} --layers {args.layers} "
           f"--levels {args.levels} --steps {args.steps} --repeats {args.repeats} --cost-source {args.cost_source}")
    write_table("pipeline_per_microbatch", head, cmd, list(rows[0]), rows)


if __name__ == "__main__":
    main()
