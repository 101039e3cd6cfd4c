"""The MTP block, row by row (DESIGN.md §2):

    e      = embed_tokens[token]            (zeroed in row 0)
    u      = eh_proj(cat[enorm(e), hnorm(h)])            embedding first, hidden second
    out    = decoder_layer(u)               DSA attention + MoE, each with a residual
    x      = shared_head.norm(out)          fed to the next draft (post_norm)
    logits = lm_head(x)                     the draft is the argmax
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import Rope, dsa_attention
from .config import MtpConfig
from .layers import rms_norm, swiglu
from .moe import moe_block
from .state import LayerCache
from .weights import DecoderLayerWeights, MlpWeights, MoeWeights, MtpWeights

# How a layer's MoE turns its normed input into its output: (weights, config, m (T, H)) -> (T, H).
MoeFn = Callable[[MoeWeights, MtpConfig, Tensor], Tensor]


def decoder_layer(
    layer: DecoderLayerWeights, cfg: MtpConfig, h: Tensor, slots: Tensor, cache: LayerCache, rope: Rope, moe: MoeFn = moe_block
) -> Tensor:
    """One GLM-5 decoder layer on new rows ``h`` (T, H) at ``slots`` (T,); writes their cache rows.

    ``moe`` computes the MoE; the default is the reference's ``moe_block``. Training swaps in a
    batched dispatch of the same routing (glm_mtp.experiments.target.grouped_moe), since the
    reference runs each row's experts on that row alone.
    """
    a = rms_norm(h, layer.input_layernorm, cfg.rms_norm_eps)
    h = h + dsa_attention(layer.attn, cfg, a, slots, cache, rope)
    m = rms_norm(h, layer.post_attention_layernorm, cfg.rms_norm_eps)
    if isinstance(layer.mlp, MlpWeights):
        return h + swiglu(m, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
    return h + moe(layer.mlp, cfg, m)


@dataclass
class BlockOutput:
    """Per row: ``x`` the post-norm output (what the head reads), ``pre_norm`` the layer output."""

    x: Tensor  # (T, H)
    pre_norm: Tensor  # (T, H)


def mtp_rows(w: MtpWeights, tokens: Tensor, hiddens: Tensor, slots: Tensor, cache: LayerCache, rope: Rope) -> BlockOutput:
    """Run the block on rows pairing ``tokens`` (T,) with ``hiddens`` (T, H) at ``slots`` (T,)."""
    cfg = w.config
    e = F.embedding(tokens, w.embed_tokens)  # (T, H)
    e = e.masked_fill((slots == 0)[:, None], 0.0)
    u = F.linear(torch.cat((rms_norm(e, w.enorm, cfg.rms_norm_eps), rms_norm(hiddens, w.hnorm, cfg.rms_norm_eps)), dim=-1), w.eh_proj)
    out = decoder_layer(w.layer, cfg, u, slots, cache, rope)
    return BlockOutput(x=rms_norm(out, w.shared_head_norm, cfg.rms_norm_eps), pre_norm=out)


def draft_logits(w: MtpWeights, x: Tensor) -> Tensor:
    """``shared_head.head``: the target's ``lm_head`` on the post-norm rows ``x`` (T, H) -> (T, V)."""
    return F.linear(x, w.lm_head)
