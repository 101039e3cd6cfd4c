"""RoPE on the new rows' keys fused with their paged cache write, as one kernel.

Replaces ``glm_mtp.reference.attention.write_cache_rows`` after its norms (the optimized
block's ``write_rows`` hook, ``glm_mtp.optimized.unfused_block.PrimitiveKernels.write_rows_hook``)::

    k_pe = apply_rope(kv[:, Lkv:], cos, sin, rope_interleave)
    ikey = rope_first(k_raw, cos, sin, cfg)            # RoPE on the first R dims of the index key
    cache.write(slots, cat(latent, k_pe), ikey)        # pool[block_table[slot // 16], slot % 16]

and adds one thing the reference does not need: every store is conditional on a device flag
``ok``, so a propose can refuse a non-finite hidden without a host sync (nothing is written when
``ok`` is false).

``cache_rows_write_triton`` is the same kernel with the two norms before it fused in: from the
raw GEMV outputs ``kv`` (kv_a_proj, (T, Lkv + R)) and ``k`` (the indexer's wk, (T, D)) it stores
exactly what ``attention.cache_rows`` computes from them::

    latent = rms_norm(kv[:, :Lkv], kv_a_layernorm, cfg.latent_norm_eps)
    k_pe   = apply_rope(kv[:, Lkv:], cos, sin, rope_interleave)
    key    = rope_first(layer_norm(k, k_norm_weight, k_norm_bias, K_NORM_EPS), cos, sin, cfg)

It takes the pools as ``caches`` (a ``LayerCache``, or ``paged.RowCaches``: row t in its own
sequence's cache, so one launch writes a batch of sequences' rows): each program reads its row's
``(kv_pool, index_pool, block_table)`` from the address table (``paged.row_pools``; stride 0 when
every row shares one cache), and the twin writes each run of rows into its cache as if alone.

A glm5_next layer (DESIGN.md §7) has no RoPE (R = 0: nothing is rotated, the rows are stored as
normed) and one more row to store: its KPool gate ``linear(a, kpool_gate)`` (``gates``), copied
into the row's ``KPoolCache.gates`` at its slot (``paged.row_kpool``) by the same program, so the
pooled-key kernel after it finds every row of a completed pool in place.

The norms' sums are ``psum`` trees over the row (lanes past the width are ``+0.0``, and so is
``x - mu`` there), divisions ``div_rn`` and roots ``sqrt_rn``, the epsilons passed as float32
bits; each normed value is rounded to S where the reference rounds it, before RoPE reads it.

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
from glm_mtp.reference.indexer import K_NORM_EPS, rope_first
from glm_mtp.reference.layers import apply_rope
from glm_mtp.reference.numerics import layer_norm, rms_norm
from glm_mtp.reference.state import BLOCK_ROWS, LayerCache

from .launch import AuditLaunch, Launch, abstract
from .paged import ADDRESS_COLUMNS, KERNEL_DTYPES, RowCaches, check_row_caches, row_caches, row_kpool, row_pools
from .pinned_math import psum_vector
from .rounding import float32_bits, round_to_storage

# The rows of the audit's batched launch: one per sequence of a batched draft step.
BATCH_ROWS = 16


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


@triton.jit
def _layer_norm_at(k_row, w_ptr, b_ptr, idx, mask, mu, inv, TO_BF16: tl.constexpr, NAN_BITS: tl.constexpr):
    """``layer_norm``'s output at lanes ``idx`` of one row, from its statistics: ``round_S((d * inv)
    * w + b)`` with ``d = x - mu``, back in float32 (exact). Elementwise, so any lane order gives
    the same values."""
    x = tl.load(k_row + idx, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    return round_to_storage(((x - mu) * inv) * w + b, TO_BF16, NAN_BITS).to(tl.float32)


@triton.jit
def _cache_rows_write_kernel(
    kv_ptr,  # (T, Lkv + R) S, kv_a_proj's raw output, row stride kv_stride
    k_ptr,  # (T, D) S, the indexer wk's raw output, row stride k_stride
    gates_ptr,  # (T, D) S, the KPool gates (HAS_GATES), row stride gates_stride
    kv_norm_ptr,  # (Lkv,) S, kv_a_layernorm
    k_norm_w_ptr,  # (D,) S, k_norm weight
    k_norm_b_ptr,  # (D,) S, k_norm bias
    slots_ptr,  # (T,) int64
    cos_ptr,  # (C, R/2) float32 table
    sin_ptr,
    addresses_ptr,  # (1 or T, ADDRESS_COLUMNS) int64: each row's cache addresses (paged.RowCaches)
    addr_stride,  # the address table's row stride: 0 (one cache for every row) or ADDRESS_COLUMNS (one per row)
    ok_ptr,  # (1,) uint8 (the bool flag's byte): write only when nonzero
    kv_stride,
    k_stride,
    gates_stride,
    Lkv,
    R,
    D,
    latent_eps_bits,  # int32: the bits of float32(cfg.latent_norm_eps)
    k_eps_bits,  # int32: the bits of float32(K_NORM_EPS)
    KV_INTERLEAVE: tl.constexpr,
    INDEX_INTERLEAVE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    LEVELS_L: tl.constexpr,
    BLOCK_R2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LEVELS_D: tl.constexpr,
    TO_BF16: tl.constexpr,
    NAN_BITS: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
    HAS_GATES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    ok = tl.load(ok_ptr).to(tl.int32)
    # Row t's cache: its pools (blocks, 16, Lkv + R) / (blocks, 16, D) and block table (blocks,) int32.
    kv_pool_ptr, index_pool_ptr, block_table_ptr = row_pools(addresses_ptr, t, addr_stride, TO_BF16)
    slot = tl.load(slots_ptr + t)
    block = tl.load(block_table_ptr + slot // ROWS_PER_BLOCK).to(tl.int64)
    phys = block * ROWS_PER_BLOCK + slot % ROWS_PER_BLOCK  # physical row in the pools
    half = R // 2
    cos_row = cos_ptr + slot * half
    sin_row = sin_ptr + slot * half
    kv_row = kv_pool_ptr + phys * (Lkv + R)
    ix_row = index_pool_ptr + phys * D
    kv_in = kv_ptr + t * kv_stride
    k_in = k_ptr + t * k_stride

    # The latent: rms_norm(kv[:Lkv]): r = 1 / sqrt(psum(x * x) / n + eps); round_S(w * round_S(x * r)).
    cl = tl.arange(0, BLOCK_L)
    lm = cl < Lkv
    x = tl.load(kv_in + cl, mask=lm, other=0.0).to(tl.float32)  # +0.0 past Lkv: the tree's padding
    ss = psum_vector(x * x, BLOCK_L, LEVELS_L)
    r = tl.math.div_rn(
        1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, Lkv.to(tl.float32)) + latent_eps_bits.to(tl.float32, bitcast=True))
    )
    normed = round_to_storage(x * r, TO_BF16, NAN_BITS).to(tl.float32)
    wl = tl.load(kv_norm_ptr + cl, mask=lm, other=0.0).to(tl.float32)
    tl.store(kv_row + cl, round_to_storage(wl * normed, TO_BF16, NAN_BITS), mask=lm & ((cl * 0 + ok) != 0))
    # The rope key, rotated, after the latent.
    _rotate_store(kv_in + Lkv, kv_row + Lkv, cos_row, sin_row, half, ok, KV_INTERLEAVE, BLOCK_R2, TO_BF16, NAN_BITS)

    # The index key: layer_norm(k) (mu = psum(x) / n; d = x - mu; var = psum(d * d) / n;
    # inv = 1 / sqrt(var + eps)), then RoPE on its first R dims (rope_first), the rest as normed.
    cd = tl.arange(0, BLOCK_D)
    dm = cd < D
    xk = tl.load(k_in + cd, mask=dm, other=0.0).to(tl.float32)
    n_d = D.to(tl.float32)
    mu = tl.math.div_rn(psum_vector(xk, BLOCK_D, LEVELS_D), n_d)
    dev = tl.where(dm, xk - mu, 0.0)  # +0.0 past D
    var = tl.math.div_rn(psum_vector(dev * dev, BLOCK_D, LEVELS_D), n_d)
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + k_eps_bits.to(tl.float32, bitcast=True)))
    rot = cd < R
    if INDEX_INTERLEAVE:  # pairs (2i, 2i + 1)
        first = (cd % 2) == 0
        pair = cd // 2
        partner = tl.where(first, cd + 1, cd - 1)
    else:  # pairs (i, i + R/2)
        first = cd < half
        pair = tl.where(first, cd, cd - half)
        partner = tl.where(first, cd + half, cd - half)
    y0 = _layer_norm_at(k_in, k_norm_w_ptr, k_norm_b_ptr, cd, dm, mu, inv, TO_BF16, NAN_BITS)
    yp = _layer_norm_at(k_in, k_norm_w_ptr, k_norm_b_ptr, partner, rot, mu, inv, TO_BF16, NAN_BITS)
    c = tl.load(cos_row + pair, mask=rot, other=0.0)
    s = tl.load(sin_row + pair, mask=rot, other=0.0)
    y = tl.where(rot, tl.where(first, y0 * c - yp * s, y0 * c + yp * s), y0)  # x1: x1 c - x2 s; x2: x2 c + x1 s
    tl.store(ix_row + cd, round_to_storage(y, TO_BF16, NAN_BITS), mask=dm & ((cd * 0 + ok) != 0))

    if HAS_GATES:  # the KPool gate row, stored as computed, dense by slot
        gates_row, _, _ = row_kpool(addresses_ptr, t, addr_stride, TO_BF16)
        g = tl.load(gates_ptr + t * gates_stride + cd, mask=dm)
        tl.store(gates_row + slot * D + cd, g, mask=dm & ((cd * 0 + ok) != 0))


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
        raise TypeError(f"rope_cache_write_triton: cache dtype {dtype} / table dtype {cos_table.dtype} is not "
                        "supported")
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


def _cache_rows_write_one(cfg: MtpConfig, kv: Tensor, k: Tensor, kv_norm_weight: Tensor, k_norm_weight: Tensor,
                          k_norm_bias: Tensor, slots: Tensor, cos_table: Tensor, sin_table: Tensor, cache: LayerCache,
                          ok: Tensor, gates: Tensor | None) -> None:
    """The twin for rows that all live in ``cache``."""
    Lkv = cfg.kv_lora_rank
    cos, sin = cos_table[slots], sin_table[slots]  # (T, R/2)
    latent = rms_norm(kv[:, :Lkv], kv_norm_weight, cfg.latent_norm_eps)
    k_pe = apply_rope(kv[:, Lkv:], cos, sin, cfg.rope_interleave)
    key = rope_first(layer_norm(k, k_norm_weight, k_norm_bias, K_NORM_EPS), cos, sin, cfg)
    block, offset = cache.block_table[slots // BLOCK_ROWS].long(), slots % BLOCK_ROWS
    keep = ok.reshape(())
    cache.write(slots, torch.where(keep, torch.cat((latent, k_pe), dim=-1), cache.kv_pool[block, offset]),
                torch.where(keep, key, cache.index_pool[block, offset]))
    if gates is not None:
        kpc = cache.kpool
        assert kpc is not None, "gates need a KPool cache"
        kpc.gates[slots] = torch.where(keep, gates, kpc.gates[slots])


def cache_rows_write_torch(
    cfg: MtpConfig,
    kv: Tensor,
    k: Tensor,
    kv_norm_weight: Tensor,
    k_norm_weight: Tensor,
    k_norm_bias: Tensor,
    slots: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    caches: LayerCache | RowCaches,
    ok: Tensor,
    gates: Tensor | None = None,
) -> None:
    """The twin: ``attention.cache_rows``' math from the raw GEMV outputs, then
    ``LayerCache.write``, each row's write kept only where ``ok`` is set. A glm5_next layer
    (NoPE: R = 0, so nothing is rotated) also stores its rows' KPool ``gates`` by slot.

    Args:
        kv: (T, Lkv + R) S, ``kv_a_proj_with_mqa``'s raw output.
        k: (T, D) S, the indexer ``wk``'s raw output.
        kv_norm_weight: (Lkv,) ``kv_a_layernorm``; k_norm_weight / k_norm_bias: (D,) ``k_norm``.
        slots: (T,) int64 slots (= RoPE positions), each in its row's cache.
        cos_table / sin_table: (C, R/2) the drafter's RoPE table.
        caches: the paged cache every row is written to (a ``LayerCache``), or one per row
            (``paged.RowCaches``): each run of rows in one cache is written as if alone.
        ok: (1,) or () bool; nothing is written when it is false.
        gates: (T, D) S, the KPool gates ``linear(a, kpool_gate)`` (glm5_next), stored into each
            row's ``KPoolCache.gates`` at its slot; ``None`` for GLM-5.
    """
    for cache, rows in row_caches(caches).runs(slots.shape[0]):
        _cache_rows_write_one(cfg, kv[rows], k[rows], kv_norm_weight, k_norm_weight, k_norm_bias, slots[rows],
                              cos_table,
                              sin_table, cache, ok, None if gates is None else gates[rows])


def cache_rows_write_launch(
    cfg: MtpConfig,
    kv: Tensor,
    k: Tensor,
    kv_norm_weight: Tensor,
    k_norm_weight: Tensor,
    k_norm_bias: Tensor,
    slots: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    caches: LayerCache | RowCaches,
    ok: Tensor,
    gates: Tensor | None = None,
    cuda: bool | None = None,
) -> Launch:
    """The kernel's launch, arguments checked (see ``cache_rows_write_triton``): the one place its
    grid and constexprs are computed. ``cuda``: whether it runs on CUDA (it picks the NaN payload);
    ``None`` reads it off the address table."""
    Lkv, R, D = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    rc = row_caches(caches)
    T = slots.shape[0]
    dtype = rc.caches[0].kv_pool.dtype
    if dtype not in KERNEL_DTYPES or cos_table.dtype != torch.float32:
        raise TypeError(f"cache_rows_write_triton: cache dtype {dtype} / table dtype {cos_table.dtype} is not "
                        "supported")
    check_row_caches("cache_rows_write_triton", rc, T, Lkv + R, D, kpool=gates is not None)
    if kv.shape != (T, Lkv + R) or k.shape != (T, D):
        raise ValueError(f"cache_rows_write_triton: kv {tuple(kv.shape)} / k {tuple(k.shape)} must be ({T}, {Lkv + R}) "
                         f"/ ({T}, {D})")
    if gates is not None and gates.shape != (T, D):
        raise ValueError(f"cache_rows_write_triton: gates {tuple(gates.shape)} must be ({T}, {D})")
    for name, x in (("kv", kv), ("k", k), ("kv_norm_weight", kv_norm_weight), ("k_norm_weight", k_norm_weight),
                    ("k_norm_bias", k_norm_bias), *((("gates", gates),) if gates is not None else ())):
        if x.stride(-1) != 1 or x.dtype != dtype:
            raise ValueError(f"cache_rows_write_triton: {name} must be {dtype} with a contiguous last dim")
    cuda = rc.addresses.is_cuda if cuda is None else cuda
    block_l, block_d = triton.next_power_of_2(Lkv), triton.next_power_of_2(D)
    args = (
        kv, k, k if gates is None else gates, kv_norm_weight, k_norm_weight, k_norm_bias, slots, cos_table, sin_table,
        rc.addresses, rc.stride,
        ok.view(torch.uint8),  # bytes, not i1: the flag loads the same on every backend
        kv.stride(0), k.stride(0), 0 if gates is None else gates.stride(0), Lkv, R, D,
        float32_bits(cfg.latent_norm_eps),
        float32_bits(K_NORM_EPS),
    )
    meta = dict(
        KV_INTERLEAVE=cfg.rope_interleave,
        INDEX_INTERLEAVE=cfg.indexer_rope_interleave,
        BLOCK_L=block_l,
        LEVELS_L=block_l.bit_length() - 1,
        BLOCK_R2=triton.next_power_of_2(max(R // 2, 1)),
        BLOCK_D=block_d,
        LEVELS_D=block_d.bit_length() - 1,
        TO_BF16=dtype == torch.bfloat16,
        NAN_BITS=0x7FFF if cuda else 0xFFFF,
        ROWS_PER_BLOCK=BLOCK_ROWS,
        HAS_GATES=gates is not None,
        enable_fp_fusion=False,
    )
    return Launch(_cache_rows_write_kernel, (T,), args, meta)


def cache_rows_write_triton(
    cfg: MtpConfig,
    kv: Tensor,
    k: Tensor,
    kv_norm_weight: Tensor,
    k_norm_weight: Tensor,
    k_norm_bias: Tensor,
    slots: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    caches: LayerCache | RowCaches,
    ok: Tensor,
    gates: Tensor | None = None,
) -> None:
    """``rope_cache_write_triton`` with the two norms fused in: the latent's ``rms_norm`` and the
    index key's ``k_norm`` (``layer_norm``); arguments as ``cache_rows_write_torch``, byte-equal to
    it. ``kv``/``k`` may be row-strided views (contiguous last dim); weights contiguous. Each
    program reads its row's pools from the address table (``paged.row_pools``), so one launch
    writes rows of many sequences; a lone ``LayerCache`` becomes a one-line table (a host-to-device
    copy: capturable callers pass a ``RowCaches`` made once)."""
    if slots.shape[0] == 0:
        return
    cache_rows_write_launch(cfg, kv, k, kv_norm_weight, k_norm_weight, k_norm_bias, slots, cos_table, sin_table,
                            caches, ok, gates).run()


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The launches the drafter makes at ``cfg`` with a ``dtype`` cache, on abstract tensors
    shaped as ``glm_mtp.optimized.unfused_block.PrimitiveKernels.write_rows_hook`` passes them: the rope key a view of
    ``kv`` (T, Lkv + R) after the latent, the pools from ``LayerCache.allocate``, float32 tables
    (see ``glm_mtp.tools.audit``). Only ``KERNEL_DTYPES`` caches take the kernel.

    ``aligned``: a draft step or the one-row catch-up (``slots`` a fresh (1,) tensor).
    ``unaligned``: context rows from an odd row, ``slots[row:]`` 8 bytes off a 16-byte boundary.
    ``batch`` (``cache_rows_write``): a batched draft step, ``BATCH_ROWS`` rows each in its own
    cache (an address table of one line per row, stride ADDRESS_COLUMNS). At a glm5_next config
    ``cache_rows_write`` stores the rows' KPool gates too, as the fused step calls it."""
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

    def fused(T: int, slots: Tensor, batch: bool = False) -> Launch:
        # One cache for every row: a one-line address table read with stride 0; a batch: one line per row.
        caches = RowCaches((cache,) * T, abstract((T, ADDRESS_COLUMNS), torch.int64)) if batch else \
            RowCaches((cache,), abstract((1, ADDRESS_COLUMNS), torch.int64))
        gates = abstract((T, D), dtype) if cfg.is_next else None  # a glm5_next row's KPool gate
        return cache_rows_write_launch(cfg, abstract((T, Lkv + R), dtype), abstract((T, D), dtype),
                                       abstract((Lkv,), dtype),
                                       abstract((D,), dtype), abstract((D,), dtype), slots, table, table, caches, ok,
                                       gates=gates, cuda=True)

    return [
        AuditLaunch("rope_cache_write", "aligned", launch(1, abstract((1,), torch.int64))),
        AuditLaunch("rope_cache_write", "unaligned", launch(rows, abstract((rows + 1,), torch.int64)[1:])),
        AuditLaunch("cache_rows_write", "aligned", fused(1, abstract((1,), torch.int64))),
        AuditLaunch("cache_rows_write", "unaligned", fused(rows, abstract((rows + 1,), torch.int64)[1:])),
        AuditLaunch("cache_rows_write", "batch", fused(BATCH_ROWS, abstract((BATCH_ROWS,), torch.int64), batch=True)),
    ]
