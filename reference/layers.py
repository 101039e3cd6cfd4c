"""The small building blocks: norms, the RoPE table, the SwiGLU MLP, the draft argmax.

Precision, everywhere in the drafter: weights and activations live in the weights' dtype (bf16 in
production); norms, RoPE, scores and softmax compute in at least float32 (``acc_dtype``) and round
back once. Float64 inputs stay float64, so a float64 run re-derives the math to the last digit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms, scores and softmax compute in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in acc_dtype, scaled in x's dtype."""
    xf = x.to(acc_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """LayerNorm with bias (the indexer's ``k_norm``), computed in acc_dtype."""
    acc = acc_dtype(x.dtype)
    y = F.layer_norm(x.to(acc), (x.shape[-1],), weight.to(acc), bias.to(acc), eps)
    return y.to(x.dtype)


def swiglu(x: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> Tensor:
    """``down(silu(gate(x)) * up(x))``: a dense MLP, the shared expert, one routed expert."""
    return F.linear(F.silu(F.linear(x, gate_proj)) * F.linear(x, up_proj), down_proj)


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


def greedy_token(logits: Tensor) -> Tensor:
    """Argmax over the vocabulary; ties go to the lower token id (torch.argmax returns the first)."""
    return torch.argmax(logits, dim=-1)


def topk_indices(scores: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries of the last dim, best first; equal scores go to the
    lower index. A stable descending sort pins that order, which ``torch.topk`` does not."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
