"""Where a scenario's randomness comes from (a ``Chooser``), and the argument helpers every
generator draws its token ids and hiddens with (valid, or broken with a given chance)."""

from __future__ import annotations

import random
from typing import Protocol, Sequence, TypeVar

from .ops import Hidden, TokenIds
from .spec import SpecModel

T = TypeVar("T")

# Drafts per propose the generators use (k in [0, MAX_DRAFTS]); GLM-5 deployments run 1-4.
MAX_DRAFTS = 4


# ------------------------------------------------------------------------------------------------
# Where randomness comes from.


class Chooser(Protocol):
    """A source of choices: a seeded ``random.Random`` here, hypothesis data in ``machine.py``."""

    def int(self, lo: int, hi: int) -> int: ...  # inclusive
    def choice(self, options: Sequence[T]) -> T: ...
    def chance(self, p: float) -> bool: ...
    def seed(self) -> int: ...


class RandomChooser:
    """Choices from ``random.Random(seed)``: the same seed gives the same scenario everywhere."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def seed(self) -> int:
        return self.rng.randrange(2**31)


# Argument helpers shared by the generators.


def random_ids(ch: Chooser, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(ch.int(0, vocab - 1) for _ in range(n))


def token_list(ch: Chooser, m: SpecModel, n: int, drafts: int = 0, fault_p: float = 0.0) -> TokenIds:
    """``n`` token ids in a random valid form, some naming drafts; broken with chance ``fault_p``."""
    ids: list[int | str] = [
        f"d{ch.int(1, drafts)}" if drafts and ch.chance(0.3) else ch.int(0, m.vocab - 1) for _ in range(n)
    ]
    if ch.chance(fault_p):
        kind = ch.choice(("id", "id", "float", "2d", "floats")) if n else ch.choice(("float", "2d"))
        if kind == "id":
            ids[ch.int(0, n - 1)] = ch.choice((-1, m.vocab, m.vocab + 7, -m.vocab))
            return TokenIds(tuple(ids), ch.choice(TokenIds.LIST_FORMS))
        return TokenIds(tuple(ids), kind)
    return TokenIds(tuple(ids), ch.choice(TokenIds.LIST_FORMS))


def single_token(ch: Chooser, m: SpecModel, drafts: int = 0, fault_p: float = 0.0) -> TokenIds:
    tok: int | str = f"d{ch.int(1, drafts)}" if drafts and ch.chance(0.2) else ch.int(0, m.vocab - 1)
    if ch.chance(fault_p):
        kind = ch.choice(("id", "id", "float", "pyfloat", "bool", "2d", "pair", "pair"))
        if kind == "id":
            return TokenIds((ch.choice((-1, m.vocab, 10 * m.vocab)),), ch.choice(TokenIds.SINGLE_FORMS))
        if kind == "pair":
            return TokenIds((tok, ch.int(0, m.vocab - 1)), "tensor")
        return TokenIds((tok,), kind)
    return TokenIds((tok,), ch.choice(TokenIds.SINGLE_FORMS))


def hidden(ch: Chooser, rows: int, fault_p: float = 0.0, single: bool = False) -> Hidden:
    """Fresh rows (a new seed); broken with chance ``fault_p``."""
    fault = None
    if ch.chance(fault_p):
        fault = ch.choice(Hidden.FAULTS)
        if rows == 0 and fault in ("nan", "inf"):
            fault = "rows"  # an empty tensor has no element to poison
    return Hidden(ch.seed(), rows, flat=single and ch.chance(0.5), fault=fault)
