"""A small byte-level BPE tokenizer (GPT-2 style), trained on the corpus's training split.

Text is split into words by a regex (letters/underscores, digits, punctuation runs, whitespace
runs with the last space left to the next word, so indentation becomes its own tokens); each word
is UTF-8 bytes, and merges learnt from pair counts join adjacent symbols. Ids 0..255 are bytes,
256 + i is merge i. Every byte string round-trips: ``decode(encode(s)) == s``.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import Iterable

PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+"""


class BpeTokenizer:
    """Byte-level BPE.

    Args:
        merges: the learnt pairs in order; merge i makes token ``256 + i``.
        pattern: the pre-tokenisation regex.
    """

    def __init__(self, merges: list[tuple[int, int]], pattern: str = PATTERN) -> None:
        self.merges = [tuple(m) for m in merges]
        self.pattern = pattern
        self._re = re.compile(pattern)
        self.ranks = {m: i for i, m in enumerate(self.merges)}
        self.vocab: list[bytes] = [bytes([i]) for i in range(256)]
        for a, b in self.merges:
            self.vocab.append(self.vocab[a] + self.vocab[b])
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.merges)

    # ---- training ---------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, pattern: str = PATTERN) -> BpeTokenizer:
        """Learn ``vocab_size - 256`` merges from ``texts``; ties in pair counts go to the
        smaller pair, so the result is the same on every machine."""
        if vocab_size < 256:
            raise ValueError(f"vocab_size must be >= 256 (the byte alphabet), got {vocab_size}")
        rx = re.compile(pattern)
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(rx.findall(text))
        words = [list(w.encode("utf-8")) for w in counts]
        freqs = list(counts.values())
        pairs: Counter[tuple[int, int]] = Counter()
        where: dict[tuple[int, int], set[int]] = {}
        for i, (w, f) in enumerate(zip(words, freqs)):
            for p in zip(w, w[1:]):
                pairs[p] += f
                where.setdefault(p, set()).add(i)
        merges: list[tuple[int, int]] = []
        for new in range(256, vocab_size):
            if not pairs:
                break
            best = max(pairs.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]))[0]
            merges.append(best)
            for i in list(where.get(best, ())):
                w, f = words[i], freqs[i]
                for p in zip(w, w[1:]):  # withdraw the word's old pairs
                    pairs[p] -= f
                    if pairs[p] <= 0:
                        del pairs[p]
                merged, j = [], 0
                while j < len(w):
                    if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                        merged.append(new)
                        j += 2
                    else:
                        merged.append(w[j])
                        j += 1
                words[i] = merged
                for p in zip(merged, merged[1:]):
                    pairs[p] += f
                    where.setdefault(p, set()).add(i)
            where.pop(best, None)
        return cls(merges, pattern)

    # ---- use ----------------------------------------------------------------------------------
    def _encode_word(self, word: str) -> list[int]:
        ids = self._cache.get(word)
        if ids is not None:
            return ids
        ids = list(word.encode("utf-8"))
        while len(ids) > 1:
            ranked = [(self.ranks.get(p, 1 << 30), k) for k, p in enumerate(zip(ids, ids[1:]))]
            rank, _ = min(ranked)
            if rank == 1 << 30:
                break
            pair, new, out, j = self.merges[rank], 256 + rank, [], 0
            while j < len(ids):
                if j + 1 < len(ids) and (ids[j], ids[j + 1]) == pair:
                    out.append(new)
                    j += 2
                else:
                    out.append(ids[j])
                    j += 1
            ids = out
        self._cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        out: list[int] = []
        for word in self._re.findall(text):
            out.extend(self._encode_word(word))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (invalid UTF-8 from a partial character becomes U+FFFD)."""
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    # ---- files --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write ``{"type": "byte_bpe", "pattern", "merges"}`` as JSON."""
        with open(path, "w") as f:
            json.dump({"type": "byte_bpe", "pattern": self.pattern, "merges": [list(m) for m in self.merges]}, f)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BpeTokenizer:
        with open(path) as f:
            data = json.load(f)
        if data.get("type") != "byte_bpe":
            raise ValueError(f"{path}: not a byte_bpe tokenizer file")
        return cls([tuple(m) for m in data["merges"]], data["pattern"])
