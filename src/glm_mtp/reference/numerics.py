"""The pinned primitives (DESIGN.md §5): every floating-point result of the drafter in one written
order of IEEE-754 operations, so any implementation that follows the order produces the same bits.

Storage dtype S is the weights' dtype; accumulation dtype A is float32 (float64 for float64
weights, where these orders only check the math). Allowed in A: ``+ - * /`` and ``sqrt``, each
correctly rounded to nearest even; casts S <-> A; comparisons, ``max``/``min``, ``where``,
``relu``; integer arithmetic and bit casts; gathers and copies. Nothing here calls a library
reduction on floating data (``sum``, ``matmul``, ``softmax``, ``exp``, ...): their order is the
library's choice. Torch's CPU elementwise ops are exact IEEE operations one at a time (no fused
multiply-add across two ops), which is what makes readable torch a valid statement of the order.

Every sum is ``psum``: the balanced binary tree over the values padded with ``+0.0`` to the next
power of two, adjacent pairs first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .fp8 import FP8_BLOCK, BlockScaledWeight

# Products of a chunk of output columns are materialised as (T, chunk, K) in A; this bounds that
# buffer (elements), so a 154880-row lm_head streams through a few MiB at a time.
LINEAR_CHUNK_ELEMENTS = 1 << 22


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """A for storage dtype ``dtype``: float32, or float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def up(x: Tensor) -> Tensor:
    """``x`` in A (exact: every S value is an A value)."""
    return x.to(acc_dtype(x.dtype))


# ------------------------------------------------------------------------------------------------
# Sums.


def psum(x: Tensor) -> Tensor:
    """The sum over the last dim in the pinned order: ``x[..., :n]`` padded with ``+0.0`` to the
    next power of two, then level by level ``w[i] = w[2i] + w[2i+1]`` until one value is left.
    ``n = 1`` returns ``x[..., 0]``; ``n = 0`` returns ``+0.0``.

    A level with an odd count pairs its last value with ``+0.0``: that is the padded tree exactly,
    since the padding's subtrees are all ``+0.0`` and every real value reaches the root through
    the same additions (``v + 0.0`` included: it turns ``-0.0`` into ``+0.0``)."""
    n = x.shape[-1]
    if n == 0:
        return torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = torch.cat((x, torch.zeros_like(x[..., :1])), dim=-1)
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def next_pow2(n: int) -> int:
    """The width of ``psum``'s padded tree over ``n`` values (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def psum_prefix(x: Tensor, lengths: Tensor) -> Tensor:
    """``psum(x[..., :lengths[...]])`` for lists of different lengths held in one static width W:
    ``x`` (..., W) with ``+0.0`` past each list's length, ``lengths`` (...) int64.

    The padded tree of the W values holds the tree of a list's first ``P = next_pow2(length)``
    values as its left-most subtree, whose root is value 0 of level ``log2(P)``; past that level
    the wider tree only adds ``+0.0``. So every level's value 0 is kept and each list takes its own."""
    W = x.shape[-1]
    lengths = lengths.expand(x.shape[:-1])
    below = lengths.clamp(min=1) - 1
    level = torch.zeros_like(lengths)  # log2(next_pow2(length)): the bit length of length - 1
    for j in range(max(1, W).bit_length()):
        level = level + ((below >> j) > 0).to(lengths.dtype)
    roots = [x[..., 0]]  # level 0: a one-value list is that value
    while x.shape[-1] > 1:
        if x.shape[-1] % 2:
            x = torch.cat((x, torch.zeros_like(x[..., :1])), dim=-1)
        x = x[..., 0::2] + x[..., 1::2]
        roots.append(x[..., 0])
    out = torch.stack(roots, dim=-1).gather(-1, level.clamp(max=len(roots) - 1)[..., None])[..., 0]
    return torch.where(lengths > 0, out, torch.zeros_like(out))


def sqrt(x: Tensor) -> Tensor:
    """The correctly rounded square root. torch's float32 ``sqrt`` on the CPU is not (it calls a
    vector-math library: about 1 in 6 results is 1 ulp off); float64's is within an ulp of
    float64, and rounding that to float32 is the correctly rounded float32 root (53 >= 2 * 24 + 2
    bits: a square root never lies that close to a float32 rounding boundary)."""
    if x.dtype == torch.float32:
        return torch.sqrt(x.double()).float()
    return torch.sqrt(x)


def recip(x: Tensor) -> Tensor:
    """``1 / x``, a correctly rounded division (``1.0 / t`` in torch is ``reciprocal(t) * 1.0``)."""
    return torch.div(torch.ones_like(x), x)


