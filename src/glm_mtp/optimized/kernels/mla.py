"""The absorbed query and the sparse MLA over the indexer's lists, as Triton kernels.

Replaces, in ``glm_mtp.reference.attention`` (``latent_query`` after ``q_b_proj``, then
``sparse_mla`` = ``mla_over_lists(absorb_query(...))``)::

    q_pe  = apply_rope(q[..., nope:], cos[:, None], sin[:, None], rope_interleave)    # S
    q_abs = dot(q_nope[:, :, None, :], rearrange(W_uk, "h n c -> h c n"))           # A
    s     = (dot(q_abs, c_k) + dot(q_pe, k_pe_k)) * scale,  -inf past count          # A
    p     = list_softmax(s, count)               # max; the pinned exp; / psum_prefix
    o     = psum_prefix(p * up(c), count)        # (nh, Lkv), A
    out   = round_S(dot(o, W_uv[h]))             # (T, nh * v)

Launches (one program per row and block of heads; rows never share a program, so a row's bits
do not depend on the others):

- ``_head_gemv_kernel`` with ``ROPE``: ``q_abs`` (a per-head GEMV over nope, the ``psum`` tree
  in chunks as ``linear``'s), and RoPE of ``q_pe`` in the programs of the first column block.
- ``_mla_scores_kernel``: the scores of a block of heads for a chunk of listed rows, into a
  float32 scratch (T, nh, K). A chunk wholly past the row's ``count`` returns at once: the cost
  is O(count), not O(K). The rows are read from the PAGED pool through ``block_table`` (slot r
  lives in ``kv_pool[block_table[r // 16], r % 16]``), never from a gathered copy; row t's pool
  and block table come from line t of a ``RowCaches`` address table (``paged.row_pools``; stride
  0 when every row is in one sequence's cache), so one launch serves rows of many sequences.
- ``_mla_softmax_kernel``: ``m = max`` over the listed scores, ``e = exp(s - m)`` by the pinned
  algorithm (``numerics.exp``, step by step; never ``tl.exp``), the denominator ``psum_prefix``,
  ``p = div_rn(e, denominator)`` into a second scratch (T, nh, K).
- ``_mla_latent_kernel``: ``o[h, c] = psum_prefix_k(p[h, k] * up(c_k[c]))`` for a block of heads
  and latent columns.
- ``_head_gemv_kernel`` again: ``out = round_S(dot(o, W_uv[h]))``.

``psum_prefix`` (DESIGN.md §5): a list of ``count`` values held in the static width K takes the
root of the left-most subtree of width ``P = next_pow2(count)`` of the padded tree over K, i.e.
value 0 of level ``L = log2(P)``. The kernels compute the tree level by level and, from level L
up, keep the left child instead of adding (``psum_prefix_grid``): the root is then exactly that
value 0. K is read in chunks of a power of two (aligned subtrees), each chunk's root goes to a
column of a root array, and the root array is reduced the same way from level ``log2(chunk)``.
Only the chunks that hold ``[0, min(P, K))`` are read. Lanes inside ``[count, P)`` are the lists'
padding entries: their slot (0 from ``select_rows``) is read as listed and multiplied by
``p = +0.0`` as the reference does (``+0.0 * negative = -0.0``, ``0 * inf = NaN``); lanes past K
load ``+0.0``, the tree's own padding.

Every launch compiles with ``enable_fp_fusion=False``; casts to bfloat16 round on the bits
(``rounding.round_to_storage``); division is ``div_rn``. Storage dtypes: float32 and bfloat16
(``KERNEL_DTYPES``); others stay on the torch code. NaN results stay NaN, payloads not pinned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from einops import rearrange
from torch import Tensor

from glm_mtp.reference import numerics
from glm_mtp.reference.attention import absorb_query, mla_over_lists
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.fp8 import BlockScaledWeight, scale_shape
from glm_mtp.reference.layers import apply_rope
from glm_mtp.reference.state import BLOCK_ROWS, LayerCache

from .launch import AuditLaunch, Launch, abstract
from .linear_fp8 import e4m3_to_f32
from .paged import ADDRESS_COLUMNS, KERNEL_DTYPES, RowCaches, row_caches, row_pools
from .pinned_math import exp_f32, psum_grid, psum_prefix_grid
from .rope_cache import _rotate_store
from .rounding import round_to_storage


# ---- block sizes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlaBlocks:
    """Caps on the kernels' block widths (each a power of two; a kernel uses
    ``min(next_pow2(dim), cap)``). No result depends on them: every chunk is an aligned subtree
    of the same ``psum`` tree (the tests run small caps to exercise many chunks).

    Args:
        gemv_k: chunk of the output GEMV's inputs (Lkv; contiguous in W_uv's rows).
        absorb_k: chunk of the absorbed query's inputs (nope; W_uk is read across its rows, so
            narrow chunks and more outputs per program keep its loads coalesced).
        tile: products per GEMV chunk (sets its outputs per program).
        score_heads / score_rows / score_l: heads, listed rows per program, and the latent chunk
            of the scores' dot.
        soft_heads / soft_k: heads per program and the list chunk of the softmax.
        latent_heads / latent_l / latent_k: heads and latent columns per program and the list
            chunk of ``o``.
    """

    gemv_k: int = 256
    absorb_k: int = 32
    tile: int = 2048
    score_heads: int = 4
    score_rows: int = 8
    score_l: int = 64
    soft_heads: int = 8
    soft_k: int = 128
    latent_heads: int = 4
    latent_l: int = 16
    latent_k: int = 32

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1 or value & (value - 1):
                raise ValueError(f"MlaBlocks.{name} must be a power of two, got {value}")


DEFAULT_BLOCKS = MlaBlocks()
# Bounds the float32 scratch of one pass of sparse_mla_triton (elements per buffer): rows beyond
# it run in further passes (at GLM-5, 128 rows of 64 heads x 2048 listed rows: 64 MiB a buffer).
MLA_SCRATCH_ELEMENTS = 1 << 24


def _p2(n: int) -> int:
    return numerics.next_pow2(n)


def _log2(n: int) -> int:
    return n.bit_length() - 1


# ---- shared pieces --------------------------------------------------------------------------------


@triton.jit
def _list_level(count, LEVELS: tl.constexpr):
    """``log2(next_pow2(count))`` (0 for ``count <= 1``): the bit length of ``count - 1``, for
    ``count <= 2 ** LEVELS``."""
    below = tl.maximum(count, 1) - 1
    level = (below * 0).to(tl.int32)
    for j in tl.static_range(LEVELS):
        level += ((below >> j) > 0).to(tl.int32)
    return level


@triton.jit
def _physical_rows(rows_ptr, block_table_ptr, k, inside, ROWS_PER_BLOCK: tl.constexpr):
    """The pool rows (int64) of list entries ``k``: slot ``s = rows[k]`` lives in row
    ``block_table[s // 16] * 16 + s % 16`` of the flattened pool (0 where not ``inside``)."""
    slot = tl.load(rows_ptr + k, mask=inside, other=0)
    block = tl.load(block_table_ptr + slot // ROWS_PER_BLOCK, mask=inside, other=0).to(tl.int64)
    return block * ROWS_PER_BLOCK + slot % ROWS_PER_BLOCK


# ---- the per-head GEMV (q_abs, and the output through W_uv) ---------------------------------------


@triton.jit
def _head_gemv_kernel(
    x_ptr,  # row t, head h: x_ptr + t * stride_xt + h * stride_xh + k, k < K
    w_ptr,  # head h, output n, input k: w_ptr + h * stride_wh + n * stride_wn + k * stride_wk
    out_ptr,  # out_ptr + t * stride_ot + h * stride_oh + n
    cos_ptr,  # ROPE: (T, R/2) float32, row stride stride_cos
    sin_ptr,
    qpe_ptr,  # ROPE: (T, nh, R) out, strides stride_pt, stride_ph, last dim contiguous
    N,
    K,
    stride_xt,
    stride_xh,
    stride_wh,
    stride_wn,
    stride_wk,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_pt,
    stride_ph,
    half,  # R / 2
    s_ptr,  # FP8: the weight's (ceil(rows/128), ceil(w_cols/128)) float32 scales, row stride stride_s
    w_row0,  # FP8: the weight row w_ptr points at (its element offset is w_row0 * w_cols)
    w_cols,  # FP8: the weight's row length (its rows are contiguous)
    stride_s,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LEVELS_K: tl.constexpr,
    NCHUNK: tl.constexpr,  # next_pow2(K) / BLOCK_K
    LEVELS_C: tl.constexpr,
    TO_BF16: tl.constexpr,  # the GEMV's output: rounded to bfloat16, else left in float32
    NAN_BITS: tl.constexpr,
    ROPE: tl.constexpr,  # also rotate the R values after x's K (the query's rope part)
    INTERLEAVE: tl.constexpr,
    BLOCK_R2: tl.constexpr,
    PE_BF16: tl.constexpr,
    FP8: tl.constexpr,  # w_ptr points at e4m3 bytes: each value is up(W8[r, c]) * s[r // 128, c // 128] in float32
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n < N
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, NCHUNK)
    x_row = x_ptr + t * stride_xt + h * stride_xh
    w_rows = w_ptr + h * stride_wh + n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    roots = tl.zeros((1, BLOCK_N, NCHUNK), tl.float32)  # +0.0: the roots of chunks past K
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        k_in = k < K
        xv = tl.load(x_row + k, mask=k_in, other=0.0).to(tl.float32)
        w_in = n_in[:, None] & k_in[None, :]
        if FP8:  # the sum runs over the weight's rows, across scale blocks: each value scaled on its own
            rel = h * stride_wh + n.to(tl.int64)[:, None] * stride_wn + k[None, :].to(tl.int64) * stride_wk
            total = w_row0 * w_cols + rel
            scale = tl.load(s_ptr + (total // w_cols) // 128 * stride_s + (total % w_cols) // 128, mask=w_in, other=0.0)
            wv = e4m3_to_f32(tl.load(w_rows + k[None, :] * stride_wk, mask=w_in, other=0)) * scale
        else:
            wv = tl.load(w_rows + k[None, :] * stride_wk, mask=w_in, other=0.0).to(tl.float32)
        p = tl.reshape(xv[None, :] * wv, (1, BLOCK_N, BLOCK_K))  # +0.0 past K
        root = psum_grid(p, 1, BLOCK_N, BLOCK_K, LEVELS_K)  # (1, BLOCK_N)
        roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
    y = tl.reshape(psum_grid(roots, 1, BLOCK_N, NCHUNK, LEVELS_C), (BLOCK_N,))
    tl.store(out_ptr + t * stride_ot + h * stride_oh + n, round_to_storage(y, TO_BF16, NAN_BITS), mask=n_in)
    if ROPE:
        if tl.program_id(2) == 0:
            _rotate_store(x_row + K, qpe_ptr + t * stride_pt + h * stride_ph, cos_ptr + t * stride_cos,
                          sin_ptr + t * stride_cos, half, 1, INTERLEAVE, BLOCK_R2, PE_BF16, NAN_BITS)


def _gemv_meta(N: int, K: int, cap_k: int, tile: int, to_bf16: bool, cuda: bool) -> tuple[int, dict]:
    block_k = min(_p2(K), cap_k)
    block_n = max(1, min(_p2(N), tile // block_k))
    nchunk = _p2(K) // block_k
    meta = dict(BLOCK_N=block_n, BLOCK_K=block_k, LEVELS_K=_log2(block_k), NCHUNK=nchunk, LEVELS_C=_log2(nchunk),
                TO_BF16=to_bf16, NAN_BITS=0x7FFF if cuda else 0xFFFF, enable_fp_fusion=False)
    return block_n, meta


# ---- the absorbed query -------------------------------------------------------------------------


def absorbed_query_torch(
    cfg: MtpConfig, q: Tensor, kv_b_proj: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """The twin: ``latent_query``'s split and RoPE after ``q_b_proj`` and ``absorb_query``, the
    reference's own code. ``q`` (T, nh * (nope + R)) in S, nope first per head; ``kv_b_proj``
    (nh * (nope + v), Lkv); ``cos``/``sin`` (T, R/2) in A. Returns ``q_abs`` (T, nh, Lkv) in A
    and ``q_pe`` (T, nh, R) in S."""
    nope = cfg.qk_nope_head_dim
    q = rearrange(q, "t (h d) -> t h d", h=cfg.num_attention_heads)
    q_pe = apply_rope(q[..., nope:], cos[:, None], sin[:, None], cfg.rope_interleave)
    return absorb_query(_KvB(kv_b_proj), cfg, q[..., :nope]), q_pe


def absorbed_query_launch(cfg: MtpConfig, q: Tensor, kv_b_proj: Tensor, cos: Tensor, sin: Tensor, q_abs: Tensor,
                          q_pe: Tensor, blocks: MlaBlocks = DEFAULT_BLOCKS, cuda: bool | None = None) -> Launch:
    """The launch of ``absorbed_query_triton`` into ``q_abs`` (T, nh, Lkv) float32 and ``q_pe``
    (T, nh, R) S (any strides, last dims contiguous): the one place its grid and constexprs are
    computed. ``cuda`` picks the NaN payload; ``None`` reads it off ``q_abs``."""
    nh, nope, R, Lkv, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                           cfg.v_head_dim)
    T = q.shape[0]
    kv_b_proj, kv_s = _kv_b_parts(kv_b_proj)
    _check_dtype("absorbed_query_triton", q, q_pe, *([] if kv_s is not None else [kv_b_proj]))
    if q.dim() != 2 or q.shape[1] != nh * (nope + R) or q.stride(1) != 1:
        raise ValueError(f"absorbed_query_triton: q must be (T, {nh * (nope + R)}) with a contiguous last dim, got "
                         f"{tuple(q.shape)} strides {q.stride()}")
    if kv_b_proj.shape != (nh * (nope + v), Lkv) or not kv_b_proj.is_contiguous():
        raise ValueError(f"absorbed_query_triton: kv_b_proj must be contiguous ({nh * (nope + v)}, {Lkv}), got "
                         f"{tuple(kv_b_proj.shape)}")
    for name, a in (("cos", cos), ("sin", sin)):
        if a.dtype != torch.float32 or a.shape != (T, R // 2) or a.stride(1) != 1 or a.stride(0) != cos.stride(0):
            raise ValueError(f"absorbed_query_triton: {name} must be float32 (T, R/2) = ({T}, {R // 2}) with a "
                             f"contiguous last dim and cos's row stride")
    if q_abs.shape != (T, nh, Lkv) or q_abs.dtype != torch.float32 or q_abs.stride(2) != 1:
        raise ValueError("absorbed_query_triton: q_abs must be float32 (T, nh, Lkv) with a contiguous last dim")
    if q_pe.shape != (T, nh, R) or q_pe.stride(2) != 1:
        raise ValueError("absorbed_query_triton: q_pe must be (T, nh, R) with a contiguous last dim")
    cuda = q_abs.is_cuda if cuda is None else cuda
    block_n, meta = _gemv_meta(Lkv, nope, blocks.absorb_k, blocks.tile, False, cuda)
    args = (q, kv_b_proj, q_abs, cos, sin, q_pe, Lkv, nope, q.stride(0), nope + R, (nope + v) * Lkv, 1, Lkv,
            q_abs.stride(0), q_abs.stride(1), cos.stride(0), q_pe.stride(0), q_pe.stride(1), R // 2,
            *_fp8_args(kv_s, cos, 0, Lkv))
    # NoPE (glm5_next, qk_rope_head_dim 0): no rotation is compiled in at all.
    meta.update(ROPE=R > 0, INTERLEAVE=cfg.rope_interleave, BLOCK_R2=_p2(max(R // 2, 1)),
                PE_BF16=q_pe.dtype == torch.bfloat16, FP8=kv_s is not None)
    return Launch(_head_gemv_kernel, (T, nh, triton.cdiv(Lkv, block_n)), args, meta)


def absorbed_query_triton(cfg: MtpConfig, q: Tensor, kv_b_proj: Tensor, cos: Tensor, sin: Tensor,
                          blocks: MlaBlocks = DEFAULT_BLOCKS) -> tuple[Tensor, Tensor]:
    """The kernel for ``absorbed_query_torch`` (same arguments and results, byte-equal): one
    launch. float32 or bfloat16 ``q`` and ``kv_b_proj`` (the same dtype); float32 angles."""
    T, nh = q.shape[0], cfg.num_attention_heads
    q_abs = torch.empty(T, nh, cfg.kv_lora_rank, dtype=torch.float32, device=q.device)
    q_pe = torch.empty(T, nh, cfg.qk_rope_head_dim, dtype=q.dtype, device=q.device)
    if T > 0:
        absorbed_query_launch(cfg, q, kv_b_proj, cos, sin, q_abs, q_pe, blocks).run()
    return q_abs, q_pe


# ---- the MLA over the lists -----------------------------------------------------------------------


@triton.jit
def _mla_scores_kernel(
    qabs_ptr,  # (T, nh, Lkv) float32, strides stride_at, stride_ah, 1
    qpe_ptr,  # (T, nh, R) S, strides stride_pt, stride_ph, 1
    addresses_ptr,  # row t's (kv_pool, index_pool, block_table) at addresses_ptr + t * addr_stride (paged.py)
    addr_stride,  # 0: every row in one cache; 3: one line per row
    rows_ptr,  # (T, K) int64, row stride stride_rows
    count_ptr,  # (T,) int64
    s_ptr,  # (T, nh, K) float32 scratch, contiguous
    nh,
    K,
    Lkv,
    R,
    stride_at,
    stride_ah,
    stride_pt,
    stride_ph,
    stride_rows,
    scale,  # qk_head_dim ** -0.5 as float32
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
    LEVELS_L: tl.constexpr,
    NCHUNK_L: tl.constexpr,  # next_pow2(Lkv) / BLOCK_L
    LEVELS_CL: tl.constexpr,
    BLOCK_R: tl.constexpr,  # next_pow2(R): one chunk
    LEVELS_R: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
    TO_BF16: tl.constexpr,  # the pools' dtype: bfloat16, else float32
    HAS_ROPE: tl.constexpr,  # R > 0; NoPE (glm5_next) reads and multiplies no rope lanes
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k0 = tl.program_id(2) * BLOCK_K
    count = tl.load(count_ptr + t)
    if k0 < count:  # a chunk wholly past the list is never read (the softmax masks it)
        kv_pool_ptr, _, block_table_ptr = row_pools(addresses_ptr, t, addr_stride, TO_BF16)  # (blocks, 16, Lkv + R)
        h_in = h < nh
        k = k0 + tl.arange(0, BLOCK_K)
        k_in = k < K
        width = Lkv + R
        kv_rows = kv_pool_ptr + _physical_rows(rows_ptr + t * stride_rows, block_table_ptr, k, k_in,
                                               ROWS_PER_BLOCK) * width
        q_rows = qabs_ptr + t * stride_at + h[:, None] * stride_ah  # (BLOCK_H, 1)
        ll = tl.arange(0, BLOCK_L)
        col = tl.arange(0, NCHUNK_L)
        roots = tl.zeros((BLOCK_H, BLOCK_K, NCHUNK_L), tl.float32)
        for c in range(0, tl.cdiv(Lkv, BLOCK_L)):
            l = c * BLOCK_L + ll
            l_in = l < Lkv
            qv = tl.load(q_rows + l[None, :], mask=h_in[:, None] & l_in[None, :], other=0.0)  # (BLOCK_H, BLOCK_L)
            cv = tl.load(kv_rows[:, None] + l[None, :], mask=k_in[:, None] & l_in[None, :], other=0.0).to(tl.float32)
            root = psum_grid(qv[:, None, :] * cv[None, :, :], BLOCK_H, BLOCK_K, BLOCK_L, LEVELS_L)  # (BLOCK_H, BLOCK_K)
            roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
        dot_c = psum_grid(roots, BLOCK_H, BLOCK_K, NCHUNK_L, LEVELS_CL)
        if HAS_ROPE:
            r = tl.arange(0, BLOCK_R)
            r_in = r < R
            pv = tl.load(qpe_ptr + t * stride_pt + h[:, None] * stride_ph + r[None, :],
                         mask=h_in[:, None] & r_in[None, :], other=0.0).to(tl.float32)
            kv = tl.load(kv_rows[:, None] + Lkv + r[None, :], mask=k_in[:, None] & r_in[None, :],
                         other=0.0).to(tl.float32)
            dot_r = psum_grid(pv[:, None, :] * kv[None, :, :], BLOCK_H, BLOCK_K, BLOCK_R, LEVELS_R)
            s = (dot_c + dot_r) * scale
        else:  # the reference adds the empty rope dot, psum of nothing = +0.0 (it turns -0.0 into +0.0)
            s = (dot_c + 0.0) * scale
        tl.store(s_ptr + (t * nh + h[:, None]) * K + k[None, :], s, mask=h_in[:, None] & k_in[None, :])


@triton.jit
def _mla_softmax_kernel(
    s_ptr,  # (T, nh, K) float32 scores (written for the listed entries)
    p_ptr,  # (T, nh, K) float32 out: the probabilities over [0, min(next_pow2(count), K))
    count_ptr,  # (T,) int64
    nh,
    K,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LEVELS_K: tl.constexpr,
    NCHUNK: tl.constexpr,  # next_pow2(K) / BLOCK_K
    LEVELS_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_in = h < nh
    count = tl.minimum(tl.maximum(tl.load(count_ptr + t), 0), K)  # numerics' rule for count > K
    level = _list_level(count, LEVELS_K + LEVELS_C)
    span = tl.minimum(1 << level, K)  # the list's subtree, clipped to the width
    kk = tl.arange(0, BLOCK_K)
    rows = s_ptr + (t * nh + h[:, None]) * K  # (BLOCK_H, 1)
    # m = max over the list (the masked tail is -inf); exact, any order.
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for c in range(0, tl.cdiv(span, BLOCK_K)):
        k = c * BLOCK_K + kk
        s = tl.load(rows + k[None, :], mask=h_in[:, None] & (k < count)[None, :], other=float("-inf"))
        m = tl.maximum(m, tl.max(s, axis=1))
    m = tl.where(h_in, m, 0.0)  # heads past nh: keep them finite (never stored)
    # The denominator: psum_prefix of e = exp(s - m) over the list.
    col = tl.arange(0, NCHUNK)
    roots = tl.zeros((1, BLOCK_H, NCHUNK), tl.float32)
    for c in range(0, tl.cdiv(span, BLOCK_K)):
        k = c * BLOCK_K + kk
        s = tl.load(rows + k[None, :], mask=h_in[:, None] & (k < count)[None, :], other=float("-inf"))
        e = tl.where((k < K)[None, :], exp_f32(s - m[:, None]), 0.0)  # past K: the tree's +0.0 padding
        root = psum_prefix_grid(tl.reshape(e, (1, BLOCK_H, BLOCK_K)), 1, BLOCK_H, BLOCK_K, LEVELS_K, level, 0)
        roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
    den = tl.reshape(psum_prefix_grid(roots, 1, BLOCK_H, NCHUNK, LEVELS_C, level, LEVELS_K), (BLOCK_H,))
    den = tl.where(h_in, den, 1.0)
    # p = e / denominator (e recomputed: the same bits, and no read of this program's own stores).
    out = p_ptr + (t * nh + h[:, None]) * K
    for c in range(0, tl.cdiv(span, BLOCK_K)):
        k = c * BLOCK_K + kk
        s = tl.load(rows + k[None, :], mask=h_in[:, None] & (k < count)[None, :], other=float("-inf"))
        p = tl.math.div_rn(exp_f32(s - m[:, None]), den[:, None])
        tl.store(out + k[None, :], p, mask=h_in[:, None] & (k < span)[None, :])


@triton.jit
def _mla_latent_kernel(
    p_ptr,  # (T, nh, K) float32 probabilities
    addresses_ptr,  # row t's (kv_pool, index_pool, block_table) at addresses_ptr + t * addr_stride (paged.py)
    addr_stride,  # 0: every row in one cache; 3: one line per row
    rows_ptr,  # (T, K) int64, row stride stride_rows
    count_ptr,  # (T,) int64
    o_ptr,  # (T, nh, Lkv) float32 out, contiguous
    nh,
    K,
    Lkv,
    R,
    stride_rows,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LEVELS_K: tl.constexpr,
    NCHUNK: tl.constexpr,  # next_pow2(K) / BLOCK_K
    LEVELS_C: tl.constexpr,
    ROWS_PER_BLOCK: tl.constexpr,
    TO_BF16: tl.constexpr,  # the pools' dtype: bfloat16, else float32
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    l = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    h_in = h < nh
    l_in = l < Lkv
    kv_pool_ptr, _, block_table_ptr = row_pools(addresses_ptr, t, addr_stride, TO_BF16)  # (blocks, 16, Lkv + R)
    count = tl.minimum(tl.maximum(tl.load(count_ptr + t), 0), K)
    level = _list_level(count, LEVELS_K + LEVELS_C)
    span = tl.minimum(1 << level, K)
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, NCHUNK)
    p_rows = p_ptr + (t * nh + h[:, None]) * K  # (BLOCK_H, 1)
    roots = tl.zeros((BLOCK_H, BLOCK_L, NCHUNK), tl.float32)
    for c in range(0, tl.cdiv(span, BLOCK_K)):
        k = c * BLOCK_K + kk
        k_in = k < span  # the list and its padding entries up to next_pow2(count): read as listed
        kv_rows = kv_pool_ptr + _physical_rows(rows_ptr + t * stride_rows, block_table_ptr, k, k_in,
                                               ROWS_PER_BLOCK) * (Lkv + R)
        cv = tl.load(kv_rows[None, :] + l[:, None], mask=l_in[:, None] & k_in[None, :], other=0.0).to(tl.float32)
        pv = tl.load(p_rows + k[None, :], mask=h_in[:, None] & k_in[None, :], other=0.0)  # (BLOCK_H, BLOCK_K)
        prod = pv[:, None, :] * cv[None, :, :]  # (BLOCK_H, BLOCK_L, BLOCK_K)
        root = psum_prefix_grid(prod, BLOCK_H, BLOCK_L, BLOCK_K, LEVELS_K, level, 0)
        roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
    o = psum_prefix_grid(roots, BLOCK_H, BLOCK_L, NCHUNK, LEVELS_C, level, LEVELS_K)
    o = tl.where(count > 0, o, 0.0)  # psum_prefix of an empty list
    tl.store(o_ptr + (t * nh + h[:, None]) * Lkv + l[None, :], o, mask=h_in[:, None] & l_in[None, :])


def sparse_mla_torch(cfg: MtpConfig, q_abs: Tensor, q_pe: Tensor, caches: LayerCache | RowCaches, rows: Tensor,
                     count: Tensor, kv_b_proj: Tensor) -> Tensor:
    """The twin: ``mla_over_lists`` (the reference's own code) over ``LayerCache.kv_rows()``,
    the pool gathered by its block table; with a cache per row, over each run of rows in one
    cache (``RowCaches.runs``), the runs' outputs concatenated (each row as if alone).
    Arguments as ``sparse_mla_triton``."""
    T = rows.shape[0]
    runs = [(caches, slice(0, T))] if isinstance(caches, LayerCache) else caches.runs(T)
    outs = [mla_over_lists(_KvB(kv_b_proj), cfg, q_abs[t], q_pe[t], cache.kv_rows(), rows[t], count[t])
            for cache, t in runs]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


@dataclass(frozen=True)
class MlaScratch:
    """The float32 buffers between the launches: scores and probabilities (T, nh, K), the
    latent outputs ``o`` (T, nh, Lkv)."""

    scores: Tensor
    probs: Tensor
    latent: Tensor

    @classmethod
    def empty(cls, T: int, nh: int, K: int, Lkv: int, device: torch.device | str) -> MlaScratch:
        f32 = torch.float32
        return cls(torch.empty(T, nh, K, dtype=f32, device=device), torch.empty(T, nh, K, dtype=f32, device=device),
                   torch.empty(T, nh, Lkv, dtype=f32, device=device))


def sparse_mla_launches(cfg: MtpConfig, q_abs: Tensor, q_pe: Tensor, caches: LayerCache | RowCaches, rows: Tensor,
                        count: Tensor, kv_b_proj: Tensor, scratch: MlaScratch, out: Tensor,
                        blocks: MlaBlocks = DEFAULT_BLOCKS, cuda: bool | None = None) -> list[Launch]:
    """The four launches of ``sparse_mla_triton`` (scores, softmax, latent, output), arguments
    checked: the one place their grids and constexprs are computed. ``out`` (T, nh * v) S.
    ``cuda`` picks the NaN payload; ``None`` reads it off ``out``."""
    nh, nope, R, Lkv, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                           cfg.v_head_dim)
    T, K = rows.shape
    name = "sparse_mla_triton"
    rc = row_caches(caches)
    kv_pool = _check_caches(name, rc, T, Lkv + R)
    kv_b_proj, kv_s = _kv_b_parts(kv_b_proj)
    _check_dtype(name, q_pe, kv_pool, out, *([] if kv_s is not None else [kv_b_proj]))
    if q_abs.shape != (T, nh, Lkv) or q_abs.dtype != torch.float32 or q_abs.stride(2) != 1:
        raise ValueError(f"{name}: q_abs must be float32 (T, nh, Lkv) = ({T}, {nh}, {Lkv}), last dim contiguous")
    if q_pe.shape != (T, nh, R) or q_pe.stride(2) != 1:
        raise ValueError(f"{name}: q_pe must be (T, nh, R) = ({T}, {nh}, {R}), last dim contiguous")
    if (
        rows.dtype != torch.int64
        or (K > 1 and rows.stride(1) != 1)
        or count.dtype != torch.int64
        or count.shape != (T,)
    ):
        raise ValueError(f"{name}: rows must be (T, K) int64 (last dim contiguous) and count (T,) int64")
    if count.stride(0) != 1 and T > 1:
        raise ValueError(f"{name}: count must be contiguous")
    if kv_b_proj.shape != (nh * (nope + v), Lkv) or not kv_b_proj.is_contiguous():
        raise ValueError(f"{name}: kv_b_proj must be contiguous ({nh * (nope + v)}, {Lkv})")
    if out.shape != (T, nh * v) or out.stride(1) != 1:
        raise ValueError(f"{name}: out must be (T, nh * v) = ({T}, {nh * v}), last dim contiguous")
    for buf, shape in ((scratch.scores, (T, nh, K)), (scratch.probs, (T, nh, K)), (scratch.latent, (T, nh, Lkv))):
        if buf.shape != shape or buf.dtype != torch.float32 or not buf.is_contiguous():
            raise ValueError(f"{name}: scratch buffers must be contiguous float32 {shape}")
    if _p2(R) > 256:
        raise ValueError(f"{name}: qk_rope_head_dim {R} > 256 is read in one chunk; not supported")
    cuda = out.is_cuda if cuda is None else cuda
    b = blocks
    PK = _p2(K)
    pool_bf16 = kv_pool.dtype == torch.bfloat16

    # Scores.
    sh, sk, sl = min(_p2(nh), b.score_heads), min(PK, b.score_rows), min(_p2(Lkv), b.score_l)
    scores = Launch(
        _mla_scores_kernel, (T, triton.cdiv(nh, sh), triton.cdiv(K, sk)),
        (q_abs, q_pe, rc.addresses, rc.stride, rows, count, scratch.scores, nh, K, Lkv, R, q_abs.stride(0),
         q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), rows.stride(0), float(cfg.qk_head_dim**-0.5)),
        dict(BLOCK_H=sh, BLOCK_K=sk, BLOCK_L=sl, LEVELS_L=_log2(sl), NCHUNK_L=_p2(Lkv) // sl,
             LEVELS_CL=_log2(_p2(Lkv) // sl), BLOCK_R=_p2(R), LEVELS_R=_log2(_p2(R)), ROWS_PER_BLOCK=BLOCK_ROWS,
             TO_BF16=pool_bf16, HAS_ROPE=R > 0, enable_fp_fusion=False))
    # Softmax.
    fh, fk = min(_p2(nh), b.soft_heads), min(PK, b.soft_k)
    softmax = Launch(
        _mla_softmax_kernel, (T, triton.cdiv(nh, fh)), (scratch.scores, scratch.probs, count, nh, K),
        dict(BLOCK_H=fh, BLOCK_K=fk, LEVELS_K=_log2(fk), NCHUNK=PK // fk, LEVELS_C=_log2(PK // fk),
             enable_fp_fusion=False))
    # The latent outputs.
    lh, ll, lk = min(_p2(nh), b.latent_heads), min(_p2(Lkv), b.latent_l), min(PK, b.latent_k)
    latent = Launch(
        _mla_latent_kernel, (T, triton.cdiv(nh, lh), triton.cdiv(Lkv, ll)),
        (scratch.probs, rc.addresses, rc.stride, rows, count, scratch.latent, nh, K, Lkv, R, rows.stride(0)),
        dict(BLOCK_H=lh, BLOCK_L=ll, BLOCK_K=lk, LEVELS_K=_log2(lk), NCHUNK=PK // lk, LEVELS_C=_log2(PK // lk),
             ROWS_PER_BLOCK=BLOCK_ROWS, TO_BF16=pool_bf16, enable_fp_fusion=False))
    # out[t, h] = round_S(dot(o[t, h], W_uv[h])): W_uv[h] row n is kv_b_proj row h * (nope + v) + nope + n.
    block_n, meta = _gemv_meta(v, Lkv, b.gemv_k, b.tile, out.dtype == torch.bfloat16, cuda)
    meta.update(ROPE=False, INTERLEAVE=False, BLOCK_R2=1, PE_BF16=False, FP8=kv_s is not None)
    lat = scratch.latent
    output = Launch(
        _head_gemv_kernel, (T, nh, triton.cdiv(v, block_n)),
        (lat, kv_b_proj[nope:], out, lat, lat, lat, v, Lkv, lat.stride(0), lat.stride(1), (nope + v) * Lkv, Lkv, 1,
         out.stride(0), v, 0, 0, 0, 0, *_fp8_args(kv_s, lat, nope, Lkv)),
        meta)
    return [scores, softmax, latent, output]


def sparse_mla_triton(cfg: MtpConfig, q_abs: Tensor, q_pe: Tensor, caches: LayerCache | RowCaches, rows: Tensor,
                      count: Tensor, kv_b_proj: Tensor, blocks: MlaBlocks = DEFAULT_BLOCKS) -> Tensor:
    """The kernels for ``sparse_mla_torch`` (byte-equal): ``q_abs`` (T, nh, Lkv) float32 and
    ``q_pe`` (T, nh, R) S from ``absorbed_query_triton``; ``caches`` the layer's paged cache of
    every row (a ``LayerCache``) or of each row (a ``RowCaches``, one line per row): its
    ``kv_pool`` (blocks, 16, Lkv + R) read through its ``block_table`` (blocks,) int32; the lists
    ``rows`` (T, K) int64 ascending (padding entries slot 0) and ``count`` (T,) int64, on the
    device (never read by the host); ``kv_b_proj`` (nh * (nope + v), Lkv). Returns
    ``(T, nh * v)`` in S. float32 or bfloat16. A lone ``LayerCache`` costs a host-to-device copy
    of its address line; capturable callers pass a ``RowCaches`` made once."""
    T, K = rows.shape
    nh = cfg.num_attention_heads
    out = torch.empty(T, nh * cfg.v_head_dim, dtype=q_pe.dtype, device=q_pe.device)
    if T == 0:
        return out
    if K == 0:
        raise ValueError("sparse_mla_triton: rows must have at least one column")
    # Rows are independent: passes of at most `per_pass` rows bound the scratch (shapes only, no
    # host read of the data, so the loop is the same at capture and replay).
    per_pass = max(1, min(T, MLA_SCRATCH_ELEMENTS // (nh * max(K, cfg.kv_lora_rank))))
    full = MlaScratch.empty(per_pass, nh, K, cfg.kv_lora_rank, q_pe.device)
    rc = row_caches(caches)
    if len(rc.caches) not in (1, T):  # checked before the passes slice the table
        raise ValueError(f"sparse_mla_triton: caches must be one LayerCache or one per row ({T}), got {len(rc.caches)}")
    for t0 in range(0, T, per_pass):
        t = slice(t0, min(T, t0 + per_pass))
        n = t.stop - t.start
        scratch = MlaScratch(full.scores[:n], full.probs[:n], full.latent[:n])
        for launch in sparse_mla_launches(cfg, q_abs[t], q_pe[t], _rows_of(rc, t), rows[t], count[t], kv_b_proj,
                                          scratch, out[t], blocks):
            launch.run()
    return out


# ---- helpers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _KvB:
    """What the reference's ``absorb_query`` / ``mla_over_lists`` read of ``AttentionWeights``:
    ``kv_b_proj`` alone (through ``split_kv_b``)."""

    kv_b_proj: Tensor


def _rows_of(rc: RowCaches, t: slice) -> RowCaches:
    """The caches of rows ``t`` (a view of the address table; the shared line when stride 0)."""
    return rc if rc.stride == 0 else RowCaches(rc.caches[t], rc.addresses[t])


def _check_caches(name: str, rc: RowCaches, T: int, width: int) -> Tensor:
    """Checks a call's caches on the host (shapes and dtypes of the tuple's tensors, never a
    device read): one cache, or one per row, each kv pool contiguous (blocks, 16, ``width``)
    of one dtype and one shape, each block table a contiguous (blocks,) int32; the address table
    contiguous int64 (len(caches), 3). Returns the first cache's kv pool."""
    n = len(rc.caches)
    if n not in (1, T):
        raise ValueError(f"{name}: caches must be one LayerCache or one per row ({T}), got {n}")
    table = rc.addresses
    if table.dtype != torch.int64 or table.shape != (n, ADDRESS_COLUMNS) or not table.is_contiguous():
        raise ValueError(f"{name}: the address table must be a contiguous int64 ({n}, {ADDRESS_COLUMNS}), got "
                         f"{table.dtype} {tuple(table.shape)}")
    first = rc.caches[0]
    for cache in rc.caches:
        pool, bt = cache.kv_pool, cache.block_table
        if pool.dim() != 3 or pool.shape[1:] != (BLOCK_ROWS, width) or not pool.is_contiguous():
            raise ValueError(f"{name}: kv_pool must be contiguous (blocks, {BLOCK_ROWS}, {width})")
        if pool.dtype != first.kv_pool.dtype or pool.shape != first.kv_pool.shape:
            raise ValueError(f"{name}: every cache's kv_pool must have one dtype and shape")
        if bt.dtype != torch.int32 or bt.dim() != 1 or not bt.is_contiguous() or bt.shape != first.block_table.shape:
            raise ValueError(f"{name}: block_table must be a contiguous (blocks,) int32 tensor, one shape for "
                             "all caches")
    return first.kv_pool


def _kv_b_parts(kv_b_proj: Tensor | BlockScaledWeight) -> tuple[Tensor, Tensor | None]:
    """``kv_b_proj`` as the kernels read it: a plain tensor and no scales, or a block-scaled
    weight's e4m3 bytes (uint8, the same element strides) and its float32 scales."""
    if isinstance(kv_b_proj, BlockScaledWeight):
        return kv_b_proj.w8.view(torch.uint8), kv_b_proj.scale_inv
    return kv_b_proj, None


def _fp8_args(scales: Tensor | None, dummy: Tensor, row0: int, cols: int) -> tuple:
    """``_head_gemv_kernel``'s FP8 arguments (s_ptr, w_row0, w_cols, stride_s); unused without scales."""
    if scales is None:
        return (dummy, 0, 1, 0)
    return (scales, row0, cols, scales.stride(0))


def _check_dtype(name: str, *tensors: Tensor) -> None:
    dtype = tensors[0].dtype
    if dtype not in KERNEL_DTYPES or any(t.dtype != dtype for t in tensors):
        raise TypeError(f"{name}: storage tensors must share one dtype of {KERNEL_DTYPES}, got "
                        f"{[t.dtype for t in tensors]}")


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The launches a drafter at ``cfg`` with ``dtype`` weights makes, on abstract tensors (see
    ``glm_mtp.tools.audit``): ``step`` (one row) and ``rows`` (8 rows), lists of width
    ``index_topk`` over a pool from ``LayerCache.allocate``, q as ``q_b_proj``'s output, every
    row in that cache (an address table of one line); and ``batch`` (16 rows, each in its own
    cache: one address line per row, stride 3)."""
    if dtype not in KERNEL_DTYPES:
        return []
    nh, nope, R, Lkv, v, K = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                              cfg.v_head_dim, cfg.index_topk)
    cache = LayerCache.allocate(cfg, 2, dtype, "meta")
    kv_b = abstract((nh * (nope + v), Lkv), dtype)
    out = []
    for variant, T in (("step", 1), ("rows", 8), ("batch", 16)):
        q_abs, q_pe = abstract((T, nh, Lkv), torch.float32), abstract((T, nh, R), dtype)
        angles = abstract((T, R // 2), torch.float32)  # (T, 0) for NoPE: never read
        out.append(AuditLaunch("mla:absorbed_query", variant, absorbed_query_launch(
            cfg, abstract((T, nh * (nope + R)), dtype), kv_b, angles, angles, q_abs, q_pe, cuda=True)))
        scratch = MlaScratch.empty(T, nh, K, Lkv, "meta")
        lines = T if variant == "batch" else 1
        caches = RowCaches((cache,) * lines, abstract((lines, ADDRESS_COLUMNS), torch.int64))
        assert caches.stride == (ADDRESS_COLUMNS if variant == "batch" else 0)
        launches = sparse_mla_launches(cfg, q_abs, q_pe, caches,
                                       abstract((T, K), torch.int64), abstract((T,), torch.int64), kv_b, scratch,
                                       abstract((T, nh * v), dtype), cuda=True)
        for part, launch in zip(("scores", "softmax", "latent", "out"), launches):
            out.append(AuditLaunch(f"mla:{part}", variant, launch))
        if variant != "batch":  # a block-scaled kv_b (DESIGN.md §8): the two launches that read it
            kv_b8 = BlockScaledWeight(abstract(tuple(kv_b.shape), torch.float8_e4m3fn),
                                      abstract(scale_shape(tuple(kv_b.shape)), torch.float32))
            out.append(AuditLaunch("mla:absorbed_query_fp8", variant, absorbed_query_launch(
                cfg, abstract((T, nh * (nope + R)), dtype), kv_b8, angles, angles, q_abs, q_pe, cuda=True)))
            fp8_launches = sparse_mla_launches(cfg, q_abs, q_pe, caches, abstract((T, K), torch.int64),
                                               abstract((T,), torch.int64), kv_b8, scratch,
                                               abstract((T, nh * v), dtype),
                                               cuda=True)
            out.append(AuditLaunch("mla:out_fp8", variant, fp8_launches[3]))
    return out
