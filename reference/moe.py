"""The MoE block: sigmoid routing with a selection-only correction bias, optional group
limiting, normalised weights times ``routed_scaling_factor``, SwiGLU experts, a shared expert.

    s      = sigmoid(router(m))                              (acc dtype)
    chosen = top-k of s + bias        (only among the topk_group best groups when n_group > 1;
                                       a group scores the sum of its two best biased scores)
    w      = s[chosen] / sum(s[chosen]) * routed_scaling_factor
    out    = sum_j w_j expert_{chosen_j}(m) + shared(m)

Each row's experts run on that row alone, with its experts' weights gathered, so a row's result
does not depend on which other rows share the call; the weighted sum runs in ascending expert id.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor

from .config import MtpConfig
from .layers import acc_dtype, swiglu, topk_indices
from .weights import MoeWeights

# Keeps the normalisation finite if every chosen score underflows to 0.
NORM_EPS = 1e-20


def route(moe: MoeWeights, cfg: MtpConfig, m: Tensor) -> tuple[Tensor, Tensor]:
    """Experts and weights for rows ``m`` (T, H): ``(T, k)`` int64 ids in ascending order and
    ``(T, k)`` weights in acc dtype. Ties go to the lower group and the lower expert."""
    acc = acc_dtype(m.dtype)
    scores = torch.sigmoid(F.linear(m.to(acc), moe.router.to(acc)))  # (T, E)
    biased = scores + moe.e_score_correction_bias.to(acc)
    if cfg.n_group > 1:
        grouped = rearrange(biased, "t (g e) -> t g e", g=cfg.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, topk_indices(group_score, cfg.topk_group), True)
        keep = repeat(keep, "t g -> t (g e)", e=cfg.n_routed_experts // cfg.n_group)
        biased = biased.masked_fill(~keep, float("-inf"))
    experts = topk_indices(biased, cfg.num_experts_per_tok).sort(dim=-1).values  # (T, k)
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + NORM_EPS)
    return experts, weights * cfg.routed_scaling_factor


def expert_outputs(moe: MoeWeights, m: Tensor, experts: Tensor) -> Tensor:
    """``expert_{experts[t, j]}(m[t])`` for every row and slot: (T, k, H), acc dtype. ``experts``
    index the experts this ``moe`` holds. Each row runs alone on its k gathered experts."""
    acc = acc_dtype(m.dtype)
    out = []
    for t in range(m.shape[0]):
        ids = experts[t]  # (k,)
        gate = torch.index_select(moe.experts_gate, 0, ids)  # (k, I, H)
        up = torch.index_select(moe.experts_up, 0, ids)  # (k, I, H)
        down = torch.index_select(moe.experts_down, 0, ids)  # (k, H, I)
        h = F.silu(torch.einsum("h,kih->ki", m[t], gate)) * torch.einsum("h,kih->ki", m[t], up)  # (k, I)
        out.append(torch.einsum("ki,khi->kh", h, down).to(acc))  # (k, H)
    return torch.stack(out)


def sharded_expert_outputs(moe: MoeWeights, m: Tensor, experts: Tensor) -> Tensor:
    """``expert_outputs`` over expert-parallel ranks: each rank runs the slots whose expert it
    holds (the others on a clamped local expert, discarded), then every rank takes each slot's
    output from its owner's all-gathered copy: bytes moved, not re-added, so the result equals
    the single-rank one exactly."""
    assert moe.shard is not None
    per_rank = moe.experts_gate.shape[0]
    local = (experts - moe.shard.rank * per_rank).clamp(0, per_rank - 1)
    gathered = moe.shard.all_gather(expert_outputs(moe, m, local))  # (W, T, k, H)
    owner = rearrange(experts // per_rank, "t k -> 1 t k 1").expand(1, *gathered.shape[1:])
    return gathered.gather(0, owner)[0]  # (T, k, H)


def routed_experts(moe: MoeWeights, m: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(m[t])`` for every row: (T, H), acc dtype."""
    y = expert_outputs(moe, m, experts) if moe.shard is None else sharded_expert_outputs(moe, m, experts)
    total = torch.zeros_like(y[:, 0])
    for j in range(y.shape[1]):  # a fixed order: ascending expert id
        total = total + weights[:, j : j + 1] * y[:, j]
    return total


def moe_block(moe: MoeWeights, cfg: MtpConfig, m: Tensor) -> Tensor:
    """The MoE's output for its normed input ``m`` (T, H), in m's dtype."""
    experts, weights = route(moe, cfg, m)
    out = routed_experts(moe, m, experts, weights)
    if moe.shared is not None:
        out = out + swiglu(m, moe.shared.gate_proj, moe.shared.up_proj, moe.shared.down_proj).to(out.dtype)
    return out.to(m.dtype)
