"""Whether the pre-norm feed changes the drafts (the training grid's feed ablation): the drafts of
two proposers, one per feed (``post_norm`` and ``pre_norm``), after the same text and the target's
hiddens, at every teacher-forced position of some windows."""

from __future__ import annotations

from typing import Any

import torch

from glm_mtp.reference.contract import DraftProposer

FEEDS = ("post_norm", "pre_norm")


@torch.no_grad()
def feed_agreement(target: Any, proposers: dict[str, DraftProposer], windows: list[list[int]], prompt_len: int,
                   k: int) -> dict[str, Any]:
    """How often the two feeds' drafts agree: at every position m in ``[prompt_len, len(w))`` of
    each window w, each proposer proposes k drafts after ``w[:m+1]`` with the target's hiddens of
    the window (one forward of the whole window), as in ``speculative.teacher_forced``; then the
    text moves on. Returns ``same_per_position`` (share of positions where draft i is equal
    under both feeds, i = 1..k), ``all_same`` (all k equal), ``positions`` and, per prompt,
    the positions where any draft differed (``differing_per_prompt``)."""
    a, b = (proposers[f] for f in FEEDS)
    same, all_same, positions, per_prompt = [0] * k, 0, 0, []
    for w in windows:
        out = target.forward(torch.tensor(w), target.alloc_state())
        sa, sb = a.alloc_state("cpu"), b.alloc_state("cpu")
        a.prefill_drafter(w[:prompt_len], out.hidden[:prompt_len], sa)
        b.prefill_drafter(w[:prompt_len], out.hidden[:prompt_len], sb)
        differing = 0
        for m in range(prompt_len, len(w)):
            h = out.hidden[m - 1 : m]
            da, db = a.propose(w[m], h, m - 1, k, sa), b.propose(w[m], h, m - 1, k, sb)
            a.after_verify(0, sa)
            b.after_verify(0, sb)
            eq = [x == y for x, y in zip(da, db)]
            same = [s + int(e) for s, e in zip(same, eq)]
            all_same += int(all(eq))
            differing += int(not all(eq))
            positions += 1
        a.free_state(sa)
        b.free_state(sb)
        per_prompt.append(differing)
    return {"same_per_position": [s / positions for s in same], "all_same": all_same / positions,
            "positions": positions,
            "differing_per_prompt": per_prompt, "num_drafts": k}
