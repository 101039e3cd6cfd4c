"""The lightning indexer as two kernels: the index scores of new rows against the paged cache,
and each row's top-k selection.

Replaces, in ``glm_mtp.reference.attention.dsa_attention``::

    q, w = index_queries(...)                      # its tail: RoPE on the heads' queries, w's scale
    scores = index_scores(q, w, cache.index_rows(), ops)   # then masked_fill(~visible, -inf)
    rows, count = select_rows(scores, slots, index_topk)

``index_scores_triton`` takes the raw GEMV outputs (``wq_b``'s queries, unrotated, and
``weights_proj``'s head weights, both S) and computes, per new row t and cached row s <= slots[t]:

    q[h]    = rope_first(q_raw[h])                 (round_S after RoPE, as index_queries)
    w[h]    = up(w_raw[h]) * (Hi * D)^-1/2         (a float32 constant, rounded once)
    I(t, s) = psum_h(w[h] * relu(psum_d(up(q[h, d]) * up(k[s, d]))))

each row against its own cache (``caches``: a ``LayerCache`` for every row, or
``paged.RowCaches``, one per row: a program reads its row's index pool and block table from the
address table, so one launch scores a batch of sequences), with ``relu(x) = x < 0 ? +0.0 : x``
exactly as ``torch.relu`` (it keeps ``-0.0`` and NaN), each sum the ``psum`` tree (padded with
``+0.0`` to the next power of two, adjacent pairs first) and no FMA (``enable_fp_fusion=False``).
Rows past ``slots[t]`` get ``-inf``; the programs that hold only such rows load nothing (one
program per 16 cached rows), so the loads are O(visible rows).

``select_rows_triton`` is ``indexer.select_rows`` exactly: the ``count[t] = min(topk, slots[t] + 1)``
best visible rows, ties to the lower row, listed in ascending slot order, padding 0. Scores become
order-preserving integer keys (``-0.0`` equals ``+0.0``, every NaN above ``+inf`` and equal to each
other: torch's stable descending sort puts NaNs first, in index order). The count-th largest key
is found digit by digit (RADIX_BITS per pass, integer counts: exact), then the rows above it and
the lowest-index rows equal to it are listed at positions given by an integer prefix count.
Each pass reads the visible rows only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from einops import rearrange
from torch import Tensor

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.indexer import index_scores, index_weight_scale, rope_first, select_rows
from glm_mtp.reference.numerics import up
from glm_mtp.reference.state import BLOCK_ROWS, LayerCache

from .launch import AuditLaunch, Launch, abstract
from .paged import ADDRESS_COLUMNS, RowCaches, check_row_caches, row_caches, row_pools
from .pinned_math import order_key, psum_rows
from .rounding import float32_bits, round_to_storage

# The storage dtypes the index-score kernel reads (queries, head weights, cached keys).
INDEX_DTYPES = (torch.float32, torch.bfloat16)
# Cached rows per index-score program: one cache block, so a program past a row's slot is whole.
SCORE_BLOCK_S = BLOCK_ROWS
# Scores per chunk of the selection's passes, and bits of the key found per pass.
SELECT_BLOCK = 256
RADIX_BITS = 4
# The capacity the audit's launches score (a runtime integer: any multiple of 16 compiles the same).
AUDIT_CAPACITY = 4096
# The rows of the audit's batched launch: one per sequence of a batched draft step.
BATCH_ROWS = 16


@triton.jit
def _index_scores_kernel(
    q_ptr,  # (T, Hi * D) S, the raw wq_b output, row stride q_stride
    w_ptr,  # (T, Hi) S, the raw weights_proj output, row stride w_stride
    cos_ptr,  # (T, R/2) float32, the rows' angles, row stride cos_stride
    sin_ptr,
    addresses_ptr,  # (1 or T, ADDRESS_COLUMNS) int64: each row's cache addresses (paged.RowCaches)
    addr_stride,  # the address table's row stride: 0 (one cache for every row) or ADDRESS_COLUMNS (one per row)
    slots_ptr,  # (T,) int64
    out_ptr,  # (T, C) float32, row stride out_stride
    C,
    Hi,
    D,
    R,
    q_stride,
    w_stride,
    cos_stride,
    sin_stride,
    out_stride,
    scale_bits,  # int32: the bits of float32((Hi * D)^-1/2)
    INTERLEAVE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LEVELS_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LEVELS_H: tl.constexpr,
    TO_BF16: tl.constexpr,
    NAN_BITS: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    s = b * BLOCK_S + tl.arange(0, BLOCK_S)
    dst = out_ptr + t * out_stride + s
    if b * BLOCK_S > slot:  # every row here is past the slot: -inf, nothing loaded
        tl.store(dst, tl.full((BLOCK_S,), float("-inf"), tl.float32), mask=s < C)
    else:
        # Row t's cache: its index pool (blocks, 16, D) S, contiguous, and block table (blocks,) int32.
        _kv, pool_ptr, block_table_ptr = row_pools(addresses_ptr, t, addr_stride, TO_BF16)
        visible = (s <= slot) & (s < C)
        block = tl.load(block_table_ptr + s // ROWS_PER_BLOCK, mask=visible, other=0).to(tl.int64)
        phys = block * ROWS_PER_BLOCK + s % ROWS_PER_BLOCK
        d = tl.arange(0, BLOCK_D)
        d_in = d < D
        keys = tl.load(pool_ptr + phys[:, None] * D + d[None, :], mask=visible[:, None] & d_in[None, :],
                       other=0.0).to(tl.float32)  # (BLOCK_S, BLOCK_D), +0.0 past D and past the slot
        # RoPE on the first R dims of each head's query: lane d pairs with lane `partner`
        # (x1 lanes: y1 = x1 * cos - x2 * sin; x2 lanes: y2 = x2 * cos + x1 * sin).
        rot = d < R
        half = R // 2
        if INTERLEAVE:  # pairs (2i, 2i + 1)
            first = (d % 2) == 0
            pair = d // 2
            partner = tl.where(first, d + 1, d - 1)
        else:  # pairs (i, i + R/2)
            first = d < half
            pair = tl.where(first, d, d - half)
            partner = tl.where(first, d + half, d - half)
        c = tl.load(cos_ptr + t * cos_stride + pair, mask=rot, other=0.0)
        sn = tl.load(sin_ptr + t * sin_stride + pair, mask=rot, other=0.0)
        scale = scale_bits.to(tl.float32, bitcast=True)
        q_row = q_ptr + t * q_stride
        w_row = w_ptr + t * w_stride
        hcol = tl.arange(0, BLOCK_H)
        roots = tl.zeros((BLOCK_S, BLOCK_H), tl.float32)  # +0.0: the heads' padding
        for h in range(0, Hi):
            x = tl.load(q_row + h * D + d, mask=d_in, other=0.0).to(tl.float32)
            xp = tl.load(q_row + h * D + partner, mask=rot, other=0.0).to(tl.float32)
            y = tl.where(first, x * c - xp * sn, x * c + xp * sn)
            y = round_to_storage(y, TO_BF16, NAN_BITS).to(tl.float32)  # RoPE's result in S, then up
            qh = tl.where(rot, y, x)  # (BLOCK_D,), +0.0 past D
            dots = psum_rows(keys * qh[None, :], BLOCK_S, BLOCK_D, LEVELS_D)  # (BLOCK_S,)
            wh = tl.load(w_row + h).to(tl.float32) * scale
            v = wh * tl.where(dots < 0.0, 0.0, dots)  # torch.relu: -0.0 and NaN pass through
            roots = tl.where(hcol[None, :] == h, v[:, None], roots)
        score = psum_rows(roots, BLOCK_S, BLOCK_H, LEVELS_H)
        tl.store(dst, tl.where(visible, score, float("-inf")), mask=s < C)


@triton.jit
def _order_key(x):
    """``pinned_math.order_key`` moved to [0, 2^32) as an int64 (the radix select's digits)."""
    return order_key(x).to(tl.int64) + 2147483648


@triton.jit
def _select_rows_kernel(
    scores_ptr,  # (T, S) float32, row stride score_stride
    slots_ptr,  # (T,) int64
    rows_ptr,  # (T, W) int64, row stride rows_stride
    count_ptr,  # (T,) int64
    S,
    K,
    W,  # the list's width: K (rows), or K * KPOOL + KPOOL - 1 (pools and a tail)
    score_stride,
    rows_stride,
    BLOCK: tl.constexpr,
    RADIX: tl.constexpr,  # bits per pass; divides 32
    KPOOL: tl.constexpr,  # 1: the scores are rows'; else pools' of KPOOL rows (glm5_next)
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    if KPOOL == 1:
        V = tl.minimum(tl.maximum(slot + 1, 0), S)  # visible rows: [0, V)
        n = tl.minimum(slot + 1, K)  # the list's length (count)
    else:
        V = tl.minimum(tl.maximum((slot + 1) // KPOOL, 0), S)  # complete pools whose last row is <= slot
        n = tl.minimum(V, K)  # the pools listed
    row = scores_ptr + t * score_stride
    lanes = tl.arange(0, BLOCK)
    digits = tl.arange(0, 1 << RADIX)
    chunks = tl.cdiv(V, BLOCK)

    # The n-th largest key: the largest theta with #{key >= theta} >= n, RADIX bits per pass.
    theta = tl.zeros((), tl.int64)
    for p in tl.static_range(32 // RADIX):
        shift = 32 - RADIX * (p + 1)
        cand = theta + (digits.to(tl.int64) << shift)  # (2^RADIX,)
        cnt = tl.zeros((1 << RADIX,), tl.int64)
        for ch in range(0, chunks):
            s = ch * BLOCK + lanes
            m = s < V
            key = _order_key(tl.load(row + s, mask=m, other=0.0))
            ge = (key[:, None] >= cand[None, :]) & m[:, None]
            cnt += tl.sum(ge.to(tl.int64), axis=0)  # integer
        best = tl.max(tl.where(cnt >= n, digits, 0), axis=0)
        theta = theta + (best.to(tl.int64) << shift)

    # Rows above theta all go in; the rest of the list is the lowest-index rows equal to it.
    above = tl.zeros((), tl.int64)
    for ch in range(0, chunks):
        s = ch * BLOCK + lanes
        m = s < V
        key = _order_key(tl.load(row + s, mask=m, other=0.0))
        above += tl.sum(((key > theta) & m).to(tl.int64), axis=0)  # integer
    equal_wanted = n - above
    equal_seen = tl.zeros((), tl.int64)
    listed = tl.zeros((), tl.int64)
    out = rows_ptr + t * rows_stride
    for ch in range(0, chunks):
        s = ch * BLOCK + lanes
        m = s < V
        key = _order_key(tl.load(row + s, mask=m, other=0.0))
        eq = ((key == theta) & m).to(tl.int64)
        eq_rank = tl.cumsum(eq, axis=0) - eq + equal_seen  # integer; equal rows at lower indices
        take = (((key > theta) & m) | ((eq != 0) & (eq_rank < equal_wanted))).to(tl.int64)
        pos = tl.cumsum(take, axis=0) - take + listed  # integer; ascending slot order
        if KPOOL == 1:
            tl.store(out + pos, s.to(tl.int64), mask=take != 0)
        else:  # a listed pool is its KPOOL rows, in order
            j = tl.arange(0, KPOOL)
            tl.store(out + pos[:, None] * KPOOL + j[None, :], s.to(tl.int64)[:, None] * KPOOL + j[None, :],
                     mask=(take[:, None] != 0) & (j[None, :] < KPOOL))
        equal_seen += tl.sum(eq, axis=0)  # integer
        listed += tl.sum(take, axis=0)  # integer
    if KPOOL == 1:
        count = n
    else:  # then the tail: the rows of the slot's own incomplete pool, up to the slot
        jt = tl.arange(0, KPOOL)
        start = ((slot + 1) // KPOOL) * KPOOL
        tail = slot + 1 - start  # in [0, KPOOL)
        tl.store(out + n * KPOOL + jt, start + jt, mask=jt < tail)
        count = n * KPOOL + tail
    # Padding past the list: slot 0.
    for ch in range(count // BLOCK, tl.cdiv(W, BLOCK)):
        j = ch * BLOCK + lanes
        tl.store(out + j, tl.zeros((BLOCK,), tl.int64), mask=(j >= count) & (j < W))
    tl.store(count_ptr + t, count)


# ---- index scores ---------------------------------------------------------------------------------


def _index_scores_one(cfg: MtpConfig, q: Tensor, w: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache,
                      slots: Tensor) -> Tensor:
    """The twin for rows that all read ``cache``."""
    qh = rope_first(rearrange(q, "t (h d) -> t h d", h=cfg.index_n_heads), cos[:, None], sin[:, None], cfg)
    wh = up(w) * index_weight_scale(cfg)
    scores = index_scores(qh, wh, cache.index_rows())  # (T, C)
    C = scores.shape[-1]
    visible = torch.arange(C, device=scores.device)[None, :] <= slots[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def index_scores_torch(cfg: MtpConfig, q: Tensor, w: Tensor, cos: Tensor, sin: Tensor, caches: LayerCache | RowCaches,
                       slots: Tensor) -> Tensor:
    """The twin, from the reference's functions: ``index_queries``' tail (RoPE on the queries,
    the head weights' scale), ``index_scores`` over ``cache.index_rows()``, rows past each slot
    ``-inf``.

    Args:
        q: (T, Hi * D) S, ``wq_b``'s raw output (unrotated).
        w: (T, Hi) S, ``weights_proj``'s raw output.
        cos / sin: (T, R/2) float32, the new rows' angles.
        caches: the paged cache every row reads (a ``LayerCache``), or one per row
            (``paged.RowCaches``: each run of rows in one cache scored as if alone; every cache
            has the same capacity).
        slots: (T,) int64, the new rows' slots.

    Returns ``(T, C)`` float32 scores, C the capacity."""
    parts = [_index_scores_one(cfg, q[rows], w[rows], cos[rows], sin[rows], cache, slots[rows])
             for cache, rows in row_caches(caches).runs(slots.shape[0])]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def index_scores_launch(cfg: MtpConfig, q: Tensor, w: Tensor, cos: Tensor, sin: Tensor, caches: LayerCache | RowCaches,
                        slots: Tensor, out: Tensor, cuda: bool | None = None) -> Launch:
    """The kernel's launch (see ``index_scores_triton``), arguments checked: the one place its grid
    and constexprs are computed. ``cuda``: whether it runs on CUDA (the NaN payload of a rounded
    query); ``None`` reads it off ``out``."""
    Hi, D, R = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    rc = row_caches(caches)
    dtype = rc.caches[0].index_pool.dtype
    if dtype not in INDEX_DTYPES or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"index_scores_triton: cache dtype {dtype} / angle dtype {cos.dtype} is not supported")
    T = q.shape[0]
    if q.shape != (T, Hi * D) or w.shape != (T, Hi) or cos.shape != (T, max(R // 2, 1)) or sin.shape != cos.shape:
        raise ValueError(f"index_scores_triton: q {tuple(q.shape)}, w {tuple(w.shape)}, cos {tuple(cos.shape)} do "
                         f"not fit Hi={Hi}, D={D}, R={R}, T={T}")
    if slots.shape != (T,):
        raise ValueError(f"index_scores_triton: slots must be ({T},), got {tuple(slots.shape)}")
    for name, x in (("q", q), ("w", w)):
        if x.dtype != dtype or x.stride(-1) != 1:
            raise ValueError(f"index_scores_triton: {name} must be {dtype} with a contiguous last dim")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("index_scores_triton: cos/sin must have a contiguous last dim")
    check_row_caches("index_scores_triton", rc, T, None, D)  # the index pools: contiguous (blocks, 16, D)
    C = rc.caches[0].block_table.shape[0] * BLOCK_ROWS
    if out.shape != (T, C) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"index_scores_triton: out must be float32 (T, C) = ({T}, {C})")
    cuda = out.is_cuda if cuda is None else cuda
    block_d = triton.next_power_of_2(D)
    block_h = triton.next_power_of_2(Hi)
    args = (
        q, w, cos, sin, rc.addresses, rc.stride, slots, out,
        C, Hi, D, R, q.stride(0), w.stride(0), cos.stride(0), sin.stride(0), out.stride(0),
        float32_bits(index_weight_scale(cfg)),
    )
    meta = dict(
        INTERLEAVE=cfg.indexer_rope_interleave,
        BLOCK_S=SCORE_BLOCK_S,
        BLOCK_D=block_d,
        LEVELS_D=block_d.bit_length() - 1,
        BLOCK_H=block_h,
        LEVELS_H=block_h.bit_length() - 1,
        TO_BF16=dtype == torch.bfloat16,
        NAN_BITS=0x7FFF if cuda else 0xFFFF,
        ROWS_PER_BLOCK=BLOCK_ROWS,
        enable_fp_fusion=False,
    )
    return Launch(_index_scores_kernel, (triton.cdiv(C, SCORE_BLOCK_S), T), args, meta)


def index_scores_triton(cfg: MtpConfig, q: Tensor, w: Tensor, cos: Tensor, sin: Tensor, caches: LayerCache | RowCaches,
                        slots: Tensor) -> Tensor:
    """The kernel; arguments and result as ``index_scores_torch``, byte-equal to it. ``q``/``w``
    may be row-strided views (contiguous last dim); the pools contiguous; float32 angles. Each
    program reads its row's index pool and block table from the address table
    (``paged.row_pools``), so one launch scores rows of many sequences; a lone ``LayerCache``
    becomes a one-line table (a host-to-device copy: capturable callers pass a ``RowCaches``)."""
    rc = row_caches(caches)
    C = rc.caches[0].block_table.shape[0] * BLOCK_ROWS
    out = torch.empty(q.shape[0], C, dtype=torch.float32, device=q.device)
    if out.numel() > 0:
        index_scores_launch(cfg, q, w, cos, sin, rc, slots, out).run()
    return out


# ---- selection ------------------------------------------------------------------------------------


def select_rows_torch(scores: Tensor, slots: Tensor, topk: int,
                      out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The twin: ``indexer.select_rows`` itself (copied into ``out`` when given)."""
    return into(out, *select_rows(scores, slots, topk))


def into(out: tuple[Tensor, Tensor] | None, rows: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """``(rows, count)``, or copied into ``out`` (the same shapes) and ``out`` returned: the
    twins' form of the kernels' ``out`` argument."""
    if out is None:
        return rows, count
    if out[0].shape != rows.shape or out[1].shape != count.shape:
        raise ValueError(f"out: a ({tuple(rows.shape)}, {tuple(count.shape)}) selection, got "
                         f"({tuple(out[0].shape)}, {tuple(out[1].shape)})")
    out[0].copy_(rows)
    out[1].copy_(count)
    return out


def select_rows_launch(scores: Tensor, slots: Tensor, rows: Tensor, count: Tensor, kpool: int = 1,
                       topk: int | None = None) -> Launch:
    """The kernel's launch for ``scores`` (T, S) float32 into ``rows`` (T, K) and ``count`` (T,),
    int64: the one place its grid and constexprs are computed. ``kpool`` > 1: the scores are pools'
    of ``kpool`` rows (``kpool.select_pool_rows_launch``), ``topk`` pools listed, and ``rows`` is
    (T, topk * kpool + kpool - 1)."""
    T, S = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise TypeError(f"select_rows_triton: scores must be float32 with a contiguous last dim, got {scores.dtype}")
    if slots.shape != (T,) or slots.dtype != torch.int64:
        raise ValueError(f"select_rows_triton: slots must be int64 ({T},)")
    W = rows.shape[1]
    K = W if kpool == 1 else topk
    if kpool != 1 and (topk is None or W != topk * kpool + kpool - 1):
        raise ValueError(f"select_rows_triton: pools of {kpool} rows need topk and a list of topk * kpool + kpool "
                         "- 1 rows")
    if (
        rows.shape != (T, W)
        or rows.dtype != torch.int64
        or rows.stride(-1) != 1
        or count.shape != (T,)
        or count.dtype != torch.int64
    ):
        raise ValueError("select_rows_triton: rows must be int64 (T, K), count int64 (T,)")
    args = (scores, slots, rows, count, S, K, W, scores.stride(0), rows.stride(0))
    meta = dict(BLOCK=SELECT_BLOCK, RADIX=RADIX_BITS, KPOOL=kpool, enable_fp_fusion=False)
    return Launch(_select_rows_kernel, (T,), args, meta)


def select_rows_triton(scores: Tensor, slots: Tensor, topk: int,
                       out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The kernel for ``indexer.select_rows``: ``rows`` (T, K) int64 and ``count`` (T,) int64,
    ``K = min(topk, S)``, byte-equal to it. No host reads: the lengths stay on the device.
    ``out``: buffers of those shapes the kernel writes (a selection kept for later steps)."""
    T, S = scores.shape
    K = min(topk, S)
    if out is not None:
        rows, count = out
        if rows.shape != (T, K):
            raise ValueError(f"select_rows_triton: out's rows must be ({T}, {K}), got {tuple(rows.shape)}")
    else:
        rows = torch.empty(T, K, dtype=torch.int64, device=scores.device)
        count = torch.empty(T, dtype=torch.int64, device=scores.device)
    if T > 0:
        select_rows_launch(scores, slots, rows, count).run()
    return rows, count


# ---- audit ----------------------------------------------------------------------------------------


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The drafter's launches at ``cfg`` with a ``dtype`` cache, on abstract tensors (see
    ``glm_mtp.tools.audit``): ``step`` one new row, ``rows`` 8 (catch-up, a batched drafter);
    queries and head weights as fresh GEMV outputs, angles gathered per row, the pool from
    ``LayerCache.allocate`` at ``AUDIT_CAPACITY`` rows; ``batch`` (``index_scores``): a batched
    draft step, ``BATCH_ROWS`` rows each in its own cache (an address table of one line per row,
    stride 3). Only ``INDEX_DTYPES`` caches take them."""
    if dtype not in INDEX_DTYPES:
        return []
    Hi, D, R = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    cache = LayerCache.allocate(cfg, AUDIT_CAPACITY // BLOCK_ROWS, dtype, "meta")
    C = cache.capacity
    K = min(cfg.index_topk, C)
    out = []
    for variant, T in (("step", 1), ("rows", 8), ("batch", BATCH_ROWS)):
        slots = abstract((T,), torch.int64)
        angles = abstract((T, max(R // 2, 1)), torch.float32)
        scores = abstract((T, C), torch.float32)
        # One cache for every row: a one-line address table read with stride 0; a batch: one line per row.
        caches = RowCaches((cache,) * T, abstract((T, ADDRESS_COLUMNS), torch.int64)) if variant == "batch" else \
            RowCaches((cache,), abstract((1, ADDRESS_COLUMNS), torch.int64))
        out.append(AuditLaunch("index_scores", variant, index_scores_launch(
            cfg, abstract((T, Hi * D), dtype), abstract((T, Hi), dtype), angles, angles, caches, slots, scores,
            cuda=True)))
        if variant != "batch":  # select_rows reads no cache: a batch launches it as ``rows`` does
            out.append(AuditLaunch("select_rows", variant, select_rows_launch(
                scores, slots, abstract((T, K), torch.int64), abstract((T,), torch.int64))))
    return out
