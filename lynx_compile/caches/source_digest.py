"""A digest of lynx's own Python sources: part of every key under which lynx reuses a plan or
lets torch reuse a compiled artifact (``caches.plans``, ``caches.autograd``, ``_compat``'s
partitioner uuid). A leaf module: it imports nothing of lynx."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path


@functools.lru_cache(maxsize=None)
def lynx_source_digest() -> str:
    """sha256 of lynx's Python sources (``lynx_compile`` and its ``passes`` package, wherever
    they are installed from): a plan made by other planning code is never reused."""
    roots = [Path(__file__).resolve().parent.parent]  # lynx_compile/, this file in caches/
    spec = importlib.util.find_spec("lynx_compile.passes")
    roots += [Path(p).resolve() for p in (spec.submodule_search_locations or ())] if spec else []
    h = hashlib.sha256()
    for root in sorted(set(roots)):
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]
