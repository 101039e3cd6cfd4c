"""Calibration of the drafter's confidence: acceptance per draft position against ``p_i`` and
``margin_i`` (DESIGN.md §12) in bins, with bootstrap 95% intervals over prompts.

Read from a run that verified all K drafts every round (so every draft reached is scored): draft
i of a round is *reached* when drafts 1..i-1 were accepted and *accepted* when it was too, as
``SpecStats`` counts. A bin's acceptance is accepted / reached over the rounds whose draft i has
its confidence in the bin (the conditional alpha_i of those drafts). A calibrated ``p`` has
acceptance equal to the bin's mean ``p`` (the expected calibration error ``ece`` measures the gap,
weighted by the bins' counts).

``depth_correlation``: Spearman's rank correlation, over rounds, between the first draft's
confidence (and the product of all K probabilities) and the accepted depth ``a`` (the hindsight-
best verify width): the statistic llama.cpp's study of draft-probability stopping reports.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from . import stats as acc_stats
from .stop_rules import RoundRecord

PROB_EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
MARGIN_EDGES = (-math.inf, 0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, math.inf)
CONFIDENCES = ("prob", "margin")


def bin_index(values: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """The bin of each value: bin b holds ``edges[b] <= x < edges[b + 1]``, the last bin closed
    (``x == edges[-1]`` falls in it); a value outside the edges or NaN gets -1."""
    e = np.asarray(edges, dtype=np.float64)
    idx = np.searchsorted(e, values, side="right") - 1
    idx = np.where(values == e[-1], len(e) - 2, idx)
    return np.where((idx < 0) | (idx > len(e) - 2) | np.isnan(values), -1, idx)


def bin_counts(rounds_per_prompt: Sequence[Sequence[RoundRecord]], num_drafts: int, which: str,
               edges: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per prompt, position and bin: drafts reached, accepted, and the sum of their confidence.
    Returns three (P, K, B) arrays.

    Args:
        rounds_per_prompt: each prompt's rounds, each verified at the full width K.
        num_drafts: K. which: ``prob`` or ``margin``. edges: the bins' B + 1 edges.
    """
    if which not in CONFIDENCES:
        raise ValueError(f"which must be one of {CONFIDENCES}, got {which!r}")
    P, B = len(rounds_per_prompt), len(edges) - 1
    reached, accepted, total = (np.zeros((P, num_drafts, B)) for _ in range(3))
    for p, rounds in enumerate(rounds_per_prompt):
        for r in rounds:
            if r.width != num_drafts or len(r.prob) != num_drafts:
                raise ValueError(f"calibration reads rounds that verified all {num_drafts} drafts with their "
                                 f"confidences; one verified {r.width} with {len(r.prob)} confidences")
            values = np.asarray(getattr(r, which), dtype=np.float64)
            bins = bin_index(values, edges)
            for i in range(min(r.accepted + 1, num_drafts)):
                if bins[i] < 0:
                    continue
                reached[p, i, bins[i]] += 1
                accepted[p, i, bins[i]] += i < r.accepted
                total[p, i, bins[i]] += values[i] if math.isfinite(values[i]) else 0.0
    return reached, accepted, total


def calibration(rounds_per_prompt: Sequence[Sequence[RoundRecord]], num_drafts: int, which: str,
                edges: Sequence[float], seed: int = 0, replicates: int = acc_stats.REPLICATES) -> dict[str, Any]:
    """Acceptance per position and bin with its bootstrap 95% interval over prompts, and the
    positions pooled (``all``). Each entry: ``reached``, ``accepted``, ``acceptance``, ``ci``,
    ``mean`` (the bin's mean confidence; finite values only) per bin, and ``ece`` (for ``prob``)."""
    r, a, tot = bin_counts(rounds_per_prompt, num_drafts, which, edges)  # (P, K, B)
    idx = acc_stats._replicate_indices(r.shape[0], replicates, seed)  # (R, P)

    def entry(rp: np.ndarray, ap: np.ndarray, tp: np.ndarray) -> dict[str, Any]:
        """rp, ap, tp: (P, B)."""
        rs, as_ = rp.sum(0), ap.sum(0)
        rate = acc_stats._ratio(as_, rs)
        rep = acc_stats._ratio(ap[idx].sum(1), rp[idx].sum(1))  # (R, B)
        mean = acc_stats._ratio(tp.sum(0), rs)
        out = {"reached": [int(x) for x in rs], "accepted": [int(x) for x in as_], "acceptance": rate.tolist(),
               "ci": acc_stats._percentiles(rep), "mean": mean.tolist()}
        if which == "prob":
            keep = rs > 0
            out["ece"] = float(np.sum(rs[keep] * np.abs(rate[keep] - mean[keep])) / rs.sum()) if rs.sum() else math.nan
        return out

    return {"which": which, "edges": [float(e) for e in edges],
            "per_position": [entry(r[:, i], a[:, i], tot[:, i]) for i in range(num_drafts)],
            "all": entry(r.sum(1), a.sum(1), tot.sum(1))}


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN with fewer than 2 values or a constant."""
    if x.size < 2:
        return math.nan

    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(v.size)
        r[order] = np.arange(v.size, dtype=np.float64)
        _, inv, counts = np.unique(v, return_inverse=True, return_counts=True)
        sums = np.bincount(inv, weights=r)
        return sums[inv] / counts[inv]

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def depth_correlation(rounds_per_prompt: Sequence[Sequence[RoundRecord]]) -> dict[str, float]:
    """Spearman's correlation over all rounds between the accepted depth and ``p_1``,
    ``margin_1`` (+inf margins ranked above every finite one) and ``prod p_1..p_K``."""
    rounds = [r for rs in rounds_per_prompt for r in rs if r.prob]
    depth = np.asarray([r.accepted for r in rounds], dtype=np.float64)
    p1 = np.asarray([r.prob[0] for r in rounds], dtype=np.float64)
    m1 = np.asarray([r.margin[0] for r in rounds], dtype=np.float64)
    m1 = np.where(np.isposinf(m1), np.finfo(np.float64).max, m1)
    prod = np.asarray([math.prod(r.prob) for r in rounds], dtype=np.float64)
    return {"rounds": len(rounds), "prob_1": spearman(p1, depth), "margin_1": spearman(m1, depth),
            "cumprob_K": spearman(prod, depth)}
