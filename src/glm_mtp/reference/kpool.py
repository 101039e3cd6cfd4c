"""The KPool indexer of GLM-5.3-Flash's DSA attention (DESIGN.md §7): rows are selected as whole
pools of ``index_kpool`` consecutive rows, scored through one pooled key per pool, plus the row's
own incomplete pool (the tail).

Pool p is rows ``[kp * p, kp * (p + 1))`` of the dense row space (kp = ``index_kpool``; pools
start at row 0). Every row s stores its index key ``k_s = k_norm(wk(a_s))`` (no RoPE) and its
gate ``g_s = linear(a_s, index_kpool_compress_gate)`` (S). A pool is complete once its kp rows
are held; its pooled key is computed once, when its last row is written, and kept:

    l[j, c]  = up(g[kp p + j, c]) + up(ape[j, c])                      (A, ape: (kp, D))
    pk[p, c] = round_S(psum_j(softmax_j(l[:, c])[j] * up(k[kp p + j, c])))

A rewind that cuts into a complete pool makes it incomplete again (``KPoolCache.forget_from``);
its key is recomputed when its last row is written again, and never read before. Row t scores the
complete pools whose last row is ``<= t``,

    I(t, p) = psum_h(w[t, h] * relu(dot(q[t, h], pk[p]) * D^-1/2)),   w = up(weights_proj(a)) * Hi^-1/2

keeps the best ``min(index_topk / kp, count)`` (ties to the lower pool id), and attends to their
rows and its tail ``[kp * floor((t + 1) / kp), t]`` (empty when t completes its pool), in
ascending slot order.

Training and the experiments' target run the same pieces with torch's kernels (``ops=VENDOR``:
``pooled_keys_vendor``, ``pool_scores_vendor``; differentiable, not pinned), and
``kpool_all_rows`` is the dense ablation: the same pool writes, every visible row listed.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from .config import MtpConfig
from .layers import topk_indices
from .numerics import PINNED, Numerics, acc_dtype, linear_acc, psum, softmax, up
from .state import KPoolCache, LayerCache
from .weights import IndexerWeights

# The KPool cache is the state's (``state.KPoolCache``, below this module); the functions here
# read and write it, and ``KPoolCache`` stays importable from here.


def pooled_keys(ix: IndexerWeights, keys: Tensor, gates: Tensor) -> Tensor:
    """The pooled keys of complete pools from their rows' index keys and gates, each
    ``(P, kp, D)`` in S: ``(P, D)`` in S (the module docstring's formula)."""
    assert ix.kpool_ape is not None, "a KPool layer (glm5_next) has kpool_ape"
    logits = up(gates) + up(ix.kpool_ape)[None]  # (P, kp, D), A
    p = softmax(rearrange(logits, "p j c -> p c j"))  # (P, D, kp): over the pool's positions
    return psum(p * rearrange(up(keys), "p j c -> p c j")).to(keys.dtype)  # (P, D)


def pooled_keys_vendor(ix: IndexerWeights, keys: Tensor, gates: Tensor) -> Tensor:
    """``pooled_keys`` with torch's kernels (differentiable; training and the target):
    ``(P, kp, D)`` keys and gates -> ``(P, D)`` in S."""
    A = acc_dtype(keys.dtype)
    assert ix.kpool_ape is not None, "a KPool layer (glm5_next) has kpool_ape"
    p = torch.softmax(gates.to(A) + ix.kpool_ape.to(A)[None], dim=1)  # (P, kp, D): over the pool's positions
    return (p * keys.to(A)).sum(1).to(keys.dtype)


def complete_pools(slots: Tensor, kpool: int) -> Tensor:
    """The pools the rows at ``slots`` complete (a slot that is a pool's last row), ascending."""
    last = slots[(slots + 1) % kpool == 0]
    return (last // kpool).sort().values


def kpool_gates(ix: IndexerWeights, a: Tensor, ops: Numerics = PINNED) -> Tensor:
    """The KPool gates of new rows ``a`` (T, H): ``(T, D)``, ``a @ kpool_gate^T``."""
    assert ix.kpool_gate is not None, "a KPool layer (glm5_next) has kpool_gate"
    return ops.linear(a, ix.kpool_gate)


def write_pools(ix: IndexerWeights, cfg: MtpConfig, gates: Tensor, slots: Tensor, cache: LayerCache,
                ops: Numerics = PINNED) -> None:
    """Store new rows' gates ``gates`` (T, D) at ``slots`` (T,) and compute the key of every pool
    a new row completes, from the pool's index rows (already written) and gates (``pooled_keys``;
    ``pooled_keys_vendor`` when ``ops`` is not pinned)."""
    kp = cache.kpool
    assert kp is not None, "a glm5_next layer needs a KPool cache"
    kp.gates[slots] = gates
    done = complete_pools(slots, cfg.index_kpool)  # (P,)
    if done.numel() == 0:
        return
    rows = done[:, None] * cfg.index_kpool + torch.arange(cfg.index_kpool, device=slots.device)  # (P, kp)
    keys = cache.index_rows(int(rows.max()) + 1)[rows]  # (P, kp, D)
    pool = pooled_keys if ops.pinned else pooled_keys_vendor
    kp.keys[done] = pool(ix, keys, kp.gates[rows])
    kp.complete[done] = True


def kpool_queries(
    ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, ops: Numerics = PINNED
) -> tuple[Tensor, Tensor]:
    """The index heads of new rows: queries ``(T, Hi, D)`` (S; no RoPE) and weights ``(T, Hi)``
    in A, ``up(weights_proj(a)) * Hi^-1/2``."""
    q = rearrange(ops.linear(q_latent, ix.wq_b), "t (h d) -> t h d", h=cfg.index_n_heads)  # (T, Hi, D)
    return q, up(ops.linear(a, ix.weights_proj)) * cfg.index_n_heads**-0.5


def pool_scores(q: Tensor, w: Tensor, pool_keys: Tensor, cfg: MtpConfig) -> Tensor:
    """``I(t, p)`` (T, P) in A for queries ``q`` (T, Hi, D), weights ``w`` (T, Hi) and the pooled
    keys ``pool_keys`` (P, D): ``psum_h(w * relu(dot(q_h, pk_p) * D^-1/2))``."""
    T, Hi, D = q.shape
    per_head = rearrange(linear_acc_rows(rearrange(q, "t h d -> (t h) d"), pool_keys), "(t h) p -> t p h", h=Hi)
    scale = torch.tensor(cfg.index_head_dim**-0.5, dtype=acc_dtype(q.dtype), device=q.device)
    return psum(w[:, None, :] * torch.relu(per_head * scale))  # (T, P)


def pool_scores_vendor(q: Tensor, w: Tensor, pool_keys: Tensor, cfg: MtpConfig) -> Tensor:
    """``pool_scores`` with torch's kernels (differentiable): (T, P) in A."""
    A = acc_dtype(q.dtype)
    per_head = torch.einsum("thd,pd->tph", q.to(A), pool_keys.to(A)) * cfg.index_head_dim**-0.5  # (T, P, Hi)
    return (w[:, None, :] * torch.relu(per_head)).sum(-1)


def linear_acc_rows(x: Tensor, rows: Tensor) -> Tensor:
    """``dot(x[i], rows[j])`` for every pair, in A: (N, K) x (P, K) -> (N, P)."""
    if rows.shape[0] == 0:
        return torch.zeros(x.shape[0], 0, dtype=acc_dtype(x.dtype), device=x.device)
    return linear_acc(x, rows)


def select_pool_rows(scores: Tensor, slots: Tensor, cfg: MtpConfig) -> tuple[Tensor, Tensor]:
    """Row t's list from its pool scores ``(T, P)`` (pools ``[0, P)``): the rows of its best
    ``min(index_topk / kp, count_t)`` candidate pools (complete, last row ``<= t``; ties to the
    lower pool id) and its tail, in ascending slot order. Returns ``rows`` (T, K) int64 and
    ``count`` (T,) int64 as ``indexer.select_rows`` does (padding: slot 0), ``K`` the widest list."""
    kp, dev = cfg.index_kpool, slots.device
    T, P = scores.shape
    candidates = (slots + 1) // kp  # (T,): complete pools whose last row is <= t
    Kp = min(cfg.kpool_pools_selected, P)
    chosen = candidates.clamp(max=Kp)  # (T,)
    visible = torch.arange(P, device=dev)[None, :] < candidates[:, None]
    best = topk_indices(scores.masked_fill(~visible, float("-inf")), Kp)  # (T, Kp), best first
    listed = torch.arange(Kp, device=dev)[None, :] < chosen[:, None]
    pools = torch.where(listed, best, P).sort(dim=-1).values  # ascending; padding (P) last
    pool_rows = rearrange(pools[:, :, None] * kp + torch.arange(kp, device=dev), "t k j -> t (k j)")
    pool_valid = rearrange(listed[:, :, None].expand(T, Kp, kp), "t k j -> t (k j)")
    tail_rows = (candidates * kp)[:, None] + torch.arange(kp - 1, device=dev)  # (T, kp - 1)
    tail_valid = tail_rows <= slots[:, None]
    rows = torch.cat((pool_rows, tail_rows), dim=-1)
    valid = torch.cat((pool_valid, tail_valid), dim=-1)
    # Listed entries first, in their (ascending) order: a stable sort on "not listed".
    order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices
    rows, valid = rows.gather(1, order), valid.gather(1, order)
    return torch.where(valid, rows, 0), valid.sum(-1)


def kpool_scores(ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, slots: Tensor, cache: LayerCache,
                 ops: Numerics = PINNED) -> Tensor:
    """The KPool indexer's scores for new rows ``a`` (T, H) at ``slots`` (T,) whose index rows
    are already in ``cache``: writes their gates and the keys of the pools they complete, then
    ``I(t, p)`` (T, P) over pools ``[0, P)``, ``P = (max(slots) + 1) // kp`` (pinned, or with
    torch's kernels when ``ops`` is not). ``q_latent`` (T, Lq) is the MLA's normed low-rank query."""
    write_pools(ix, cfg, kpool_gates(ix, a, ops), slots, cache, ops)
    kp = cache.kpool
    assert kp is not None
    P = int(((slots.max() + 1) // cfg.index_kpool).item()) if slots.numel() else 0
    if not bool(kp.complete[:P].all()):
        raise RuntimeError("KPool: a candidate pool has no key (its rows were not all written in order)")
    q, w = kpool_queries(ix, cfg, a, q_latent, ops)
    return pool_scores(q, w, kp.keys[:P], cfg) if ops.pinned else pool_scores_vendor(q, w, kp.keys[:P], cfg)


def kpool_rows(ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, slots: Tensor, cache: LayerCache,
               ops: Numerics = PINNED, shared: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The KPool indexer for new rows ``a`` (T, H) at ``slots`` (T,) whose index rows are
    already in ``cache``: writes their gates and the keys of the pools they complete, then each
    row's list (``select_pool_rows`` of ``kpool_scores``). ``q_latent`` (T, Lq) is the MLA's
    normed low-rank query.

    ``shared``: a shared draft step's selection (step 1's ``(rows, count)``, DESIGN.md §9): the
    writes as always, none of the query side (no ``wq_b``, head weights, scores or top-k), and
    ``shared`` is the list returned."""
    if shared is not None:
        write_pools(ix, cfg, kpool_gates(ix, a, ops), slots, cache, ops)
        return shared
    return select_pool_rows(kpool_scores(ix, cfg, a, q_latent, slots, cache, ops), slots, cfg)


def visible_rows(slots: Tensor) -> tuple[Tensor, Tensor]:
    """Every visible row of each new row, as a list: ``rows`` (T, max(slots) + 1) int64 with row
    t's slots ``[0, t]`` first, ascending (padding: slot 0), and ``count = slots + 1``."""
    K = int(slots.max()) + 1 if slots.numel() else 0
    rows = torch.arange(K, device=slots.device)[None, :].expand(slots.shape[0], K)
    count = slots + 1
    return torch.where(rows < count[:, None], rows, 0), count


def kpool_all_rows(ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, slots: Tensor, cache: LayerCache,
                   ops: Numerics = PINNED, shared: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The dense ablation of the KPool indexer (a ``KPoolRowsFn``; the reference drafter only):
    the same gate and pooled-key writes as ``kpool_rows`` (so a state's pool bytes do not depend
    on it), but each new row attends to every visible row ``[0, t]`` (``visible_rows``). It
    selects nothing, so there is nothing to share: a shared step's ``shared`` is not read, and
    every draft step attends every visible row, its own included (DESIGN.md §9)."""
    write_pools(ix, cfg, kpool_gates(ix, a, ops), slots, cache, ops)
    return visible_rows(slots)


# The selection pieces a drafter's KPool hook may run (DESIGN.md §7): the indexer, and the dense
# ablation that attends every visible row.
SELECTIONS = (kpool_rows, kpool_all_rows)


def check_selection(kpool: object, cfg: MtpConfig) -> None:
    """The rule of a drafter's ``kpool`` piece, checked at construction: one of ``SELECTIONS``,
    or a probe that runs one as its ``select`` attribute (``experiments.loop.recall.RecallProbe``
    records what its selection does). Any other object would fail, or select rows the rules do not
    define, at the first prefill. Only the glm5_next family selects through KPool: a GLM-5
    drafter (its lightning indexer selects) takes the default ``kpool_rows``, which it never
    calls. ``ValueError`` naming ``kpool`` and the rule otherwise."""
    select = getattr(kpool, "select", kpool)
    if not any(select is piece for piece in SELECTIONS):
        raise ValueError("kpool must be a KPool selection: kpool.kpool_rows (the indexer), kpool.kpool_all_rows (every "
                         f"visible row) or a probe running one as its .select; got {kpool!r:.80}")
    if not cfg.is_next and kpool is not kpool_rows:
        raise ValueError(f"kpool={getattr(select, '__name__', select)!r} cannot apply to family {cfg.family!r}: only "
                         "glm5_next selects rows by KPool pools (GLM-5's lightning indexer selects its own); leave "
                         "kpool at its default")


__all__ = [
    "SELECTIONS",
    "check_selection",
    "KPoolCache",
    "pooled_keys",
    "complete_pools",
    "write_pools",
    "kpool_queries",
    "pool_scores",
    "select_pool_rows",
    "kpool_rows",
    "kpool_scores",
    "pooled_keys_vendor",
    "pool_scores_vendor",
    "visible_rows",
    "kpool_all_rows",
]
