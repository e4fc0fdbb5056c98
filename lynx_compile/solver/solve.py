"""``solve_remat``: one entry point for Lynx-OPT (MILP, HiGHS or GLPK) and Lynx-HEU.

``solver="auto"`` picks HiGHS when installed, else GLPK, else the heuristic with a warning.
A MILP that fails for any reason other than an infeasible budget falls back to the heuristic,
with a warning saying why (STYLE rule 4); an infeasible budget is never papered over.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

from .heuristic import solve_heu
from .milp import solve_milp
from .milp_solvers import pick_solver, require_solver
from .problem import InfeasibleBudget, RematProblem, RematSolution


def solve_remat(problem: RematProblem, budget_bytes: int, *, solver: str = "auto",
                time_limit_s: float = 60.0, mip_gap: float = 1e-4,
                progress: Callable[[str], None] | None = None) -> RematSolution:
    """Keep / recompute-on-demand / recompute-in-window per unit, minimizing exposed time.

    ``solver``: "auto" (HiGHS, else GLPK, else HEU with a warning), "highs", "glpk" (missing:
    RuntimeError with the install command) or "heu". ``time_limit_s``/``mip_gap`` go to the MILP;
    ``progress`` receives a few lines: the model's size, during a MILP solve one line every
    ``milp_solvers.PROGRESS_EVERY_S`` (elapsed, incumbent, bound, gap), and the result. The
    solver's own log goes to the ``lynx_compile.solver`` logger (DEBUG), never to ``progress``.
    Raises ``InfeasibleBudget`` when nothing fits."""
    choice = pick_solver(solver)
    if choice.name == "heu":
        if solver == "auto":
            warnings.warn(f"lynx: {choice.reason}", stacklevel=2)
        return solve_heu(problem, budget_bytes, progress=progress)
    require_solver(choice.name)  # a solver asked for by name must be there: say how to get it
    try:
        return solve_milp(problem, budget_bytes, solver=choice.name, time_limit_s=time_limit_s,
                          mip_gap=mip_gap, progress=progress)
    except (InfeasibleBudget, ValueError):
        raise                    # an unreachable budget or a malformed problem: HEU cannot help
    except Exception as e:       # solver crash, no incumbent in the time limit, Pyomo errors
        why = f"Lynx-OPT with {choice.name} failed ({type(e).__name__}: {e}); used Lynx-HEU"
        warnings.warn(f"lynx: {why}", stacklevel=2)
        sol = solve_heu(problem, budget_bytes, progress=progress)
        return dataclasses.replace(sol, notes=(why, *sol.notes))
