"""A head judged by replay (DESIGN.md §13 "Judged by replay", §11): the held-out prompts of a
trace replayed with the base head and with the tuned one, at the trace's greedy verification, k
drafts a step, the same loop as ``python -m glm_mtp.experiments.acceptance trace.path=...``
(``ReplayTarget``, the reference drafter, ``first_row_kept``); paired over prompts.

The trace is read item by item (``traces.shard_reader``): each prompt is replayed against a
``ReplayTarget`` holding only the judged items recorded from that prompt, in the judged order, so
it answers exactly as one holding every judged item would (a prefill matches the items of its
prompt, and the first of them left answers) with a few items in memory, never the trace.
"""

from __future__ import annotations

from typing import Any

from glm_mtp.reference.contract import FeedHidden

import numpy as np

from ..loop import stats as acc_stats
from ..loop.speculative import SpeculativeDecoder
from ..targets.replay import ReplayTarget, item_budget
from ..traces.shard_reader import TraceItems


def replay_counts(trace: TraceItems, items: list[int], weights: Any, num_drafts: int, max_seq_len: int,
                  feed_hidden: FeedHidden = "post_norm", seed: int = 0) -> dict[str, Any]:
    """Per prompt (one per item of ``items``, in order): ``reached``, ``accepted`` (K each) and
    ``steps`` of the speculative loop replaying ``trace`` with the reference drafter on ``weights``."""
    from glm_mtp.reference import ReferenceProposer

    prompts = {i: trace.prompt_tokens(i) for i in items}
    proposer = ReferenceProposer(weights, max_seq_len, feed_hidden=feed_hidden)
    decoder: SpeculativeDecoder | None = None
    counts: dict[str, Any] = {"reached": [], "accepted": [], "steps": []}
    for i in items:
        # The judged items of this prompt, in the judged order: all a replay of it can answer from.
        group = [j for j in items if prompts[j] == prompts[i]]
        sub = trace.trace_of(group)
        target = ReplayTarget(sub, weights.device)
        if decoder is None:
            # arg-type: both satisfy the loop's protocols at run time; mypy sees narrower parameter types
            # (ReplayTarget.rollback takes its ReplayState, propose_batch a list where the protocol says Sequence).
            decoder = SpeculativeDecoder(target, proposer, num_drafts, "first_row_kept", 0.0,  # type: ignore[arg-type]
                                         seed)
        decoder.target = target  # type: ignore[assignment]  # the same protocol gap as above
        it = sub.items[group.index(i)]
        res = decoder.generate(list(prompts[i]), max(1, item_budget(it, num_drafts)), weights.device)
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


def judge_counts(trace: TraceItems, items: list[int], base_counts: dict[str, Any], tuned_counts: dict[str, Any],
                 num_drafts: int, seed: int) -> dict[str, Any]:
    """The replay record of one trace from both heads' counts: ``base`` and ``tuned``
    (``head_stats``), ``delta`` (``paired_delta``), the prompts judged and the counts."""
    return {"trace_sha256": trace.sha256, "num_drafts": num_drafts, "prompts": len(items),
            "base": head_stats(base_counts), "tuned": head_stats(tuned_counts),
            "delta": paired_delta(tuned_counts, base_counts, seed), "counts": {"base": base_counts,
                                                                               "tuned": tuned_counts}}


def judge(trace: TraceItems, items: list[int], base: Any, tuned: Any, num_drafts: int, max_seq_len: int,
          feed_hidden: FeedHidden, seed: int) -> dict[str, Any]:
    """``judge_counts`` of ``base`` and ``tuned`` replayed on ``items``."""
    cb = replay_counts(trace, items, base, num_drafts, max_seq_len, feed_hidden, seed)
    ct = replay_counts(trace, items, tuned, num_drafts, max_seq_len, feed_hidden, seed)
    return judge_counts(trace, items, cb, ct, num_drafts, seed)
