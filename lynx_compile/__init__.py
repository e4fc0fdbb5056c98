"""lynx_compile: a torch.compile backend that plans activation recomputation.

Use it as ``torch.compile(model, backend="lynx", options={...})`` or bind options with
:func:`lynx_compile.backend`.
"""
from lynx_compile._version import __version__  # noqa: E402
from lynx_compile.backend import LynxBackend, backend  # noqa: E402
from lynx_compile.config import LynxConfig, make_config  # noqa: E402
from lynx_compile.plan import RecomputePlan  # noqa: E402
from lynx_compile.pipeline import pipeline  # noqa: E402  (shadows the subpackage name on purpose)

__all__ = ["LynxBackend", "LynxConfig", "RecomputePlan", "backend", "make_config", "pipeline", "__version__"]
