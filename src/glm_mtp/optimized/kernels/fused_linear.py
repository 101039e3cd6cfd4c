"""The fused GEMV family of a draft step: one generalised kernel, four uses.

Every use is the pinned GEMV of ``kernels.linear`` (``y[t, n] = psum_k(up(a[t, k]) * up(W[n, k]))``
in the chunk-root tree: chunks of ``BLOCK_K`` lanes reduced in registers, one root per chunk, the
roots reduced by the same tree; lanes past K are ``+0.0``), with a prologue that builds its input
``a`` and an epilogue that consumes ``y``, each in the reference's operation order:

- ``block_input``: ``a = cat(rms_norm(embed[tokens] (zeroed at slot 0), enorm), rms_norm(hiddens,
  hnorm))``, ``y = linear(a, eh_proj)``;
- ``norm_linear``: ``a = rms_norm(x, norm_weight)``, ``y_i = linear(a, W_i)`` (or ``linear_acc``)
  for 1..5 weights of the same K in ONE launch: the grid runs over the weights' concatenated
  output blocks and each program picks its weight (pointer, N, strides) from its block index;
  optionally ``a`` itself is stored (by the programs of the first output block);
- ``linear_residual``: ``residual + linear(x, W)`` (torch's S add: ``round_S(up(r) + up(y))``);
- ``head_partials``: ``x = rms_norm(out, norm_weight)`` (stored once), the S-rounded logits
  ``linear(x, lm_head)`` and each program's argmax over its vocabulary slice, never the full
  logits; ``argmax_reduce`` (a small kernel) picks each row's token from the slices' partials.

The norms' ``r = 1 / sqrt(psum(x * x) / n + eps)`` is computed inside every program (each
recomputes it for its rows: a few KiB of activations, and the same order everywhere, so every
program gets the same bits): the sum of squares is the chunk-root ``psum`` over n, then
``div_rn``, ``+ eps`` (eps rounded to float32 on the host, as ``numerics.rms_norm`` does),
``sqrt_rn``, ``div_rn(1, .)``. The normed row is ``round_S(up(w) * up(round_S(x * r)))`` chunk by
chunk as the GEMV reads it. Nothing sums with ``tl.sum``/``tl.dot``; launches compile with
``enable_fp_fusion=False``; bfloat16 rounds on the bits (``rounding.round_to_storage``).

The argmax follows ``torch.argmax`` (``reference.layers.greedy_token``): the maximum by value,
ties to the LOWER index (``-0.0 == +0.0``), and NaN counts as the maximum: the first NaN wins.
It uses only comparisons and integer min/max reductions (exact), in the jit helpers
``argmax_reduce`` (a block's rows) and ``argmax_combine`` (two candidates), which a later kernel
can call as they are.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_mtp.reference import numerics
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.fp8 import BlockScaledWeight, scale_shape
from glm_mtp.reference.layers import greedy_token

from .embed import embed_rows_torch
from .launch import AuditLaunch, Launch, abstract
from .linear import LINEAR_DTYPES, MAX_BLOCK_K, linear_blocks
from .linear_fp8 import FP8_BLOCK, e4m3_to_f32, fp8_linear_blocks
from .pinned_math import psum_grid
from .rounding import to_storage

# At most this many weights share one norm_linear launch.
MAX_WEIGHTS = 5
# Epilogues.
EPI_STORE, EPI_RESIDUAL, EPI_ARGMAX = 0, 1, 2
# Prologues: the GEMV's input is x as is, rms_norm(x), or the block input's two normed halves.
PRO_PLAIN, PRO_NORM, PRO_HALVES = 0, 1, 2
# argmax_reduce: partials per chunk of its loop.
ARGMAX_BLOCK_P = 1024
# An index past every vocabulary (the "no candidate" index of the argmax helpers).
NO_INDEX = tl.constexpr(1 << 62)


# ---- jit helpers ------------------------------------------------------------------------------


@triton.jit
def _round_s(y, S_BF16: tl.constexpr, S_F16: tl.constexpr, NAN_BITS: tl.constexpr):
    """``up(round_S(y))``: float32 ``y`` rounded to S and back to float32 (exact)."""
    return to_storage(y, S_BF16, S_F16, NAN_BITS).to(tl.float32)


@triton.jit
def _sum_squares(rows, t_in, n, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, LEVELS_R: tl.constexpr,
                 NCHUNK_R: tl.constexpr, LEVELS_CR: tl.constexpr):
    """``psum(x * x)`` over ``x[t, :n]`` for the rows at pointers ``rows`` (BLOCK_T, 1): chunks of
    ``BLOCK_R`` (a power of two <= next_pow2(n)), one root each, roots reduced by the same tree
    (``NCHUNK_R = next_pow2(n) / BLOCK_R``). Lanes past n load ``+0.0``. Returns (BLOCK_T,)."""
    kk = tl.arange(0, BLOCK_R)
    col = tl.arange(0, NCHUNK_R)
    roots = tl.zeros((BLOCK_T, 1, NCHUNK_R), tl.float32)
    for c in range(0, tl.cdiv(n, BLOCK_R)):
        k = c * BLOCK_R + kk
        v = tl.load(rows + k[None, :], mask=t_in[:, None] & (k < n)[None, :], other=0.0).to(tl.float32)
        sq = tl.reshape(v * v, (BLOCK_T, 1, BLOCK_R))
        root = psum_grid(sq, BLOCK_T, 1, BLOCK_R, LEVELS_R)  # (BLOCK_T, 1)
        roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
    return tl.reshape(psum_grid(roots, BLOCK_T, 1, NCHUNK_R, LEVELS_CR), (BLOCK_T,))


@triton.jit
def _rms_factor(ss, n, eps, BLOCK_T: tl.constexpr):
    """``1 / sqrt(ss / n + eps)``, each operation correctly rounded (ss (BLOCK_T,) float32)."""
    ms = tl.math.div_rn(ss, tl.full((BLOCK_T,), n, tl.int32).to(tl.float32))
    return tl.math.div_rn(tl.full((BLOCK_T,), 1.0, tl.float32), tl.math.sqrt_rn(ms + eps))


@triton.jit
def _normed(xv, r, wn, S_BF16: tl.constexpr, S_F16: tl.constexpr, NAN_BITS: tl.constexpr):
    """``up(round_S(up(w) * up(round_S(x * r))))`` for xv (BLOCK_T, C), r (BLOCK_T,), wn (C,)."""
    normed = _round_s(xv * r[:, None], S_BF16, S_F16, NAN_BITS)
    return _round_s(wn[None, :] * normed, S_BF16, S_F16, NAN_BITS)


@triton.jit
def argmax_combine(v1, i1, v2, i2):
    """The better of two argmax candidates (value, index), elementwise, as ``torch.argmax`` ranks
    them: a NaN beats every number, among NaNs or equal values the lower index wins, else the
    larger value. Returns (value, index)."""
    nan1 = v1 != v1
    nan2 = v2 != v2
    lower = i2 < i1
    take2 = (nan2 & (~nan1 | lower)) | (~nan1 & ~nan2 & ((v2 > v1) | ((v2 == v1) & lower)))
    return tl.where(take2, v2, v1), tl.where(take2, i2, i1)


@triton.jit
def argmax_reduce(v, idx, valid):
    """Each row's argmax over axis 1 of ``v`` (R, W) float32 with indices ``idx`` (R, W) int64,
    lanes where ``valid`` (R, W) is false ignored, as ``torch.argmax`` over the indices: the first
    (lowest index) NaN if any, else the lowest index holding the maximum (``-0.0 == +0.0``).
    Returns (value (R,), index (R,)): a NaN row's value is a NaN; a row with no valid lane gets
    ``-inf`` and an index past every vocabulary. Only comparisons and integer reductions."""
    nan = valid & (v != v)
    has_nan = tl.max(nan.to(tl.int32), axis=1) > 0
    nan_idx = tl.min(tl.where(nan, idx, NO_INDEX), axis=1)
    num = valid & (v == v)
    m = tl.max(tl.where(num, v, float("-inf")), axis=1)
    m_idx = tl.min(tl.where(num & (v == m[:, None]), idx, NO_INDEX), axis=1)
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, nan_idx, m_idx)


# ---- the kernel -----------------------------------------------------------------------------


@triton.jit
def _fused_linear_kernel(
    x_ptr,  # (T, K) the GEMV input (PRO_PLAIN, PRO_NORM); the hiddens (T, H) (PRO_HALVES)
    emb_ptr,  # (V, H) embedding (PRO_HALVES)
    tok_ptr,  # (T,) int64 token ids (PRO_HALVES)
    slot_ptr,  # (T,) int64 slots (PRO_HALVES)
    nw_ptr,  # (K,) the norm's weight (PRO_NORM); enorm (H,) (PRO_HALVES)
    nw2_ptr,  # (H,) hnorm (PRO_HALVES)
    w0, w1, w2, w3, w4,  # (N_i, K) weights, contiguous last dim (FP8: their e4m3 bytes, uint8)
    c0, c1, c2, c3, c4,  # FP8: (ceil(N_i/128), ceil(K/128)) float32 scales, contiguous last dim
    o0, o1, o2, o3, o4,  # (T, N_i) outputs (EPI_STORE, EPI_RESIDUAL)
    res_ptr,  # (T, N) residual (EPI_RESIDUAL)
    normed_ptr,  # (T, K) the normed input, S (STORE_NORMED)
    pv_ptr,  # (T, P) float32 partial argmax values (EPI_ARGMAX)
    pi_ptr,  # (T, P) int64 partial argmax indices (EPI_ARGMAX)
    lg_ptr,  # (T, N) the S-rounded logits (EPI_ARGMAX with STORE_LOGITS)
    T, K, H, V,
    stride_x, stride_e, stride_res, stride_normed, stride_p, stride_lg,
    n0, n1, n2, n3, n4,
    sw0, sw1, sw2, sw3, sw4,
    sc0, sc1, sc2, sc3, sc4,
    so0, so1, so2, so3, so4,
    B1, B2, B3, B4,  # the first output block of weights 1, 2, 3, 4
    eps,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LEVELS_K: tl.constexpr,
    NCHUNK: tl.constexpr, LEVELS_C: tl.constexpr,
    BLOCK_R: tl.constexpr, LEVELS_R: tl.constexpr, NCHUNK_R: tl.constexpr, LEVELS_CR: tl.constexpr,
    PRO: tl.constexpr, NW: tl.constexpr, EPI: tl.constexpr, OUT_ACC: tl.constexpr, STORE_NORMED: tl.constexpr,
    STORE_LOGITS: tl.constexpr, S_BF16: tl.constexpr, S_F16: tl.constexpr, NAN_BITS: tl.constexpr,
    FP8: tl.constexpr, SCALE_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    # The weight this program's output block belongs to.
    w_ptr, o_ptr, N, stride_w, stride_o, nb = w0, o0, n0, sw0, so0, pid
    c_ptr, stride_c = c0, sc0
    if NW > 1:
        s = pid >= B1
        w_ptr, o_ptr, N = tl.where(s, w1, w_ptr), tl.where(s, o1, o_ptr), tl.where(s, n1, N)
        stride_w, stride_o, nb = tl.where(s, sw1, stride_w), tl.where(s, so1, stride_o), tl.where(s, pid - B1, nb)
        c_ptr, stride_c = tl.where(s, c1, c_ptr), tl.where(s, sc1, stride_c)
    if NW > 2:
        s = pid >= B2
        w_ptr, o_ptr, N = tl.where(s, w2, w_ptr), tl.where(s, o2, o_ptr), tl.where(s, n2, N)
        stride_w, stride_o, nb = tl.where(s, sw2, stride_w), tl.where(s, so2, stride_o), tl.where(s, pid - B2, nb)
        c_ptr, stride_c = tl.where(s, c2, c_ptr), tl.where(s, sc2, stride_c)
    if NW > 3:
        s = pid >= B3
        w_ptr, o_ptr, N = tl.where(s, w3, w_ptr), tl.where(s, o3, o_ptr), tl.where(s, n3, N)
        stride_w, stride_o, nb = tl.where(s, sw3, stride_w), tl.where(s, so3, stride_o), tl.where(s, pid - B3, nb)
        c_ptr, stride_c = tl.where(s, c3, c_ptr), tl.where(s, sc3, stride_c)
    if NW > 4:
        s = pid >= B4
        w_ptr, o_ptr, N = tl.where(s, w4, w_ptr), tl.where(s, o4, o_ptr), tl.where(s, n4, N)
        stride_w, stride_o, nb = tl.where(s, sw4, stride_w), tl.where(s, so4, stride_o), tl.where(s, pid - B4, nb)
        c_ptr, stride_c = tl.where(s, c4, c_ptr), tl.where(s, sc4, stride_c)

    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    t_in = t < T
    n_in = n < N
    t64 = t.to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, NCHUNK)
    x_rows = x_ptr + t64[:, None] * stride_x  # (BLOCK_T, 1)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w  # (BLOCK_N, 1)

    # Prologue: the norms' factors r, per row.
    if PRO == 1:
        r = _rms_factor(_sum_squares(x_rows, t_in, K, BLOCK_T, BLOCK_R, LEVELS_R, NCHUNK_R, LEVELS_CR), K, eps, BLOCK_T)
    if PRO == 2:
        tok = tl.load(tok_ptr + t, mask=t_in, other=0).to(tl.int64)
        tok = tl.where((tok >= 0) & (tok < V), tok, 0)
        slot0 = tl.load(slot_ptr + t, mask=t_in, other=1) == 0  # row 0: a zero embedding (+0.0)
        e_rows = emb_ptr + tok[:, None] * stride_e  # (BLOCK_T, 1)
        ss_e = _sum_squares(e_rows, t_in, H, BLOCK_T, BLOCK_R, LEVELS_R, NCHUNK_R, LEVELS_CR)
        r_e = _rms_factor(tl.where(slot0, 0.0, ss_e), H, eps, BLOCK_T)
        ss_h = _sum_squares(x_rows, t_in, H, BLOCK_T, BLOCK_R, LEVELS_R, NCHUNK_R, LEVELS_CR)
        r_h = _rms_factor(ss_h, H, eps, BLOCK_T)

    roots = tl.zeros((BLOCK_T, BLOCK_N, NCHUNK), tl.float32)  # +0.0: the roots of chunks past K
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        k_in = k < K
        inside = t_in[:, None] & k_in[None, :]
        if PRO == 0:
            a = tl.load(x_rows + k[None, :], mask=inside, other=0.0).to(tl.float32)
        elif PRO == 1:
            xv = tl.load(x_rows + k[None, :], mask=inside, other=0.0).to(tl.float32)
            wn = tl.load(nw_ptr + k, mask=k_in, other=0.0).to(tl.float32)
            a = tl.where(inside, _normed(xv, r, wn, S_BF16, S_F16, NAN_BITS), 0.0)
        else:
            lo = k < H  # the embedding half, then the hidden half
            hi = k_in & (k >= H)
            kh = tl.where(hi, k - H, 0)
            ev = tl.load(e_rows + k[None, :], mask=t_in[:, None] & lo[None, :], other=0.0).to(tl.float32)
            ev = tl.where(slot0[:, None], 0.0, ev)
            hv = tl.load(x_rows + kh[None, :], mask=t_in[:, None] & hi[None, :], other=0.0).to(tl.float32)
            we = tl.load(nw_ptr + k, mask=lo, other=0.0).to(tl.float32)
            wh = tl.load(nw2_ptr + kh, mask=hi, other=0.0).to(tl.float32)
            a_e = _normed(ev, r_e, we, S_BF16, S_F16, NAN_BITS)
            a_h = _normed(hv, r_h, wh, S_BF16, S_F16, NAN_BITS)
            a = tl.where(inside, tl.where(lo[None, :], a_e, a_h), 0.0)
        if STORE_NORMED:
            if pid == 0:  # the programs of the first output block store the normed rows
                tl.store(normed_ptr + t64[:, None] * stride_normed + k[None, :],
                         to_storage(a, S_BF16, S_F16, NAN_BITS), mask=inside)
        if FP8:  # the e4m3 bytes, decoded exactly (0x00 = +0.0 past K)
            wv = e4m3_to_f32(tl.load(w_rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0))
        else:
            wv = tl.load(w_rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0).to(tl.float32)
        p = a[:, None, :] * wv[None, :, :]  # (BLOCK_T, BLOCK_N, BLOCK_K), +0.0 past K
        root = psum_grid(p, BLOCK_T, BLOCK_N, BLOCK_K, LEVELS_K)  # (BLOCK_T, BLOCK_N)
        if FP8:  # chunk c is scale block c (BLOCK_K = 128): times its scale, one rounding
            scale = tl.load(c_ptr + (n // SCALE_ROWS).to(tl.int64) * stride_c + c, mask=n_in, other=0.0)
            root = root * scale[None, :]
        roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
    y = psum_grid(roots, BLOCK_T, BLOCK_N, NCHUNK, LEVELS_C)  # (BLOCK_T, BLOCK_N)

    out_in = t_in[:, None] & n_in[None, :]
    if EPI == 0:
        dst = o_ptr + t64[:, None] * stride_o + n[None, :]
        if OUT_ACC:
            tl.store(dst, y, mask=out_in)
        else:
            tl.store(dst, to_storage(y, S_BF16, S_F16, NAN_BITS), mask=out_in)
    elif EPI == 1:
        res = tl.load(res_ptr + t64[:, None] * stride_res + n[None, :], mask=out_in, other=0.0).to(tl.float32)
        z = res + _round_s(y, S_BF16, S_F16, NAN_BITS)
        tl.store(o_ptr + t64[:, None] * stride_o + n[None, :], to_storage(z, S_BF16, S_F16, NAN_BITS), mask=out_in)
    else:
        logits = _round_s(y, S_BF16, S_F16, NAN_BITS)
        if STORE_LOGITS:  # the step's logits, kept for its confidence and a grammar's redo (S, exact)
            tl.store(lg_ptr + t64[:, None] * stride_lg + n[None, :], to_storage(y, S_BF16, S_F16, NAN_BITS),
                     mask=out_in)
        idx = tl.broadcast_to(n.to(tl.int64)[None, :], (BLOCK_T, BLOCK_N))
        best, best_idx = argmax_reduce(logits, idx, tl.broadcast_to(n_in[None, :], (BLOCK_T, BLOCK_N)))
        tl.store(pv_ptr + t64 * stride_p + pid, best, mask=t_in)
        tl.store(pi_ptr + t64 * stride_p + pid, best_idx, mask=t_in)


@triton.jit
def _argmax_reduce_kernel(
    pv_ptr,  # (T, P) float32
    pi_ptr,  # (T, P) int64
    out_ptr,  # (T,) int64
    T, P, stride_pv, stride_pi,
    BLOCK_P: tl.constexpr,
):
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK_P)
    best = tl.full((1,), float("-inf"), tl.float32)
    best_idx = tl.full((1,), NO_INDEX, tl.int64)
    for c in range(0, tl.cdiv(P, BLOCK_P)):
        p = c * BLOCK_P + j
        valid = (p < P)[None, :]
        v = tl.load(pv_ptr + t * stride_pv + p[None, :], mask=valid, other=float("-inf"))
        i = tl.load(pi_ptr + t * stride_pi + p[None, :], mask=valid, other=NO_INDEX)
        cv, ci = argmax_reduce(v, i, valid)
        best, best_idx = argmax_combine(best, best_idx, cv, ci)
    tl.store(out_ptr + t + tl.arange(0, 1), best_idx)


# ---- launches ---------------------------------------------------------------------------------


def _pow2_meta(n: int) -> dict[str, int]:
    """The rms prologue's chunking of a sum over ``n``: ``BLOCK_R`` lanes, ``NCHUNK_R`` chunks."""
    block = min(numerics.next_pow2(n), MAX_BLOCK_K)
    nchunk = numerics.next_pow2(n) // block
    return dict(BLOCK_R=block, LEVELS_R=block.bit_length() - 1, NCHUNK_R=nchunk, LEVELS_CR=nchunk.bit_length() - 1)


