"""DSA attention: multi-head latent attention (MLA) over the rows the indexer selects.

The cache holds, per row, the normalised KV latent ``c`` and the rotated rope key ``k_pe``
(``kv_rows``). Keys and values are never expanded: the query's no-RoPE part is absorbed into the
latent space through ``kv_b_proj``'s key half, and the output leaves it through the value half,

    score(t, s) = (q_nope W_uk . c_s  +  q_pe . k_pe_s) / sqrt(qk_head_dim)
    out_t       = W_uv (sum_s softmax(score)_ts c_s),

which is the same math as attending with expanded keys and values. Scores span the whole row
capacity; rows the indexer did not choose (and rows not yet visible) get -inf, so they add exact
zeros to the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from .config import MtpConfig
from .indexer import index_keys, index_scores, select_rows
from .layers import acc_dtype, apply_rope, rms_norm, rope_table
from .state import LayerCache
from .weights import AttentionWeights

# RMSNorm epsilon of q_a_layernorm and kv_a_layernorm, fixed by the architecture.
LATENT_NORM_EPS = 1e-6


@dataclass
class Rope:
    """The RoPE table of one row space: ``cos``/``sin`` (capacity, qk_rope_head_dim // 2) in the
    acc dtype of the weights (float32, or float64 for float64 weights)."""

    cos: Tensor
    sin: Tensor

    @classmethod
    def build(cls, cfg: MtpConfig, capacity: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> "Rope":
        return cls(*rope_table(capacity, cfg.qk_rope_head_dim, cfg.rope_theta, device, acc_dtype(dtype)))

    def at(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """The angles of rows at ``slots`` (T,): a row's RoPE position is its slot."""
        return self.cos[slots], self.sin[slots]


def latent_query(attn: AttentionWeights, cfg: MtpConfig, a: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The queries of new rows ``a`` (T, H): ``q_latent`` (T, Lq), the normed low-rank query the
    indexer shares; ``q_nope`` (T, nh, nope) and the rotated ``q_pe`` (T, nh, R), split nope-first."""
    q_latent = rms_norm(F.linear(a, attn.q_a_proj), attn.q_a_layernorm, LATENT_NORM_EPS)  # (T, Lq)
    q = rearrange(F.linear(q_latent, attn.q_b_proj), "t (h d) -> t h d", h=cfg.num_attention_heads)  # (T, nh, nope + R)
    nope = cfg.qk_nope_head_dim
    return q_latent, q[..., :nope], apply_rope(q[..., nope:], cos[:, None], sin[:, None], cfg.rope_interleave)


def attend(
    attn: AttentionWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, q_nope: Tensor, q_pe: Tensor,
    cos: Tensor, sin: Tensor, slots: Tensor, cache: LayerCache,
) -> Tensor:
    """Attention of new rows (their cache rows already written) over every visible row the
    indexer selects, through ``o_proj``: ``(T, H)``."""
    nh, nope, Lkv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    acc = acc_dtype(a.dtype)
    rows = cache.kv_rows().to(acc)  # (C, Lkv + R)
    c_all, k_pe_all = rows[:, :Lkv], rows[:, Lkv:]
    chosen = select_rows(index_scores(attn.indexer, cfg, a, q_latent, cos, sin, cache.index_rows()), slots, cfg.index_topk)

    w_kv = rearrange(attn.kv_b_proj, "(h d) c -> h d c", h=nh).to(acc)  # (nh, nope + v, Lkv)
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
    q_absorbed = torch.einsum("thn,hnc->thc", q_nope.to(acc), w_uk)  # (T, nh, Lkv)
    scores = torch.einsum("thc,sc->ths", q_absorbed, c_all) + torch.einsum("thr,sr->ths", q_pe.to(acc), k_pe_all)
    scores = (scores * cfg.qk_head_dim**-0.5).masked_fill(~chosen[:, None, :], float("-inf"))  # (T, nh, C)
    probs = torch.softmax(scores, dim=-1)
    out_latent = torch.einsum("ths,sc->thc", probs, c_all)  # (T, nh, Lkv)
    out = torch.einsum("thc,hvc->thv", out_latent, w_uv)  # (T, nh, v)
    return output_projection(attn, cfg, rearrange(out, "t h v -> t (h v)").to(a.dtype))


def output_projection(attn: AttentionWeights, cfg: MtpConfig, out: Tensor) -> Tensor:
    """``o_proj`` on the heads' outputs ``out`` (T, nh * v). Row-parallel (``attn.shard`` set),
    each rank multiplies its heads' columns and the float32 partial sums are all-reduced: a
    split reduction, so not bit-equal to the single GEMM (see reference/distributed.py)."""
    if attn.shard is None:
        return F.linear(out, attn.o_proj)
    cols = attn.shard.head_columns(cfg.num_attention_heads, cfg.v_head_dim)
    partial = F.linear(out[:, cols], attn.o_proj).to(acc_dtype(out.dtype))  # (T, H)
    return attn.shard.all_reduce_sum(partial).to(out.dtype)


def dsa_attention(attn: AttentionWeights, cfg: MtpConfig, a: Tensor, slots: Tensor, cache: LayerCache, rope: Rope) -> Tensor:
    """Attention for new rows ``a`` (T, H) at ``slots`` (T,): writes their rows into ``cache``,
    then attends over every visible, selected row. Returns ``(T, H)``."""
    cos, sin = rope.at(slots)  # (T, R/2)
    q_latent, q_nope, q_pe = latent_query(attn, cfg, a, cos, sin)

    # This call's rows: compressed latent + one rope key shared by the heads, and the indexer key.
    kv = F.linear(a, attn.kv_a_proj_with_mqa)  # (T, Lkv + R)
    latent = rms_norm(kv[:, : cfg.kv_lora_rank], attn.kv_a_layernorm, LATENT_NORM_EPS)
    k_pe = apply_rope(kv[:, cfg.kv_lora_rank :], cos, sin, cfg.rope_interleave)
    cache.write(slots, torch.cat((latent, k_pe), dim=-1), index_keys(attn.indexer, cfg, a, cos, sin))

    return attend(attn, cfg, a, q_latent, q_nope, q_pe, cos, sin, slots, cache)
