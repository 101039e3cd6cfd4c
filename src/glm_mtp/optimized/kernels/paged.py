"""Where each row of a kernel call keeps its paged cache: one sequence's cache, or one per row.

A draft step over a batch runs every sequence's new row through the same launches (each weight
read once for all of them), but each row reads and writes its own sequence's paged pools. The
cache kernels (``cache_rows_write``, ``index_scores``, ``sparse_mla``) therefore take a
``RowCaches``: an address table on the device, one line per row, ``(kv_pool, index_pool,
block_table)`` as integers, which the kernel turns into pointers (``row_pools``), then, for a
glm5_next layer, the KPool cache's ``(gates, keys, complete)`` (``row_kpool``; 0 in a GLM-5 line,
never read). Rows of one sequence (a catch-up, a prefill, a single propose) share one line: the
table's row stride is 0.

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

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.state import BLOCK_ROWS, LayerCache

from .launch import AuditLaunch, Launch, abstract

# The storage dtypes the cache kernels (and the fused step) take; other dtypes run the torch twins.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

# The columns of an address table: each row's kv pool, index pool and block table, then its
# KPool cache's gates, pooled keys and complete flags (glm5_next; 0 where the layer has none).
KV_POOL, INDEX_POOL, BLOCK_TABLE, POOL_GATES, POOL_KEYS, POOL_COMPLETE = 0, 1, 2, 3, 4, 5
ADDRESS_COLUMNS = 6


# The kernels tell the compiler each address is a multiple of this (``row_pools``), as Triton
# assumes of a tensor argument it specialises, so loads through them vectorise; checked here.
ADDRESS_ALIGN = 16


def cache_addresses(cache: LayerCache) -> list[int]:
    """One line of an address table: ``cache``'s pools and block table as integers, each
    ``ADDRESS_ALIGN``-byte aligned (torch allocations are; a view at an odd offset is refused)."""
    kp = cache.kpool
    line = [cache.kv_pool.data_ptr(), cache.index_pool.data_ptr(), cache.block_table.data_ptr(),
            *((kp.gates.data_ptr(), kp.keys.data_ptr(), kp.complete.data_ptr()) if kp is not None else (0, 0, 0))]
    for name, address in zip(("kv_pool", "index_pool", "block_table", "kpool.gates", "kpool.keys", "kpool.complete"),
                             line):
        if address % ADDRESS_ALIGN:
            raise ValueError(f"RowCaches: the cache's {name} starts {address % ADDRESS_ALIGN} bytes past a "
                             f"{ADDRESS_ALIGN}-byte boundary; the cache kernels need aligned pools "
                             "(LayerCache.allocate's are)")
    return line


@dataclass(frozen=True)
class RowCaches:
    """The paged caches of a kernel call's T rows.

    Args:
        caches: one ``LayerCache`` (every row in it) or T of them (row t in ``caches[t]``); the
            twins read these, the kernels read ``addresses``.
        addresses: ``(len(caches), ADDRESS_COLUMNS)`` int64 on the caches' device, each line
            ``cache_addresses(caches[i])``.
    """

    caches: tuple[LayerCache, ...]
    addresses: Tensor

    @classmethod
    def of(cls, cache: LayerCache) -> RowCaches:
        """Every row in ``cache`` (an address table of one line, read with stride 0)."""
        table = torch.tensor([cache_addresses(cache)], dtype=torch.int64, device=cache.kv_pool.device)
        return cls((cache,), table)

    @classmethod
    def per_row(cls, caches: Sequence[LayerCache], table: Tensor | None = None) -> RowCaches:
        """Row t in ``caches[t]``. ``table``: a static ``(>= T, ADDRESS_COLUMNS)`` int64 buffer on the device to
        write the lines into (its first T lines are used); without one, a new table."""
        caches = tuple(caches)
        if not caches:
            raise ValueError("RowCaches.per_row: caches must not be empty")
        device = caches[0].kv_pool.device
        lines = torch.tensor([cache_addresses(c) for c in caches], dtype=torch.int64)
        if table is None:
            return cls(caches, lines.to(device))
        if (
            table.dtype != torch.int64
            or table.dim() != 2
            or table.shape[0] < len(caches)
            or table.shape[1] != ADDRESS_COLUMNS
        ):
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


def check_row_caches(name: str, rc: RowCaches, T: int, kv_width: int | None, index_width: int | None,
                     kpool: bool = False) -> torch.dtype:
    """The host-side checks of a cache kernel's ``RowCaches`` (no device reads): one cache or T,
    the address table int64 ``(len(caches), ADDRESS_COLUMNS)``, every cache's pools contiguous with
    the widths given (``None``: that pool is not read) and the same dtype, shape and block count as
    the first; with ``kpool``, every cache's KPool cache too (gates (capacity, D), keys (pools, D)
    and complete (pools,) bool, contiguous, the pools' dtype). Returns the pools' dtype."""
    n = len(rc.caches)
    if n not in (1, T):
        raise ValueError(f"{name}: {n} caches for {T} rows (one for every row, or one per row)")
    if rc.addresses.dtype != torch.int64 or tuple(rc.addresses.shape) != (n, ADDRESS_COLUMNS):
        raise ValueError(f"{name}: the address table must be int64 ({n}, {ADDRESS_COLUMNS}), got "
                         f"{rc.addresses.dtype} {tuple(rc.addresses.shape)}")
    first = rc.caches[0]
    dtype = first.kv_pool.dtype
    for c in rc.caches:
        if c.kv_pool.dtype != dtype or c.index_pool.dtype != dtype:
            raise ValueError(f"{name}: every cache must hold {dtype}")
        bt = c.block_table
        if bt.dtype != torch.int32 or bt.shape != first.block_table.shape or not bt.is_contiguous():
            raise ValueError(f"{name}: every block table must be contiguous int32 {tuple(first.block_table.shape)}")
        blocks = first.block_table.shape[0]
        for pool, width in ((c.kv_pool, kv_width), (c.index_pool, index_width)):
            if width is not None and (tuple(pool.shape) != (blocks, BLOCK_ROWS, width) or not pool.is_contiguous()):
                raise ValueError(f"{name}: every pool must be contiguous ({blocks}, {BLOCK_ROWS}, {width}), got "
                                 f"{tuple(pool.shape)}")
        if kpool:
            check_kpool_cache(name, c, dtype)
    return dtype


def check_kpool_cache(name: str, cache: LayerCache, dtype: torch.dtype) -> None:
    """``cache`` has a KPool cache the kernels can address: gates (capacity, D) and keys (pools, D)
    contiguous in ``dtype``, complete (pools,) bool."""
    kpc = cache.kpool
    if kpc is None:
        raise ValueError(f"{name}: a glm5_next layer's cache needs its KPool cache (LayerCache.kpool)")
    capacity, D = cache.capacity, cache.index_pool.shape[-1]
    pools = capacity // kpc.kpool
    for arg, x, shape, dt in (("gates", kpc.gates, (capacity, D), dtype), ("keys", kpc.keys, (pools, D), dtype),
                              ("complete", kpc.complete, (pools,), torch.bool)):
        if tuple(x.shape) != shape or x.dtype != dt or not x.is_contiguous():
            raise ValueError(f"{name}: kpool.{arg} must be a contiguous {shape} {dt} tensor, got {tuple(x.shape)} "
                             f"{x.dtype}")


@triton.jit
def row_pools(addresses_ptr, t, stride, TO_BF16: tl.constexpr):
    """Row ``t``'s ``(kv_pool, index_pool, block_table)`` pointers from an address table read
    with row ``stride`` (0: one line for every row), each declared ``ADDRESS_ALIGN``-aligned (a
    pointer cast from an integer carries no alignment facts: without this the MLA scores kernel
    compiled to 199 registers instead of 56, its row loads unvectorised)."""
    line = addresses_ptr + t * stride
    kv = tl.load(line + 0)
    ix = tl.load(line + 1)
    bt = tl.load(line + 2).to(tl.pointer_type(tl.int32))
    if TO_BF16:
        kv_ptr, ix_ptr = kv.to(tl.pointer_type(tl.bfloat16)), ix.to(tl.pointer_type(tl.bfloat16))
    else:
        kv_ptr, ix_ptr = kv.to(tl.pointer_type(tl.float32)), ix.to(tl.pointer_type(tl.float32))
    return tl.multiple_of(kv_ptr, 16), tl.multiple_of(ix_ptr, 16), tl.multiple_of(bt, 16)


@triton.jit
def row_kpool(addresses_ptr, t, stride, TO_BF16: tl.constexpr):
    """Row ``t``'s KPool cache pointers ``(gates, keys, complete)`` from an address table read
    with row ``stride``: gates (capacity, D) and keys (pools, D) in S, complete (pools,) bool as
    bytes; each ``ADDRESS_ALIGN``-aligned (see ``row_pools``). Only a glm5_next line has them."""
    line = addresses_ptr + t * stride
    gates = tl.load(line + 3)
    keys = tl.load(line + 4)
    done = tl.load(line + 5).to(tl.pointer_type(tl.int8))
    if TO_BF16:
        g_ptr, k_ptr = gates.to(tl.pointer_type(tl.bfloat16)), keys.to(tl.pointer_type(tl.bfloat16))
    else:
        g_ptr, k_ptr = gates.to(tl.pointer_type(tl.float32)), keys.to(tl.pointer_type(tl.float32))
    return tl.multiple_of(g_ptr, 16), tl.multiple_of(k_ptr, 16), tl.multiple_of(done, 16)


# ---- per-row destinations: the batched programs' writes into each state's own tensors -----------


@dataclass(frozen=True)
class RowTargets:
    """Per-row destination tensors of a scatter: row t of the values goes to ``tensors[t]``.

    Args:
        tensors: T contiguous tensors, each with N elements of the values' dtype (the twin
            writes these).
        addresses: (T,) int64 on the device (a column view of a table may be strided): each
            tensor's ``data_ptr`` (the kernel writes through these).
    """

    tensors: tuple[Tensor, ...]
    addresses: Tensor

    @classmethod
    def of(cls, tensors: Sequence[Tensor], column: Tensor) -> RowTargets:
        """``tensors``' addresses written into ``column`` (a static (>= T,) int64 device view)."""
        tensors = tuple(tensors)
        view = column[: len(tensors)]
        view.copy_(torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64), non_blocking=True)
        return cls(tensors, view)


