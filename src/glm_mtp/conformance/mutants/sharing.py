"""Mutants of index sharing (DESIGN.md §9): the bugs engines shipped on the way to it, each a
reference drafter that breaks one of its rules when its weights' config shares (the scenarios draw
sharing on and off, ``scenarios.draws_index_share``; with it off they are the reference).

A ``SharingMutant`` drafts each propose with its own ``SharedSelection`` (swapped in for that
propose only, as ``mutants_base.swapped`` does) instead of the reference's fresh one; the last also
swaps how a shared step writes its row. Registered in ``mutants.GROUPS``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from glm_mtp.reference import attention as _attention
from glm_mtp.reference import kpool as _kpool
from glm_mtp.reference import proposer as _proposer
from glm_mtp.reference.block import BlockHooks
from glm_mtp.reference.contract import ProposeArgs
from glm_mtp.reference.sharing import SharedSelection
from glm_mtp.reference.state import DrafterState

from .base import Mutant, swapped


class SharingMutant(Mutant):
    """A mutant whose proposes share through ``selection(args, state)`` (when its config shares)."""

    preset: ClassVar[str] = "tiny"
    _share: SharedSelection | None = None  # the running propose's, while one runs

    def selection(self, args: ProposeArgs, state: DrafterState) -> SharedSelection:
        raise NotImplementedError

    def _draft(self, args, state, call, sample=None):
        if not self.config.index_share_for_mtp_iteration:
            return super()._draft(args, state, call, sample)
        share = self._share = self.selection(args, state)
        try:
            with swapped(_proposer, "share_selection", lambda enabled: share):
                return super()._draft(args, state, call, sample)
        finally:
            self._share = None


class _SecondStepsSelection(SharedSelection):
    """Keeps the selection of draft step 2 (row p + 1), not step 1's."""

    selected: int = 0

    @property
    def kept(self) -> tuple[Tensor, Tensor] | None:
        return super().kept if self.selected >= 2 else None

    def keep(self, rows: Tensor, count: Tensor) -> None:
        self.selected += 1
        if self.selected == 2:  # MUTATION: step 2 selects for its own row, and steps 3.. share that
            super().keep(rows, count)


class ShareWrongRow(SharingMutant):
    name = "share_wrong_row"
    rule = "§9: steps 2..k share the selection of the propose's first row p, not of row p + 1"

    def selection(self, args: ProposeArgs, state: DrafterState) -> SharedSelection:
        return _SecondStepsSelection()


class _LeftOverSelection(SharedSelection):
    """Step 1 selects for its row; later steps attend the previous propose's selection."""

    def __init__(self, state: DrafterState) -> None:
        super().__init__()
        self.state = state
        self.previous: tuple[Tensor, Tensor] | None = getattr(state, "_mutant_selection", None)

    @property
    def kept(self) -> tuple[Tensor, Tensor] | None:
        own = super().kept
        if own is None or self.previous is None:
            return own
        return self.previous  # MUTATION: the selection of an earlier propose of this state

    def keep(self, rows: Tensor, count: Tensor) -> None:
        super().keep(rows, count)
        self.state._mutant_selection = (rows, count)  # type: ignore[attr-defined]  # the mutant's own mark on the state, not a field of it


class ShareLeftOver(SharingMutant):
    name = "share_left_over"
    rule = "§9: a selection belongs to one propose: a later propose's steps never attend it"
    preset = "glm5next_tiny"

    def selection(self, args: ProposeArgs, state: DrafterState) -> SharedSelection:
        return _LeftOverSelection(state)


class _WithOwnRowSelection(SharedSelection):
    """Step 1's selection, with each shared step's own row q added."""

    def __init__(self, position: int) -> None:
        super().__init__()
        self.row = position

    @property
    def kept(self) -> tuple[Tensor, Tensor] | None:
        own = super().kept
        if own is None:
            return None
        rows, count = own
        self.row += 1  # read once per step: this step's row q
        n = int(count[0])
        wider = torch.cat((rows, torch.zeros_like(rows[:, :1])), dim=1)
        wider[0, n] = self.row  # MUTATION: q (above every row of S <= p) listed after S
        return wider, count + 1


class ShareAttendsOwnRow(SharingMutant):
    name = "share_attends_own_row"
    rule = "§9: a shared step attends exactly step 1's rows, not its own row q"

    def selection(self, args: ProposeArgs, state: DrafterState) -> SharedSelection:
        return _WithOwnRowSelection(args.position)


class ShareSkipsIndexWrites(SharingMutant):
    name = "share_skips_index_writes"
    rule = "§9: a shared step still writes its row's index key, gate and completed pool key"
    preset = "glm5next_tiny"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hooks = BlockHooks(write_rows=self._write_rows_of_step, kpool=self._kpool_of_step)

    def selection(self, args: ProposeArgs, state: DrafterState) -> SharedSelection:
        return SharedSelection()

    def _shared_step(self) -> bool:
        return self._share is not None and self._share.kept is not None

    def _write_rows_of_step(self, attn, cfg, kv, k, slots, rope, cache, ops):
        if not self._shared_step():
            return _attention.write_cache_rows(attn, cfg, kv, k, slots, rope, cache, ops)
        kv_rows, _ = _attention.cache_rows(attn, cfg, kv, k, *rope.at(slots), ops)
        cache.write(slots, kv_rows, cache.index_rows()[slots].clone())  # MUTATION: the index key is not written

    def _kpool_of_step(self, ix, cfg, a, q_latent, slots, cache, ops, shared=None):
        if shared is None:
            return _kpool.kpool_rows(ix, cfg, a, q_latent, slots, cache, ops)
        # MUTATION: the gate is not written (a pool completed here is keyed from stale rows)
        _kpool.write_pools(ix, cfg, cache.kpool.gates[slots].clone(), slots, cache, ops)
        return shared


MUTANTS: tuple[type[Mutant], ...] = (ShareWrongRow, ShareLeftOver, ShareAttendsOwnRow, ShareSkipsIndexWrites)
