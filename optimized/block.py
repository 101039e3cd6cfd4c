"""The MTP block for new rows, as the optimized drafter schedules it.

The math is ``glm_mtp.reference.block.mtp_rows``: every reduction follows the pinned order of
DESIGN.md §5 through the reference's own functions (``latent_query``, ``sparse_mla``,
``moe_block``, ``numerics.rms_norm``, ...), in static shapes (attention reads the whole capacity,
which changes no result). Four pieces differ, all exact by construction:

- the block's GEMVs (eh_proj, q_a/q_b, kv_a, the indexer's wq_b/wk/weights_proj and key scores,
  o_proj, the router, every expert's gate/up/down) in the pinned GEMV kernel (``kernels.linear``:
  the ``psum`` tree over K), through ``Fused.ops``: the pinned primitives with the kernel's
  ``linear``/``linear_acc``/``swiglu``, passed as ``ops`` to the reference's functions (a
  row-parallel ``o_proj`` keeps the reference's own per-rank sum);
- the embedding gather with the row-0 zeroing (``kernels.embed``), which reads token ids from the
  device, so a draft's argmax feeds the next lookup without a host round trip;
- RoPE on the new keys fused with their paged cache write (``kernels.rope_cache_write``), every
  store gated by a device flag ``ok`` so a propose can refuse a bad input without a host sync;
- the chosen experts' weights gathered on the device rather than read in place through host
  ids (``gathered_expert_outputs``): copies of the same values.

Nothing here reads a device value on the host: slots arrive as a device tensor, so the same code
runs eagerly on CPU and under CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

import torch
from torch import Tensor

from glm_mtp.reference.attention import LATENT_NORM_EPS, Rope, latent_query, output_projection, sparse_mla
from glm_mtp.reference.block import block_input
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.indexer import K_NORM_EPS, index_queries, index_scores, select_rows
from glm_mtp.reference.moe import moe_block
from glm_mtp.reference.numerics import PINNED, Numerics, layer_norm, rms_norm, swiglu
from glm_mtp.reference.state import LayerCache
from glm_mtp.reference.weights import AttentionWeights, MlpWeights, MoeWeights, MtpWeights

from .kernels import (
    KERNEL_DTYPES, embed_rows_torch, embed_rows_triton, linear_acc_torch, linear_acc_triton, linear_torch, linear_triton,
    rope_cache_write_torch, rope_cache_write_triton,
)

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

    def _gemv(self, x: Tensor, weight: Tensor) -> bool:
        """Whether ``x @ weight.T`` takes the GEMV kernel: weights the kernels take, 2-D with a
        contiguous last dim (any row stride), activations of a kernel dtype on the same device."""
        return (self.use_triton(weight) and weight.dim() == 2 and weight.stride(-1) == 1 and x.dtype in KERNEL_DTYPES
                and x.device == weight.device and x.shape[-1] == weight.shape[-1])

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """``numerics.linear(x, weight)``: x (..., K), weight (N, K) -> (..., N) in x's dtype."""
        return linear_triton(x, weight) if self._gemv(x, weight) else linear_torch(x, weight)

    def linear_acc(self, x: Tensor, weight: Tensor) -> Tensor:
        """``numerics.linear_acc(x, weight)``: as ``linear``, left in A."""
        return linear_acc_triton(x, weight) if self._gemv(x, weight) else linear_acc_torch(x, weight)

    def swiglu(self, x: Tensor, gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> Tensor:
        """``numerics.swiglu`` with this ``linear``."""
        return swiglu(x, gate_proj, up_proj, down_proj, linear=self.linear)

    @cached_property
    def ops(self) -> Numerics:
        """The pinned primitives with this ``linear``, ``linear_acc`` and ``swiglu``: what the
        reference's functions take as ``ops`` here, so each of their GEMVs takes the kernel
        (built once per drafter, not once per draft step)."""
        return replace(PINNED, linear=self.linear, linear_acc=self.linear_acc, swiglu=self.swiglu)


def attention_rows(attn: AttentionWeights, cfg: MtpConfig, a: Tensor, slots: Tensor, cache: LayerCache, rope: Rope,
                   ok: Tensor, fused: Fused) -> Tensor:
    """``glm_mtp.reference.attention.dsa_attention`` for new rows ``a`` (T, H) at ``slots`` (T,),
    with the cache write fused and gated by ``ok`` (1,) bool. Returns ``(T, H)``.

    The queries, the indexer's choice and the sparse MLA are the reference's own functions, over
    the whole capacity (a static shape: no result depends on the rows read); only the new rows'
    RoPE and cache write in between are the fused kernel."""
    ops = fused.ops
    cos, sin = rope.at(slots)  # (T, R/2)
    q_latent, q_nope, q_pe = latent_query(attn, cfg, a, cos, sin, ops)

    kv = fused.linear(a, attn.kv_a_proj_with_mqa)  # (T, Lkv + R)
    latent = rms_norm(kv[:, : cfg.kv_lora_rank], attn.kv_a_layernorm, LATENT_NORM_EPS)
    ix = attn.indexer
    k_raw = layer_norm(fused.linear(a, ix.wk), ix.k_norm_weight, ix.k_norm_bias, K_NORM_EPS)  # (T, D), RoPE comes in the write
    fused.rope_cache_write(cfg, latent, kv[:, cfg.kv_lora_rank :], k_raw, slots, rope, cache, ok)

    q_idx, w_idx = index_queries(ix, cfg, a, q_latent, cos, sin, ops)
    rows, count = select_rows(index_scores(q_idx, w_idx, cache.index_rows(), ops), slots, cfg.index_topk)
    return output_projection(attn, cfg, sparse_mla(attn, cfg, q_nope, q_pe, cache.kv_rows(), rows, count), ops)


def gathered_expert_outputs(moe: MoeWeights, m: Tensor, experts: Tensor, ops: Numerics = PINNED) -> Tensor:
    """``glm_mtp.reference.moe.expert_outputs`` without a host read of the expert ids (so it can
    be captured): each row's experts are gathered on the device (copies), then run alone."""
    out = []
    for t in range(m.shape[0]):
        ids = experts[t]  # (k,)
        gate, up, down = (torch.index_select(x, 0, ids) for x in (moe.experts_gate, moe.experts_up, moe.experts_down))
        out.append(torch.stack([ops.swiglu(m[t], gate[j], up[j], down[j]) for j in range(ids.shape[0])]))  # (k, H)
    return torch.stack(out)  # (T, k, H)


def block_rows(w: MtpWeights, tokens: Tensor, hiddens: Tensor, slots: Tensor, cache: LayerCache, rope: Rope,
               ok: Tensor, fused: Fused) -> tuple[Tensor, Tensor]:
    """``glm_mtp.reference.block.mtp_rows`` on rows pairing ``tokens`` (T,) with ``hiddens``
    (T, H) at ``slots`` (T,); cache writes only where ``ok`` (1,) bool is set.

    Returns ``(x, pre_norm)``, each (T, H): the post-norm output and the layer output."""
    cfg, eps = w.config, w.config.rms_norm_eps
    u = block_input(w, fused.embed(w.embed_tokens, tokens, slots), hiddens, fused.ops)  # (T, H)
    layer = w.layer
    a = rms_norm(u, layer.input_layernorm, eps)
    h = u + attention_rows(layer.attn, cfg, a, slots, cache, rope, ok, fused)
    m = rms_norm(h, layer.post_attention_layernorm, eps)
    if isinstance(layer.mlp, MlpWeights):
        out = h + fused.swiglu(m, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
    else:
        out = h + moe_block(layer.mlp, cfg, m, fused.ops, outputs=gathered_expert_outputs)
    return rms_norm(out, w.shared_head_norm, eps), out
