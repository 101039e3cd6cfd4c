"""Mutants: reference drafters that each break one rule, to prove the suite can fail.

Each mutant subclasses ``ReferenceProposer`` and breaks exactly one rule of DESIGN.md, by
overriding a method (a copy of the reference's with the one change) or, where the rule lives in
a plain function deep in the block, by swapping that function in for the duration of the
mutant's own calls only (``swapped``): the swap is undone before the call returns. The lockstep
runs its two sides one after the other, so a reference beside a mutant in the same process never
runs while a swap is in place (the lock serialises mutants among themselves; a reference running
in another thread at the same moment is not protected, so do not thread a mutant run).

To add one: subclass ``Mutant`` (or ``SwappingMutant`` and return the swaps from ``swaps``),
set ``name`` and ``rule``, and add the class to ``MUTANTS``. The test in
``tests/conformance/test_mutants.py`` then demands the suite catch it. Add a mutant whenever a
rule is added to the spec.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import Tensor

from glm_mtp.reference import attention as _attention
from glm_mtp.reference import block as _block
from glm_mtp.reference import contract as _contract
from glm_mtp.reference import indexer as _indexer
from glm_mtp.reference import kpool as _kpool
from glm_mtp.reference import numerics as _numerics
from glm_mtp.reference import proposer as _proposer
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.block import draft_logits, mtp_rows
from glm_mtp.reference.layers import greedy_token
from glm_mtp.reference.contract import check_int
from glm_mtp.reference.proposer import ReferenceProposer
from glm_mtp.reference.state import BLOCK_ROWS, DrafterState

from .scenarios import GENERATORS

_SWAP_LOCK = threading.RLock()


@contextmanager
def swapped(module: ModuleType, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``module.name`` is ``replacement`` inside the block and the original again after it."""
    with _SWAP_LOCK:
        original = getattr(module, name)
        setattr(module, name, replacement)
        try:
            yield
        finally:
            setattr(module, name, original)


class Mutant(ReferenceProposer):
    """A reference drafter that breaks one rule.

    Class attributes:
        name: the registry key (``mutant:<name>`` on the command line).
        rule: the rule it breaks, one line.
        generators: the generators whose scenarios reach the rule (the batched calls' mutants
            need ``batched``).
        preset: the config preset whose drafter has the rule (the KPool mutants need a
            glm5_next one).
    """

    name: ClassVar[str]
    rule: ClassVar[str]
    generators: ClassVar[tuple[str, ...]] = GENERATORS
    preset: ClassVar[str] = "tiny"


class SwappingMutant(Mutant):
    """A mutant whose bug is a swapped reference function, active only during its own calls."""

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        raise NotImplementedError

    def _swapped(self, state: DrafterState, call: Callable[[], Any]) -> Any:
        with ExitStack() as stack:
            if isinstance(state, DrafterState) and not state.released:
                for module, name, fn in self.swaps(state):
                    stack.enter_context(swapped(module, name, fn))
            return call()

    def prefill_drafter(self, prompt_tokens, hiddens, state):  # type: ignore[no-untyped-def]
        return self._swapped(state, lambda: super(SwappingMutant, self).prefill_drafter(prompt_tokens, hiddens, state))

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state):  # type: ignore[no-untyped-def]
        return self._swapped(state, lambda: super(SwappingMutant, self).catchup_drafter(tokens, hiddens, row_base, pos_base, state))

    def propose(self, last_token, target_hidden, position, num_drafts, state):  # type: ignore[no-untyped-def]
        return self._swapped(state, lambda: super(SwappingMutant, self).propose(last_token, target_hidden, position, num_drafts, state))


# ------------------------------------------------------------------------------------------------


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

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state):  # type: ignore[no-untyped-def]
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (row_base, pos_base))
        self._shift = pos_base - row_base if ints else 0  # MUTATION: rotate at pos_base + i
        try:
            return super().catchup_drafter(tokens, hiddens, row_base, pos_base, state)
        finally:
            self._shift = 0


class PairShift(Mutant):
    name = "pair_shift"
    rule = "row r pairs token t_{r+1} with hidden h_r (prefill uses hiddens[:-1])"

    def prefill_drafter(self, prompt_tokens, hiddens, state):  # type: ignore[no-untyped-def]
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


