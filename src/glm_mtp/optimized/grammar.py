"""Grammar-constrained drafts (DESIGN.md §10) in the optimized drafter: the host's walk of the
matcher over drafts read back from the device, and the masked pieces a device program runs.

The greedy propose drafts unmasked in its captured program and reads the drafts back once, as
without a grammar; the host then walks the matcher: before draft i it stops if the matcher is
terminated or the step's allowed set ``A_i`` is empty, else it checks ``d_i`` against ``A_i`` (an
unmasked argmax that ``A_i`` allows is the masked draft, lowest index in both) and accepts it.
Only a forbidden ``d_i`` costs a redo: a program that takes step i's masked argmax from the
logits the head stored and runs steps i+1.. again, then one more read-back (``walk_greedy``'s
``redo``). A sampled draft's ``q`` is renormalised over ``A_i``, so a sampled propose under a
grammar draws each step from its own masked ``q`` (the reference's ``layers.draft_probs`` and
``sampled_token`` with the step's allowed tokens), one step per program.

The matcher is any object with xgrammar's ``GrammarMatcher`` methods; this module imports
nothing of xgrammar. Draft step 1's question was asked among the propose's checks, before the
program wrote anything (``reference.grammar.ask_first_step``); the walk takes that answer
(``first_row``) and asks the matcher only from step 2 on, so a matcher that raises here fails a
propose that has written rows: its caller runs the walk inside ``writing``, which poisons the
state as the reference's does (DESIGN.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from glm_mtp.reference.contract import Matcher
from glm_mtp.reference.grammar import FirstStep, MatcherRefusedToken

from .kernels.confidence import MASK_BITS, mask_words


def host_masks(rows: int, vocab_size: int) -> Tensor:
    """A zeroed host bitmask ``(rows, ceil(V / 32))`` int32 over numpy memory: the walk reads
    and edits it through ``numpy()`` (host work: no torch operator, nothing a GPU would launch)."""
    return torch.from_numpy(np.zeros((rows, mask_words(vocab_size)), dtype=np.int32))


def fill_row(matcher: Matcher, masks: Tensor, i: int, vocab_size: int) -> bool:
    """Row ``i`` of the host bitmask ``masks`` (``host_masks``), zeroed first: the matcher's
    allowed tokens, bits at or past ``vocab_size`` cleared (never allowed). Returns whether any
    token is allowed."""
    words = masks.numpy()
    words[i] = 0
    matcher.fill_next_token_bitmask(masks, i)
    return _within_vocab(words, i, vocab_size)


def first_row(first: FirstStep, masks: Tensor, vocab_size: int) -> bool:
    """Row 0 of the host bitmask ``masks`` from step 1's answer, asked before any write
    (``FirstStep``), bits at or past ``vocab_size`` cleared. Returns whether any token is allowed
    (False when the matcher was terminated: the walk stops before step 1)."""
    words = masks.numpy()
    if first.bitmask is None:
        return False
    words[0] = first.bitmask.numpy()[0]
    return _within_vocab(words, 0, vocab_size)


def _within_vocab(words: np.ndarray, i: int, vocab_size: int) -> bool:
    """Clear row ``i``'s bits at or past ``vocab_size`` (never allowed); whether any bit is left."""
    tail = vocab_size % MASK_BITS
    if tail:  # bits past V in the last word
        words[i, -1] &= np.int32((1 << tail) - 1)
    return bool(words[i].any())


def allows(masks: Tensor, i: int, token: int) -> bool:
    """Whether row ``i`` of ``masks`` allows ``token`` (bit ``token % 32`` of word ``token // 32``)."""
    word = int(masks.numpy()[i, token // MASK_BITS])
    return (word >> (token % MASK_BITS)) & 1 == 1


def refused(matcher: Matcher, step: int, token: int) -> MatcherRefusedToken:
    """The refusal of a matcher that rejected draft ``step``'s ``token`` (1-based), which its own
    mask allowed: ``reference.grammar.GrammarWalk.accept``'s error, word for word."""
    return MatcherRefusedToken(
        f"grammar: the matcher ({type(matcher).__name__}) refused draft step {step}'s token {token}, "
        f"which its own mask allowed at that step: a matcher must accept every token its bitmask allows; the "
        "state and the matcher are left as found")


@dataclass
class Walk:
    """A walk's outcome: ``drafts`` (the propose's drafts, ``n`` of them), ``masks`` (n, words)
    int32 on the host (step i's allowed set in row i) and ``redos`` (the redo programs it ran)."""

    drafts: list[int]
    masks: Tensor
    redos: int = 0

    @property
    def n(self) -> int:
        return len(self.drafts)


def walk_greedy(matcher: Matcher, drafts: list[int], vocab_size: int,
                redo: Callable[[int, Tensor], list[int]], first: FirstStep | None = None) -> Walk:
    """Walk ``matcher`` over the unmasked ``drafts`` (k of them, read back from the device), in
    the reference's order (``reference.grammar.GrammarWalk``): before draft i, accept ``d_{i-1}``
    (only to find ``A_i``), then stop when the matcher is terminated or ``A_i`` is empty (the
    walk's drafts are ``d_1 .. d_{i-1}``); a forbidden ``d_i`` calls ``redo(i, masks)`` (0-based
    ``i``), which returns drafts ``i ..`` of the redone steps (the masked ``d_i`` first). A
    refusal of a draft its own mask allowed raises ``MatcherRefusedToken`` naming the draft's
    step. The matcher is rolled back by every token the walk accepted, on return and on raise.
    ``first``: step 1's answer, asked before any write (``ask_first_step``); None: step 1 asks
    the matcher itself."""
    k = len(drafts)
    masks = host_masks(k, vocab_size)
    drafts = list(drafts)
    accepted = redos = 0
    try:
        for i in range(k):
            if i:
                if not matcher.accept_token(drafts[i - 1]):
                    raise refused(matcher, i, drafts[i - 1])
                accepted += 1
            if i == 0 and first is not None:
                stop = not first_row(first, masks, vocab_size)
            else:
                stop = matcher.is_terminated() or not fill_row(matcher, masks, i, vocab_size)
            if stop:
                drafts = drafts[:i]
                break
            if not allows(masks, i, drafts[i]):
                drafts[i:] = redo(i, masks)
                redos += 1
    finally:
        if accepted:
            matcher.rollback(accepted)
    return Walk(drafts, masks[: len(drafts)], redos)


__all__ = ["Walk", "allows", "fill_row", "first_row", "host_masks", "refused", "walk_greedy"]
