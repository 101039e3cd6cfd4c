"""The pinned arithmetic of DESIGN.md §5 as ``@triton.jit`` helpers any kernel can import: the
``psum`` trees and the elementwise ``exp``, ``sigmoid`` and ``silu`` in float32, each the step-by-step port of
``glm_mtp.reference.numerics`` (same constants, same operations, same order), so they give the
same bits as the reference wherever the kernel is compiled with ``enable_fp_fusion=False``.

- ``exp_f32(x)``: clamp to [-104, 89]; ``k = (c * LOG2E + 1.5 * 2^23) - 1.5 * 2^23``;
  ``r = (c - k * LN2_HI) - k * LN2_LO``; Horner of degree 7; ``(p * 2^(k >> 1)) * 2^(k - (k >> 1))``
  with each power of two built from its exponent bits (``>> 1`` on int32 is the floor division the
  reference writes); NaN comes back as the input. No ``tl.exp`` (its order is the library's: on a
  GPU it is ``ex2.approx``).
- ``sigmoid_f32(x) = 1 / (1 + exp(-x))`` with a correctly rounded division (``div_rn``).
- ``silu_f32(x) = x * sigmoid(x)``.
- ``psum_grid`` (R, N, W) -> (R, N), ``psum_rows`` (N, W) -> (N,), ``psum_vector`` (W,) -> ():
  ``psum`` over the last axis, ``W = 2 ** LEVELS``, adjacent pairs first (no ``tl.sum``, whose
  order is the compiler's); ``psum_prefix_grid`` stops the tree at a level (MLA's prefix sums).

``exp_kernel`` applies ``exp_f32`` to a float32 buffer: the byte test's handle on the helper
(tests/optimized/kernels/test_moe.py sweeps float32 bit patterns against ``numerics.exp``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_mtp.reference import numerics
from glm_mtp.reference.config import MtpConfig

from .launch import AuditLaunch, Launch, abstract

# The reference's constants, checked at import against numerics (Triton takes these literals as
# float32; each is a float32 value exactly, so nothing rounds on the way in).
_LOG2E = tl.constexpr(1.4426950216293335)
_LN2_HI = tl.constexpr(0.693359375)
_LN2_LO = tl.constexpr(-2.1219444170128554e-04)
_MAGIC = tl.constexpr(12582912.0)
_MAX_IN = tl.constexpr(89.0)
_MIN_IN = tl.constexpr(-104.0)
_C7, _C6, _C5, _C4, _C3, _C2, _C1, _C0 = (tl.constexpr(c) for c in numerics.EXP_POLY)
_CONSTS = (_LOG2E, _LN2_HI, _LN2_LO, _MAGIC, _MAX_IN, _MIN_IN)
assert tuple(c.value for c in _CONSTS) == (
    numerics.LOG2E, numerics.LN2_HI, numerics.LN2_LO, numerics.ROUND_MAGIC, numerics.EXP_MAX_IN, numerics.EXP_MIN_IN)
for _c in (_LOG2E.value, _LN2_HI.value, _LN2_LO.value, *numerics.EXP_POLY):
    assert float(torch.tensor(_c, dtype=torch.float32)) == _c, "the exp constants must be float32 values"

EXP_BLOCK = 1024


@triton.jit
def _pow2(k):
    """``2^k`` as float32 for int32 ``k`` in [-126, 127], from its exponent bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exp_f32(x):
    """``numerics.exp`` on float32 ``x``, operation by operation."""
    c = tl.minimum(tl.maximum(x, _MIN_IN), _MAX_IN)
    # A NaN input comes back as itself (last line); 0.0 in its place keeps the integer cast below
    # defined (the reference casts whatever NaN gives and then discards it: same result bits).
    c = tl.where(x != x, 0.0, c)
    k = (c * _LOG2E + _MAGIC) - _MAGIC
    r = (c - k * _LN2_HI) - k * _LN2_LO
    p = r * _C7 + _C6  # float32 products and sums, each rounded (no FMA: enable_fp_fusion=False)
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + _C1
    p = p * r + _C0
    ki = k.to(tl.int32)
    k1 = ki >> 1  # arithmetic shift: floor(k / 2), as torch.div(ki, 2, rounding_mode="floor")
    k2 = ki - k1
    y = (p * _pow2(k1)) * _pow2(k2)
    return tl.where(x != x, x, y)


