"""lynx_compile: a torch.compile backend that plans activation recomputation.

Use it as ``torch.compile(model, backend="lynx", options={...})`` or bind options with
:func:`lynx_compile.backend`.

Importing the package loads nothing but its version: the names below load their module on first
use, so a subpackage (``lynx_compile.kernels``, ``lynx_compile.solver``, ``lynx_compile.models``)
imports on its own, without torch.compile's machinery.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lynx_compile._lazy import lazy_names
from lynx_compile._version import __version__

#: public name -> the module that defines it
_LAZY = {
    "LynxBackend": "lynx_compile.compiler.dynamo_backend",
    "backend": "lynx_compile.compiler.dynamo_backend",
    "LynxConfig": "lynx_compile.config",
    "make_config": "lynx_compile.config",
    "RecomputePlan": "lynx_compile.recompute_plan",
    "pipeline": "lynx_compile.pipelining",
    "region_budget": "lynx_compile.recompute.regions",
}

__all__ = ["LynxBackend", "LynxConfig", "RecomputePlan", "backend", "make_config", "pipeline", "region_budget",
           "__version__"]

if TYPE_CHECKING:
    from lynx_compile.config import LynxConfig, make_config
    from lynx_compile.compiler.dynamo_backend import LynxBackend, backend
    from lynx_compile.pipelining import pipeline
    from lynx_compile.recompute_plan import RecomputePlan
    from lynx_compile.recompute.regions import region_budget


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
