"""The drafter's sparse selection in an acceptance run: which selection it attends through
(``attention``: ``sparse``, its KPool indexer, or ``dense``, every visible row) and how much of
the dense attention the selection keeps at every drafted position (the indexer's recall,
``tools.selection_recall``).

A ``RecallProbe`` is the drafter's ``KPoolRowsFn`` (glm5_next): it runs the chosen selection and,
while ``ProbedProposer.propose`` (or ``propose_batch``) runs, records for each drafted row its draft position i (1..k),
its slot, how many rows it could see and how many it attended, its recall, the oracle recall
(the best KPool selection of index_topk rows plus the tail: what a perfect indexer keeps) and
the dense distribution's entropy over the log of the visible rows (1: uniform). Prefill and
catch-up rows are selected the same way and not recorded. Recording adds a dense attention
computation to every drafted row (the loop's ``draft_seconds`` include it); the speedup model's
measured costs are timed with recording off.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from glm_mtp.reference.attention import KPoolRowsFn
from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.kpool import kpool_all_rows, kpool_rows
from glm_mtp.reference.numerics import Numerics
from glm_mtp.tools.selection_recall import dense_attention_mass, oracle_pool_recall, recall_of
from glm_mtp.reference.state import LayerCache
from glm_mtp.reference.weights import IndexerWeights, MtpWeights

ATTENTION = ("sparse", "dense")
# attention -> the drafter's KPool selection (a choice of piece, not a second drafter)
SELECTIONS: dict[str, KPoolRowsFn] = {"sparse": kpool_rows, "dense": kpool_all_rows}


def selection(attention: str) -> KPoolRowsFn:
    """The ``KPoolRowsFn`` of ``attention`` (``sparse`` | ``dense``); ``ValueError`` otherwise."""
    if attention not in SELECTIONS:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    return SELECTIONS[attention]


@dataclass
class RecallProbe:
    """A ``KPoolRowsFn`` that selects through ``select`` and records drafted rows' recall.

    Args:
        weights: the MTP layer (its attention weights give the dense distribution).
        select: the selection it runs (``kpool_rows`` or ``kpool_all_rows``).
    """

    weights: MtpWeights
    select: KPoolRowsFn
    records: list[dict[str, float]] = field(default_factory=list)
    position: int | None = None  # drafts recorded so far in this propose while one runs, else None
    num_drafts: int = 0  # of the running propose: a batched one drafts its states one after another

    def __call__(self, ix: IndexerWeights, cfg: MtpConfig, a: Tensor, q_latent: Tensor, slots: Tensor,
                 cache: LayerCache,
                 ops: Numerics, shared: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        # shared: a shared draft step's selection (DESIGN.md §9), passed on: the step's rows are
        # recorded as every step's are, so position i > 1 measures the kept selection's recall.
        rows, count = self.select(ix, cfg, a, q_latent, slots, cache, ops, shared=shared)
        if self.position is not None:  # a propose writes its drafts one row per call
            S = int(slots.max()) + 1
            mass = dense_attention_mass(self.weights.layer.attn, cfg, q_latent, cache.kv_rows(S), slots)  # (T, S)
            r, best = recall_of(mass, rows, count, slots), oracle_pool_recall(mass, slots, cfg)  # (T,), (T,)
            entropy = -torch.xlogy(mass, mass).sum(-1) / torch.log((slots + 1).to(mass.dtype)).clamp_min(1e-300)  # (T,)
            for t in range(slots.shape[0]):
                self.position = self.position % self.num_drafts + 1 if self.num_drafts else self.position + 1
                self.records.append({"position": self.position, "slot": int(slots[t]), "visible": int(slots[t]) + 1,
                                     "attended": int(count[t]), "recall": float(r[t]), "oracle": float(best[t]),
                                     "entropy": float(entropy[t])})
        return rows, count


class ProbedProposer:
    """A drafter whose ``propose`` calls are recorded by its ``RecallProbe`` (every other call
    and attribute is the drafter's own)."""

    def __init__(self, proposer: Any, probe: RecallProbe) -> None:
        self._proposer = proposer
        self.probe = probe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proposer, name)

    def propose(self, last_token: Any, target_hidden: Any, position: int, num_drafts: int, state: Any) -> list[int]:
        return self._recorded(num_drafts, self._proposer.propose, last_token, target_hidden, position, num_drafts,
                              state)

    def propose_batch(self, last_tokens: Any, target_hiddens: Any, positions: Any, num_drafts: int,
                      states: Any) -> list[list[int]]:
        """Recorded too: the reference drafter drafts the batch's states one after another, k rows each."""
        return self._recorded(num_drafts, self._proposer.propose_batch, last_tokens, target_hiddens, positions,
                              num_drafts, states)

    def _recorded(self, num_drafts: int, call: Any, *args: Any) -> Any:
        self.probe.position, self.probe.num_drafts = 0, num_drafts
        try:
            return call(*args)
        finally:
            self.probe.position, self.probe.num_drafts = None, 0


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear interpolation between order statistics; NaN when empty)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def recall_summary(records: list[dict[str, float]], num_drafts: int) -> dict[str, Any]:
    """``summary.json``'s ``recall``: median, lower decile (p10) and mean of the drafted rows'
    recall (and the oracle's median and p10), overall and per draft position, how often selection
    was real (the row could see more rows than it attended) and how flat the dense attention was."""

    def stats(rs: list[dict[str, float]]) -> dict[str, float]:
        vals, best = [r["recall"] for r in rs], [r["oracle"] for r in rs]
        return {"rows": len(vals), "median": quantile(vals, 0.5), "p10": quantile(vals, 0.1),
                "mean": statistics.fmean(vals) if vals else float("nan"), "min": min(vals) if vals else float("nan"),
                "oracle_median": quantile(best, 0.5), "oracle_p10": quantile(best, 0.1)}

    real = [r for r in records if r["attended"] < r["visible"]]
    return {
        **stats(records),
        "per_position": [stats([r for r in records if r["position"] == i + 1]) for i in range(num_drafts)],
        "selection_real_share": len(real) / len(records) if records else float("nan"),
        "mean_visible": statistics.fmean(r["visible"] for r in records) if records else float("nan"),
        "mean_attended": statistics.fmean(r["attended"] for r in records) if records else float("nan"),
        # The dense distribution's entropy / log(visible rows): 1 is uniform, where no selection can beat its share of
        # rows.
        "entropy_median": quantile([r["entropy"] for r in records], 0.5),
        "definition": "share of the dense head-averaged attention mass (float64) on the rows the drafter attended, per "
                      "drafted row; oracle: the same for the best KPool selection of index_topk rows plus the tail",
    }


__all__ = ["ATTENTION", "SELECTIONS", "selection", "RecallProbe", "ProbedProposer", "quantile", "recall_summary"]
