"""Row storage: a private paged pool per sequence, and the drafter's per-sequence state.

Rows are dense: row r lives in slot r, found through the block table as
``pool[block_table[r // 16], r % 16]``. A drafter claims its whole pool at allocation, so the
table is ``[0, blocks)``; rolling back is lowering ``seq_len``, since nothing reads past it.
A drafter's row budget is ``Sizes``; ``snapshot`` is a state's bytes as ``export_state`` gives
them. A glm5_next layer's rows carry the KPool indexer's gates and pooled keys (``KPoolCache``,
written and read by ``kpool.py``). A state records whose it is (``Owner``); who may use it, and
when, is the contract's (``contract_guards``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .config import MtpConfig
from .weights import MtpWeights

BLOCK_ROWS = 16


def num_blocks(max_seq_len: int) -> int:
    """Blocks claimed for one sequence: two spare blocks let drafts run past ``max_seq_len``."""
    return max_seq_len // BLOCK_ROWS + 2


@dataclass
class KPoolCache:
    """What the KPool indexer keeps per sequence beside the layer's rows (dense by slot).

    Args:
        gates: (capacity, D) the gate row ``g_s`` of every slot (S).
        keys: (capacity // kp, D) the pooled key of every pool (S); read only where ``complete``.
        complete: (capacity // kp,) bool: the pool's key was computed from the rows held now.
    """

    gates: Tensor
    keys: Tensor
    complete: Tensor
    kpool: int

    @classmethod
    def allocate(cls, cfg: MtpConfig, capacity: int, dtype: torch.dtype, device: torch.device | str) -> KPoolCache:
        pools = capacity // cfg.index_kpool
        D = cfg.index_head_dim
        return cls(
            gates=torch.zeros(capacity, D, dtype=dtype, device=device),
            keys=torch.zeros(pools, D, dtype=dtype, device=device),
            complete=torch.zeros(pools, dtype=torch.bool, device=device),
            kpool=cfg.index_kpool,
        )

    def forget_from(self, n: int) -> None:
        """Rows ``>= n`` are gone: every pool holding one of them is incomplete (its stored key
        describes rows that no longer exist)."""
        self.complete[n // self.kpool :] = False

    def snapshot(self, seq_len: int) -> dict[str, Tensor]:
        """The bytes ``export_state`` adds: ``pool_keys`` (seq_len // kp, D) of the complete
        pools, ``pool_complete`` (ceil(seq_len / kp),) for every pool holding a row, and
        ``pool_gates`` (seq_len, D)."""
        kp = self.kpool
        return {
            "pool_keys": self.keys[: seq_len // kp].clone(),
            "pool_complete": self.complete[: -(-seq_len // kp)].clone(),
            "pool_gates": self.gates[:seq_len].clone(),
        }


def empty_kpool_snapshot(cfg: MtpConfig, dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
    """``KPoolCache.snapshot`` of a freed state: no pools, no rows."""
    D = cfg.index_head_dim
    return {
        "pool_keys": torch.zeros(0, D, dtype=dtype, device=device),
        "pool_complete": torch.zeros(0, dtype=torch.bool, device=device),
        "pool_gates": torch.zeros(0, D, dtype=dtype, device=device),
    }


@dataclass
class LayerCache:
    """One attention layer's rows: the MLA row (normalised latent, rotated rope key) and the
    indexer key (after its norm and RoPE), each in a pool of 16-row blocks.

    Args:
        kv_pool: (blocks, 16, kv_lora_rank + qk_rope_head_dim).
        index_pool: (blocks, 16, index_head_dim).
        block_table: (blocks,) int32; slot r lives in block ``block_table[r // 16]``.
        kpool: the KPool indexer's gates and pooled keys (glm5_next; None in glm5).
    """

    kv_pool: Tensor
    index_pool: Tensor
    block_table: Tensor
    kpool: KPoolCache | None = None

    @classmethod
    def allocate(cls, cfg: MtpConfig, blocks: int, dtype: torch.dtype, device: torch.device | str) -> LayerCache:
        # Never-written rows hold zeros; they are masked out of every read, and zeros keep
        # exported snapshots free of uninitialised bytes.
        return cls(
            kv_pool=torch.zeros(blocks, BLOCK_ROWS, cfg.kv_row_width, dtype=dtype, device=device),
            index_pool=torch.zeros(blocks, BLOCK_ROWS, cfg.index_head_dim, dtype=dtype, device=device),
            block_table=torch.arange(blocks, dtype=torch.int32, device=device),
            kpool=KPoolCache.allocate(cfg, blocks * BLOCK_ROWS, dtype, device) if cfg.is_next else None,
        )

    @property
    def capacity(self) -> int:
        return self.block_table.shape[0] * BLOCK_ROWS

    def write(self, slots: Tensor, kv_rows: Tensor, index_rows: Tensor) -> None:
        """Store rows (T, ·) at ``slots`` (T,)."""
        block = self.block_table[slots // BLOCK_ROWS].long()
        offset = slots % BLOCK_ROWS
        self.kv_pool[block, offset] = kv_rows
        self.index_pool[block, offset] = index_rows

    def read(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """Copies of the rows at ``slots`` (T,): ``(kv_rows, index_rows)``, as ``write`` takes them."""
        block = self.block_table[slots // BLOCK_ROWS].long()
        offset = slots % BLOCK_ROWS
        return self.kv_pool[block, offset].clone(), self.index_pool[block, offset].clone()

    def write_index(self, slots: Tensor, index_rows: Tensor) -> None:
        """Store indexer keys alone (T, D) at ``slots`` (T,) (training rewrites them from a
        detached input: ``experiments.training.indexer_loss``)."""
        block = self.block_table[slots // BLOCK_ROWS].long()
        self.index_pool[block, slots % BLOCK_ROWS] = index_rows

    def kv_rows(self, n: int | None = None) -> Tensor:
        """The first ``n`` slots' rows (default: every slot), (n, kv_lora_rank + qk_rope_head_dim)."""
        return self._rows(self.kv_pool, n)

    def index_rows(self, n: int | None = None) -> Tensor:
        """The first ``n`` slots' indexer keys (default: every slot), (n, index_head_dim)."""
        return self._rows(self.index_pool, n)

    def _rows(self, pool: Tensor, n: int | None) -> Tensor:
        n = self.capacity if n is None else n
        blocks = self.block_table[: -(-n // BLOCK_ROWS)].long()  # only the blocks that hold them
        return pool[blocks].flatten(0, 1)[:n]


class Owner:
    """The drafter a state belongs to: its weights (the object, compared by identity) and its
    states' row capacity. With the state's type (one per backend) this is what ``use_state``
    checks, so a state never meets a drafter whose rows or weights it does not fit.

    The weights are held by a weak reference (a state does not keep them alive), and the class
    has slots and no ``__dict__``: walkers that measure what a state holds never reach them."""

    __slots__ = ("_weights", "capacity")

    def __init__(self, weights: Any, capacity: int) -> None:
        self._weights = weakref.ref(weights)
        self.capacity = capacity

    def serves(self, weights: Any) -> bool:
        """Whether these are the weights the state was allocated for."""
        return self._weights() is weights


@dataclass
class DrafterState:
    """Everything one sequence's drafter holds (DESIGN.md §3).

    Args:
        cache: the MTP layer's rows.
        x: (H,) the post-norm output of the last row that ``propose`` wrote (zeros at first).
        seq_len: rows held; the newest row's slot is ``seq_len - 1``.
        pending: a propose is outstanding, not yet verified.
        last_drafted: that propose's draft count (0 when none is pending).
        released: ``free_state`` ran.
        owner: the weights and row capacity of the drafter that allocated it (``Owner``).
        poisoned: why the state is unusable: a call failed midway and may have left rows
            half-written (``None`` while it is sound).
        user: the thread id of the call running on the state now (``None`` between calls).
        confidence: ``(prob, margin)`` of the latest propose's drafts, each ``(last_drafted,)``
            in A (DESIGN.md §12); read through ``draft_confidence`` while that propose is pending.
    """

    cache: LayerCache
    x: Tensor
    device: torch.device
    seq_len: int = 0
    pending: bool = False
    last_drafted: int = 0
    released: bool = False
    owner: Owner | None = None
    poisoned: str | None = None
    user: int | None = None
    confidence: tuple[Tensor, Tensor] | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.released else self.cache.capacity


@dataclass
class RowsBackup:
    """What a propose writing rows ``[lo, hi)`` may change in a state, kept to put back when it
    is refused midway (a matcher that breaks its contract, DESIGN.md §10): those rows (MLA,
    index key, KPool gate), every pool's key and completeness, ``x``, the counters and the
    confidence. Rows outside ``[lo, hi)`` are never written by such a propose."""

    slots: Tensor  # (hi - lo,)
    kv_rows: Tensor
    index_rows: Tensor
    x: Tensor
    counters: tuple[int, bool, int]  # seq_len, pending, last_drafted
    confidence: tuple[Tensor, Tensor] | None
    kpool: tuple[Tensor, Tensor, Tensor] | None  # gates of the slots, every pool's key, completeness

    @classmethod
    def take(cls, state: DrafterState, lo: int, hi: int) -> RowsBackup:
        slots = torch.arange(lo, hi, device=state.device)
        kv_rows, index_rows = state.cache.read(slots)
        kp = state.cache.kpool
        return cls(slots, kv_rows, index_rows, state.x.clone(), (state.seq_len, state.pending, state.last_drafted),
                   state.confidence,
                   None if kp is None else (kp.gates[slots].clone(), kp.keys.clone(), kp.complete.clone()))

    def restore(self, state: DrafterState) -> None:
        """Put every kept byte back: the state is as ``take`` found it."""
        state.cache.write(self.slots, self.kv_rows, self.index_rows)
        state.x = self.x
        state.seq_len, state.pending, state.last_drafted = self.counters
        state.confidence = self.confidence
        kp = state.cache.kpool
        if kp is not None and self.kpool is not None:
            gates, keys, complete = self.kpool
            kp.gates[self.slots] = gates
            kp.keys.copy_(keys)
            kp.complete.copy_(complete)


def rewind_rows(state: Any, n: int) -> None:
    """Hold rows ``[0, n)`` only (``n <= seq_len``): lowering ``seq_len`` is the whole rollback
    of the rows, and a KPool pool that loses a row becomes incomplete (its stored key is never
    read again until its last row is rewritten). ``state`` is either backend's state."""
    state.seq_len = n
    kpool = getattr(getattr(state, "cache", None), "kpool", None)
    if kpool is not None:
        kpool.forget_from(n)


@dataclass(frozen=True)
class Sizes:
    """A drafter's row budget: ``max_seq_len`` (capped at the model's DSA context), the
    ``blocks`` of 16 rows a state claims and their ``capacity`` in rows."""

    max_seq_len: int
    blocks: int
    capacity: int

    @classmethod
    def of(cls, max_seq_len: int, max_position_embeddings: int) -> Sizes:
        """``max_seq_len`` capped at the model's DSA context, and the rows a state claims for it."""
        capped = min(max_seq_len, max_position_embeddings)
        blocks = num_blocks(capped)
        return cls(capped, blocks, BLOCK_ROWS * blocks)


def snapshot(state: DrafterState, weights: MtpWeights) -> dict[str, Tensor]:
    """``export_state``'s bytes (after the owner checks): every byte the conformance suite
    compares; rows past ``seq_len`` are never exported. Works on a freed or a poisoned state."""
    cfg, dt, dev = weights.config, weights.dtype, state.device
    scalars = {
        "seq_len": torch.tensor(state.seq_len, dtype=torch.int64, device=dev),
        "last_drafted": torch.tensor(state.last_drafted, dtype=torch.int64, device=dev),
        "pending": torch.tensor(state.pending, dtype=torch.bool, device=dev),
    }
    if state.released:
        return {
            "kv_rows": torch.zeros(0, cfg.kv_row_width, dtype=dt, device=dev),
            "index_rows": torch.zeros(0, cfg.index_head_dim, dtype=dt, device=dev),
            "x": torch.zeros(cfg.hidden_size, dtype=dt, device=dev),
            **scalars,
            "block_table": torch.zeros(0, dtype=torch.int32, device=dev),
            **(empty_kpool_snapshot(cfg, dt, dev) if cfg.is_next else {}),
        }
    n = state.seq_len
    kpool = state.cache.kpool
    return {
        "kv_rows": state.cache.kv_rows()[:n].clone(),
        "index_rows": state.cache.index_rows()[:n].clone(),
        "x": state.x.clone(),
        **scalars,
        "block_table": state.cache.block_table.clone(),
        # glm5_next only (GLM-5's keys stay exactly the five above): pooled keys, completeness, gates
        **(kpool.snapshot(n) if kpool is not None else {}),
    }
