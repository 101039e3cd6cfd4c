"""The lightning indexer of DeepSeek Sparse Attention: which rows each query attends to.

    I(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s]),   w = weights_proj(a) / sqrt(n_heads * head_dim)

with ``q = wq_b(q_a_layernorm(q_a_proj(a)))`` (the MLA's own low-rank query), ``k =
k_norm(wk(a))`` (one key head shared by all index heads), RoPE on the first ``qk_rope_head_dim``
dims of each (rope first, then the rest). The ``index_topk`` best rows among the causally visible
ones are kept. Scores cover the whole row capacity: the row count enters only through the mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from .config import MtpConfig
from .layers import acc_dtype, apply_rope, layer_norm, topk_indices
from .weights import IndexerWeights

# LayerNorm epsilon of k_norm, fixed by the architecture rather than the config.
K_NORM_EPS = 1e-6


def rope_first(x: Tensor, cos: Tensor, sin: Tensor, cfg: MtpConfig) -> Tensor:
    """Rotate the first ``qk_rope_head_dim`` dims of the last axis and keep the rest."""
    R = cfg.qk_rope_head_dim
    return torch.cat((apply_rope(x[..., :R], cos, sin, cfg.indexer_rope_interleave), x[..., R:]), dim=-1)


def index_keys(ix: IndexerWeights, cfg: MtpConfig, a: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The indexer keys of new rows, as cached: ``(T, index_head_dim)``."""
    k = layer_norm(F.linear(a, ix.wk), ix.k_norm_weight, ix.k_norm_bias, K_NORM_EPS)  # (T, D)
    return rope_first(k, cos, sin, cfg)


def index_scores(ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, cos: Tensor, sin: Tensor, keys: Tensor) -> Tensor:
    """``I(t, s)`` for new rows t (T,) against every cached row s: ``(T, capacity)``, acc dtype.

    ``a`` (T, H) is the attention's normed input, ``q_latent`` (T, q_lora_rank) the normed
    low-rank query, ``cos``/``sin`` (T, R/2) the rows' RoPE angles, ``keys`` (C, D) the cache.
    """
    acc = acc_dtype(a.dtype)
    q = rearrange(F.linear(q_latent, ix.wq_b), "t (h d) -> t h d", h=cfg.index_n_heads)  # (T, Hi, D)
    q = rope_first(q, cos[:, None], sin[:, None], cfg)
    scale = (cfg.index_n_heads * cfg.index_head_dim) ** -0.5
    w = F.linear(a, ix.weights_proj).to(acc) * scale  # (T, Hi)
    per_head = torch.relu(torch.einsum("thd,sd->ths", q.to(acc), keys.to(acc)))  # (T, Hi, C)
    return torch.einsum("ths,th->ts", per_head, w)  # (T, C)


def select_rows(scores: Tensor, slots: Tensor, topk: int) -> Tensor:
    """Boolean ``(T, C)``: the ``topk`` best-scored rows among those visible to each new row
    (slots ``<= slots[t]``), ties to the lower row. With ``topk`` >= the visible count every
    visible row is kept: plain causal attention."""
    C = scores.shape[-1]
    visible = torch.arange(C, device=scores.device)[None, :] <= slots[:, None]  # (T, C)
    best = topk_indices(scores.masked_fill(~visible, float("-inf")), min(topk, C))  # (T, K)
    chosen = torch.zeros_like(visible).scatter_(1, best, True)
    return chosen & visible
