"""Training the KPool indexer (glm5_next): DSA's sparse-stage recipe at toy scale.

The model's training forward attends through the KPool selection, as at inference (the
selection is discrete, so the language-model losses never reach the indexer). The indexer learns
from its own loss, DeepSeek-V3.2's indexer KL, aggregated to what a KPool indexer scores: for a
row t with candidate pools ``C_t`` (complete, last row <= t; at least two),

    target(t, p) = sum_{s in pool p} p_dense(t, s) / sum_{p' in C_t} sum_{s in p'} p_dense(t, s)
    loss_t       = KL(target(t, .) || softmax_{p in C_t} I(t, p))

with ``p_dense`` the head-averaged dense causal attention of the layer (``tools.selection_recall``),
detached. The tail (the row's own incomplete pool) is always attended and not scored, so it is
not in the target. As in DSA's sparse stage the indexer's inputs are detached from the model
(its queries, head weights, gates and keys are recomputed from the detached layer input), so
the KL trains the indexer's weights (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``, the KPool
gate and ``ape``) and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.indexer import normed_index_keys
from glm_mtp.reference.kpool import kpool_scores, select_pool_rows
from glm_mtp.reference.numerics import Numerics
from glm_mtp.tools.selection_recall import dense_attention_mass, recall_of
from glm_mtp.reference.state import LayerCache
from glm_mtp.reference.weights import AttentionWeights, IndexerWeights

# Masked pools' logit: finite, so a zero target times it stays 0 (an -inf would give NaN).
MASKED_LOGIT = -1.0e9


def pool_kl(scores: Tensor, mass: Tensor, slots: Tensor, kpool: int) -> tuple[Tensor, int]:
    """The summed KL over rows with at least two candidate pools, and their number.

    Args:
        scores: ``I(t, p)`` (T, P) over pools ``[0, P)``.
        mass: the dense head-averaged attention (T, S), S >= P * kpool, detached.
        slots: (T,) the rows' slots.
        kpool: rows per pool.
    """
    T, P = scores.shape
    if P == 0:
        return scores.sum() * 0.0, 0
    pool_mass = mass[:, : P * kpool].reshape(T, P, kpool).sum(-1).to(scores.dtype)  # (T, P)
    candidates = torch.arange(P, device=slots.device)[None, :] < ((slots + 1) // kpool)[:, None]  # (T, P)
    rows = candidates.sum(-1) >= 2  # (T,): one candidate leaves nothing to choose
    if not bool(rows.any()):
        return scores.sum() * 0.0, 0
    target = pool_mass.masked_fill(~candidates, 0.0)[rows]
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    log_q = torch.log_softmax(scores.masked_fill(~candidates, MASKED_LOGIT)[rows], dim=-1)
    kl = torch.xlogy(target, target) - target * log_q  # (R, P); 0 where the target is 0
    return kl.sum(), int(rows.sum())


@dataclass
class IndexerDistill:
    """A ``KPoolRowsFn`` for training (pass it to ``Target`` and the MTP forward): it selects as
    ``kpool.kpool_rows`` does, with torch's kernels, and records each call's indexer KL and the
    selection's recall (``tools.selection_recall``).

    Args:
        layers: the attention weights of every glm5_next layer it serves (the target's and the
            MTP layer's), found by their indexer.
    """

    layers: list[AttentionWeights]
    kl_sum: list[Tensor] = field(default_factory=list)  # per call: summed KL over its scored rows
    kl_rows: int = 0
    recall_sum: float = 0.0
    recall_rows: int = 0

    def __post_init__(self) -> None:
        self._attn = {id(a.indexer): a for a in self.layers}

    def __call__(self, ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, slots: Tensor,
                 cache: LayerCache,
                 ops: Numerics) -> tuple[Tensor, Tensor]:
        attn = self._attn[id(ix)]
        a_in, q_in = a.detach(), q_latent.detach()
        # The keys of the new rows again, from the detached input: the KL reaches wk and k_norm,
        # not the layer below (the cached values are the same numbers).
        cache.write_index(slots, normed_index_keys(ix, ops.linear(a_in, ix.wk), ops))
        scores = kpool_scores(ix, cfg, a_in, q_in, slots, cache, ops)  # (T, P)
        rows, count = select_pool_rows(scores.detach(), slots, cfg)
        with torch.no_grad():
            S = int(slots.max()) + 1
            # (T, S)
            mass = dense_attention_mass(attn, cfg, q_in, cache.kv_rows(S).detach(), slots, dtype=torch.float32)
            recall = recall_of(mass, rows, count, slots)  # (T,)
        kl, n = pool_kl(scores, mass, slots, cfg.index_kpool)
        self.kl_sum.append(kl)
        self.kl_rows += n
        self.recall_sum += float(recall.sum())
        self.recall_rows += recall.numel()
        return rows, count

    def loss(self) -> Tensor | None:
        """The mean KL per scored row over every call so far (``None`` before any row was scored)."""
        if not self.kl_rows:
            return None
        return torch.stack(self.kl_sum).sum() / self.kl_rows

    def mean_recall(self) -> float:
        """The mean recall of every row selected so far (NaN before any)."""
        return self.recall_sum / self.recall_rows if self.recall_rows else float("nan")


__all__ = ["pool_kl", "IndexerDistill"]
