"""The MTP block for new rows, as the optimized drafter schedules it.

The math is ``glm_mtp.reference.block.mtp_rows`` op for op: every reduction (GEMMs, norms, the
index scores, top-k selection, softmax, the MoE) is the reference's own function (``latent_query``,
``attend``, ``moe_block``, ``rms_norm``, ...) or the same torch op on the same shapes. Two pieces differ, both exact by construction (DESIGN.md §5):

- the embedding gather with the row-0 zeroing (``kernels.embed``), which reads token ids from the
  device, so a draft's argmax feeds the next lookup without a host round trip;
- RoPE on the new keys fused with their paged cache write (``kernels.rope_cache_write``), every
  store gated by a device flag ``ok`` so a propose can refuse a bad input without a host sync.

Nothing here reads a device value on the host: slots arrive as a device tensor, so the same code
runs eagerly on CPU and under CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_mtp.reference.attention import LATENT_NORM_EPS, Rope, attend, latent_query
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.indexer import K_NORM_EPS
from glm_mtp.reference.layers import layer_norm, rms_norm, swiglu
from glm_mtp.reference.moe import moe_block
from glm_mtp.reference.state import LayerCache
from glm_mtp.reference.weights import AttentionWeights, MlpWeights, MtpWeights

from .kernels import KERNEL_DTYPES, embed_rows_torch, embed_rows_triton, rope_cache_write_torch, rope_cache_write_triton

KernelMode = Literal["auto", "triton", "torch"]


@dataclass(frozen=True)
class Fused:
    """Which implementation the fused pieces use: the Triton kernel or its torch twin (proven
    byte-equal to it). ``auto`` takes the kernels on CUDA and the twins on CPU, where Triton
    only has its (slow) interpreter; ``triton`` forces the kernels (on CPU that needs
    ``TRITON_INTERPRET=1`` set before triton is imported)."""

    mode: KernelMode = "auto"

    def use_triton(self, t: Tensor) -> bool:
        if self.mode == "torch":
            return False
        if self.mode == "triton":
            return t.dtype in KERNEL_DTYPES
        return t.is_cuda and t.dtype in KERNEL_DTYPES

    def embed(self, embed: Tensor, tokens: Tensor, slots: Tensor) -> Tensor:
        """``embed[tokens]`` (T, H) with slot-0 rows zeroed."""
        if self.use_triton(embed) and embed.is_contiguous() and tokens.shape[0] > 0:
            return embed_rows_triton(embed, tokens, slots)
        return embed_rows_torch(embed, tokens, slots)

    def rope_cache_write(self, cfg: MtpConfig, latent: Tensor, kpe_raw: Tensor, ikey_raw: Tensor, slots: Tensor,
                         rope: Rope, cache: LayerCache, ok: Tensor) -> None:
        """Rotate and store the new rows' keys at ``slots`` where ``ok``; see kernels.rope_cache."""
        args = (cfg, latent, kpe_raw, ikey_raw, slots, rope.cos, rope.sin, cache.kv_pool, cache.index_pool, cache.block_table, ok)
        if self.use_triton(cache.kv_pool) and rope.cos.dtype == torch.float32:
            rope_cache_write_triton(*args)
        else:
            rope_cache_write_torch(*args)


def attention_rows(attn: AttentionWeights, cfg: MtpConfig, a: Tensor, slots: Tensor, cache: LayerCache, rope: Rope,
                   ok: Tensor, fused: Fused) -> Tensor:
    """``glm_mtp.reference.attention.dsa_attention`` for new rows ``a`` (T, H) at ``slots`` (T,),
    with the cache write fused and gated by ``ok`` (1,) bool. Returns ``(T, H)``.

    The queries and the attention proper are the reference's own ``latent_query`` and ``attend``
    (index scores, top-k selection, softmax, ``o_proj``); only the new rows' RoPE and cache
    write in between are the fused kernel."""
    cos, sin = rope.at(slots)  # (T, R/2)
    q_latent, q_nope, q_pe = latent_query(attn, cfg, a, cos, sin)

    kv = F.linear(a, attn.kv_a_proj_with_mqa)  # (T, Lkv + R)
    latent = rms_norm(kv[:, : cfg.kv_lora_rank], attn.kv_a_layernorm, LATENT_NORM_EPS)
    ix = attn.indexer
    k_raw = layer_norm(F.linear(a, ix.wk), ix.k_norm_weight, ix.k_norm_bias, K_NORM_EPS)  # (T, D), RoPE comes in the write
    fused.rope_cache_write(cfg, latent, kv[:, cfg.kv_lora_rank :], k_raw, slots, rope, cache, ok)

    return attend(attn, cfg, a, q_latent, q_nope, q_pe, cos, sin, slots, cache)


def block_rows(w: MtpWeights, tokens: Tensor, hiddens: Tensor, slots: Tensor, cache: LayerCache, rope: Rope,
               ok: Tensor, fused: Fused) -> tuple[Tensor, Tensor]:
    """``glm_mtp.reference.block.mtp_rows`` on rows pairing ``tokens`` (T,) with ``hiddens``
    (T, H) at ``slots`` (T,); cache writes only where ``ok`` (1,) bool is set.

    Returns ``(x, pre_norm)``, each (T, H): the post-norm output and the layer output."""
    cfg, eps = w.config, w.config.rms_norm_eps
    e = fused.embed(w.embed_tokens, tokens, slots)  # (T, H)
    u = F.linear(torch.cat((rms_norm(e, w.enorm, eps), rms_norm(hiddens, w.hnorm, eps)), dim=-1), w.eh_proj)
    layer = w.layer
    a = rms_norm(u, layer.input_layernorm, eps)
    h = u + attention_rows(layer.attn, cfg, a, slots, cache, rope, ok, fused)
    m = rms_norm(h, layer.post_attention_layernorm, eps)
    if isinstance(layer.mlp, MlpWeights):
        out = h + swiglu(m, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
    else:
        out = h + moe_block(layer.mlp, cfg, m)
    return rms_norm(out, w.shared_head_norm, eps), out
