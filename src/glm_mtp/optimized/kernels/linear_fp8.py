"""The pinned GEMV over a block-scaled fp8 weight (DESIGN.md §8), reading the fp8 bytes and the
scales directly: ``numerics.block_scaled_linear_acc``'s order,

    ``y[t, n] = round_S(psum_b(s[n // 128, b] * psum_{k in block b}(up(x[t, k]) * up(W8[n, k]))))``

- K is read in 128-lane chunks, one per scale block (``FP8_BLOCK``): lanes past K load ``+0.0``
  for both operands (their products are the padding's ``+0.0``), the chunk's products (float32,
  each rounded once: no FMA) are reduced by the 128-wide tree, and the root is multiplied by the
  block's scale ``s[n // 128, c]`` (one rounding).
- The scaled roots go to column ``c`` of a ``(.., NCHUNK)`` register array, ``NCHUNK =
  next_pow2(ceil(K / 128))``, starting at ``+0.0``; the same tree reduces it.

``W8`` is read as bytes (a ``uint8`` view) and decoded with integer operations (``e4m3_to_f32``):
sign, exponent + 120 and mantissa moved into float32's fields for a normal value, ``m * 2^-9``
(exact) for a subnormal one, NaN for ``S.1111.111``. That is exact for all 256 patterns on every
device, including Triton's CPU interpreter, whose own float8 cast maps the NaN pattern to a number.

The drafter does not launch this GEMV: the fused step's fp8 variants (``fused_linear``, ``moe``,
``mla``) import its decoder and block helpers and follow its order inside their own kernels. The
GEMV is that order on its own, proven byte-equal to the reference by
tests/optimized/kernels/test_linear_fp8.py and audited with the rest (``kernels.AUDITED``); it is
not among the kernels ``glm_mtp.optimized.kernels`` exports.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_mtp.reference import numerics
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.fp8 import FP8_BLOCK, FP8_DTYPE, BlockScaledWeight, scale_shape

from .launch import AuditLaunch, Launch, abstract
from .linear import LINEAR_DTYPES, MAX_BLOCK_T, TILE, drafter_linears
from .pinned_math import psum_grid
from .rounding import to_storage

BLOCK_K = FP8_BLOCK[1]  # one chunk = one scale block of K
LEVELS_K = BLOCK_K.bit_length() - 1
# 2^-9: the weight of an e4m3 subnormal's mantissa unit (2^(1 - 7) / 8).
_SUBNORMAL_UNIT = tl.constexpr(0.001953125)


@triton.jit
def e4m3_to_f32(b):
    """float8_e4m3fn bytes ``b`` (uint8) as float32 values, by integer operations: exact for
    every pattern (normal: ``(S, E + 120, M << 20)``; subnormal ``E = 0``: ``M * 2^-9``;
    ``S.1111.111``: NaN)."""
    v = b.to(tl.int32)
    sign = (v & 0x80) << 24
    em = v & 0x7F  # exponent and mantissa, E << 3 | M
    normal = (em + (120 << 3)) << 20
    sub = ((em & 7).to(tl.float32) * _SUBNORMAL_UNIT).to(tl.int32, bitcast=True)
    bits = tl.where(em >= 8, normal, sub)
    bits = tl.where(em == 0x7F, 0x7FC00000, bits)
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """``e4m3_to_f32`` over a buffer: the byte test's handle on the decoder."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst_ptr + i, e4m3_to_f32(tl.load(src_ptr + i, mask=m, other=0)), mask=m)


