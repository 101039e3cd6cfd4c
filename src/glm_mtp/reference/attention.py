"""DSA attention: multi-head latent attention (MLA) over the rows the lightning indexer selects.

The cache holds, per row, the normalised KV latent ``c`` and the rotated rope key ``k_pe``
(``kv_rows``). Keys and values are never expanded: the query's no-RoPE part is absorbed into the
latent space through ``kv_b_proj``'s key half, and the output leaves it through the value half,

    q_abs[h]    = W_uk[h]^T q_nope[h]                               (A, per head)
    score(t, s) = (dot(q_abs, c_s) + dot(q_pe, k_pe_s)) * qk_head_dim^-1/2
    out_t[h]    = W_uv[h] (psum_s softmax(score)_s c_s)

over row t's list of selected rows in ascending slot order (``indexer.select_rows``; in the
glm5_next family ``kpool.kpool_rows``, with NoPE: ``qk_rope_head_dim = 0``, so ``k_pe`` and
``q_pe`` are empty and their dot is the empty sum ``+0.0``): the same
math as attending with expanded keys and values, at a cost of O(index_topk) per row whatever the
row capacity. Pinned (DESIGN.md §5): every sum is a ``psum`` in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from einops import rearrange
from torch import Tensor

from .config import MtpConfig
from .indexer import index_keys_from, index_queries, index_scores, select_rows, selection_mask
from .kpool import kpool_rows
from .layers import apply_rope, rope_table
from .fp8 import weight_values
from .numerics import (PINNED, Numerics, acc_dtype, dot, linear_acc, list_softmax, next_pow2, plain_weight, psum,
                       psum_prefix, up)
from .sharing import SharedSelection
from .state import LayerCache
from .weights import AttentionWeights, IndexerWeights, MtpWeights

# RMSNorm epsilon of q_a_layernorm and kv_a_layernorm, fixed by GLM-5's architecture (glm5_next
# uses its rms_norm_eps: ``MtpConfig.latent_norm_eps`` says which).
LATENT_NORM_EPS = 1e-6
# Bounds the (rows, heads, listed rows, latent) products the pinned attention holds at once.
ATTENTION_CHUNK_ELEMENTS = 1 << 24


@dataclass
class Rope:
    """The RoPE table of one row space: ``cos``/``sin`` (capacity, qk_rope_head_dim // 2) in the
    acc dtype of the weights (float32, or float64 for float64 weights)."""

    cos: Tensor
    sin: Tensor

    @classmethod
    def build(cls, cfg: MtpConfig, capacity: int, device: torch.device | str,
              dtype: torch.dtype = torch.float32) -> Rope:
        return cls(*rope_table(capacity, cfg.qk_rope_head_dim, cfg.rope_theta, device, acc_dtype(dtype)))

    def at(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """The angles of rows at ``slots`` (T,): a row's RoPE position is its slot."""
        return self.cos[slots], self.sin[slots]


def latent_query(attn: AttentionWeights, cfg: MtpConfig, a: Tensor, cos: Tensor, sin: Tensor,
                 ops: Numerics = PINNED) -> tuple[Tensor, Tensor, Tensor]:
    """The queries of new rows ``a`` (T, H): ``q_latent`` (T, Lq), the normed low-rank query the
    indexer shares; ``q_nope`` (T, nh, nope) and the rotated ``q_pe`` (T, nh, R), split nope-first."""
    q_latent = ops.rms_norm(ops.linear(a, attn.q_a_proj), attn.q_a_layernorm, cfg.latent_norm_eps)  # (T, Lq)
    # (T, nh, nope + R)
    q = rearrange(ops.linear(q_latent, attn.q_b_proj), "t (h d) -> t h d", h=cfg.num_attention_heads)
    nope = cfg.qk_nope_head_dim
    return q_latent, q[..., :nope], apply_rope(q[..., nope:], cos[:, None], sin[:, None], cfg.rope_interleave)


def row_projections(attn: AttentionWeights, a: Tensor, ops: Numerics = PINNED) -> tuple[Tensor, Tensor]:
    """The raw projections of new rows ``a`` (T, H) that their cache rows are made of:
    ``kv = kv_a_proj_with_mqa(a)`` (T, Lkv + R) and the indexer's ``k = wk(a)`` (T, D)."""
    return ops.linear(a, attn.kv_a_proj_with_mqa), ops.linear(a, attn.indexer.wk)


def normed_latent(attn: AttentionWeights, cfg: MtpConfig, kv: Tensor, ops: Numerics = PINNED) -> Tensor:
    """``kv_a_layernorm`` of the latent part of ``kv`` (T, Lkv + R): the cached latent (T, Lkv)."""
    return ops.rms_norm(kv[:, : cfg.kv_lora_rank], attn.kv_a_layernorm, cfg.latent_norm_eps)


def cache_rows(attn: AttentionWeights, cfg: MtpConfig, kv: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
               ops: Numerics = PINNED) -> tuple[Tensor, Tensor]:
    """What new rows store, from their raw projections ``kv``/``k`` (``row_projections``): the
    KV row (T, Lkv + R), the normalised latent then the rotated rope key shared by the heads,
    and the indexer key (T, D)."""
    k_pe = apply_rope(kv[:, cfg.kv_lora_rank :], cos, sin, cfg.rope_interleave)
    return (torch.cat((normed_latent(attn, cfg, kv, ops), k_pe), dim=-1),
            index_keys_from(attn.indexer, cfg, k, cos, sin, ops))


def new_cache_rows(attn: AttentionWeights, cfg: MtpConfig, a: Tensor, cos: Tensor, sin: Tensor,
                   ops: Numerics = PINNED) -> tuple[Tensor, Tensor]:
    """What new rows ``a`` (T, H) store: ``cache_rows`` of their ``row_projections``."""
    return cache_rows(attn, cfg, *row_projections(attn, a, ops), cos, sin, ops)


def write_cache_rows(attn: AttentionWeights, cfg: MtpConfig, kv: Tensor, k: Tensor, slots: Tensor, rope: Rope,
                     cache: LayerCache, ops: Numerics = PINNED) -> None:
    """The default ``WriteRowsFn``: ``cache_rows`` at the rows' angles, then ``cache.write``."""
    cache.write(slots, *cache_rows(attn, cfg, kv, k, *rope.at(slots), ops))


# How one call's new rows reach the cache, from their raw projections (``row_projections``):
# ``write_rows(attn, cfg, kv (T, Lkv + R), k (T, D), slots (T,), rope, cache, ops) -> None``. It
# must store exactly ``cache_rows``' values at ``slots`` (the default, ``write_cache_rows``); the
# optimized drafter passes its fused RoPE + paged write, gated by a device flag.
WriteRowsFn = Callable[[AttentionWeights, MtpConfig, Tensor, Tensor, Tensor, Rope, LayerCache, Numerics], None]

# How the KPool indexer (glm5_next) lists new rows' attended rows, its pool writes included:
# ``kpool(ix, cfg, a (T, H), q_latent (T, Lq), slots (T,), cache, ops) -> (rows (T, K), count (T,))``.
# A shared draft step (DESIGN.md §9) calls it with one more keyword, ``shared=(rows, count)``
# (step 1's selection): it then writes the row's gate and pooled key as always, runs none of the
# query side, and returns its selection (``kpool.kpool_rows`` returns ``shared``; the dense
# ablation ``kpool.kpool_all_rows`` still lists every visible row). It must store and return
# exactly ``kpool.kpool_rows``' values (the default); the optimized drafter passes one gated by a
# device flag, with no host read.
class KPoolRowsFn(Protocol):
    def __call__(self, ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, slots: Tensor,
                 cache: LayerCache, ops: Numerics, shared: tuple[Tensor, Tensor] | None = None,
                 ) -> tuple[Tensor, Tensor]: ...


def split_kv_b(attn: AttentionWeights, cfg: MtpConfig, acc: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Views of ``kv_b_proj`` per head: the key half ``W_uk`` (nh, nope, Lkv) and the value half
    ``W_uv`` (nh, v, Lkv). A block-scaled ``kv_b_proj`` gives its values in ``acc`` instead
    (``fp8.weight_values``: these products sum over its rows, across its scale blocks)."""
    # (nh, nope + v, Lkv)
    w_kv = rearrange(weight_values(attn.kv_b_proj, acc), "(h d) c -> h d c", h=cfg.num_attention_heads)
    return w_kv[:, : cfg.qk_nope_head_dim], w_kv[:, cfg.qk_nope_head_dim :]


def absorb_query(attn: AttentionWeights, cfg: MtpConfig, q_nope: Tensor) -> Tensor:
    """The absorbed query ``q_abs`` (T, nh, Lkv) in A of ``q_nope`` (T, nh, nope):
    ``q_abs[t, h, c] = dot(q_nope[t, h], W_uk[h, :, c])`` (a ``psum`` over nope)."""
    w_uk = rearrange(split_kv_b(attn, cfg, acc_dtype(q_nope.dtype))[0], "h n c -> h c n")  # (nh, Lkv, nope)
    nh, Lkv, nope = w_uk.shape
    per_chunk = max(1, ATTENTION_CHUNK_ELEMENTS // max(1, nh * Lkv * nope))
    # rows are independent: chunks bound the products held
    return torch.cat([dot(q_nope[t0 : t0 + per_chunk, :, None, :], w_uk)
                      for t0 in range(0, q_nope.shape[0], per_chunk)])


def mla_over_lists(attn: AttentionWeights, cfg: MtpConfig, q_abs: Tensor, q_pe: Tensor, kv_rows: Tensor,
                   rows: Tensor, count: Tensor) -> Tensor:
    """Pinned MLA of new rows over their lists from the absorbed query: ``q_abs`` (T, nh, Lkv)
    in A (``absorb_query``), ``q_pe`` (T, nh, R) in S, the cache's ``kv_rows`` (S, Lkv + R), the
    lists ``rows`` (T, K) and their lengths ``count`` (T,) from ``select_rows``. Returns the
    heads' outputs ``(T, nh * v)`` in S."""
    Lkv = cfg.kv_lora_rank
    T, nh = q_abs.shape[:2]
    K = rows.shape[1]
    w_uv = split_kv_b(attn, cfg, acc_dtype(q_pe.dtype))[1]
    scale = cfg.qk_head_dim**-0.5
    per_chunk = max(1, ATTENTION_CHUNK_ELEMENTS // max(1, nh * K * Lkv))
    outs = []
    for t0 in range(0, T, per_chunk):  # rows are independent: chunks bound the products held
        t = slice(t0, t0 + per_chunk)
        listed = kv_rows[rows[t]]  # (t, K, Lkv + R), ascending slots
        c, k_pe = listed[..., :Lkv], listed[..., Lkv:]
        scores = (dot(q_abs[t, :, None, :], c[:, None]) + dot(q_pe[t, :, None, :], k_pe[:, None])) * scale  # (t, nh, K)
        n = count[t, None]  # (t, 1): every head of a row has that row's list
        scores = scores.masked_fill(torch.arange(K, device=rows.device) >= n[..., None], float("-inf"))
        p = list_softmax(scores, n)  # (t, nh, K), +0.0 past the list
        out_latent = psum_prefix(p[:, :, None, :] * rearrange(up(c), "t k c -> t 1 c k"), n[..., None])  # (t, nh, Lkv)
        outs.append(dot(out_latent[:, :, None, :], w_uv))  # (t, nh, v)
    return rearrange(torch.cat(outs), "t h v -> t (h v)").to(q_pe.dtype)


def sparse_mla(attn: AttentionWeights, cfg: MtpConfig, q_nope: Tensor, q_pe: Tensor, kv_rows: Tensor,
               rows: Tensor, count: Tensor) -> Tensor:
    """Pinned MLA of new rows over their lists: ``q_nope`` (T, nh, nope), ``q_pe`` (T, nh, R),
    the cache's ``kv_rows`` (S, Lkv + R), the lists ``rows`` (T, K) and their lengths ``count``
    (T,) from ``select_rows``. Returns the heads' outputs ``(T, nh * v)`` in S:
    ``mla_over_lists`` of ``absorb_query``."""
    return mla_over_lists(attn, cfg, absorb_query(attn, cfg, q_nope), q_pe, kv_rows, rows, count)


def dense_mla(attn: AttentionWeights, cfg: MtpConfig, q_nope: Tensor, q_pe: Tensor, kv_rows: Tensor,
              chosen: Tensor) -> Tensor:
    """MLA with torch's kernels (training, the experiments' target): the same math as
    ``sparse_mla`` as one masked softmax over every row read, ``chosen`` (T, S) bool."""
    nope, Lkv = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    acc = acc_dtype(q_nope.dtype)
    rows = kv_rows.to(acc)
    c_all, k_pe_all = rows[:, :Lkv], rows[:, Lkv:]
    # (nh, nope + v, Lkv)
    w_kv = rearrange(plain_weight(attn.kv_b_proj), "(h d) c -> h d c", h=cfg.num_attention_heads).to(acc)
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    q_absorbed = torch.einsum("thn,hnc->thc", q_nope.to(acc), w_uk)  # (T, nh, Lkv)
    scores = torch.einsum("thc,sc->ths", q_absorbed, c_all) + torch.einsum("thr,sr->ths", q_pe.to(acc), k_pe_all)
    scores = (scores * cfg.qk_head_dim**-0.5).masked_fill(~chosen[:, None, :], float("-inf"))  # (T, nh, S)
    probs = torch.softmax(scores, dim=-1)
    out_latent = torch.einsum("ths,sc->thc", probs, c_all)  # (T, nh, Lkv)
    out = torch.einsum("thc,hvc->thv", out_latent, w_uv)  # (T, nh, v)
    return rearrange(out, "t h v -> t (h v)").to(q_nope.dtype)


def output_projection(attn: AttentionWeights, cfg: MtpConfig, out: Tensor, ops: Numerics = PINNED) -> Tensor:
    """``o_proj`` on the heads' outputs ``out`` (T, nh * v).

    Row-parallel (``attn.shard`` set; pinned numerics, a power-of-two world), rank r holds the
    input columns of the r-th aligned subtree of the ``psum`` over ``nh * v``
    (``ShardSpec.o_proj_columns``): it sums its slice as that subtree, the ranks' partials are
    gathered and summed in tree order, so the result is the single-rank one bit for bit."""
    if attn.shard is None:
        return ops.linear(out, attn.o_proj)
    K = out.shape[-1]
    cols, subtree = attn.shard.o_proj_columns(K), attn.shard.o_proj_subtree(K)
    partial = linear_acc(out[:, cols], attn.o_proj)  # (T, H), A: the slice's own tree
    if next_pow2(cols.stop - cols.start) < subtree:
        partial = partial + 0.0  # the subtree's +0.0 padding levels (they turn -0.0 into +0.0)
    parts = attn.shard.all_gather(partial)  # (world, T, H), rank order = tree order
    return psum(rearrange(parts, "w t h -> t h w")).to(out.dtype)


def dsa_attention(attn: AttentionWeights, cfg: MtpConfig, a: Tensor, slots: Tensor, cache: LayerCache, rope: Rope,
                  rows_read: int | None = None, ops: Numerics = PINNED, write_rows: WriteRowsFn = write_cache_rows,
                  kpool: KPoolRowsFn = kpool_rows, share: SharedSelection | None = None) -> Tensor:
    """Attention for new rows ``a`` (T, H) at ``slots`` (T,): writes their rows into ``cache``,
    then each attends over the rows the indexer selects for it. Returns ``(T, H)``.

    ``rows_read``: the cache rows ``[0, rows_read)`` read, at least ``max(slots) + 1`` (the
    default: the whole capacity). No result depends on it; the indexer's cost does.
    ``write_rows``: how the new rows are stored (``WriteRowsFn``; default ``write_cache_rows``).
    ``kpool``: the KPool indexer of a glm5_next layer (``KPoolRowsFn``; default ``kpool_rows``).
    ``share``: index sharing within a propose (DESIGN.md §9), one row per call: None selects for
    the row; an empty ``SharedSelection`` (draft step 1) selects for the row and keeps the
    selection in it; a kept one (a later step) attends exactly the kept rows and runs none of
    the indexer's query side. The row's cache entries are written the same in all three."""
    if share is not None and slots.shape[0] != 1:
        raise ValueError(f"share: index sharing drafts one row per call, got {slots.shape[0]} rows")
    kept = None if share is None else share.kept
    cos, sin = rope.at(slots)  # (T, R/2)
    q_latent, q_nope, q_pe = latent_query(attn, cfg, a, cos, sin, ops)
    kv, k = row_projections(attn, a, ops)  # (T, Lkv + R), (T, D)
    write_rows(attn, cfg, kv, k, slots, rope, cache, ops)

    # 1. The indexer: each new row scores the rows it can see and keeps its index_topk best
    #    (glm5_next: its best pools of rows plus its tail, kpool.kpool_rows).
    #    A shared step (kept: step 1's selection) scores nothing: it attends the kept rows; the
    #    KPool indexer still writes its gate and the key of a pool it completes.
    S = cache.capacity if rows_read is None else rows_read
    if cfg.is_next and kept is None:  # pinned, or torch's kernels (training, the target) inside kpool_rows
        rows, count = kpool(attn.indexer, cfg, a, q_latent, slots, cache, ops)  # (T, K), (T,)
    elif cfg.is_next:
        rows, count = kpool(attn.indexer, cfg, a, q_latent, slots, cache, ops, shared=kept)  # (1, K), (1,)
    elif kept is None:
        q_idx, w_idx = index_queries(attn.indexer, cfg, a, q_latent, cos, sin, ops)
        # (T, K), (T,)
        rows, count = select_rows(index_scores(q_idx, w_idx, cache.index_rows(S), ops), slots, cfg.index_topk)
    else:
        rows, count = kept  # (1, K), (1,)
    if share is not None and kept is None:
        share.keep(rows, count)

    # 2. MLA over the selected rows, then o_proj.
    if ops.pinned:
        out = sparse_mla(attn, cfg, q_nope, q_pe, cache.kv_rows(S), rows, count)
    else:
        out = dense_mla(attn, cfg, q_nope, q_pe, cache.kv_rows(S), selection_mask(rows, count, S))
    return output_projection(attn, cfg, out, ops)


def rope_for(tables: dict[torch.device, Rope], weights: MtpWeights, capacity: int, device: torch.device) -> Rope:
    """The drafter's RoPE table on ``device`` from its cache ``tables`` (built once per device)."""
    if device not in tables:
        tables[device] = Rope.build(weights.config, capacity, device, weights.dtype)
    return tables[device]
