"""Mutants that break what a row computes (DESIGN.md §2-§5): its RoPE position, the (token,
hidden) pair it holds, the rows the indexer and attention may read, the feed of the next draft,
the indexer's tie order, the pinned sums."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch
from torch import Tensor

from glm_mtp.reference import attention as _attention
from glm_mtp.reference import block as _block
from glm_mtp.reference import contract as _contract
from glm_mtp.reference import indexer as _indexer
from glm_mtp.reference import numerics as _numerics
from glm_mtp.reference import proposer as _proposer
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.state import DrafterState

from .base import Mutant, SwappingMutant


@dataclass
class _ShiftedRope(Rope):
    shift: int = 0

    def at(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        pos = (slots + self.shift) % self.cos.shape[0]
        return self.cos[pos], self.sin[pos]


class PosBaseRope(Mutant):
    name = "pos_base_rope"
    rule = "a row's RoPE position is its slot; catch-up's pos_base is ignored"

    _shift = 0

    def rope(self, device: torch.device) -> Rope:
        r = super().rope(device)
        return _ShiftedRope(r.cos, r.sin, self._shift) if self._shift else r

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state):
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (row_base, pos_base))
        self._shift = pos_base - row_base if ints else 0  # MUTATION: rotate at pos_base + i
        try:
            return super().catchup_drafter(tokens, hiddens, row_base, pos_base, state)
        finally:
            self._shift = 0


class PairShift(Mutant):
    name = "pair_shift"
    rule = "row r pairs token t_{r+1} with hidden h_r (prefill uses hiddens[:-1])"

    def prefill_drafter(self, prompt_tokens, hiddens, state):
        _contract.check_live(state, "prefill_drafter")
        tokens = _contract.token_ids("prompt_tokens", prompt_tokens, self.config.vocab_size, state.device)
        n = tokens.shape[0]
        if n > self.max_seq_len:
            raise ValueError(f"prompt_tokens: a prompt of {n} tokens is longer than max_seq_len={self.max_seq_len}")
        _contract.check_hiddens("hiddens", hiddens, n, self.weights, state.device)
        if state.seq_len > 0 or n < 2:
            return 0
        self._write_rows(tokens[1:], hiddens[1:], 0, state)  # MUTATION: was hiddens[:-1]
        return n - 1


class StaleIndexerView(SwappingMutant):
    name = "stale_indexer_view"
    rule = "a rewind makes rows >= seq_len unreachable: the indexer and attention never read them"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        seen = getattr(state, "_mutant_high_water", 0)

        def select_rows(scores: Tensor, slots: Tensor, topk: int) -> tuple[Tensor, Tensor]:
            # MUTATION: rows up to the most ever held stay visible after a rewind.
            S = scores.shape[-1]
            col = torch.arange(S, device=scores.device)[None, :]
            visible = (col <= slots[:, None]) | (col < seen)
            K = min(topk, S)
            count = visible.long().sum(-1).clamp(max=K)
            best = _indexer.topk_indices(scores.masked_fill(~visible, float("-inf")), K)
            listed = torch.arange(K, device=scores.device)[None, :] < count[:, None]
            rows = torch.where(listed, best, S).sort(dim=-1).values
            return torch.where(listed, rows, 0), count

        def mtp_rows(*args: Any, rows_read: int | None = None, **kwargs: Any) -> Any:
            # MUTATION: the block reads the whole capacity, not just the rows held.
            return _block.mtp_rows(*args, **kwargs)

        return [(_attention, "select_rows", select_rows), (_proposer, "mtp_rows", mtp_rows)]

    def _track(self, state: DrafterState, result: Any) -> Any:
        if not state.released:
            state._mutant_high_water = max(getattr(state, "_mutant_high_water", 0), state.seq_len)  # type: ignore[attr-defined]  # the mutant's own mark on the state, not a field of it
        return result

    def prefill_drafter(self, prompt_tokens, hiddens, state):
        return self._track(state, super().prefill_drafter(prompt_tokens, hiddens, state))

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state):
        return self._track(state, super().catchup_drafter(tokens, hiddens, row_base, pos_base, state))

    def propose(self, last_token, target_hidden, position, num_drafts, state, grammar=None):
        before = state.seq_len
        out = super().propose(last_token, target_hidden, position, num_drafts, state, grammar=grammar)
        state._mutant_high_water = max(getattr(state, "_mutant_high_water", 0), before, state.seq_len)
        return out


class PreNormFeed(Mutant):
    name = "pre_norm_feed"
    rule = "draft i > 1 is fed the post-norm x of draft i - 1, not the pre-norm block output"

    def __init__(self, weights, max_seq_len, feed_hidden="post_norm"):
        super().__init__(weights, max_seq_len, feed_hidden="pre_norm")  # MUTATION


def topk_ties_high(scores: Tensor, k: int) -> Tensor:
    # MUTATION: equal scores go to the higher index (sort the reversed row, map indices back).
    C = scores.shape[-1]
    return (C - 1) - torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]


class TopkTiesHigh(SwappingMutant):
    name = "topk_ties_high"
    rule = "the indexer's top-k breaks ties toward the lower row"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_indexer, "topk_indices", topk_ties_high)]


def _library_sum(x: Tensor) -> Tensor:
    # MUTATION: torch's own reduction, in whatever order it chooses (same math, other rounding).
    return x.sum(-1)


class LibrarySums(SwappingMutant):
    name = "library_sums"
    rule = "every sum of the drafter is the pinned psum (DESIGN.md §5), never a library reduction"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_numerics, "psum", _library_sum)]


# This module's mutants, in the registry (``mutants.MUTANTS``) through ``mutants.GROUPS``.
MUTANTS: tuple[type[Mutant], ...] = (
    PosBaseRope, PairShift, StaleIndexerView, PreNormFeed, TopkTiesHigh, LibrarySums,
)
