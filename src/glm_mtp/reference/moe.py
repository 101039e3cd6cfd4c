"""The MoE block: sigmoid routing with a selection-only correction bias, optional group
limiting, normalised weights times ``routed_scaling_factor``, SwiGLU experts, a shared expert.

    s      = sigmoid(router(m))                              (A)
    chosen = top-k of s + bias        (only among the topk_group best groups when n_group > 1;
                                       a group scores the sum of its two best biased scores)
    w      = s[chosen] / (psum(s[chosen]) + 1e-20) * routed_scaling_factor
    out    = round_S(psum_j(w_j * expert_{chosen_j}(m)) + shared(m))

In the glm5_next family every expert (routed and shared) is the clamped SwiGLU of
``layers.clamped_swiglu`` at ``swiglu_limit`` (``expert_swiglu``) and the router is float32.

Each row's experts run on that row alone, reading the chosen experts' weights in place, so a row's
result does not depend on which other rows share the call; the weighted sum runs over the chosen
experts in ascending expert id.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor

from .config import MtpConfig
from .layers import clamped_swiglu, topk_indices
from .numerics import PINNED, Numerics, plain_weight, psum, up
from .weights import MoeWeights

# The chosen experts' outputs: (weights, m (T, H), experts (T, k), ops) -> (T, k, H) in S.
ExpertFn = Callable[[MoeWeights, Tensor, Tensor, Numerics], Tensor]

# Keeps the normalisation finite if every chosen score underflows to 0.
NORM_EPS = 1e-20


def route(moe: MoeWeights, cfg: MtpConfig, m: Tensor, ops: Numerics = PINNED) -> tuple[Tensor, Tensor]:
    """Experts and weights for rows ``m`` (T, H): ``(T, k)`` int64 ids in ascending order and
    ``(T, k)`` weights in acc dtype. Ties go to the lower group and the lower expert."""
    return choose_experts(cfg, ops.linear_acc(m, moe.router), moe.e_score_correction_bias, ops)


def choose_experts(cfg: MtpConfig, logits: Tensor, bias: Tensor, ops: Numerics = PINNED) -> tuple[Tensor, Tensor]:
    """``route`` after the router's GEMV: experts and weights from the router's logits (T, E) in
    A and the selection bias (E,) (optimized/kernels/moe.py's ``route_triton`` is its kernel)."""
    scores = ops.sigmoid(logits)  # (T, E), A
    biased = scores + up(bias)
    if cfg.n_group > 1:
        grouped = rearrange(biased, "t (g e) -> t g e", g=cfg.n_group)
        group_score = ops.psum(grouped.topk(2, dim=-1).values)  # (T, G): best + second best
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
            1, topk_indices(group_score, cfg.topk_group), True
        )
        keep = repeat(keep, "t g -> t (g e)", e=cfg.n_routed_experts // cfg.n_group)
        biased = biased.masked_fill(~keep, float("-inf"))
    experts = topk_indices(biased, cfg.num_experts_per_tok).sort(dim=-1).values  # (T, k)
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob:
        weights = weights / (ops.psum(weights)[:, None] + NORM_EPS)
    return experts, weights * cfg.routed_scaling_factor


def expert_swiglu(moe: MoeWeights, ops: Numerics = PINNED) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The SwiGLU of ``moe``'s experts, routed and shared: ``ops.swiglu``, or with
    ``moe.swiglu_limit`` set (glm5_next) the pinned ``layers.clamped_swiglu`` at that limit
    (``clamped_swiglu_vendor`` with torch's kernels: training and the experiments' target)."""
    if moe.swiglu_limit is None:
        return ops.swiglu
    if not ops.pinned:
        return partial(clamped_swiglu_vendor, limit=moe.swiglu_limit)
    return partial(clamped_swiglu, limit=moe.swiglu_limit)


def clamped_swiglu_vendor(x: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor, limit: float) -> Tensor:
    """The clamped SwiGLU of DESIGN.md §7 with torch's kernels (differentiable; not pinned):
    ``down(silu(min(gate(x), L)) * clamp(up(x), -L, L))`` in S."""
    g = torch.clamp(F.linear(x, plain_weight(gate_proj)), max=limit)
    u = torch.clamp(F.linear(x, plain_weight(up_proj)), min=-limit, max=limit)
    return F.linear(F.silu(g) * u, plain_weight(down_proj))


def expert_outputs(moe: MoeWeights, m: Tensor, experts: Tensor, ops: Numerics = PINNED) -> Tensor:
    """``expert_{experts[t, j]}(m[t])`` for every row and slot: (T, k, H) in S. ``experts`` index
    the experts this ``moe`` holds. Each row runs alone on its k experts, whose weights are read
    in place (views of the stacked tensors)."""
    out = torch.empty(*experts.shape, m.shape[-1], dtype=m.dtype, device=m.device)
    swiglu = expert_swiglu(moe, ops)
    for t, ids in enumerate(experts.tolist()):
        for j, e in enumerate(ids):
            out[t, j] = swiglu(m[t], moe.experts_gate[e], moe.experts_up[e], moe.experts_down[e])
    return out


def sharded_expert_outputs(moe: MoeWeights, m: Tensor, experts: Tensor, ops: Numerics = PINNED) -> Tensor:
    """``expert_outputs`` over expert-parallel ranks: each rank runs the slots whose expert it
    holds (the others on a clamped local expert, discarded), then every rank takes each slot's
    output from its owner's all-gathered copy: bytes moved, not re-added, so the result equals
    the single-rank one exactly."""
    assert moe.shard is not None
    per_rank = moe.experts_gate.shape[0]
    local = (experts - moe.shard.rank * per_rank).clamp(0, per_rank - 1)
    gathered = moe.shard.all_gather(expert_outputs(moe, m, local, ops))  # (W, T, k, H)
    owner = rearrange(experts // per_rank, "t k -> 1 t k 1").expand(1, *gathered.shape[1:])
    return gathered.gather(0, owner)[0]  # (T, k, H)


def combine(weights: Tensor, y: Tensor, ops: Numerics = PINNED) -> Tensor:
    """``sum_j weights[t, j] * y[t, j]`` over the slots in ascending expert id: (T, H) in A."""
    if ops.pinned:
        return psum(rearrange(weights[:, :, None] * up(y), "t k h -> t h k"))
    total = torch.zeros_like(up(y[:, 0]))
    for j in range(y.shape[1]):
        total = total + weights[:, j : j + 1] * up(y[:, j])
    return total


def moe_block(moe: MoeWeights, cfg: MtpConfig, m: Tensor, ops: Numerics = PINNED,
              outputs: ExpertFn = expert_outputs) -> Tensor:
    """The MoE's output for its normed input ``m`` (T, H), in m's dtype. ``outputs`` computes
    the chosen experts' outputs (the optimized drafter passes one that needs no host read)."""
    experts, weights = route(moe, cfg, m, ops)
    y = outputs(moe, m, experts, ops) if moe.shard is None else sharded_expert_outputs(moe, m, experts, ops)
    out = combine(weights, y, ops)
    if moe.shared is not None:
        out = out + up(expert_swiglu(moe, ops)(m, moe.shared.gate_proj, moe.shared.up_proj, moe.shared.down_proj))
    return out.to(m.dtype)
