"""The offline corpus: the Python standard library's sources and pydoc topics.

Present on every machine that runs Python, so anyone can retrain. Files are listed in sorted
order of their path relative to the stdlib root. The split has two stages:

1. Candidates: an item is a held-out candidate when the blake2b hash of its relative path falls
   in the ``HELDOUT_PERCENT`` bucket, so the candidates do not depend on which other files a
   Python version ships.
2. Deduplication: the stdlib repeats itself (the ``encodings`` code-page tables, distutils copies,
   pydoc topics quoting the reference), and a held-out file whose lines the model saw in training
   measures recall, not prediction. A candidate stays held out only if at most ``MAX_OVERLAP`` of
   its long lines (``MIN_LINE_CHARS``+ characters, stripped) and at most ``MAX_OVERLAP`` of its
   ``NGRAM``-word n-grams occur in training items; otherwise it moves to training. Moving grows
   the training set, so this repeats until no candidate moves.

The lists (and their hash) are recorded beside the checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field

from torch import Tensor

from .bpe import BpeTokenizer

# Directories left out: the test suite (huge, repetitive), third-party and generated trees.
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib", "turtledemo", "lib2to3",
                 "ensurepip"}
HELDOUT_PERCENT = 10
MAX_OVERLAP = 0.05  # largest share of a held-out item's long lines, and of its n-grams, seen in training
MIN_LINE_CHARS = 25  # shorter lines (`return self`, `else:`) are shared by any two Python files
NGRAM = 8  # words (whitespace-separated) per n-gram


def stdlib_root() -> str:
    """Where this interpreter's standard library lives."""
    return sysconfig.get_paths()["stdlib"]


def is_heldout(name: str) -> bool:
    """Whether a corpus item (a relative path or ``pydoc:topic``) is a held-out candidate: its
    path hash falls in the held-out bucket (deduplication may still move it to training)."""
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


# Out-of-distribution text: packages installed beside this one that never enter training.
OOD_PACKAGES = ("omegaconf", "hydra")


def site_root() -> str:
    """The site-packages directory that holds ``OOD_PACKAGES`` (this environment's)."""
    import omegaconf

    return os.path.dirname(os.path.dirname(os.path.abspath(omegaconf.__file__)))


def ood_items() -> list[str]:
    """``site:<relative path>`` of every ``.py`` file of ``OOD_PACKAGES`` (tests excluded), sorted:
    Python code of the stdlib's style that the corpus never holds (it excludes site-packages)."""
    root = site_root()
    out = []
    for pkg in OOD_PACKAGES:
        for d, dirs, files in os.walk(os.path.join(root, pkg)):
            dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS and x != "gen")  # gen: ANTLR-generated parsers
            out += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    return [f"site:{n}" for n in sorted(out)]


def read_item(name: str, root: str | None = None) -> str:
    """The text of a corpus item: a stdlib file, ``pydoc:<topic>`` or ``site:<path>`` (an
    out-of-distribution file, relative to ``site_root()``)."""
    if name.startswith("pydoc:"):
        from pydoc_data.topics import topics

        return topics[name[len("pydoc:"):]]
    if name.startswith("site:"):
        root, name = site_root(), name[len("site:"):]
    with open(os.path.join(root or stdlib_root(), name), encoding="utf-8", errors="replace") as f:
        return f.read()


# ------------------------------------------------------------------------------------------------
# Overlap. Lines and n-grams are compared through Python's 64-bit string hash: within one process
# equal strings hash equal, and a collision among the corpus's ~1.5 M n-grams has a probability
# near 1e-7, so sets of hashes stand in for sets of strings at a tenth of the memory.


def long_lines(text: str) -> set[int]:
    """Hashes of the stripped lines of ``text`` with at least ``MIN_LINE_CHARS`` characters."""
    return {hash(s) for s in (l.strip() for l in text.splitlines()) if len(s) >= MIN_LINE_CHARS}


def ngrams(text: str) -> set[int]:
    """Hashes of the ``NGRAM``-word n-grams of ``text`` (words split on whitespace)."""
    w = text.split()
    return {hash(" ".join(w[i : i + NGRAM])) for i in range(len(w) - NGRAM + 1)}


@dataclass
class Overlap:
    """What share of one item's long lines and n-grams occur in a reference set (0 for none)."""

    lines: float
    ngrams: float

    @property
    def worst(self) -> float:
        return max(self.lines, self.ngrams)


def overlap(text: str, seen_lines: set[int], seen_ngrams: set[int]) -> Overlap:
    """Shares of ``text``'s distinct long lines and distinct n-grams found in the seen sets."""
    ls, gs = long_lines(text), ngrams(text)
    return Overlap(len(ls & seen_lines) / len(ls) if ls else 0.0, len(gs & seen_ngrams) / len(gs) if gs else 0.0)


