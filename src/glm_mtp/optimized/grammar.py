"""Grammar-constrained drafts (DESIGN.md §10) in the optimized drafter: the host's walk of the
matcher over drafts read back from the device, and the masked pieces a device program runs.

The greedy propose drafts unmasked in its captured program and reads the drafts back once, as
without a grammar; the host then walks the matcher: before draft i it stops if the matcher is
terminated or the step's allowed set ``A_i`` is empty, else it checks ``d_i`` against ``A_i`` (an
unmasked argmax that ``A_i`` allows is the masked draft, lowest index in both) and accepts it.
Only a forbidden ``d_i`` costs a redo: a program that takes step i's masked argmax from the
logits the head stored and runs steps i+1.. again, then one more read-back (``walk_greedy``'s
``redo``). A sampled draft's ``q`` is renormalised over ``A_i``, so a sampled propose under a
grammar draws each step from its own masked ``q`` (``masked_draft_probs``), one step per program.

The matcher is any object with xgrammar's ``GrammarMatcher`` methods; this module imports
nothing of xgrammar.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from glm_mtp.reference import numerics

from .kernels.confidence import MASK_BITS, allowed_tokens, mask_words


class Matcher(Protocol):
    """xgrammar's ``GrammarMatcher`` methods a propose calls."""

    def fill_next_token_bitmask(self, bitmask: Tensor, index: int = 0) -> Any: ...

    def accept_token(self, token: int) -> bool: ...

    def rollback(self, num_tokens: int) -> Any: ...

    def is_terminated(self) -> bool: ...


MATCHER_METHODS = ("fill_next_token_bitmask", "accept_token", "rollback", "is_terminated")


def check_matcher(call: str, arg: str, grammar: object) -> None:
    """``ValueError`` naming ``arg`` unless ``grammar`` is None or has the four matcher methods."""
    if grammar is None:
        return
    missing = [m for m in MATCHER_METHODS if not callable(getattr(grammar, m, None))]
    if missing:
        raise ValueError(f"{call}: {arg} must be None or a grammar matcher with {', '.join(MATCHER_METHODS)} "
                         f"(xgrammar's GrammarMatcher methods); {type(grammar).__name__} lacks {', '.join(missing)}")


def fill_row(matcher: Matcher, masks: Tensor, i: int, vocab_size: int) -> bool:
    """Row ``i`` of the host bitmask ``masks`` (k, ceil(V / 32)) int32: the matcher's allowed
    tokens, bits at or past ``vocab_size`` cleared (never allowed). Returns whether any token
    is allowed."""
    matcher.fill_next_token_bitmask(masks, i)
    row = masks[i]
    tail = vocab_size % MASK_BITS
    if tail:  # bits past V in the last word
        keep = torch.tensor((1 << tail) - 1, dtype=torch.int64).to(torch.int32)
        row[-1] = row[-1] & keep
    return bool((row != 0).any())


def allows(masks: Tensor, i: int, token: int) -> bool:
    """Whether row ``i`` of ``masks`` allows ``token`` (bit ``token % 32`` of word ``token // 32``)."""
    word = int(masks[i, token // MASK_BITS])
    return (word >> (token % MASK_BITS)) & 1 == 1


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
                redo: Callable[[int, Tensor], list[int]], describe: Callable[[], str]) -> Walk:
    """Walk ``matcher`` over the unmasked ``drafts`` (k of them, read back from the device).

    Before draft i: stop when the matcher is terminated or ``A_i`` is empty (the walk's drafts
    are then ``d_1 .. d_{i-1}``); a forbidden ``d_i`` calls ``redo(i, masks)`` (0-based ``i``),
    which returns the drafts ``i ..`` of the redone steps (the masked ``d_i`` first). Every draft
    kept is accepted by the matcher; a refusal of a draft its own mask allowed is a
    ``ValueError`` naming the draft step (1-based) and ``describe()``'s words. The matcher is
    rolled back by every token the walk accepted, on return and on raise."""
    k = len(drafts)
    masks = torch.zeros(k, mask_words(vocab_size), dtype=torch.int32)
    drafts = list(drafts)
    accepted = redos = 0
    try:
        for i in range(k):
            if matcher.is_terminated() or not fill_row(matcher, masks, i, vocab_size):
                drafts = drafts[:i]
                break
            if not allows(masks, i, drafts[i]):
                drafts[i:] = redo(i, masks)
                redos += 1
            if not matcher.accept_token(drafts[i]):
                raise ValueError(f"grammar: the matcher refused token {drafts[i]} at draft step {i + 1}, which its own "
                                 f"bitmask allowed (a matcher must accept every token its mask allows); "
                                 f"{describe()}")
            accepted += 1
    finally:
        if accepted:
            matcher.rollback(accepted)
    return Walk(drafts, masks[: len(drafts)], redos)


# ---- the device side: a sampled step under its mask (torch ops in the pinned order) -------------


def masked_draft_probs(logits: Tensor, temperature: Tensor, allowed: Tensor) -> Tensor:
    """``q`` (T, V) in A of a sampled step under a grammar: the pinned softmax of ``up(logits) /
    temperature`` over the full vocabulary with every forbidden term exactly ``+0.0`` and the
    max over the ``allowed`` (T, V) bool tokens only (DESIGN.md §10; with every token allowed it
    is ``reference.layers.draft_probs``)."""
    s = numerics.up(logits) / temperature
    neg = torch.tensor(float("-inf"), dtype=s.dtype, device=s.device)
    m = torch.where(allowed, s, neg).amax(dim=-1, keepdim=True)
    e = torch.where(allowed, numerics.exp(s - m), torch.zeros((), dtype=s.dtype, device=s.device))
    return e / numerics.psum(e)[..., None]


def masked_token(values: Tensor, allowed: Tensor) -> Tensor:
    """Each row's lowest-index maximum of ``values`` (T, V) over the ``allowed`` (T, V) tokens
    only, NaN ranked as ``torch.argmax`` ranks it (the first allowed NaN wins); a forbidden value
    is never compared. (T,) int64 (a row with none allowed: its first token, never asked for)."""
    nan = allowed & (values != values)
    num = allowed & (values == values)
    m = torch.where(num, values, torch.tensor(float("-inf"), dtype=values.dtype, device=values.device))
    m = m.amax(dim=-1, keepdim=True)
    best = torch.where(nan.any(dim=-1, keepdim=True), nan, num & (values == m))
    return torch.argmax(best.to(torch.int8), dim=-1)


def masked_sampled_token(q: Tensor, noise: Tensor, allowed: Tensor) -> Tensor:
    """A sampled draft under a grammar: the lowest-index argmax of ``q / noise`` over the
    ``allowed`` tokens only (T,) int64."""
    return masked_token(q / noise, allowed)


__all__ = ["Matcher", "Walk", "allowed_tokens", "allows", "check_matcher", "fill_row", "masked_draft_probs",
           "masked_sampled_token", "masked_token", "walk_greedy"]
