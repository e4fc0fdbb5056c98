"""When a Triton kernel may run, and the one-time warning when it may not.

A kernel launches when Triton imports and the tensor is on CUDA, or on the CPU under
``TRITON_INTERPRET=1`` (set before triton is imported; the CPU tests run that way). Otherwise,
or for a non-contiguous tensor or an unsupported dtype, the op computes the pure-torch
reference instead and warns once per (kernel, reason): never a wrong result, never silent.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
_WARNED: set[tuple[str, str]] = set()


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a broken install: the reference runs
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def why_not(name: str, *tensors: torch.Tensor) -> str | None:
    """None when the kernel ``name`` can run on ``tensors``, else the reason it cannot."""
    if not triton_importable():
        return "triton is not installed"
    for t in tensors:
        if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
            return f"tensors on {t.device.type} (Triton runs on CUDA, or on CPU with TRITON_INTERPRET=1)"
        if t.dtype not in DTYPES:
            return f"dtype {t.dtype} (supported: float32, float16, bfloat16)"
        if not t.is_contiguous():
            return "a non-contiguous input"
    return None


def warn_fallback(name: str, reason: str) -> None:
    """One warning per (kernel, reason) and process."""
    if (name, reason) in _WARNED:
        return
    _WARNED.add((name, reason))
    warnings.warn(f"lynx_compile.kernels.{name}: {reason}; using the pure-torch reference "
                  "(same result, not fused)", stacklevel=3)
