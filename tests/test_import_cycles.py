"""No import cycles in ``src/glm_mtp``: every ``import`` and ``from ... import`` counts, at the top
of a module, inside a function or under ``TYPE_CHECKING`` alike. Where two modules need each other,
the shared piece moves down a floor; a function-local import only hides a cycle until the order of
first use changes. And no module imports an entry point (``experiments/*.py`` with a ``main``):
entry points import the library, never each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def package_graph() -> dict[str, set[str]]:
    """The package's import graph, parsed once for the file's tests."""
    return import_graph(PACKAGE_DIR)


def test_glm_mtp_has_no_import_cycles(package_graph):
    graph = package_graph
    assert len(graph) > 100, f"the walk found only {len(graph)} modules under {PACKAGE_DIR}"
    assert graph["glm_mtp.experiments.acceptance"] >= {"glm_mtp.experiments.acceptance_job.run",
                                                        "glm_mtp.experiments.settings.entry"}  # local import seen
    found = cycles(graph)
    assert not found, "import cycles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def entry_points(package_dir: Path, experiments: str) -> set[str]:
    """The entry points: the modules directly in the ``experiments`` package (dotted name) that
    define a top-level ``main`` (``python -m <package>.experiments.<name>`` runs them)."""
    found = set()
    for name, path in module_files(package_dir).items():
        if name.rpartition(".")[0] == experiments and path.name != "__init__.py":
            tree = ast.parse(path.read_text(), str(path))
            if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
                found.add(name)
    return found


def entry_point_imports(graph: dict[str, set[str]], entries: set[str]) -> list[tuple[str, str]]:
    """Every (module, entry point) where a module of the package imports an entry point: entry
    points import the library, never each other, and the library never imports them."""
    return sorted((m, e) for m, deps in graph.items() for e in deps & entries)


def test_no_module_imports_an_entry_point(package_graph):
    """The rule of ``glm_mtp.experiments``: its top-level modules with a ``main`` are entry points
    only; what another module needs of one lives in a subpackage (``acceptance_job``,
    ``training.train_run``, ``loop.feed_agreement``, ...)."""
    entries = entry_points(PACKAGE_DIR, "glm_mtp.experiments")
    assert {"glm_mtp.experiments.acceptance", "glm_mtp.experiments.grid", "glm_mtp.experiments.train"} <= entries
    found = entry_point_imports(package_graph, entries)
    assert not found, "modules that import an entry point (move what they use into the library):\n" + "\n".join(
        f"{m} -> {e}" for m, e in found)


def test_a_planted_entry_point_import_is_found(tmp_path):
    """An entry point imported by another entry point (inside a function) and by a subpackage
    (relative, up a floor) is found; a module without ``main`` and a subpackage's own ``main`` are
    not entry points."""
    exp = tmp_path / "planted" / "experiments"
    (exp / "sub").mkdir(parents=True)
    (exp.parent / "__init__.py").write_text("")
    (exp / "__init__.py").write_text("")
    (exp / "sub" / "__init__.py").write_text("")
    (exp / "run.py").write_text("def main():\n    pass\n")
    (exp / "sweep.py").write_text("def main():\n    from . import run\n    run.main()\n")
    (exp / "lib.py").write_text("X = 1\n")
    (exp / "sub" / "job.py").write_text("from .. import lib\nfrom ..run import main\n\ndef main():\n    pass\n")
    entries = entry_points(tmp_path / "planted", "planted.experiments")
    assert entries == {"planted.experiments.run", "planted.experiments.sweep"}
    found = entry_point_imports(import_graph(tmp_path / "planted"), entries)
    assert found == [("planted.experiments.sub.job", "planted.experiments.run"),
                     ("planted.experiments.sweep", "planted.experiments.run")]
    (exp / "sweep.py").write_text("def main():\n    from .sub import job\n")
    (exp / "sub" / "job.py").write_text("from .. import lib\n")
    assert entry_point_imports(import_graph(tmp_path / "planted"), entries) == []


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
