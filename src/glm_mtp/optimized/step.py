"""The MTP block for new rows as fused kernels: the draft step's schedule.

Same math as ``glm_mtp.reference.block.mtp_rows`` (every piece's twin is built from the
reference's own functions and proven byte-equal to its kernel, tests/optimized/test_kernels_*),
cut into the launches a GPU runs for one draft step::

     1  block_input         embedding row (zeroed at slot 0), enorm, hnorm, eh_proj       -> u
     2  norm_linear         input_layernorm; q_a, kv_a, indexer wk, weights_proj           (reads u once)
     3  norm_linear         q_a_layernorm; q_b, indexer wq_b
     4  cache_rows_write    kv_a_layernorm, RoPE of k_pe; indexer k_norm + RoPE; paged write (gated by ok)
     5  absorbed_query      RoPE of q_pe; q_nope absorbed through kv_b's key half
     6  index_scores        RoPE of the index query; I(t, s) over the visible rows only
     7  select_rows         the index_topk best visible rows, ascending
     8  sparse_mla          scores, list softmax, latent sum over the list, kv_b's value half
     9  linear_residual     o_proj + the attention residual                                 -> h
    10  norm_linear         post_attention_layernorm; router                                -> m, logits
    11  route               sigmoid, bias, group limit, top-k, normalisation
    12  experts_gate_up     the chosen experts' and the shared expert's gate/up + SwiGLU
    13  experts_down_combine   their down projections, the weighted combine, the MoE residual -> out
    14  head_partials       shared_head norm; lm_head over the vocabulary in slices, each's argmax -> x
    15  argmax_reduce       the draft token, on the device

plus the RoPE angles' two gathers. Each weight is read once per step; the attention reads the
index keys of the visible rows and the kv rows of the listed ones, never the whole capacity.

``fused_rows`` serves any number of rows T (a draft step: T = 1; a catch-up: its rows), each
computed as if alone. It needs a MoE layer without shards (GLM-5's MTP layer); anything else
takes the per-primitive path (``glm_mtp.optimized.block.block_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor

from glm_mtp.reference.attention import LATENT_NORM_EPS, Rope
from glm_mtp.reference.state import LayerCache
from glm_mtp.reference.weights import MoeWeights, MtpWeights

from . import kernels
from .kernels.paged import RowCaches, row_caches

# The fused pieces, in schedule order: each is ``kernels.<name>_triton`` or its twin ``_torch``.
PIECES = (
    "block_input", "norm_linear", "cache_rows_write", "absorbed_query", "index_scores", "select_rows",
    "sparse_mla", "linear_residual", "route", "experts_gate_up", "experts_down_combine", "head_partials",
    "argmax_reduce",
    "scatter_rows",  # the batched programs' last write: each row into its own state's tensors
)


def fusable(w: MtpWeights) -> bool:
    """Whether ``fused_rows`` runs this layer: a MoE MLP, no shards (a sharded layer runs the
    reference's collectives), storage in a dtype the kernels take."""
    return (isinstance(w.layer.mlp, MoeWeights) and w.shard_spec is None
            and w.dtype in kernels.KERNEL_DTYPES and not w.config.is_next)


@dataclass(frozen=True)
class StepKernels:
    """Every fused piece of the step, each the Triton kernel (``triton=True``) or its twin."""

    triton: bool

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in PIECES:
            raise AttributeError(name)
        return getattr(kernels, f"{name}_{'triton' if self.triton else 'torch'}")


def fused_rows(w: MtpWeights, tokens: Tensor, hiddens: Tensor, slots: Tensor, caches: LayerCache | RowCaches,
               rope: Rope, ok: Tensor, k: StepKernels) -> Tensor:
    """The block (launches 1-13) on rows pairing ``tokens`` (T,) with ``hiddens`` (T, H) at
    ``slots`` (T,), all on the device; cache rows are written only where ``ok`` (1,) bool is set.
    ``caches``: the paged cache of every row (a ``LayerCache``), or row t's in line t of a
    ``RowCaches`` (a batch of sequences; a capturable caller passes a ``RowCaches`` made once, as
    a lone ``LayerCache`` becomes a one-line address table by a host-to-device copy).
    Returns the layer output ``pre_norm`` (T, H)."""
    cfg, eps = w.config, w.config.rms_norm_eps
    layer = w.layer
    attn, moe = layer.attn, layer.mlp
    ix = attn.indexer
    assert isinstance(moe, MoeWeights)
    rc = row_caches(caches)  # one address table for the call's cache kernels

    u = k.block_input(w.embed_tokens, tokens, slots, hiddens, w.enorm, w.hnorm, eps, w.eh_proj)  # (T, H)
    (q_a, kv, k_raw, w_raw), _ = k.norm_linear(
        u, layer.input_layernorm, eps, [attn.q_a_proj, attn.kv_a_proj_with_mqa, ix.wk, ix.weights_proj])
    (q, q_idx), _ = k.norm_linear(q_a, attn.q_a_layernorm, LATENT_NORM_EPS, [attn.q_b_proj, ix.wq_b])
    k.cache_rows_write(cfg, kv, k_raw, attn.kv_a_layernorm, ix.k_norm_weight, ix.k_norm_bias, slots, rope.cos,
                       rope.sin, rc, ok)

    # Attention over the rows the indexer lists: this call's rows are in the cache already.
    cos, sin = rope.at(slots)  # (T, R/2)
    q_abs, q_pe = k.absorbed_query(cfg, q, attn.kv_b_proj, cos, sin)  # (T, nh, Lkv) A, (T, nh, R)
    scores = k.index_scores(cfg, q_idx, w_raw, cos, sin, rc, slots)  # (T, C) A
    rows, count = k.select_rows(scores, slots, cfg.index_topk)  # (T, K), (T,)
    heads = k.sparse_mla(cfg, q_abs, q_pe, rc, rows, count, attn.kv_b_proj)  # (T, nh*v)
    h = k.linear_residual(heads, attn.o_proj, u)  # (T, H)

    # MoE.
    (logits,), m = k.norm_linear(h, layer.post_attention_layernorm, eps, [moe.router], acc=True, store_normed=True)
    experts, weights = k.route(cfg, logits, moe.e_score_correction_bias)  # (T, k), (T, k)
    shared = moe.shared
    hidden, shared_hidden = k.experts_gate_up(m, experts, moe.experts_gate, moe.experts_up,
                                              shared.gate_proj if shared else None, shared.up_proj if shared else None)
    return k.experts_down_combine(hidden, shared_hidden, experts, weights, moe.experts_down,
                                  shared.down_proj if shared else None, h)  # (T, H)


def fused_head(w: MtpWeights, pre_norm: Tensor, k: StepKernels) -> tuple[Tensor, Tensor]:
    """The shared head on the layer outputs ``pre_norm`` (T, H) (launches 14-15): the post-norm
    rows ``x`` (T, H) and the drafts (T,) int64, the argmax of ``lm_head(x)``, which is never
    materialised whole (each vocabulary slice keeps its own best)."""
    x, part_val, part_idx = k.head_partials(pre_norm, w.shared_head_norm, w.config.rms_norm_eps, w.lm_head)
    return x, k.argmax_reduce(part_val, part_idx)
