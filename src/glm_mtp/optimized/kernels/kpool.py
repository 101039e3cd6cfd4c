"""The KPool indexer of GLM-5.3-Flash (DESIGN.md §7) as kernels: the pooled-key write (every new
row that completes its pool computes that pool's key from the pool's rows' index keys and gates
and stores it, with the pool marked complete), the pool scores of new rows over their visible
complete pools, the pool selection with its tail, and a rewind's forgetting of pools.

Every kernel reads its row's caches through an address table (``paged.RowCaches``: the index
pool and block table from ``row_pools``, the KPool gates, keys and complete flags from
``row_kpool``), so one launch serves a batch of sequences; each twin runs the reference's
functions on each run of rows in one cache, as if alone.

Pool scores replace ``kpool_queries``' weights and ``pool_scores``::

    w[h]    = up(w_raw[h]) * Hi^-1/2                                   (a float32 constant)
    I(t, p) = psum_h(w[h] * relu(psum_d(up(q[h, d]) * up(pk[p, d])) * D^-1/2))   p < (slot + 1) // kp

stored only at a row's visible pools: the programs past them load and store nothing, so a step's
bytes are O(visible pools), never the capacity's (the twin writes ``-inf`` there, the reference's
mask; no reader looks).

The pool selection (``select_pool_rows``) is GLM-5's top-k kernel (``indexer._select_rows_kernel``:
the same radix threshold search, ties to the lower index, listed ascending) run over a row's
visible pools, each listed pool stored as its kp rows, then the tail ``[kp * ((slot + 1) // kp),
slot]`` and slot-0 padding: one launch, integer index arithmetic only, no host read.

Replaces, in ``glm_mtp.reference.kpool.write_pools`` (after the gates are stored, by
``cache_rows_write``)::

    l[j, c]  = up(g[kp p + j, c]) + up(ape[j, c])                      (A)
    pk[p, c] = round_S(psum_j(softmax_j(l[:, c])[j] * up(k[kp p + j, c])))

Exact by construction (DESIGN.md §5): the softmax is ``numerics.softmax`` operation by operation
(an exact max, ``pinned_math.exp_f32``, the ``psum`` tree over the kp positions with ``tl.split``
levels, ``div_rn``); products and sums rounded once each (``enable_fp_fusion=False``); bfloat16
rounded on the bits. Only a row whose slot is its pool's last stores, and only where the device
flag ``ok`` is set: a pool has one last row, so no two programs store the same pool. The pool's
index rows and gates must already be stored (the reference's order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from einops import rearrange
from torch import Tensor

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.kpool import pool_scores, pooled_keys, select_pool_rows
from glm_mtp.reference.numerics import next_pow2, up
from glm_mtp.reference.state import BLOCK_ROWS, LayerCache
from glm_mtp.reference.weights import IndexerWeights

from .indexer import into, select_rows_launch
from .launch import AuditLaunch, Launch, abstract
from .paged import ADDRESS_COLUMNS, RowCaches, check_row_caches, row_caches, row_kpool, row_pools
from .pinned_math import exp_f32, psum_rows
from .rope_cache import BATCH_ROWS
from .rounding import float32_bits, round_to_storage

# Storage dtypes the kernels take (their A is float32).
KPOOL_DTYPES = (torch.float32, torch.bfloat16)
# The key channels one pooled-key program covers (the tile is (BLOCK_C, kp)).
MAX_BLOCK_C = 128
# The pools one forgetting program clears.
FORGET_BLOCK = 128


def check_kpool(name: str, cfg: MtpConfig, rc: RowCaches, T: int) -> torch.dtype:
    """``rc`` holds T rows' caches of a glm5_next layer whose kernels take them: pools of a power of
    two rows dividing a block, the index pools and KPool caches contiguous in a ``KPOOL_DTYPES``
    dtype. Returns that dtype."""
    kp = cfg.index_kpool
    if kp < 2 or kp & (kp - 1) or BLOCK_ROWS % kp:
        raise ValueError(f"{name}: index_kpool must be a power of two in [2, {BLOCK_ROWS}], got {kp}")
    dtype = check_row_caches(name, rc, T, None, cfg.index_head_dim, kpool=True)
    if dtype not in KPOOL_DTYPES:
        raise TypeError(f"{name}: storage dtype must be one of {KPOOL_DTYPES}, got {dtype}")
    return dtype


def check_slots(name: str, slots: Tensor, T: int | None = None) -> None:
    if slots.dim() != 1 or slots.dtype != torch.int64 or (T is not None and slots.shape[0] != T):
        raise ValueError(f"{name}: slots must be (T,) int64, got {tuple(slots.shape)} {slots.dtype}")


def check_ok(name: str, ok: Tensor) -> None:
    if ok.dtype != torch.bool or ok.numel() != 1:
        raise ValueError(f"{name}: ok must be one bool, got {tuple(ok.shape)} {ok.dtype}")


# ---- the pooled-key write -------------------------------------------------------------------------


@triton.jit
def _pool_keys_kernel(
    slots_ptr,  # (T,) int64
    ok_ptr,  # (1,) uint8 (the bool flag's byte): store only when nonzero
    addresses_ptr,  # (1 or T, ADDRESS_COLUMNS) int64: each row's cache addresses (paged.RowCaches)
    addr_stride,  # the table's row stride: 0 (one cache for every row) or ADDRESS_COLUMNS
    ape_ptr,  # (KP, D) S, contiguous
    D,
    KP: tl.constexpr,  # index_kpool, a power of two
    LEVELS: tl.constexpr,  # log2(KP)
    BLOCK_C: tl.constexpr,
    TO_BF16: tl.constexpr,
    NAN_BITS: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    slot = tl.load(slots_ptr + t)
    ok = tl.load(ok_ptr) != 0
    done = ok & ((slot + 1) % KP == 0)  # this row completes its pool
    if done:
        # Row t's index pool (blocks, 16, D) and block table; its gates (capacity, D), keys (pools, D), complete
        # (pools,).
        _, index_ptr, table_ptr = row_pools(addresses_ptr, t, addr_stride, TO_BF16)
        gates_ptr, keys_ptr, complete_ptr = row_kpool(addresses_ptr, t, addr_stride, TO_BF16)
        pool = slot // KP
        j = tl.arange(0, KP)  # (KP,)
        rows = pool * KP + j  # (KP,) int64
        block = tl.load(table_ptr + rows // ROWS_PER_BLOCK).to(tl.int64)
        c_in = c < D
        m2 = c_in[:, None] & (j[None, :] >= 0)  # (BLOCK_C, KP)
        idx_off = (block * ROWS_PER_BLOCK + rows % ROWS_PER_BLOCK)[None, :] * D + c[:, None]  # (BLOCK_C, KP)
        k = tl.load(index_ptr + idx_off, mask=m2, other=0.0).to(tl.float32)
        g = tl.load(gates_ptr + rows[None, :] * D + c[:, None], mask=m2, other=0.0).to(tl.float32)
        a = tl.load(ape_ptr + j[None, :] * D + c[:, None], mask=m2, other=0.0).to(tl.float32)
        logit = g + a  # (BLOCK_C, KP), A
        m = tl.max(logit, axis=1)  # exact in any order
        e = exp_f32(logit - m[:, None])
        s = e
        for level in tl.static_range(LEVELS):  # psum_j(e)
            lo, hi = tl.split(tl.reshape(s, (BLOCK_C, KP >> (level + 1), 2)))
            s = lo + hi
        p = tl.math.div_rn(e, tl.reshape(s, (BLOCK_C, 1)))
        x = p * k
        for level in tl.static_range(LEVELS):  # psum_j(p * k)
            lo, hi = tl.split(tl.reshape(x, (BLOCK_C, KP >> (level + 1), 2)))
            x = lo + hi
        pk = round_to_storage(tl.reshape(x, (BLOCK_C,)), TO_BF16, NAN_BITS)
        tl.store(keys_ptr + pool * D + c, pk, mask=c_in)
        if tl.program_id(1) == 0:
            tl.store(complete_ptr + pool, tl.full((), 1, tl.int8))


def pool_keys_write_launch(cfg: MtpConfig, ape: Tensor, slots: Tensor, caches: LayerCache | RowCaches, ok: Tensor,
                           cuda: bool | None = None) -> Launch:
    """The launch, arguments checked: grid (T rows, key-channel blocks). ``cuda``: whether it runs
    on CUDA (the NaN payload); ``None`` reads it off the address table."""
    name = "pool_keys_write_triton"
    rc = row_caches(caches)
    T, kp, D = slots.shape[0], cfg.index_kpool, cfg.index_head_dim
    check_slots(name, slots)
    dtype = check_kpool(name, cfg, rc, T)
    check_ok(name, ok)
    if tuple(ape.shape) != (kp, D) or ape.dtype != dtype or not ape.is_contiguous():
        raise ValueError(f"{name}: kpool_ape must be a contiguous ({kp}, {D}) {dtype} tensor, got {tuple(ape.shape)} "
                         f"{ape.dtype}")
    block_c = min(next_pow2(D), MAX_BLOCK_C)
    cuda = rc.addresses.is_cuda if cuda is None else cuda
    args = (slots, ok.view(torch.uint8), rc.addresses, rc.stride, ape, D)
    meta = dict(KP=kp, LEVELS=kp.bit_length() - 1, BLOCK_C=block_c, TO_BF16=dtype == torch.bfloat16,
                NAN_BITS=0x7FFF if cuda else 0xFFFF, ROWS_PER_BLOCK=BLOCK_ROWS, enable_fp_fusion=False)
    return Launch(_pool_keys_kernel, (T, triton.cdiv(D, block_c)), args, meta)


def pool_keys_write_triton(cfg: MtpConfig, ix: IndexerWeights, slots: Tensor, caches: LayerCache | RowCaches,
                           ok: Tensor) -> None:
    """Store the key of every pool a row at ``slots`` (T,) completes into its cache's
    ``kpool.keys``, marking it in ``kpool.complete``, only where ``ok`` (1,) bool is set. The
    pools' index rows and gates are read as stored. ``caches``: every row's cache (a
    ``LayerCache``) or row t's in line t (``RowCaches``). One launch, byte-equal to
    ``pool_keys_write_torch``."""
    if slots.shape[0]:
        pool_keys_write_launch(cfg, ix.kpool_ape, slots, caches, ok).run()


def _pool_keys_write_one(cfg: MtpConfig, ix: IndexerWeights, slots: Tensor, cache: LayerCache, ok: Tensor) -> None:
    """The twin for rows that all live in ``cache``: ``reference.kpool.pooled_keys`` of every row's
    own pool (read through the block table), stored only where the row completes its pool and
    ``ok`` is set. A pool has one last row, so each pool takes at most one row's key: chosen by a
    one-hot match rather than a scatter of duplicates (whose order is not defined), no host read."""
    kpc = cache.kpool
    assert kpc is not None, "a glm5_next layer needs a KPool cache"
    kp, dev = cfg.index_kpool, slots.device
    pool = slots // kp  # (T,)
    rows = pool[:, None] * kp + torch.arange(kp, device=dev)  # (T, kp): the row's pool
    block = cache.block_table[rows // BLOCK_ROWS].long()
    new = pooled_keys(ix, cache.index_pool[block, rows % BLOCK_ROWS], kpc.gates[rows])  # (T, D): meaningful where full
    done = ((slots + 1) % kp == 0) & ok.reshape(())  # (T,)
    hit = (pool[:, None] == torch.arange(kpc.keys.shape[0], device=dev)) & done[:, None]  # (T, P)
    which = hit.to(torch.int64).argmax(dim=0)  # (P,): the row completing pool p (any, where none does)
    stored = hit.any(dim=0)  # (P,)
    kpc.keys.copy_(torch.where(stored[:, None], new[which], kpc.keys))
    kpc.complete.copy_(kpc.complete | stored)


def pool_keys_write_torch(cfg: MtpConfig, ix: IndexerWeights, slots: Tensor, caches: LayerCache | RowCaches,
                          ok: Tensor) -> None:
    """The twin: each run of rows in one cache written as if alone."""
    for cache, rows in row_caches(caches).runs(slots.shape[0]):
        _pool_keys_write_one(cfg, ix, slots[rows], cache, ok)


# ---- pool scores ----------------------------------------------------------------------------------


@triton.jit
def _pool_scores_kernel(
    q_ptr,  # (T, Hi * D) S, the raw wq_b output (no RoPE), row stride q_stride
    w_ptr,  # (T, Hi) S, the raw weights_proj output, row stride w_stride
    addresses_ptr,  # (1 or T, ADDRESS_COLUMNS) int64: each row's cache addresses
    addr_stride,
    slots_ptr,  # (T,) int64
    out_ptr,  # (T, P) float32, row stride out_stride
    P,
    Hi,
    D,
    q_stride,
    w_stride,
    out_stride,
    head_scale_bits,  # int32: float32(Hi^-1/2)
    dot_scale_bits,  # int32: float32(D^-1/2)
    KP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LEVELS_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LEVELS_H: tl.constexpr,
    TO_BF16: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    n_vis = (slot + 1) // KP  # complete pools whose last row is <= slot
    if b * BLOCK_P < n_vis:  # else: no visible pool here, nothing loaded or stored
        _, keys_ptr, _ = row_kpool(addresses_ptr, t, addr_stride, TO_BF16)
        p = b * BLOCK_P + tl.arange(0, BLOCK_P)
        visible = (p < n_vis) & (p < P)
        d = tl.arange(0, BLOCK_D)
        d_in = d < D
        keys = tl.load(keys_ptr + p.to(tl.int64)[:, None] * D + d[None, :], mask=visible[:, None] & d_in[None, :],
                       other=0.0).to(tl.float32)  # (BLOCK_P, BLOCK_D), +0.0 past D
        head_scale = head_scale_bits.to(tl.float32, bitcast=True)
        dot_scale = dot_scale_bits.to(tl.float32, bitcast=True)
        q_row = q_ptr + t * q_stride
        w_row = w_ptr + t * w_stride
        hcol = tl.arange(0, BLOCK_H)
        roots = tl.zeros((BLOCK_P, BLOCK_H), tl.float32)  # +0.0: the heads' padding
        for h in range(0, Hi):
            qh = tl.load(q_row + h * D + d, mask=d_in, other=0.0).to(tl.float32)
            dots = psum_rows(keys * qh[None, :], BLOCK_P, BLOCK_D, LEVELS_D) * dot_scale  # (BLOCK_P,)
            wh = tl.load(w_row + h).to(tl.float32) * head_scale
            v = wh * tl.where(dots < 0.0, 0.0, dots)  # torch.relu: -0.0 and NaN pass through
            roots = tl.where(hcol[None, :] == h, v[:, None], roots)
        score = psum_rows(roots, BLOCK_P, BLOCK_H, LEVELS_H)
        tl.store(out_ptr + t * out_stride + p, score, mask=visible)


def pool_scores_launch(cfg: MtpConfig, q_raw: Tensor, w_raw: Tensor, caches: LayerCache | RowCaches, slots: Tensor,
                       out: Tensor) -> Launch:
    """The launch, arguments checked: grid (pool blocks, T rows)."""
    name = "pool_scores_triton"
    rc = row_caches(caches)
    Hi, D, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    T = slots.shape[0]
    check_slots(name, slots)
    dtype = check_kpool(name, cfg, rc, T)
    if q_raw.shape != (T, Hi * D) or w_raw.shape != (T, Hi):
        raise ValueError(f"{name}: q_raw (T, Hi*D) = ({T}, {Hi * D}) and w_raw ({T}, {Hi}) expected, got "
                         f"{tuple(q_raw.shape)}, {tuple(w_raw.shape)}")
    for arg, x in (("q_raw", q_raw), ("w_raw", w_raw)):
        if x.dtype != dtype or x.stride(-1) != 1:
            raise ValueError(f"{name}: {arg} must be {dtype} (the cache's) with a contiguous last dim")
    P = rc.caches[0].kpool.keys.shape[0]
    if out.shape != (T, P) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be float32 (T, P) = ({T}, {P})")
    block_d, block_h = next_pow2(D), next_pow2(Hi)
    block_p = max(1, min(next_pow2(max(P, 1)), max(1, 4096 // block_d)))
    args = (q_raw, w_raw, rc.addresses, rc.stride, slots, out, P, Hi, D, q_raw.stride(0), w_raw.stride(0),
            out.stride(0),
            float32_bits(Hi**-0.5), float32_bits(D**-0.5))
    meta = dict(KP=kp, BLOCK_P=block_p, BLOCK_D=block_d, LEVELS_D=block_d.bit_length() - 1, BLOCK_H=block_h,
                LEVELS_H=block_h.bit_length() - 1, TO_BF16=dtype == torch.bfloat16, enable_fp_fusion=False)
    return Launch(_pool_scores_kernel, (triton.cdiv(max(P, 1), block_p), T), args, meta)


def _pool_scores_one(cfg: MtpConfig, q_raw: Tensor, w_raw: Tensor, cache: LayerCache, slots: Tensor) -> Tensor:
    """The twin for rows that all read ``cache``."""
    q = rearrange(q_raw, "t (h d) -> t h d", h=cfg.index_n_heads)
    w = up(w_raw) * cfg.index_n_heads**-0.5
    keys = cache.kpool.keys
    scores = pool_scores(q, w, keys, cfg)  # (T, P)
    visible = torch.arange(keys.shape[0], device=slots.device)[None, :] < ((slots + 1) // cfg.index_kpool)[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def pool_scores_torch(cfg: MtpConfig, q_raw: Tensor, w_raw: Tensor, caches: LayerCache | RowCaches,
                      slots: Tensor) -> Tensor:
    """The twin: ``kpool_queries``' head weights from ``w_raw`` (T, Hi) S, ``pool_scores`` of the
    queries ``q_raw`` (T, Hi * D) S against each row's cache's pooled keys (P, D), and ``-inf``
    past each row's visible complete pools (``select_pool_rows``' mask). Returns (T, P) float32."""
    parts = [_pool_scores_one(cfg, q_raw[rows], w_raw[rows], cache, slots[rows])
             for cache, rows in row_caches(caches).runs(slots.shape[0])]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def pool_scores_triton(cfg: MtpConfig, q_raw: Tensor, w_raw: Tensor, caches: LayerCache | RowCaches,
                       slots: Tensor) -> Tensor:
    """The kernel for ``pool_scores_torch``: one launch, byte-equal to it at every row's visible
    pools ``p < (slot + 1) // kp``; past them the scores are not written (no reader looks:
    ``select_pool_rows_triton`` reads a row's visible pools only)."""
    rc = row_caches(caches)
    out = torch.empty(slots.shape[0], rc.caches[0].capacity // cfg.index_kpool, dtype=torch.float32,
                      device=q_raw.device)
    if out.numel():
        pool_scores_launch(cfg, q_raw, w_raw, rc, slots, out).run()
    return out


