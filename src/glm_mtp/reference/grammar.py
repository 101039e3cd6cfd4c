"""Grammar-constrained drafts (DESIGN.md §10): the matcher a propose is given, the bitmask it
fills, and one propose's walk over it.

A matcher is any object with xgrammar's ``GrammarMatcher`` methods (``MATCHER_METHODS``), so an
xgrammar matcher passes as it is; nothing here imports xgrammar. The bitmask is a CPU int32
tensor ``(rows, ceil(V / 32))``: bit ``j % 32`` of word ``j // 32`` set means token j is allowed;
the bits past V are never read.

One propose walks the matcher (``GrammarWalk``): before step i it asks whether the matcher is
terminated and for ``A_i``, its mask after ``d_1 .. d_{i-1}``; it accepts ``d_i`` only to find
``A_{i+1}``; and it rolls back every token it accepted before the propose returns or raises
(``walking``). Step 1's question is asked with the propose's checks, before anything is written
(``ask_first_step``): a matcher that cannot answer it (one of another vocabulary, whose fill
refuses a bitmask of this drafter's width) is refused there, with the state and the matcher as
found; a matcher that raises later, once rows are written, fails the propose midway (the state
is poisoned, DESIGN.md §4).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from .contract_guards import RefusedMidway

# The four methods of xgrammar's GrammarMatcher a drafter calls.
MATCHER_METHODS = ("fill_next_token_bitmask", "accept_token", "rollback", "is_terminated")


def bitmask_words(vocab_size: int) -> int:
    """The int32 words of one bitmask row: ``ceil(vocab_size / 32)``."""
    return -(-vocab_size // 32)


def new_bitmask(vocab_size: int, rows: int = 1) -> Tensor:
    """A zeroed bitmask ``(rows, ceil(V / 32))`` int32 on the CPU (every token forbidden)."""
    return torch.zeros(rows, bitmask_words(vocab_size), dtype=torch.int32)


def allowed_tokens(bitmask_row: Tensor, vocab_size: int) -> Tensor:
    """The tokens one bitmask row allows: (V,) bool, ``True`` at j where bit ``j % 32`` of word
    ``j // 32`` is set. Only the first V bits are read (tokens at or past V are never allowed)."""
    j = torch.arange(vocab_size, device=bitmask_row.device)  # (V,)
    return ((bitmask_row[j // 32] >> (j % 32)) & 1).bool()


def missing_method(matcher: object) -> str | None:
    """The first of ``MATCHER_METHODS`` that ``matcher`` lacks (or holds as a non-callable), else None."""
    for method in MATCHER_METHODS:
        if not callable(getattr(matcher, method, None)):
            return method
    return None


@dataclass(frozen=True)
class FirstStep:
    """The matcher's answer for draft step 1, asked before the propose writes anything
    (``ask_first_step``). ``bitmask``: the (1, ceil(V / 32)) int32 CPU bitmask the matcher filled,
    or None when the matcher was terminated (the propose stops before step 1)."""

    bitmask: Tensor | None


def ask_first_step(name: str, matcher: object, vocab_size: int) -> FirstStep:
    """Draft step 1's question (is the matcher terminated; else its mask, into a fresh bitmask of
    ``ceil(vocab_size / 32)`` words), asked among a propose's checks, before any write, so that a
    matcher that cannot answer it is a refusal, not a failure midway. The answer is step 1's: the
    walk does not ask again (``GrammarWalk``'s ``first``).

    Args:
        name: the argument's name in messages (``grammar``, or ``grammars[b]`` in a batch).
        matcher: the checked matcher (``contract.check_grammar``).
        vocab_size: the drafter's V.

    Raises:
        ValueError: naming ``name``, when the matcher raises an exception here (a matcher of
            another vocabulary: xgrammar refuses a bitmask of another width). Nothing was written
            and no token was accepted, so the state and the matcher are as found."""
    bitmask = new_bitmask(vocab_size)  # (1, ceil(V / 32)) int32, CPU
    try:
        if matcher.is_terminated():  # type: ignore[attr-defined]  # duck-typed matcher (held as object)
            return FirstStep(None)
        matcher.fill_next_token_bitmask(bitmask, 0)  # type: ignore[attr-defined]  # duck-typed matcher (held as object)
    except Exception as e:  # noqa: BLE001  any failure of the matcher's own code is the refusal's cause
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(
            f"{name}: the matcher ({type(matcher).__name__}) failed when asked for draft step 1's mask "
            f"({type(e).__name__}{': ' + why if why else ''}); a matcher must answer is_terminated and fill a CPU "
            f"int32 bitmask of ceil(vocab_size / 32) = {bitmask.shape[1]} words per row for this drafter's "
            f"vocab_size={vocab_size} (one of another vocabulary cannot); refused before any write, the state "
            "and the matcher are left as found") from e
    return FirstStep(bitmask)


class MatcherRefusedToken(RefusedMidway):
    """A matcher refused a token its own mask allowed (it breaks its contract): raised after the
    propose put its rows back and before it rolls the matcher back, so both are as found. It
    leaves the drafter as a plain ``ValueError`` (``refusal_as_value_error``)."""


@contextmanager
def refusal_as_value_error() -> Iterator[None]:
    """A public propose's boundary: a ``MatcherRefusedToken`` leaves it as a plain ``ValueError``,
    the contract's type for every refused argument (the drafter tells the two apart inside only,
    to put rows back instead of poisoning)."""
    try:
        yield
    except MatcherRefusedToken as e:
        raise ValueError(str(e)) from None


class GrammarWalk:
    """One propose's walk over ``matcher``: the allowed set of each draft step, the drafts
    accepted so far (``accepted``) and their rollback.

    Args:
        matcher: the propose's matcher (checked by ``contract.check_grammar``).
        vocab_size: V, the model's vocabulary (the bitmask's width is ``ceil(V / 32)`` words).
        device: where ``allowed`` puts the mask (the state's).
        first: step 1's answer, asked before any write (``ask_first_step``); None: step 1 asks
            the matcher itself.
    """

    def __init__(self, matcher: object, vocab_size: int, device: torch.device,
                 first: FirstStep | None = None) -> None:
        self.matcher, self.vocab_size, self.device = matcher, vocab_size, device
        self.bitmask = new_bitmask(vocab_size)  # (1, ceil(V / 32)) int32, CPU
        self.accepted = 0
        self.first = first

    def allowed(self) -> Tensor | None:
        """``A_i`` as (V,) bool on the device, or None when the propose stops before this step:
        the matcher is terminated, or its mask allows no token (a host read of the CPU mask).
        Step 1 takes the answer asked before any write (``first``) when there is one."""
        if self.first is not None:
            first, self.first = self.first, None
            if first.bitmask is None:  # terminated
                return None
            self.bitmask.copy_(first.bitmask)
        else:
            if self.matcher.is_terminated():  # type: ignore[attr-defined]  # the matcher is duck-typed (its four methods, DESIGN.md §10), held as object
                return None
            self.bitmask.zero_()
            self.matcher.fill_next_token_bitmask(self.bitmask, 0)  # type: ignore[attr-defined]  # duck-typed matcher (held as object)
        allowed = allowed_tokens(self.bitmask[0], self.vocab_size)  # (V,) bool, CPU
        if not bool(allowed.any()):
            return None
        return allowed.to(self.device)

    def accept(self, token: int, step: int) -> None:
        """Advance the matcher by draft ``step``'s ``token`` (1-based), which its mask allowed;
        ``MatcherRefusedToken`` (a ``ValueError``) when it refuses."""
        if not self.matcher.accept_token(token):  # type: ignore[attr-defined]  # duck-typed matcher (held as object)
            raise MatcherRefusedToken(
                f"grammar: the matcher ({type(self.matcher).__name__}) refused draft step {step}'s token {token}, "
                f"which its own mask allowed at that step: a matcher must accept every token its bitmask allows; the "
                "state and the matcher are left as found")
        self.accepted += 1

    def rollback(self) -> None:
        """Undo every token this walk accepted (the matcher as the propose found it)."""
        if self.accepted:
            self.matcher.rollback(self.accepted)  # type: ignore[attr-defined]  # duck-typed matcher (held as object)
            self.accepted = 0


@contextmanager
def walking(matcher: object | None, vocab_size: int, device: torch.device,
            first: FirstStep | None = None) -> Iterator[GrammarWalk | None]:
    """A ``GrammarWalk`` over ``matcher`` for one propose (None without a grammar), its step 1
    answered by ``first`` when given, rolled back when the block ends, whether it returns or raises."""
    if matcher is None:
        yield None
        return
    walk = GrammarWalk(matcher, vocab_size, device, first)
    try:
        yield walk
    finally:
        walk.rollback()


__all__ = ["MATCHER_METHODS", "FirstStep", "GrammarWalk", "MatcherRefusedToken", "allowed_tokens", "ask_first_step",
           "bitmask_words", "missing_method", "new_bitmask", "refusal_as_value_error", "walking"]
