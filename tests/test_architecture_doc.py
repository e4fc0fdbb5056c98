"""``docs/architecture.md``'s layout block against the tree: every module of ``lynx_compile/`` is
named under its own package, every package has a line and every line a package, and the top level
stays a table of contents (a dozen modules at most beside the packages)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lynx_compile"


def _layout_sections() -> dict[str, str]:
    """Package folder ('' for lynx_compile/ itself) -> the words its layout lines say."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    sections: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        top = re.match(r"lynx_compile/\s", line)
        sub = re.match(r"  (\w+)/\s", line)
        if top:
            current = ""
        elif sub:
            current = sub.group(1)
        elif line and not line.startswith(" "):
            current = None  # passes/, kernels/, tests/, benchmarks/: not lynx_compile's folders
        if current is not None:
            sections[current] = sections.get(current, "") + " " + line
    return sections


def _modules(folder: Path) -> set[str]:
    return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}


def test_every_module_is_named_under_its_package():
    sections = _layout_sections()
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")} | {
        p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert set(sections) - {""} == packages, "packages with no layout line / lines with no package"
    missing = {}
    for name, words in sections.items():
        folder = PACKAGE / name if name else PACKAGE
        absent = sorted(m for m in _modules(folder) if not re.search(rf"(?<![\w.]){re.escape(m)}(?!\w)", words))
        if absent:
            missing[name or "lynx_compile"] = absent
    assert not missing, f"modules the layout in docs/architecture.md does not name: {missing}"


def test_the_top_level_is_a_table_of_contents():
    top = _modules(PACKAGE)
    assert len(top) <= 12, sorted(top)
