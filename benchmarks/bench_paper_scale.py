"""GPT 1.3B-23B on modeled clusters: throughput, MFU and plan search time per recompute strategy.

Not a test: it measures nothing on a GPU. It profiles each model's layer with lynx's own planning
trace (meta device, fake tensor-parallel group, analytic costs of the cluster's accelerator;
``lynx_compile.sim.layer_profile``), then simulates one training iteration per strategy with
``lynx_compile.sim`` (``sim.scale.evaluate``). One command regenerates every table and plot:

    python benchmarks/bench_paper_scale.py            # profiles cached in results/paper_scale_profiles.json
    python benchmarks/bench_paper_scale.py --reprofile --models gpt-1.3b,gpt-13b
    python benchmarks/bench_paper_scale.py --schedules 1F1B,ZBVZeroBubble --models gpt-23b --clusters a100-nvlink-32

Per (model, cluster) the layout is fixed as a user would choose it (``LAYOUTS``), the global batch
is 128 sequences of 2048 tokens, and each strategy gets the micro-batch (1, 2 or 4) with the best
simulated throughput among those that fit; a strategy that fits at none is OOM, with the memory
its best attempt needs. Writes ``results/paper_scale.{csv,md}``, ``results/paper_scale_search.md``,
``results/paper_scale_throughput.png`` and a timeline (Chrome trace + Gantt) of one configuration.

``--schedules`` compares pipeline schedules instead (``schedule_table``): per pipelined
configuration and micro-batch, lynx's recompute-aware stage plan (``plan_stages``, Lynx-OPT's
per-layer recompute curve) under each schedule and its predicted step (``pipelining.schedule_sim``:
the zero-bubble schedules replay torch's own order with each backward split into B and W). Writes
``results/paper_scale_schedules.{csv,md}``.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import platform
import sys
import time
import warnings

import torch

from lynx_compile.sim.layer_profile import LayerProfile, plan_search_time, profile_layer
from lynx_compile.sim.scale import CLUSTERS, STRATEGIES, Layout, evaluate
from lynx_compile.sim.timeline import plot_gantt, to_chrome_trace

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODELS = ("gpt-1.3b", "gpt-2.7b", "gpt-6.7b", "gpt-13b", "gpt-23b")
MICROBATCHES = (1, 2, 4)
GLOBAL_BATCH = 128
# (tp, pp) per model on 8 devices (dp fills the rest), and on the 32-device cluster
LAYOUTS_8 = {"gpt-1.3b": (2, 1), "gpt-2.7b": (4, 1), "gpt-6.7b": (8, 1), "gpt-13b": (8, 1), "gpt-23b": (4, 2)}
LAYOUTS_32 = {"gpt-13b": (8, 2), "gpt-23b": (8, 4)}
# the same models with half the tensor parallelism (more data parallelism, less communication):
# what a user tries first for throughput, and where activation memory binds
LAYOUTS_8_TIGHT = {"gpt-2.7b": (2, 1), "gpt-6.7b": (4, 1), "gpt-13b": (4, 1), "gpt-23b": (8, 1)}
TIGHT_CLUSTERS = ("a100-nvlink-8", "ascend-910b-8")
BASELINES = ("none", "full", "selective", "uniform", "torch", "checkmate")
"""What users run today (no recompute when it fits, Megatron's options, torch's budget) and the
no-overlap optimum; all with uniform stage cuts."""


def configs(models, clusters):
    for cluster in clusters:
        tables = [LAYOUTS_32] if CLUSTERS[cluster].devices == 32 else [LAYOUTS_8]
        if cluster in TIGHT_CLUSTERS:
            tables.append(LAYOUTS_8_TIGHT)
        for model in models:
            for table in tables:
                if model in table:
                    tp, pp = table[model]
                    yield model, cluster, tp, pp, CLUSTERS[cluster].devices // (tp * pp)


def get_profile(cache: dict, model: str, cluster: str, tp: int, mb: int, reprofile: bool) -> LayerProfile:
    c = CLUSTERS[cluster]
    key = f"{model}|{c.hardware}|{c.intra_link}|tp{tp}|mb{mb}"
    if key not in cache or reprofile:
        t0 = time.perf_counter()
        cache[key] = profile_layer(model, hardware=c.hardware, link=c.intra_link, tp=tp, microbatch=mb,
                                   solvers=("heu", "highs", "glpk")).to_dict()
        print(f"  profiled {key} in {time.perf_counter() - t0:.1f} s", flush=True)
    return LayerProfile.from_dict(cache[key])


def best_outcome(profiles: dict, strategy: str, cluster: str, tp: int, pp: int, dp: int):
    """The fitting micro-batch with the best throughput, else the attempt needing the least memory."""
    outcomes = []
    for mb, prof in profiles.items():
        layout = Layout(tp=tp, pp=pp, dp=dp, microbatch=mb, global_batch=GLOBAL_BATCH)
        if layout.num_microbatches < pp:
            continue
        outcomes.append((mb, evaluate(prof, strategy, CLUSTERS[cluster], layout)))
    fitting = [(mb, o) for mb, o in outcomes if o.fits]
    if fitting:
        return max(fitting, key=lambda t: t[1].tokens_per_s)
    return min(outcomes, key=lambda t: t[1].need_bytes)


def run(args) -> list[dict]:
    cache_path = os.path.join(RESULTS, "paper_scale_profiles.json")
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    rows = []
    for model, cluster, tp, pp, dp in configs(args.models, args.clusters):
        print(f"{model} on {cluster}: tp={tp} pp={pp} dp={dp}", flush=True)
        profiles = {mb: get_profile(cache, model, cluster, tp, mb, args.reprofile) for mb in MICROBATCHES}
        with open(cache_path, "w") as f:
            json.dump(cache, f)
        for strategy in STRATEGIES:
            mb, o = best_outcome(profiles, strategy, cluster, tp, pp, dp)
            rows.append({"model": model, "config": f"{model} ({tp}/{pp}/{dp})", "cluster": cluster, "tp": tp, "pp": pp, "dp": dp, "strategy": strategy,
                         "microbatch": mb, "fits": o.fits, "iteration_s": o.iteration_s,
                         "tokens_per_s": o.tokens_per_s if o.fits else None, "mfu": o.mfu if o.fits else None,
                         "peak_GiB": o.need_bytes / 2**30, "layers_per_stage": "/".join(map(str, o.layers_per_stage)),
                         "decision": " | ".join(o.choices)})
    return rows, cache


def speedups(rows: list[dict]) -> list[dict]:
    out = []
    for key in dict.fromkeys((r["config"], r["cluster"]) for r in _ordered(rows)):
        group = {r["strategy"]: r for r in rows if (r["config"], r["cluster"]) == key}
        tput = {s: r["tokens_per_s"] for s, r in group.items() if r["fits"]}
        base = {s: t for s, t in tput.items() if s in BASELINES}
        best_base = max(base, key=base.get) if base else None
        lynx = tput.get("lynx-opt")
        out.append({"config (tp/pp/dp)": key[0], "cluster": key[1],
                    "best_baseline": best_base or "OOM",
                    "lynx_opt_vs_best_baseline": lynx / base[best_base] if lynx and best_base else None,
                    "lynx_opt_vs_full": lynx / tput["full"] if lynx and "full" in tput else None,
                    "lynx_opt_vs_no_partition": (lynx / tput["lynx-no-partition"]
                                             if lynx and "lynx-no-partition" in tput else None),
                    "none_fits": "none" in tput})
    return out


def _ordered(rows: list[dict]) -> list[dict]:
    clusters = list(CLUSTERS)
    return sorted(rows, key=lambda r: (clusters.index(r["cluster"]), MODELS.index(r["model"]), -r["tp"]))


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def md_table(rows: list[dict], keys: list[str]) -> list[str]:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return lines + ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]


def throughput_table(rows: list[dict]) -> list[str]:
    lines = []
    for cluster in dict.fromkeys(r["cluster"] for r in rows):
        lines += ["", f"### {cluster}", "", "tokens/s per strategy (micro-batch in brackets; OOM: GiB needed)", ""]
        head = ["model (tp/pp/dp)"] + list(STRATEGIES)
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for config in dict.fromkeys(r["config"] for r in _ordered(rows) if r["cluster"] == cluster):
            group = {r["strategy"]: r for r in rows if r["cluster"] == cluster and r["config"] == config}
            cells = [config]
            for s in STRATEGIES:
                r = group[s]
                cells.append(f"{r['tokens_per_s']:.0f} [{r['microbatch']}]" if r["fits"]
                             else f"OOM {r['peak_GiB']:.0f} GiB")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def full_search(cache: dict, models, reprofile: bool) -> None:
    """lynx's plan of each whole model (8-device layout's tp, micro-batch 1, budget 0.6 of the
    no-recompute peak) with each solver: what a user waits for at compile time."""
    c = CLUSTERS["a100-nvlink-8"]
    for model in models:
        for solver in ("heu", "highs", "glpk"):
            key = f"search|{model}|{solver}"
            if key not in cache or reprofile:
                cache[key] = plan_search_time(model, hardware=c.hardware, link=c.intra_link,
                                              tp=LAYOUTS_8[model][0], solver=solver)
                print(f"  {key}: {cache[key]['solve_s']:.3f} s in the solver", flush=True)


def full_search_table(cache: dict) -> list[str]:
    lines = ["| model | tp | layers | HEU solve s | HEU plan s | HiGHS solve s | HiGHS status | GLPK solve s | "
             "GLPK status | trace + plan s (HEU) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model in MODELS:
        got = {sv: cache.get(f"search|{model}|{sv}") for sv in ("heu", "highs", "glpk")}
        if not all(got.values()):
            continue
        h = got["heu"]
        from lynx_compile.models.presets import get_config

        milp = []
        for sv in ("highs", "glpk"):
            r = got[sv]
            if r["status"] == "heuristic":  # the MILP found nothing in its time limit; lynx fell back
                milp += ["60 (limit)", "no plan in 60 s; lynx fell back to HEU"]
            else:
                gap = next((n.split("relative gap ")[1] for n in r["notes"] if "relative gap" in n), None)
                milp += [f"{r['solve_s']:.1f}", r["status"] + (f", gap {float(gap):.3f}" if gap else "")]
        lines.append(f"| {model} | {LAYOUTS_8[model][0]} | {get_config(model).n_layers} | {h['solve_s']:.3f} | "
                     f"{h['plan_time_s']:.2f} | {' | '.join(milp)} | {h['trace_and_plan_s']:.1f} |")
    return lines


def search_table(cache: dict) -> list[str]:
    lines = ["| model | tp | HEU s | OPT (HiGHS) s | OPT (GLPK) s | profile s |", "|---|---|---|---|---|---|"]
    for model in MODELS:
        key = next((k for k in cache if k.startswith(f"{model}|a100-sxm4-80gb|") and k.endswith("|mb1")), None)
        if key is None:
            continue
        p = cache[key]
        s = p["solve_s"]
        lines.append(f"| {model} | {p['tp']} | {s.get('lynx-heu', 0):.3f} | {s.get('lynx-opt', 0):.3f} | "
                     f"{s.get('lynx-opt-glpk', 0):.3f} | {p['profile_s']:.1f} |")
    return lines


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    fig, axes = plt.subplots(len(clusters), 1, figsize=(11, 3.2 * len(clusters)), squeeze=False)
    for ax, cluster in zip(axes[:, 0], clusters):
        models = list(dict.fromkeys(r["config"] for r in _ordered(rows) if r["cluster"] == cluster))
        width = 0.8 / len(STRATEGIES)
        for j, s in enumerate(STRATEGIES):
            vals = []
            for m in models:
                r = next(r for r in rows if r["config"] == m and r["cluster"] == cluster and r["strategy"] == s)
                full = next(x for x in rows if x["config"] == m and x["cluster"] == cluster and x["strategy"] == "full")
                vals.append(r["tokens_per_s"] / full["tokens_per_s"] if r["fits"] and full["fits"] else 0.0)
            ax.bar([i + j * width for i in range(len(models))], vals, width, label=s)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models, fontsize=7)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("throughput / full")
        ax.set_title(f"{cluster} (simulated; 0 = OOM)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, ncol=len(STRATEGIES), fontsize=7, loc="upper center", frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timeline(cache: dict, args) -> str:
    """Chrome trace + Gantt of gpt-13b on the 32-device cluster under lynx-opt (micro-batch 1)."""
    key = "gpt-13b|a100-sxm4-80gb|nvlink3|tp8|mb1"
    if key not in cache:
        return ""
    prof = LayerProfile.from_dict(cache[key])
    layout = Layout(tp=8, pp=2, dp=2, microbatch=1, global_batch=16)
    out, res = evaluate(prof, "lynx-opt", CLUSTERS["a100-nvlink-32"], layout, result=True)
    base = os.path.join(RESULTS, "paper_scale_timeline")
    to_chrome_trace(res, base + ".json")
    plot_gantt(res, base + ".png", title="gpt-13b, 32 x A100, tp8 pp2 dp2, 8 micro-batches, lynx-opt (simulated)")
    return base


STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2}


def pipeline_costs(prof: LayerProfile, cluster, layout: Layout):
    """The per-layer ``PipelineCosts`` ``sim.scale`` plans lynx's cuts with (Lynx-OPT's recompute
    curve, tensor-parallel collectives on the compute stream), plus what a zero-bubble schedule
    needs: each layer's weight-gradient seconds, 3h / (6h + s) of its backward compute (the
    linears' dW matmuls; ``pipeline.step_time.WEIGHT_SHARE``; the collectives carry dx, so they stay in
    B), half the LM head's backward (its dx and dW matmuls), none of the embedding's, and the
    point-to-point link between stages (``sim.scale``'s choice)."""
    from lynx_compile.costs.comm import LINKS
    from lynx_compile.pipelining.pipeline_costs import PipelineCosts, SegmentCost
    from lynx_compile.pipelining.recompute_curve import RecomputeCurve
    from lynx_compile.sim.scale import STATE_BYTES_PER_PARAM_BYTE, _candidates, _exposed, _logits_bytes

    pts = _candidates(prof, "lynx-opt")
    curve = RecomputeCurve(kept_bytes=tuple(q.kept_bytes for q in pts),
                           exposed_s=tuple(_exposed(q, prof, cluster) for q in pts))
    comm = sum(prof.comm_s)
    share = 3 * prof.hidden / (6 * prof.hidden + prof.seq_len)
    block = SegmentCost(name="layer", forward_s=prof.forward_s + comm, backward_s=prof.backward_s + comm,
                        weight_backward_s=share * prof.backward_s, param_bytes=prof.layer_param_bytes,
                        activation_bytes=prof.points["none"][0].kept_bytes, curve=curve,
                        output_bytes=layout.microbatch * prof.seq_len * prof.hidden * 2)
    link = LINKS[cluster.inter_link if layout.tp * layout.pp > cluster.devices_per_node else cluster.intra_link]
    return PipelineCosts(
        blocks=(block,) * prof.n_layers,
        pre=SegmentCost(name="<pre>", forward_s=prof.pre_s[0], backward_s=prof.pre_s[1], weight_backward_s=0.0,
                        param_bytes=prof.pre_param_bytes, activation_bytes=prof.pre_bytes),
        post=SegmentCost(name="<post>", forward_s=prof.post_s[0], backward_s=prof.post_s[1],
                         weight_backward_s=0.5 * prof.post_s[1], param_bytes=prof.post_param_bytes,
                         activation_bytes=prof.post_bytes),
        working_bytes=_logits_bytes(prof, layout), state_bytes_per_param_byte=STATE_BYTES_PER_PARAM_BYTE,
        p2p_bytes_per_s=link.bandwidth_bytes_per_s, p2p_latency_s=link.alpha_s, microbatch_size=layout.microbatch)


def schedule_rows(cache: dict, args) -> list[dict]:
    """``--schedules``: one row per pipelined configuration, micro-batch and schedule
    (``SCHEDULE_ASSUMPTIONS``). A rank holding two stages fits them to its memory together
    (``plan_stages``' rank sharing, ``pipeline.rank_memory``)."""
    from lynx_compile.pipelining.placement import stage_rank
    from lynx_compile.pipelining.plan_stages import plan_stages
    from lynx_compile.pipelining.stage_plan import StagePlanError

    rows = []
    for model, cluster, tp, pp, dp in configs(args.models, args.clusters):
        if pp < 2:
            continue
        c = CLUSTERS[cluster]
        for mb in MICROBATCHES:
            prof = get_profile(cache, model, cluster, tp, mb, args.reprofile)
            layout = Layout(tp=tp, pp=pp, dp=dp, microbatch=mb, global_batch=GLOBAL_BATCH)
            m, costs = layout.num_microbatches, pipeline_costs(prof, c, layout)
            for schedule in args.schedules:
                v = STAGES_PER_RANK[schedule]
                row = {"config": f"{model} ({tp}/{pp}/{dp})", "cluster": cluster, "microbatch": mb,
                       "microbatches": m, "schedule": schedule, "stages": v * pp}
                try:
                    plan = plan_stages(costs, v * pp, m, c.memory_bytes, schedule, method="lynx", ranks=pp)
                except StagePlanError as e:
                    rows.append({**row, "error": str(e).split(":")[0][:80]})
                    continue
                work = [0.0] * pp
                for st in plan.stages:
                    work[stage_rank(schedule, st.index, v * pp, pp)] += m * st.time_s
                rows.append({**row, "layers_per_stage": "/".join(map(str, plan.layers_per_stage)), "fits": plan.fits,
                             "recompute_ms_per_mb": round(sum(s.recompute_s for s in plan.stages) * 1e3, 2),
                             "step_s": plan.predicted_step_s, "step_in_wait_s": plan.predicted_step_in_wait_s,
                             "bubble": 1 - max(work) / plan.predicted_step_s,
                             "tokens_per_s": GLOBAL_BATCH * prof.seq_len / plan.predicted_step_s})
    return rows


def schedule_table(cache: dict, args) -> int:
    rows = schedule_rows(cache, args)
    keys = ["config", "cluster", "microbatch", "microbatches", "schedule", "stages", "layers_per_stage", "fits",
            "recompute_ms_per_mb", "step_s", "step_in_wait_s", "bubble", "tokens_per_s", "error"]
    with open(os.path.join(RESULTS, "paper_scale_schedules.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    env = (f"{time.strftime('%Y-%m-%d')}; simulated on {platform.machine()}, {os.cpu_count()} cores; python "
           f"{platform.python_version()}, torch {torch.__version__}")
    lines = [env, "", "Command: `python benchmarks/bench_paper_scale.py --schedules " + ",".join(args.schedules) +
             (" --models " + ",".join(args.models)) + (" --clusters " + ",".join(args.clusters)) + "`", "",
             "**Simulated, not measured.** " + SCHEDULE_ASSUMPTIONS + " " + ASSUMPTIONS, ""] + md_table(rows, keys)
    with open(os.path.join(RESULTS, "paper_scale_schedules.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    p.add_argument("--clusters", type=lambda s: s.split(","), default=list(CLUSTERS))
    p.add_argument("--reprofile", action="store_true", help="profile again instead of reading the cache")
    p.add_argument("--no-full-search", action="store_true",
                   help="skip planning each whole model with each solver (~1 min per MILP at its time limit)")
    p.add_argument("--schedules", type=lambda s: s.split(","), default=None,
                   help="compare pipeline schedules (e.g. 1F1B,ZBVZeroBubble) on the pipelined configurations "
                        "instead; writes results/paper_scale_schedules.{csv,md}")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lynx_compile").setLevel(logging.ERROR)
    os.makedirs(RESULTS, exist_ok=True)
    if args.schedules:
        cache_path = os.path.join(RESULTS, "paper_scale_profiles.json")
        cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
        return schedule_table(cache, args)
    rows, cache = run(args)
    if not args.no_full_search:
        full_search(cache, args.models, args.reprofile)
        with open(os.path.join(RESULTS, "paper_scale_profiles.json"), "w") as f:
            json.dump(cache, f)
    with open(os.path.join(RESULTS, "paper_scale.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ups = speedups(rows)
    plot(rows, os.path.join(RESULTS, "paper_scale_throughput.png"))
    base = timeline(cache, args)
    env = (f"{time.strftime('%Y-%m-%d')}; simulated on {platform.machine()}, {os.cpu_count()} cores; python "
           f"{platform.python_version()}, torch {torch.__version__}")
    lines = [env, "", "Command: `python benchmarks/bench_paper_scale.py " + " ".join(argv or sys.argv[1:]) + "`", "",
             "**Simulated, not measured.** " + ASSUMPTIONS, "", "## Lynx-OPT against the baselines", ""]
    lines += md_table(ups, list(ups[0]))
    lines += ["", "## Throughput", ""] + throughput_table(rows)
    lines += ["", "## Plan search time", "",
              "Whole model, as `torch.compile(backend='lynx')` plans it (micro-batch 1, tp of the 8-device layout, "
              "memory_budget 0.6, MILP time limit 60 s, gap 1e-4; HEU solves one representative block exactly and "
              "replicates it). Solve = inside the solver; plan = extract + solve + check; the trace is dynamo + "
              "aot_autograd on the meta device:", ""]
    lines += full_search_table(cache)
    lines += ["", "One solve of the two-block layer problem the tables above use (mean over its budget ladder):", ""]
    lines += search_table(cache)
    if base:
        lines += ["", f"Timeline of one configuration: `{os.path.basename(base)}.json` (chrome://tracing) and `.png`."]
    with open(os.path.join(RESULTS, "paper_scale.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


ASSUMPTIONS = (
    "Per-layer forward/backward time, tensor-parallel all-reduce time and activation bytes come from lynx's "
    "planning trace of a two-block copy of each model (bf16, meta device, fake TP group) with analytic roofline "
    "costs of the accelerator's datasheet profile (lynx_compile.costs: matmul efficiency 0.7, memory 0.8) and "
    "the intra-node link's alpha-beta (NVLink3 300 GB/s, PCIe4 31.5 GB/s, HCCS 196 GB/s; InfiniBand HDR 25 GB/s "
    "between nodes). Every layer is that layer. Memory: 16 B per parameter (bf16 weights and grads, fp32 master "
    "and Adam; no ZeRO), kept activations x in-flight micro-batches (1F1B), the recomputed bytes of one layer's "
    "backward, fp32 logits on the last stage. kappa = 1.1 (recompute inside a collective runs 10% slower). "
    "Data-parallel all-reduce of the gradients after the last backward, not overlapped. Strategies: "
    "lynx_compile.sim.scale. MFU = Megatron's 72BsLh^2(1+s/6h+V/12hL) / (time x devices x bf16 peak).")


SCHEDULE_ASSUMPTIONS = (
    "Per schedule, lynx's recompute-aware stage cuts (plan_stages, method lynx, Lynx-OPT's per-layer recompute "
    "curve) and the step pipelining.schedule_sim replays: 1F1B one stage per rank; ZBVZeroBubble two per rank in a V, torch's "
    "own action order, each backward split into B (input gradients, with the tensor-parallel collectives) and W = "
    "3h/(6h+s) of a layer's backward compute (half the LM head's). A rank holding two stages fits them to its "
    "memory together (pipeline.rank_memory). recompute_ms_per_mb: exposed recompute summed over the stages. Bubble: 1 - the busiest rank's work "
    "/ the step. step_s and tokens_per_s: the pipeline alone (no data-parallel all-reduce, no optimizer step).")


if __name__ == "__main__":
    sys.exit(main())
