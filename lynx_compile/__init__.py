"""lynx_compile: a torch.compile backend that plans activation recomputation.

Use it as ``torch.compile(model, backend="lynx", options={...})`` or bind options with
:func:`lynx_compile.backend`.
"""
__version__ = "0.1.0"
