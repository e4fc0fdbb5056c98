"""Which MILP solver, and running a Pyomo model on it (HiGHS through Pyomo's highspy interface,
GLPK through ``glpsol``), with time limit and relative gap. While it runs, a progress line
(elapsed, incumbent, bound, gap) goes to a callable every ``PROGRESS_EVERY_S``; the solver's own
log goes to the ``lynx_compile.solver`` logger at DEBUG, once, and nowhere else.

HiGHS is preferred: on ``synthetic.compare_solvers`` problems (4 blocks, 324-708 binaries,
budgets 0.6-0.8 of the reference peak; 2-core CPU) HiGHS proved optimality in 0.2-24 s in most
cases, while GLPK hit a 60 s limit in most of them (its incumbents were within 0.5 % of
HiGHS's optimum).

HiGHS runs through Pyomo's ``pyomo.contrib.solver`` interface (highspy 1.15), GLPK through the
classic ``SolverFactory("glpk")`` shell interface; both load the incumbent when the time limit
stops them, which ``solve_milp`` reports as status "feasible" with a note.

Determinism (every rank of a torchrun job must reach the same plan, whatever its
``PYTHONHASHSEED``): the models are built in unit-id order, i.e. graph order, and every HiGHS
run is seeded (``SOLVER_SEED``, its ``random_seed`` option) rather than left to whatever a
HiGHS options file or a Pyomo default says. GLPK's branch and bound draws no random numbers
(``glpsol --seed`` only seeds MathProg models; lynx hands it an LP file), so it needs no seed.
A solve stopped by its time limit is the one thing left that depends on the process: its
incumbent depends on how fast the machine got there (status "feasible", with a note).
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import math
import re
import shutil
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

HIGHS_INSTALL = "pip install highspy"
GLPK_INSTALL = "apt-get install -y glpk-utils"
SOLVERS = ("highs", "glpk", "heu")
SOLVER_SEED = 0
"""HiGHS's ``random_seed`` in every lynx solve (Lynx-OPT and Lynx-HEU's small MILPs alike)."""


class SolverChoice(NamedTuple):
    name: str
    """"highs", "glpk" or "heu"."""
    reason: str


def highs_installed() -> bool:
    return importlib.util.find_spec("highspy") is not None


def glpk_installed() -> bool:
    return shutil.which("glpsol") is not None


def available_solvers() -> list[str]:
    """Installed MILP solvers, best first, then "heu" (always available)."""
    return [n for n, ok in (("highs", highs_installed()), ("glpk", glpk_installed())) if ok] + ["heu"]


def require_solver(name: str) -> None:
    """RuntimeError naming the install command when MILP solver ``name`` is missing."""
    if name == "highs" and not highs_installed():
        raise RuntimeError(f"the HiGHS MILP solver needs the highspy package: {HIGHS_INSTALL}")
    if name == "glpk" and not glpk_installed():
        raise RuntimeError("the GLPK MILP solver needs the glpsol executable on PATH: "
                           f"{GLPK_INSTALL} (or conda install -c conda-forge glpk)")


def pick_solver(solver: str = "auto") -> SolverChoice:
    """"auto": HiGHS when installed, else GLPK, else "heu" (with the install commands as reason).
    A named solver is returned as is (``require_solver`` checks it); unknown names: ValueError."""
    if solver == "auto":
        if highs_installed():
            return SolverChoice("highs", "HiGHS is installed")
        if glpk_installed():
            return SolverChoice("glpk", "GLPK is installed, HiGHS is not (faster: "
                                f"{HIGHS_INSTALL})")
        return SolverChoice("heu", f"no MILP solver is installed ({HIGHS_INSTALL}, or "
                            f"{GLPK_INSTALL}); using the Lynx-HEU heuristic")
    if solver not in SOLVERS:
        raise ValueError(f"unknown remat solver {solver!r}; expected 'auto' or one of {SOLVERS}")
    return SolverChoice(solver, "requested")


@dataclass(frozen=True)
class Outcome:
    status: str
    """"optimal", "feasible" (time limit with an incumbent, loaded) or "infeasible"."""
    gap: float | None = None
    notes: tuple[str, ...] = ()


SOLVER_LOG = logging.getLogger("lynx_compile.solver")
"""The MILP solvers' own log, one record per line at DEBUG: shown by ``lynx plan --verbose`` and
``verbose=True`` (``backend._log_to_stderr(solver_log=True)``), never otherwise."""
PROGRESS_EVERY_S = 5.0
"""Seconds between two progress lines of one MILP solve."""


class _Progress:
    """Progress lines of one solve, at most one per ``PROGRESS_EVERY_S``: elapsed time, the
    incumbent objective, the bound and the relative gap as last reported by the solver (the
    objective is ``milp.build_model``'s: exposed recompute time / total recompute time, plus a
    1e-6 tie-break). ``update`` is called from the solver's callbacks, any number of times."""

    def __init__(self, name: str, fn: Callable[[str], None] | None):
        self.name, self.fn = name, fn
        self.start = self.last = time.perf_counter()
        self.incumbent, self.bound, self.gap, self.extra = "none yet", "none yet", "-", ""

    def update(self, incumbent: str | None = None, bound: str | None = None, gap: str | None = None,
               extra: str | None = None) -> None:
        self.incumbent = incumbent or self.incumbent
        self.bound = bound or self.bound
        self.gap = gap or self.gap
        self.extra = self.extra if extra is None else extra
        now = time.perf_counter()
        if self.fn is None or now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        self.fn(f"lynx-opt[{self.name}]: {now - self.start:.0f} s, incumbent {self.incumbent}, "
                f"bound {self.bound}, gap {self.gap}{self.extra}")


