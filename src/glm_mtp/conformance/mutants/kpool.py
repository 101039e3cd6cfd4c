"""Mutants that break the KPool indexer of a glm5_next layer (DESIGN.md §7): pooled keys and
their completeness after a trim, the tail, the pools' alignment, the tie order."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import torch

from glm_mtp.reference import kpool as _kpool
from glm_mtp.reference.state import DrafterState

from .base import Mutant, SwappingMutant
from .block import topk_ties_high


def _write_pools_once(ix, cfg, gates, slots, cache, ops=None):  # write_pools' arguments (ops: unread)
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
    rule = ("a trim that cuts into a complete pool voids its key: rewritten rows give the pool a new key, never the "
            "stale one")
    preset = "glm5next_tiny"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_kpool, "write_pools", _write_pools_once)]


def _select_without_tail(scores, slots, cfg):
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


def _write_pools_shifted(ix, cfg, gates, slots, cache, ops=None):  # write_pools' arguments (ops: unread)
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
        return [(_kpool, "topk_indices", topk_ties_high)]


class KPoolCutStaysComplete(SwappingMutant):
    name = "kpool_cut_stays_complete"
    rule = "a rewind or trim that cuts into a complete pool makes it incomplete (pool_complete follows the rows held)"
    preset = "glm5next_tiny"

    def swaps(self, state: DrafterState) -> list[tuple[ModuleType, str, Callable[..., Any]]]:
        return [(_kpool.KPoolCache, "forget_from", lambda cache, n: None)]  # type: ignore[list-item]  # MUTATION: the swap patches a class (KPoolCache), typed as a module

    def after_verify(self, num_accepted, state):
        return self._swapped(state, lambda: super(KPoolCutStaysComplete, self).after_verify(num_accepted, state))


# This module's mutants, in the registry (``mutants.MUTANTS``) through ``mutants.GROUPS``.
MUTANTS: tuple[type[Mutant], ...] = (
    KPoolStaleKey, KPoolTailDropped, KPoolMisaligned, KPoolTiesHigh, KPoolCutStaysComplete,
)
