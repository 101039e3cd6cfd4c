"""The target's verification under a grammar (DESIGN.md §10, "Verification"): what the loop does
with a matcher.

A matcher is any object with xgrammar's ``GrammarMatcher`` methods ``fill_next_token_bitmask(bitmask,
index=0)``, ``accept_token(token) -> bool``, ``rollback(num_tokens)`` and ``is_terminated()``. Its
bitmask is CPU int32 ``(rows, ceil(V / 32))``: bit ``j % 32`` of word ``j // 32`` set = token j allowed.

- ``verify_masks(matcher, drafts, V)``: row j (j = 0..k) = the tokens allowed at target position
  m + j, the matcher's mask after accepting ``d_1..d_j``. Rows stop at the first draft the grammar
  forbids (``legal`` = the drafts before it): the target never accepts a forbidden draft, so no
  position past it is ever read. The matcher is rolled back to where it was.
- ``masked_greedy_verify``: greedy verification with each position's argmax taken over its row
  only (lowest index among the allowed maxima; a forbidden logit is never compared). The output is
  the target's constrained greedy decode, token for token.
- ``commit_tokens``: the matcher advances on the committed tokens only (accepted drafts and the
  bonus), after the verify.

A position whose row allows nothing (the grammar is complete and the vocabulary has no stop token
it allows) or a terminated matcher ends the output: no bonus token is drawn there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

BITS = 32


def allowed_tokens(bitmask: Tensor, vocab_size: int) -> Tensor:
    """(rows, ceil(V / 32)) int32 bitmask -> (rows, V) bool: token j allowed where bit ``j % 32``
    of word ``j // 32`` is set. Bits past ``vocab_size`` are dropped."""
    shifts = torch.arange(BITS, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (rows, W, 32); >> of int32 is arithmetic, & 1 keeps one bit
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def matcher_row(matcher: Any, vocab_size: int) -> Tensor:
    """(V,) bool: the tokens the matcher allows next; none when it is terminated."""
    if matcher.is_terminated():
        return torch.zeros(vocab_size, dtype=torch.bool)
    bitmask = torch.zeros(1, (vocab_size + BITS - 1) // BITS, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return allowed_tokens(bitmask, vocab_size)[0]


def verify_masks(matcher: Any, drafts: list[int], vocab_size: int) -> tuple[Tensor, int]:
    """The masks of positions 0..legal of a verify of ``[t_m, d_1..d_n]`` and ``legal``, the drafts
    the grammar allows in a row from the first (``n - legal`` of them it forbids: the first
    forbidden one and every draft after it, none of which the target can accept).

    Returns ``(allowed, legal)``: ``allowed`` (legal + 1, V) bool, row j after ``d_1..d_j``. The
    matcher is left as found. ``ValueError`` when the matcher refuses a draft its own mask allowed.
    """
    rows: list[Tensor] = []
    accepted = 0
    try:
        for j in range(len(drafts) + 1):
            rows.append(matcher_row(matcher, vocab_size))
            if j == len(drafts) or not (0 <= drafts[j] < vocab_size) or not bool(rows[j][drafts[j]]):
                break
            if not matcher.accept_token(drafts[j]):
                raise ValueError(f"the matcher refused draft {j + 1} (token {drafts[j]}) that its own mask allowed")
            accepted += 1
    finally:
        if accepted:
            matcher.rollback(accepted)
    return torch.stack(rows), len(rows) - 1


def masked_argmax(logits: Tensor, allowed: Tensor) -> int | None:
    """The lowest index of the largest of ``logits`` (V,) over ``allowed`` (V,) bool, comparing
    allowed logits only; None when nothing is allowed."""
    idx = torch.nonzero(allowed[: logits.shape[-1]]).flatten()
    if idx.numel() == 0:
        return None
    return int(idx[torch.argmax(logits[idx])])  # argmax: first of equal maxima, and idx ascends


def masked_greedy_verify(logits: Tensor, drafts: list[int], allowed: Tensor) -> tuple[int, int | None]:
    """Greedy verification of ``drafts`` against ``logits`` (n+1, V) with ``allowed`` (legal+1, V)
    from ``verify_masks``: accept while the draft is the position's masked argmax. Returns (drafts
    accepted, bonus token), the bonus None when that position allows nothing."""
    a = 0
    while True:
        best = masked_argmax(logits[a], allowed[a])
        if best is None or a == len(drafts) or drafts[a] != best:
            return a, best
        a += 1


def masked_target_probs(logits: Tensor, temperature: float, allowed: Tensor) -> Tensor:
    """``softmax(logits / T)`` over each row's allowed tokens (forbidden ones exactly 0), float64;
    ``logits`` (R, V), ``allowed`` (R, V) bool with at least one token allowed per row."""
    x = logits.double() / temperature
    return torch.softmax(x.masked_fill(~allowed[:, : x.shape[-1]], float("-inf")), dim=-1)


def commit_tokens(matcher: Any, tokens: list[int]) -> None:
    """Advance the matcher over committed ``tokens``; ``RuntimeError`` when it refuses one (the
    verify only commits tokens its masks allowed, so that is a broken matcher)."""
    for i, t in enumerate(tokens):
        if not matcher.accept_token(t):
            raise RuntimeError(f"the matcher refused committed token {i} ({t}) that its mask allowed")


def output_finished(matcher: Any, bonus: int | None) -> bool:
    """Whether the constrained output is complete: no token was allowed, or the matcher terminated
    (it accepted a stop token)."""
    return bonus is None or matcher.is_terminated()
