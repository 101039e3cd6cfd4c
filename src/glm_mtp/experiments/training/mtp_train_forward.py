"""The drafter's own forward over one trace item, unrolled to depth d with shared weights and
differentiable (DESIGN.md §13): what fine-tuning trains, and, with ``ops=PINNED`` and gradients
off, the reference drafter's teacher-forced logits bit for bit.

An item is tokens ``t_0 .. t_{L-1}`` with the target's post-norm hiddens ``h_0 .. h_{L-1}``. Row r
of the dense row space pairs ``t_{r+1}`` with ``h_r`` at slot r (RoPE position = slot), as the
drafter's prefill writes it. A *proposal* at row p is what the drafter's ``propose`` at position p
computes after a fresh prefill of rows ``[0, p)``:

- depth 1 writes row p from ``(t_{p+1}, h_p)``: exactly context row p, so depth 1 for every p is
  one pass over rows ``[0, R)`` (R = L - 1; each row attends the rows its indexer selects among
  ``[0, r]``);
- depth d > 1 writes row ``p + d - 1`` from ``(tok_d[p], feed_{d-1}[p])``: the token (training: the
  text's ``t_{p+d}``; the equality test: the drafter's own draft) and the previous depth's output
  at that proposal (``x``, or the pre-norm output when ``feed_hidden == "pre_norm"``). It attends
  what the drafter's step d attends: under index sharing (DESIGN.md §9) exactly depth 1's
  selection of row p, all of it context rows, so every proposal's depth d is one batched pass
  over the context cache; without sharing, the proposal's own rows ``[0, p + d - 1]`` (the
  context rows ``[0, p]`` and its earlier depths), so each proposal runs on its own copy of the
  context cache rewound to ``p + 1`` rows (``state.rewind_rows``' rule for KPool pools).

Numerics: ``ops=PINNED`` (with the reference's MoE) is the drafter's pinned order, and a row's
value does not depend on the rows computed beside it, so the logits are the reference
drafter's bytes (tests/experiments/training/test_mtp_train_forward.py). Training runs ``ops=VENDOR``
(torch's kernels, autograd; dense masked MLA over the same selection, ``grouped_moe``): the same
math, rounded in another order, so its logits differ from the pinned ones by rounding only (the
test bounds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from glm_mtp.reference.attention import (KPoolRowsFn, Rope, dense_mla, latent_query, output_projection,
                                         row_projections, sparse_mla, write_cache_rows)
from glm_mtp.reference.block import MoeFn, block_input, embed_rows
from glm_mtp.reference.indexer import index_queries, index_scores, select_rows, selection_mask
from glm_mtp.reference.kpool import kpool_rows
from glm_mtp.reference.moe import moe_block
from glm_mtp.reference.numerics import PINNED, VENDOR, Numerics
from glm_mtp.reference.state import LayerCache, num_blocks
from glm_mtp.reference.weights import MlpWeights, MtpWeights

# A depth's tokens for each proposal p: (depth d, proposals P) -> (P,) int64. Training's is the
# text's ``t_{p+d}`` (``text_tokens``).
ChainTokens = Callable[[int, int], Tensor]


@dataclass
class DepthOutput:
    """One depth's rows, one per proposal ``p = 0 .. P-1``: ``x`` (P, H) the post-norm output,
    ``pre_norm`` (P, H), ``logits`` (P, V)."""

    x: Tensor
    pre_norm: Tensor
    logits: Tensor


def text_tokens(tokens: Tensor) -> ChainTokens:
    """Teacher forcing by the text: depth d's token at proposal p is ``tokens[p + d]``."""
    return lambda d, P: tokens[d : d + P]