def _num(x: float | None) -> str | None:
    return None if x is None or not math.isfinite(x) or abs(x) >= 1e30 else f"{x:.6g}"


class _Lines(io.TextIOBase):
    """A text stream calling ``fn`` once per non-empty line written to it."""

    def __init__(self, fn: Callable[[str], None]):
        self.fn, self.buf = fn, ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            if line.strip():
                self.fn(line.rstrip())
        return len(s)


def run_solver(M, name: str, time_limit_s: float, mip_gap: float,
               progress: Callable[[str], None] | None) -> Outcome:
    """Solve ``M`` (minimization) with ``name``; values are loaded into ``M`` unless infeasible.
    ``progress`` gets a line every ``PROGRESS_EVERY_S`` while the solver runs (elapsed,
    incumbent, bound, gap); the solver's own log goes to ``SOLVER_LOG`` (DEBUG) and nowhere else.
    RuntimeError when the solver fails or stops without an incumbent."""
    return (_run_highs if name == "highs" else _run_glpk)(M, time_limit_s, mip_gap, _Progress(name, progress))


@contextlib.contextmanager
def _pyomo_capture_off():
    """Pyomo's HiGHS interface runs the solver inside ``pyomo.common.tee.capture_output``, which
    redirects the process's stdout/stderr file descriptors into a pipe read by a thread. A
    logging handler that writes to stderr from inside the solve writes into that pipe, whose
    reader hands the line back to the handler: the loop seen as ``lynx: lynx: lynx: ...`` lines
    and ``TeeStream: deadlock observed joining reader threads``. HiGHS's output reaches lynx
    through HiGHS callbacks instead, and the capture is off (Pyomo's documented
    ``OVERRIDE_CAPTURE_OUTPUT = CaptureOutputMode.DISABLE``) while lynx solves."""
    from pyomo.common import tee

    mode = getattr(tee, "CaptureOutputMode", None)
    if mode is None or not hasattr(tee, "OVERRIDE_CAPTURE_OUTPUT"):  # older Pyomo: capture stays on
        yield                                                         # (HiGHS still prints nothing)
        return
    old, tee.OVERRIDE_CAPTURE_OUTPUT = tee.OVERRIDE_CAPTURE_OUTPUT, mode.DISABLE
    try:
        yield
    finally:
        tee.OVERRIDE_CAPTURE_OUTPUT = old


def _highs_callbacks(h, progress: _Progress) -> None:
    """Every HiGHS log line to ``SOLVER_LOG``; incumbent, bound and gap from the MIP callbacks
    (HiGHS calls the interrupt callback thousands of times a second; ``_Progress`` keeps one
    line per period, and log lines keep it ticking through presolve and the root LP)."""

    def on_log(e) -> None:
        for line in e.message.splitlines():
            if line.strip():
                SOLVER_LOG.debug("%s", line.rstrip())
        progress.update()

    def on_mip(e) -> None:
        d = e.data_out
        gap = _num(d.mip_gap)
        progress.update(_num(d.mip_primal_bound), _num(d.mip_dual_bound),
                        None if gap is None else f"{100 * d.mip_gap:.3g} %", f", {int(d.mip_node_count)} nodes")

    h.cbLogging.subscribe(on_log)
    if progress.fn is not None:
        h.cbMipInterrupt.subscribe(on_mip)
        h.cbMipImprovingSolution.subscribe(on_mip)


