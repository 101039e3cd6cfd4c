"""The held-out split's overlap bound, measured independently of the split's own bookkeeping,
and the deduplication that enforces it."""

from glm_mtp.experiments.training.corpus import (
    MAX_OVERLAP, corpus_split, dedup_heldout, is_heldout, long_lines, ngrams, overlap, read_item,
)


def _seen(names):
    lines, grams = set(), set()
    for n in names:
        t = read_item(n)
        lines |= long_lines(t)
        grams |= ngrams(t)
    return lines, grams


def test_real_split_respects_the_overlap_bound():
    s = corpus_split()
    assert len(s.heldout) >= 20 and not set(s.train) & set(s.heldout)
    seen_lines, seen_grams = _seen(s.train)
    worst = {n: overlap(read_item(n), seen_lines, seen_grams) for n in s.heldout}
    assert max(o.lines for o in worst.values()) <= MAX_OVERLAP
    assert max(o.ngrams for o in worst.values()) <= MAX_OVERLAP
    assert worst == s.overlap  # the split's recorded overlap is the measured one
    # The bound bites: the plain path-hash split (every candidate held out) breaks it, as the
    # encodings tables and pydoc topics did before deduplication.
    candidates = [n for n in s.train + s.heldout if is_heldout(n)]
    plain_train = [n for n in s.train if not is_heldout(n)]
    pl, pg = _seen(plain_train)
    assert max(overlap(read_item(n), pl, pg).worst for n in candidates) > 0.5


def test_dedup_moves_chains_until_stable():
    # c1 copies the training file; c2 copies c1 only: once c1 moves to training, c2 must follow.
    words = [f"w{i}" for i in range(400)]
    base = "\n".join(" ".join(words[i : i + 10]) + " padding padding" for i in range(0, 200, 10))
    other = "\n".join(" ".join(words[i : i + 10]) + " filler filler" for i in range(200, 400, 10))
    texts = {"train": base, "c1": base + "\n" + other, "c2": other,
             "c3": "completely different text " * 3 + "\n" + "unique line number three here ok"}
    train, held, ov = dedup_heldout(["c1", "c2", "c3"], ["train"], texts)
    assert held == ["c3"] and train == ["c1", "c2", "train"]
    assert ov["c3"].worst == 0.0
    # Without the second round c2 would have stayed: it shares nothing with the first training set.
    assert overlap(texts["c2"], long_lines(base), ngrams(base)).worst == 0.0


def test_split_ignores_files_a_python_version_lacks(tmp_path):
    # A different stdlib root: candidates still follow the path hash, and the split is reproducible.
    for name in ("a.py", "b.py", "pkg/c.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\nprint('hello from {name}, a long enough line')\n")
    s1, s2 = corpus_split(str(tmp_path)), corpus_split(str(tmp_path))
    assert s1.digest() == s2.digest() and s1.train is not s2.train
    assert {"a.py", "b.py", "pkg/c.py"} <= set(s1.train + s1.heldout)
