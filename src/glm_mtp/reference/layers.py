"""The small building blocks with no reduction in them: the RoPE table and rotation, the draft
argmax and the sampled draft (over a grammar's allowed tokens, DESIGN.md §10), each draft's
probability and margin (§12), the tie-pinned top-k, the clamped SwiGLU of GLM-5.3-Flash (its
GEMMs are ``numerics.linear``). (Norms, GEMMs and the SwiGLU MLP are the pinned primitives of
``numerics``.)

RoPE computes in A (float32, or float64 for float64 inputs): ``y1 = x1 cos - x2 sin``,
``y2 = x2 cos + x1 sin``, each product and difference rounded on its own, then one rounding to S.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .numerics import acc_dtype, linear, masked_softmax, silu, up


# ------------------------------------------------------------------------------------------------
# RoPE. One table of cos/sin per (position, frequency), computed once per drafter in float64 and
# stored in the acc dtype, so every backend reads the same values instead of calling sin/cos itself.


def rope_table(
    capacity: int, rope_dim: int, theta: float, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``(capacity, rope_dim // 2)``: angle ``pos * theta^(-2i/rope_dim)``."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)  # (R/2,)
    angles = torch.arange(capacity, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (C, R/2)
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """Rotate the last dim of ``x`` (..., R) by the per-row angles ``cos``/``sin`` (rows..., R/2).

    ``cos`` and ``sin`` are already gathered at each row's position and broadcast against
    ``x``'s leading dims. ``interleave`` pairs dims (2i, 2i+1) (GLM-5); otherwise (i, i + R/2).
    """
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    cos, sin = cos.to(acc), sin.to(acc)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if interleave:
        y = torch.stack((y1, y2), dim=-1).flatten(-2)
    else:
        y = torch.cat((y1, y2), dim=-1)
    return y.to(x.dtype)


def restricted_argmax(x: Tensor, allowed: Tensor | None) -> Tensor:
    """The lowest-index maximum (T,) of ``x`` (T, V) over the allowed tokens only, ranked as
    ``torch.argmax`` ranks (a NaN above every number): the maximum is taken over the allowed
    entries and the first allowed entry equal to it wins, so a forbidden entry is never compared
    (DESIGN.md §10), even where every allowed entry is ``-inf``. ``allowed`` (V,) or (T, V) bool
    with at least one token per row, or None (every token). No host read: the optimized
    drafter's captured programs call it too."""
    if allowed is None:
        return torch.argmax(x, dim=-1)
    nan = allowed & (x != x)  # (T, V)
    num = allowed & (x == x)
    m = torch.where(num, x, -math.inf).amax(dim=-1, keepdim=True)  # (T, 1): the best allowed number
    best = torch.where(nan.any(dim=-1, keepdim=True), nan, num & (x == m))  # (T, V)
    return torch.argmax(best.to(torch.int8), dim=-1)  # the first True: the lower index wins ties


def greedy_token(logits: Tensor, allowed: Tensor | None = None) -> Tensor:
    """Argmax over the allowed tokens (T,) of ``logits`` (T, V); ties go to the lower token id
    (torch.argmax returns the first). ``allowed`` (V,) bool, None for every token."""
    return restricted_argmax(logits, allowed)


def draft_probs(logits: Tensor, temperature: Tensor, allowed: Tensor | None = None) -> Tensor:
    """The draft distribution ``q = masked_softmax(up(logits) / temperature)`` (T, V) in A, from
    the head's logits (T, V) in S: one correctly rounded division per logit, then the pinned
    softmax over the allowed tokens (``numerics.masked_softmax``; every token when ``allowed``
    is None). ``temperature`` is a tensor in A on the logits' device (the run's temperature
    rounded to A once): a division by a host scalar may run on CUDA as a multiplication by its
    reciprocal, which rounds differently."""
    return masked_softmax(up(logits) / temperature, allowed)


def sampled_token(q: Tensor, noise: Tensor, allowed: Tensor | None = None) -> Tensor:
    """The sampled draft ``argmax(q / noise)`` (T,) over the allowed tokens, for ``q`` (T, V) and
    positive noise (T, V) in A; ties go to the lower token id. With ``noise`` i.i.d.
    Exponential(1) this is a draw from ``q`` (the exponential race: ``noise_v / q_v`` is
    Exponential(q_v), and the smallest wins with probability ``q_v``), and the caller's noise
    fixes it on every backend and device."""
    return restricted_argmax(q / noise, allowed)


def draft_prob(probs: Tensor, token: Tensor) -> Tensor:
    """A draft's probability (T,) (DESIGN.md §12): ``probs[t, token[t]]`` of the distribution
    ``probs`` (T, V) it was drafted from (``q``, or the masked softmax at temperature 1)."""
    return probs.gather(-1, token[:, None])[:, 0]


def draft_margin(logits: Tensor, token: Tensor, allowed: Tensor | None = None) -> Tensor:
    """A draft's margin (T,) in A (DESIGN.md §12): ``up(l_d) - max(up(l_j) : j allowed, j != d)``
    for ``logits`` (T, V) in S and the drafts ``token`` (T,); one rounded subtraction. ``+inf``
    when d is the only allowed token (the max of nothing is ``-inf``)."""
    s = up(logits)  # (T, V) in A
    own = s.gather(-1, token[:, None])[:, 0]  # (T,)
    others = torch.arange(s.shape[-1], device=s.device) != token[:, None]  # (T, V)
    if allowed is not None:
        others = others & allowed
    return own - torch.where(others, s, -math.inf).amax(dim=-1)


def topk_indices(scores: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries of the last dim, best first; equal scores go to the
    lower index. A stable descending sort pins that order, which ``torch.topk`` does not."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


# ------------------------------------------------------------------------------------------------
# The clamped SwiGLU (glm5_next, DESIGN.md §7): g = min(up(gate(x)), L), u = min(max(up(up(x)), -L), L),
# round_S(silu(g) * u), then down. L is swiglu_limit as float32; min/max are exact and keep NaN.


def clamped_swiglu_hidden(x: Tensor, gate_proj: Tensor, up_proj: Tensor, limit: float) -> Tensor:
    """The clamped SwiGLU's hidden before ``down``: ``round_S(silu(g) * u)`` (..., I) in S."""
    g, u = up(linear(x, gate_proj)), up(linear(x, up_proj))
    L = torch.tensor(limit, dtype=torch.float32).to(device=g.device, dtype=g.dtype)
    g = torch.minimum(g, L)  # torch.minimum/maximum propagate NaN, as the rule says
    u = torch.minimum(torch.maximum(u, -L), L)
    return (silu(g) * u).to(x.dtype)


def clamped_swiglu(x: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor, limit: float) -> Tensor:
    """``linear(clamped_swiglu_hidden(x, gate, up, limit), down)``: an expert of GLM-5.3-Flash."""
    return linear(clamped_swiglu_hidden(x, gate_proj, up_proj, limit), down_proj)
