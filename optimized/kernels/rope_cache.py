"""RoPE on the new rows' keys fused with their paged cache write, as one kernel.

Replaces ``glm_mtp.reference.attention.write_cache_rows`` after its norms (the optimized
block's ``write_rows`` hook, ``glm_mtp.optimized.block.Fused.write_rows_hook``)::

    k_pe = apply_rope(kv[:, Lkv:], cos, sin, rope_interleave)
    ikey = rope_first(k_raw, cos, sin, cfg)            # RoPE on the first R dims of the index key
    cache.write(slots, cat(latent, k_pe), ikey)        # pool[block_table[slot // 16], slot % 16]

and adds one thing the reference does not need: every store is conditional on a device flag
``ok``, so a propose can refuse a non-finite hidden without a host sync (nothing is written when
``ok`` is false).

Exact by construction: RoPE is ``y1 = x1 * cos - x2 * sin``, ``y2 = x2 * cos + x1 * sin`` in
float32, each product and sum rounded on its own (``enable_fp_fusion=False``: no FMA), from the
same float32 table, then one cast to the cache dtype. The cast to bfloat16 rounds to nearest even
on the bits, because Triton's CPU interpreter truncates. NaN payloads are not pinned: torch
itself writes 0xFFFF (CPU, vectorised), 0x7FC0 (CPU, scalar tail) or 0x7FFF (CUDA) for a NaN;
the kernel writes 0xFFFF on CPU and 0x7FFF on CUDA. (A NaN key can only come from an overflow:
the proposer refuses non-finite hiddens.) Only float32 and bfloat16 caches take the kernel;
other dtypes stay on the torch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.indexer import rope_first
from glm_mtp.reference.layers import apply_rope
from glm_mtp.reference.state import BLOCK_ROWS, LayerCache

from .launch import AuditLaunch, Launch, abstract
from .rounding import round_to_storage

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _rotate_store(
    src_ptr,  # first element of the R dims to rotate (row start + offset)
    dst_ptr,  # first element of where they go
    cos_ptr,  # (R/2,) float32, this row's angles
    sin_ptr,
    half,  # R / 2
    ok,  # int32: the ok flag; store only when nonzero
    INTERLEAVE: tl.constexpr,
    BLOCK_R2: tl.constexpr,
    TO_BF16: tl.constexpr,
    NAN_BITS: tl.constexpr,
):
    i = tl.arange(0, BLOCK_R2)
    inside = i < half
    store = (i * 0 + ok) != 0
    if INTERLEAVE:  # pairs (2i, 2i + 1)
        j1 = 2 * i
        j2 = 2 * i + 1
    else:  # pairs (i, i + R/2)
        j1 = i
        j2 = i + half
    x1 = tl.load(src_ptr + j1, mask=inside).to(tl.float32)
    x2 = tl.load(src_ptr + j2, mask=inside).to(tl.float32)
    c = tl.load(cos_ptr + i, mask=inside)
    s = tl.load(sin_ptr + i, mask=inside)
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    tl.store(dst_ptr + j1, round_to_storage(y1, TO_BF16, NAN_BITS), mask=inside & store)
    tl.store(dst_ptr + j2, round_to_storage(y2, TO_BF16, NAN_BITS), mask=inside & store)


@triton.jit
def _rope_cache_write_kernel(
    latent_ptr,  # (T, Lkv), row stride latent_stride
    kpe_ptr,  # (T, R) not yet rotated, row stride kpe_stride
    ikey_ptr,  # (T, D) index key after its norm, not yet rotated, row stride ikey_stride
    slots_ptr,  # (T,) int64
    cos_ptr,  # (C, R/2) float32 table
    sin_ptr,
    block_table_ptr,  # (blocks,) int32
    kv_pool_ptr,  # (blocks, 16, Lkv + R)
    index_pool_ptr,  # (blocks, 16, D)
    ok_ptr,  # (1,) uint8 (the bool flag's byte): write only when nonzero
    latent_stride,
    kpe_stride,
    ikey_stride,
    Lkv,
    R,
    D,
    KV_INTERLEAVE: tl.constexpr,
    INDEX_INTERLEAVE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TO_BF16: tl.constexpr,
    NAN_BITS: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    ok = tl.load(ok_ptr).to(tl.int32)
    slot = tl.load(slots_ptr + t)
    block = tl.load(block_table_ptr + slot // ROWS_PER_BLOCK).to(tl.int64)
    phys = block * ROWS_PER_BLOCK + slot % ROWS_PER_BLOCK  # physical row in the pools
    half = R // 2
    cos_row = cos_ptr + slot * half
    sin_row = sin_ptr + slot * half
    kv_row = kv_pool_ptr + phys * (Lkv + R)
    ix_row = index_pool_ptr + phys * D

    # The normalised latent: a copy.
    cl = tl.arange(0, BLOCK_L)
    lat = tl.load(latent_ptr + t * latent_stride + cl, mask=cl < Lkv)
    tl.store(kv_row + cl, lat, mask=(cl < Lkv) & ((cl * 0 + ok) != 0))
    # The rope key, rotated, after the latent.
    _rotate_store(kpe_ptr + t * kpe_stride, kv_row + Lkv, cos_row, sin_row, half, ok,
                  KV_INTERLEAVE, BLOCK_R2, TO_BF16, NAN_BITS)
    # The index key: its first R dims rotated, the rest copied.
    _rotate_store(ikey_ptr + t * ikey_stride, ix_row, cos_row, sin_row, half, ok,
                  INDEX_INTERLEAVE, BLOCK_R2, TO_BF16, NAN_BITS)
    cd = tl.arange(0, BLOCK_D)
    rest = (cd >= R) & (cd < D)
    k = tl.load(ikey_ptr + t * ikey_stride + cd, mask=rest)
    tl.store(ix_row + cd, k, mask=rest & ((cd * 0 + ok) != 0))


def rope_cache_write_torch(
    cfg: MtpConfig,
    latent: Tensor,
    kpe_raw: Tensor,
    ikey_raw: Tensor,
    slots: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    kv_pool: Tensor,
    index_pool: Tensor,
    block_table: Tensor,
    ok: Tensor,
) -> None:
    """The reference's ops (``apply_rope``, ``rope_first``, ``LayerCache.write``), each row's
    write kept only where ``ok`` (a bool tensor with one element) is set.

    Args:
        latent: (T, Lkv) the normalised KV latent of the new rows.
        kpe_raw: (T, R) their rope keys before RoPE.
        ikey_raw: (T, D) their index keys after ``k_norm``, before RoPE.
        slots: (T,) int64 slots (= RoPE positions).
        cos_table / sin_table: (C, R/2) the drafter's RoPE table.
        kv_pool / index_pool / block_table: the paged cache (``LayerCache``'s tensors).
        ok: (1,) or () bool; nothing is written when it is false.
    """
    cos, sin = cos_table[slots], sin_table[slots]  # (T, R/2)
    k_pe = apply_rope(kpe_raw, cos, sin, cfg.rope_interleave)
    ikey = rope_first(ikey_raw, cos, sin, cfg)
    rows = torch.cat((latent, k_pe), dim=-1)  # (T, Lkv + R)
    block = block_table[slots // BLOCK_ROWS].long()
    offset = slots % BLOCK_ROWS
    keep = ok.reshape(())
    kv_pool[block, offset] = torch.where(keep, rows, kv_pool[block, offset])
    index_pool[block, offset] = torch.where(keep, ikey, index_pool[block, offset])


def rope_cache_write_launch(
    cfg: MtpConfig,
    latent: Tensor,
    kpe_raw: Tensor,
    ikey_raw: Tensor,
    slots: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    kv_pool: Tensor,
    index_pool: Tensor,
    block_table: Tensor,
    ok: Tensor,
    cuda: bool | None = None,
) -> Launch:
    """The kernel's launch, arguments checked (see ``rope_cache_write_triton``): the one place
    its grid and constexprs are computed. ``cuda``: whether it runs on CUDA (it picks the NaN
    payload); ``None`` reads it off ``kv_pool`` (the audit's abstract tensors are on no device)."""
    Lkv, R, D = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    dtype = kv_pool.dtype
    if dtype not in KERNEL_DTYPES or cos_table.dtype != torch.float32:
        raise TypeError(f"rope_cache_write_triton: cache dtype {dtype} / table dtype {cos_table.dtype} is not supported")
    for name, t in (("latent", latent), ("kpe_raw", kpe_raw), ("ikey_raw", ikey_raw)):
        if t.stride(-1) != 1 or t.dtype != dtype:
            raise ValueError(f"rope_cache_write_triton: {name} must be {dtype} with a contiguous last dim")
    cuda = kv_pool.is_cuda if cuda is None else cuda
    args = (
        latent, kpe_raw, ikey_raw, slots, cos_table, sin_table, block_table, kv_pool, index_pool,
        ok.view(torch.uint8),  # bytes, not i1: the flag loads the same on every backend
        latent.stride(0), kpe_raw.stride(0), ikey_raw.stride(0), Lkv, R, D,
    )
    meta = dict(
        KV_INTERLEAVE=cfg.rope_interleave,
        INDEX_INTERLEAVE=cfg.indexer_rope_interleave,
        BLOCK_L=triton.next_power_of_2(Lkv),
        BLOCK_R2=triton.next_power_of_2(max(R // 2, 1)),
        BLOCK_D=triton.next_power_of_2(D),
        TO_BF16=dtype == torch.bfloat16,
        NAN_BITS=0x7FFF if cuda else 0xFFFF,
        ROWS_PER_BLOCK=BLOCK_ROWS,
        enable_fp_fusion=False,
    )
    return Launch(_rope_cache_write_kernel, (slots.shape[0],), args, meta)


def rope_cache_write_triton(
    cfg: MtpConfig,
    latent: Tensor,
    kpe_raw: Tensor,
    ikey_raw: Tensor,
    slots: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    kv_pool: Tensor,
    index_pool: Tensor,
    block_table: Tensor,
    ok: Tensor,
) -> None:
    """The kernel; arguments as in ``rope_cache_write_torch``. Rows may be strided views (the
    last dim must be contiguous); pools, tables and the block table contiguous; float32 tables."""
    if slots.shape[0] == 0:
        return
    rope_cache_write_launch(cfg, latent, kpe_raw, ikey_raw, slots, cos_table, sin_table, kv_pool, index_pool,
                            block_table, ok).run()


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The launches the drafter makes at ``cfg`` with a ``dtype`` cache, on abstract tensors
    shaped as ``glm_mtp.optimized.block.Fused.write_rows_hook`` passes them: the rope key a view of
    ``kv`` (T, Lkv + R) after the latent, the pools from ``LayerCache.allocate``, float32 tables
    (see ``glm_mtp.optimized.audit``). Only ``KERNEL_DTYPES`` caches take the kernel.

    ``aligned``: a draft step or the one-row catch-up (``slots`` a fresh (1,) tensor).
    ``unaligned``: context rows from an odd row, ``slots[row:]`` 8 bytes off a 16-byte boundary."""
    if dtype not in KERNEL_DTYPES:
        return []
    Lkv, R, D, rows = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim, 4
    cache = LayerCache.allocate(cfg, 2, dtype, "meta")
    table = abstract((cache.capacity, max(R // 2, 1)), torch.float32)
    ok = abstract((1,), torch.bool)

    def launch(T: int, slots: Tensor) -> Launch:
        kv = abstract((T, Lkv + R), dtype)
        return rope_cache_write_launch(cfg, abstract((T, Lkv), dtype), kv[:, Lkv:], abstract((T, D), dtype), slots,
                                       table, table, cache.kv_pool, cache.index_pool, cache.block_table, ok, cuda=True)

    return [
        AuditLaunch("rope_cache_write", "aligned", launch(1, abstract((1,), torch.int64))),
        AuditLaunch("rope_cache_write", "unaligned", launch(rows, abstract((rows + 1,), torch.int64)[1:])),
    ]
