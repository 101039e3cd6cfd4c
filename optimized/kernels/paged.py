"""Where each row of a kernel call keeps its paged cache: one sequence's cache, or one per row.

A draft step over a batch runs every sequence's new row through the same launches (each weight
read once for all of them), but each row reads and writes its own sequence's paged pools. The
cache kernels (``cache_rows_write``, ``index_scores``, ``sparse_mla``) therefore take a
``RowCaches``: an address table on the device, one line per row, ``(kv_pool, index_pool,
block_table)`` as integers, which the kernel turns into pointers (``row_pools``). Rows of one
sequence (a catch-up, a prefill, a single propose) share one line: the table's row stride is 0.

The table holds addresses, not copies: a state's pools never move between ``alloc_state`` and
``free_state``, so a line stays valid for the state's life, and a CUDA graph that reads the table
follows whatever states the caller writes into it before a replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_mtp.reference.state import LayerCache

# The columns of an address table: each row's kv pool, index pool and block table.
KV_POOL, INDEX_POOL, BLOCK_TABLE = 0, 1, 2
ADDRESS_COLUMNS = 3


def cache_addresses(cache: LayerCache) -> list[int]:
    """One line of an address table: ``cache``'s pools and block table as integers."""
    return [cache.kv_pool.data_ptr(), cache.index_pool.data_ptr(), cache.block_table.data_ptr()]


@dataclass(frozen=True)
class RowCaches:
    """The paged caches of a kernel call's T rows.

    Args:
        caches: one ``LayerCache`` (every row in it) or T of them (row t in ``caches[t]``); the
            twins read these, the kernels read ``addresses``.
        addresses: ``(len(caches), 3)`` int64 on the caches' device, each line
            ``cache_addresses(caches[i])``.
    """

    caches: tuple[LayerCache, ...]
    addresses: Tensor

    @classmethod
    def of(cls, cache: LayerCache) -> "RowCaches":
        """Every row in ``cache`` (an address table of one line, read with stride 0)."""
        table = torch.tensor([cache_addresses(cache)], dtype=torch.int64, device=cache.kv_pool.device)
        return cls((cache,), table)

    @classmethod
    def per_row(cls, caches: Sequence[LayerCache], table: Tensor | None = None) -> "RowCaches":
        """Row t in ``caches[t]``. ``table``: a static ``(>= T, 3)`` int64 buffer on the device to
        write the lines into (its first T lines are used); without one, a new table."""
        caches = tuple(caches)
        if not caches:
            raise ValueError("RowCaches.per_row: caches must not be empty")
        device = caches[0].kv_pool.device
        lines = torch.tensor([cache_addresses(c) for c in caches], dtype=torch.int64)
        if table is None:
            return cls(caches, lines.to(device))
        if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] < len(caches) or table.shape[1] != ADDRESS_COLUMNS:
            raise ValueError(f"RowCaches.per_row: table must be int64 (>= {len(caches)}, {ADDRESS_COLUMNS}), got "
                             f"{table.dtype} {tuple(table.shape)}")
        view = table[: len(caches)]
        view.copy_(lines, non_blocking=True)
        return cls(caches, view)

    @property
    def stride(self) -> int:
        """The address table's row stride, in int64s: 0 when every row shares the one line."""
        return 0 if len(self.caches) == 1 else ADDRESS_COLUMNS

    def cache_of(self, t: int) -> LayerCache:
        """Row ``t``'s cache."""
        return self.caches[0 if len(self.caches) == 1 else t]

    def runs(self, rows: int) -> list[tuple[LayerCache, slice]]:
        """The twins' schedule: maximal runs of consecutive rows in one cache, with their rows."""
        if len(self.caches) == 1:
            return [(self.caches[0], slice(0, rows))]
        if len(self.caches) != rows:
            raise ValueError(f"RowCaches: {len(self.caches)} caches for {rows} rows")
        out: list[tuple[LayerCache, slice]] = []
        start = 0
        for t in range(1, rows + 1):
            if t == rows or self.caches[t] is not self.caches[start]:
                out.append((self.caches[start], slice(start, t)))
                start = t
        return out

    @property
    def device(self) -> torch.device:
        return self.addresses.device


def row_caches(caches: LayerCache | RowCaches) -> RowCaches:
    """``caches`` as a ``RowCaches`` (a lone ``LayerCache`` serves every row; this makes a one-line
    table with a host-to-device copy, so capturable callers pass a ``RowCaches`` made once)."""
    return caches if isinstance(caches, RowCaches) else RowCaches.of(caches)


@triton.jit
def row_pools(addresses_ptr, t, stride, TO_BF16: tl.constexpr):
    """Row ``t``'s ``(kv_pool, index_pool, block_table)`` pointers from an address table read
    with row ``stride`` (0: one line for every row)."""
    line = addresses_ptr + t * stride
    kv = tl.load(line + 0)
    ix = tl.load(line + 1)
    bt = tl.load(line + 2).to(tl.pointer_type(tl.int32))
    if TO_BF16:
        return kv.to(tl.pointer_type(tl.bfloat16)), ix.to(tl.pointer_type(tl.bfloat16)), bt
    else:
        return kv.to(tl.pointer_type(tl.float32)), ix.to(tl.pointer_type(tl.float32)), bt