def _run_highs(M, time_limit_s, mip_gap, progress: _Progress) -> Outcome:
    # abs_gap 1e-7: exposed time is resolved to 1e-7 of the total recompute time, the 1e-6
    # tie-break (milp.TIE_BREAK) to 10% of its range; 1e-9 made HiGHS chase the tie-break for
    # tens of seconds on zero-exposure plans.
    from pyomo.contrib.solver.common.results import SolutionStatus, TerminationCondition as TC
    from pyomo.contrib.solver.solvers.highs import Highs

    opt = Highs()
    # builds the highspy model (its banner goes to Pyomo's capture), so that callbacks can be
    # attached before the solve; nothing of lynx's logs while it runs
    opt.set_instance(M)
    h = getattr(opt, "_solver_model", None)   # Pyomo's highspy.Highs (no public accessor)
    if h is not None and hasattr(h, "cbMipInterrupt"):
        _highs_callbacks(h, progress)
    with _pyomo_capture_off():
        # log_to_console False: HiGHS prints nothing itself (its log comes through on_log)
        res = opt.solve(M, time_limit=time_limit_s, rel_gap=mip_gap, abs_gap=1e-7, load_solutions=False,
                        raise_exception_on_nonoptimal_result=False,
                        solver_options={"mip_feasibility_tolerance": 1e-9, "log_to_console": False,
                                        "random_seed": SOLVER_SEED})
    tc = res.termination_condition
    if tc in (TC.provenInfeasible, TC.infeasibleOrUnbounded):
        return Outcome("infeasible")
    if res.solution_status not in (SolutionStatus.optimal, SolutionStatus.feasible):
        raise RuntimeError(f"HiGHS stopped ({tc.name}) without a feasible plan"
                           + (f" within the {time_limit_s:g} s time limit" if tc == TC.maxTimeLimit else ""))
    res.solution_loader.load_vars()
    inc, bound = res.incumbent_objective, res.objective_bound
    gap = None if inc is None or bound is None else max(inc - bound, 0.0) / max(abs(inc), 1e-12)
    if tc == TC.convergenceCriteriaSatisfied:
        return Outcome("optimal", gap)
    why = "time limit" if tc == TC.maxTimeLimit else tc.name
    return Outcome("feasible", gap, (f"HiGHS stopped at the {why} ({time_limit_s:g} s) with an "
                                     f"incumbent; relative gap {gap if gap is not None else 'unknown'}",))


# glpsol's branch-and-bound lines: "+   305: mip =   1.0e+00 >=   6.0e-01  40.0% (12; 0)", with
# ">>>>>" in place of "mip =" when the incumbent improved, "not found yet" before the first one
# and "tree is empty" as the bound at the end.
_GLPK_MIP = re.compile(r"\+\s*\d+:\s*(?:mip\s*=|>>>>>)\s*(not found yet|\S+)\s*>=\s*(tree is empty|\S+)\s*(\S+%)?")


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _run_glpk(M, time_limit_s, mip_gap, progress: _Progress) -> Outcome:
    import pyomo.environ as pyo
    from pyomo.opt import TerminationCondition as TC

    def on_line(line: str) -> None:
        SOLVER_LOG.debug("%s", line)
        m = _GLPK_MIP.match(line.strip())
        if m:
            inc = _num(_float(m.group(1)))
            bound = inc if m.group(2) == "tree is empty" else _num(_float(m.group(2)))
            progress.update(inc, bound, m.group(3) and m.group(3).replace("%", " %"))

    opt = pyo.SolverFactory("glpk")
    opt.options["tmlim"] = max(1, math.ceil(time_limit_s))   # glpsol takes whole seconds
    opt.options["mipgap"] = mip_gap
    # glpsol is a subprocess; Pyomo tees its output to sys.stdout (no file-descriptor capture)
    with contextlib.redirect_stdout(_Lines(on_line)):
        res = opt.solve(M, tee=True, load_solutions=False)
    tc = res.solver.termination_condition
    if tc in (TC.infeasible, TC.infeasibleOrUnbounded):
        return Outcome("infeasible")
    if len(res.solution) == 0:
        raise RuntimeError(f"GLPK stopped ({tc}) without a feasible plan within "
                           f"{opt.options['tmlim']} s")
    M.solutions.load_from(res)
    if tc == TC.optimal:
        return Outcome("optimal", None)
    return Outcome("feasible", None, (f"GLPK stopped ({tc}, time limit {opt.options['tmlim']} s) "
                                      "with an incumbent; gap unknown",))
