"""The ``lynx`` command line: ``lynx plan``, ``lynx demo`` and ``lynx train`` (``simulate``
arrives with issue F)."""
from __future__ import annotations

import argparse
import json
import sys
import time


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="lynx", choices=["lynx", "none", "full", "selective", "torch"])
    p.add_argument("--solver", default="auto", choices=["auto", "glpk", "highs", "heu"],
                   help="policy lynx: MILP solver (Lynx-OPT) or the block heuristic (heu)")
    p.add_argument("--time-limit", type=float, default=60.0, help="MILP time limit in seconds")
    p.add_argument("--mip-gap", type=float, default=1e-4, help="relative MIP gap")
    p.add_argument("--memory-budget", type=_budget, default=None,
                   help="fraction in (0, 1] of the no-recompute peak, or an integer number of bytes")
    p.add_argument("--cost-source", default="analytic", choices=["analytic", "measured"])
    p.add_argument("--hardware", default="auto", help="hardware profile for analytic costs")
    p.add_argument("--compiler", default="inductor", choices=["inductor", "eager"],
                   help="the compiler the plan is for (a plan file only matches graphs compiled "
                        "with the same one: Inductor's joint passes change the graph)")


def _budget(text: str) -> float | int:
    return int(text) if text.isdigit() else float(text)


def _options(args: argparse.Namespace) -> dict:
    opts = {"policy": args.policy, "cost_source": args.cost_source, "hardware": args.hardware,
            "solver": args.solver, "time_limit_s": args.time_limit, "mip_gap": args.mip_gap,
            "compiler": args.compiler}
    if args.memory_budget is not None:
        opts["memory_budget"] = args.memory_budget
    return opts


