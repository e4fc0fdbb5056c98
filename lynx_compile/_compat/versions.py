"""The torch releases lynx supports, and the check that the installed one is among them."""
from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
SUPPORTED_TORCH = ((2, 11), (2, 13))


def check_torch_version() -> None:
    """Raise a clear error when the installed torch is outside the supported range."""
    lo, hi = SUPPORTED_TORCH
    if not (lo <= TORCH_VERSION <= hi):
        raise RuntimeError(
            f"lynx_compile supports torch {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}, found {torch.__version__}; "
            f"install a supported build first, e.g. `pip install torch==2.13.0`."
        )
