"""No import cycles in ``src/glm_mtp``: every ``import`` and ``from ... import`` counts, at the top
of a module, inside a function or under ``TYPE_CHECKING`` alike. Where two modules need each other,
the shared piece moves down a floor; a function-local import only hides a cycle until the order of
first use changes."""

from __future__ import annotations

import ast
from pathlib import Path

import glm_mtp

PACKAGE_DIR = Path(glm_mtp.__file__).resolve().parent


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module under ``package_dir`` by dotted name (a package by its own name, not
    ``.__init__``), named from the package folder's own name down."""
    root = package_dir.parent
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` (its source at ``path``) imports anywhere
    in its body. ``from P import x`` imports ``P.x`` when that is a module, else ``P``; a
    relative import resolves from the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            deps.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {d for d in deps if d in modules and d != name}


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    modules = module_files(package_dir)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every
    import cycle lies in one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_glm_mtp_has_no_import_cycles():
    graph = import_graph(PACKAGE_DIR)
    assert len(graph) > 100, f"the walk found only {len(graph)} modules under {PACKAGE_DIR}"
    assert graph["glm_mtp.experiments.acceptance"] >= {"glm_mtp.experiments.loop.speculative",
                                                        "glm_mtp.experiments.settings.entry"}  # local import seen
    found = cycles(graph)
    assert not found, "import cycles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_a_planted_cycle_is_found(tmp_path):
    """A cycle through a function-local import, one through ``TYPE_CHECKING`` and a relative one up
    a floor are each found; a one-way chain is not."""
    pkg = tmp_path / "planted"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from planted import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from planted.sub.d import D\n")
    (pkg / "sub" / "d.py").write_text("from .. import c\n")
    (pkg / "e.py").write_text("import planted.sub\nfrom planted.sub import d\n")
    assert cycles(import_graph(pkg)) == [["planted.a", "planted.b"], ["planted.c", "planted.sub.d"]]
    (pkg / "b.py").write_text("import os\n")
    (pkg / "sub" / "d.py").write_text("import planted.b\n")
    assert cycles(import_graph(pkg)) == []
