"""The draft's confidence (DESIGN.md §12) and the grammar's masked argmax (§10), from a draft
step's stored logits: the head (``fused_linear.head_partials``) writes each step's S-rounded
logits once, and these kernels read them back, one program per row.

- ``draft_confidence``: for logits ``l`` (R, V) in S, drafts ``d`` (R,) and an optional grammar
  bitmask (R, ceil(V / 32)) int32 (bit ``j % 32`` of word ``j // 32`` set = token j allowed; no
  mask = every token allowed), each row's

      m      = max over allowed j of up(l_j)
      e_j    = exp(up(l_j) - m) if j allowed, else +0.0           (forbidden terms exactly +0.0)
      prob   = exp(up(l_d) - m) / psum_V(e)                      (psum over all V in vocabulary order)
      margin = up(l_d) - max over allowed j != d of up(l_j)      (+inf when d is the only allowed token)

  in float32, every operation correctly rounded (``div_rn``), ``exp`` the pinned one
  (``pinned_math.exp_f32``), the sum the ``psum`` tree over V padded with ``+0.0`` (chunks of
  ``BLOCK`` lanes, one root each, the roots reduced by the same tree: a subtree split of the same
  tree). The max follows ``torch.amax``: a NaN among the allowed logits makes it NaN.
- ``masked_argmax``: each row's lowest-index maximum of ``up(l)`` over its allowed tokens only
  (a forbidden logit is never compared), NaN ranked as ``torch.argmax`` ranks it (the first
  allowed NaN wins); a row with no allowed token gets ``-1`` (the drafter never asks for one).

Both reduce with comparisons and integer min/max only, besides the one ``psum``: no ``tl.sum``,
``tl.exp`` or fused multiply-add (``enable_fp_fusion=False``). Each ``*_triton`` has a ``*_torch``
twin written in the reference's primitives (``numerics.exp``, ``numerics.psum``), byte-equal to it
(tests/optimized/kernels/test_confidence.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_mtp.reference import numerics
from glm_mtp.reference.config import MtpConfig

from .fused_linear import NO_INDEX, argmax_combine, argmax_reduce
from .launch import AuditLaunch, Launch, abstract
from .pinned_math import exp_f32, psum_vector

# Logits per chunk of a row's loop (a power of two: each chunk is a subtree of the psum).
CONFIDENCE_BLOCK = 1024
# Tokens per bitmask word.
MASK_BITS = 32


@triton.jit
def _allowed(mask_ptr, row, stride_m, j, in_v, HAS_MASK: tl.constexpr):
    """Whether tokens ``j`` (BLOCK,) of ``row`` are allowed: inside the vocabulary and, with a
    mask, their bit set."""
    if HAS_MASK:
        word = tl.load(mask_ptr + row * stride_m + j // 32, mask=in_v, other=0)
        return in_v & (((word >> (j % 32)) & 1) != 0)
    return in_v


@triton.jit
def _confidence_kernel(
    lg_ptr,  # (R, V) logits in S
    tok_ptr,  # (R,) int64 drafts
    mask_ptr,  # (R, W) int32 bitmask (HAS_MASK)
    prob_ptr,  # (R,) float32
    margin_ptr,  # (R,) float32
    V, stride_l, stride_m,
    BLOCK: tl.constexpr, LEVELS: tl.constexpr, NCHUNK: tl.constexpr, LEVELS_C: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    d = tl.load(tok_ptr + row + tl.arange(0, 1))  # (1,)
    l_d = tl.load(lg_ptr + row * stride_l + d).to(tl.float32)  # (1,)
    # Pass 1: the max over the allowed logits, and over the allowed ones other than d.
    m = tl.full((1,), float("-inf"), tl.float32)
    other = tl.full((1,), float("-inf"), tl.float32)
    nan = tl.zeros((1,), tl.int32)
    nan_other = tl.zeros((1,), tl.int32)
    others = tl.zeros((1,), tl.int32)  # allowed tokens other than d (0 or more)
    for c in range(0, tl.cdiv(V, BLOCK)):
        j = c * BLOCK + lanes
        in_v = j < V
        ok = _allowed(mask_ptr, row, stride_m, j, in_v, HAS_MASK)
        lv = tl.load(lg_ptr + row * stride_l + j, mask=in_v, other=0.0).to(tl.float32)
        ok2 = tl.reshape(ok, (1, BLOCK))
        lv2 = tl.reshape(lv, (1, BLOCK))
        not_d = tl.reshape(j.to(tl.int64), (1, BLOCK)) != d[:, None]
        num = ok2 & (lv2 == lv2)
        m = tl.maximum(m, tl.max(tl.where(num, lv2, float("-inf")), axis=1))
        other = tl.maximum(other, tl.max(tl.where(num & not_d, lv2, float("-inf")), axis=1))
        nan = tl.maximum(nan, tl.max((ok2 & (lv2 != lv2)).to(tl.int32), axis=1))
        nan_other = tl.maximum(nan_other, tl.max((ok2 & not_d & (lv2 != lv2)).to(tl.int32), axis=1))
        others = tl.maximum(others, tl.max((ok2 & not_d).to(tl.int32), axis=1))
    m = tl.where(nan > 0, float("nan"), m)
    other = tl.where(nan_other > 0, float("nan"), other)
    # Pass 2: psum over V of e (+0.0 where forbidden or past V), chunk roots then their tree.
    col = tl.arange(0, NCHUNK)
    roots = tl.zeros((NCHUNK,), tl.float32)
    for c in range(0, tl.cdiv(V, BLOCK)):
        j = c * BLOCK + lanes
        in_v = j < V
        ok = _allowed(mask_ptr, row, stride_m, j, in_v, HAS_MASK)
        lv = tl.load(lg_ptr + row * stride_l + j, mask=in_v, other=0.0).to(tl.float32)
        e = tl.where(ok, exp_f32(lv - m), 0.0)
        root = psum_vector(e, BLOCK, LEVELS)
        roots = tl.where(col == c, root, roots)
    s = psum_vector(roots, NCHUNK, LEVELS_C)
    prob = tl.math.div_rn(exp_f32(l_d - m), tl.broadcast_to(s, (1,)))
    margin = tl.where(others > 0, l_d - other, float("inf"))
    tl.store(prob_ptr + row + tl.arange(0, 1), prob)
    tl.store(margin_ptr + row + tl.arange(0, 1), margin)


@triton.jit
def _masked_argmax_kernel(
    lg_ptr,  # (R, V) logits in S
    mask_ptr,  # (R, W) int32 bitmask
    out_ptr,  # (R,) int64
    V, stride_l, stride_m,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    best = tl.full((1,), float("-inf"), tl.float32)
    best_idx = tl.full((1,), NO_INDEX, tl.int64)
    for c in range(0, tl.cdiv(V, BLOCK)):
        j = c * BLOCK + lanes
        in_v = j < V
        ok = tl.reshape(_allowed(mask_ptr, row, stride_m, j, in_v, True), (1, BLOCK))
        lv = tl.reshape(tl.load(lg_ptr + row * stride_l + j, mask=in_v, other=0.0).to(tl.float32), (1, BLOCK))
        # A chunk with no allowed lane offers (-inf, an index past every vocabulary), which never
        # displaces a candidate; an allowed -inf displaces the initial one (equal value, lower index).
        cv, ci = argmax_reduce(lv, tl.reshape(j.to(tl.int64), (1, BLOCK)), ok)
        best, best_idx = argmax_combine(best, best_idx, cv, ci)
    tl.store(out_ptr + row + tl.arange(0, 1), tl.where(best_idx == NO_INDEX, -1, best_idx))


# ---- launches ---------------------------------------------------------------------------------


def _block(V: int) -> int:
    return min(CONFIDENCE_BLOCK, numerics.next_pow2(V))


def confidence_launch(logits: Tensor, tokens: Tensor, mask: Tensor | None, prob: Tensor, margin: Tensor) -> Launch:
    """``draft_confidence``'s launch: ``logits`` (R, V) S with a contiguous last dim, ``tokens``
    (R,) int64, ``mask`` (R, ceil(V / 32)) int32 or None, into ``prob``/``margin`` (R,) float32.
    One program per row."""
    R, V = logits.shape
    block = _block(V)
    nchunk = numerics.next_pow2(V) // block
    return Launch(_confidence_kernel, (R,), (
        logits, tokens, mask if mask is not None else tokens, prob, margin, V, logits.stride(0),
        mask.stride(0) if mask is not None else 0,
    ), dict(BLOCK=block, LEVELS=block.bit_length() - 1, NCHUNK=nchunk, LEVELS_C=nchunk.bit_length() - 1,
            HAS_MASK=mask is not None, enable_fp_fusion=False))


def masked_argmax_launch(logits: Tensor, mask: Tensor, out: Tensor) -> Launch:
    """``masked_argmax``'s launch: ``logits`` (R, V) S, ``mask`` (R, ceil(V / 32)) int32, into
    ``out`` (R,) int64. One program per row."""
    R, V = logits.shape
    return Launch(_masked_argmax_kernel, (R,), (logits, mask, out, V, logits.stride(0), mask.stride(0)),
                  dict(BLOCK=_block(V), enable_fp_fusion=False))


# ---- checks and the bitmask -------------------------------------------------------------------


def mask_words(vocab_size: int) -> int:
    """Words of a grammar bitmask row over ``vocab_size`` tokens: ``ceil(V / 32)``."""
    return -(-vocab_size // MASK_BITS)


def allowed_tokens(mask: Tensor, vocab_size: int) -> Tensor:
    """The bitmask ``mask`` (R, ceil(V / 32)) int32 as (R, V) bool: token j allowed where bit
    ``j % 32`` of word ``j // 32`` is set. Exact integer ops (a shift and an and)."""
    j = torch.arange(vocab_size, device=mask.device)
    words = mask.to(torch.int64).index_select(-1, j // MASK_BITS)  # (R, V)
    return ((words >> (j % MASK_BITS)) & 1) != 0


def _check(name: str, logits: Tensor, tokens: Tensor | None, mask: Tensor | None) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"{name}: logits must be (R, V>0), got {tuple(logits.shape)}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: logits dtype {logits.dtype} is not a storage dtype the kernel takes")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"{name}: logits need a contiguous last dim")
    R, V = logits.shape
    if tokens is not None and (tokens.shape != (R,) or tokens.dtype != torch.int64):
        raise ValueError(f"{name}: tokens must be ({R},) int64, got {tuple(tokens.shape)} {tokens.dtype}")
    if mask is not None:
        if mask.shape != (R, mask_words(V)) or mask.dtype != torch.int32:
            raise ValueError(f"{name}: mask must be ({R}, {mask_words(V)}) int32, got {tuple(mask.shape)} {mask.dtype}")
        if mask.shape[1] > 1 and mask.stride(1) != 1:
            raise ValueError(f"{name}: mask needs a contiguous last dim")
    devices = {t.device for t in (logits, tokens, mask) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{name}: tensors on different devices {sorted(str(d) for d in devices)}")


# ---- the kernels and their twins --------------------------------------------------------------


def draft_confidence_torch(logits: Tensor, tokens: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The twin: ``(prob, margin)`` (R,) in A (float32; float64 for float64 logits) of drafts
    ``tokens`` (R,) int64 from ``logits`` (R, V) S under ``mask`` (R, ceil(V / 32)) int32 or None,
    as the module docstring defines them, in the reference's primitives."""
    l = numerics.up(logits)  # (R, V) in A
    R, V = l.shape
    allowed = allowed_tokens(mask, V) if mask is not None else torch.ones(R, V, dtype=torch.bool, device=l.device)
    neg = torch.tensor(float("-inf"), dtype=l.dtype, device=l.device)
    m = torch.where(allowed, l, neg).amax(dim=-1)  # (R,), NaN propagates
    e = torch.where(allowed, numerics.exp(l - m[:, None]), torch.zeros((), dtype=l.dtype, device=l.device))
    l_d = l.gather(-1, tokens[:, None])[:, 0]
    prob = numerics.exp(l_d - m) / numerics.psum(e)
    others = allowed & (torch.arange(V, device=l.device)[None, :] != tokens[:, None])
    other = torch.where(others, l, neg).amax(dim=-1)
    margin = torch.where(others.any(dim=-1), l_d - other, torch.tensor(float("inf"), dtype=l.dtype, device=l.device))
    return prob, margin


def draft_confidence_triton(logits: Tensor, tokens: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The kernel: ``draft_confidence_torch``'s ``(prob, margin)``, byte-equal to it. One launch."""
    _check("draft_confidence_triton", logits, tokens, mask)
    R = logits.shape[0]
    prob = torch.empty(R, dtype=torch.float32, device=logits.device)
    margin = torch.empty(R, dtype=torch.float32, device=logits.device)
    if R:
        confidence_launch(logits, tokens, mask, prob, margin).run()
    return prob, margin


def masked_argmax_torch(logits: Tensor, mask: Tensor) -> Tensor:
    """The twin: each row's lowest-index maximum of ``up(logits)`` (R, V) over the tokens
    ``mask`` (R, ceil(V / 32)) int32 allows, the first allowed NaN if any; ``-1`` for a row
    with none allowed. (R,) int64."""
    l = numerics.up(logits).float()
    allowed = allowed_tokens(mask, l.shape[1])
    nan = allowed & (l != l)
    num = allowed & (l == l)
    m = torch.where(num, l, torch.tensor(float("-inf"), device=l.device)).amax(dim=-1)  # (R,)
    best = torch.where(nan.any(dim=-1, keepdim=True), nan, num & (l == m[:, None]))  # (R, V)
    first = torch.argmax(best.to(torch.int8), dim=-1)  # the first True (ties: the lower index)
    return torch.where(allowed.any(dim=-1), first, torch.full_like(first, -1))


def masked_argmax_triton(logits: Tensor, mask: Tensor) -> Tensor:
    """The kernel: ``masked_argmax_torch``'s tokens, byte-equal to it. One launch."""
    _check("masked_argmax_triton", logits, None, mask)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if out.numel():
        masked_argmax_launch(logits, mask, out).run()
    return out


# ---- the audit --------------------------------------------------------------------------------


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The confidence of a propose's drafts (k = 4 rows; with and without a grammar's mask) and
    the masked argmax of a redone step, at ``cfg``'s vocabulary with ``dtype`` logits."""
    V, R = cfg.vocab_size, 4
    logits, tokens = abstract((R, V), dtype), abstract((R,), torch.int64)
    mask = abstract((R, mask_words(V)), torch.int32)
    prob, margin = abstract((R,), torch.float32), abstract((R,), torch.float32)
    return [
        AuditLaunch("draft_confidence", "plain", confidence_launch(logits, tokens, None, prob, margin)),
        AuditLaunch("draft_confidence", "masked", confidence_launch(logits, tokens, mask, prob, margin)),
        AuditLaunch("masked_argmax", "step", masked_argmax_launch(logits[:1], mask[:1], tokens[:1])),
    ]
