"""The lightning indexer of DeepSeek Sparse Attention: which rows each query attends to.

    I(t, s) = psum_h(w[t, h] * relu(dot(q[t, h], k[s]))),   w = weights_proj(a) / sqrt(n_heads * head_dim)

with ``q = wq_b(q_a_layernorm(q_a_proj(a)))`` (the MLA's own low-rank query), ``k =
k_norm(wk(a))`` (one key head shared by all index heads), RoPE on the first ``qk_rope_head_dim``
dims of each (rope first, then the rest). Each query keeps the ``index_topk`` best of the rows it
can see (slots ``<= its own``), ties to the lower row, as a list in ascending slot order.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from .config import MtpConfig
from .layers import apply_rope, topk_indices
from .numerics import PINNED, Numerics, up
from .weights import IndexerWeights

# LayerNorm epsilon of k_norm, fixed by the architecture rather than the config.
K_NORM_EPS = 1e-6


def index_weight_scale(cfg: MtpConfig) -> float:
    """``(n_heads * head_dim)^-1/2``, the head weights' scale (a float32 constant in A)."""
    return (cfg.index_n_heads * cfg.index_head_dim) ** -0.5


def rope_first(x: Tensor, cos: Tensor, sin: Tensor, cfg: MtpConfig) -> Tensor:
    """Rotate the first ``qk_rope_head_dim`` dims of the last axis and keep the rest."""
    R = cfg.qk_rope_head_dim
    return torch.cat((apply_rope(x[..., :R], cos, sin, cfg.indexer_rope_interleave), x[..., R:]), dim=-1)


def normed_index_keys(ix: IndexerWeights, k: Tensor, ops: Numerics = PINNED) -> Tensor:
    """``k_norm`` of the raw keys ``k = wk(a)`` (T, D): the keys before their RoPE."""
    return ops.layer_norm(k, ix.k_norm_weight, ix.k_norm_bias, K_NORM_EPS)


def index_keys_from(ix: IndexerWeights, cfg: MtpConfig, k: Tensor, cos: Tensor, sin: Tensor,
                    ops: Numerics = PINNED) -> Tensor:
    """The cached indexer keys ``(T, D)`` of new rows from their raw keys ``k = wk(a)`` (T, D)."""
    return rope_first(normed_index_keys(ix, k, ops), cos, sin, cfg)


def index_keys(ix: IndexerWeights, cfg: MtpConfig, a: Tensor, cos: Tensor, sin: Tensor,
               ops: Numerics = PINNED) -> Tensor:
    """The indexer keys of new rows, as cached: ``(T, index_head_dim)``."""
    return index_keys_from(ix, cfg, ops.linear(a, ix.wk), cos, sin, ops)


def index_queries(ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, cos: Tensor, sin: Tensor,
                  ops: Numerics = PINNED) -> tuple[Tensor, Tensor]:
    """The index heads of new rows: queries ``(T, Hi, D)`` (rotated, S) and weights ``(T, Hi)``
    (already scaled, A). ``a`` (T, H) is the attention's normed input, ``q_latent`` (T, Lq) the
    normed low-rank query, ``cos``/``sin`` (T, R/2) the rows' RoPE angles."""
    q = rearrange(ops.linear(q_latent, ix.wq_b), "t (h d) -> t h d", h=cfg.index_n_heads)  # (T, Hi, D)
    q = rope_first(q, cos[:, None], sin[:, None], cfg)
    w = up(ops.linear(a, ix.weights_proj)) * index_weight_scale(cfg)  # (T, Hi)
    return q, w


def index_scores(q: Tensor, w: Tensor, keys: Tensor, ops: Numerics = PINNED) -> Tensor:
    """``I(t, s)`` for queries ``q`` (T, Hi, D) with weights ``w`` (T, Hi) against the cached
    keys ``keys`` (S, D): ``(T, S)`` in A. Each score is its own sum, so reading more rows (up to
    the whole capacity) changes none of them."""
    T, Hi, D = q.shape
    if ops.pinned:
        per_head = ops.linear_acc(rearrange(q, "t h d -> (t h) d"), keys)  # (T * Hi, S): dot(q[t, h], k[s])
        per_head = rearrange(per_head, "(t h) s -> t s h", h=Hi)
        return ops.psum(w[:, None, :] * torch.relu(per_head))  # (T, S)
    per_head = torch.relu(torch.einsum("thd,sd->ths", up(q), up(keys)))  # (T, Hi, S)
    return torch.einsum("ths,th->ts", per_head, w)


def select_rows(scores: Tensor, slots: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """The rows each new row attends to, from the scores ``(T, S)`` of cached rows ``[0, S)``.

    Returns ``rows`` (T, K) int64 and ``count`` (T,) int64, ``K = min(topk, S)``: row t's list is
    the ``count[t] = min(topk, slots[t] + 1)`` best-scored rows among slots ``<= slots[t]`` (ties
    to the lower row), in ascending slot order; entries past ``count[t]`` are padding (slot 0).
    With ``topk`` >= the visible count every visible row is listed: plain causal attention."""
    S = scores.shape[-1]
    K = min(topk, S)
    visible = torch.arange(S, device=scores.device)[None, :] <= slots[:, None]  # (T, S)
    count = (slots + 1).clamp(max=K)  # (T,)
    best = topk_indices(scores.masked_fill(~visible, float("-inf")), K)  # (T, K), best first
    listed = torch.arange(K, device=scores.device)[None, :] < count[:, None]  # (T, K)
    rows = torch.where(listed, best, S).sort(dim=-1).values  # ascending; padding (S) sorts last
    return torch.where(listed, rows, 0), count


def selection_mask(rows: Tensor, count: Tensor, S: int) -> Tensor:
    """The lists of ``select_rows`` as a boolean ``(T, S)`` mask."""
    listed = torch.arange(rows.shape[-1], device=rows.device)[None, :] < count[:, None]
    mask = torch.zeros(rows.shape[0], S + 1, dtype=torch.bool, device=rows.device)  # column S takes the padding
    return mask.scatter_(1, torch.where(listed, rows, S), True)[:, :S]