def dot(a: Tensor, b: Tensor) -> Tensor:
    """``psum(a * b)`` over the last dim (broadcast), each product rounded in A."""
    return psum(up(a) * up(b))


def linear(x: Tensor, weight: Tensor | BlockScaledWeight) -> Tensor:
    """``y[..., n] = round_S(dot(x[...], weight[n]))`` for ``x`` (..., K) and ``weight`` (N, K):
    ``F.linear`` without a bias, in the pinned order. The result is in ``x``'s dtype. A
    block-scaled fp8 weight takes its own order (``block_scaled_linear_acc``)."""
    return linear_acc(x, weight).to(x.dtype)


def linear_acc(x: Tensor, weight: Tensor | BlockScaledWeight) -> Tensor:
    """``dot(x[...], weight[n])`` for every output column, left in A (the router's logits, the
    absorbed query); over a block-scaled weight, ``block_scaled_linear_acc``."""
    if isinstance(weight, BlockScaledWeight):
        return block_scaled_linear_acc(x, weight)
    lead, K = x.shape[:-1], x.shape[-1]
    xf = up(x).reshape(-1, 1, K)  # (T, 1, K)
    N = weight.shape[0]
    chunk = max(1, LINEAR_CHUNK_ELEMENTS // max(1, xf.shape[0] * K))
    # The weight is read in place: promotion to A happens inside the multiply, chunk by chunk.
    cols = [psum(xf * weight[n0 : n0 + chunk]) for n0 in range(0, N, chunk)]  # (T, chunk) each
    return torch.cat(cols, dim=-1).reshape(*lead, N)


def block_scaled_linear_acc(x: Tensor, weight: BlockScaledWeight) -> Tensor:
    """The pinned linear over a block-scaled fp8 weight (DESIGN.md §8), left in A, for ``x``
    (..., K) and ``weight`` W8 (N, K) with scales s (ceil(N/128), ceil(K/128)):

        ``y[t, n] = psum_b(s[n // 128, b] * psum_{k in block b}(up(x[t, k]) * up(W8[n, k])))``

    the inner sum is the 128-wide padded tree over block b's columns (a partial last block is
    padded with ``+0.0`` to 128 lanes, as a kernel reading 128-lane blocks computes it), each
    product rounded in A (exact for a bf16 ``x``: 8 x 4 significant bits); times the block's scale,
    one rounding; then ``psum`` over the ceil(K/128) blocks. W8 is read in place, chunk by chunk:
    no dequantized copy of the weight exists."""
    lead, K = x.shape[:-1], x.shape[-1]
    N, Kw = weight.shape
    if Kw != K:
        raise ValueError(f"block-scaled linear: x has {K} input features, the weight {tuple(weight.shape)} "
                         f"expects {Kw}")
    bn, bk = FP8_BLOCK
    nb = -(-K // bk)
    A = acc_dtype(x.dtype)
    xf = torch.zeros(*lead, nb * bk, dtype=A, device=x.device)
    xf[..., :K] = up(x)
    xf = xf.reshape(-1, 1, nb, bk)  # (T, 1, nb, 128), +0.0 past K
    row_scales = weight.scale_inv.to(A).repeat_interleave(bn, dim=0)[:N]  # (N, nb): the scale of row n's blocks
    chunk = max(1, LINEAR_CHUNK_ELEMENTS // max(1, xf.shape[0] * nb * bk))
    cols = []
    for n0 in range(0, N, chunk):
        w8 = weight.w8[n0 : n0 + chunk]  # (c, K) fp8
        wf = torch.zeros(w8.shape[0], nb * bk, dtype=A, device=x.device)
        wf[:, :K] = w8.to(A)  # exact: every e4m3 value is an A value
        inner = psum(xf * wf.reshape(1, -1, nb, bk))  # (T, c, nb): one tree per block
        cols.append(psum(inner * row_scales[n0 : n0 + chunk]))  # (T, c): the tree over blocks
    return torch.cat(cols, dim=-1).reshape(*lead, N)


# ------------------------------------------------------------------------------------------------
# Norms.


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``r = 1 / sqrt(psum(x*x) / n + eps)``; ``round_S(up(weight) * up(round_S(x * r)))``."""
    xf = up(x)
    A = xf.dtype
    n = torch.tensor(x.shape[-1], dtype=A)
    r = recip(sqrt(psum(xf * xf) / n + torch.tensor(eps, dtype=A)))  # (...,)
    normed = (xf * r[..., None]).to(x.dtype)
    return (up(weight) * up(normed)).to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """``mu = psum(x) / n``; ``d = x - mu``; ``var = psum(d*d) / n``;
    ``round_S((d * (1 / sqrt(var + eps))) * weight + bias)``."""
    xf = up(x)
    A = xf.dtype
    n = torch.tensor(x.shape[-1], dtype=A)
    d = xf - (psum(xf) / n)[..., None]
    inv = recip(sqrt(psum(d * d) / n + torch.tensor(eps, dtype=A)))
    return ((d * inv[..., None]) * up(weight) + up(bias)).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# exp and what is built on it.

# exp(x) = 2^k * e^r with k = round(x / ln 2), r = x - k ln 2 (|r| <= ln2 / 2 + tiny). ln 2 is split
# in two (Cody-Waite): LN2_HI has 9 significant bits, so k * LN2_HI is exact for |k| < 2^15 and
# x - k * LN2_HI is exact; LN2_LO carries the rest.
LOG2E = 1.4426950216293335  # float32(1 / ln 2): a float32 value exactly
LN2_HI = 0.693359375  # 355 / 512, exactly
LN2_LO = -2.1219444170128554e-04  # float32(ln 2 - LN2_HI): a float32 value exactly
# Adding and subtracting 1.5 * 2^23 rounds a float32 of magnitude < 2^22 to the nearest integer.
ROUND_MAGIC = 12582912.0
# Beyond these exp is inf / 0 in float32 (and NaN stays NaN); clamping first keeps k small.
EXP_MAX_IN, EXP_MIN_IN = 89.0, -104.0
# e^r on |r| <= 0.35: the Taylor coefficients 1/i!, i = 7..0, as float32, in Horner form.
EXP_POLY = tuple(float(torch.tensor(1.0 / math.factorial(i), dtype=torch.float32)) for i in range(7, -1, -1))


def exp(x: Tensor) -> Tensor:
    """``e^x`` elementwise in A. float32, step by step (DESIGN.md §5, "exp"):

    1. ``c = min(max(x, -104), 89)`` (NaN is restored at the end; ``-inf`` becomes 0, ``+inf`` inf);
    2. ``k = (c * LOG2E + 1.5 * 2^23) - 1.5 * 2^23``, the nearest integer to ``c / ln 2``;
    3. ``r = (c - k * LN2_HI) - k * LN2_LO``;
    4. ``p = (((((((1/7! * r + 1/6!) * r + 1/5!) * r + 1/4!) * r + 1/3!) * r + 1/2) * r + 1) * r + 1``;
    5. ``result = (p * 2^(k // 2)) * 2^(k - k // 2)``, each power of two built from its exponent
       bits (the split keeps both factors normal; only the second product can round, into a
       denormal or to inf).

    At most 2 ulp from the float64 value on every finite float32 input (tests sweep the range).
    float64 inputs use torch's float64 ``exp``: float64 checks the math, not cross-device bits."""
    if x.dtype == torch.float64:
        return torch.exp(x)
    if x.dtype != torch.float32:
        raise ValueError(f"exp computes in float32 (or float64), got {x.dtype}")
    c = torch.clamp(x, EXP_MIN_IN, EXP_MAX_IN)
    k = (c * LOG2E + ROUND_MAGIC) - ROUND_MAGIC
    r = (c - k * LN2_HI) - k * LN2_LO
    p = torch.full_like(r, EXP_POLY[0])
    for coeff in EXP_POLY[1:]:
        p = p * r + coeff
    ki = k.to(torch.int32)
    k1 = torch.div(ki, 2, rounding_mode="floor")
    k2 = ki - k1
    y = (p * pow2(k1)) * pow2(k2)
    return torch.where(x != x, x, y)


def pow2(k: Tensor) -> Tensor:
    """``2^k`` as float32 for int32 ``k`` in [-126, 127], from its exponent bits."""
    return ((k + 127) << 23).view(torch.float32)


def sigmoid(x: Tensor) -> Tensor:
    """``1 / (1 + exp(-x))`` in A."""
    return recip(1.0 + exp(-x))


def silu(x: Tensor) -> Tensor:
    """``x * sigmoid(x)`` in A."""
    return x * sigmoid(x)


def softmax(s: Tensor) -> Tensor:
    """Over the last dim, in A: ``m = max(s)``; ``e = exp(s - m)``; ``e / psum(e)``."""
    m = s.amax(dim=-1, keepdim=True)
    e = exp(s - m)
    return e / psum(e)[..., None]


def masked_softmax(s: Tensor, allowed: Tensor | None) -> Tensor:
    """§10's masked softmax over the last dim, in A: ``m`` = the max of ``s`` over the allowed
    tokens only; ``e = exp(s - m)`` where allowed and exactly ``+0.0`` elsewhere (as if the
    logit were ``-inf``); ``e / psum(e)``, the psum over every position in vocabulary order.
    ``allowed`` (V,) bool, at least one True; None allows every token (``softmax`` exactly)."""
    if allowed is None:
        return softmax(s)
    m = torch.where(allowed, s, -math.inf).amax(dim=-1, keepdim=True)
    e = torch.where(allowed, exp(s - m), 0.0)
    return e / psum(e)[..., None]


def list_softmax(s: Tensor, lengths: Tensor) -> Tensor:
    """``softmax`` of each list ``s[..., :lengths]`` held in a static width (the tail is ``-inf``
    and comes back ``+0.0``): ``m = max``; ``e = exp(s - m)``; ``e / psum(e[:length])``."""
    m = s.amax(dim=-1, keepdim=True)
    e = exp(s - m)
    return e / psum_prefix(e, lengths)[..., None]


# ------------------------------------------------------------------------------------------------
# Primitive sets. The block's code is written once against one of these: PINNED for the drafter
# (every order above), VENDOR for training and the experiments' target, where autograd and speed
# matter and the library's kernels choose their own order.


def swiglu(x: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor,
           linear: Callable[[Tensor, Tensor], Tensor] = linear) -> Tensor:
    """``linear(round_S(silu(linear(x, gate)) * linear(x, up)), down)``: one rounding between.
    ``linear`` may be any implementation of the pinned ``linear`` (a fused kernel)."""
    return linear(swiglu_hidden(x, gate_proj, up_proj, linear), down_proj)


def swiglu_hidden(x: Tensor, gate_proj: Tensor, up_proj: Tensor,
                  linear: Callable[[Tensor, Tensor], Tensor] = linear) -> Tensor:
    """``swiglu``'s hidden, before ``down``: ``round_S(silu(up(linear(x, gate))) * up(linear(x, up)))``
    (optimized/kernels/moe.py fuses it for the chosen experts)."""
    return (silu(up(linear(x, gate_proj))) * up(linear(x, up_proj))).to(x.dtype)


def rms_norm_vendor(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm with torch's reductions (``mean``, ``rsqrt``), normalised in A, scaled in S."""
    xf = up(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm_vendor(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """``F.layer_norm`` in A."""
    A = acc_dtype(x.dtype)
    return F.layer_norm(x.to(A), (x.shape[-1],), weight.to(A), bias.to(A), eps).to(x.dtype)


def swiglu_vendor(x: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> Tensor:
    """``down(silu(gate(x)) * up(x))`` with torch's GEMMs, in S."""
    return F.linear(F.silu(F.linear(x, gate_proj)) * F.linear(x, up_proj), down_proj)


def linear_acc_vendor(x: Tensor, weight: Tensor) -> Tensor:
    A = acc_dtype(x.dtype)
    return F.linear(x.to(A), plain_weight(weight).to(A))


def plain_weight(weight: Tensor | BlockScaledWeight) -> Tensor:
    """``weight`` for torch's kernels, which read plain tensors only: a block-scaled fp8 weight is
    refused (training and the target compute in bf16 / float32; quantize after training)."""
    if isinstance(weight, BlockScaledWeight):
        raise ValueError("torch's (vendor) numerics read plain weights only, got a block-scaled fp8 weight "
                         f"{tuple(weight.shape)}; the pinned numerics (the drafter) read fp8, training does not")
    return weight


def linear_vendor(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x, plain_weight(weight))


def swiglu_vendor_checked(x: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> Tensor:
    return swiglu_vendor(x, plain_weight(gate_proj), plain_weight(up_proj), plain_weight(down_proj))


@dataclass(frozen=True)
class Numerics:
    """The primitives a forward computes with (the arguments are those of the pinned functions).

    Args:
        pinned: every result follows DESIGN.md §5 (the drafter); else torch's kernels.
        linear / linear_acc: ``x @ W.T`` rounded to S / left in A.
        rms_norm / layer_norm / swiglu: as the pinned functions of those names.
        sigmoid: in A.
        psum: a sum over the last dim.
    """

    pinned: bool
    linear: Callable[[Tensor, Tensor], Tensor]
    linear_acc: Callable[[Tensor, Tensor], Tensor]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    layer_norm: Callable[[Tensor, Tensor, Tensor, float], Tensor]
    swiglu: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    sigmoid: Callable[[Tensor], Tensor]
    psum: Callable[[Tensor], Tensor]


PINNED = Numerics(True, linear, linear_acc, rms_norm, layer_norm, swiglu, sigmoid, psum)
VENDOR = Numerics(False, linear_vendor, linear_acc_vendor, rms_norm_vendor, layer_norm_vendor, swiglu_vendor_checked,
                  torch.sigmoid,
                  lambda x: x.sum(-1))