@triton.jit
def _linear_fp8_kernel(
    x_ptr,  # (T, K) S, row stride stride_x, last dim contiguous
    w_ptr,  # (N, K) uint8 (the e4m3 bytes), row stride stride_w, last dim contiguous
    s_ptr,  # (ceil(N/128), ceil(K/128)) float32, row stride stride_s, last dim contiguous
    out_ptr,  # (T, N), row stride stride_out
    T,
    N,
    K,
    stride_x,
    stride_w,
    stride_s,
    stride_out,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # 128: one scale block
    LEVELS_K: tl.constexpr,
    NCHUNK: tl.constexpr,  # next_pow2(ceil(K / 128))
    LEVELS_C: tl.constexpr,
    SCALE_ROWS: tl.constexpr,  # 128: the rows one scale covers
    TO_BF16: tl.constexpr,
    TO_F16: tl.constexpr,
    NAN_BITS: tl.constexpr,
):
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_in = t < T
    n_in = n < N
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, NCHUNK)
    x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_x  # (BLOCK_T, 1)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_w  # (BLOCK_N, 1)
    s_rows = s_ptr + (n // SCALE_ROWS).to(tl.int64) * stride_s  # (BLOCK_N,)
    roots = tl.zeros((BLOCK_T, BLOCK_N, NCHUNK), tl.float32)  # +0.0: the roots of blocks past K
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        k_in = k < K
        xv = tl.load(x_rows + k[None, :], mask=t_in[:, None] & k_in[None, :], other=0.0).to(tl.float32)
        wv = e4m3_to_f32(tl.load(w_rows + k[None, :], mask=n_in[:, None] & k_in[None, :], other=0))  # 0x00 = +0.0
        p = xv[:, None, :] * wv[None, :, :]  # (BLOCK_T, BLOCK_N, 128), +0.0 past K
        root = psum_grid(p, BLOCK_T, BLOCK_N, BLOCK_K, LEVELS_K)  # (BLOCK_T, BLOCK_N): the block's tree
        s = tl.load(s_rows + c, mask=n_in, other=0.0)  # (BLOCK_N,) the block's scale
        roots = tl.where(col[None, None, :] == c, (root * s[None, :])[:, :, None], roots)
    y = psum_grid(roots, BLOCK_T, BLOCK_N, NCHUNK, LEVELS_C)  # the tree over blocks
    dst = out_ptr + t.to(tl.int64)[:, None] * stride_out + n[None, :]
    tl.store(dst, to_storage(y, TO_BF16, TO_F16, NAN_BITS), mask=t_in[:, None] & n_in[None, :])


def fp8_linear_blocks(T: int, N: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_N)`` for ``T`` rows and ``N`` outputs: about ``TILE`` products per
    128-lane chunk, as the plain GEMV."""
    block_t = min(numerics.next_pow2(T), MAX_BLOCK_T)
    block_n = max(1, min(numerics.next_pow2(N), TILE // (BLOCK_K * block_t)))
    return block_t, block_n


def _check(x: Tensor, weight: BlockScaledWeight, name: str) -> None:
    if not isinstance(weight, BlockScaledWeight) or weight.w8.dim() != 2:
        raise TypeError(f"{name}: weight must be a 2-d BlockScaledWeight, got {type(weight).__name__}")
    if x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: x must be (T, K={weight.shape[1]}), got {tuple(x.shape)}")
    if x.dtype not in LINEAR_DTYPES:
        raise TypeError(f"{name}: x dtype {x.dtype} is not supported (one of {LINEAR_DTYPES})")
    for arg, t in (("x", x), ("weight.w8", weight.w8), ("weight.scale_inv", weight.scale_inv)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name}: {arg} must have a contiguous last dim (stride {t.stride(1)})")
        if t.device != x.device:
            raise ValueError(f"{name}: {arg} is on {t.device}, x on {x.device}")


def linear_fp8_launch(x: Tensor, w8: Tensor, scale_inv: Tensor, out: Tensor, cuda: bool | None = None) -> Launch:
    """The kernel's launch for ``x`` (T, K), the weight's bytes ``w8`` (N, K) (float8_e4m3fn or
    its uint8 view) and ``scale_inv`` (ceil(N/128), ceil(K/128)) float32, into ``out`` (T, N)
    (float32 for the A result, else x's dtype): the one place its grid and constexprs are
    computed (the audit calls it on abstract tensors)."""
    (T, K), N = x.shape, w8.shape[0]
    block_t, block_n = fp8_linear_blocks(T, N)
    nchunk = numerics.next_pow2(-(-K // BLOCK_K))
    cuda = out.is_cuda if cuda is None else cuda
    grid = (triton.cdiv(N, block_n), triton.cdiv(T, block_t))
    bytes_ = w8.view(torch.uint8) if w8.dtype == FP8_DTYPE else w8
    args = (x, bytes_, scale_inv, out, T, N, K, x.stride(0), w8.stride(0), scale_inv.stride(0), out.stride(0))
    meta = dict(
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=BLOCK_K, LEVELS_K=LEVELS_K, NCHUNK=nchunk,
        LEVELS_C=nchunk.bit_length() - 1, SCALE_ROWS=FP8_BLOCK[0],
        TO_BF16=out.dtype == torch.bfloat16, TO_F16=out.dtype == torch.float16,
        NAN_BITS=0x7FFF if cuda else 0xFFFF, enable_fp_fusion=False,
    )
    return Launch(_linear_fp8_kernel, grid, args, meta)


def _run(x: Tensor, weight: BlockScaledWeight, out_dtype: torch.dtype, name: str) -> Tensor:
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if K > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    _check(x2, weight, name)
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=out_dtype, device=x.device)
    if out.numel() > 0:
        linear_fp8_launch(x2, weight.w8, weight.scale_inv, out).run()
    return out.reshape(*lead, weight.shape[0])


def linear_fp8_triton(x: Tensor, weight: BlockScaledWeight) -> Tensor:
    """The kernel for ``numerics.linear`` over a block-scaled weight: ``x`` (..., K) ->
    (..., N) in x's dtype, byte-equal to it."""
    return _run(x, weight, x.dtype, "linear_fp8_triton")


def linear_fp8_acc_triton(x: Tensor, weight: BlockScaledWeight) -> Tensor:
    """As ``linear_fp8_triton``, the result left in float32 (``numerics.linear_acc``)."""
    return _run(x, weight, torch.float32, "linear_fp8_acc_triton")


def linear_fp8_torch(x: Tensor, weight: BlockScaledWeight) -> Tensor:
    """The twin: ``numerics.linear`` itself (it dispatches to ``block_scaled_linear_acc``)."""
    return numerics.linear(x, weight)


def fp8_weight_bytes(N: int, K: int) -> int:
    """The bytes one read of a block-scaled (N, K) weight moves: one per value plus its float32
    scales (the counters' fp8 floor)."""
    sn, sk = scale_shape((N, K))
    return N * K + 4 * sn * sk


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The fp8 GEMV at ``cfg`` with ``dtype`` activations over every weight §8 lets be fp8 (of
    ``drafter_linears``: the attention's projections, the indexer's wq_b and wk, the experts), for
    a draft step (one token) and a prefill chunk (8 tokens), on abstract tensors; and the e4m3
    decoder's buffer kernel."""
    fp8_names = {"q_a_proj", "q_b_proj", "kv_a_proj", "idx_wq_b", "idx_wk", "o_proj", "exp_gate_up", "exp_down",
                 "sh_gate_up", "sh_down"}
    launches = []
    for name, N, K, acc, per_token in drafter_linears(cfg):
        if name not in fp8_names:
            continue
        w8, s = abstract((N, K), torch.uint8), abstract(scale_shape((N, K)), torch.float32)
        for variant, tokens in (("step", 1), ("rows", 8)):
            T = tokens * per_token
            out = abstract((T, N), torch.float32 if acc else dtype)
            launches.append(AuditLaunch(f"linear_fp8:{name}", variant,
                                        linear_fp8_launch(abstract((T, K), dtype), w8, s, out, cuda=True)))
    # The decoder's own handle (the byte test's), so its instructions are audited alone too.
    decode = Launch(_e4m3_kernel, (1,), (abstract((256,), torch.uint8), abstract((256,), torch.float32), 256),
                    dict(BLOCK=256, enable_fp_fusion=False))
    return launches + [AuditLaunch("e4m3_decode", "bytes", decode)]
