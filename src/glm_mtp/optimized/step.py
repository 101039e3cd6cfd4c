"""The MTP block for new rows as fused kernels: the draft step's schedule.

Same math as ``glm_mtp.reference.block.mtp_rows`` (every piece's twin is built from the
reference's own functions and proven byte-equal to its kernel, tests/optimized/kernels/),
cut into the launches a GPU runs for one draft step::

     1  block_input         embedding row (zeroed at slot 0), enorm, hnorm, eh_proj       -> u
     2  norm_linear         input_layernorm; q_a, kv_a, indexer wk, weights_proj           (reads u once;
                            fp8 weights: two launches, the fp8 three and the bf16 weights_proj)
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
                            (and the S logits stored: a step's confidence and a grammar's redo read them)
    15  argmax_reduce       the draft token, on the device

plus the RoPE angles' two gathers. Each weight is read once per step; the attention reads the
index keys of the visible rows and the kv rows of the listed ones, never the whole capacity.

A glm5_next layer (DESIGN.md §7) is the same schedule with its own pieces: the input norm's
launch also computes the KPool gate (5 weights); ``cache_rows_write`` stores the rows as normed
(NoPE: nothing rotated) with their gates; the KPool indexer replaces 6-7 with

     6a pool_keys_write     the key of every pool a new row completes, from its rows' keys and gates
     6b pool_scores         I(t, p) over the row's visible complete pools only
     7  select_pool_rows    its best index_topk / kp pools as rows, then its tail, ascending

``absorbed_query`` and ``sparse_mla`` run without RoPE lanes, and ``experts_gate_up`` clamps the
SwiGLU at ``swiglu_limit``. There are no RoPE angles to gather.

With index sharing (DESIGN.md §9, ``index_share_for_mtp_iteration``), draft step 1 of a propose
runs the schedule above and its selection kernel writes the list into the state's kept buffer
(``state.KeptSelection``; a batch: one line per state); draft steps 2..k are shared steps: the
input norm's launch leaves out the head weights (weights_proj), 3 computes q_b only (no index
wq_b), 6-7 are not launched (GLM-5: index_scores, select_rows; glm5_next: pool_scores,
select_pool_rows; 6a still writes a completed pool's key), and sparse_mla attends the kept list.

``fused_rows`` serves any number of rows T (a draft step: T = 1; a catch-up: its rows), each
computed as if alone. It needs a MoE layer without shards (GLM-5's and GLM-5.3-Flash's MTP
layers); anything else takes the per-primitive path (``glm_mtp.optimized.unfused_block.block_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Protocol, Sequence

from torch import Tensor

from glm_mtp.reference.attention import Rope
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.fp8 import BlockScaledWeight, is_block_scaled
from glm_mtp.reference.state import LayerCache
from glm_mtp.reference.weights import IndexerWeights, MoeWeights, MtpWeights

from . import kernels
from .kernels.paged import RowCaches, RowTargets, row_caches


def fusable(w: MtpWeights) -> bool:
    """Whether ``fused_rows`` runs this layer: a MoE MLP, no shards (a sharded layer runs the
    reference's collectives), storage in a dtype the kernels take."""
    return isinstance(w.layer.mlp, MoeWeights) and w.shard_spec is None and w.dtype in kernels.KERNEL_DTYPES


Caches = LayerCache | RowCaches
Weight = Tensor | BlockScaledWeight


class NormLinear(Protocol):
    """``norm_linear_triton`` / ``norm_linear_torch``: the RMS norm of ``x`` and the linears over
    it, ``acc`` for float32 results, ``store_normed`` for the normed rows too."""

    def __call__(self, x: Tensor, norm_weight: Tensor, eps: float, weights: Sequence[Weight], acc: bool = False,
                 store_normed: bool = False) -> tuple[list[Tensor], Tensor | None]: ...


class CacheRowsWrite(Protocol):
    """``cache_rows_write_triton`` / ``_torch``: the rows' MLA latent and index key (and KPool
    ``gates``) into their caches at ``slots``, where ``ok`` is set."""

    def __call__(self, cfg: MtpConfig, kv: Tensor, k: Tensor, kv_norm_weight: Tensor, k_norm_weight: Tensor,
                 k_norm_bias: Tensor, slots: Tensor, cos_table: Tensor, sin_table: Tensor, caches: Caches, ok: Tensor,
                 gates: Tensor | None = None) -> None: ...


class ExpertsGateUp(Protocol):
    """``experts_gate_up_triton`` / ``_torch``: the chosen and shared experts' SwiGLU hidden,
    clamped at ``limit`` when set."""

    def __call__(self, m: Tensor, experts: Tensor, experts_gate: Weight, experts_up: Weight,
                 shared_gate: Weight | None = None, shared_up: Weight | None = None,
                 limit: float | None = None) -> tuple[Tensor, Tensor | None]: ...


@dataclass(frozen=True)
class StepKernels:
    """Every fused piece of the step, in schedule order: each field is bound to the Triton kernel
    (``triton_kernels``) or to its torch twin, proven byte-equal to it (``torch_twins``); the
    kernels' own signatures are in ``glm_mtp.optimized.kernels``. ``scatter_rows`` is the batched
    programs' last write, each row into its own state's tensors, and ``pools_forget`` a batched
    propose's rewind of glm5_next's pools."""

    triton: bool
    block_input: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, Weight], Tensor]
    norm_linear: NormLinear
    cache_rows_write: CacheRowsWrite
    absorbed_query: Callable[[MtpConfig, Tensor, Weight, Tensor, Tensor], tuple[Tensor, Tensor]]
    index_scores: Callable[[MtpConfig, Tensor, Tensor, Tensor, Tensor, Caches, Tensor], Tensor]
    select_rows: Callable[[Tensor, Tensor, int, tuple[Tensor, Tensor] | None], tuple[Tensor, Tensor]]
    pool_keys_write: Callable[[MtpConfig, IndexerWeights, Tensor, Caches, Tensor], None]
    pool_scores: Callable[[MtpConfig, Tensor, Tensor, Caches, Tensor], Tensor]
    select_pool_rows: Callable[[MtpConfig, Tensor, Tensor, tuple[Tensor, Tensor] | None], tuple[Tensor, Tensor]]
    sparse_mla: Callable[[MtpConfig, Tensor, Tensor, Caches, Tensor, Tensor, Weight], Tensor]
    linear_residual: Callable[[Tensor, Weight, Tensor], Tensor]
    route: Callable[[MtpConfig, Tensor, Tensor], tuple[Tensor, Tensor]]
    experts_gate_up: ExpertsGateUp
    experts_down_combine: Callable[[Tensor, Tensor | None, Tensor, Tensor, Weight, Weight | None, Tensor], Tensor]
    head_partials: Callable[[Tensor, Tensor, float, Tensor, Tensor | None, Tensor | None],
                            tuple[Tensor, Tensor, Tensor]]
    argmax_reduce: Callable[[Tensor, Tensor], Tensor]
    scatter_rows: Callable[[Tensor, RowTargets, Tensor], None]
    pools_forget: Callable[[MtpConfig, Tensor, Caches, Tensor], None]


