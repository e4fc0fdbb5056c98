"""``caches.source_digest``: every Python source of lynx (``lynx_compile`` and its ``passes``) is in
the digest that keys its plans and torch's caches, wherever the module itself sits in the tree."""
from __future__ import annotations

from pathlib import Path

import lynx_compile
import lynx_compile.passes
from lynx_compile.caches import source_digest


def test_the_digest_reads_every_source_of_lynx(monkeypatch):
    read: list[Path] = []
    original = Path.read_bytes

    def recording(self: Path) -> bytes:
        read.append(self.resolve())
        return original(self)

    monkeypatch.setattr(Path, "read_bytes", recording)
    source_digest.lynx_source_digest.cache_clear()
    try:
        digest = source_digest.lynx_source_digest()
    finally:
        source_digest.lynx_source_digest.cache_clear()
    expected = {p.resolve() for root in (lynx_compile.__path__[0], lynx_compile.passes.__path__[0])
                for p in Path(root).rglob("*.py")}
    assert set(read) == expected and len(digest) == 16
    assert Path(lynx_compile.__file__).resolve() in set(read)  # the top level, not only caches/
