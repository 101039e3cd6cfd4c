"""Rounding float32 results to a storage dtype inside a kernel, the same on the GPU and in
Triton's CPU interpreter.

Triton's interpreter casts float32 to bfloat16 by truncation, the GPU (``cvt.rn.bf16.f32``) and
torch by rounding to nearest even. So bfloat16 is rounded here on the bits: add ``0x7FFF`` plus
the lowest kept bit, keep the high half. NaN stays NaN (its payload is ``NAN_BITS``: torch itself
writes different NaN payloads on different code paths, so payloads are not pinned).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def round_to_storage(y, TO_BF16: tl.constexpr, NAN_BITS: tl.constexpr):
    """float32 ``y`` in the storage dtype: bfloat16 rounded to nearest even on the bits, or as is
    (float32 stays float32)."""
    if TO_BF16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        hi = (bits >> 16).to(tl.uint16)
        hi = tl.where(y != y, NAN_BITS, hi).to(tl.uint16)
        return hi.to(tl.bfloat16, bitcast=True)
    else:
        return y


@triton.jit
def to_storage(y, TO_BF16: tl.constexpr, TO_F16: tl.constexpr, NAN_BITS: tl.constexpr):
    """float32 ``y`` rounded to the storage dtype S, to nearest even: bfloat16 on the bits
    (``round_to_storage``), float16 by Triton's cast (round to nearest even, numpy's in the
    interpreter), float32 as is."""
    if TO_F16:
        return y.to(tl.float16)
    else:
        return round_to_storage(y, TO_BF16, NAN_BITS)


@functools.cache
def float32_bits(value: float) -> int:
    """The bits of ``value`` rounded once to float32 (as ``torch.tensor(value, dtype=float32)``),
    as a signed int32: kernels take constants this way so no launcher rounds them differently."""
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))