# The fused pieces, in schedule order (the fields of ``StepKernels``).
PIECES = tuple(f.name for f in fields(StepKernels) if f.name != "triton")


def kernels_named(suffix: str) -> StepKernels:
    """Every piece of ``PIECES`` bound to ``kernels.<piece><suffix>`` (``_triton`` the Triton
    kernel, ``_torch`` its twin). Read from ``kernels`` when called, so a drafter built after a
    test wraps a kernel calls the wrapper."""
    return StepKernels(triton=suffix == "_triton", **{piece: getattr(kernels, piece + suffix) for piece in PIECES})


def triton_kernels() -> StepKernels:
    """The step's Triton kernels (``kernels.<piece>_triton``)."""
    return kernels_named("_triton")


def torch_twins() -> StepKernels:
    """The step's torch twins (``kernels.<piece>_torch``), each byte-equal to its kernel
    (tests/optimized/kernels/)."""
    return kernels_named("_torch")


def step_kernels(triton: bool) -> StepKernels:
    """``triton_kernels()`` or ``torch_twins()``."""
    return triton_kernels() if triton else torch_twins()


def fused_rows(w: MtpWeights, tokens: Tensor, hiddens: Tensor, slots: Tensor, caches: LayerCache | RowCaches,
               rope: Rope, ok: Tensor, kernel_set: StepKernels, kept: tuple[Tensor, Tensor] | None = None,
               index_shared: bool = False) -> Tensor:
    """The block (launches 1-13) on rows pairing ``tokens`` (T,) with ``hiddens`` (T, H) at
    ``slots`` (T,), all on the device; cache rows are written only where ``ok`` (1,) bool is set.
    ``caches``: the paged cache of every row (a ``LayerCache``), or row t's in line t of a
    ``RowCaches`` (a batch of sequences; a capturable caller passes a ``RowCaches`` made once, as
    a lone ``LayerCache`` becomes a one-line address table by a host-to-device copy).
    ``kernel_set``: the step's kernels (``triton_kernels()`` or ``torch_twins()``).
    ``kept`` and ``index_shared``: index sharing across a propose's draft steps (DESIGN.md §9), one
    row per state. Without ``index_shared``, the selection is written into ``kept`` ((T, K) rows, (T,)
    counts: ``KeptSelection.lines``) when given: draft step 1. An index-shared step runs none of the
    indexer's query side (no index ``wq_b`` or head weights, no scores, no selection) and attends
    the rows ``kept`` holds; it writes every cache entry of its rows all the same (latent, index
    key, KPool gate and the key of a pool it completes).
    Returns the layer output ``pre_norm`` (T, H)."""
    if index_shared and kept is None:
        raise ValueError("kept: an index-shared draft step attends draft step 1's kept selection, got None")
    cfg, eps = w.config, w.config.rms_norm_eps
    layer = w.layer
    attn, moe = layer.attn, layer.mlp
    ix = attn.indexer
    assert isinstance(moe, MoeWeights)
    rc = row_caches(caches)  # one address table for the call's cache kernels

    u = kernel_set.block_input(w.embed_tokens, tokens, slots, hiddens, w.enorm, w.hnorm, eps, w.eh_proj)  # (T, H)
    # The index key (wk) is written at every step; the head weights (weights_proj) and the index
    # query (the indexer's wq_b) are the query side, which an index-shared step does not run.
    query_side = not index_shared
    row_weights = [attn.q_a_proj, attn.kv_a_proj_with_mqa, ix.wk] + ([ix.weights_proj] if query_side else [])
    if cfg.is_next:  # the KPool gate reads the same normed row
        row_weights.append(ix.kpool_gate)
    q_a, kv, k_raw, *rest = norm_linear_by_format(kernel_set, u, layer.input_layernorm, eps, row_weights)
    w_raw, gates = (rest[0], rest[1:]) if query_side else (None, rest)
    latent_weights = [attn.q_b_proj, ix.wq_b] if query_side else [attn.q_b_proj]
    (q, *q_index), _ = kernel_set.norm_linear(q_a, attn.q_a_layernorm, cfg.latent_norm_eps, latent_weights)
    kernel_set.cache_rows_write(cfg, kv, k_raw, attn.kv_a_layernorm, ix.k_norm_weight, ix.k_norm_bias, slots, rope.cos,
                                rope.sin, rc, ok, gates=gates[0] if gates else None)

    # Attention over the rows the indexer lists: this call's rows are in the cache already.
    if cfg.is_next:  # NoPE: no angles; the KPool indexer lists whole pools and the tail
        no_angles = rope.cos[:1].expand(slots.shape[0], 0)  # (T, 0): a view, nothing gathered
        # (T, nh, Lkv) A, (T, nh, 0)
        q_abs, q_pe = kernel_set.absorbed_query(cfg, q, attn.kv_b_proj, no_angles, no_angles)
        kernel_set.pool_keys_write(cfg, ix, slots, rc, ok)
        if query_side:
            scores = kernel_set.pool_scores(cfg, q_index[0], w_raw, rc, slots)  # (T, P) A, at the visible pools
            rows, count = kernel_set.select_pool_rows(cfg, scores, slots, kept)  # (T, Kp * kp + kp - 1), (T,)
    else:
        cos, sin = rope.at(slots)  # (T, R/2)
        q_abs, q_pe = kernel_set.absorbed_query(cfg, q, attn.kv_b_proj, cos, sin)  # (T, nh, Lkv) A, (T, nh, R)
        if query_side:
            scores = kernel_set.index_scores(cfg, q_index[0], w_raw, cos, sin, rc, slots)  # (T, C) A
            rows, count = kernel_set.select_rows(scores, slots, cfg.index_topk, kept)  # (T, K), (T,)
    if not query_side:  # an index-shared step: draft step 1's rows, its own row not among them
        rows, count = kept
    heads = kernel_set.sparse_mla(cfg, q_abs, q_pe, rc, rows, count, attn.kv_b_proj)  # (T, nh*v)
    h = kernel_set.linear_residual(heads, attn.o_proj, u)  # (T, H)

    # MoE.
    (logits,), m = kernel_set.norm_linear(h, layer.post_attention_layernorm, eps, [moe.router], acc=True,
                                          store_normed=True)
    experts, weights = kernel_set.route(cfg, logits, moe.e_score_correction_bias)  # (T, k), (T, k)
    expert = moe.shared  # the shared expert
    hidden, shared_hidden = kernel_set.experts_gate_up(m, experts, moe.experts_gate, moe.experts_up,
                                                       expert.gate_proj if expert else None,
                                                       expert.up_proj if expert else None,
                                                       limit=moe.swiglu_limit)  # clamped in glm5_next
    return kernel_set.experts_down_combine(hidden, shared_hidden, experts, weights, moe.experts_down,
                                           expert.down_proj if expert else None, h)  # (T, H)