class NoRewindWhenAhead(Mutant):
    name = "no_rewind_when_ahead"
    rule = "propose first rewinds a drafter that is ahead of position to position"

    def propose(self, last_token, target_hidden, position, num_drafts, state):  # type: ignore[no-untyped-def]
        _contract.check_live(state, "propose")
        position = check_int("position", position)
        if state.seq_len < position:
            raise RuntimeError(f"propose: the drafter holds {state.seq_len} rows, behind position {position}")
        one = [last_token] if not isinstance(last_token, Tensor) else last_token.reshape(1)
        token = _contract.token_ids("last_token", one, self.config.vocab_size, state.device)
        hidden = target_hidden.reshape(1, -1) if isinstance(target_hidden, Tensor) and target_hidden.dim() == 1 else target_hidden
        _contract.check_hiddens("target_hidden", hidden, 1, self.weights, state.device)
        num_drafts = check_int("num_drafts", num_drafts)
        _contract.check_capacity("propose", position + num_drafts, self.capacity)
        # MUTATION: no `state.seq_len = min(state.seq_len, position)`, and rows only ever grow.
        drafts: list[int] = []
        rope = self.rope(state.device)
        share = _proposer.share_selection(self.config.index_share_for_mtp_iteration)  # DESIGN.md §9, as the reference
        for i in range(num_drafts):
            out = mtp_rows(self.weights, token, hidden, torch.tensor([position + i], device=state.device), state.cache, rope,
                           share=share)
            token = greedy_token(draft_logits(self.weights, out.x))
            drafts.append(int(token[0]))
            state.x = out.x[0].clone()
            hidden = out.x
            state.seq_len = max(state.seq_len, position + i + 1)
        state.pending = True
        state.last_drafted = num_drafts
        return drafts


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
            state._mutant_high_water = max(getattr(state, "_mutant_high_water", 0), state.seq_len)  # type: ignore[attr-defined]
        return result

    def prefill_drafter(self, prompt_tokens, hiddens, state):  # type: ignore[no-untyped-def]
        return self._track(state, super().prefill_drafter(prompt_tokens, hiddens, state))

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state):  # type: ignore[no-untyped-def]
        return self._track(state, super().catchup_drafter(tokens, hiddens, row_base, pos_base, state))

    def propose(self, last_token, target_hidden, position, num_drafts, state):  # type: ignore[no-untyped-def]
        before = state.seq_len
        out = super().propose(last_token, target_hidden, position, num_drafts, state)
        state._mutant_high_water = max(getattr(state, "_mutant_high_water", 0), before, state.seq_len)  # type: ignore[attr-defined]
        return out


class PreNormFeed(Mutant):
    name = "pre_norm_feed"
    rule = "draft i > 1 is fed the post-norm x of draft i - 1, not the pre-norm block output"

    def __init__(self, weights, max_seq_len, feed_hidden="post_norm"):  # type: ignore[no-untyped-def]
        super().__init__(weights, max_seq_len, feed_hidden="pre_norm")  # MUTATION


def _topk_ties_high(scores: Tensor, k: int) -> Tensor:
    # MUTATION: equal scores go to the higher index (sort the reversed row, map indices back).
    C = scores.shape[-1]
    return (C - 1) - torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]


class TopkTiesHigh(SwappingMutant):
    name = "topk_ties_high"
    rule = "the indexer's top-k breaks ties toward the lower row"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_indexer, "topk_indices", _topk_ties_high)]


def _reshape_any_token(last_token):  # type: ignore[no-untyped-def]
    # MUTATION: the shape check dropped: any one-element tensor passes, a longer one hits reshape.
    return last_token.reshape(1) if isinstance(last_token, torch.Tensor) else last_token


class LastTokenShapeUnchecked(SwappingMutant):
    name = "last_token_shape_unchecked"
    rule = "a last_token tensor must be 0-d or (1,): others are a ValueError naming last_token"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_contract, "one_token", _reshape_any_token)]


def _library_sum(x: Tensor) -> Tensor:
    # MUTATION: torch's own reduction, in whatever order it chooses (same math, other rounding).
    return x.sum(-1)


class LibrarySums(SwappingMutant):
    name = "library_sums"
    rule = "every sum of the drafter is the pinned psum (DESIGN.md §5), never a library reduction"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_numerics, "psum", _library_sum)]


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
        state._mutant_last = ld  # type: ignore[attr-defined]


class MisalignedCatchup(Mutant):
    name = "misaligned_catchup"
    rule = "a catch-up whose row_base != drafter_rows writes nothing and returns 0"

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state):  # type: ignore[no-untyped-def]
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

    def __init__(self, weights, max_seq_len, feed_hidden="post_norm"):  # type: ignore[no-untyped-def]
        super().__init__(weights, max_seq_len, feed_hidden)
        self.blocks = self.max_seq_len // BLOCK_ROWS + 1  # MUTATION: was + 2
        self.capacity = BLOCK_ROWS * self.blocks