@triton.jit
def sigmoid_f32(x):
    """``numerics.sigmoid``: ``recip(1 + exp(-x))``, the division correctly rounded."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp_f32(-x))


@triton.jit
def silu_f32(x):
    """``numerics.silu``: ``x * sigmoid(x)``."""
    return x * sigmoid_f32(x)


# ---- the psum trees (DESIGN.md §5): adjacent pairs first, level by level, over a power-of-two
# width; every kernel that sums in the pinned order sums through one of these ----


@triton.jit
def psum_grid(x, R: tl.constexpr, N: tl.constexpr, W: tl.constexpr, LEVELS: tl.constexpr):
    """``psum`` over the last axis of ``x`` (R, N, W), ``W = 2 ** LEVELS``: level by level
    ``x[..., i] = x[..., 2i] + x[..., 2i + 1]``. Returns (R, N)."""
    for level in tl.static_range(LEVELS):
        a, b = tl.split(tl.reshape(x, (R, N, W >> (level + 1), 2)))
        x = a + b
    return tl.reshape(x, (R, N))


@triton.jit
def psum_rows(x, N: tl.constexpr, W: tl.constexpr, LEVELS: tl.constexpr):
    """``psum`` over the last axis of ``x`` (N, W), ``W = 2 ** LEVELS``, adjacent pairs first
    (``tl.sum`` is not the pinned order). Returns (N,)."""
    for level in tl.static_range(LEVELS):
        a, b = tl.split(tl.reshape(x, (N, W >> (level + 1), 2)))
        x = a + b
    return tl.reshape(x, (N,))


@triton.jit
def psum_vector(x, W: tl.constexpr, LEVELS: tl.constexpr):
    """``psum`` of ``x`` (W,), ``W = 2 ** LEVELS``: level by level ``x[i] = x[2i] + x[2i + 1]``."""
    for level in tl.static_range(LEVELS):
        a, b = tl.split(tl.reshape(x, (W >> (level + 1), 2)))
        x = a + b
    return tl.reshape(x, ())


@triton.jit
def psum_prefix_grid(x, R: tl.constexpr, N: tl.constexpr, W: tl.constexpr, LEVELS: tl.constexpr, level,
                     BASE: tl.constexpr):
    """The ``psum`` tree over the last axis of ``x`` (R, N, W), ``W = 2 ** LEVELS``, whose leaves
    are level ``BASE`` of a larger tree, stopped at level ``level``: from there up each step keeps
    the left child, so the result (R, N) is value 0 of level ``level`` (the whole root when
    ``level >= BASE + LEVELS``; ``x[..., 0]`` when ``level <= BASE``)."""
    for i in tl.static_range(LEVELS):
        a, b = tl.split(tl.reshape(x, (R, N, W >> (i + 1), 2)))
        x = tl.where(level > BASE + i, a + b, a)
    return tl.reshape(x, (R, N))


@triton.jit
def order_key(v):
    """An int32 that orders as torch's sort orders float32 ``v``: ``-0.0`` equal to ``+0.0``,
    every NaN (any sign, any payload) above ``+inf`` and equal to each other. Integer compares
    and max/min on these keys are exact, so top-k choices built on them follow torch's order."""
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude's order
    return tl.where(v != v, 0x7FFFFFFF, key)


@triton.jit
def key_value(key):
    """The float32 of an ``order_key`` (the map is its own inverse on the bits; NaN stays NaN)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _exp_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    x = tl.load(x_ptr + i, mask=inside, other=0.0)
    tl.store(out_ptr + i, exp_f32(x), mask=inside)


def exp_launch(x: Tensor, out: Tensor) -> Launch:
    """``out = exp(x)`` elementwise over contiguous float32 buffers of the same size."""
    n = x.numel()
    return Launch(_exp_kernel, (triton.cdiv(n, EXP_BLOCK),), (x, out, n), dict(BLOCK=EXP_BLOCK, enable_fp_fusion=False))


def exp_triton(x: Tensor) -> Tensor:
    """``numerics.exp`` of a float32 tensor through the kernel helper (any shape)."""
    if x.dtype != torch.float32:
        raise TypeError(f"exp_triton: float32 only, got {x.dtype}")
    xc = x.contiguous()
    out = torch.empty_like(xc)
    if xc.numel():
        exp_launch(xc, out).run()
    return out


def exp_torch(x: Tensor) -> Tensor:
    """The twin: ``numerics.exp`` itself."""
    return numerics.exp(x)


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The helper compiled on its own (the MoE kernels inline it; this row shows its PTX alone)."""
    x = abstract((4096,), torch.float32)
    return [AuditLaunch("exp", "sweep", exp_launch(x, abstract((4096,), torch.float32)))]
