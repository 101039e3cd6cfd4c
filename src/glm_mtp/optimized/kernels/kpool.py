"""The KPool indexer of GLM-5.3-Flash (DESIGN.md §7) as kernels: the pooled-key write (every new
row that completes its pool computes that pool's key from the pool's rows' index keys and gates
and stores it, with the pool marked complete) and the pool scores of new rows over their visible
complete pools.

Pool scores replace ``kpool_queries``' weights and ``pool_scores`` (then the visibility mask of
``select_pool_rows``)::

    w[h]    = up(w_raw[h]) * Hi^-1/2                                   (a float32 constant)
    I(t, p) = psum_h(w[h] * relu(psum_d(up(q[h, d]) * up(pk[p, d])) * D^-1/2))   p < (slot + 1) // kp

and ``-inf`` for every other pool; the programs past a row's visible pools load nothing, so the
loads are O(visible pools), never the capacity's.

The pool selection (``select_pool_rows``) reuses GLM-5's top-k kernel (``indexer.select_rows``'s:
the same ``topk_indices`` ties to the lower index, listed ascending) on the pools, as rows
``[0, n_visible)`` of a row ``n_visible - 1``, then expands each listed pool to its kp rows and
appends the tail ``[kp * n_visible, slot]``: integer index arithmetic only, no host read.

Replaces, in ``glm_mtp.reference.kpool.write_pools`` (after the gates are stored)::

    l[j, c]  = up(g[kp p + j, c]) + up(ape[j, c])                      (A)
    pk[p, c] = round_S(psum_j(softmax_j(l[:, c])[j] * up(k[kp p + j, c])))

Exact by construction (DESIGN.md §5): the softmax is ``numerics.softmax`` operation by operation
(an exact max, ``pinned_math.exp_f32``, the ``psum`` tree over the kp positions with ``tl.split``
levels, ``div_rn``); products and sums rounded once each (``enable_fp_fusion=False``); bfloat16
rounded on the bits. Only a row whose slot is its pool's last stores, and only where the device
flag ``ok`` is set: a pool has one last row, so no two programs store the same pool. Index rows
are read through the block table of the paged cache (``LayerCache``), gates from the dense
``KPoolCache.gates``; both must already hold the pool's rows (the reference's order).
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
from glm_mtp.reference.state import BLOCK_ROWS
from glm_mtp.reference.weights import IndexerWeights

from .launch import AuditLaunch, Launch, abstract
from .pinned_math import exp_f32, psum_rows
from .rounding import float32_bits, round_to_storage

# Storage dtypes the kernel takes (its A is float32).
KPOOL_DTYPES = (torch.float32, torch.bfloat16)
# The key channels one program covers (the tile is (BLOCK_C, kp)).
MAX_BLOCK_C = 128


@triton.jit
def _pool_keys_kernel(
    slots_ptr,  # (T,) int64
    ok_ptr,  # (1,) bool
    index_ptr,  # (blocks, 16, D) S, contiguous
    table_ptr,  # (blocks,) int32
    gates_ptr,  # (capacity, D) S, contiguous
    ape_ptr,  # (KP, D) S, contiguous
    keys_ptr,  # (pools, D) S out, contiguous
    complete_ptr,  # (pools,) bool out
    D,
    KP: tl.constexpr,  # index_kpool, a power of two
    LEVELS: tl.constexpr,  # log2(KP)
    BLOCK_C: tl.constexpr,
    TO_BF16: tl.constexpr,
    NAN_BITS: tl.constexpr,
):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    slot = tl.load(slots_ptr + t)
    ok = tl.load(ok_ptr).to(tl.int1)
    done = ok & ((slot + 1) % KP == 0)  # this row completes its pool
    if done:
        pool = slot // KP
        j = tl.arange(0, KP)  # (KP,)
        rows = pool * KP + j  # (KP,) int64
        block = tl.load(table_ptr + rows // 16).to(tl.int64)
        c_in = c < D
        m2 = c_in[:, None] & (j[None, :] >= 0)  # (BLOCK_C, KP)
        idx_off = (block * 16 + rows % 16)[None, :] * D + c[:, None]  # (BLOCK_C, KP)
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
            tl.store(complete_ptr + pool, tl.full((), 1, tl.int1))


@triton.jit
def _pool_scores_kernel(
    q_ptr,  # (T, Hi * D) S, the raw wq_b output (no RoPE), row stride q_stride
    w_ptr,  # (T, Hi) S, the raw weights_proj output, row stride w_stride
    keys_ptr,  # (P, D) S pooled keys, contiguous
    slots_ptr,  # (T,) int64
    out_ptr,  # (T, P) float32, row stride out_stride
    P,
    Hi,
    D,
    KP,
    q_stride,
    w_stride,
    out_stride,
    head_scale_bits,  # int32: float32(Hi^-1/2)
    dot_scale_bits,  # int32: float32(D^-1/2)
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LEVELS_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    LEVELS_H: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t)
    n_vis = (slot + 1) // KP  # complete pools whose last row is <= slot
    p = b * BLOCK_P + tl.arange(0, BLOCK_P)
    dst = out_ptr + t * out_stride + p
    if b * BLOCK_P >= n_vis:  # no visible pool here: -inf, nothing loaded
        tl.store(dst, tl.full((BLOCK_P,), float("-inf"), tl.float32), mask=p < P)
    else:
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
        tl.store(dst, tl.where(visible, score, float("-inf")), mask=p < P)


def pool_scores_launch(kp: int, n_heads: int, q: Tensor, w: Tensor, keys: Tensor, slots: Tensor, out: Tensor) -> Launch:
    """The launch: grid (pool blocks, T rows)."""
    (P, D), T = keys.shape, slots.shape[0]
    block_d, block_h = next_pow2(D), next_pow2(n_heads)
    block_p = max(1, min(next_pow2(max(P, 1)), max(1, 4096 // block_d)))
    args = (q, w, keys, slots, out, P, n_heads, D, kp, q.stride(0), w.stride(0), out.stride(0),
            float32_bits(n_heads**-0.5), float32_bits(D**-0.5))
    meta = dict(BLOCK_P=block_p, BLOCK_D=block_d, LEVELS_D=block_d.bit_length() - 1, BLOCK_H=block_h,
                LEVELS_H=block_h.bit_length() - 1, enable_fp_fusion=False)
    return Launch(_pool_scores_kernel, (triton.cdiv(max(P, 1), block_p), T), args, meta)


def pool_scores_torch(cfg: MtpConfig, q_raw: Tensor, w_raw: Tensor, keys: Tensor, slots: Tensor) -> Tensor:
    """The twin: ``kpool_queries``' head weights from ``w_raw`` (T, Hi) S, ``pool_scores`` of the
    queries ``q_raw`` (T, Hi * D) S against ``keys`` (P, D), and ``-inf`` past each row's visible
    complete pools (``select_pool_rows``' mask). Returns (T, P) float32."""
    q = rearrange(q_raw, "t (h d) -> t h d", h=cfg.index_n_heads)
    w = up(w_raw) * cfg.index_n_heads**-0.5
    scores = pool_scores(q, w, keys, cfg)  # (T, P)
    visible = torch.arange(keys.shape[0], device=slots.device)[None, :] < ((slots + 1) // cfg.index_kpool)[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def pool_scores_triton(cfg: MtpConfig, q_raw: Tensor, w_raw: Tensor, keys: Tensor, slots: Tensor) -> Tensor:
    """The kernel for ``pool_scores_torch``: one launch, byte-equal to it."""
    name = "pool_scores_triton"
    Hi, D = cfg.index_n_heads, cfg.index_head_dim
    T = slots.shape[0]
    if q_raw.shape != (T, Hi * D) or w_raw.shape != (T, Hi) or keys.dim() != 2 or keys.shape[1] != D:
        raise ValueError(f"{name}: q_raw (T, Hi*D) = ({T}, {Hi * D}), w_raw ({T}, {Hi}), keys (P, {D}) expected, got "
                         f"{tuple(q_raw.shape)}, {tuple(w_raw.shape)}, {tuple(keys.shape)}")
    if q_raw.dtype not in KPOOL_DTYPES or w_raw.dtype != q_raw.dtype or keys.dtype != q_raw.dtype:
        raise TypeError(f"{name}: q_raw, w_raw and keys must share one of {KPOOL_DTYPES}")
    q_raw, w_raw, keys = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_raw, w_raw, keys))
    keys = keys.contiguous()
    out = torch.empty(T, keys.shape[0], dtype=torch.float32, device=keys.device)
    if T and keys.shape[0]:
        pool_scores_launch(cfg.index_kpool, Hi, q_raw, w_raw, keys, slots, out).run()
    return out