class RewindBeforeValidate(Mutant):
    name = "rewind_before_validate"
    rule = "a refused call leaves the state byte-identical (propose validates before it rewinds)"

    def propose(self, last_token, target_hidden, position, num_drafts, state):  # type: ignore[no-untyped-def]
        _contract.check_live(state, "propose")
        if isinstance(position, int) and not isinstance(position, bool) and 0 <= position <= state.seq_len:
            state.seq_len = position  # MUTATION: rewinds before the arguments are checked
        return super().propose(last_token, target_hidden, position, num_drafts, state)


class CatchupWritesX(Mutant):
    name = "catchup_writes_x"
    rule = "prefill, catch-up, rewind and trim leave the scratch x as it is; only propose writes it"

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state):  # type: ignore[no-untyped-def]
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


# ---- batches: each state of a batch exactly as its own call alone ------------------------------


class BatchPermuted(Mutant):
    name = "batch_permuted"
    rule = "propose_batch returns states[b]'s drafts at index b (here: the batch's results rotated by one)"
    generators = ("batched",)

    def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states):  # type: ignore[no-untyped-def]
        out = super().propose_batch(last_tokens, target_hiddens, positions, num_drafts, states)
        return out[1:] + out[:1]  # MUTATION: every state drafted right, returned in the wrong order


class BatchChecksAsItGoes(Mutant):
    name = "batch_checks_as_it_goes"
    rule = "a batched call checks every state before it drafts any: a refusal leaves every state byte-identical"
    generators = ("batched",)

    def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states):  # type: ignore[no-untyped-def]
        call = "propose_batch"
        states = _contract.batch_states(call, states)
        B, H = len(states), self.config.hidden_size
        tokens = _contract.batch_values(call, "last_tokens", last_tokens, B)
        hiddens = _contract.batch_hiddens(call, "target_hiddens", target_hiddens, B, H)
        pos = _contract.batch_ints(call, "positions", positions, B)
        check_int("num_drafts", num_drafts)
        # MUTATION: each state checked and drafted in turn (the single call), not all checked first.
        out = []
        for b, st in enumerate(states):
            with _contract.batch_item(call, b):
                out.append(self.propose(tokens[b], hiddens[b], pos[b], num_drafts, st))
        return out


class BatchXOfState0(Mutant):
    name = "batch_x_of_state0"
    rule = "each state of a batch keeps its own drafter hidden x (here: states[0]'s x written into every state)"
    generators = ("batched",)

    def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states):  # type: ignore[no-untyped-def]
        out = super().propose_batch(last_tokens, target_hiddens, positions, num_drafts, states)
        if num_drafts and len(states) > 1:
            for st in states[1:]:
                st.x = states[0].x.clone()  # MUTATION
        return out


class CatchupBatchWritesMisaligned(Mutant):
    name = "catchup_batch_writes_misaligned"
    rule = "a catchup_batch row whose row_base is not the state's drafter_rows writes nothing and returns 0 for it"
    generators = ("batched",)

    def catchup_batch(self, tokens, hiddens, row_bases, states):  # type: ignore[no-untyped-def]
        original = _contract.batch_catchup_args

        def every_row(call, tokens, hiddens, row_bases, states, weights, capacity, check_live_state):  # type: ignore[no-untyped-def]
            original(call, tokens, hiddens, row_bases, states, weights, capacity, check_live_state)  # the real checks
            # MUTATION: every row written, each at its state's drafter_rows.
            return original(call, tokens, hiddens, [st.seq_len for st in states], states, weights, capacity, check_live_state)

        with swapped(_contract, "batch_catchup_args", every_row):
            return super().catchup_batch(tokens, hiddens, row_bases, states)


# ---- the KPool indexer (glm5_next, DESIGN.md §7) ----------------------------------------------


def _write_pools_once(ix, cfg, gates, slots, cache, ops=None):  # type: ignore[no-untyped-def]  # write_pools' arguments (ops: unread)
    # MUTATION: a pool's key is computed the first time it completes only; after a trim cut into
    # it and its rows were rewritten, it is marked complete again over the old rows' key.
    kp = cache.kpool
    kp.gates[slots] = gates
    done = _kpool.complete_pools(slots, cfg.index_kpool)
    ever = getattr(kp, "_mutant_ever", None)
    if ever is None:
        ever = kp._mutant_ever = torch.zeros_like(kp.complete)
    new = done[~ever[done]]
    if new.numel():
        rows = new[:, None] * cfg.index_kpool + torch.arange(cfg.index_kpool, device=slots.device)
        keys = cache.index_rows(int(rows.max()) + 1)[rows]
        kp.keys[new] = _kpool.pooled_keys(ix, keys, kp.gates[rows])
        ever[new] = True
    kp.complete[done] = True


