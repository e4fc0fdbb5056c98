"""The recompute solver (issue B), apart from torch.fx: problem, solvers (Lynx-OPT MILP, Lynx-HEU), evaluation.

    solve_remat(problem, budget, solver="auto"|"highs"|"glpk"|"heu") -> RematSolution
    solve_milp / solve_heu (same signature), evaluate(problem, solution) -> Evaluation,
    smallest_peak(problem), available_solvers(), pick_solver("auto"), synthetic_problem(...)

Only the plain-data classes load eagerly; the solvers (Pyomo, ~0.3 s to import) load on first
use of their names.
"""
from lynx_compile._lazy import lazy_names

from .problem import CommWindow, InfeasibleBudget, RematProblem, RematSolution, Unit

_LAZY = {
    "Evaluation": ".evaluate", "evaluate": ".evaluate",
    "solve_milp": ".milp", "smallest_peak": ".milp", "build_model": ".milp",
    "available_solvers": ".milp_solvers", "pick_solver": ".milp_solvers", "SolverChoice": ".milp_solvers",
    "solve_heu": ".heuristic", "heuristic_bound": ".heuristic",
    "solve_remat": ".solve",
    "synthetic_problem": ".synthetic",
}

__all__ = ["CommWindow", "InfeasibleBudget", "RematProblem", "RematSolution", "Unit", *_LAZY]


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
