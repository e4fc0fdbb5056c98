"""Names a package offers without importing their modules until first use (PEP 562)."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, lazy: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``, whose ``namespace`` (its ``globals()``) gets
    each name of ``lazy`` (name -> module, absolute or relative to ``package``) from its module on
    first use, and keeps it there so later lookups skip ``__getattr__``."""

    def __getattr__(name: str) -> Any:
        if name not in lazy:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(lazy[name], package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(lazy))

    return __getattr__, __dir__
