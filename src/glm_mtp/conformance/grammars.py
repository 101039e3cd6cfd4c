"""Grammars as data for the conformance suite and the tests (DESIGN.md §10): random token automata
over the vocabulary, and the matcher that walks one (xgrammar's four ``GrammarMatcher`` methods).

A ``Grammar`` is plain data, like ``spec.Hidden``: a seed and the automaton's shape. Its automaton
is layered: a state lives at a depth (the tokens accepted since the root) and has its own mask,
drawn from its seed (one token, a few, about half, all but a few, every token), and each allowed
token leads to a state one deeper that depends on the token, so the mask of draft i depends on the
drafts before it. With ``depth = L`` every state at depth L ends the walk, all the same way
(``end``): ``terminated`` (``is_terminated()`` is true; its mask still allows tokens, so a drafter
that ignores termination drafts on) or ``empty`` (not terminated, its mask allows nothing). So how
many drafts a propose returns follows from the automaton alone: ``min(num_drafts, L - start)``
(``Grammar.drafts``), which the spec model predicts. ``depth = None`` never ends.

A matcher starts at depth ``start`` (a state drawn from the seed) and keeps the states it
walked, so ``rollback`` is exact and ``as_found`` says whether it is back where it started.
``liar`` is a depth at which ``accept_token`` refuses every token its own mask allows (a matcher
that breaks its contract); ``fault`` makes the argument no matcher at all, or a matcher of another
vocabulary (for the refusal, DESIGN.md §10's checks). Every bitmask word it fills past V has its
bits set, so a drafter that reads past V is caught. A matcher's fill checks the bitmask's width
as xgrammar's does (a ``RuntimeError`` for another vocabulary's). ``Breaks`` is a matcher whose
own code fails on its n-th fill or accept (a grammar process that dies midway).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# How a bounded automaton's last depth ends a walk.
ENDS = ("terminated", "empty")
# How a grammar argument is broken, or None: an object with no ``rollback``, one whose
# ``accept_token`` is not callable, the matcher class itself (not an instance), or a matcher of
# another vocabulary (32 tokens more: its bitmask rows are one word wider than the drafter's).
FAULTS = ("no_rollback", "not_callable", "class", "other_vocab")
# States per depth: small, so drafts of different tokens often meet again.
WIDTH = 3


@dataclass(frozen=True)
class Grammar:
    """A grammar argument as data: a random layered token automaton and where its matcher starts.

    Args:
        seed: draws every state's mask and the transitions.
        depth: L, the depth whose states end every walk (``end``); None: the walk never ends.
        start: the depth the matcher starts at (``start <= depth``); its state there is drawn
            from the seed.
        end: ``terminated`` or ``empty`` (``ENDS``).
        liar: a depth at which ``accept_token`` refuses every token (None: an honest matcher).
        fault: ``FAULTS``: the argument is no matcher (None: a matcher).
    """

    seed: int
    depth: int | None = None
    start: int = 0
    end: str = "terminated"
    liar: int | None = None
    fault: str | None = None

    def drafts(self, num_drafts: int) -> int:
        """How many drafts a propose asked for ``num_drafts`` returns under this grammar."""
        return num_drafts if self.depth is None else max(0, min(num_drafts, self.depth - self.start))

    def refuses(self, num_drafts: int) -> bool:
        """Whether a propose asked for ``num_drafts`` meets the liar: it accepts draft i (from
        depth ``start + i - 1``) before step i + 1 only, for i < num_drafts and i <= the drafts
        returned (the last of them is accepted to find that the walk stops after it)."""
        if self.liar is None or self.liar < self.start:
            return False
        i = self.liar - self.start + 1  # the draft accepted at the liar's depth
        return i <= min(num_drafts - 1, self.drafts(num_drafts))

    def valid(self) -> bool:
        return self.fault is None

    def refused(self, num_drafts: int) -> bool:
        """Whether a propose asked for ``num_drafts`` refuses this argument among its checks
        (DESIGN.md §10): no matcher at all (a class, an object missing a method) always; a matcher
        of another vocabulary when the propose asks it for step 1's mask, before any write: it
        drafts (``num_drafts >= 1``) and the matcher is not terminated at its start."""
        if self.fault == "other_vocab":
            terminated_at_start = self.depth is not None and self.start >= self.depth and self.end == "terminated"
            return num_drafts >= 1 and not terminated_at_start
        return self.fault is not None

    def matcher(self, vocab_size: int) -> Any:
        """The argument as a call receives it: a fresh ``AutomatonMatcher`` (or the broken object)."""
        if self.fault == "class":
            return AutomatonMatcher
        if self.fault == "other_vocab":
            return AutomatonMatcher(self, vocab_size + 32)
        if self.fault == "no_rollback":
            return NoRollback(self, vocab_size)
        if self.fault == "not_callable":
            return NotCallable(self, vocab_size)
        return AutomatonMatcher(self, vocab_size)

    def __str__(self) -> str:
        shape = "unbounded" if self.depth is None else f"depth={self.depth}:{self.end}"
        parts = [f"seed={self.seed}", shape, f"start={self.start}"]
        parts += [f"liar={self.liar}"] if self.liar is not None else []
        parts += [self.fault] if self.fault else []
        return f"Grammar[{', '.join(parts)}]"


def _mask(rng: random.Random, vocab: int) -> list[int]:
    """A state's allowed tokens, in one of the shapes a real grammar gives."""
    kind = rng.choice(("one", "one", "few", "few", "half", "most", "all"))
    if kind == "one":
        return [rng.randrange(vocab)]
    if kind == "few":
        return sorted(rng.sample(range(vocab), rng.randint(2, min(5, vocab))))
    if kind == "half":
        return [t for t in range(vocab) if rng.random() < 0.5] or [rng.randrange(vocab)]
    if kind == "most":
        gone = set(rng.sample(range(vocab), min(vocab - 1, rng.randint(1, 4))))
        return [t for t in range(vocab) if t not in gone]
    return list(range(vocab))


