"""The frozen configuration tree for one lynx compile, built from ``torch.compile(options=...)``.

Unknown keys and bad values raise ``ValueError`` naming what is valid: a misspelt option must
never silently fall back to a default.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from lynx_compile.budget import (BUDGET_FORMS, DEVICE_BUDGET_FORMS, Budget, check_budget,  # noqa: F401 (re-exported)
                                 check_device_budget, parse_budget)

Policy = Literal["lynx", "none", "full", "selective", "torch"]
Solver = Literal["auto", "glpk", "highs", "heu"]
CostSource = Literal["analytic", "measured"]
Compiler = Literal["eager", "inductor"]



@dataclass(frozen=True, kw_only=True)
class LynxConfig:
    """Options of the ``lynx`` backend. Every field is also a key of ``options={...}``."""

    policy: Policy = "lynx"
    """What to save and what to recompute. ``lynx`` (default): the recompute optimizer chooses,
    per tensor, keep / recompute on demand / recompute inside a communication window, to fit
    ``memory_budget`` at the least exposed recompute time (with no budget it recomputes
    nothing). ``none``: save every forward value the backward
    reads (no recompute). ``full``: keep only each transformer block's input, recompute the rest
    of the block. ``selective``: Megatron's selective recompute (the attention core QK^T, mask,
    softmax, dropout; the s x s tensors). ``torch``: torch's min-cut partitioner under
    ``activation_memory_budget`` (for side-by-side comparison)."""

    memory_budget: float | int | None = None
    """The step's peak activation memory allowed (``lynx_compile.budget``): the bytes a training
    step allocates above what is allocated when it starts (parameter gradients aside). A float
    in (0, 1] is a fraction of the no-recompute peak of the same compiler (under Inductor:
    torch.compile's own step); bytes are an int or a string with a unit (``"48MiB"``,
    ``"2GiB"``; kept as int bytes). For ``torch`` a fraction is handed to
    torch's ``activation_memory_budget`` (default 1.0); for ``none``/``full``/``selective`` it is
    a check. A budget no plan reaches is a ``BudgetError`` naming the smallest reachable one."""

    device_budget: int | None = None
    """Everything on the device during the step allowed (``lynx_compile.budget``): the bytes
    allocated when the step starts (parameters, buffers, optimizer state, the batch: the
    *resident* bytes) plus the step's peak (what ``memory_budget`` bounds), so the step's budget
    is ``device_budget - resident``. Int bytes, a size string (``"70GiB"``; kept as int bytes)
    or ``"auto"`` (read once: 90% of what this process may use on the current CUDA device,
    ``budget.auto_device_budget``; an error without CUDA); never a fraction (that is
    ``memory_budget``). The resident bytes are read when lynx compiles each graph, during the
    first step's forward: on CUDA ``torch.cuda.memory_allocated(device)``; elsewhere the unique
    storage bytes of the graph's inputs (parameters, buffers, the batch) and the state the
    optimizers seen stepping hold for them (``memory.optimizer_state``); for ``lynx plan`` the
    inputs. AdamW's state is created by the first ``optimizer.step()``, after that read: the
    budget is checked again as step 2 starts (``step.recorder``), and a plan that no longer fits
    beside the state is made again, or refused naming the smallest ``device_budget``. With
    ``memory_budget`` too, the tighter bound in bytes applies. Resident bytes at or above it are
    a ``BudgetError`` at compile time; a budget no plan reaches is one naming the smallest
    ``device_budget`` that is reachable. The plan records both (``resident_bytes``,
    ``device_budget_bytes``)."""

    solver: Solver = "auto"
    """Optimizer for ``policy="lynx"``: ``glpk`` / ``highs`` solve the MILP (Lynx-OPT), ``heu``
    runs the block heuristic (Lynx-HEU), ``auto`` picks HiGHS when installed, else GLPK, else
    HEU (with a warning)."""

    time_limit_s: float = 60.0
    """MILP time limit; at the limit the best plan found so far is used, with a warning."""

    mip_gap: float = 1e-4
    """Relative MIP gap at which the MILP stops."""

    plan: str | None = None
    """Path of a saved plan (``lynx plan --out``) to reuse without solving; it must come from the
    same graph (its hash is checked)."""

    plan_cache: bool = True
    """Reuse plans made earlier for the same graph and options: in this process (the solve, by
    graph, budget and solver) and, for a whole model under policy ``lynx`` with a budget, across
    processes from ``lynx/plans`` under torch.compile's cache directory (``TORCHINDUCTOR_CACHE_DIR``;
    ``lynx_compile.caches.plans``: the winning plan after seeding, re-checked against the budget;
    ``lynx cache clear`` empties it). ``False`` turns both off."""

    cost_source: CostSource = "analytic"
    """Per-node costs: ``analytic`` (roofline over ``hardware``) or ``measured`` (each node run
    on real tensors on the actual device, median of ``measure_repeats``)."""

    hardware: str = "auto"
    """Hardware profile for analytic costs: ``auto`` (the local CUDA device, else ``cpu``),
    ``cpu``, ``a100-sxm4-80gb``, ``a100-pcie-80gb``, ``h100-sxm``, ``h200``, ``ascend-910b``."""

    link: str = "auto"
    """Interconnect that prices collectives, i.e. the length of each communication window the
    optimizer may fill with recompute: ``auto`` (the emulated link when the process group is
    lynx's emulated one; else, when torch.distributed runs with more than one rank, a link
    calibrated once per process by timing all-reduces on the default group; else the hardware
    profile's link), ``calibrate`` (always measure; needs an initialized process group), or a
    name in ``lynx_compile.costs.LINKS`` (``nvlink3``, ``nvlink4``, ``pcie4``, ``pcie5``,
    ``infiniband-hdr``, ``infiniband-ndr``, ``hccs``, ``loopback-gloo``)."""

    windows: bool = True
    """Let ``policy="lynx"`` place recompute inside communication windows. ``False`` plans
    on-demand recompute only (the "lynx without overlap" baseline of the TP benchmark)."""

    offload: bool = False
    """Let ``policy="lynx"`` also offload saved activations to host memory (Kuaishou ATC'24):
    per tensor keep / recompute / offload under the same peak budget, a copy priced by the
    hardware profile's ``host_link_bytes_per_s`` and exposed only where it outlasts the compute
    it overlaps (``passes/offload.py``). Visible in the graphs as ``lynx.offload`` /
    ``offload_wait`` (forward) and ``lynx.reload`` / ``reload_wait`` (backward); under Inductor
    they are extern calls in the generated code, ordered by their arguments. Not with
    ``side_stream`` or ``recompute_in_wait``. On CPU "host" is a second CPU buffer."""

    recompute_in_wait: bool = False
    """Keep each forward's saved tensors per pipeline micro-batch so that the recompute prefix of
    its backward (the recomputed ops no gradient flows into) can run early, while the stage waits
    for the next stage's gradient (``lynx_compile.pipeline`` sets it; see
    ``lynx_compile.runtime.prefetch``). Outside a pipeline stage it changes nothing."""

    recompute_in_wait_bytes: int | None = None
    """Most bytes of recomputed tensors run early and held until the backward uses them (the
    stage's memory headroom); None: no limit."""

    weight_split: bool = False
    """Compile each backward also as B (input gradients) and W (weight gradients), so that a
    zero-bubble pipeline schedule can run W later, in a bubble (``lynx_compile.runtime.weight_split``;
    ``lynx_compile.pipeline`` sets it for ``ZBVZeroBubble`` / ``InterleavedZeroBubble``). Under
    ``compiler="inductor"`` Inductor compiles B and W when it compiles the backward (two
    backward compiles instead of one) and a backward that is not deferred runs B then W; under
    ``compiler="eager"`` the split is always available and this changes nothing. Outside a
    pipeline stage it changes nothing but the compile time."""

    accumulate_grad_in_graph: bool | None = None
    """Where parameter gradients go (``lynx_compile.memory.grad_in_graph``). None (default): each is
    added into ``.grad`` inside the compiled backward right after it is computed, as eager
    PyTorch does (its tensor and post-accumulate-grad hooks run there), instead of all being
    returned at the backward's end for autograd to add (the "gradient pile", which sets the
    step's peak under heavy recompute; DDP's and FSDP2's hooks read ``.grad``); returned where
    that cannot give eager's ``.grad``: tensor-subclass parameters, a tensor hook, ``weight_split``,
    and where nothing is recomputed (policy ``none``/``torch``, no budget: torch.compile's step
    bit for bit). True: added also where nothing is recomputed, refused where it cannot be.
    False: always returned. Added in the graph,
    ``torch.autograd.grad(loss, parameters)`` and ``create_graph=True`` are errors naming False."""

    fuse_kernels: bool | str = False
    """Replace recognized recompute chains in the backward (causal softmax, LayerNorm, GeLU) with
    lynx's fused Triton kernels (``lynx_compile.kernels``; pass ``fuse_recompute_pass``).
    ``"auto"``: when a kernel can run (CUDA, or ``TRITON_INTERPRET=1``). Off by default until
    the kernels have been validated on a GPU."""

    side_stream: bool = False
    """Run each recompute segment of the backward on a secondary CUDA stream, launched one
    segment ahead so it overlaps the main stream's gradient ops (pass ``side_stream_pass``,
    runtime ``lynx_compile.runtime.side_stream_runner``). The graph shows it as
    ``lynx.side_stream_begin / end / wait`` ops; on CPU they are no-ops and the backward runs
    inline. Needs ``compiler='eager'``. Off by default until validated on a GPU."""

    side_stream_extra_bytes: int = 0
    """Bytes that launching a segment early may add to the backward's simulated peak. 0: a
    segment is launched early only where that keeps the peak (otherwise it runs where the
    partitioner placed it, overlapping nothing); one segment's outputs buys full overlap."""

    check_plan_agreement: bool = True
    """With more than one rank, compare each graph's plan fingerprint across ranks before it
    runs and stop every rank with one error when they differ (different plans issue
    collectives in different orders, which deadlocks NCCL)."""

    buffer_reuse: bool = True
    """Inductor's buffer reuse in lynx's own placements (``_compat.inductor_reuse``): a freed
    buffer's storage handed to a later buffer of its size instead of a free and an allocation,
    where it keeps the plan's peak (freed just before), or within the budget's bytes above the
    plan's predicted peak (a graph planned on its own peak), never a gradient kept as ``.grad``.
    On CPU it saves ~90 of ~245 allocator calls of a 4-layer step and 0.2-1% of its time. False:
    every buffer its own allocation, as Inductor's ``allow_buffer_reuse=False`` (the compiled
    peak is then the predicted one exactly)."""

    measure_repeats: int = 5
    """Repeats per node when ``cost_source="measured"`` (the median is kept)."""

    compiler: Compiler = "inductor"
    """What compiles the step around lynx's partition. ``inductor`` (default): torch.compile's
    own pipeline (joint passes, fusion, Triton on GPU / C++ on CPU) with lynx's partition in
    place of min-cut; cheap pointwise chains that Inductor fuses are also recomputed (as
    torch.compile does), and the predicted peak is that of the unfused graphs (an upper bound on
    the compiled program's saved bytes). ``eager``: the partitioned graphs run op by op — the
    exact reference (prediction = allocator peak) and what ``side_stream``,
    ``recompute_in_wait`` and ``trace_recompute`` need; when one of those is on and
    ``compiler`` is not given, ``eager`` is chosen."""

    disable_passes: tuple[str, ...] = ()
    """Names of passes to skip (any pass of the ``*_PIPELINE`` tuples in ``lynx_compile.passes``;
    an unknown name is an error)."""

    trace_recompute: bool = False
    """Wrap each run of recomputed backward ops in a ``torch.profiler`` range
    ``lynx::recompute[demand]`` or ``lynx::recompute[window:<w>]``, so traces show where recompute
    ran (``lynx train --trace`` turns it on and computes the overlap with collectives)."""

    dump_dir: str | None = field(default_factory=lambda: os.environ.get("LYNX_DUMP_DIR"))
    """Directory for graph dumps before/after each pass (default: ``$LYNX_DUMP_DIR``)."""

    verbose: bool = field(default_factory=lambda: os.environ.get("LYNX_DEBUG", "") not in ("", "0"))
    """Log each graph's decisions at INFO (default: ``$LYNX_DEBUG``)."""

    @property
    def budget(self) -> Budget | None:
        """``memory_budget`` and ``device_budget`` as the one ``Budget`` value every check uses
        (None: no budget). A device budget's resident bytes are the compiled graph's, not an
        option: ``GraphRecord.resident``, and ``PassContext.budget`` the budget with them."""
        return Budget.of(self.memory_budget, self.device_budget)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _choices(name: str) -> tuple[str, ...]:
    hint = {f.name: f.type for f in dataclasses.fields(LynxConfig)}[name]
    return get_args({"Policy": Policy, "Solver": Solver, "CostSource": CostSource,
                     "Compiler": Compiler}[hint])


def make_config(options: dict[str, Any] | None = None) -> LynxConfig:
    """Validate ``options`` and return the frozen config. Raises ``ValueError`` on any bad key
    or value, naming the option and what is valid (``lynx_compile.backend(...)`` calls this
    before anything is compiled)."""
    options = dict(options or {})
    valid = [f.name for f in dataclasses.fields(LynxConfig) if not f.name.startswith("_")]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        import difflib

        guesses = {k: difflib.get_close_matches(k, valid, n=1, cutoff=0.6) for k in unknown}
        hint = "; ".join(f"did you mean {g[0]!r} for {k!r}?" for k, g in guesses.items() if g)
        raise ValueError(f"unknown lynx option(s) {unknown}; {hint + ' ' if hint else ''}"
                         f"valid options are {valid}")
    for key in ("policy", "solver", "cost_source", "compiler"):
        if key in options and options[key] not in _choices(key):
            value = options[key]
            raise ValueError(f"{key}={value!r} is not valid; choose one of {list(_choices(key))}")
    _check_types(options)
    if "memory_budget" in options:
        options["memory_budget"] = check_budget(options["memory_budget"])
    if "device_budget" in options:
        options["device_budget"] = check_device_budget(options["device_budget"])
    if "disable_passes" in options:
        options["disable_passes"] = _check_passes(options["disable_passes"])
    if options.get("plan") is not None:
        check_plan_file(options["plan"], "plan")
    _check_solver_installed(options)
    needs_eager = [k for k in ("side_stream", "recompute_in_wait", "trace_recompute") if options.get(k)]
    if needs_eager and "compiler" not in options:
        options["compiler"] = "eager"  # documented: these run the backward graph in pieces
    if options.get("trace_recompute") and options.get("compiler") == "inductor":
        raise ValueError("trace_recompute=True wraps backward ops in profiler ranges and needs "
                         "compiler='eager'; drop one of the two")
    if options.get("recompute_in_wait") and options.get("compiler") == "inductor":
        raise ValueError("recompute_in_wait=True splits the backward graph at runtime and needs "
                         "compiler='eager'; drop one of the two")
    if options.get("side_stream") and options.get("compiler") == "inductor":
        raise ValueError("side_stream=True runs the backward in pieces on two streams and needs "
                         "compiler='eager'; drop one of the two")
    if options.get("offload"):
        if options.get("policy", "lynx") != "lynx":
            raise ValueError(f"offload=True is decided by the optimizer (policy 'lynx'), not by "
                             f"policy {options['policy']!r}; drop one of the two")
        clash = [k for k in ("side_stream", "recompute_in_wait") if options.get(k)]
        if clash:
            raise ValueError(f"offload=True is not combined with {clash[0]}=True yet; choose one")
    if options.get("accumulate_grad_in_graph") is True and options.get("weight_split"):
        raise ValueError("accumulate_grad_in_graph=True adds weight gradients into .grad where they are "
                         "computed, weight_split=True defers them to a W graph; choose one")
    if options.get("weight_split") and options.get("side_stream"):
        raise ValueError("weight_split=True cuts the backward into B and W, side_stream=True into "
                         "stream segments; choose one")
    if options.get("side_stream") and options.get("recompute_in_wait"):
        raise ValueError("side_stream=True and recompute_in_wait=True both take over the backward's "
                         "recompute; choose one")
    if "fuse_kernels" in options and options["fuse_kernels"] not in (True, False, "auto"):
        raise ValueError(f"fuse_kernels={options['fuse_kernels']!r} is not valid; choose True, False or 'auto'")
    if "link" in options:
        from lynx_compile.costs import LINKS

        names = ["auto", "calibrate", *LINKS]
        if options["link"] not in names:
            raise ValueError(f"link={options['link']!r} is not valid; choose one of {names}")
    if "hardware" in options:
        from lynx_compile.costs import PROFILES

        names = ["auto", *PROFILES]
        if options["hardware"] not in names:
            raise ValueError(f"hardware={options['hardware']!r} is not valid; choose one of {names}")
    return LynxConfig(**options)


_BOOLS = ("plan_cache", "windows", "offload", "recompute_in_wait", "side_stream", "check_plan_agreement",
          "trace_recompute", "verbose", "weight_split", "buffer_reuse")


def _check_types(options: dict[str, Any]) -> None:
    """Plain-typed options: a wrong type is named here, not deep inside a compile."""
    for key in _BOOLS:
        if key in options and not isinstance(options[key], bool):
            raise ValueError(f"{key}={options[key]!r} is not valid; choose True or False")
    value = options.get("accumulate_grad_in_graph")
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"accumulate_grad_in_graph={value!r} is not valid; choose None (default: where eager's "
                         ".grad can be kept), True or False")
    for key, lo, what in (("time_limit_s", 0.0, "a number of seconds > 0"),
                          ("mip_gap", 0.0, "a relative gap in [0, 1)")):
        if key not in options:
            continue
        value = options[key]
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not ok or not (value > lo if key == "time_limit_s" else lo <= value < 1):
            raise ValueError(f"{key}={value!r} is not valid; use {what}")
        options[key] = float(value)
    for key, lo, none_ok in (("measure_repeats", 1, False), ("side_stream_extra_bytes", 0, False),
                             ("recompute_in_wait_bytes", 0, True)):
        if key not in options or (none_ok and options[key] is None):
            continue
        value = options[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
            unit = "bytes" if key.endswith("bytes") else "repeats"
            raise ValueError(f"{key}={value!r} is not valid; use an int >= {lo} ({unit})"
                             + (" or None" if none_ok else ""))
        options[key] = int(value)
    for key in ("plan", "dump_dir"):
        if options.get(key) is not None and not isinstance(options[key], (str, os.PathLike)):
            raise ValueError(f"{key}={options[key]!r} is not valid; use a path (str) or None")
        if options.get(key) is not None:
            options[key] = os.fspath(options[key])


def _check_passes(names: Any) -> tuple[str, ...]:
    """The form only (a tuple of names); that each names a pass is checked where the backend is
    built (``lynx_compile.passes.check_pass_names``): the config knows no pass."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"disable_passes={names!r} is not valid; use a tuple of pass names")
    return tuple(names)


def _check_solver_installed(options: dict[str, Any]) -> None:
    """A MILP solver asked for by name must be installed when the optimizer will run."""
    if options.get("policy", "lynx") != "lynx" or options.get("solver") not in ("highs", "glpk"):
        return
    from lynx_compile.solver.milp_solvers import require_solver

    try:
        require_solver(options["solver"])
    except RuntimeError as e:
        raise ValueError(f"solver={options['solver']!r}: {e}; or use solver='auto' or 'heu'") from None


def check_plan_file(path: str, what: str = "plan") -> list[dict[str, Any]]:
    """The plans in the JSON file ``path`` (written by ``lynx plan --out``). ``ValueError``
    naming the file (and ``what`` named it: an option or a flag) when it is missing, not JSON,
    or not a list of plans."""
    fix = f"write one with `lynx plan --policy lynx ... --out {path}`"
    if not os.path.isfile(path):
        raise ValueError(f"{what}={path!r}: no such file; {fix}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what}={path!r} is not a lynx plan file ({type(e).__name__}: {e}); {fix}") from None
    plans = data if isinstance(data, list) else [data]
    if not plans or not all(isinstance(p, dict) and "graph_hash" in p for p in plans):
        raise ValueError(f"{what}={path!r} is not a lynx plan file (expected a plan or a list of plans, "
                         f"each with a 'graph_hash'); {fix}")
    return plans


def budget_argument(text: str) -> float | int:
    """``parse_budget`` as an argparse ``type=``: a bad budget is argparse's one-line error."""
    import argparse

    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --- Options of the string backend "lynx" from the environment ---------------------------------

OPTIONS_ENV = "LYNX_OPTIONS"
"""The environment variable :func:`options_from_env` reads."""


def options_from_env(environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """lynx's options for ``torch.compile(..., backend="lynx")`` given without ``options=``, read
    from ``$LYNX_OPTIONS`` (for launchers that pass the backend only by name, e.g. torchtitan's
    ``--compile.backend lynx``). None when the variable is unset or blank.

    ``LYNX_OPTIONS`` holds either a JSON object (its first non-blank character is ``{``):
    ``LYNX_OPTIONS='{"memory_budget": 0.7, "solver": "heu"}'``, or the path of a file holding one:
    ``LYNX_OPTIONS=lynx_options.json``. The keys are those of ``options=`` (:class:`LynxConfig`)
    and are validated by :func:`make_config`. A missing file, text that is not a JSON object, or a
    bad option raises ``ValueError`` naming ``LYNX_OPTIONS``. The backend refuses ``options=``
    together with a set ``LYNX_OPTIONS`` (``lynx_compile.compiler.dynamo_backend.lynx_backend``): one source of
    options per compile; ``lynx_compile.backend(**options)`` never reads the variable."""
    text = (os.environ if environ is None else environ).get(OPTIONS_ENV, "").strip()
    if not text:
        return None
    where = f"{OPTIONS_ENV}={text!r}"
    if not text.startswith("{"):
        try:
            with open(text) as f:
                body = f.read()
        except OSError as e:
            raise ValueError(f"{where}: cannot read it as a file ({e.strerror}); set it to a JSON "
                             f"object or to the path of a file holding one") from None
        where = f"{OPTIONS_ENV} file {text!r}"
        text = body
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not JSON ({e}); write an object such as "
                         f'{{"memory_budget": 0.7}}') from None
    if not isinstance(options, dict):
        raise ValueError(f"{where} is not a JSON object of lynx options; write an object such as "
                         f'{{"memory_budget": 0.7}}')
    try:
        make_config(options)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return options
