"""The ``lynx`` command line: ``lynx plan``, ``lynx demo``, ``lynx simulate``, ``lynx train`` and
``lynx cache``.

Every error is one line on stderr that says what to change, with exit code 2; ``--debug`` (or
``LYNX_DEBUG=1``) shows the traceback instead."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from lynx_compile.budget import DEVICE_BUDGET_FORMS, device_budget_argument
from lynx_compile.config import BUDGET_FORMS, budget_argument


_DESCRIPTION = """lynx: plan activation recomputation (plan), compare policies on a small GPT (demo),
simulate paper-scale training (simulate), train with tensor / pipeline parallelism (train), show or
clear the persistent plan cache (cache).

Every error is one line that says what to change, exit code 2; --debug or LYNX_DEBUG=1 shows
the traceback."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (not the usage block) and exit code 2, and a guess
    for a misspelled option or choice (``did you mean '--memory-budget'?``)."""

    def error(self, message: str):  # type: ignore[override]
        guess = _guess(message, self._option_strings())
        self.exit(2, f"{self.prog}: error: {message}{guess} (see `{self.prog} --help`)\n")

    def _option_strings(self) -> set[str]:
        """Every option string of this parser and of its subcommands' parsers (an unknown
        option after a subcommand is reported by the top parser)."""
        out, stack = set(), [self]
        while stack:
            parser = stack.pop()
            out.update(parser._option_string_actions)
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    stack.extend(action.choices.values())
        return out


def _guess(message: str, options: set[str]) -> str:
    """``; did you mean ...?`` for argparse's ``unrecognized arguments: --memory-budjet 0.5``
    (the closest option strings) and ``invalid choice: 'higs' (choose from ...)`` (the closest
    choice); empty when nothing is close."""
    import difflib
    import re

    guesses = []
    if message.startswith("unrecognized arguments:"):
        for token in message.split(":", 1)[1].split():
            name = token.split("=", 1)[0]
            if name.startswith("-"):
                close = difflib.get_close_matches(name, sorted(options), n=1, cutoff=0.6)
                guesses += [f"{close[0]!r} for {name!r}"] if close else []
    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if found:
        choices = re.findall(r"'([^']*)'", found.group(2))
        close = difflib.get_close_matches(found.group(1), choices, n=1, cutoff=0.6)
        guesses += [repr(close[0])] if close else []
    return f"; did you mean {', '.join(guesses)}?" if guesses else ""


_BUDGET_HELP = f"peak activation memory allowed: {BUDGET_FORMS}"


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="lynx", choices=["lynx", "none", "full", "selective", "torch"],
                   help="what to save and recompute: the optimizer (lynx, default), nothing (none), "
                        "everything but block inputs (full), Megatron's attention core (selective), "
                        "torch's min-cut (torch)")
    p.add_argument("--solver", default="auto", choices=["auto", "glpk", "highs", "heu"],
                   help="policy lynx: MILP solver (Lynx-OPT) or the block heuristic (heu)")
    p.add_argument("--time-limit", type=float, default=60.0, help="MILP time limit in seconds")
    p.add_argument("--mip-gap", type=float, default=1e-4, help="relative MIP gap")
    p.add_argument("--memory-budget", type=budget_argument, default=None, metavar="BUDGET", help=_BUDGET_HELP)
    p.add_argument("--device-budget", type=device_budget_argument, default=None, metavar="SIZE",
                   help=f"everything on the device during the step (what is resident at its start, here "
                        f"the graph's inputs, plus its peak): {DEVICE_BUDGET_FORMS}; with --memory-budget "
                        "the tighter applies")
    p.add_argument("--cost-source", default="analytic", choices=["analytic", "measured"],
                   help="per-node runtimes: roofline over --hardware (analytic) or run on this machine "
                        "(measured; not on --device meta)")
    p.add_argument("--hardware", default="auto",
                   help="hardware profile for analytic costs: auto, cpu, a100-sxm4-80gb, a100-pcie-80gb, "
                        "h100-sxm, h200, ascend-910b")
    p.add_argument("--compiler", default="inductor", choices=["inductor", "eager"],
                   help="the compiler the plan is for (a plan file only matches graphs compiled "
                        "with the same one: Inductor's joint passes change the graph)")


def _options(args: argparse.Namespace) -> dict:
    opts = {"policy": args.policy, "cost_source": args.cost_source, "hardware": args.hardware,
            "solver": args.solver, "time_limit_s": args.time_limit, "mip_gap": args.mip_gap,
            "compiler": args.compiler}
    if args.memory_budget is not None:
        opts["memory_budget"] = args.memory_budget
    if args.device_budget is not None:
        opts["device_budget"] = args.device_budget
    if args.plan is not None:
        opts["plan"] = args.plan
    return opts


def cmd_plan(args: argparse.Namespace) -> int:
    from lynx_compile.compiler.dynamo_backend import _log_to_stderr

    _log_to_stderr(solver_log=args.verbose)  # per-graph decisions, MILP progress; --verbose: solver log

    from lynx_compile.config import make_config
    from lynx_compile.models import example_batch, load_model_spec, num_parameters, PRESETS
    from lynx_compile.planning import plan_model
    from lynx_compile.tools.report import human_bytes, markdown_table

    make_config(_options(args))  # bad options and plan files fail before the model is built
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise ValueError(f"--out {args.out}: its directory does not exist; create it or write elsewhere")
    device = args.device
    if device == "auto":
        big = args.model in PRESETS and num_parameters(PRESETS[args.model]) > 2e8
        device = "meta" if big else "cpu"
    if device == "meta":  # meta tensors have no autograd kernel for the loss: torch warns, harmlessly
        import warnings

        warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")
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
              f"hardware={record.stats.get('hardware')}  costs={record.stats.get('cost_source')}")
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
        if plan.budget_bytes is not None:
            what = ("the step's activation peak" if plan.budget_scope == "peak" else
                    "what this graph saves for its backward (it is one block or a piece of the model)")
            print(f"budget: {human_bytes(plan.budget_bytes)} of {what}")
        if plan.device_budget_bytes is not None:
            print(f"device budget: {human_bytes(plan.device_budget_bytes)}, of which "
                  f"{human_bytes(plan.resident_bytes)} resident at the step's start: {plan.resident_source}")
        if plan.policy == "lynx":
            counts = {k: v for k, v in plan.decisions.counts().items() if v}
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
        raise ValueError(f"--device {device} needs a preset name, got {spec!r}; presets: {sorted(PRESETS)}")
    return build_model(spec, device=device, **overrides)


def cmd_demo(args: argparse.Namespace) -> int:
    from lynx_compile.tools.demo import cmd_demo as demo

    return demo(args)


def _say(msg: str) -> None:
    print(f"lynx: {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    from lynx_compile.sim.scale import CLUSTERS, STRATEGIES

    parser = _Parser(prog="lynx", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback (also LYNX_DEBUG=1)")
    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, show the traceback (also LYNX_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,demo,simulate,train,cache}")
    p = sub.add_parser("plan", parents=[debug],
                       help="print what each block saves and recomputes, and the predicted memory")
    p.add_argument("--model", default="gpt-small", help="a preset (e.g. gpt-small, gpt-1.3b) or module:callable")
    p.add_argument("--batch-size", type=int, default=2, help="sequences in the example batch")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "meta"],
                   help="meta plans without allocating (analytic costs only); auto = meta for big presets")
    p.add_argument("--out", default=None, metavar="PATH", help="write the plan(s) as JSON")
    p.add_argument("--plan", default=None, metavar="PATH",
                   help="reuse the decisions of a plan written by --out (policy lynx; its graph hash "
                        "must match) instead of solving")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="list saved and recomputed node names, and show the MILP solver's log")
    _add_options(p)
    p.set_defaults(func=cmd_plan)
    d = sub.add_parser("demo", parents=[debug],
                       help="one training step of a GPT where activation memory matters (gpt-small at 8 layers, "
                       "seq 512) under eager, torch.utils.checkpoint, torch.compile (+ activation_memory_budget) "
                       "and lynx at three budgets: step time, peak memory, gradients vs eager, plot")
    d.add_argument("--model", default=None, help="a preset (default: gpt-small at 8 layers, seq 512, batch 2; "
                   "another preset keeps its own shape, batch 4: --model gpt-tiny is the old small demo)")
    d.add_argument("--layers", type=int, default=None, help="override the model's number of layers")
    d.add_argument("--seq-len", type=int, default=None, help="override the model's sequence length")
    d.add_argument("--steps", type=int, default=None, help="timed steps per variant (median reported; default 10)")
    d.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 2; 4 for another "
                   "--model: at 2, gpt-tiny's parameter gradients hold the smallest reachable budget at 0.76)")
    d.add_argument("--compile", default=None, choices=["per-block", "whole"],
                   help="per-block (default: each transformer block compiled on its own) or whole")
    d.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when present")
    d.add_argument("--out", default=None, metavar="DIR", help="where demo_<device>.md and .png go "
                   "(default: <tmp>/lynx_demo)")
    d.set_defaults(func=cmd_demo)
    s = sub.add_parser("simulate", parents=[debug],
                       help="simulate one training iteration of a paper-scale GPT on a modeled cluster")
    s.add_argument("--model", default="gpt-13b", help="a GPT preset (gpt-1.3b ... gpt-23b)")
    s.add_argument("--cluster", default="a100-nvlink-8", choices=list(CLUSTERS), help="the modeled cluster")
    s.add_argument("--tp", type=int, default=8, help="tensor-parallel degree")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (stages)")
    s.add_argument("--microbatch", type=int, default=1, help="sequences per micro-batch")
    s.add_argument("--global-batch", type=int, default=128, help="sequences per iteration")
    s.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and optimizer state over the data-parallel replicas "
                        "(FSDP2 / ZeRO-3): per-layer all-gathers and reduce-scatters, in whose time recompute hides")
    s.add_argument("--strategy", default="all", choices=["all", *STRATEGIES],
                   help="the recompute strategy to simulate, or all of them")
    s.add_argument("--trace", default=None, metavar="PATH", help="Chrome trace JSON of the (last) strategy")
    s.add_argument("--gantt", default=None, metavar="PATH", help="Gantt chart PNG of the (last) strategy")
    s.add_argument("--json", default=None, metavar="PATH", help="write the outcomes as JSON")
    s.set_defaults(func=cmd_simulate)
    t = sub.add_parser("train", parents=[debug],
                       help="tensor-parallel training (run under torchrun for --tp > 1)")
    from lynx_compile.tools.train import add_train_arguments

    add_train_arguments(t)
    t.set_defaults(func=cmd_train)
    c = sub.add_parser("cache", parents=[debug],
                       help="the persistent plan cache under torch.compile's cache directory "
                            "(TORCHINDUCTOR_CACHE_DIR): print where it is (path) or remove every plan (clear)")
    c.add_argument("action", choices=["path", "clear"], help="path: print the directory; clear: empty it")
    c.set_defaults(func=cmd_cache)
    return parser


def cmd_cache(args: argparse.Namespace) -> int:
    """``lynx cache path`` / ``lynx cache clear`` (``lynx_compile.caches.plans``)."""
    from lynx_compile.caches import plans as plan_cache

    if args.action == "path":
        print(plan_cache.plans_dir())
        return 0
    removed = plan_cache.clear()
    print(f"removed {removed} plan(s) from {plan_cache.plans_dir()}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    """Profile the model's layer (lynx's planning trace on meta, fake TP group) and simulate."""
    import dataclasses
    import json
    import logging
    import warnings

    from lynx_compile.sim.scale import CLUSTERS, STRATEGIES, Layout, evaluate

    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)  # argparse checked both
    cluster = CLUSTERS[args.cluster]
    devices = args.tp * args.pp
    if devices > cluster.devices or cluster.devices % devices:
        raise ValueError(f"--tp x --pp = {devices} must divide the {cluster.devices} devices of "
                         f"{cluster.name}; choose --tp and --pp whose product divides {cluster.devices}")
    layout = Layout(tp=args.tp, pp=args.pp, dp=cluster.devices // devices, microbatch=args.microbatch,
                    global_batch=args.global_batch, fsdp=args.fsdp)
    from lynx_compile.sim.layer_profile import profile_layer

    _say(f"profiling {args.model} (tp={args.tp}, micro-batch {args.microbatch}) on {cluster.hardware} ...")
    warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")
    logging.getLogger("lynx_compile").setLevel(logging.ERROR)  # the torch policy's budget notes
    profile = profile_layer(args.model, hardware=cluster.hardware, link=cluster.intra_link, tp=args.tp,
                            microbatch=args.microbatch)
    print(f"{args.model} on {cluster.name}: tp={layout.tp} pp={layout.pp} dp={layout.dp}"
          f"{' (FSDP)' if layout.fsdp else ''}, micro-batch "
          f"{layout.microbatch} x {layout.num_microbatches}, simulated ({cluster.hardware} roofline, "
          f"{cluster.intra_link}; profile {profile.profile_s:.1f} s)\n")
    print("| strategy | iteration s | tokens/s | MFU | peak GiB per stage | fits | layers per stage | decision "
          "| recompute s | hidden H |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    outcomes, result = [], None
    none_s = evaluate(profile, "none", cluster, layout).iteration_s
    for strategy in strategies:
        out, result = evaluate(profile, strategy, cluster, layout, result=True)
        recompute_s = sum(e.end_s - e.start_s for e in result.events if e.kind == "R") / max(1, len(out.peak_bytes))
        hidden = hidden_fraction(out.iteration_s, none_s, recompute_s)
        outcomes.append({**out.to_dict(), "recompute_s": recompute_s, "hidden": hidden})
        peaks = "/".join(f"{b / 2**30:.1f}" for b in out.peak_bytes)
        fits = "yes" if out.fits else f"OOM (needs {out.need_bytes / 2**30:.1f} GiB of {cluster.memory_bytes / 2**30:.0f})"
        print(f"| {strategy} | {out.iteration_s:.3f} | {out.tokens_per_s:.0f} | {out.mfu:.3f} | {peaks} | {fits} | "
              f"{'/'.join(map(str, out.layers_per_stage))} | {'; '.join(out.choices)} | {recompute_s:.3f} | "
              f"{'-' if hidden is None else f'{hidden:.2f}'} |")
    print("\nrecompute s: per rank (on demand and in windows, kappa included); hidden H = 1 - (iteration - "
          "none's iteration) / recompute s: the share of the recompute the step does not pay for")
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


def hidden_fraction(iteration_s: float, none_s: float, recompute_s: float) -> float | None:
    """Share of ``recompute_s`` (per rank) the iteration does not pay for against no recompute
    (``none_s``), clipped to [0, 1]; None when nothing is recomputed."""
    if recompute_s <= 0:
        return None
    return min(1.0, max(0.0, 1.0 - (iteration_s - none_s) / recompute_s))


def cmd_train(args: argparse.Namespace) -> int:
    from lynx_compile.tools.train import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False) or os.environ.get("LYNX_DEBUG", "") not in ("", "0")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("lynx: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every error is one line with the fix (--debug: traceback)
        if debug:
            raise
        print(f"lynx: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    """``e`` on one line: lynx's own error (a ``ValueError`` raised by lynx's code, found under
    dynamo's wrappers) as its message, which says what to change; anything else with its type
    and the way to see more."""
    mine = _lynx_error(e)
    text = " ".join(str(mine or e).split())
    text = text.split(" Set TORCHDYNAMO_VERBOSE=1")[0]  # dynamo's suffix on errors passed through it
    if mine is not None:
        return text
    return f"{type(e).__name__}: {text} (run with --debug for the traceback)"


def _lynx_error(e: BaseException | None) -> BaseException | None:
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ValueError) and _raised_in_lynx(e):
            return e
        e = getattr(e, "inner_exception", None) or e.__cause__ or (
            None if e.__suppress_context__ else e.__context__)
    return None


def _raised_in_lynx(e: BaseException) -> bool:
    tb, module = e.__traceback__, ""
    while tb is not None:
        module, tb = tb.tb_frame.f_globals.get("__name__", ""), tb.tb_next
    return module.startswith("lynx_compile") or module == "__main__"


if __name__ == "__main__":
    sys.exit(main())
