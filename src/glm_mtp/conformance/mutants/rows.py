"""Mutants that break what a call does to a state's rows and counters, or what it refuses
(DESIGN.md §3-§4): the first row kept, the rewind to position, after_verify's pending rule,
catch-up's no-op rule, the blocks a state claims, validate before change, the scratch x, the
shape of last_token."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import torch
from torch import Tensor

from glm_mtp.reference import contract as _contract
from glm_mtp.reference import proposer as _proposer
from glm_mtp.reference.block import mtp_rows
from glm_mtp.reference.contract import check_int
from glm_mtp.reference.state import BLOCK_ROWS, DrafterState

from .base import Mutant, SwappingMutant, swapped


class TrimFirstRow(Mutant):
    name = "trim_first_row"
    rule = "after_verify keeps min(last_drafted, num_accepted + 1) rows: the first row of a propose is never trimmed"

    def after_verify(self, num_accepted: int, state: DrafterState) -> None:
        if state.released:
            raise RuntimeError("after_verify: the state was freed (free_state); allocate a new one")
        if not state.pending:
            raise RuntimeError("after_verify: no propose is pending")
        num_accepted = check_int("num_accepted", num_accepted)
        if num_accepted > state.last_drafted:
            raise ValueError(f"num_accepted must be in [0, {state.last_drafted}], got {num_accepted}")
        keep = min(state.last_drafted, num_accepted)  # MUTATION: was num_accepted + 1
        state.seq_len -= state.last_drafted - keep
        state.pending = False
        state.last_drafted = 0


class NoRewindWhenAhead(Mutant):
    name = "no_rewind_when_ahead"
    rule = "propose first rewinds a drafter that is ahead of position to position"

    def _draft(self, args, state, call, sample=None):
        before = state.seq_len
        with swapped(_proposer, "rewind_rows", lambda st, n: None):  # MUTATION: no rewind to position ...
            out = super()._draft(args, state, call, sample)
        state.seq_len = max(before, state.seq_len)  # MUTATION: ... and rows only ever grow
        return out


def _reshape_any_token(last_token):
    # MUTATION: the shape check dropped: any one-element tensor passes, a longer one hits reshape.
    return last_token.reshape(1) if isinstance(last_token, torch.Tensor) else last_token


class LastTokenShapeUnchecked(SwappingMutant):
    name = "last_token_shape_unchecked"
    rule = "a last_token tensor must be 0-d or (1,): others are a ValueError naming last_token"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_contract, "one_token", _reshape_any_token)]


class SecondVerify(Mutant):
    name = "second_verify"
    rule = "after_verify with no propose pending raises RuntimeError (the engine's drafter would trim again)"

    def after_verify(self, num_accepted: int, state: DrafterState) -> None:
        if not state.released and not state.pending:
            # MUTATION: the engine drafter's behaviour: trim again with the previous propose's count.
            ld = getattr(state, "_mutant_last", 0)
            keep = min(ld, check_int("num_accepted", num_accepted) + 1)
            state.seq_len = max(0, state.seq_len - (ld - keep))
            return
        ld = state.last_drafted
        super().after_verify(num_accepted, state)
        state._mutant_last = ld  # type: ignore[attr-defined]  # the mutant's own mark on the state, not a field of it


class MisalignedCatchup(Mutant):
    name = "misaligned_catchup"
    rule = "a catch-up whose row_base != drafter_rows writes nothing and returns 0"

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state):
        _contract.check_live(state, "catchup_drafter")
        ids = _contract.token_ids("tokens", tokens, self.config.vocab_size, state.device)
        row_base = check_int("row_base", row_base)
        check_int("pos_base", pos_base)
        _contract.check_hiddens("hiddens", hiddens, ids.shape[0], self.weights, state.device)
        _contract.check_capacity("catchup_drafter", row_base + ids.shape[0], self.capacity)
        if ids.shape[0] == 0:  # MUTATION: was `row_base != state.seq_len or ...`
            return 0
        self._write_rows(ids, hiddens, row_base, state)
        return ids.shape[0]


class BlockTableOffByOne(Mutant):
    name = "block_table_off_by_one"
    rule = "a state claims max_seq_len // 16 + 2 blocks"

    def __init__(self, weights, max_seq_len, feed_hidden="post_norm"):
        super().__init__(weights, max_seq_len, feed_hidden)
        self.blocks = self.max_seq_len // BLOCK_ROWS + 1  # MUTATION: was + 2
        self.capacity = BLOCK_ROWS * self.blocks


class RewindBeforeValidate(Mutant):
    name = "rewind_before_validate"
    rule = "a refused call leaves the state byte-identical (propose validates before it rewinds)"

    def propose(self, last_token, target_hidden, position, num_drafts, state, grammar=None):
        _contract.check_live(state, "propose")
        if isinstance(position, int) and not isinstance(position, bool) and 0 <= position <= state.seq_len:
            state.seq_len = position  # MUTATION: rewinds before the arguments are checked
        return super().propose(last_token, target_hidden, position, num_drafts, state, grammar=grammar)


class CatchupWritesX(Mutant):
    name = "catchup_writes_x"
    rule = "prefill, catch-up, rewind and trim leave the scratch x as it is; only propose writes it"

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state):
        self._in_catchup = True
        try:
            return super().catchup_drafter(tokens, hiddens, row_base, pos_base, state)
        finally:
            self._in_catchup = False

    def _write_rows(self, tokens: Tensor, hiddens: Tensor, row_base: int, state: DrafterState) -> None:
        slots = torch.arange(row_base, row_base + tokens.shape[0], device=state.device)
        out = mtp_rows(self.weights, tokens, hiddens, slots, state.cache, self.rope(state.device))
        state.seq_len = row_base + tokens.shape[0]
        if getattr(self, "_in_catchup", False):
            state.x = out.x[-1].clone()  # MUTATION


# This module's mutants, in the registry (``mutants.MUTANTS``) through ``mutants.GROUPS``.
MUTANTS: tuple[type[Mutant], ...] = (
    TrimFirstRow, NoRewindWhenAhead, LastTokenShapeUnchecked, SecondVerify, MisalignedCatchup, BlockTableOffByOne,
    RewindBeforeValidate, CatchupWritesX,
)
