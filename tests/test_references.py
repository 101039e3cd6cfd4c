"""Every dotted reference to the package resolves: in the docstrings and comments under
``src/glm_mtp``, in ``docs/*.md``, ``DESIGN.md`` and ``README.md``, each ``glm_mtp.a.b.c`` names a
real module or attribute (the longest importable module, then ``getattr`` for the rest), and so
does each short reference rooted at one of the package's own folders or top-level modules
(``experiments.targets.target.Target``, ``reference.block.mtp_rows``, ``kernels.linear``), read as
``glm_mtp.`` plus it. A module that moved leaves its old name behind in prose; this finds it.

Short roots are the top-level modules and packages of ``glm_mtp`` (``reference``, ``optimized``,
``conformance``, ``experiments``, ``tools``, ``registry``, ``ranges``) and the second-level
packages whose name no other module or package of ``glm_mtp`` has (``kernels``, ``mutants``,
``traces``, ...), except the names in ``NOT_ROOTS``, which the prose also uses for arguments. A
trailing file suffix (``registry.py``, ``train.yaml``) is dropped before resolving.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import glm_mtp

PACKAGE_DIR = Path(glm_mtp.__file__).resolve().parent
REPO = PACKAGE_DIR.parent.parent
# Second-level package names the docstrings also use as argument names: ``targets.tensors[t]``
# (paged.py's RowTargets argument), ``loop.state`` (a loop object): not references.
NOT_ROOTS = {"targets", "loop"}
FILE_SUFFIXES = {"py", "md", "json", "jsonl", "yaml", "png", "txt", "safetensors", "log", "csv", "toml", "sh"}


def short_roots(package_dir: Path) -> dict[str, str]:
    """The short names a reference may start with, each to its full dotted name (module docstring)."""
    name = package_dir.name
    roots = {name: name}
    for path in sorted(package_dir.iterdir()):
        if path.suffix == ".py" and path.stem != "__init__" or (path / "__init__.py").is_file():
            roots[path.stem] = f"{name}.{path.stem}"
    # Every module and package name below the top level, to keep only the second-level
    # packages whose last name is theirs alone (``grammars`` is both a package and a module).
    seen: dict[str, int] = {}
    for path in package_dir.rglob("*.py"):
        depth = len(path.relative_to(package_dir).parts)
        stem = path.parent.name if path.stem == "__init__" else path.stem
        if depth > 1 or path.stem != "__init__":
            seen[stem] = seen.get(stem, 0) + 1
    for init in sorted(package_dir.glob("*/*/__init__.py")):
        short = init.parent.name
        if short not in roots and short not in NOT_ROOTS and seen.get(short) == 1:
            roots[short] = f"{name}.{init.parent.parent.name}.{short}"
    return roots


def reference_pattern(roots: dict[str, str]) -> re.Pattern[str]:
    """A dotted name starting at one of ``roots``, not itself the tail of a longer name or a path."""
    names = "|".join(sorted(map(re.escape, roots), key=len, reverse=True))
    return re.compile(rf"(?<![\w./\-])(?:{names})(?:\.[A-Za-z_]\w*)+")


def python_prose(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and docstring (module, class, function) in the Python
    text ``source``."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                found.append((doc.lineno, doc.value.value))
    return found


def markdown_prose(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every line of the Markdown file ``path``."""
    return list(enumerate(path.read_text().splitlines(), 1))


def why_unresolved(dotted: str) -> str | None:
    """Why ``dotted`` (``glm_mtp.a.b``) names nothing, or ``None`` where it names a module or an
    attribute: each part is an attribute of the object so far, else a submodule to import."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    name = parts[0]
    for part in parts[1:]:
        parent, name = name, f"{name}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise  # the module exists and fails to import: an error of its own, not a stale name
            return f"{parent} has no attribute or submodule {part!r}"
    return None


def unresolved(sources: dict[str, list[tuple[int, str]]], roots: dict[str, str]) -> list[str]:
    """``file:line: reference (why)`` for every reference in ``sources`` (file name to its prose)
    that names nothing."""
    pattern = reference_pattern(roots)
    failures = []
    for fname, texts in sources.items():
        for line, text in texts:
            for match in pattern.finditer(text):
                parts = match.group(0).split(".")
                if parts[-1] in FILE_SUFFIXES:
                    parts.pop()
                if len(parts) < 2 and parts[0] != PACKAGE_DIR.name:
                    continue  # a bare root with a file suffix: ``registry.py``
                dotted = ".".join([roots[parts[0]], *parts[1:]])
                why = why_unresolved(dotted)
                if why is not None:
                    at = line + text.count("\n", 0, match.start())  # the match's own line in a docstring
                    failures.append(f"{fname}:{at}: {match.group(0)} ({why})")
    return failures


def all_sources() -> dict[str, list[tuple[int, str]]]:
    """The prose this test reads: the package's comments and docstrings and the Markdown docs."""
    sources = {str(p.relative_to(REPO)): python_prose(p.read_text()) for p in sorted(PACKAGE_DIR.rglob("*.py"))}
    for path in [REPO / "DESIGN.md", REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        sources[str(path.relative_to(REPO))] = markdown_prose(path)
    return sources


def test_every_dotted_reference_resolves():
    failures = unresolved(all_sources(), short_roots(PACKAGE_DIR))
    assert not failures, "references that name nothing:\n  " + "\n  ".join(failures)


def test_a_planted_bad_reference_fails():
    # A moved module, a missing attribute, both spellings, in a comment, a docstring and Markdown;
    # beside them references that do resolve, a file name and an argument that are not references.
    roots = short_roots(PACKAGE_DIR)
    source = '''"""Uses ``glm_mtp.experiments.target.Target`` and ``reference.block.mtp_rows``."""
# see experiments.recall.RecallProbe and glm_mtp.reference.block.no_such_function
def f(targets):
    """``targets.tensors[t]``, in registry.py, by ``kernels.linear`` and ``glm_mtp.optimized``."""
'''
    sources = {"planted.py": python_prose(source),
               "planted.md": [(1, "run `python -m glm_mtp.experiments.indexer_loss` (moved)")]}
    failures = unresolved(sources, roots)
    assert sorted(f.split(" (")[0] for f in failures) == [
        "planted.md:1: glm_mtp.experiments.indexer_loss",
        "planted.py:1: glm_mtp.experiments.target.Target",
        "planted.py:2: experiments.recall.RecallProbe",
        "planted.py:2: glm_mtp.reference.block.no_such_function",
    ], failures


def test_short_roots_hold_the_package_and_no_ambiguous_name():
    roots = short_roots(PACKAGE_DIR)
    assert roots["experiments"] == "glm_mtp.experiments" and roots["kernels"] == "glm_mtp.optimized.kernels"
    assert "grammars" not in roots  # experiments/grammars/ and conformance/grammars.py
    assert not NOT_ROOTS & roots.keys()
