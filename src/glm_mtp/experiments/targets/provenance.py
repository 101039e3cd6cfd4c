"""What a result depends on beyond its config: the code's commit and the hashes of the files it
read. Acceptance runs, grids and training record the same fields from here."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any


def file_sha256(path: str | os.PathLike[str]) -> str | None:
    """sha256 of a file's bytes (None when it does not exist)."""
    if not os.path.exists(path):
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def git_commit() -> str | None:
    """The package checkout's commit, ``+dirty`` when tracked files differ from it; None outside git."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def provenance(checkpoint_dir: str | None) -> dict[str, Any]:
    """What a result depends on beyond its config: the code's commit, the checkpoint's weights and
    the corpus split it was trained on (the sha256 recorded in its corpus.json).

    Args:
        checkpoint_dir: the directory the model was loaded from (``LoadedModel.path``); None for
            random weights, which have no files to hash.
    """
    ckpt, corpus = None, None
    if checkpoint_dir:
        ckpt = file_sha256(Path(checkpoint_dir) / "model.safetensors")
        cj = Path(checkpoint_dir) / "corpus.json"
        if cj.exists():
            corpus = json.loads(cj.read_text()).get("sha256")
    return {"git_commit": git_commit(), "checkpoint_sha256": ckpt, "corpus_sha256": corpus}
