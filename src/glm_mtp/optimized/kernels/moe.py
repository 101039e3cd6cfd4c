"""The MoE after the router's GEMV as three kernels: expert choice, the chosen experts' gate/up
with SwiGLU, and their down projections fused with the weighted combine, the shared expert and
the residual add.

Replaces, in ``glm_mtp.reference.moe.moe_block`` and ``block.decoder_layer``::

    experts, weights = choose_experts(cfg, logits, bias)          # route after linear_acc
    hidden[t, j]  = swiglu_hidden(m[t], gate[e], up[e])           # e = experts[t, j]
                    (glm5_next: clamped_swiglu_hidden at swiglu_limit, the ``limit`` argument)
    y[t, j]       = linear(hidden[t, j], down[e])
    out = h + round_S(combine(weights, y) + up(swiglu(m, shared)))

Exact by construction (DESIGN.md §5): sigmoid and silu are ``pinned_math``'s ports of
``numerics.exp`` (no ``tl.exp``) with ``div_rn``; every dot is the ``psum`` tree cut at chunk
boundaries as in ``linear.py`` (products rounded once each, ``enable_fp_fusion=False``); the
combine's sum over the k slots is the ``psum`` tree over ``next_pow2(k)`` register columns in
ascending expert id, then ``+ shared``; each cast to bfloat16 rounds on the bits. Selection is on
integer keys (a float's bits made order-preserving, ``-0.0`` as ``+0.0`` and NaN above ``+inf``,
as torch's sort orders them), with integer max/min reductions only, ties to the lower index.

Everything stays on the device: expert ids are read by the kernels (no ``.item()``, no gathered
weight copies: each expert's rows are read in place from the stacked ``(E, I, H)`` tensors), so
the three launches can be captured in a CUDA graph. A row's result never depends on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_mtp.reference import numerics
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.fp8 import BlockScaledWeight, scale_shape
from glm_mtp.reference import moe as ref_moe
from glm_mtp.reference.moe import choose_experts, combine
from glm_mtp.reference.numerics import PINNED, up

from .launch import AuditLaunch, Launch, abstract
from .linear_fp8 import FP8_BLOCK, e4m3_to_f32
from .pinned_math import key_value, order_key, psum_grid, sigmoid_f32, silu_f32
from .rounding import float32_bits, to_storage
from glm_mtp.reference.layers import clamped_swiglu_hidden

# Storage dtypes of the expert kernels (activations and weights).
MOE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# As linear.py: chunks of at most MAX_BLOCK_K inputs, about TILE products per chunk.
MAX_BLOCK_K = 256
TILE = 2048
NORM_EPS = ref_moe.NORM_EPS
# The expert kernels' rows run on a CUDA grid's second/third axis (at most 65535 blocks).
MAX_ROWS = 65535
_INT_MIN = tl.constexpr(-2147483648)
# order_key(-inf): where masked_fill puts the experts of the groups left out.
_NEG_INF_KEY = tl.constexpr(int(torch.tensor([0xFF800000 ^ 0x7FFFFFFF], dtype=torch.int64).to(torch.int32).item()))


# ---- shared pieces ----------------------------------------------------------------------------


@triton.jit
def _dot_cols(x_row, w_rows, n_in, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LEVELS_K: tl.constexpr,
              NCHUNK: tl.constexpr, LEVELS_C: tl.constexpr, s_rows, FP8: tl.constexpr):
    """``psum_k(up(x[k]) * up(W[n, k]))`` for a block of output columns: ``x_row`` points at x's
    first element, ``w_rows`` (BLOCK_N, 1) at each column's weight row. The padded tree over K
    cut at BLOCK_K (see linear.py): one root per chunk into a +0.0 array, then its tree.

    ``FP8``: ``w_rows`` point at e4m3 bytes and ``s_rows`` (BLOCK_N,) at each column's row of
    block scales; chunks are the 128-wide scale blocks (BLOCK_K = 128) and each root is multiplied
    by its block's scale before the tree over blocks (DESIGN.md §8). Otherwise ``s_rows`` is unused."""
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, NCHUNK)
    roots = tl.zeros((1, BLOCK_N, NCHUNK), tl.float32)
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        k_in = k < K
        xv = tl.load(x_row + k, mask=k_in, other=0.0).to(tl.float32)
        if FP8:
            wv = e4m3_to_f32(tl.load(w_rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0))
        else:
            wv = tl.load(w_rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0).to(tl.float32)
        p = xv[None, None, :] * wv[None, :, :]  # (1, BLOCK_N, BLOCK_K), +0.0 past K
        root = psum_grid(p, 1, BLOCK_N, BLOCK_K, LEVELS_K)
        if FP8:
            root = root * tl.load(s_rows + c, mask=n_in, other=0.0)[None, :]
        roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
    return tl.reshape(psum_grid(roots, 1, BLOCK_N, NCHUNK, LEVELS_C), (BLOCK_N,))


