import random

import pytest

from glm_mtp.experiments.training.bpe import BpeTokenizer
from glm_mtp.experiments.training.corpus import corpus_split, is_heldout, read_item


@pytest.fixture(scope="module")
def tok():
    split = corpus_split()
    texts = [read_item(n) for n in split.train[:40]]
    return BpeTokenizer.train(texts, 400)


def test_roundtrip_random_text(tok):
    rng = random.Random(7)
    alphabet = "abc XYZ_09\n\t    ()[]{}:'\"#é漢😀\u00a0"
    for _ in range(50):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        assert tok.decode(tok.encode(s)) == s


def test_merges_compress_code_and_ids_in_range(tok):
    text = read_item(corpus_split().heldout[0])[:5000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < 0.6 * len(text.encode())  # merges learnt on code compress unseen code
    assert all(0 <= i < tok.vocab_size for i in ids) and tok.vocab_size == 400


def test_training_is_deterministic_and_saves(tok, tmp_path):
    split = corpus_split()
    again = BpeTokenizer.train([read_item(n) for n in split.train[:40]], 400)
    assert again.merges == tok.merges
    tok.save(tmp_path / "t.json")
    loaded = BpeTokenizer.load(tmp_path / "t.json")
    assert loaded.merges == tok.merges and loaded.encode("def f(x):\n    "
                                                         "return x") == tok.encode("def f(x):\n    return x")


def test_split_is_disjoint_and_recorded():
    s = corpus_split()
    assert s.heldout and s.train and not set(s.train) & set(s.heldout)
    # Held-out items are path-hash candidates; training holds the rest and the deduplicated candidates.
    assert all(is_heldout(n) for n in s.heldout) and any(is_heldout(n) for n in s.train)
    assert any(n.startswith("pydoc:") for n in s.train)
    assert len(s.digest()) == 64 and s.digest() == corpus_split().digest()


def test_vocab_size_below_bytes_is_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        BpeTokenizer.train(["x"], 100)
