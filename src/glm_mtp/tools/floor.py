"""The byte model: the bytes one draft step must read, at the least.

The launch counters (``glm_mtp.tools.counters``) compare the bytes a draft step's launches move
with it, the benchmark (``glm_mtp.experiments.bench``) turns it into a time at the device's copy
bandwidth, and the speedup model (``glm_mtp.experiments.speedup``) counts GLM-5's draft step in
parameters from it. It needs only a config, so GLM-5's floor is known without its weights.
"""

from __future__ import annotations

import torch

from glm_mtp.reference.config import MtpConfig


def floor_bytes_per_draft(cfg: MtpConfig, dtype: torch.dtype, visible_rows: int) -> int:
    """Bytes one draft step of a drafter with ``cfg`` and weights in ``dtype`` must read, at
    ``visible_rows`` rows visible to it (its own included):

    - every weight of the MTP layer it multiplies or scales by: ``enorm``, ``hnorm``,
      ``eh_proj``; the input and post-attention norms; attention ``q_a_proj``,
      ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
      ``o_proj``; the indexer's ``wq_b``, ``wk``, ``k_norm`` weight and bias, ``weights_proj``;
      the router and its score-correction bias (float32: 4 bytes an expert whatever ``dtype``);
      the ``num_experts_per_tok`` chosen routed experts' gate/up/down (the others are not read);
      the shared experts; ``shared_head.norm``;
    - one embedding row and the whole ``lm_head``;
    - the attended rows: the indexer keys of the ``visible_rows`` visible rows and the MLA rows
      of the ``min(index_topk, visible_rows)`` rows the indexer lists, in the cache's dtype
      (the weights' dtype).

    The step's stores (its new cache rows, a hidden, a token) are a few hundred bytes and not
    part of the floor.
    """
    H, nh, Lq, Lkv, R = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    D, I = cfg.index_head_dim, cfg.moe_intermediate_size
    params = (
        H  # one embedding row
        + 3 * H + 2 * H * H  # enorm, hnorm, shared_head.norm; eh_proj
        + 2 * H  # input / post-attention norms
        + Lq * H + Lq + nh * cfg.qk_head_dim * Lq  # q_a_proj, q_a_layernorm, q_b_proj
        + (Lkv + R) * H + Lkv + nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) * Lkv  # kv_a, norm, kv_b
        + H * nh * cfg.v_head_dim  # o_proj
        + cfg.index_n_heads * D * Lq + D * H + 2 * D + cfg.index_n_heads * H  # indexer
        + cfg.n_routed_experts * H  # router
        + cfg.num_experts_per_tok * 3 * I * H  # the chosen experts
        + cfg.n_shared_experts * 3 * I * H  # the shared experts
        + cfg.vocab_size * H  # the head
    )
    rows = visible_rows * D + min(visible_rows, cfg.index_topk) * (Lkv + R)
    return (params + rows) * torch.empty(0, dtype=dtype).element_size() + cfg.n_routed_experts * 4  # + the fp32 bias