# Integer views that carry each storage dtype's bits unchanged.
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32, torch.int64: torch.int64,
         torch.int32: torch.int32}


@triton.jit
def _scatter_rows_kernel(
    values_ptr,  # (T, N) integer bits, row stride v_stride
    addresses_ptr,  # (T,) int64 destination addresses, stride a_stride
    ok_ptr,  # (1,) uint8: write only when nonzero
    N,
    v_stride,
    a_stride,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ok = tl.load(ok_ptr).to(tl.int32)
    address = tl.load(addresses_ptr + t * a_stride)
    if BITS == 16:
        dst = address.to(tl.pointer_type(tl.int16))
    elif BITS == 32:
        dst = address.to(tl.pointer_type(tl.int32))
    else:
        dst = address.to(tl.pointer_type(tl.int64))
    for c in range(0, N, BLOCK):
        i = c + tl.arange(0, BLOCK)
        m = i < N
        v = tl.load(values_ptr + t * v_stride + i, mask=m)
        tl.store(dst + i, v, mask=m & ((i * 0 + ok) != 0))


def scatter_rows_torch(values: Tensor, targets: RowTargets, ok: Tensor) -> None:
    """The twin: ``targets.tensors[t] = values[t]`` where ``ok`` (1,) bool is set, else unchanged.
    ``values`` (T, N) of the targets' dtype."""
    keep = ok.reshape(())
    for t, dst in enumerate(targets.tensors):
        dst.copy_(torch.where(keep, values[t].reshape(dst.shape), dst))


def scatter_rows_launch(values: Tensor, targets: RowTargets, ok: Tensor) -> Launch:
    """The kernel's launch (see ``scatter_rows_triton``), arguments checked."""
    T = len(targets.tensors)
    if values.dim() != 2 or values.shape[0] != T or values.stride(-1) != 1:
        raise ValueError(f"scatter_rows_triton: values must be (T={T}, N) with a contiguous last dim, got "
                         f"{tuple(values.shape)}")
    if values.dtype not in _BITS:
        raise TypeError(f"scatter_rows_triton: dtype {values.dtype} is not supported")
    for t, dst in enumerate(targets.tensors):
        if dst.dtype != values.dtype or dst.numel() != values.shape[1] or not dst.is_contiguous():
            raise ValueError(f"scatter_rows_triton: targets.tensors[{t}] must be a contiguous {values.dtype} tensor of "
                             f"{values.shape[1]} elements")
    bits = _BITS[values.dtype]
    N = values.shape[1]
    args = (values.view(bits), targets.addresses, ok.view(torch.uint8), N, values.stride(0),
            targets.addresses.stride(0))
    meta = dict(BITS=torch.iinfo(bits).bits, BLOCK=min(1024, triton.next_power_of_2(max(N, 1))), enable_fp_fusion=False)
    return Launch(_scatter_rows_kernel, (T,), args, meta)


def scatter_rows_triton(values: Tensor, targets: RowTargets, ok: Tensor) -> None:
    """``scatter_rows_torch`` as one launch: each row's values written through its address
    (bits copied, no arithmetic), byte-equal to the twin."""
    if not targets.tensors:
        return
    scatter_rows_launch(values, targets, ok).run()


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The batched programs' scatters at a batch of 16: each state's ``x`` (H,) in ``dtype`` and
    its device row count (1,) int64."""
    T = 16
    ok = abstract((1,), torch.bool)
    out = []
    for name, values in (("x", abstract((T, cfg.hidden_size), dtype)), ("seq", abstract((T, 1), torch.int64))):
        targets = RowTargets(tuple(abstract((values.shape[1],), values.dtype) for _ in range(T)),
                             abstract((T,), torch.int64))
        out.append(AuditLaunch("scatter_rows", name, scatter_rows_launch(values, targets, ok)))
    return out
