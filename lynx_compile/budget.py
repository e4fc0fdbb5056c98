"""The memory budget: one value from the option to the check, and the one error it raises.

What a budget bounds (docs/memory_budget.md): the **peak of the training step**, the
bytes a forward + backward allocates above what is allocated when it starts: saved activations,
their recomputes, gradients of activations, temporaries, and the parameter gradients the
backward returns (a compiled backward returns them together at its end; only then does autograd
add them into ``.grad``).

* a **fraction** (``0.5``) is of the no-recompute peak *of the same compiler*: under Inductor
  torch.compile's own partition as Inductor runs it (``backend="inductor"``'s step), under
  ``compiler="eager"`` the default partition run op by op;
* a **size** (``"48MiB"``, or an int number of bytes) is that peak in bytes.

``device_budget`` (``"70GiB"`` or int bytes, never a fraction) bounds everything on the device
during the step: the bytes allocated when the step starts (parameters, buffers, optimizer state,
the batch: the *resident* bytes, read when lynx compiles each graph) plus the step's peak, so the
step's budget is ``device_budget - resident``. With ``memory_budget`` too, the tighter applies.

``Budget.bytes_of(reference)`` is the number every check compares with; ``budget_error`` is the
one place that words a refusal, naming the smallest reachable budget in the user's own units.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

from lynx_compile.decisions import BudgetError

log = logging.getLogger("lynx_compile")

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
        raise ValueError(f"memory_budget={value} (an int is a number of bytes) must be positive; a fraction of "
                         f"the no-recompute peak is a float in (0, 1], e.g. memory_budget=0.5")
    return int(value)


DEVICE_BUDGET_FORMS = ("bytes on the device: an int, a size with a unit (e.g. 70GiB, 512MiB, 80GB), or 'auto' "
                       "(a CUDA device's free memory); "
                       "a fraction of the no-recompute peak is memory_budget's form")


AUTO_HEADROOM = 0.10
"""The share of the memory ``device_budget="auto"`` finds usable that it leaves to the caching
allocator (fragmentation: reserved but not allocated) and to libraries' workspaces (cuBLAS,
NCCL)."""


def auto_device_budget() -> tuple[int, str]:
    """(bytes, how they were found) for ``device_budget="auto"``: on the current CUDA device,
    what this process may use (``torch.cuda.mem_get_info``'s free bytes plus what its caching
    allocator already reserved; other processes' memory and the CUDA context excluded) less
    :data:`AUTO_HEADROOM` of it. A ``ValueError`` naming the fix without a CUDA device (a CPU has
    no device memory to read: give the bytes)."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("device_budget='auto' reads the free memory of a CUDA device, and this process has none "
                         "(torch.cuda.is_available() is False); give the bytes the step may use, e.g. "
                         "device_budget='20GiB'")
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    usable = int(free) + int(reserved)
    nbytes = int(usable * (1 - AUTO_HEADROOM))
    how = (f"device_budget='auto' on cuda:{device}: {format_bytes(nbytes)} = {1 - AUTO_HEADROOM:.0%} of the "
           f"{format_bytes(usable)} this process may use (free {format_bytes(free)} + reserved by its allocator "
           f"{format_bytes(reserved)}, of {format_bytes(total)})")
    return nbytes, how


