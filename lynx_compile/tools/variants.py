"""Ways to run one training step, by name, measured the same way: ``lynx demo`` and
``benchmarks/bench_step.py`` both build their rows here.

Variant names:

- ``eager``; ``checkpoint``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around
  each transformer block's forward (the model's largest ``nn.ModuleList``), eager.
- ``inductor``: ``torch.compile(model)``; ``inductor-b<B>``: the same with
  ``torch._functorch.config.activation_memory_budget = B`` while Inductor compiles (a backend
  of its own per budget, so the setting does not leak into later compiles and copies of one
  model at several budgets in one process each get their own code).
- ``lynx-none``, ``lynx-full``, ``lynx-selective``; ``lynx-torch-b<B>`` (policy ``torch``,
  budget B); ``lynx-b<B>`` (policy ``lynx``, budget B): ``torch.compile(model, backend="lynx",
  options=...)`` with the given solver and compiler.

``run_variant`` measures one variant in this process: the first step (compile included) and its
gradients against a reference, then warm-up and timed steps with
``lynx_compile.memory.measure_step`` (median step time, peak activation memory). ``plot_pareto``
draws rows of several variants as peak memory vs step time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from lynx_compile.memory.measure import grad_rel_diff, grad_snapshot, measure_step

LYNX_POLICIES = ("none", "full", "selective")
GRAD_RTOL = 1e-5
"""Gradients "equal" a reference when their ``grad_rel_diff`` is at most this (fp32)."""


@dataclass(frozen=True)
class Variant:
    """A parsed variant name (see the module docstring)."""

    name: str
    kind: str
    """``eager``, ``checkpoint``, ``inductor`` or ``lynx``."""
    policy: Optional[str] = None
    """lynx policy (``lynx`` for ``lynx-b<B>``); None for the others."""
    budget: Optional[float] = None
    """``activation_memory_budget`` (inductor) or ``memory_budget`` (lynx); None: the default."""


def parse_variant(name: str) -> Variant:
    """The variant a name stands for; ValueError listing the known names otherwise."""
    if name in ("eager", "checkpoint", "inductor"):
        return Variant(name, name)
    if name.startswith("lynx-") and name[len("lynx-"):] in LYNX_POLICIES:
        return Variant(name, "lynx", name[len("lynx-"):])
    for prefix, kind, policy, low in (("inductor-b", "inductor", None, 0.0), ("lynx-torch-b", "lynx", "torch", 0.0),
                                      ("lynx-b", "lynx", "lynx", 0.0)):
        if name.startswith(prefix):
            try:
                b = float(name[len(prefix):])
            except ValueError:
                break
            if low <= b <= 1.0 and (kind == "inductor" or b > 0):
                return Variant(name, kind, policy, b)
            break
    raise ValueError(f"unknown variant {name!r}; known: eager, checkpoint, inductor, inductor-b<B> (B in [0, 1]), "
                     "lynx-none, lynx-full, lynx-selective, lynx-torch-b<B>, lynx-b<B> (B in (0, 1])")


def describe(name: str) -> str:
    """What a variant is, in words, for tables and legends."""
    v = parse_variant(name)
    if v.kind == "eager":
        return "eager"
    if v.kind == "checkpoint":
        return "eager, torch.utils.checkpoint per block"
    if v.kind == "inductor":
        return "torch.compile" + ("" if v.budget is None else f", activation_memory_budget={v.budget:g}")
    if v.policy == "lynx":
        return f"lynx, memory_budget={v.budget:g}"
    return f"lynx, policy {v.policy}" + ("" if v.budget is None else f", memory_budget={v.budget:g}")


def lynx_options(name: str, *, solver: str = "auto", compiler: str = "inductor") -> Optional[dict]:
    """The lynx ``options`` of a ``lynx-*`` variant; None for the others."""
    v = parse_variant(name)
    if v.kind != "lynx":
        return None
    opts: dict[str, Any] = {"policy": v.policy, "compiler": compiler}
    if v.budget is not None:
        opts["memory_budget"] = v.budget
    if v.policy == "lynx":
        opts["solver"] = solver
    return opts


def under_inductor(name: str, lynx_compiler: str = "inductor") -> bool:
    """Whether the variant's graphs run under Inductor (and so draw Inductor's random numbers)."""
    v = parse_variant(name)
    return v.kind == "inductor" or (v.kind == "lynx" and lynx_compiler == "inductor")


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's blocks: its largest ``nn.ModuleList`` or ``nn.ModuleDict`` (torchtitan keeps
    its layers in one)."""
    lists = [list(m.values()) if isinstance(m, torch.nn.ModuleDict) else list(m) for m in model.modules()
             if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList or nn.ModuleDict of blocks to checkpoint")
    return max(lists, key=len)


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Wrap each block's forward in ``checkpoint(use_reentrant=False)``, in place."""
    from torch.utils.checkpoint import checkpoint

    for block in transformer_blocks(model):
        fwd = block.forward
        block.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(fwd)


COMPILE_STYLES = ("whole", "per-block")
"""How the compiled variants compile: ``whole``: ``torch.compile(model)``; ``per-block``: each
transformer block (``transformer_blocks``) ``block.compile(fullgraph=True)`` on its own, the rest
eager, as torchtitan's ``apply_compile`` does (identical blocks share one compiled graph, so the
compile time does not grow with depth)."""


def prepare(name: str, model: torch.nn.Module, *, solver: str = "auto", compiler: str = "inductor",
            style: str = "whole") -> Callable:
    """The callable model of a variant (compiles lazily, on the first call); ``style``: one of
    ``COMPILE_STYLES`` (eager and checkpoint ignore it)."""
    if style not in COMPILE_STYLES:
        raise ValueError(f"compile style {style!r}: one of {', '.join(COMPILE_STYLES)}")
    v = parse_variant(name)
    if v.kind == "eager":
        return model
    if v.kind == "checkpoint":
        checkpoint_blocks(model)
        return model
    if v.kind == "lynx":
        kw: dict[str, Any] = {"backend": "lynx", "options": lynx_options(name, solver=solver, compiler=compiler)}
    elif v.budget is None:
        kw = {}
    else:
        # Inductor with the budget patched while it compiles (the partition is decided then). A
        # backend of its own, not backend="inductor" under a patch: dynamo shares compiled code
        # between copies of a model compiled with the same backend (guards are on the parameters'
        # shapes, not their identity), so in one process every budget would run the first's code.
        from lynx_compile import _compat

        kw = {"backend": _compat.inductor_at_activation_budget(v.budget)}
    if style == "per-block":
        return compile_blocks(model, **kw)
    return torch.compile(model, **kw)


def compile_blocks(model: torch.nn.Module, **kw: Any) -> torch.nn.Module:
    """``model`` with each transformer block (``transformer_blocks``) compiled on its own,
    ``block.compile(fullgraph=True, **kw)``, as torchtitan's ``apply_compile`` does."""
    for block in transformer_blocks(model):
        block.compile(fullgraph=True, **kw)
    return model


def min_warmup(name: str, style: str = "whole") -> int:
    """The fewest warm-up steps (the compiling first included) before a variant's steps are its
    steady state: per-block lynx plans its pieces together from the recorded step 2 and swaps the
    re-planned compiles in at step 3 (``lynx_compile.step.recorder``; a budget no plan reaches is
    refused there), so 3; otherwise 1."""
    from lynx_compile.step.recorder import RECORDED_STEP

    return RECORDED_STEP + 1 if style == "per-block" and parse_variant(name).kind == "lynx" else 1


def describe_failure(exc: BaseException) -> str:
    """``refused: <first line>`` for a lynx BudgetError anywhere under dynamo's wrappers,
    else ``error: <type>: <first line>``."""
    from lynx_compile.compiler.dynamo_backend import find_backend_error
    from lynx_compile.decisions import BudgetError

    budget = find_backend_error(exc, BudgetError)
    if budget is not None:
        return f"refused: {_first_line(budget)}"
    return f"error: {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def run_variant(name: str, model: torch.nn.Module, loss_of: Callable[[Callable], torch.Tensor], *,
                device: str = "cpu", warmup: int = 2, steps: int = 5, solver: str = "auto",
                compiler: str = "inductor", ref_grads: Optional[Sequence] = None,
                seed: int = 1234, style: str = "whole", zero_grad: bool = False) -> tuple[dict, Optional[list]]:
    """Measure variant ``name`` on ``model`` (changed in place: compiled, gradients accumulated).

    Step = ``loss_of(callable model).backward()``, no optimizer. The first step (seeded with
    ``seed``) compiles: its wall time is ``first_step_s``, its loss ``loss``, its gradients are
    returned and compared with ``ref_grads`` (``grad_rel_diff``). Then ``warmup - 1`` more steps
    and ``measure_step`` over ``steps`` timed steps: ``step_ms`` (median), ``peak_MiB``.
    lynx variants add ``predicted_peak_MiB`` (the largest predicted peak of the graphs compiled
    in this run) and ``lynx_graphs``. Returns ``(row, first-step gradients)``; a failure is a row
    with ``result`` ``refused: ...`` or ``error: ...`` (see ``describe_failure``) and no
    gradients.

    ``style`` (``COMPILE_STYLES``): ``per-block`` compiles each block on its own; a lynx variant
    then warms up for at least ``min_warmup`` steps (its step plan is made at step 2 and runs from
    step 3, where a budget no plan reaches is refused), and its ``predicted_peak_MiB`` is the
    step's predicted peak (``Plan.step_peak_bytes``) rather than one piece's.

    ``zero_grad``: every step starts with ``.grad`` None (``optimizer.zero_grad()``'s default) and
    ``peak_MiB`` counts the ``.grad`` the step creates; otherwise gradients accumulate and the
    peak is taken with ``.grad`` allocated (``measure_step(params=...)``)."""
    row: dict[str, Any] = {"variant": name, "result": "ok"}
    options = lynx_options(name, solver=solver, compiler=compiler)
    grads = None
    try:
        import lynx_compile

        warmup = max(warmup, min_warmup(name, style))
        known = len(lynx_compile.backend(**options).plans) if options is not None else 0
        fn = prepare(name, model, solver=solver, compiler=compiler, style=style)

        def step() -> torch.Tensor:
            if zero_grad:
                for p in model.parameters():
                    p.grad = None
            loss = loss_of(fn)
            loss.backward()
            return loss

        torch.manual_seed(seed)
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        row["first_step_s"] = time.perf_counter() - t0
        row["loss"] = loss.item()
        grads = grad_snapshot(model)
        if ref_grads is not None:
            row["grad_rel_diff"] = grad_rel_diff(grads, ref_grads)
        for _ in range(warmup - 1):
            step()
        m = measure_step(step, device=device, repeats=steps, warmup=0,
                         params=None if zero_grad else list(model.parameters()))
        row["step_ms"] = m.step_s * 1e3
        row["peak_MiB"] = m.peak_bytes / 2**20
        if options is not None:
            plans = lynx_compile.backend(**options).plans[known:]
            step_peaks = [p.step_peak_bytes for p in plans if p.step_peak_bytes is not None]
            if style == "per-block" and step_peaks:
                row["predicted_peak_MiB"] = max(step_peaks) / 2**20
            elif plans:
                row["predicted_peak_MiB"] = max(p.peak_bytes for p in plans) / 2**20
            row["lynx_graphs"] = len(plans)
    except Exception as exc:  # noqa: BLE001 - a variant that fails is a result, the others still run
        row["result"] = describe_failure(exc)
        grads = None
    return row, grads


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def plot_pareto(rows: Sequence[dict], path: str, title: str) -> None:
    """Pareto plot, one panel per ``model``: x = ``peak_MiB``, y = ``step_ms``; torch.compile's
    budget sweep as a line, eager / checkpoint / torch.compile as markers, lynx points labelled.
    Rows need ``model``, ``variant``, ``result`` and, when ``result == "ok"``, the two axes.
    Needs matplotlib (``pip install matplotlib``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        ok = [r for r in rows if r["model"] == model and r["result"] == "ok"]
        _plot_torch_sweep(ax, ok)
        marks = {"inductor": ("s", "tab:blue", "torch.compile"), "eager": ("^", "black", "eager"),
                 "checkpoint": ("v", "gray", "checkpoint per block")}
        for r in ok:
            if r["variant"] in marks:
                m, c, label = marks[r["variant"]]
                ax.plot(r["peak_MiB"], r["step_ms"], m, color=c, label=label)
        lynx = [r for r in ok if r["variant"].startswith("lynx-")]
        if lynx:
            ax.plot([r["peak_MiB"] for r in lynx], [r["step_ms"] for r in lynx], "D", color="tab:red",
                    linestyle="none", label="lynx")
            labels: dict[tuple, list[str]] = {}
            for r in lynx:  # coincident points (e.g. a budget that ends at full recompute) share one label
                labels.setdefault((r["peak_MiB"], r["step_ms"]), []).append(r["variant"][len("lynx-"):])
            for xy, names in labels.items():
                ax.annotate(", ".join(names), xy, fontsize=8, textcoords="offset points", xytext=(4, 4),
                            color="tab:red")
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("peak activation memory (MiB)")
        ax.set_ylabel("step time (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_torch_sweep(ax: Any, ok: Sequence[dict]) -> None:
    """torch.compile at each activation_memory_budget, joined by a line (default = budget 1)."""
    budget = {r["variant"]: parse_variant(r["variant"]).budget for r in ok if r["variant"].startswith("inductor-b")}
    if "inductor-b1.0" not in budget and any(r["variant"] == "inductor" for r in ok):
        budget["inductor"] = 1.0  # torch's default budget closes the sweep
    sweep = sorted((r for r in ok if r["variant"] in budget), key=lambda r: budget[r["variant"]])
    if not sweep:
        return
    ax.plot([r["peak_MiB"] for r in sweep], [r["step_ms"] for r in sweep], "o-", color="tab:blue",
            label="torch.compile + budget")
    for r in sweep:
        ax.annotate(f"b{budget[r['variant']]:g}", (r["peak_MiB"], r["step_ms"]), fontsize=7,
                    textcoords="offset points", xytext=(3, -9), color="tab:blue")
