"""The recompute optimizer (issue B): problem, solvers (Lynx-OPT MILP, Lynx-HEU), evaluation."""
from .problem import InfeasibleBudget, RematProblem, RematSolution, Unit, Window

__all__ = ["InfeasibleBudget", "RematProblem", "RematSolution", "Unit", "Window"]
