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

from .attention import KPoolRowsFn, Rope, WriteRowsFn, dsa_attention, write_cache_rows
from .kpool import kpool_rows
from .config import MtpConfig
from .moe import moe_block
from .numerics import PINNED, Numerics, linear
from .sharing import SharedSelection
from .state import LayerCache
from .weights import DecoderLayerWeights, MlpWeights, MoeWeights, MtpWeights

# How a layer's MoE turns its normed input into its output: (weights, config, m (T, H), ops) -> (T, H).
MoeFn = Callable[[MoeWeights, MtpConfig, Tensor, Numerics], Tensor]
# How the block looks up its rows' embeddings: (weights, tokens (T,), slots (T,)) -> (T, H), zero
# in a row at slot 0 (whose token has no predecessor).
EmbedFn = Callable[[MtpWeights, Tensor, Tensor], Tensor]


def decoder_layer(
    layer: DecoderLayerWeights, cfg: MtpConfig, h: Tensor, slots: Tensor, cache: LayerCache, rope: Rope,
    moe: MoeFn = moe_block, rows_read: int | None = None, ops: Numerics = PINNED,
    write_rows: WriteRowsFn = write_cache_rows,
    kpool: KPoolRowsFn = kpool_rows, share: SharedSelection | None = None,
) -> Tensor:
    """One decoder layer (GLM-5's, or GLM-5.3-Flash's with ``cfg.family == "glm5_next"``: the
    same residual structure, its attention and MoE pieces chosen by the config) on new rows ``h``
    (T, H) at ``slots`` (T,); writes their cache rows.

    Args:
        moe: computes the MoE; the default is the reference's ``moe_block``. Training swaps in a
            batched dispatch of the same routing (glm_mtp.experiments.targets.target.grouped_moe).
        rows_read: cache rows the attention reads, ``[0, rows_read)`` (default: the capacity);
            at least ``max(slots) + 1``. No result depends on it.
        ops: the primitives: ``PINNED`` (the drafter) or ``VENDOR`` (training, the target).
        write_rows: how the new rows reach the cache (``attention.WriteRowsFn``).
        kpool: the KPool indexer of a glm5_next layer (``attention.KPoolRowsFn``).
        share: index sharing within a propose (``attention.dsa_attention``; DESIGN.md §9).
    """
    a = ops.rms_norm(h, layer.input_layernorm, cfg.rms_norm_eps)
    h = h + dsa_attention(layer.attn, cfg, a, slots, cache, rope, rows_read, ops, write_rows, kpool, share)
    m = ops.rms_norm(h, layer.post_attention_layernorm, cfg.rms_norm_eps)
    if isinstance(layer.mlp, MlpWeights):
        return h + ops.swiglu(m, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
    return h + moe(layer.mlp, cfg, m, ops)


@dataclass
class BlockOutput:
    """Per row: ``x`` the post-norm output (what the head reads), ``pre_norm`` the layer output."""

    x: Tensor  # (T, H)
    pre_norm: Tensor  # (T, H)


def embed_rows(w: MtpWeights, tokens: Tensor, slots: Tensor) -> Tensor:
    """``embed_tokens[tokens]`` (T, H), zeroed in row 0 (whose token has no predecessor)."""
    return F.embedding(tokens, w.embed_tokens).masked_fill((slots == 0)[:, None], 0.0)


def block_input(w: MtpWeights, e: Tensor, hiddens: Tensor, ops: Numerics = PINNED) -> Tensor:
    """``eh_proj(cat[enorm(e), hnorm(h)])``: embedding first, hidden second (T, 2H) -> (T, H)."""
    eps = w.config.rms_norm_eps
    return ops.linear(torch.cat((ops.rms_norm(e, w.enorm, eps), ops.rms_norm(hiddens, w.hnorm, eps)), dim=-1),
                      w.eh_proj)


@dataclass(frozen=True)
class BlockHooks:
    """The pieces of ``mtp_rows`` a backend may swap; the defaults are the reference's own.
    Every piece must compute the reference's values (bit for bit under ``PINNED``):

    Args:
        ops: the primitives (``numerics.Numerics``): ``PINNED`` (the drafter; the optimized
            drafter passes ``PINNED`` with its GEMV kernel) or ``VENDOR`` (training).
        embed: ``EmbedFn``, the rows' embeddings (default ``embed_rows``).
        write_rows: ``attention.WriteRowsFn``, how new rows reach the cache from their raw
            projections (default ``attention.write_cache_rows``).
        moe: ``MoeFn``, the MoE of a sparse layer (default ``moe.moe_block``).
        kpool: ``attention.KPoolRowsFn``, the KPool indexer of a glm5_next layer, its pool
            writes included (default ``kpool.kpool_rows``).
    """

    ops: Numerics = PINNED
    embed: EmbedFn = embed_rows
    write_rows: WriteRowsFn = write_cache_rows
    moe: MoeFn = moe_block
    kpool: KPoolRowsFn = kpool_rows


REFERENCE_HOOKS = BlockHooks()


def mtp_rows(w: MtpWeights, tokens: Tensor, hiddens: Tensor, slots: Tensor, cache: LayerCache, rope: Rope,
             rows_read: int | None = None, hooks: BlockHooks = REFERENCE_HOOKS,
             share: SharedSelection | None = None) -> BlockOutput:
    """Run the block on rows pairing ``tokens`` (T,) with ``hiddens`` (T, H) at ``slots`` (T,);
    ``rows_read`` and ``share`` (index sharing within a propose, DESIGN.md §9) as in
    ``decoder_layer``; ``hooks`` the swappable pieces (default: the reference's, with the
    pinned numerics)."""
    ops = hooks.ops
    u = block_input(w, hooks.embed(w, tokens, slots), hiddens, ops)
    out = decoder_layer(w.layer, w.config, u, slots, cache, rope, hooks.moe, rows_read, ops, hooks.write_rows,
                        hooks.kpool, share)
    return BlockOutput(x=ops.rms_norm(out, w.shared_head_norm, w.config.rms_norm_eps), pre_norm=out)


def draft_logits(w: MtpWeights, x: Tensor) -> Tensor:
    """``shared_head.head``: the target's ``lm_head`` on the post-norm rows ``x`` (T, H) -> (T, V), in S."""
    return linear(x, w.lm_head)
