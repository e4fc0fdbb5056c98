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


def _budget(text: str) -> float | int:
    return int(text) if text.isdigit() else float(text)


def _options(args: argparse.Namespace) -> dict:
    opts = {"policy": args.policy, "cost_source": args.cost_source, "hardware": args.hardware,
            "solver": args.solver, "time_limit_s": args.time_limit, "mip_gap": args.mip_gap}
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
    t = sub.add_parser("train", help="tensor-parallel training (run under torchrun for --tp > 1)")
    from lynx_compile.train import add_train_arguments

    add_train_arguments(t)
    t.set_defaults(func=cmd_train)
    return parser


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
