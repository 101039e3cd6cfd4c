"""A head judged by replay (DESIGN.md §13 "Judged by replay", §11): the held-out prompts of a
trace replayed with the base head and with the tuned one, at the trace's greedy verification, k
drafts a step, the same loop as ``python -m glm_mtp.experiments.acceptance trace.path=...``
(``ReplayTarget``, the reference drafter, ``first_row_kept``); paired over prompts.
"""

from __future__ import annotations

from typing import Any

from glm_mtp.reference.contract import FeedHidden

import numpy as np

from ..loop import stats as acc_stats
from ..loop.speculative import SpeculativeDecoder
from ..targets.replay import ReplayTarget, item_budget
from ..traces.format import Trace


def replay_counts(trace: Trace, items: list[int], weights: Any, num_drafts: int, max_seq_len: int,
                  feed_hidden: FeedHidden = "post_norm", seed: int = 0) -> dict[str, Any]:
    """Per prompt (one per item of ``items``, in order): ``reached``, ``accepted`` (K each) and
    ``steps`` of the speculative loop replaying ``trace`` with the reference drafter on ``weights``."""
    from glm_mtp.reference import ReferenceProposer

    sub = Trace(trace.path, trace.meta, trace.sha256, [trace.items[i] for i in items])
    target = ReplayTarget(sub, weights.device)
    proposer = ReferenceProposer(weights, max_seq_len, feed_hidden=feed_hidden)
    # arg-type: both satisfy the loop's protocols at run time; mypy sees narrower parameter types
    # (ReplayTarget.rollback takes its ReplayState, propose_batch a list where the protocol says Sequence).
    decoder = SpeculativeDecoder(target, proposer, num_drafts, "first_row_kept", 0.0,  # type: ignore[arg-type]
                                 seed)
    counts: dict[str, Any] = {"reached": [], "accepted": [], "steps": []}
    for it in sub.items:
        prompt = it.tokens[: it.prompt_len].tolist()
        res = decoder.generate(prompt, max(1, item_budget(it, num_drafts)), weights.device)
        counts["reached"].append(res.stats.reached)
        counts["accepted"].append(res.stats.accepted)
        counts["steps"].append(res.stats.steps)
    return counts


def head_stats(counts: dict[str, Any]) -> dict[str, Any]:
    """``tau`` and ``alpha`` (per position) of one head's counts."""
    p = acc_stats.point_stats(*(np.asarray(counts[k], dtype=np.float64) for k in ("reached", "accepted", "steps")))
    return {"tau": float(p["tau"]), "alpha": [float(a) for a in p["alpha"]]}


def paired_delta(tuned: dict[str, Any], base: dict[str, Any], seed: int) -> dict[str, Any]:
    """``tuned - base``: ``tau`` and each ``alpha_i`` as ``[estimate, lo, hi]``, the paired
    bootstrap's 95% interval over the prompts (``loop.stats.paired_difference``)."""
    d = acc_stats.paired_difference(tuned, base, seed=seed)
    out: dict[str, Any] = {"tau": [d["tau"], *d["tau_ci"]]}
    for i, (a, ci) in enumerate(zip(d["alpha"], d["alpha_ci"]), start=1):
        out[f"alpha_{i}"] = [a, *ci]
    return out


def judge(trace: Trace, items: list[int], base: Any, tuned: Any, num_drafts: int, max_seq_len: int,
          feed_hidden: FeedHidden, seed: int) -> dict[str, Any]:
    """The replay record of one trace: ``base`` and ``tuned`` (``head_stats``), ``delta``
    (``paired_delta``), the prompts judged and each head's per-prompt counts."""
    cb = replay_counts(trace, items, base, num_drafts, max_seq_len, feed_hidden, seed)
    ct = replay_counts(trace, items, tuned, num_drafts, max_seq_len, feed_hidden, seed)
    return {"trace_sha256": trace.sha256, "num_drafts": num_drafts, "prompts": len(items),
            "base": head_stats(cb), "tuned": head_stats(ct), "delta": paired_delta(ct, cb, seed),
            "counts": {"base": cb, "tuned": ct}}