def expand_pools(cfg: MtpConfig, pools: Tensor, n_pools: Tensor, slots: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """The row lists of ``select_pool_rows`` from the listed pools ``pools`` (T, Kp) ascending
    (the first ``n_pools`` (T,) entries listed) and the rows' ``slots`` (T,): each listed pool's kp
    rows, then the tail ``[kp * ((slot + 1) // kp), slot]``, padding 0, in ``width`` columns.
    Returns ``rows`` (T, width) int64 and ``count`` (T,) int64."""
    kp, dev = cfg.index_kpool, slots.device
    i = torch.arange(width, device=dev)[None, :]  # (1, W)
    in_pools = n_pools[:, None] * kp  # (T, 1): the listed pools' rows come first
    which = (i // kp).clamp(max=max(pools.shape[1] - 1, 0))
    pool_row = pools.gather(1, which.expand(slots.shape[0], width)) * kp + i % kp if pools.shape[1] else torch.zeros_like(i)
    tail_start = ((slots + 1) // kp * kp)[:, None]  # (T, 1)
    tail_len = (slots[:, None] + 1 - tail_start)  # (T, 1), in [0, kp)
    tail_row = tail_start + (i - in_pools)
    count = in_pools + tail_len  # (T, 1)
    rows = torch.where(i < in_pools, pool_row, torch.where(i < count, tail_row, 0))
    return rows, count[:, 0]


def select_pool_rows_torch(cfg: MtpConfig, scores: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """The twin: the reference's ``kpool.select_pool_rows`` on the scores ``(T, P)`` of every pool."""
    return select_pool_rows(scores, slots, cfg)


def select_pool_rows_triton(cfg: MtpConfig, scores: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """``select_pool_rows_torch`` through GLM-5's top-k kernel on the pools (``select_rows_triton``:
    the best ``min(index_topk / kp, visible)`` pools, ties to the lower id, ascending) and
    ``expand_pools``; byte-equal to the twin. ``rows`` (T, Kp * kp + kp - 1), ``count`` (T,)."""
    from .indexer import select_rows_triton  # the GLM-5 kernel, shared

    kp = cfg.index_kpool
    T, P = scores.shape
    Kp = min(cfg.kpool_pools_selected, P)
    pools, n_pools = select_rows_triton(scores.contiguous(), (slots + 1) // kp - 1, Kp)  # (T, Kp), (T,)
    return expand_pools(cfg, pools, n_pools, slots, Kp * kp + kp - 1)


def _check(cfg: MtpConfig, ape: Tensor, slots: Tensor, index_pool: Tensor, block_table: Tensor, gates: Tensor,
           keys: Tensor, complete: Tensor, ok: Tensor) -> None:
    name = "pool_keys_write_triton"
    kp, D = cfg.index_kpool, cfg.index_head_dim
    if kp < 2 or kp & (kp - 1) or BLOCK_ROWS % kp:
        raise ValueError(f"{name}: index_kpool must be a power of two in [2, {BLOCK_ROWS}], got {kp}")
    dt = index_pool.dtype
    if dt not in KPOOL_DTYPES:
        raise TypeError(f"{name}: storage dtype must be one of {KPOOL_DTYPES}, got {dt}")
    for arg, x, shape in (("ape", ape, (kp, D)), ("gates", gates, (gates.shape[0], D)), ("keys", keys, (keys.shape[0], D)),
                          ("index_pool", index_pool, (index_pool.shape[0], BLOCK_ROWS, D))):
        if tuple(x.shape) != shape or x.dtype != dt or not x.is_contiguous():
            raise ValueError(f"{name}: {arg} must be a contiguous {shape} {dt} tensor, got {tuple(x.shape)} {x.dtype}")
    if slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"{name}: slots must be (T,) int64, got {tuple(slots.shape)} {slots.dtype}")
    if complete.dtype != torch.bool or complete.shape != (keys.shape[0],):
        raise ValueError(f"{name}: complete must be ({keys.shape[0]},) bool, got {tuple(complete.shape)} {complete.dtype}")
    if ok.dtype != torch.bool or ok.numel() != 1:
        raise ValueError(f"{name}: ok must be one bool, got {tuple(ok.shape)} {ok.dtype}")
    if block_table.dtype != torch.int32 or block_table.dim() != 1:
        raise ValueError(f"{name}: block_table must be (blocks,) int32, got {tuple(block_table.shape)} {block_table.dtype}")


def pool_keys_write_launch(kp: int, ape: Tensor, slots: Tensor, index_pool: Tensor, block_table: Tensor,
                           gates: Tensor, keys: Tensor, complete: Tensor, ok: Tensor, cuda: bool | None = None) -> Launch:
    """The launch at pools of ``kp`` rows: grid (T rows, key-channel blocks)."""
    D = keys.shape[1]
    block_c = min(next_pow2(D), MAX_BLOCK_C)
    cuda = keys.is_cuda if cuda is None else cuda
    args = (slots, ok, index_pool, block_table, gates, ape, keys, complete, D)
    meta = dict(KP=kp, LEVELS=kp.bit_length() - 1, BLOCK_C=block_c, TO_BF16=keys.dtype == torch.bfloat16,
                NAN_BITS=0x7FFF if cuda else 0xFFFF, enable_fp_fusion=False)
    return Launch(_pool_keys_kernel, (slots.shape[0], triton.cdiv(D, block_c)), args, meta)


def pool_keys_write_triton(cfg: MtpConfig, ix: IndexerWeights, slots: Tensor, index_pool: Tensor, block_table: Tensor,
                           gates: Tensor, keys: Tensor, complete: Tensor, ok: Tensor) -> None:
    """Store the key of every pool a row at ``slots`` (T,) completes into ``keys`` (pools, D),
    marking it in ``complete`` (pools,) bool, only where ``ok`` (1,) bool is set. The pools' index
    rows (``index_pool`` through ``block_table``) and gates (``gates`` (capacity, D)) are read as
    stored. One launch, byte-equal to ``pool_keys_write_torch``."""
    _check(cfg, ix.kpool_ape, slots, index_pool, block_table, gates, keys, complete, ok)
    if slots.shape[0]:
        pool_keys_write_launch(cfg.index_kpool, ix.kpool_ape, slots, index_pool, block_table, gates, keys, complete, ok).run()


def pool_keys_write_torch(cfg: MtpConfig, ix: IndexerWeights, slots: Tensor, index_pool: Tensor, block_table: Tensor,
                          gates: Tensor, keys: Tensor, complete: Tensor, ok: Tensor) -> None:
    """The twin: ``reference.kpool.pooled_keys`` of every row's own pool (the rows read through the
    block table), stored only where the row completes its pool and ``ok`` is set. A pool has one
    last row, so each pool takes at most one row's key: chosen by a one-hot match rather than a
    scatter of duplicates (whose order is not defined), with no host read."""
    kp, dev = cfg.index_kpool, slots.device
    pool = slots // kp  # (T,)
    rows = pool[:, None] * kp + torch.arange(kp, device=dev)  # (T, kp): the row's pool
    block = block_table[rows // BLOCK_ROWS].long()
    new = pooled_keys(ix, index_pool[block, rows % BLOCK_ROWS], gates[rows])  # (T, D): meaningful where the pool is full
    done = ((slots + 1) % kp == 0) & ok  # (T,)
    hit = (pool[:, None] == torch.arange(keys.shape[0], device=dev)) & done[:, None]  # (T, P)
    which = hit.to(torch.int64).argmax(dim=0)  # (P,): the row completing pool p (any, where none does)
    stored = hit.any(dim=0)  # (P,)
    keys.copy_(torch.where(stored[:, None], new[which], keys))
    complete.copy_(complete | stored)


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The launch at ``cfg``'s index width with ``dtype`` storage, on abstract tensors: a draft
    step (``step``: 1 row) and a prefill chunk (``rows``: 8 rows). Pools of ``index_kpool`` rows
    (a GLM-5 config, which has none, audits the release's 16: the kernel compiles the same)."""
    if dtype not in KPOOL_DTYPES:
        return []
    D, kp, blocks = cfg.index_head_dim, cfg.index_kpool if cfg.is_next else 16, 64
    capacity = blocks * BLOCK_ROWS
    out = []
    for variant, T in (("step", 1), ("rows", 8)):
        launch = pool_keys_write_launch(
            kp, abstract((kp, D), dtype), abstract((T,), torch.int64), abstract((blocks, BLOCK_ROWS, D), dtype),
            abstract((blocks,), torch.int32), abstract((capacity, D), dtype), abstract((capacity // kp, D), dtype),
            abstract((capacity // kp,), torch.bool), abstract((1,), torch.bool), cuda=True)
        out.append(AuditLaunch("kpool:pool_keys_write", variant, launch))
        Hi = cfg.index_n_heads
        scores = pool_scores_launch(kp, Hi, abstract((T, Hi * D), dtype), abstract((T, Hi), dtype),
                                    abstract((capacity // kp, D), dtype), abstract((T,), torch.int64),
                                    abstract((T, capacity // kp), torch.float32))
        out.append(AuditLaunch("kpool:pool_scores", variant, scores))
    return out
