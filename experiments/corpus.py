"""The offline corpus: the Python standard library's sources and pydoc topics.

Present on every machine that runs Python, so anyone can retrain. Files are listed in sorted
order of their path relative to the stdlib root; a file is held out for evaluation when the hash
of that relative path falls in the held-out bucket, so the split does not depend on which other
files a Python version ships. The lists (and their hash) are recorded beside the checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

# Directories left out: the test suite (huge, repetitive), third-party and generated trees.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib", "turtledemo", "lib2to3", "ensurepip"}
HELDOUT_PERCENT = 5


def stdlib_root() -> str:
    """Where this interpreter's standard library lives."""
    return sysconfig.get_paths()["stdlib"]


def is_heldout(name: str) -> bool:
    """Whether a corpus item (a relative path or ``pydoc:topic``) is held out for evaluation."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return h % 100 < HELDOUT_PERCENT


def list_stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the stdlib's ``.py`` files, sorted."""
    root = root or stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS)
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(out)


def read_item(name: str, root: str | None = None) -> str:
    """The text of a corpus item: a stdlib file or ``pydoc:<topic>``."""
    if name.startswith("pydoc:"):
        from pydoc_data.topics import topics

        return topics[name[len("pydoc:"):]]
    with open(os.path.join(root or stdlib_root(), name), encoding="utf-8", errors="replace") as f:
        return f.read()


@dataclass
class Split:
    """The corpus's items, split. ``train`` and ``heldout`` are sorted item names."""

    train: list[str]
    heldout: list[str]

    def digest(self) -> str:
        """sha256 of the two lists, one name per line, ``[train]`` then ``[heldout]``."""
        body = "[train]\n" + "\n".join(self.train) + "\n[heldout]\n" + "\n".join(self.heldout) + "\n"
        return hashlib.sha256(body.encode()).hexdigest()


def corpus_split(root: str | None = None) -> Split:
    """All stdlib files and pydoc topics, split by ``is_heldout``."""
    from pydoc_data.topics import topics

    items = list_stdlib_files(root) + [f"pydoc:{t}" for t in sorted(topics)]
    return Split(train=[n for n in items if not is_heldout(n)], heldout=[n for n in items if is_heldout(n)])
