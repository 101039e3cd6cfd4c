"""Acceptance statistics with their uncertainty: bootstrap over prompts.

Steps within one prompt are not independent (a prompt that loops is easy to draft at every step),
so the unit of resampling is the prompt: a replicate draws ``P`` prompts with replacement out of
the ``P`` measured and recomputes each statistic from the drawn prompts' summed counts. The 95%
interval is the 2.5th and 97.5th percentile of the replicates (percentile bootstrap).

Counts per prompt (``SpecStats`` of one generation):

- ``reached[i]``: verifications in which draft i+1 was checked (drafts 1..i all accepted);
- ``accepted[i]``: verifications in which draft i+1 was accepted;
- ``steps``: verifications.

Statistics, per draft position i (1-based):

- conditional ``alpha_i = sum accepted[i] / sum reached[i]`` = P(draft i accepted | drafts
  1..i-1 accepted), what DESIGN.md calls acceptance;
- cumulative ``P(accepted >= i) = sum accepted[i] / sum steps``, the share of verifications that
  accepted at least i drafts (what vLLM's per-position acceptance reports);
- ``tau = (steps + sum_i accepted[i]) / steps``, tokens committed per verification.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

REPLICATES = 2000


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _percentiles(x: np.ndarray) -> list[list[float]]:
    """(B, K) replicates -> K pairs [2.5%, 97.5%]; NaN where no replicate is defined."""
    out = []
    for col in x.T:
        col = col[~np.isnan(col)]
        out.append(
            [float(np.percentile(col, 2.5)), float(np.percentile(col, 97.5))] if col.size else [math.nan, math.nan]
        )
    return out


def point_stats(reached: np.ndarray, accepted: np.ndarray, steps: np.ndarray) -> dict[str, np.ndarray]:
    """Statistics of counts summed over the leading axes but the last: ``reached``/``accepted``
    (..., P, K), ``steps`` (..., P). Returns ``alpha`` and ``cumulative`` (..., K), ``tau`` (...)."""
    r, a, s = reached.sum(-2), accepted.sum(-2), steps.sum(-1)
    return {"alpha": _ratio(a, r), "cumulative": _ratio(a, s[..., None]), "tau": _ratio(s + a.sum(-1), s)}


def _replicate_indices(num_prompts: int, replicates: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_prompts, size=(replicates, num_prompts))  # (B, P)


def bootstrap(counts: dict[str, Any], replicates: int = REPLICATES, seed: int = 0) -> dict[str, Any]:
    """95% intervals over prompts.

    Args:
        counts: per prompt, ``{"reached": [[...K] * P], "accepted": [[...K] * P], "steps": [P]}``.
        replicates / seed: bootstrap replicates and their generator's seed (fixed: reruns agree).
    Returns ``alpha_ci`` and ``cumulative_ci`` (K pairs ``[low, high]``) and ``tau_ci`` (one pair).
    """
    r, a, s = (np.asarray(counts[k], dtype=np.float64) for k in ("reached", "accepted", "steps"))
    if r.ndim != 2 or r.shape != a.shape or s.shape != r.shape[:1] or not r.shape[0]:
        raise ValueError(f"counts must hold P >= 1 prompts: reached and accepted (P, K), steps (P,); got {r.shape}, "
                         f"{a.shape}, {s.shape}")
    idx = _replicate_indices(r.shape[0], replicates, seed)
    rep = point_stats(r[idx], a[idx], s[idx])
    return {"alpha_ci": _percentiles(rep["alpha"]), "cumulative_ci": _percentiles(rep["cumulative"]),
            "tau_ci": _percentiles(rep["tau"][:, None])[0]}


def paired_difference(a: dict[str, Any], b: dict[str, Any], replicates: int = REPLICATES,
                      seed: int = 0) -> dict[str, Any]:
    """``a - b`` for two runs on the same prompts (same order), with 95% intervals from resampling
    the prompts jointly (each replicate draws the same prompts for both, so what the prompts
    share cancels). Returns ``alpha``, ``alpha_ci``, ``cumulative``, ``cumulative_ci`` over the
    positions both runs have, and ``tau`` / ``tau_ci``."""
    A = [np.asarray(a[k], dtype=np.float64) for k in ("reached", "accepted", "steps")]
    B = [np.asarray(b[k], dtype=np.float64) for k in ("reached", "accepted", "steps")]
    if A[2].shape != B[2].shape:
        raise ValueError(f"paired runs must share their prompts: {A[2].shape[0]} vs {B[2].shape[0]} prompts")
    K = min(A[0].shape[1], B[0].shape[1])
    A[:2], B[:2] = [x[:, :K] for x in A[:2]], [x[:, :K] for x in B[:2]]
    pa, pb = point_stats(*A), point_stats(*B)
    idx = _replicate_indices(A[2].shape[0], replicates, seed)
    ra, rb = point_stats(*(x[idx] for x in A)), point_stats(*(x[idx] for x in B))
    return {"alpha": (pa["alpha"] - pb["alpha"]).tolist(), "alpha_ci": _percentiles(ra["alpha"] - rb["alpha"]),
            "cumulative": (pa["cumulative"] - pb["cumulative"]).tolist(),
            "cumulative_ci": _percentiles(ra["cumulative"] - rb["cumulative"]),
            "tau": float(pa["tau"] - pb["tau"]), "tau_ci": _percentiles((ra["tau"] - rb["tau"])[:, None])[0]}