def norm_linear_by_format(kernel_set: StepKernels, x: Tensor, norm_weight: Tensor, eps: float,
                          weights: list[Tensor | BlockScaledWeight]) -> list[Tensor]:
    """``kernel_set.norm_linear`` of ``x`` over ``weights``, one launch per weight format: block-scaled
    fp8 weights beside a plain one (the input norm's q_a, kv_a, wk with the indexer's weights_proj,
    which DESIGN.md §8 keeps bf16) take two launches, one for each; else one."""
    fp8 = [is_block_scaled(w) for w in weights]
    if len(set(fp8)) == 1 or not kernel_set.triton:  # the torch twin takes any mix in one call
        return kernel_set.norm_linear(x, norm_weight, eps, weights)[0]
    outs: list[Tensor] = [x] * len(weights)
    for fmt in (True, False):
        idx = [i for i, f in enumerate(fp8) if f == fmt]
        for i, y in zip(idx, kernel_set.norm_linear(x, norm_weight, eps, [weights[i] for i in idx])[0]):
            outs[i] = y
    return outs


def fused_head(w: MtpWeights, pre_norm: Tensor, kernel_set: StepKernels, x_out: Tensor | None = None,
               logits_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The shared head on the layer outputs ``pre_norm`` (T, H) (launches 14-15): the post-norm
    rows ``x`` (T, H) and the drafts (T,) int64, the argmax of ``lm_head(x)``, which each
    vocabulary slice reduces to its own best. ``x_out`` (T, H): where ``x`` is stored;
    ``logits_out`` (T, V) S: where the head's launch also stores the logits (what the step's
    confidence and a grammar's redo read, DESIGN.md §10, §12); no launch is added for either."""
    x, part_val, part_idx = kernel_set.head_partials(pre_norm, w.shared_head_norm, w.config.rms_norm_eps, w.lm_head,
                                                     x_out, logits_out)
    return x, kernel_set.argmax_reduce(part_val, part_idx)