def cmd_plan(args: argparse.Namespace) -> int:
    import logging

    from lynx_compile.backend import _log_to_stderr

    _log_to_stderr()  # solver progress and per-graph decisions
    logging.getLogger("lynx_compile").handlers[0].setFormatter(logging.Formatter("%(message)s"))

    from lynx_compile.models import example_batch, load_model_spec, num_parameters, PRESETS
    from lynx_compile.planning import plan_model
    from lynx_compile.report import human_bytes, markdown_table

    device = args.device
    if device == "auto":
        big = args.model in PRESETS and num_parameters(PRESETS[args.model]) > 2e8
        device = "meta" if big else "cpu"
    overrides = {} if args.seq_len is None else {"seq_len": args.seq_len}
    _say(f"building {args.model} on {device} ...")
    model = load_model_spec(args.model, **overrides) if device == "cpu" else \
        _build_on(args.model, device, overrides)
    x = example_batch(model, args.batch_size, device=device)
    _say("tracing and planning (one forward pass) ...")
    start = time.perf_counter()
    records = plan_model(model, (x,), **_options(args))
    _say(f"planned {len(records)} graph(s) in {time.perf_counter() - start:.2f} s")
    for record in records:
        plan = record.plan
        if plan is None:
            continue
        print(f"\ngraph {record.graph_id}: policy={plan.policy}  blocks={len(plan.blocks)}  "
              f"hardware={record.decisions.get('hardware')}  costs={record.decisions.get('cost_source')}")
        rows = [{"block": b.path, "saved": human_bytes(b.saved_bytes), "saved_tensors": len(b.saved),
                 "recomputed_nodes": len(b.recomputed), "recompute_ms": round(b.recompute_s * 1e3, 4)}
                for b in plan.blocks]
        print(markdown_table(rows))
        if args.verbose:
            for b in plan.blocks:
                print(f"  {b.path}: saves {', '.join(b.saved) or '-'}")
                print(f"  {b.path}: recomputes {', '.join(b.recomputed) or '-'}")
        print(f"predicted saved activations: {human_bytes(plan.saved_bytes)}   "
              f"peak activation memory: {human_bytes(plan.peak_bytes)} "
              f"({plan.peak_fraction:.2f} of no-recompute {human_bytes(plan.reference_peak_bytes)}, "
              f"at {plan.peak_at})   recompute time: {plan.recompute_s * 1e3:.3f} ms")
        if plan.policy == "lynx":
            counts = {}
            for d in plan.decisions.values():
                kind = d.split(":")[0]
                counts[kind] = counts.get(kind, 0) + 1
            print(f"solver: {plan.solver} ({plan.solver_status})   plan time: {plan.plan_time_s:.3f} s   "
                  f"exposed recompute: {plan.exposed_s * 1e3:.3f} ms   tensors: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        for note in plan.notes:
            print(f"note: {note}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([r.plan.to_dict() for r in records if r.plan], f, indent=2)
        _say(f"wrote {args.out}")
    return 0


def _build_on(spec: str, device: str, overrides: dict):
    from lynx_compile.models import PRESETS, build_model

    if spec not in PRESETS:
        raise SystemExit(f"--device {device} needs a preset name, got {spec!r}")
    return build_model(spec, device=device, **overrides)


def cmd_demo(args: argparse.Namespace) -> int:
    from lynx_compile.demo import run_demo
    from lynx_compile.report import environment, markdown_table

    rows = run_demo(args.model, steps=args.steps, batch_size=args.batch_size)
    env = environment()
    print(f"\nlynx demo: {args.model}, batch {args.batch_size}, {args.steps} AdamW steps, fp32, dropout on "
          f"({env['cpu']}, torch {env['torch']}, {env['threads']} threads)\n")
    print(markdown_table(rows))
    ok = all(r["loss_equals_eager"] == "yes" for r in rows)
    print("\nall policies match eager" if ok else "\nMISMATCH against eager", flush=True)
    return 0 if ok else 1


def _say(msg: str) -> None:
    print(f"lynx: {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lynx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print what each block saves and recomputes, and the predicted memory")
    p.add_argument("--model", default="gpt-small", help="a preset (e.g. gpt-small, gpt-1.3b) or module:callable")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "meta"],
                   help="meta plans without allocating (analytic costs only); auto = meta for big presets")
    p.add_argument("--out", default=None, help="write the plan(s) as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="list saved and recomputed node names")
    _add_options(p)
    p.set_defaults(func=cmd_plan)
    d = sub.add_parser("demo", help="train a small GPT on CPU under every policy and compare with eager")
    d.add_argument("--model", default="gpt-small")
    d.add_argument("--steps", type=int, default=4)
    d.add_argument("--batch-size", type=int, default=4)
    d.set_defaults(func=cmd_demo)
    s = sub.add_parser("simulate", help="simulate one training iteration of a paper-scale GPT on a modeled cluster")
    s.add_argument("--model", default="gpt-13b", help="a GPT preset (gpt-1.3b ... gpt-23b)")
    s.add_argument("--cluster", default="a100-nvlink-8", help="a100-nvlink-8, a100-pcie-8, ascend-910b-8, a100-nvlink-32")
    s.add_argument("--tp", type=int, default=8)
    s.add_argument("--pp", type=int, default=1)
    s.add_argument("--microbatch", type=int, default=1)
    s.add_argument("--global-batch", type=int, default=128, help="sequences per iteration")
    s.add_argument("--strategy", default="all", help="one of lynx_compile.sim.scale.STRATEGIES, or all")
    s.add_argument("--trace", default=None, metavar="PATH", help="Chrome trace JSON of the (last) strategy")
    s.add_argument("--gantt", default=None, metavar="PATH", help="Gantt chart PNG of the (last) strategy")
    s.add_argument("--json", default=None, metavar="PATH", help="write the outcomes as JSON")
    s.set_defaults(func=cmd_simulate)
    t = sub.add_parser("train", help="tensor-parallel training (run under torchrun for --tp > 1)")
    from lynx_compile.train import add_train_arguments

    add_train_arguments(t)
    t.set_defaults(func=cmd_train)
    return parser


def cmd_simulate(args: argparse.Namespace) -> int:
    """Profile the model's layer (lynx's planning trace on meta, fake TP group) and simulate."""
    import dataclasses
    import json
    import logging
    import warnings

    from lynx_compile.sim.scale import CLUSTERS, STRATEGIES, Layout, evaluate

    if args.cluster not in CLUSTERS:
        raise ValueError(f"unknown cluster {args.cluster!r}; choose one of {list(CLUSTERS)}")
    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
    if any(s not in STRATEGIES for s in strategies):
        raise ValueError(f"unknown strategy {args.strategy!r}; choose 'all' or one of {list(STRATEGIES)}")
    cluster = CLUSTERS[args.cluster]
    devices = args.tp * args.pp
    if devices > cluster.devices or cluster.devices % devices:
        raise ValueError(f"tp x pp = {devices} must divide the {cluster.devices} devices of {cluster.name}")
    layout = Layout(tp=args.tp, pp=args.pp, dp=cluster.devices // devices, microbatch=args.microbatch,
                    global_batch=args.global_batch)
    from lynx_compile.sim.profile import profile_layer

    _say(f"profiling {args.model} (tp={args.tp}, micro-batch {args.microbatch}) on {cluster.hardware} ...")
    warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")
    logging.getLogger("lynx_compile").setLevel(logging.ERROR)  # the torch policy's budget notes
    profile = profile_layer(args.model, hardware=cluster.hardware, link=cluster.intra_link, tp=args.tp,
                            microbatch=args.microbatch)
    print(f"{args.model} on {cluster.name}: tp={layout.tp} pp={layout.pp} dp={layout.dp}, micro-batch "
          f"{layout.microbatch} x {layout.num_microbatches}, simulated ({cluster.hardware} roofline, "
          f"{cluster.intra_link}; profile {profile.profile_s:.1f} s)\n")
    print("| strategy | iteration s | tokens/s | MFU | peak GiB per stage | fits | layers per stage | decision |")
    print("|---|---|---|---|---|---|---|---|")
    outcomes, result = [], None
    for strategy in strategies:
        out, result = evaluate(profile, strategy, cluster, layout, result=True)
        outcomes.append(out.to_dict())
        peaks = "/".join(f"{b / 2**30:.1f}" for b in out.peak_bytes)
        fits = "yes" if out.fits else f"OOM (needs {out.need_bytes / 2**30:.1f} GiB of {cluster.memory_bytes / 2**30:.0f})"
        print(f"| {strategy} | {out.iteration_s:.3f} | {out.tokens_per_s:.0f} | {out.mfu:.3f} | {peaks} | {fits} | "
              f"{'/'.join(map(str, out.layers_per_stage))} | {'; '.join(out.choices)} |")
    if args.trace:
        from lynx_compile.sim.timeline import to_chrome_trace

        to_chrome_trace(result, args.trace)
    if args.gantt:
        from lynx_compile.sim.timeline import plot_gantt

        plot_gantt(result, args.gantt, title=f"{args.model} {cluster.name} {strategies[-1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": profile.to_dict(), "layout": dataclasses.asdict(layout), "outcomes": outcomes}, f, indent=1)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from lynx_compile.train import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad options, budgets, model specs: one clear line, no traceback
        print(f"lynx: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
