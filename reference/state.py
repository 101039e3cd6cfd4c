"""Row storage: a private paged pool per sequence, and the drafter's per-sequence state.

Rows are dense: row r lives in slot r, found through the block table as
``pool[block_table[r // 16], r % 16]``. A drafter claims its whole pool at allocation, so the
table is ``[0, blocks)``; rolling back is lowering ``seq_len``, since nothing reads past it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import MtpConfig

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
    """

    kv_pool: Tensor
    index_pool: Tensor
    block_table: Tensor

    @classmethod
    def allocate(cls, cfg: MtpConfig, blocks: int, dtype: torch.dtype, device: torch.device | str) -> "LayerCache":
        # Never-written rows hold zeros; they are masked out of every read, and zeros keep
        # exported snapshots free of uninitialised bytes.
        return cls(
            kv_pool=torch.zeros(blocks, BLOCK_ROWS, cfg.kv_row_width, dtype=dtype, device=device),
            index_pool=torch.zeros(blocks, BLOCK_ROWS, cfg.index_head_dim, dtype=dtype, device=device),
            block_table=torch.arange(blocks, dtype=torch.int32, device=device),
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
    """

    cache: LayerCache
    x: Tensor
    device: torch.device
    seq_len: int = 0
    pending: bool = False
    last_drafted: int = 0
    released: bool = False

    @property
    def capacity(self) -> int:
        return 0 if self.released else self.cache.capacity