# ---- pool selection -------------------------------------------------------------------------------


def list_width(cfg: MtpConfig, pools: int) -> int:
    """The width of a row list over ``pools`` pools: the best ``min(index_topk / kp, pools)`` pools'
    rows and a tail of at most kp - 1 rows (``reference.kpool.select_pool_rows``' K)."""
    kp = cfg.index_kpool
    return min(cfg.kpool_pools_selected, pools) * kp + kp - 1


def select_pool_rows_launch(cfg: MtpConfig, scores: Tensor, slots: Tensor, rows: Tensor, count: Tensor) -> Launch:
    """GLM-5's selection kernel on pools (``indexer.select_rows_launch`` with ``kpool``)."""
    Kp = min(cfg.kpool_pools_selected, scores.shape[1])
    return select_rows_launch(scores, slots, rows, count, kpool=cfg.index_kpool, topk=Kp)


def select_pool_rows_torch(cfg: MtpConfig, scores: Tensor, slots: Tensor,
                           out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The twin: the reference's ``kpool.select_pool_rows`` on the scores ``(T, P)`` of every pool
    (copied into ``out`` when given)."""
    return into(out, *select_pool_rows(scores, slots, cfg))


def select_pool_rows_triton(cfg: MtpConfig, scores: Tensor, slots: Tensor,
                            out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``select_pool_rows_torch`` in one launch, reading each row's visible pools' scores only;
    byte-equal to the twin. ``rows`` (T, Kp * kp + kp - 1), ``count`` (T,), both int64; ``out``:
    buffers of those shapes the kernel writes (a selection kept for later steps)."""
    T, P = scores.shape
    if out is not None:
        rows, count = out
    else:
        rows = torch.empty(T, list_width(cfg, P), dtype=torch.int64, device=scores.device)
        count = torch.empty(T, dtype=torch.int64, device=scores.device)
    if T:
        select_pool_rows_launch(cfg, scores, slots, rows, count).run()
    return rows, count


# ---- a rewind: pools past a row count become incomplete -------------------------------------------


@triton.jit
def _pools_forget_kernel(
    n_ptr,  # (T,) int64: each row's sequence keeps rows [0, n)
    ok_ptr,  # (1,) uint8: clear only when nonzero
    addresses_ptr,
    addr_stride,
    P,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    first = tl.load(n_ptr + t) // KP  # the first pool holding a row >= n
    if (tl.load(ok_ptr) != 0) & ((tl.program_id(1) + 1) * BLOCK > first):
        _, _, complete_ptr = row_kpool(addresses_ptr, t, addr_stride, False)
        tl.store(complete_ptr + p, tl.zeros((BLOCK,), tl.int8), mask=(p >= first) & (p < P))


def pools_forget_launch(cfg: MtpConfig, n: Tensor, caches: LayerCache | RowCaches, ok: Tensor) -> Launch:
    """The launch, arguments checked: grid (T rows, pool blocks)."""
    name = "pools_forget_triton"
    rc = row_caches(caches)
    T = n.shape[0]
    check_slots(name, n)
    check_kpool(name, cfg, rc, T)
    check_ok(name, ok)
    P = rc.caches[0].kpool.complete.shape[0]
    args = (n, ok.view(torch.uint8), rc.addresses, rc.stride, P)
    return Launch(_pools_forget_kernel, (T, triton.cdiv(max(P, 1), FORGET_BLOCK)), args,
                  dict(KP=cfg.index_kpool, BLOCK=FORGET_BLOCK))


def pools_forget_torch(cfg: MtpConfig, n: Tensor, caches: LayerCache | RowCaches, ok: Tensor) -> None:
    """The twin: ``KPoolCache.forget_from(n[t])`` of row t's cache for every row, where ``ok``
    (1,) bool is set, with no host read (rows of one cache in order)."""
    rc = row_caches(caches)
    for t in range(n.shape[0]):
        kpc = rc.cache_of(t).kpool
        pools = torch.arange(kpc.complete.shape[0], device=n.device)
        kpc.complete.copy_(kpc.complete & ~(ok.reshape(()) & (pools >= n[t] // kpc.kpool)))


def pools_forget_triton(cfg: MtpConfig, n: Tensor, caches: LayerCache | RowCaches, ok: Tensor) -> None:
    """``pools_forget_torch`` in one launch (the rows' caches distinct, or one cache for every row);
    byte-equal to the twin. Stores only the flags of pools at or past each row's ``n // kp``."""
    if n.shape[0]:
        pools_forget_launch(cfg, n, caches, ok).run()


# ---- audit ----------------------------------------------------------------------------------------


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The launches at ``cfg``'s index width with ``dtype`` storage, on abstract tensors: a draft
    step (``step``: 1 row, one cache), a prefill chunk (``rows``: 8 rows, one cache) and a batched
    draft step (``batch``: ``BATCH_ROWS`` rows, each in its own cache). A GLM-5 config has no
    KPool layer: none."""
    if dtype not in KPOOL_DTYPES or not cfg.is_next:
        return []
    D, Hi, blocks = cfg.index_head_dim, cfg.index_n_heads, 64
    cache = LayerCache.allocate(cfg, blocks, dtype, "meta")
    P = cache.kpool.keys.shape[0]
    ape, ok = abstract((cfg.index_kpool, D), dtype), abstract((1,), torch.bool)
    out = []
    for variant, T in (("step", 1), ("rows", 8), ("batch", BATCH_ROWS)):
        slots = abstract((T,), torch.int64)
        caches = RowCaches((cache,) * T, abstract((T, ADDRESS_COLUMNS), torch.int64)) if variant == "batch" else \
            RowCaches((cache,), abstract((1, ADDRESS_COLUMNS), torch.int64))
        scores = abstract((T, P), torch.float32)
        out += [
            AuditLaunch("kpool:pool_keys_write", variant,
                        pool_keys_write_launch(cfg, ape, slots, caches, ok, cuda=True)),
            AuditLaunch("kpool:pool_scores", variant, pool_scores_launch(
                cfg, abstract((T, Hi * D), dtype), abstract((T, Hi), dtype), caches, slots, scores)),
            AuditLaunch("kpool:pools_forget", variant, pools_forget_launch(cfg, slots, caches, ok)),
        ]
        if variant != "batch":  # reads no cache: a batch launches it as ``rows`` does
            out.append(AuditLaunch("kpool:select_pool_rows", variant, select_pool_rows_launch(
                cfg, scores, slots, abstract((T, list_width(cfg, P)), torch.int64), abstract((T,), torch.int64))))
    return out
