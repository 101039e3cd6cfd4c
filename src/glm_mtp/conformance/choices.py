"""Where a scenario's randomness comes from (a ``Chooser``), and the argument helpers every
generator draws its token ids and hiddens with (valid, or broken with a given chance)."""

from __future__ import annotations

import builtins
import random
from typing import Protocol, Sequence, TypeVar

from .grammars import ENDS, FAULTS, Grammar
from .ops import Hidden, Sampling, TokenIds
from .spec import SpecModel

T = TypeVar("T")

# Drafts per propose the generators use (k in [0, MAX_DRAFTS]); GLM-5 deployments run 1-4.
MAX_DRAFTS = 4


# ------------------------------------------------------------------------------------------------
# Where randomness comes from.


class Chooser(Protocol):
    """A source of choices: a seeded ``random.Random`` here, hypothesis data in ``machines/machine.py``."""

    def int(self, lo: builtins.int, hi: builtins.int) -> builtins.int: ...  # inclusive
    def choice(self, options: Sequence[T]) -> T: ...
    def chance(self, p: float) -> bool: ...
    def seed(self) -> builtins.int: ...


class RandomChooser:
    """Choices from ``random.Random(seed)``: the same seed gives the same scenario everywhere."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: builtins.int, hi: builtins.int) -> builtins.int:
        return self.rng.randint(lo, hi)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def seed(self) -> builtins.int:
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


# A propose's grammar (DESIGN.md §10) and sampling, drawn only when the scenario draws them
# (``SpecModel.grammars``); otherwise nothing is drawn, so such a scenario's other choices are
# those of a run without grammars.


def grammar_arg(ch: Chooser, m: SpecModel, fault_p: float = 0.0) -> Grammar | None:
    """A propose's grammar with chance 0.4: a random token automaton, unbounded or ending at a
    depth within a few drafts (terminated or with an empty mask), started at its root or deeper,
    now and then a matcher that refuses an allowed token; no matcher at all with chance
    ``fault_p``."""
    if not m.grammars or not ch.chance(0.4):
        return None
    depth = ch.int(0, 6) if ch.chance(0.6) else None
    start = ch.int(0, depth if depth is not None else 3) if ch.chance(0.3) else 0
    end = ch.choice(ENDS)
    liar = ch.int(0, 3) if ch.chance(0.1) else None
    fault = ch.choice(FAULTS) if ch.chance(fault_p) else None
    return Grammar(ch.seed(), depth, start, end, liar, fault)


def grammars_arg(ch: Chooser, m: SpecModel, states: int, fault_p: float = 0.0) -> tuple[Grammar | None, ...] | None:
    """A batch's grammars with chance 0.5: one per state, each a grammar or None."""
    if not m.grammars or not ch.chance(0.5):
        return None
    return tuple(grammar_arg(ch, m, fault_p) if ch.chance(0.7) else None for _ in range(states))


def sampling_arg(ch: Chooser, m: SpecModel) -> Sampling | None:
    """A sampled propose's temperature and noise seed with chance 0.25 (``propose_sampled``)."""
    if not m.grammars or not ch.chance(0.25):
        return None
    return Sampling(ch.seed(), ch.choice((0.5, 1.0, 1.7)))