# ---- 1. the expert choice -----------------------------------------------------------------------


@triton.jit
def _route_kernel(
    logits_ptr,  # (T, E) float32, row stride stride_l
    bias_ptr,  # (E,) selection bias
    experts_ptr,  # (T, k) int64 out, row stride stride_x
    weights_ptr,  # (T, k) float32 out, row stride stride_w
    stride_l,
    stride_x,
    stride_w,
    scaling,  # float32 routed_scaling_factor
    E: tl.constexpr,
    G: tl.constexpr,  # n_group (1: no group limiting)
    EG: tl.constexpr,  # experts per group, E // G
    BLOCK_G: tl.constexpr,
    BLOCK_EG: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    K: tl.constexpr,  # experts per row
    BLOCK_KS: tl.constexpr,  # next_pow2(K)
    LEVELS_KS: tl.constexpr,
    NORM: tl.constexpr,  # norm_topk_prob
    EPS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    i = tl.arange(0, BLOCK_EG)
    ids = g[:, None] * EG + i[None, :]  # (BLOCK_G, BLOCK_EG): expert id = group * EG + index in group
    valid = (g[:, None] < G) & (i[None, :] < EG)
    logit = tl.load(logits_ptr + t * stride_l + ids, mask=valid, other=0.0)
    bias = tl.load(bias_ptr + ids, mask=valid, other=0.0).to(tl.float32)
    biased = sigmoid_f32(logit) + bias  # the scores plus the bias, as route: scores + up(bias)
    key = tl.where(valid, order_key(biased), _INT_MIN)
    BIG: tl.constexpr = BLOCK_G * BLOCK_EG
    if G > 1:
        # Group score: best + second best biased score (topk(2).values, psum of two).
        k1 = tl.max(key, axis=1)  # (BLOCK_G,)
        i1 = tl.min(tl.where(key == k1[:, None], i[None, :], BLOCK_EG), axis=1)
        k2 = tl.max(tl.where(i[None, :] == i1[:, None], _INT_MIN, key), axis=1)
        gkey = tl.where(g < G, order_key(key_value(k1) + key_value(k2)), _INT_MIN)
        # The TOPK_GROUP best groups, ties to the lower group.
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(tl.where(keep, _INT_MIN, gkey), axis=0)
            pick = tl.min(tl.where((gkey == best) & ~keep & (g < G), g, BLOCK_G), axis=0)
            keep = keep | (g == pick)
        # Experts of the other groups compete at -inf (masked_fill), still ahead of the padding.
        key = tl.where(valid & ~keep[:, None], _NEG_INF_KEY, key)
    # The K best, ties to the lower expert id (a stable descending sort), as a chosen-mask.
    chosen = ids < 0
    for _ in tl.static_range(K):
        best = tl.max(tl.max(tl.where(chosen | ~valid, _INT_MIN, key), axis=1), axis=0)
        cand = (key == best) & ~chosen & valid
        pick = tl.min(tl.min(tl.where(cand, ids, BIG), axis=1), axis=0)
        chosen = chosen | (ids == pick)
    # Ascending ids: slot j holds the j-th smallest chosen id.
    slot = tl.arange(0, BLOCK_KS)
    out_ids = tl.zeros((BLOCK_KS,), tl.int32)
    taken = ids < 0
    for j in tl.static_range(K):
        low = tl.min(tl.min(tl.where(chosen & ~taken, ids, BIG), axis=1), axis=0)
        taken = taken | (ids == low)
        out_ids = tl.where(slot == j, low, out_ids)
    s_in = slot < K
    # The chosen experts' unbiased scores, recomputed from their logits (same bits as above).
    w = tl.where(s_in, sigmoid_f32(tl.load(logits_ptr + t * stride_l + out_ids, mask=s_in, other=0.0)), 0.0)
    if NORM:
        total = tl.reshape(psum_grid(tl.reshape(w, (1, 1, BLOCK_KS)), 1, 1, BLOCK_KS, LEVELS_KS), (1,))
        w = tl.math.div_rn(w, total + EPS)
    w = w * scaling
    tl.store(experts_ptr + t * stride_x + slot, out_ids.to(tl.int64), mask=s_in)
    tl.store(weights_ptr + t * stride_w + slot, w, mask=s_in)


def route_torch(cfg: MtpConfig, logits: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """The twin: ``moe.choose_experts`` itself, pinned."""
    return choose_experts(cfg, logits, bias, PINNED)


def route_launch(cfg: MtpConfig, logits: Tensor, bias: Tensor, experts: Tensor, weights: Tensor) -> Launch:
    """The expert choice's launch: one program per row."""
    E, G, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
    block_ks = numerics.next_pow2(k)
    meta = dict(
        E=E, G=G, EG=E // G, BLOCK_G=numerics.next_pow2(G), BLOCK_EG=numerics.next_pow2(E // G),
        TOPK_GROUP=cfg.topk_group, K=k, BLOCK_KS=block_ks, LEVELS_KS=block_ks.bit_length() - 1,
        NORM=bool(cfg.norm_topk_prob), EPS=NORM_EPS, enable_fp_fusion=False,
    )
    scaling = float(torch.tensor(cfg.routed_scaling_factor, dtype=torch.float32))  # torch multiplies in float32
    args = (logits, bias, experts, weights, logits.stride(0), experts.stride(0), weights.stride(0), scaling)
    return Launch(_route_kernel, (logits.shape[0],), args, meta)


def route_triton(cfg: MtpConfig, logits: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel for ``choose_experts``: ``logits`` (T, E) float32 (the router's ``linear_acc``),
    ``bias`` (E,) -> ``experts`` (T, k) int64 in ascending order, ``weights`` (T, k) float32,
    byte-equal to the twin."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if logits.dim() != 2 or logits.shape[1] != E or logits.dtype != torch.float32:
        raise ValueError(f"route_triton: logits must be (T, {E}) float32, got {tuple(logits.shape)} {logits.dtype}")
    if bias.shape != (E,) or bias.dtype not in MOE_DTYPES:
        raise ValueError(f"route_triton: bias must be ({E},) float, got {tuple(bias.shape)} {bias.dtype}")
    if E > 1 and logits.stride(1) != 1:
        logits = logits.contiguous()
    bias = bias.contiguous()
    T = logits.shape[0]
    experts = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T:
        route_launch(cfg, logits, bias, experts, weights).run()
    return experts, weights

# ---- 2. the chosen experts' gate/up and SwiGLU --------------------------------------------------


@triton.jit
def _gate_up_kernel(
    m_ptr,  # (T, H) S, row stride stride_m
    experts_ptr,  # (T, k) int64, row stride stride_x
    gate_ptr,  # (E, I, H): expert stride stride_ge, row stride stride_gn
    up_ptr,  # (E, I, H): expert stride stride_ue, row stride stride_un
    sgate_ptr,  # (Is, H) shared gate, row stride stride_sg (unused without a shared expert)
    sup_ptr,  # (Is, H) shared up, row stride stride_su
    hidden_ptr,  # (T, k, I) S out: strides stride_ht, stride_hj (rows contiguous)
    shidden_ptr,  # (T, Is) S out, row stride stride_st
    gate_s, up_s,  # FP8: (E, ceil(I/128), ceil(H/128)) float32 scales: expert stride stride_cse, row stride stride_csn
    sgate_s, sup_s,  # FP8: (ceil(Is/128), ceil(H/128)) scales, row stride stride_css
    H,
    I,
    Is,
    stride_cse,
    stride_csn,
    stride_css,
    stride_m,
    stride_x,
    stride_ge,
    stride_gn,
    stride_ue,
    stride_un,
    stride_sg,
    stride_su,
    stride_ht,
    stride_hj,
    stride_st,
    limit_bits,  # swiglu_limit's float32 bits (read only with CLAMP)
    K: tl.constexpr,  # routed slots; slot K is the shared expert
    CLAMP: tl.constexpr,  # glm5_next's clamped SwiGLU
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LEVELS_K: tl.constexpr,
    NCHUNK: tl.constexpr,
    LEVELS_C: tl.constexpr,
    TO_BF16: tl.constexpr,
    TO_F16: tl.constexpr,
    NAN_BITS: tl.constexpr,
    FP8: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)
    m_row = m_ptr + t * stride_m
    srow = (n // 128).to(tl.int64)  # FP8: each column's row of block scales
    if j < K:  # a routed slot: its expert's rows, read in place
        e = tl.load(experts_ptr + t * stride_x + j)
        n_in = n < I
        g_rows = gate_ptr + e * stride_ge + n.to(tl.int64)[:, None] * stride_gn
        u_rows = up_ptr + e * stride_ue + n.to(tl.int64)[:, None] * stride_un
        g_s = gate_s + e * stride_cse + srow * stride_csn
        u_s = up_s + e * stride_cse + srow * stride_csn
        dst = hidden_ptr + t * stride_ht + j * stride_hj + n
    else:  # the shared expert
        n_in = n < Is
        g_rows = sgate_ptr + n.to(tl.int64)[:, None] * stride_sg
        u_rows = sup_ptr + n.to(tl.int64)[:, None] * stride_su
        g_s = sgate_s + srow * stride_css
        u_s = sup_s + srow * stride_css
        dst = shidden_ptr + t * stride_st + n
    gate = _dot_cols(m_row, g_rows, n_in, H, BLOCK_N, BLOCK_K, LEVELS_K, NCHUNK, LEVELS_C, g_s, FP8)
    upv = _dot_cols(m_row, u_rows, n_in, H, BLOCK_N, BLOCK_K, LEVELS_K, NCHUNK, LEVELS_C, u_s, FP8)
    # swiglu_hidden: round_S(silu(up(round_S(gate))) * up(round_S(up)))
    g_r = to_storage(gate, TO_BF16, TO_F16, NAN_BITS).to(tl.float32)
    u_r = to_storage(upv, TO_BF16, TO_F16, NAN_BITS).to(tl.float32)
    if CLAMP:  # g = min(g, L), u = min(max(u, -L), L): exact, and a NaN fails every comparison so stays NaN
        L = limit_bits.to(tl.float32, bitcast=True)
        g_r = tl.where(g_r > L, L, g_r)
        u_r = tl.where(u_r > L, L, tl.where(u_r < -L, -L, u_r))
    h = silu_f32(g_r) * u_r
    tl.store(dst, to_storage(h, TO_BF16, TO_F16, NAN_BITS), mask=n_in)


def _check_stack(name: str, arg: str, w: Tensor | BlockScaledWeight, dims: int, dtype: torch.dtype) -> None:
    if isinstance(w, BlockScaledWeight):  # e4m3 bytes and scales, read as they are
        if w.w8.dim() != dims:
            raise ValueError(f"{name}: {arg} must have {dims} dims, got {tuple(w.shape)}")
        for part, t in (("w8", w.w8), ("scale_inv", w.scale_inv)):
            if t.shape[-1] > 1 and t.stride(-1) != 1:
                raise ValueError(f"{name}: {arg}.{part} must have a contiguous last dim (stride {t.stride(-1)})")
        return
    if w.dim() != dims:
        raise ValueError(f"{name}: {arg} must have {dims} dims, got {tuple(w.shape)}")
    if w.dtype != dtype:
        raise TypeError(f"{name}: {arg} dtype {w.dtype} differs from the activations' {dtype}")
    if w.shape[-1] > 1 and w.stride(-1) != 1:
        raise ValueError(f"{name}: {arg} must have a contiguous last dim (stride {w.stride(-1)})")


def _one_format(name: str, mats: list) -> None:
    """One launch reads one weight format: all block-scaled fp8, or all plain."""
    kinds = {isinstance(w, BlockScaledWeight) for _, w, _ in mats}
    if len(kinds) > 1:
        raise TypeError(f"{name}: {', '.join(a for a, _, _ in mats)} mix block-scaled fp8 and plain weights; "
                        "one launch reads one format")


def _unit_columns(x: Tensor) -> Tensor:
    """``x`` (T, k) with unit column stride (the kernels index ``row * stride(0) + j``): a copy
    on the device where it has another."""
    return x if x.shape[1] <= 1 or x.stride(1) == 1 else x.contiguous()


def _check_rows(name: str, T: int) -> None:
    if T > MAX_ROWS:
        raise ValueError(f"{name}: at most {MAX_ROWS} rows per call (a grid axis runs over them), got {T}")


def _blocks(K: int, fp8: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_K, NCHUNK, BLOCK_N)`` for sums over K inputs (see linear.linear_blocks); over a
    block-scaled weight, chunks are its 128-wide scale blocks."""
    if fp8:
        block_k = FP8_BLOCK[1]
        return block_k, numerics.next_pow2(-(-K // block_k)), max(1, TILE // block_k)
    block_k = min(numerics.next_pow2(K), MAX_BLOCK_K)
    return block_k, numerics.next_pow2(K) // block_k, max(1, TILE // block_k)


def _parts(w: Tensor | BlockScaledWeight | None) -> tuple[Tensor | None, Tensor | None]:
    """A weight's values as the kernels read them (a block-scaled one: its e4m3 bytes as uint8)
    and its scales (None for a plain weight)."""
    if isinstance(w, BlockScaledWeight):
        return w.w8.view(torch.uint8), w.scale_inv
    return w, None


def _storage_meta(dtype: torch.dtype, cuda: bool) -> dict:
    return dict(TO_BF16=dtype == torch.bfloat16, TO_F16=dtype == torch.float16, NAN_BITS=0x7FFF if cuda else 0xFFFF,
                enable_fp_fusion=False)


def experts_gate_up_launch(m: Tensor, experts: Tensor, experts_gate: Tensor, experts_up: Tensor,
                           shared_gate: Tensor | None, shared_up: Tensor | None, hidden: Tensor,
                           shared_hidden: Tensor | None, cuda: bool | None = None,
                           limit: float | None = None) -> Launch:
    """The gate/up launch: grid (column blocks, k + 1 slots (k without a shared expert), T);
    ``limit``: glm5_next's ``swiglu_limit`` (the clamped SwiGLU), None for GLM-5's."""
    (T, H), k, I = m.shape, experts.shape[1], experts_gate.shape[1]
    has_shared = shared_gate is not None
    Is = shared_gate.shape[0] if has_shared else 0
    fp8 = isinstance(experts_gate, BlockScaledWeight)
    (experts_gate, gs), (experts_up, us) = _parts(experts_gate), _parts(experts_up)
    (shared_gate, sgs), (shared_up, sus) = _parts(shared_gate), _parts(shared_up)
    block_k, nchunk, block_n = _blocks(H, fp8)
    block_n = min(block_n, numerics.next_pow2(max(I, Is)))
    cuda = hidden.is_cuda if cuda is None else cuda
    sg = shared_gate if has_shared else experts_gate
    su = shared_up if has_shared else experts_up
    sh = shared_hidden if has_shared else hidden
    if fp8:
        sgs, sus = (sgs, sus) if has_shared else (gs, us)
        scales = (gs, us, sgs, sus, gs.stride(0), gs.stride(1), sgs.stride(0) if has_shared else 0)
    else:  # never read
        scales = (m, m, m, m, 0, 0, 0)
    args = (m, experts, experts_gate, experts_up, sg, su, hidden, sh, *scales[:4], H, I, Is, *scales[4:],
            m.stride(0), experts.stride(0),
            experts_gate.stride(0), experts_gate.stride(1), experts_up.stride(0), experts_up.stride(1),
            sg.stride(0) if has_shared else 0, su.stride(0) if has_shared else 0, hidden.stride(0), hidden.stride(1),
            sh.stride(0) if has_shared else 0, float32_bits(limit) if limit is not None else 0)
    meta = dict(K=k, CLAMP=limit is not None, BLOCK_N=block_n, BLOCK_K=block_k, LEVELS_K=block_k.bit_length() - 1,
                NCHUNK=nchunk,
                LEVELS_C=nchunk.bit_length() - 1, **_storage_meta(hidden.dtype, cuda), FP8=fp8)
    grid = (triton.cdiv(max(I, Is), block_n), k + int(has_shared), T)
    return Launch(_gate_up_kernel, grid, args, meta)


def experts_gate_up_torch(m: Tensor, experts: Tensor, experts_gate: Tensor, experts_up: Tensor,
                          shared_gate: Tensor | None = None, shared_up: Tensor | None = None,
                          limit: float | None = None) -> tuple[Tensor, Tensor | None]:
    """The twin: ``numerics.swiglu_hidden`` of each row on each of its experts (read in place, as
    ``moe.expert_outputs`` reads them), and of the rows on the shared expert; with ``limit``
    (glm5_next) the reference's ``layers.clamped_swiglu_hidden`` at that limit."""
    def swiglu_hidden(x: Tensor, gate: Tensor, upw: Tensor) -> Tensor:
        if limit is None:
            return numerics.swiglu_hidden(x, gate, upw)
        return clamped_swiglu_hidden(x, gate, upw, limit)

    hidden = torch.empty(*experts.shape, experts_gate.shape[1], dtype=m.dtype, device=m.device)
    for t, ids in enumerate(experts.tolist()):
        for j, e in enumerate(ids):
            hidden[t, j] = swiglu_hidden(m[t], experts_gate[e], experts_up[e])
    shared = None if shared_gate is None else swiglu_hidden(m, shared_gate, shared_up)
    return hidden, shared


def experts_gate_up_triton(m: Tensor, experts: Tensor, experts_gate: Tensor, experts_up: Tensor,
                           shared_gate: Tensor | None = None, shared_up: Tensor | None = None,
                           limit: float | None = None) -> tuple[Tensor, Tensor | None]:
    """The kernel for the chosen experts' SwiGLU hidden: ``m`` (T, H) S, ``experts`` (T, k) int64,
    ``experts_gate``/``experts_up`` (E, I, H) -> ``hidden`` (T, k, I) S and the shared expert's
    ``shared_hidden`` (T, Is) S (None without one), in one launch, byte-equal to the twin.
    ``limit``: glm5_next's ``swiglu_limit`` (routed and shared experts clamped), > 0."""
    name = "experts_gate_up_triton"
    if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
        raise ValueError(f"{name}: limit must be a positive number (swiglu_limit) or None, got {limit!r}")
    if m.dim() != 2 or m.dtype not in MOE_DTYPES:
        raise ValueError(f"{name}: m must be (T, H) in one of {MOE_DTYPES}, got {tuple(m.shape)} {m.dtype}")
    if experts.dim() != 2 or experts.dtype != torch.int64 or experts.shape[0] != m.shape[0]:
        raise ValueError(f"{name}: experts must be (T, k) int64 with T = {m.shape[0]}, got {tuple(experts.shape)} "
                         f"{experts.dtype}")
    if (shared_gate is None) != (shared_up is None):
        raise ValueError(f"{name}: pass both shared_gate and shared_up, or neither")
    mats = [("experts_gate", experts_gate, 3), ("experts_up", experts_up, 3)]
    if shared_gate is not None:
        mats += [("shared_gate", shared_gate, 2), ("shared_up", shared_up, 2)]
    _one_format(name, mats)
    for arg, w, dims in mats:
        _check_stack(name, arg, w, dims, m.dtype)
        if w.shape[-1] != m.shape[1]:
            raise ValueError(f"{name}: {arg} {tuple(w.shape)} must take H = {m.shape[1]} inputs")
    if experts_up.shape != experts_gate.shape or (shared_gate is not None and shared_up.shape != shared_gate.shape):
        raise ValueError(f"{name}: gate and up shapes differ")
    if m.shape[1] > 1 and m.stride(1) != 1:
        m = m.contiguous()
    experts = _unit_columns(experts)
    T, k, I = m.shape[0], experts.shape[1], experts_gate.shape[1]
    _check_rows(name, T)
    hidden = torch.empty(T, k, I, dtype=m.dtype, device=m.device)
    shared = None if shared_gate is None else torch.empty(T, shared_gate.shape[0], dtype=m.dtype, device=m.device)
    if T and (k or shared is not None):
        experts_gate_up_launch(m, experts, experts_gate, experts_up, shared_gate, shared_up, hidden, shared,
                               limit=limit).run()
    return hidden, shared


# ---- 3. down projections, combine, shared expert, residual ----------------------------------------


@triton.jit
def _down_combine_kernel(
    hidden_ptr,  # (T, k, I) S: strides stride_ht, stride_hj (rows contiguous)
    shidden_ptr,  # (T, Is) S, row stride stride_st
    experts_ptr,  # (T, k) int64, row stride stride_x
    weights_ptr,  # (T, k) float32, row stride stride_w
    down_ptr,  # (E, H, I): expert stride stride_de, row stride stride_dn
    sdown_ptr,  # (H, Is), row stride stride_sd
    res_ptr,  # (T, H) S residual, row stride stride_r
    out_ptr,  # (T, H) S, row stride stride_o
    down_s,  # FP8: (E, ceil(H/128), ceil(I/128)) float32 scales: expert stride stride_cde, row stride stride_cdn
    sdown_s,  # FP8: (ceil(H/128), ceil(Is/128)) scales, row stride stride_csd
    H,
    I,
    Is,
    stride_cde,
    stride_cdn,
    stride_csd,
    stride_ht,
    stride_hj,
    stride_st,
    stride_x,
    stride_w,
    stride_de,
    stride_dn,
    stride_sd,
    stride_r,
    stride_o,
    K: tl.constexpr,
    BLOCK_KS: tl.constexpr,  # next_pow2(K): the combine's tree width
    LEVELS_KS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LEVELS_K: tl.constexpr,
    NCHUNK: tl.constexpr,
    LEVELS_C: tl.constexpr,
    BLOCK_KSH: tl.constexpr,  # the shared expert's chunking over Is
    LEVELS_KSH: tl.constexpr,
    NCHUNK_SH: tl.constexpr,
    LEVELS_CSH: tl.constexpr,
    TO_BF16: tl.constexpr,
    TO_F16: tl.constexpr,
    NAN_BITS: tl.constexpr,
    FP8: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.program_id(1).to(tl.int64)
    n_in = n < H
    srow = (n // 128).to(tl.int64)  # FP8: each column's row of block scales
    slot = tl.arange(0, BLOCK_KS)
    terms = tl.zeros((1, BLOCK_N, BLOCK_KS), tl.float32)  # +0.0: the padding of the slots' tree
    for j in range(0, K):
        e = tl.load(experts_ptr + t * stride_x + j)
        w = tl.load(weights_ptr + t * stride_w + j)
        rows = down_ptr + e * stride_de + n.to(tl.int64)[:, None] * stride_dn
        y = _dot_cols(hidden_ptr + t * stride_ht + j * stride_hj, rows, n_in, I, BLOCK_N, BLOCK_K, LEVELS_K, NCHUNK,
                      LEVELS_C, down_s + e * stride_cde + srow * stride_cdn, FP8)
        term = w * to_storage(y, TO_BF16, TO_F16, NAN_BITS).to(tl.float32)  # weights * up(round_S(y))
        terms = tl.where(slot[None, None, :] == j, term[None, :, None], terms)
    moe = tl.reshape(psum_grid(terms, 1, BLOCK_N, BLOCK_KS, LEVELS_KS), (BLOCK_N,))  # combine: psum over slots
    if HAS_SHARED:
        rows = sdown_ptr + n.to(tl.int64)[:, None] * stride_sd
        ysh = _dot_cols(shidden_ptr + t * stride_st, rows, n_in, Is, BLOCK_N, BLOCK_KSH, LEVELS_KSH, NCHUNK_SH,
                        LEVELS_CSH, sdown_s + srow * stride_csd, FP8)
        moe = moe + to_storage(ysh, TO_BF16, TO_F16, NAN_BITS).to(tl.float32)
    moe_s = to_storage(moe, TO_BF16, TO_F16, NAN_BITS).to(tl.float32)
    res = tl.load(res_ptr + t * stride_r + n, mask=n_in, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + n, to_storage(res + moe_s, TO_BF16, TO_F16, NAN_BITS), mask=n_in)


def experts_down_combine_launch(hidden: Tensor, shared_hidden: Tensor | None, experts: Tensor, weights: Tensor,
                                experts_down: Tensor, shared_down: Tensor | None, residual: Tensor, out: Tensor,
                                cuda: bool | None = None) -> Launch:
    """The down/combine launch: grid (column blocks of H, T); each program loops over the k slots."""
    T, k, I = hidden.shape
    H = experts_down.shape[1]
    has_shared = shared_down is not None
    Is = shared_down.shape[1] if has_shared else 0
    fp8 = isinstance(experts_down, BlockScaledWeight)
    (experts_down, ds), (shared_down, sds) = _parts(experts_down), _parts(shared_down)
    block_k, nchunk, bn = _blocks(I, fp8)
    block_ksh, nchunk_sh, bn_sh = _blocks(max(Is, 1), fp8)
    block_n = min(bn, bn_sh, numerics.next_pow2(H))
    block_ks = numerics.next_pow2(k)
    cuda = out.is_cuda if cuda is None else cuda
    sh = shared_hidden if has_shared else hidden
    sd = shared_down if has_shared else experts_down
    if fp8:
        sds = sds if has_shared else ds
        scales = (ds, sds, ds.stride(0), ds.stride(1), sds.stride(0) if has_shared else 0)
    else:  # never read
        scales = (out, out, 0, 0, 0)
    args = (hidden, sh, experts, weights, experts_down, sd, residual, out, *scales[:2], H, I, Is, *scales[2:],
            hidden.stride(0), hidden.stride(1),
            sh.stride(0) if has_shared else 0, experts.stride(0), weights.stride(0), experts_down.stride(0),
            experts_down.stride(1), sd.stride(0) if has_shared else 0, residual.stride(0), out.stride(0))
    meta = dict(K=k, BLOCK_KS=block_ks, LEVELS_KS=block_ks.bit_length() - 1, HAS_SHARED=has_shared, BLOCK_N=block_n,
                BLOCK_K=block_k, LEVELS_K=block_k.bit_length() - 1, NCHUNK=nchunk, LEVELS_C=nchunk.bit_length() - 1,
                BLOCK_KSH=block_ksh, LEVELS_KSH=block_ksh.bit_length() - 1, NCHUNK_SH=nchunk_sh,
                LEVELS_CSH=nchunk_sh.bit_length() - 1, **_storage_meta(out.dtype, cuda), FP8=fp8)
    return Launch(_down_combine_kernel, (triton.cdiv(H, block_n), T), args, meta)


def experts_down_combine_torch(hidden: Tensor, shared_hidden: Tensor | None, experts: Tensor, weights: Tensor,
                               experts_down: Tensor, shared_down: Tensor | None, residual: Tensor) -> Tensor:
    """The twin: each slot's ``numerics.linear`` on its expert's down (read in place), the
    reference's ``moe.combine``, ``+ up(linear(shared_hidden, shared_down))``, rounded to S as
    ``moe_block`` ends, then ``decoder_layer``'s ``h + moe`` (one S add)."""
    y = torch.empty(*experts.shape, experts_down.shape[1], dtype=hidden.dtype, device=hidden.device)
    for t, ids in enumerate(experts.tolist()):
        for j, e in enumerate(ids):
            y[t, j] = numerics.linear(hidden[t, j], experts_down[e])
    out = combine(weights, y, PINNED)
    if shared_down is not None:
        out = out + up(numerics.linear(shared_hidden, shared_down))
    return residual + out.to(hidden.dtype)


def experts_down_combine_triton(hidden: Tensor, shared_hidden: Tensor | None, experts: Tensor, weights: Tensor,
                                experts_down: Tensor, shared_down: Tensor | None, residual: Tensor) -> Tensor:
    """The kernel for the experts' down projections, the weighted combine, the shared expert's
    down and the residual add: ``hidden`` (T, k, I) S, ``shared_hidden`` (T, Is) S or None,
    ``experts`` (T, k) int64, ``weights`` (T, k) float32, ``experts_down`` (E, H, I),
    ``shared_down`` (H, Is) or None, ``residual`` (T, H) S -> ``out`` (T, H) S, byte-equal to the twin."""
    name = "experts_down_combine_triton"
    if hidden.dim() != 3 or hidden.dtype not in MOE_DTYPES:
        raise ValueError(f"{name}: hidden must be (T, k, I) in one of {MOE_DTYPES}, got {tuple(hidden.shape)} "
                         f"{hidden.dtype}")
    T, k, I = hidden.shape
    if experts.shape != (T, k) or experts.dtype != torch.int64:
        raise ValueError(f"{name}: experts must be ({T}, {k}) int64, got {tuple(experts.shape)} {experts.dtype}")
    if weights.shape != (T, k) or weights.dtype != torch.float32:
        raise ValueError(f"{name}: weights must be ({T}, {k}) float32, got {tuple(weights.shape)} {weights.dtype}")
    _one_format(
        name,
        [("experts_down", experts_down, 3)] + ([("shared_down", shared_down, 2)] if shared_down is not None else []),
    )
    _check_stack(name, "experts_down", experts_down, 3, hidden.dtype)
    H = experts_down.shape[1]
    if experts_down.shape[2] != I:
        raise ValueError(f"{name}: experts_down {tuple(experts_down.shape)} must take I = {I} inputs")
    if (shared_hidden is None) != (shared_down is None):
        raise ValueError(f"{name}: pass both shared_hidden and shared_down, or neither")
    if shared_down is not None:
        _check_stack(name, "shared_down", shared_down, 2, hidden.dtype)
        if shared_hidden.dim() != 2 or shared_hidden.shape != (T, shared_down.shape[1]) or shared_down.shape[0] != H:
            raise ValueError(f"{name}: shared_hidden {tuple(shared_hidden.shape)} and shared_down "
                             f"{tuple(shared_down.shape)} must be (T, Is) and (H, Is)")
        if shared_hidden.dtype != hidden.dtype:
            raise TypeError(f"{name}: shared_hidden dtype {shared_hidden.dtype} differs from hidden's {hidden.dtype}")
        if shared_hidden.shape[1] > 1 and shared_hidden.stride(1) != 1:
            shared_hidden = shared_hidden.contiguous()
    if residual.shape != (T, H) or residual.dtype != hidden.dtype:
        raise ValueError(f"{name}: residual must be ({T}, {H}) {hidden.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    if I > 1 and hidden.stride(2) != 1:
        hidden = hidden.contiguous()
    experts, weights = _unit_columns(experts), _unit_columns(weights)
    _check_rows(name, T)
    if H > 1 and residual.stride(1) != 1:
        residual = residual.contiguous()
    out = torch.empty(T, H, dtype=hidden.dtype, device=hidden.device)
    if T and H:
        experts_down_combine_launch(hidden, shared_hidden, experts, weights, experts_down, shared_down, residual,
                                    out).run()
    return out


# ---- the audit ----------------------------------------------------------------------------------


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The three launches at ``cfg`` with ``dtype`` weights, on abstract tensors: a draft step
    (``step``: 1 row) and a prefill chunk (``rows``: 8 rows)."""
    E, k, H, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    Is = I * cfg.n_shared_experts
    gate, upw, down = abstract((E, I, H), dtype), abstract((E, I, H), dtype), abstract((E, H, I), dtype)
    sg, su, sd = (abstract((Is, H), dtype), abstract((Is, H), dtype), abstract((H, Is), dtype)) if Is else (None,) * 3
    launches = []
    for variant, T in (("step", 1), ("rows", 8)):
        experts, weights = abstract((T, k), torch.int64), abstract((T, k), torch.float32)
        logits, bias = abstract((T, E), torch.float32), abstract((E,), torch.float32)
        m, res = abstract((T, H), dtype), abstract((T, H), dtype)
        hidden = abstract((T, k, I), dtype)
        sh = abstract((T, Is), dtype) if Is else None
        launches += [
            AuditLaunch("moe:route", variant, route_launch(cfg, logits, bias, experts, weights)),
            AuditLaunch("moe:gate_up", variant, experts_gate_up_launch(m, experts, gate, upw, sg, su, hidden, sh,
                                                                       cuda=True, limit=cfg.swiglu_limit)),
            AuditLaunch("moe:down_combine", variant, experts_down_combine_launch(hidden, sh, experts, weights, down, sd,
                                                                                 res, abstract((T, H), dtype),
                                                                                 cuda=True)),
        ]
        # Block-scaled fp8 experts (DESIGN.md §8): the same launches over e4m3 bytes and scales.
        q = {n: None if w is None else BlockScaledWeight(abstract(tuple(w.shape), torch.float8_e4m3fn),
                                                         abstract(scale_shape(tuple(w.shape)), torch.float32))
             for n, w in (("gate", gate), ("up", upw), ("down", down), ("sg", sg), ("su", su), ("sd", sd))}
        launches += [
            AuditLaunch("moe:gate_up_fp8", variant,
                        experts_gate_up_launch(m, experts, q["gate"], q["up"], q["sg"], q["su"],
                                               hidden, sh, cuda=True)),
            AuditLaunch("moe:down_combine_fp8", variant, experts_down_combine_launch(
                hidden, sh, experts, weights, q["down"], q["sd"], res, abstract((T, H), dtype), cuda=True)),
        ]
    return launches
