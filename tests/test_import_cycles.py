"""No import cycles between lynx's modules, imports inside functions counted (issue O).

An import inside a function only postpones a cycle: the two modules still need each other, and
the order they load in decides whether one sees the other half-initialised. The graph here has an
edge for every ``import`` and ``from ... import`` in a module, at any depth, except under
``if TYPE_CHECKING:``; ``from package import name`` points at the submodule ``package.name`` when
there is one. Loading a submodule runs its package's ``__init__`` first: that is Python's order,
not a dependency of the submodule's, so it is no edge.

The layout is the installed one: ``passes/`` is ``lynx_compile.passes`` and ``kernels/`` is
``lynx_compile.kernels`` (``setup.py``'s package_dir).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lynx_compile": ROOT / "lynx_compile", "lynx_compile.passes": ROOT / "passes",
            "lynx_compile.kernels": ROOT / "kernels"}


def _modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> source file."""
    mods: dict[str, Path] = {}
    for pkg, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, mods: dict[str, Path]) -> dict[str, int]:
    """Modules of ``mods`` that module ``name`` imports -> the first line doing so."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target and target not in mods:  # ``import a.b.c`` of a function or class: its module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.setdefault(target, line)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in mods else base, node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def import_cycles(packages: dict[str, Path]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each as
    ``module:line -> module`` steps of one cycle through it."""
    mods = _modules(packages)
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for group in groups:  # one cycle through the group's first module, for the message
        start = min(group)
        path, seen, at = [start], {start}, start
        while True:
            nxt = min(w for w in graph[at] if w in group)
            path.append(f"{mods[at].relative_to(ROOT) if mods[at].is_relative_to(ROOT) else mods[at]}:"
                        f"{graph[at][nxt]} -> {nxt}")
            if nxt in seen:
                break
            seen.add(nxt)
            at = nxt
        cycles.append(path)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(PACKAGES)
    assert not cycles, "import cycles (break each with a module both sides can import):\n" + \
        "\n".join("  " + "\n    ".join(c) for c in cycles)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    """The checker itself: ``a`` imports ``b`` at module level and ``b`` imports ``a`` inside a
    function (a cycle); ``c`` imports ``a`` only for type checking (none); ``d`` imports the
    package's ``__init__``, which imports ``d`` (a cycle)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg import d\n")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (pkg / "d.py").write_text("def f():\n    import pkg\n")
    cycles = import_cycles({"pkg": pkg})
    assert sorted(c[0] for c in cycles) == ["pkg", "pkg.a"], cycles
    assert any("b.py:2 -> pkg.a" in step for c in cycles for step in c), cycles


def test_subpackages_import_on_their_own():
    """``import lynx_compile.kernels`` (reused by other projects), ``.remat`` (the optimizer, free
    of torch.fx) or ``.models`` loads neither lynx's backend nor torch.compile's machinery: the
    package ``__init__`` loads its names on first use. The names still resolve to the functions."""
    code = (
        "import sys, lynx_compile.kernels, lynx_compile.solver, lynx_compile.models\n"
        "loaded = [m for m in ('lynx_compile.compiler.dynamo_backend', 'lynx_compile.config', 'lynx_compile.passes',"
        " 'torch._dynamo', 'torch._inductor') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "import lynx_compile, lynx_compile.pipelining, lynx_compile.compiler.dynamo_backend\n"
        "assert callable(lynx_compile.backend) and callable(lynx_compile.pipeline)\n"
        "assert lynx_compile.backend is lynx_compile.compiler.dynamo_backend.backend\n"
        "assert lynx_compile.pipeline is lynx_compile.pipelining.pipeline\n"
    )
    _runs_in_a_fresh_interpreter(code)


def test_the_stage_planner_and_sim_import_without_torch():
    """``lynx_compile.sim`` builds on the pipeline schedule simulator and the stage planner of
    ``lynx_compile.pipelining`` (plain data in and out), so importing them loads no torch: the
    package loads ``pipeline(...)`` and its torch.distributed machinery on first use."""
    code = (
        "import sys, lynx_compile.sim, lynx_compile.pipelining\n"
        "import lynx_compile.pipelining.plan_stages, lynx_compile.pipelining.stage_variants\n"
        "import lynx_compile.pipelining.microbatch_plan, lynx_compile.pipelining.schedule_sim\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('lynx_compile'))\n"
        "assert callable(lynx_compile.pipelining.plan_stages)\n"
    )
    _runs_in_a_fresh_interpreter(code)


def _runs_in_a_fresh_interpreter(code: str) -> None:
    """``code`` run by a new Python process (what it imports is not already loaded here) exits 0."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