def dedup_heldout(
    candidates: list[str], train: list[str], texts: dict[str, str]
) -> tuple[list[str], list[str], dict[str, Overlap]]:
    """Move every candidate that overlaps training by more than ``MAX_OVERLAP`` into training,
    until none does. Returns (train, heldout, each held-out item's final overlap), lists sorted."""
    seen_lines: set[int] = set()
    seen_ngrams: set[int] = set()
    for n in train:
        seen_lines |= long_lines(texts[n])
        seen_ngrams |= ngrams(texts[n])
    train, held = list(train), list(candidates)
    while True:
        ov = {n: overlap(texts[n], seen_lines, seen_ngrams) for n in held}
        moved = [n for n in held if ov[n].worst > MAX_OVERLAP]
        if not moved:
            return sorted(train), sorted(held), ov
        for n in moved:  # they join training: later candidates are checked against them too
            seen_lines |= long_lines(texts[n])
            seen_ngrams |= ngrams(texts[n])
        train += moved
        held = [n for n in held if n not in moved]


@dataclass
class Split:
    """The corpus's items, split. ``train`` and ``heldout`` are sorted item names; ``overlap``
    holds each held-out item's overlap with training (empty for a split built by hand)."""

    train: list[str]
    heldout: list[str]
    overlap: dict[str, Overlap] = field(default_factory=dict, compare=False, repr=False)

    def digest(self) -> str:
        """sha256 of the two lists, one name per line, ``[train]`` then ``[heldout]``."""
        body = "[train]\n" + "\n".join(self.train) + "\n[heldout]\n" + "\n".join(self.heldout) + "\n"
        return hashlib.sha256(body.encode()).hexdigest()


@dataclass
class Corpus:
    """Token streams of the two splits and the tokenizer."""

    split: Split
    tokenizer: BpeTokenizer
    train: Tensor  # (N,) int64
    heldout: Tensor  # (M,) int64


@functools.lru_cache(maxsize=4)
def _split(root: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, Overlap], ...]]:
    from pydoc_data.topics import topics

    items = list_stdlib_files(root) + [f"pydoc:{t}" for t in sorted(topics)]
    texts = {n: read_item(n, root) for n in items}
    train, held, ov = dedup_heldout([n for n in items if is_heldout(n)], [n for n in items if not is_heldout(n)], texts)
    return tuple(train), tuple(held), tuple(ov.items())


def corpus_split(root: str | None = None) -> Split:
    """All stdlib files and pydoc topics: held-out candidates by path hash, deduplicated against
    training (module docstring). Cached per root (reading and hashing the corpus takes seconds);
    each call returns fresh lists."""
    train, held, ov = _split(root or stdlib_root())
    return Split(list(train), list(held), dict(ov))


# ------------------------------------------------------------------------------------------------


def split_report(train: list[str], heldout: list[str]) -> dict[str, float]:
    """Overlap of a split, measured from scratch: ``pooled_lines``, the share of all held-out
    long lines (stripped, ``MIN_LINE_CHARS``+) found verbatim in training items, and the worst
    held-out item's shares of long lines and of n-grams (the bound ``MAX_OVERLAP`` applies to)."""
    seen_text: set[str] = set()
    seen_lines: set[int] = set()
    seen_ngrams: set[int] = set()
    for n in train:
        t = read_item(n)
        seen_text |= {s for s in (l.strip() for l in t.splitlines()) if len(s) >= MIN_LINE_CHARS}
        seen_lines |= long_lines(t)
        seen_ngrams |= ngrams(t)
    total = hit = 0
    worst_lines = worst_ngrams = 0.0
    for n in heldout:
        t = read_item(n)
        ls = [s for s in (l.strip() for l in t.splitlines()) if len(s) >= MIN_LINE_CHARS]
        total, hit = total + len(ls), hit + sum(s in seen_text for s in ls)
        o = overlap(t, seen_lines, seen_ngrams)
        worst_lines, worst_ngrams = max(worst_lines, o.lines), max(worst_ngrams, o.ngrams)
    return {"heldout_items": len(heldout), "train_items": len(train), "pooled_lines": hit / total if total else 0.0,
            "worst_item_lines": worst_lines, "worst_item_ngrams": worst_ngrams}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """``python -m glm_mtp.experiments.training.corpus [corpus.json ...]``: the overlap of this split and
    of any recorded split (a checkpoint's ``corpus.json``), one line each."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Held-out / training overlap of the corpus split.")
    ap.add_argument("recorded", nargs="*", help="corpus.json files of recorded splits to measure too")
    args = ap.parse_args(argv)
    s = corpus_split()
    splits = {"this split": (s.train, s.heldout)}
    for path in args.recorded:
        with open(path) as f:
            rec = json.load(f)
        splits[path] = (rec["train"], rec["heldout"])
    out = {}
    for name, (train, held) in splits.items():
        r = out[name] = split_report(train, held)
        print(f"{name}: {r['heldout_items']} held-out / {r['train_items']} training items; held-out long lines seen in "
              f"training {r['pooled_lines']:.1%} (pooled); worst item: {r['worst_item_lines']:.1%} of its long lines, "
              f"{r['worst_item_ngrams']:.1%} of its {NGRAM}-word n-grams (bound {MAX_OVERLAP:.0%})")
    return out


if __name__ == "__main__":
    main()