def _attend(w: MtpWeights, a: Tensor, slots: Tensor, cache: LayerCache, rope: Rope, rows_read: int, ops: Numerics,
            kpool: KPoolRowsFn, kept: tuple[Tensor, Tensor] | None, write: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``attention.dsa_attention`` for rows ``a`` (T, H) at ``slots`` (T,) that also returns the
    selection ``(rows (T, K), count (T,))``, and attends ``kept`` instead of selecting when given
    (a shared step; one list per row). ``write``: store the rows' cache entries (a shared step's
    batched rows are written nowhere: under sharing nothing reads them)."""
    attn, cfg = w.layer.attn, w.config
    cos, sin = rope.at(slots)
    q_latent, q_nope, q_pe = latent_query(attn, cfg, a, cos, sin, ops)
    if write:
        kv, k = row_projections(attn, a, ops)
        write_cache_rows(attn, cfg, kv, k, slots, rope, cache, ops)
    if kept is not None:
        rows, count = kept
    elif cfg.is_next:
        rows, count = kpool(attn.indexer, cfg, a, q_latent, slots, cache, ops)
    else:
        q_idx, w_idx = index_queries(attn.indexer, cfg, a, q_latent, cos, sin, ops)
        rows, count = select_rows(index_scores(q_idx, w_idx, cache.index_rows(rows_read), ops), slots, cfg.index_topk)
    if ops.pinned:
        out = sparse_mla(attn, cfg, q_nope, q_pe, cache.kv_rows(rows_read), rows, count)
    else:
        out = dense_mla(attn, cfg, q_nope, q_pe, cache.kv_rows(rows_read), selection_mask(rows, count, rows_read))
    return output_projection(attn, cfg, out, ops), rows, count


def _rows(w: MtpWeights, tokens: Tensor, hiddens: Tensor, slots: Tensor, cache: LayerCache, rope: Rope,
          rows_read: int, ops: Numerics, moe: MoeFn, kpool: KPoolRowsFn,
          kept: tuple[Tensor, Tensor] | None = None, write: bool = True) -> tuple[DepthOutput, Tensor, Tensor]:
    """``block.mtp_rows`` (and ``block.decoder_layer``) with ``_attend``'s attention, plus the
    head: the rows' output and their selection."""
    cfg, layer = w.config, w.layer
    u = block_input(w, embed_rows(w, tokens, slots), hiddens, ops)
    a = ops.rms_norm(u, layer.input_layernorm, cfg.rms_norm_eps)
    att, rows, count = _attend(w, a, slots, cache, rope, rows_read, ops, kpool, kept, write)
    h = u + att
    m = ops.rms_norm(h, layer.post_attention_layernorm, cfg.rms_norm_eps)
    if isinstance(layer.mlp, MlpWeights):
        out = h + ops.swiglu(m, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
    else:
        out = h + moe(layer.mlp, cfg, m, ops)
    x = ops.rms_norm(out, w.shared_head_norm, cfg.rms_norm_eps)
    return DepthOutput(x, out, ops.linear(x, w.lm_head)), rows, count


def _copy_cache(cache: LayerCache, rows: int) -> LayerCache:
    """A copy of ``cache`` holding rows ``[0, rows)`` (later rows unreachable, their KPool pools
    incomplete: ``state.rewind_rows``' rule), differentiable (clones)."""
    kp = cache.kpool
    new = LayerCache(cache.kv_pool.clone(), cache.index_pool.clone(), cache.block_table,
                     None if kp is None else type(kp)(kp.gates.clone(), kp.keys.clone(), kp.complete.clone(), kp.kpool))
    if new.kpool is not None:
        new.kpool.forget_from(rows)
    return new


def drafter_forward(w: MtpWeights, tokens: Tensor, hiddens: Tensor, depth: int, ops: Numerics = VENDOR,
                    moe: MoeFn | None = None, kpool: KPoolRowsFn = kpool_rows, feed_hidden: str = "post_norm",
                    chain: ChainTokens | None = None) -> list[DepthOutput]:
    """The drafter's teacher-forced rows of one item, depths ``1 .. depth`` (module docstring).

    Args:
        w: the drafter's weights (trainable leaves for training).
        tokens: (L,) int64, the item's tokens; hiddens: (L, H) the target's hiddens (``w``'s dtype).
        depth: d >= 1, the unrolled depth (shared weights).
        ops: ``VENDOR`` (training, autograd) or ``PINNED`` (the drafter's bytes).
        moe: the MoE (default: ``moe_block`` under ``PINNED``, else ``targets.target.grouped_moe``).
        kpool: the KPool indexer of a glm5_next layer.
        feed_hidden: what depth d > 1 consumes: ``post_norm`` (``x``) or ``pre_norm``.
        chain: depth d > 1's tokens per proposal (default: the text's, ``text_tokens``).
    Returns one ``DepthOutput`` per depth; depth d holds proposals ``p = 0 .. L - 1 - d`` (those
    whose depth-d row pairs a token of the item: ``t_{p+d}``, ``p + d <= L - 1``).
    """
    if moe is None:
        if ops.pinned:
            moe = moe_block
        else:
            from ..targets.target import grouped_moe
            moe = grouped_moe
    chain = chain or text_tokens(tokens)
    L, cfg = tokens.shape[0], w.config
    if not 1 <= depth <= L - 1:
        raise ValueError(f"depth must be in [1, L - 1 = {L - 1}] for an item of {L} tokens, got {depth}")
    R = L - 1
    cache = LayerCache.allocate(cfg, num_blocks(L + depth), hiddens.dtype, hiddens.device)
    rope = Rope.build(cfg, cache.capacity, hiddens.device, hiddens.dtype)
    slots = torch.arange(R, device=hiddens.device)
    first, sel_rows, sel_count = _rows(w, tokens[1:L], hiddens[:R], slots, cache, rope, R, ops, moe, kpool)
    outs = [first]
    if depth == 1:
        return outs
    if cfg.index_share_for_mtp_iteration:  # every depth attends depth 1's selection: batched
        for d in range(2, depth + 1):
            P = L - d
            prev = outs[-1]
            feed = (prev.x if feed_hidden == "post_norm" else prev.pre_norm)[:P]
            kept = (sel_rows[:P], sel_count[:P])
            out, _, _ = _rows(w, chain(d, P), feed, slots[:P] + (d - 1), cache, rope, R, ops, moe, kpool, kept,
                              write=False)
            outs.append(out)
        return outs
    # No sharing: each proposal attends its own rows; one cache copy per proposal, rewound.
    per_depth: list[list[DepthOutput]] = [[] for _ in range(depth - 1)]
    toks = {d: chain(d, L - d) for d in range(2, depth + 1)}
    for p in range(L - 2):
        own = _copy_cache(cache, p + 1)
        feed_x, feed_pre = first.x[p : p + 1], first.pre_norm[p : p + 1]
        for d in range(2, min(depth, L - 1 - p) + 1):
            slot = torch.tensor([p + d - 1], device=hiddens.device)
            out, _, _ = _rows(w, toks[d][p : p + 1], feed_x if feed_hidden == "post_norm" else feed_pre, slot, own,
                              rope, p + d, ops, moe, kpool)
            per_depth[d - 2].append(out)
            feed_x, feed_pre = out.x, out.pre_norm
    for rows in per_depth:
        outs.append(DepthOutput(*(torch.cat([getattr(o, f) for o in rows]) for f in ("x", "pre_norm", "logits"))))
    return outs


__all__ = ["DepthOutput", "drafter_forward", "text_tokens", "PINNED", "VENDOR"]
