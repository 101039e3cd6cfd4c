"""The indexer's recall: how much of the dense attention a selection keeps.

For a new row t of a NoPE MLA layer (glm5_next, ``qk_rope_head_dim = 0``) the dense attention
distribution over its visible rows ``[0, t]`` is, per head h,

    p_h(t, s) = softmax_s(dot(q_abs[t, h], c_s) * qk_head_dim^-1/2),   s <= t

and its head average ``p(t, s) = mean_h p_h(t, s)`` (DSA's indexer warm-up aims the indexer at
the same head-summed distribution, L1-normalised). The recall of row t's list is the mass the
listed rows carry, ``sum_{s listed} p(t, s)``, computed as ``1 - sum_{s visible, not listed} p``
so a list of every visible row gives exactly 1.0. The **oracle** recall of a KPool layer is that
of the best selection of the same size: the ``index_topk / kpool`` candidate pools carrying the
most dense mass, plus the tail (``oracle_pool_recall``): what a perfect indexer would keep. A
measurement, not part of the drafter (so a tool, beside the counters): float64, torch's kernels.
The experiments' recall probe (``experiments/loop/recall.py``) and the indexer's training loss
(``experiments/training/indexer_loss.py``) call it.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.indexer import selection_mask
from glm_mtp.reference.kpool import select_pool_rows
from glm_mtp.reference.fp8 import BlockScaledWeight, dequantize
from glm_mtp.reference.weights import AttentionWeights


def real_weight(weight: Tensor | BlockScaledWeight, dtype: torch.dtype) -> Tensor:
    """The weight the drafter computes with, in ``dtype``: a block-scaled fp8 weight (DESIGN.md §8)
    dequantized, so the recall of an fp8 drafter is measured against its own attention."""
    return dequantize(weight, dtype) if isinstance(weight, BlockScaledWeight) else weight.to(dtype)


def dense_attention_mass(attn: AttentionWeights, cfg: MtpConfig, q_latent: Tensor, kv_rows: Tensor, slots: Tensor,
                         dtype: torch.dtype = torch.float64) -> Tensor:
    """The head-averaged dense causal attention ``p(t, s)`` (T, S) in ``dtype`` of new rows with
    normed low-rank queries ``q_latent`` (T, Lq) at ``slots`` (T,) over the cache's ``kv_rows``
    (S, Lkv) (rows past a row's slot get 0). NoPE layers only (``qk_rope_head_dim == 0``).
    Differentiable: training takes its KL target from it (detached)."""
    if cfg.qk_rope_head_dim != 0:
        raise ValueError("dense_attention_mass: NoPE layers only (glm5_next, qk_rope_head_dim 0)")
    nope, Lkv, nh = cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.num_attention_heads
    q = rearrange(torch.nn.functional.linear(q_latent.to(dtype), real_weight(attn.q_b_proj, dtype)),
                  "t (h d) -> t h d", h=nh)  # (T, nh, nope)
    w_uk = rearrange(real_weight(attn.kv_b_proj, dtype), "(h d) c -> h d c", h=nh)[:, :nope]  # (nh, nope, Lkv)
    q_abs = torch.einsum("thn,hnc->thc", q, w_uk)  # (T, nh, Lkv)
    S = kv_rows.shape[0]
    scores = torch.einsum("thc,sc->ths", q_abs, kv_rows[:, :Lkv].to(dtype)) * cfg.qk_head_dim**-0.5  # (T, nh, S)
    hidden = torch.arange(S, device=slots.device)[None, :] > slots[:, None]  # (T, S): not visible
    p = torch.softmax(scores.masked_fill(hidden[:, None, :], float("-inf")), dim=-1)
    return p.mean(1)  # (T, S)


def recall_of(mass: Tensor, rows: Tensor, count: Tensor, slots: Tensor) -> Tensor:
    """Row t's recall (T,) from its dense mass ``mass`` (T, S) and its list (``rows`` (T, K),
    ``count`` (T,)): ``1 - mass on the visible rows not listed`` (exactly 1.0 for a full list)."""
    S = mass.shape[1]
    listed = selection_mask(rows, count, S)  # (T, S)
    visible = torch.arange(S, device=slots.device)[None, :] <= slots[:, None]
    return 1.0 - (mass * (visible & ~listed)).sum(-1)


def oracle_pool_recall(mass: Tensor, slots: Tensor, cfg: MtpConfig) -> Tensor:
    """The recall (T,) of the best KPool selection for the dense mass ``mass`` (T, S): the
    candidate pools with the most mass (``select_pool_rows`` scoring each pool by its mass), plus
    the tail."""
    kp = cfg.index_kpool
    P = (int(slots.max()) + 1) // kp if slots.numel() else 0
    pool_mass = mass[:, : P * kp].reshape(mass.shape[0], P, kp).sum(-1)  # (T, P)
    return recall_of(mass, *select_pool_rows(pool_mass, slots, cfg), slots)


def selection_recall(attn: AttentionWeights, cfg: MtpConfig, q_latent: Tensor, kv_rows: Tensor, slots: Tensor,
                     rows: Tensor, count: Tensor) -> Tensor:
    """The recall (T,) in float64 of each new row's list (``rows``, ``count``) against its
    dense attention over ``kv_rows`` (S, Lkv) (``dense_attention_mass``, ``recall_of``)."""
    return recall_of(dense_attention_mass(attn, cfg, q_latent, kv_rows, slots), rows, count, slots)


__all__ = ["dense_attention_mass", "recall_of", "oracle_pool_recall", "selection_recall"]