def check_device_budget(value: object) -> int | None:
    """``device_budget`` made canonical: None or int bytes (a string needs a unit:
    ``"70GiB"``; ``"auto"``: :func:`auto_device_budget`, read once here). A fraction, a float, a
    non-positive number or an unreadable string is a ``ValueError`` naming the forms (and
    ``memory_budget`` for fractions)."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        nbytes, how = auto_device_budget()
        log.info("lynx: %s", how)
        return nbytes
    if isinstance(value, str):
        m = _BUDGET_RE.fullmatch(value)
        unit = m.group(2).lower() if m else ""
        if m and not unit and 0.0 < float(m.group(1)) <= 1.0:
            raise ValueError(f"device_budget={value!r} reads as a fraction; a fraction of the no-recompute "
                             f"peak is memory_budget={value!r}. device_budget takes {DEVICE_BUDGET_FORMS}")
        if m and unit in _UNITS and int(round(float(m.group(1)) * _UNITS[unit])) > 0:
            return int(round(float(m.group(1)) * _UNITS[unit]))
        raise ValueError(f"device_budget={value!r} is not understood; use {DEVICE_BUDGET_FORMS}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"device_budget={value!r} is not valid; use {DEVICE_BUDGET_FORMS}")
    if isinstance(value, float):
        hint = (f"a fraction of the no-recompute peak is memory_budget={value}; " if 0.0 < value <= 1.0 else "")
        raise ValueError(f"device_budget={value} is a float; {hint}device_budget takes {DEVICE_BUDGET_FORMS}")
    if value <= 0:
        raise ValueError(f"device_budget={value} bytes must be positive; use {DEVICE_BUDGET_FORMS}")
    return int(value)


def device_budget_argument(text: str) -> int:
    """:func:`check_device_budget` as an argparse ``type=`` (a bad value is argparse's one-line error)."""
    import argparse

    try:
        return check_device_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    """A memory budget as the user gave it. ``memory_budget``: a ``fraction`` of the
    no-recompute peak or ``nbytes`` of the step's peak (at most one). ``device_budget``:
    ``device_nbytes`` for everything on the device, of which ``resident`` bytes are allocated
    when the step starts (read per compiled graph, :meth:`with_resident`; ``resident_source``
    says what they are). With both, the tighter bound in bytes applies."""

    fraction: float | None = None
    nbytes: int | None = None
    device_nbytes: int | None = None
    resident: int | None = None
    resident_source: str = ""

    @classmethod
    def of(cls, value: float | int | None, device: int | str | None = None) -> "Budget | None":
        """The budget of canonical option values (:func:`check_budget`,
        :func:`check_device_budget`); None when neither is given."""
        value, device = check_budget(value), check_device_budget(device)
        if value is None and device is None:
            return None
        return cls(fraction=value if isinstance(value, float) else None,
                   nbytes=value if isinstance(value, int) else None, device_nbytes=device)

    @property
    def needs_resident(self) -> bool:
        """A device budget whose resident bytes are not known yet (nothing can be checked)."""
        return self.device_nbytes is not None and self.resident is None

    def with_resident(self, resident: int, source: str) -> "Budget":
        """This budget once ``resident`` bytes are known to be allocated at the step's start
        (``source``: what they are and how they were read). A ``BudgetError`` when they alone
        leave nothing of ``device_budget`` for the step; unchanged without a device budget."""
        if self.device_nbytes is None:
            return self
        if resident >= self.device_nbytes:
            why = f"{resident} B ({format_bytes(resident)}) are resident on the device at the step's start"
            raise BudgetError(
                f"device_budget={self} ({self.device_nbytes} B): {why} ({source}), before the step "
                f"allocates anything. Use device_budget > {format_bytes(resident)!r} plus room for the "
                "step's peak, or free device memory before the first step", smallest_bytes=None, why=why)
        return replace(self, resident=int(resident), resident_source=source)

    def _bounds(self, reference: int) -> dict[str, int]:
        """The step's peak allowed by each option given, in bytes."""
        out = {}
        if self.fraction is not None or self.nbytes is not None:
            out["memory_budget"] = int(self.fraction * reference) if self.fraction is not None else int(self.nbytes)
        if self.device_nbytes is not None:
            if self.resident is None:
                raise ValueError("device_budget: the bytes resident at the step's start are not known yet "
                                 "(Budget.with_resident is called when lynx compiles a graph)")
            out["device_budget"] = self.device_nbytes - self.resident
        return out

    def bytes_of(self, reference: int) -> int:
        """The step's peak allowed in bytes, against the no-recompute ``reference`` peak: the
        tighter of ``memory_budget`` and ``device_budget`` minus the resident bytes."""
        return min(self._bounds(reference).values())

    def __str__(self) -> str:
        if self.fraction is None and self.nbytes is None:
            return repr(format_bytes(self.device_nbytes))
        return f"{self.fraction:g}" if self.fraction is not None else repr(format_bytes(self.nbytes))

    def given(self) -> str:
        """The options as the user gave them: ``memory_budget=0.5 and device_budget='70.00GiB'``."""
        parts = []
        if self.fraction is not None or self.nbytes is not None:
            memory = f"{self.fraction:g}" if self.fraction is not None else repr(format_bytes(self.nbytes))
            parts.append(f"memory_budget={memory}")
        if self.device_nbytes is not None:
            parts.append(f"device_budget={format_bytes(self.device_nbytes)!r}")
        return " and ".join(parts)

    def describe(self, reference: int) -> str:
        """``<options> (<bytes> B ...)``: the head of a refusal."""
        bounds = self._bounds(reference)
        step = min(bounds.values())
        if "device_budget" not in bounds:
            return f"{self.given()} ({step} B of a no-recompute peak of {reference} B)"
        tighter = " (the tighter bound)" if len(bounds) > 1 else ""
        return (f"{self.given()} ({self.device_nbytes} B on the device, {self.resident} B of it resident at "
                f"the step's start: {self.resident_source}; {step} B for the step's peak{tighter}, of a "
                f"no-recompute peak of {reference} B)")

    def at_least(self, smallest: int, reference: int) -> str:
        """``memory_budget >= ...`` / ``device_budget >= ...`` for a step peak of ``smallest``
        bytes, in this budget's units (a fraction rounded up to 3 digits, or a size), with the
        other unit beside it. With both options, each one below ``smallest`` is named (the
        binding one when neither is)."""
        bounds = self._bounds(reference)
        names = [k for k, b in bounds.items() if b < smallest] or \
            [k for k, b in bounds.items() if b == min(bounds.values())]
        return " and ".join(self._at_least_one(name, smallest, reference) for name in names)

    def _at_least_one(self, name: str, smallest: int, reference: int) -> str:
        frac = -(-smallest * 1000 // max(reference, 1)) / 1000
        if int(frac * reference) < smallest:  # float rounding: the budget must admit that peak
            frac += 0.001
        if name == "device_budget":
            device = format_bytes(self.resident + smallest)
            return (f"device_budget >= {device!r} (of which {format_bytes(self.resident)} resident at the step's "
                    f"start: {self.resident_source}; a step peak of {format_bytes(smallest)}, {frac:.3f} of "
                    "the no-recompute peak)")
        if self.fraction is not None:
            return f"memory_budget >= {frac:.3f} (a peak of {format_bytes(smallest)})"
        return f"memory_budget >= {format_bytes(smallest)!r} ({frac:.3f} of the no-recompute peak)"


_NAMED_FRACTION = re.compile(r"memory_budget >= ([0-9.]+)")


def named_fraction(text: str) -> float | None:
    """The fraction a refusal's text names (``Use memory_budget >= 0.785``, as
    :meth:`Budget.at_least` writes it), for a refusal read back as text (another process's
    output, a table cell); None where it names none."""
    found = _NAMED_FRACTION.search(text)
    return float(found.group(1)) if found else None


def budget_error(budget: Budget, reference: int, smallest: int | None, why: str) -> BudgetError:
    """The one refusal, the fix first: ``memory_budget=<as given> (<bytes> B ...) is out of
    reach. Use memory_budget >= ... The smallest reachable peak is <n> B: <why>.``
    (``device_budget=...`` likewise, naming the resident bytes), naming ``smallest`` (the smallest
    step peak known reachable) in the user's units; without it ``<options>: <why>.``"""
    if smallest is None:
        return BudgetError(f"{budget.describe(reference)}: {why}.", smallest_bytes=None, why=why)
    return BudgetError(f"{budget.describe(reference)} is out of reach. Use {budget.at_least(smallest, reference)}. "
                       f"The smallest reachable peak is {smallest} B: {why}.", smallest_bytes=smallest, why=why)