@functools.cache
def _eps32(eps: float) -> float:
    """eps as ``numerics.rms_norm`` adds it: rounded to float32 (then passed on exactly)."""
    return float(torch.tensor(eps, dtype=torch.float32))


def _storage_flags(dtype: torch.dtype, cuda: bool) -> dict[str, object]:
    return dict(S_BF16=dtype == torch.bfloat16, S_F16=dtype == torch.float16, NAN_BITS=0x7FFF if cuda else 0xFFFF)


def _fused_launch(x: Tensor, weights: Sequence[Tensor | BlockScaledWeight], outs: Sequence[Tensor], *, pro: int,
                  epi: int, K: int,
                  s_dtype: torch.dtype, cuda: bool, eps: float = 0.0, norm_weight: Tensor | None = None,
                  emb: Tensor | None = None, tokens: Tensor | None = None, slots: Tensor | None = None,
                  hnorm: Tensor | None = None, residual: Tensor | None = None, normed: Tensor | None = None,
                  part_val: Tensor | None = None, part_idx: Tensor | None = None, logits: Tensor | None = None,
                  out_acc: bool = False) -> Launch:
    """The one place the kernel's grid, arguments and constexprs are computed. Block-scaled
    ``weights`` (all of them, ``BlockScaledWeight``) read their e4m3 bytes and scales in 128-lane
    chunks, one per scale block (``FP8``)."""
    T = x.shape[0]
    nw = len(weights)
    Ns = [w.shape[0] for w in weights]
    scaled = [w for w in weights if isinstance(w, BlockScaledWeight)]
    mats = [w for w in weights if not isinstance(w, BlockScaledWeight)]  # plain: the matrices themselves
    assert not (scaled and mats), "_fused_launch: block-scaled weights come all of them or none"
    fp8 = bool(scaled)
    if fp8:
        scales = [w.scale_inv for w in scaled]
        mats = [w.w8.view(torch.uint8) if w.w8.dtype != torch.uint8 else w.w8 for w in scaled]
        block_t, block_n = fp8_linear_blocks(T, max(Ns))
        block_k = FP8_BLOCK[1]
        nchunk = numerics.next_pow2(-(-K // block_k))
    else:
        block_t, block_n, block_k = linear_blocks(T, max(Ns), K)
        nchunk = numerics.next_pow2(K) // block_k
    blocks = [triton.cdiv(N, block_n) for N in Ns]
    starts = [sum(blocks[:i]) for i in range(MAX_WEIGHTS)]
    H = K // 2 if pro == PRO_HALVES else K
    pad = MAX_WEIGHTS - nw
    ws = mats + [mats[0]] * pad
    os_ = list(outs) + [outs[0]] * pad
    ns = Ns + [Ns[0]] * pad
    sws = [w.stride(0) for w in ws]
    sos = [o.stride(0) for o in os_]
    cs = (scales + [scales[0]] * pad) if fp8 else [x] * MAX_WEIGHTS  # plain: never read
    scs = [c.stride(0) for c in cs] if fp8 else [0] * MAX_WEIGHTS
    big = 1 << 30  # the first block of an absent weight: past every program
    bstarts = [starts[i] if i < nw else big for i in range(1, MAX_WEIGHTS)]
    dummy = x
    args = (
        x, emb if emb is not None else dummy, tokens if tokens is not None else dummy,
        slots if slots is not None else dummy, norm_weight if norm_weight is not None else dummy,
        hnorm if hnorm is not None else dummy, *ws, *cs, *os_, residual if residual is not None else dummy,
        normed if normed is not None else dummy, part_val if part_val is not None else dummy,
        part_idx if part_idx is not None else dummy, logits if logits is not None else dummy,
        T, K, H, emb.shape[0] if emb is not None else 1,
        x.stride(0), emb.stride(0) if emb is not None else 0, residual.stride(0) if residual is not None else 0,
        normed.stride(0) if normed is not None else 0, part_val.stride(0) if part_val is not None else 0,
        logits.stride(0) if logits is not None else 0,
        *ns, *sws, *scs, *sos, *bstarts, _eps32(eps),
    )
    meta = dict(
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, LEVELS_K=block_k.bit_length() - 1,
        NCHUNK=nchunk, LEVELS_C=nchunk.bit_length() - 1, **_pow2_meta(H),
        PRO=pro, NW=nw, EPI=epi, OUT_ACC=out_acc, STORE_NORMED=normed is not None, STORE_LOGITS=logits is not None,
        **_storage_flags(s_dtype, cuda), FP8=fp8, SCALE_ROWS=FP8_BLOCK[0], enable_fp_fusion=False,
    )
    grid = (sum(blocks), triton.cdiv(T, block_t))
    return Launch(_fused_linear_kernel, grid, args, meta)


def block_input_launch(embed: Tensor, tokens: Tensor, slots: Tensor, hiddens: Tensor, enorm: Tensor, hnorm: Tensor,
                       eps: float, eh_proj: Tensor, out: Tensor, cuda: bool | None = None) -> Launch:
    """``block_input``'s launch: ``embed`` (V, H), ``tokens``/``slots`` (T,) int64, ``hiddens``
    (T, H), ``enorm``/``hnorm`` (H,), ``eh_proj`` (H_out, 2H), into ``out`` (T, H_out)."""
    cuda = out.is_cuda if cuda is None else cuda
    return _fused_launch(hiddens, [eh_proj], [out], pro=PRO_HALVES, epi=EPI_STORE, K=eh_proj.shape[1],
                         s_dtype=hiddens.dtype, cuda=cuda, eps=eps, norm_weight=enorm, emb=embed, tokens=tokens,
                         slots=slots, hnorm=hnorm)


def norm_linear_launch(x: Tensor, norm_weight: Tensor, eps: float, weights: Sequence[Tensor], outs: Sequence[Tensor],
                       normed: Tensor | None = None, acc: bool = False, cuda: bool | None = None) -> Launch:
    """``norm_linear``'s launch: ``x`` (T, K), ``norm_weight`` (K,), 1..5 ``weights`` (N_i, K) into
    ``outs`` (T, N_i) (float32 when ``acc``, else x's dtype), and the normed rows into ``normed``
    (T, K) when given."""
    cuda = outs[0].is_cuda if cuda is None else cuda
    return _fused_launch(x, weights, outs, pro=PRO_NORM, epi=EPI_STORE, K=x.shape[1], s_dtype=x.dtype, cuda=cuda,
                         eps=eps, norm_weight=norm_weight, normed=normed, out_acc=acc)


def linear_residual_launch(x: Tensor, weight: Tensor, residual: Tensor, out: Tensor,
                           cuda: bool | None = None) -> Launch:
    """``linear_residual``'s launch: ``x`` (T, K), ``weight`` (N, K), ``residual`` (T, N), into ``out`` (T, N)."""
    cuda = out.is_cuda if cuda is None else cuda
    return _fused_launch(x, [weight], [out], pro=PRO_PLAIN, epi=EPI_RESIDUAL, K=x.shape[1], s_dtype=x.dtype, cuda=cuda,
                         residual=residual)


def head_slices(T: int, V: int, H: int) -> tuple[int, int]:
    """``(P, width)``: the head's vocabulary slices (one per program) for T rows, V words, width H."""
    width = linear_blocks(T, V, H)[1]
    return triton.cdiv(V, width), width


def head_partials_launch(out: Tensor, norm_weight: Tensor, eps: float, lm_head: Tensor, x: Tensor, part_val: Tensor,
                         part_idx: Tensor, logits: Tensor | None = None, cuda: bool | None = None) -> Launch:
    """``head_partials``' launch: ``out`` (T, H), ``norm_weight`` (H,), ``lm_head`` (V, H); the
    normed rows into ``x`` (T, H), each slice's best into ``part_val``/``part_idx`` (T, P), and the
    S logits into ``logits`` (T, V, contiguous last dim) when given."""
    cuda = x.is_cuda if cuda is None else cuda
    return _fused_launch(out, [lm_head], [x], pro=PRO_NORM, epi=EPI_ARGMAX, K=out.shape[1], s_dtype=out.dtype,
                         cuda=cuda, eps=eps, norm_weight=norm_weight, normed=x, part_val=part_val, part_idx=part_idx,
                         logits=logits)


def argmax_reduce_launch(part_val: Tensor, part_idx: Tensor, tokens: Tensor) -> Launch:
    """``argmax_reduce``'s launch: ``part_val`` (T, P) float32, ``part_idx`` (T, P) int64 (each
    with a contiguous last dim) into ``tokens`` (T,) int64. One program per row."""
    T, P = part_val.shape
    block = min(ARGMAX_BLOCK_P, numerics.next_pow2(P))
    return Launch(_argmax_reduce_kernel, (T,), (part_val, part_idx, tokens, T, P, part_val.stride(0),
                                                part_idx.stride(0)), dict(BLOCK_P=block, enable_fp_fusion=False))


# ---- checks -----------------------------------------------------------------------------------


def _matrix(name: str, arg: str, t: Tensor | BlockScaledWeight, cols: int | None = None) -> None:
    if isinstance(t, BlockScaledWeight):  # its bytes and scales, checked as the matrices they are
        if t.w8.dim() != 2:
            raise ValueError(f"{name}: {arg} must be 2-D, got {tuple(t.shape)}")
        if cols is not None and t.shape[1] != cols:
            raise ValueError(f"{name}: {arg} {tuple(t.shape)} must have {cols} columns")
        for part, m in (("w8", t.w8), ("scale_inv", t.scale_inv)):
            if m.shape[1] > 1 and m.stride(1) != 1:
                raise ValueError(f"{name}: {arg}.{part} must have a contiguous last dim (stride {m.stride(1)})")
        return
    if t.dim() != 2:
        raise ValueError(f"{name}: {arg} must be 2-D, got {tuple(t.shape)}")
    if cols is not None and t.shape[1] != cols:
        raise ValueError(f"{name}: {arg} {tuple(t.shape)} must have {cols} columns")
    if t.dtype not in LINEAR_DTYPES:
        raise TypeError(f"{name}: {arg} dtype {t.dtype} is not supported (one of {LINEAR_DTYPES})")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: {arg} must have a contiguous last dim (stride {t.stride(1)})")


def _vector(name: str, arg: str, t: Tensor, n: int) -> None:
    if t.shape != (n,):
        raise ValueError(f"{name}: {arg} must be ({n},), got {tuple(t.shape)}")
    if t.dtype not in LINEAR_DTYPES:
        raise TypeError(f"{name}: {arg} dtype {t.dtype} is not supported (one of {LINEAR_DTYPES})")
    if n > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: {arg} must be contiguous")


def _same_device(name: str, *ts: Tensor) -> None:
    if len({t.device for t in ts}) > 1:
        raise ValueError(f"{name}: tensors on different devices {sorted({str(t.device) for t in ts})}")


# ---- the four uses ------------------------------------------------------------------------------


def block_input_torch(embed: Tensor, tokens: Tensor, slots: Tensor, hiddens: Tensor, enorm: Tensor, hnorm: Tensor,
                      eps: float, eh_proj: Tensor) -> Tensor:
    """The twin (reference.block ``embed_rows`` + ``block_input``): ``linear(cat(rms_norm(e,
    enorm), rms_norm(hiddens, hnorm)), eh_proj)`` with ``e = embed[tokens]`` zeroed at slot 0."""
    e = embed_rows_torch(embed, tokens, slots)
    a = torch.cat((numerics.rms_norm(e, enorm, eps), numerics.rms_norm(hiddens, hnorm, eps)), dim=-1)
    return numerics.linear(a, eh_proj)


def block_input_triton(embed: Tensor, tokens: Tensor, slots: Tensor, hiddens: Tensor, enorm: Tensor, hnorm: Tensor,
                       eps: float, eh_proj: Tensor) -> Tensor:
    """The kernel: ``embed`` (V, H), ``tokens`` (T,) int64 ids (in range: an id outside reads row
    0), ``slots`` (T,) int64, ``hiddens`` (T, H), ``enorm``/``hnorm`` (H,), ``eh_proj`` (H_out, 2H)
    -> u (T, H_out) in the hiddens' dtype, byte-equal to ``block_input_torch``. One launch."""
    name = "block_input_triton"
    _matrix(name, "embed", embed)
    H = embed.shape[1]
    _matrix(name, "hiddens", hiddens, H)
    _matrix(name, "eh_proj", eh_proj, 2 * H)
    _vector(name, "enorm", enorm, H)
    _vector(name, "hnorm", hnorm, H)
    T = hiddens.shape[0]
    if tokens.shape != (T,) or slots.shape != (T,) or tokens.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError(f"{name}: tokens and slots must be ({T},) int64, got {tuple(tokens.shape)} {tokens.dtype}, "
                         f"{tuple(slots.shape)} {slots.dtype}")
    if embed.dtype != hiddens.dtype:
        raise TypeError(f"{name}: embed ({embed.dtype}) and hiddens ({hiddens.dtype}) must share a dtype")
    _same_device(name, embed, tokens, slots, hiddens, enorm, hnorm, eh_proj)
    if H == 0:
        raise ValueError(f"{name}: an empty hidden width")
    out = torch.empty(T, eh_proj.shape[0], dtype=hiddens.dtype, device=hiddens.device)
    if out.numel() > 0:
        block_input_launch(embed, tokens, slots, hiddens, enorm, hnorm, eps, eh_proj, out).run()
    return out


def norm_linear_torch(x: Tensor, norm_weight: Tensor, eps: float, weights: Sequence[Tensor], acc: bool = False,
                      store_normed: bool = False) -> tuple[list[Tensor], Tensor | None]:
    """The twin: ``a = rms_norm(x, norm_weight, eps)``; ``[linear(a, W) for W in weights]``
    (``linear_acc`` when ``acc``); ``a`` too when ``store_normed``."""
    a = numerics.rms_norm(x, norm_weight, eps)
    outs = [numerics.linear_acc(a, w) if acc else numerics.linear(a, w) for w in weights]
    return outs, (a if store_normed else None)


def norm_linear_triton(x: Tensor, norm_weight: Tensor, eps: float, weights: Sequence[Tensor], acc: bool = False,
                       store_normed: bool = False) -> tuple[list[Tensor], Tensor | None]:
    """The kernel: ``x`` (T, K), ``norm_weight`` (K,), 1..5 ``weights`` (N_i, K) of one dtype, or
    all block-scaled fp8 (``BlockScaledWeight``: their bytes and scales read as they are) ->
    ([y_i (T, N_i)], normed (T, K) or None), byte-equal to ``norm_linear_torch``. ONE launch for
    all weights; the weights are read in place (any row stride, contiguous last dim)."""
    name = "norm_linear_triton"
    _matrix(name, "x", x)
    T, K = x.shape
    _vector(name, "norm_weight", norm_weight, K)
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"{name}: 1..{MAX_WEIGHTS} weights, got {len(weights)}")
    for i, w in enumerate(weights):
        _matrix(name, f"weights[{i}]", w, K)
    if len({w.dtype for w in weights}) > 1:
        raise TypeError(f"{name}: the weights must share a dtype (block-scaled fp8 or one plain dtype: one launch "
                        f"reads one format), got {[w.dtype for w in weights]}")
    _same_device(name, x, norm_weight, *weights)
    if K == 0:
        raise ValueError(f"{name}: an empty width K")
    out_dtype = torch.float32 if acc else x.dtype
    outs = [torch.empty(T, w.shape[0], dtype=out_dtype, device=x.device) for w in weights]
    normed = torch.empty(T, K, dtype=x.dtype, device=x.device) if store_normed else None
    live = [i for i, w in enumerate(weights) if w.shape[0] > 0]
    if T > 0 and live:
        norm_linear_launch(x, norm_weight, eps, [weights[i] for i in live], [outs[i] for i in live], normed, acc).run()
    elif store_normed and T > 0:  # every weight has N = 0: no program would store the normed rows
        normed = numerics.rms_norm(x, norm_weight, eps)
    return outs, normed


def linear_residual_torch(x: Tensor, weight: Tensor, residual: Tensor) -> Tensor:
    """The twin: ``residual + linear(x, weight)`` (torch's add in S: one rounding)."""
    return residual + numerics.linear(x, weight)


def linear_residual_triton(x: Tensor, weight: Tensor, residual: Tensor) -> Tensor:
    """The kernel: ``x`` (T, K), ``weight`` (N, K) (or a block-scaled fp8 ``BlockScaledWeight``),
    ``residual`` (T, N) of x's dtype -> (T, N), byte-equal to ``linear_residual_torch``."""
    name = "linear_residual_triton"
    _matrix(name, "x", x)
    _matrix(name, "weight", weight, x.shape[1])
    _matrix(name, "residual", residual, weight.shape[0])
    if residual.shape[0] != x.shape[0] or residual.dtype != x.dtype:
        raise ValueError(f"{name}: residual {tuple(residual.shape)} {residual.dtype} must be "
                         f"({x.shape[0]}, {weight.shape[0]}) {x.dtype}")
    _same_device(name, x, weight, residual)
    if x.shape[1] == 0:
        raise ValueError(f"{name}: an empty width K")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        linear_residual_launch(x, weight, residual, out).run()
    return out


def head_partials_torch(out: Tensor, norm_weight: Tensor, eps: float, lm_head: Tensor, x_out: Tensor | None = None,
                        logits_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The twin: ``x = rms_norm(out, norm_weight, eps)``, ``logits = linear(x, lm_head)`` (S) and,
    for each of the kernel's vocabulary slices (``head_slices``), ``greedy_token`` over the slice
    and the logit there in float32: (x (T, H), part_val (T, P) float32, part_idx (T, P) int64).
    ``x_out`` (T, H): where x is written (returned as x); ``logits_out`` (T, V) S: the logits."""
    T, H = out.shape
    V = lm_head.shape[0]
    x = numerics.rms_norm(out, norm_weight, eps)
    if x_out is not None:
        x = x_out.copy_(x)
    s_logits = numerics.linear(x, lm_head)  # (T, V) S
    if logits_out is not None:
        logits_out.copy_(s_logits)
    logits = numerics.up(s_logits).float()  # (T, V)
    P, width = head_slices(T, V, H)
    padded = torch.full((T, P * width), float("-inf"), dtype=torch.float32, device=out.device)
    padded[:, :V] = logits  # -inf past V never wins: a slice's valid lanes come first (ties: lower)
    local = greedy_token(padded.reshape(T, P, width))  # (T, P)
    part_val = padded.reshape(T, P, width).gather(-1, local[..., None])[..., 0]
    part_idx = local + torch.arange(P, device=out.device)[None, :] * width
    return x, part_val, part_idx


def head_partials_triton(out: Tensor, norm_weight: Tensor, eps: float, lm_head: Tensor, x_out: Tensor | None = None,
                         logits_out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel: ``out`` (T, H), ``norm_weight`` (H,), ``lm_head`` (V, H) -> (x (T, H) S,
    part_val (T, P) float32, part_idx (T, P) int64), byte-equal to ``head_partials_torch``
    (NaN payloads aside). ``x_out`` (T, H) of out's dtype: where x is stored (else a new
    tensor); ``logits_out`` (T, V) of out's dtype with a contiguous last dim: where the S logits
    are stored, by the same launch (else they are never written)."""
    name = "head_partials_triton"
    _matrix(name, "out", out)
    T, H = out.shape
    _vector(name, "norm_weight", norm_weight, H)
    _matrix(name, "lm_head", lm_head, H)
    _same_device(name, out, norm_weight, lm_head)
    V = lm_head.shape[0]
    if V == 0 or H == 0:
        raise ValueError(f"{name}: an empty vocabulary or width ({V}, {H})")
    P, _ = head_slices(T, V, H)
    for arg, t, cols in (("x_out", x_out, H), ("logits_out", logits_out, V)):
        if t is not None and (t.shape != (T, cols) or t.dtype != out.dtype or t.device != out.device
                              or (cols > 1 and t.stride(1) != 1)):
            raise ValueError(f"{name}: {arg} must be ({T}, {cols}) {out.dtype} on {out.device} with a contiguous "
                             f"last dim, got {tuple(t.shape)} {t.dtype} on {t.device}")
    x = torch.empty(T, H, dtype=out.dtype, device=out.device) if x_out is None else x_out
    part_val = torch.empty(T, P, dtype=torch.float32, device=out.device)
    part_idx = torch.empty(T, P, dtype=torch.int64, device=out.device)
    if T > 0:
        head_partials_launch(out, norm_weight, eps, lm_head, x, part_val, part_idx, logits_out).run()
    return x, part_val, part_idx


def argmax_reduce_torch(part_val: Tensor, part_idx: Tensor) -> Tensor:
    """The twin: the index at ``greedy_token(part_val)`` of each row (T,) int64."""
    return part_idx.gather(-1, greedy_token(part_val)[:, None])[:, 0]


def argmax_reduce_triton(part_val: Tensor, part_idx: Tensor) -> Tensor:
    """The kernel: ``part_val`` (T, P) float32 and ``part_idx`` (T, P) int64, indices ascending
    along P (as ``head_partials`` writes them) -> tokens (T,) int64, ``argmax_reduce_torch``'s."""
    name = "argmax_reduce_triton"
    if part_val.dim() != 2 or part_val.shape != part_idx.shape or part_val.shape[1] == 0:
        raise ValueError(f"{name}: part_val and part_idx must be (T, P>0), got {tuple(part_val.shape)}, "
                         f"{tuple(part_idx.shape)}")
    if part_val.dtype != torch.float32 or part_idx.dtype != torch.int64:
        raise TypeError(f"{name}: part_val float32 and part_idx int64, got {part_val.dtype}, {part_idx.dtype}")
    if part_val.shape[1] > 1 and (part_val.stride(1) != 1 or part_idx.stride(1) != 1):
        raise ValueError(f"{name}: part_val and part_idx need a contiguous last dim")
    _same_device(name, part_val, part_idx)
    tokens = torch.empty(part_val.shape[0], dtype=torch.int64, device=part_val.device)
    if tokens.numel() > 0:
        argmax_reduce_launch(part_val, part_idx, tokens).run()
    return tokens


# ---- the audit --------------------------------------------------------------------------------


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """Every launch of this module the draft step makes at ``cfg`` with ``dtype`` weights, on
    abstract tensors: a draft step (``step``: 1 row) and a catch-up chunk (``rows``: 8 rows)."""
    H, V, Lq = cfg.hidden_size, cfg.vocab_size, cfg.q_lora_rank
    Hi, D = cfg.index_n_heads, cfg.index_head_dim
    nh = cfg.num_attention_heads
    launches = []
    for variant, T in (("step", 1), ("rows", 8)):
        def a(*shape, dt=dtype):
            return abstract(shape, dt)

        launches.append(AuditLaunch("block_input", variant, block_input_launch(
            a(V, H), a(T, dt=torch.int64), a(T, dt=torch.int64), a(T, H), a(H), a(H), cfg.rms_norm_eps,
            a(H, 2 * H), a(T, H), cuda=True)))
        # + the KPool gate
        attn_in = [a(Lq, H), a(cfg.kv_row_width, H), a(D, H), a(Hi, H)] + ([a(D, H)] if cfg.is_next else [])
        launches.append(AuditLaunch("norm_linear:input", variant, norm_linear_launch(
            a(T, H), a(H), cfg.rms_norm_eps, attn_in, [a(T, w.shape[0]) for w in attn_in], cuda=True)))
        q_b = [a(nh * cfg.qk_head_dim, Lq), a(Hi * D, Lq)]
        launches.append(AuditLaunch("norm_linear:q_a_norm", variant, norm_linear_launch(
            a(T, Lq), a(Lq), cfg.latent_norm_eps, q_b, [a(T, w.shape[0]) for w in q_b], cuda=True)))
        router = a(cfg.n_routed_experts, H)
        launches.append(AuditLaunch("norm_linear:router", variant, norm_linear_launch(
            a(T, H), a(H), cfg.rms_norm_eps, [router], [a(T, cfg.n_routed_experts, dt=torch.float32)], a(T, H),
            acc=True, cuda=True)))
        launches.append(AuditLaunch("linear_residual", variant, linear_residual_launch(
            a(T, nh * cfg.v_head_dim), a(H, nh * cfg.v_head_dim), a(T, H), a(T, H), cuda=True)))
        P, _ = head_slices(T, V, H)
        launches.append(AuditLaunch("head_partials", variant, head_partials_launch(
            a(T, H), a(H), cfg.rms_norm_eps, a(V, H), a(T, H), a(T, P, dt=torch.float32), a(T, P, dt=torch.int64),
            a(T, V), cuda=True)))  # the drafter stores the step's logits (confidence, grammar redo)
        launches.append(AuditLaunch("argmax_reduce", variant, argmax_reduce_launch(
            a(T, P, dt=torch.float32), a(T, P, dt=torch.int64), a(T, dt=torch.int64))))

        # Block-scaled fp8 weights (DESIGN.md §8): the same launches over e4m3 bytes and scales
        # (the input norm's fp8 group: q_a, kv_a, wk; weights_proj stays plain).
        def q(*shape):
            return BlockScaledWeight(abstract(shape, torch.float8_e4m3fn), abstract(scale_shape(shape), torch.float32))

        fp8_in = [q(Lq, H), q(cfg.kv_row_width, H), q(D, H)]
        launches.append(AuditLaunch("norm_linear:input_fp8", variant, norm_linear_launch(
            a(T, H), a(H), cfg.rms_norm_eps, fp8_in, [a(T, w.shape[0]) for w in fp8_in], cuda=True)))
        fp8_q_b = [q(nh * cfg.qk_head_dim, Lq), q(Hi * D, Lq)]
        launches.append(AuditLaunch("norm_linear:q_a_norm_fp8", variant, norm_linear_launch(
            a(T, Lq), a(Lq), cfg.latent_norm_eps, fp8_q_b, [a(T, w.shape[0]) for w in fp8_q_b], cuda=True)))
        launches.append(AuditLaunch("linear_residual_fp8", variant, linear_residual_launch(
            a(T, nh * cfg.v_head_dim), q(H, nh * cfg.v_head_dim), a(T, H), a(T, H), cuda=True)))
    return launches