def _words(tokens: list[int], vocab: int) -> Tensor:
    """The bitmask row of ``tokens``: bit ``t % 32`` of word ``t // 32``, plus every bit past
    ``vocab`` in the last word (a drafter must never read them), as int32."""
    n = -(-vocab // 32)
    words = [0] * n
    for t in tokens:
        words[t // 32] |= 1 << (t % 32)
    if tokens and vocab % 32:
        words[-1] |= ((1 << 32) - 1) ^ ((1 << (vocab % 32)) - 1)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


class Automaton:
    """A ``Grammar``'s states, built on first visit: state ``(depth, index)``, ``index < WIDTH``."""

    def __init__(self, grammar: Grammar, vocab_size: int) -> None:
        self.grammar, self.vocab = grammar, vocab_size
        self._masks: dict[tuple[int, int], tuple[list[int], Tensor]] = {}

    def ends(self, state: tuple[int, int]) -> bool:
        return self.grammar.depth is not None and state[0] >= self.grammar.depth

    def allowed(self, state: tuple[int, int]) -> tuple[list[int], Tensor]:
        """The state's tokens and bitmask row (an empty row at an ``empty`` end)."""
        if state not in self._masks:
            rng = random.Random(f"{self.grammar.seed}:{state[0]}:{state[1]}")
            tokens = [] if self.ends(state) and self.grammar.end == "empty" else _mask(rng, self.vocab)
            self._masks[state] = (tokens, _words(tokens, self.vocab))
        return self._masks[state]

    def next(self, state: tuple[int, int], token: int) -> tuple[int, int]:
        """The state after ``token``: one deeper, an index that depends on the token (an end
        state stays where it is)."""
        if self.ends(state):
            return state
        return state[0] + 1, (token * 7 + state[1] * 3 + self.grammar.seed) % WIDTH

    def root(self) -> tuple[int, int]:
        return self.grammar.start, self.grammar.seed % WIDTH


class AutomatonMatcher:
    """A matcher walking a ``Grammar``'s automaton, with xgrammar's ``GrammarMatcher`` methods.

    ``walked`` holds the states it left, so ``rollback(n)`` returns exactly; rolling back more
    tokens than it accepted is an ``AssertionError`` (the drafter's bug). ``as_found`` is True
    when it stands where it started with nothing accepted."""

    def __init__(self, grammar: Grammar, vocab_size: int) -> None:
        self.grammar = grammar
        self.automaton = Automaton(grammar, vocab_size)
        self.state = self.automaton.root()
        self.walked: list[tuple[int, int]] = []
        self.vocab = vocab_size

    def is_terminated(self) -> bool:
        return self.automaton.ends(self.state) and self.grammar.end == "terminated"

    def fill_next_token_bitmask(self, bitmask: Tensor, index: int = 0) -> bool:
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu", "the bitmask is CPU int32"
        row = self.automaton.allowed(self.state)[1]
        if bitmask.shape[-1] != row.shape[0]:  # xgrammar's check, a RuntimeError too
            raise RuntimeError(f"the provided bitmask's shape is not valid: rows of {row.shape[0]} words for "
                               f"V={self.vocab}, got {bitmask.shape[-1]}")
        bitmask[index] = row
        return True

    def accept_token(self, token: int) -> bool:
        if token not in self.automaton.allowed(self.state)[0]:
            return False
        if self.grammar.liar is not None and self.state[0] == self.grammar.liar:
            return False  # breaks its contract: refuses a token its mask allowed
        self.walked.append(self.state)
        self.state = self.automaton.next(self.state, token)
        return True

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= len(self.walked), f"rollback({num_tokens}) after {len(self.walked)} accepted tokens"
        for _ in range(num_tokens):
            self.state = self.walked.pop()

    def as_found(self) -> bool:
        return not self.walked and self.state == self.automaton.root()

    def where(self) -> str:
        """Where it stands, for reports: the state and the tokens accepted since it was made."""
        return f"state {self.state} after {len(self.walked)} accepted token(s)"


def is_matcher(value: Any) -> bool:
    """Whether ``value`` is one of this module's matchers (an instance, so ``as_found`` answers)."""
    return isinstance(value, AutomatonMatcher)


class MatcherFailure(Exception):
    """What a ``Breaks`` matcher raises: its own code failing (not a refusal of the drafter's)."""


class Breaks(AutomatonMatcher):
    """A matcher whose own code fails: its ``at``-th call of ``fill_next_token_bitmask`` or
    ``accept_token`` (counted together, from 1) raises ``MatcherFailure`` and changes nothing.
    A propose asks step 1's mask among its checks, so ``at = 1`` is a refusal before any write;
    a later call comes after the propose wrote rows, so the propose fails midway (the state is
    poisoned, DESIGN.md §4). ``rollback`` and ``is_terminated`` never fail."""

    def __init__(self, grammar: Grammar, vocab_size: int, at: int) -> None:
        super().__init__(grammar, vocab_size)
        self.at, self.calls = at, 0

    def _count(self, method: str) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise MatcherFailure(f"the grammar's process died in {method} (call {self.calls})")

    def fill_next_token_bitmask(self, bitmask: Tensor, index: int = 0) -> bool:
        self._count("fill_next_token_bitmask")
        return super().fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token: int) -> bool:
        self._count("accept_token")
        return super().accept_token(token)


class NoRollback(AutomatonMatcher):
    """Not a matcher: it has no ``rollback``."""

    def __getattribute__(self, name: str) -> Any:
        if name == "rollback":
            raise AttributeError(name)
        return super().__getattribute__(name)


class NotCallable(AutomatonMatcher):
    """Not a matcher: its ``accept_token`` is a value, not a method."""

    accept_token = None  # type: ignore[assignment]  # deliberately not a method: the broken matcher under test
