"""The memory budget: one value from the option to the check, and the one error it raises.

What a budget bounds (README "The memory budget"): the **peak of the training step's
activation memory**, the bytes a forward + backward allocates above what is allocated when it
starts: saved activations, their recomputes, gradients of activations, temporaries. The
parameter gradients the backward returns are not counted yet (they become ``.grad``); counting
them, as issue M asks (a compiled backward returns them all together), is on the branch
``m-step-budget-wip``.

* a **fraction** (``0.5``) is of the no-recompute peak *of the same compiler*: under Inductor
  torch.compile's own partition as Inductor runs it (``backend="inductor"``'s step), under
  ``compiler="eager"`` the default partition run op by op;
* a **size** (``"48MiB"``, or an int number of bytes) is that peak in bytes.

``Budget.bytes_of(reference)`` is the number every check compares with; ``budget_error`` is the
one place that words a refusal, naming the smallest reachable budget in the user's own units.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from lynx_compile.decisions import BudgetError

BUDGET_FORMS = ("a fraction of the no-recompute peak in (0, 1] (e.g. 0.5), or bytes with a unit "
                "(e.g. 48MiB, 2GiB, 512KB, 1000000B)")
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BUDGET_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_budget(text: str) -> float | int:
    """A memory budget written by a person: ``"0.5"`` → 0.5 (a fraction, float), ``"48MiB"`` →
    50331648 (bytes, int). Anything else — a bare number above 1 included (``"2"`` is never
    meant as 2 bytes) — is a ``ValueError`` naming the accepted forms."""
    m = _BUDGET_RE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m and not unit:
        value = float(m.group(1))
        if 0.0 < value <= 1.0:
            return value
        raise ValueError(f"memory budget {text!r} is not a fraction in (0, 1] (bytes need a unit); "
                         f"use {BUDGET_FORMS}")
    if m and unit in _UNITS:
        nbytes = int(round(float(m.group(1)) * _UNITS[unit]))
        if nbytes > 0:
            return nbytes
    raise ValueError(f"memory budget {text!r} is not understood; use {BUDGET_FORMS}")


def check_budget(value: object) -> float | int | None:
    """The option's value made canonical: None, a float fraction in (0, 1], or int bytes (a
    string is parsed by :func:`parse_budget`). ``ValueError`` naming the forms otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return parse_budget(value)
        except ValueError as e:
            raise ValueError(f"memory_budget={value!r} must be a float in (0, 1], an int number of bytes, or a "
                             f"size string: {e}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"memory_budget={value!r} must be a float in (0, 1], an int number of bytes, or a "
                         f"size string; use {BUDGET_FORMS}")
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"memory_budget={value} as a fraction must lie in (0, 1]; "
                             "pass bytes as an int or with a unit (e.g. '48MiB')")
        return value
    if value <= 0:
        raise ValueError(f"memory_budget={value} bytes must be positive")
    return int(value)


def format_bytes(nbytes: int) -> str:
    """``'37.21MiB'``: the form ``parse_budget`` reads back (rounded up at the last digit, so
    the size it names is never below ``nbytes``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            value = -(-nbytes * 100 // size) / 100
            return f"{value:.2f}{unit}"
    return f"{nbytes}B"


@dataclass(frozen=True)
class Budget:
    """A memory budget as the user gave it: a ``fraction`` of the no-recompute peak or
    ``nbytes``. Exactly one is set."""

    fraction: float | None = None
    nbytes: int | None = None

    @classmethod
    def of(cls, value: float | int | None) -> "Budget | None":
        """The budget of a canonical option value (:func:`check_budget`); None for None."""
        value = check_budget(value)
        if value is None:
            return None
        return cls(fraction=value) if isinstance(value, float) else cls(nbytes=value)

    def bytes_of(self, reference: int) -> int:
        """The budget in bytes, against the no-recompute ``reference`` peak."""
        return int(self.fraction * reference) if self.fraction is not None else int(self.nbytes)

    def __str__(self) -> str:
        return f"{self.fraction:g}" if self.fraction is not None else repr(format_bytes(self.nbytes))

    def at_least(self, smallest: int, reference: int) -> str:
        """``memory_budget >= ...`` for a peak of ``smallest`` bytes, in this budget's units
        (a fraction rounded up to 3 digits, or a size), with the other unit beside it."""
        frac = -(-smallest * 1000 // max(reference, 1)) / 1000
        if int(frac * reference) < smallest:  # float rounding: the budget must admit that peak
            frac += 0.001
        if self.fraction is not None:
            return f"memory_budget >= {frac:.3f} (a peak of {format_bytes(smallest)})"
        return f"memory_budget >= {format_bytes(smallest)!r} ({frac:.3f} of the no-recompute peak)"


def budget_error(budget: Budget, reference: int, smallest: int | None, why: str) -> BudgetError:
    """The one refusal: ``memory_budget=<as given> (<bytes> B): <why>. Use memory_budget >= ...``
    naming ``smallest`` (the smallest peak known reachable) in the user's units; without it only
    ``why``."""
    head = f"memory_budget={budget} ({budget.bytes_of(reference)} B of a no-recompute peak of {reference} B)"
    fix = (f" The smallest reachable peak is {smallest} B. Use {budget.at_least(smallest, reference)}."
           if smallest is not None else "")
    return BudgetError(f"{head}: {why}.{fix}", smallest_bytes=smallest, why=why)