class KPoolStaleKey(SwappingMutant):
    name = "kpool_stale_key"
    rule = "a trim that cuts into a complete pool voids its key: rewritten rows give the pool a new key, never the stale one"
    preset = "glm5next_tiny"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_kpool, "write_pools", _write_pools_once)]


def _select_without_tail(scores, slots, cfg):  # type: ignore[no-untyped-def]
    # MUTATION: a row that has a complete pool to attend to drops its own incomplete pool's rows.
    rows, count = _kpool_select_pool_rows(scores, slots, cfg)
    tail = (slots + 1) % cfg.index_kpool
    has_pool = (slots + 1) // cfg.index_kpool > 0
    return rows, torch.where(has_pool, count - tail, count)


_kpool_select_pool_rows = _kpool.select_pool_rows


class KPoolTailDropped(SwappingMutant):
    name = "kpool_tail_dropped"
    rule = "row t attends to its tail, the rows [kpool * floor((t + 1) / kpool), t] of its own incomplete pool"
    preset = "glm5next_tiny"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_kpool, "select_pool_rows", _select_without_tail)]


def _write_pools_shifted(ix, cfg, gates, slots, cache, ops=None):  # type: ignore[no-untyped-def]  # write_pools' arguments (ops: unread)
    # MUTATION: pool p's key pools rows [kp p - 1, kp p + kp - 1) (row 0 twice for pool 0): the
    # pools are aligned one row early, as if the row space started at row 1.
    kp = cache.kpool
    kp.gates[slots] = gates
    done = _kpool.complete_pools(slots, cfg.index_kpool)
    if done.numel() == 0:
        return
    rows = (done[:, None] * cfg.index_kpool + torch.arange(cfg.index_kpool, device=slots.device) - 1).clamp(min=0)
    keys = cache.index_rows(int(rows.max()) + 1)[rows]
    kp.keys[done] = _kpool.pooled_keys(ix, keys, kp.gates[rows])
    kp.complete[done] = True


class KPoolMisaligned(SwappingMutant):
    name = "kpool_misaligned"
    rule = "pool p is rows [kpool * p, kpool * (p + 1)) of the dense row space: pools start at row 0"
    preset = "glm5next_tiny"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_kpool, "write_pools", _write_pools_shifted)]


class KPoolTiesHigh(SwappingMutant):
    name = "kpool_ties_high"
    rule = "the KPool selection breaks equal pool scores toward the lower pool id"
    preset = "glm5next_tiny"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_kpool, "topk_indices", _topk_ties_high)]


class KPoolCutStaysComplete(SwappingMutant):
    name = "kpool_cut_stays_complete"
    rule = "a rewind or trim that cuts into a complete pool makes it incomplete (pool_complete follows the rows held)"
    preset = "glm5next_tiny"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_kpool.KPoolCache, "forget_from", lambda cache, n: None)]  # type: ignore[list-item]  # MUTATION

    def after_verify(self, num_accepted, state):  # type: ignore[no-untyped-def]
        return self._swapped(state, lambda: super(KPoolCutStaysComplete, self).after_verify(num_accepted, state))


# The registry: name -> class. Every entry must be caught by the suite (tests/conformance).
MUTANTS: dict[str, type[Mutant]] = {
    cls.name: cls
    for cls in (
        TrimFirstRow, PosBaseRope, PairShift, NoRewindWhenAhead, StaleIndexerView, PreNormFeed,
        TopkTiesHigh, SecondVerify, MisalignedCatchup, BlockTableOffByOne, RewindBeforeValidate, CatchupWritesX,
        LastTokenShapeUnchecked, LibrarySums, BatchPermuted, BatchChecksAsItGoes, BatchXOfState0, CatchupBatchWritesMisaligned,
        KPoolStaleKey, KPoolTailDropped, KPoolMisaligned, KPoolTiesHigh, KPoolCutStaysComplete,
    )
}

from .mutants_sharing import SHARING_MUTANTS  # noqa: E402  (index sharing's, DESIGN.md §9; they subclass Mutant)

MUTANTS.update(SHARING_MUTANTS)

__all__ = ["Mutant", "SwappingMutant", "MUTANTS", "swapped"] + [c.__name__ for c in MUTANTS.values() if c not in SHARING_MUTANTS.values()]
