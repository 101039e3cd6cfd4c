"""Row storage: a private paged pool per sequence, and the drafter's per-sequence state.

Rows are dense: row r lives in slot r, found through the block table as
``pool[block_table[r // 16], r % 16]``. A drafter claims its whole pool at allocation, so the
table is ``[0, blocks)``; rolling back is lowering ``seq_len``, since nothing reads past it.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from .config import MtpConfig
from .kpool import KPoolCache

BLOCK_ROWS = 16


def num_blocks(max_seq_len: int) -> int:
    """Blocks claimed for one sequence: two spare blocks let drafts run past ``max_seq_len``."""
    return max_seq_len // BLOCK_ROWS + 2


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

    def write_index(self, slots: Tensor, index_rows: Tensor) -> None:
        """Store indexer keys alone (T, D) at ``slots`` (T,) (training rewrites them from a
        detached input: ``experiments.indexer_loss``)."""
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

    @property
    def capacity(self) -> int:
        return 0 if self.released else self.cache.capacity


def rewind_rows(state: Any, n: int) -> None:
    """Hold rows ``[0, n)`` only (``n <= seq_len``): lowering ``seq_len`` is the whole rollback
    of the rows, and a KPool pool that loses a row becomes incomplete (its stored key is never
    read again until its last row is rewritten). ``state`` is either backend's state."""
    state.seq_len = n
    kpool = getattr(getattr(state, "cache", None), "kpool", None)
    if kpool is not None:
        kpool.forget_from(n)


# ---- who may use a state, and when ----------------------------------------------------------------
# Host-side flags only: nothing here touches a tensor, so the checks cost no device sync.


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


# Held only for the test-and-set of ``DrafterState.user``, never across a call's compute.
_CLAIM = threading.Lock()


@contextmanager
def use_state(
    state: DrafterState, call: str, drafter: str, state_type: type, weights: Any, capacity: int
) -> Iterator[DrafterState]:
    """The guard of every public call on a state: the state must come from this drafter, and it
    has one caller at a time.

    Args:
        state: what the caller passed.
        call: the public call's name, for messages.
        drafter: the drafter's class name, for messages.
        state_type / weights / capacity: what this drafter's ``alloc_state`` makes.

    Raises:
        TypeError: not a state of this backend (``state_type``, exactly).
        ValueError: a state of a drafter with other weights or another capacity.
        RuntimeError: another call (another thread, or a call made from inside one) is using it.
    """
    if type(state) is not state_type:
        raise TypeError(f"{call}: state must come from {drafter}.alloc_state (a {state_type.__name__}), got "
                        f"{type(state).__name__}")
    owner = state.owner
    if owner is None or not owner.serves(weights):
        raise ValueError(f"{call}: the state was allocated by a drafter on other weights; use that drafter's "
                         "states only")
    if owner.capacity != capacity:
        raise ValueError(f"{call}: the state holds {owner.capacity} rows, this drafter's capacity is {capacity} "
                         "(another max_seq_len)")
    me = threading.get_ident()
    with _CLAIM:
        if state.user is not None:
            raise RuntimeError(f"{call}: the state is in use by another call (thread {state.user}); a state has one "
                               "caller at a time")
        state.user = me
    try:
        yield state
    finally:
        state.user = None


def check_sound(state: DrafterState, call: str) -> None:
    """``RuntimeError`` for a freed or a poisoned state (the first lifecycle checks)."""
    if state.released:
        raise RuntimeError(f"{call}: the state was freed (free_state); allocate a new one")
    if state.poisoned is not None:
        raise RuntimeError(f"{call}: the state is unusable: {state.poisoned}; free it (free_state) and allocate "
                           "a new one")


@contextmanager
def writing(state: DrafterState, call: str) -> Iterator[None]:
    """The part of a call that changes the state, after every check passed.

    It runs without autograd: hiddens (or weights) that require grad would otherwise chain every
    row written into one growing graph. Any exception from it (an interrupt, an out-of-memory, a
    failing kernel) poisons the state: rows may be half-written while the counters say otherwise,
    and restoring them would need a copy on every call, so later calls refuse it instead."""
    with writing_all((state,), call):
        yield


@contextmanager
def writing_all(states: Sequence[DrafterState], call: str) -> Iterator[None]:
    """``writing`` for a batch: a failure midway poisons every state of it (any of them may hold
    half-written rows)."""
    try:
        with torch.no_grad():
            yield
    except BaseException as e:
        for state in states:
            state.poisoned = f"{call} failed midway ({type(e).__name__}: {e})"
        raise
