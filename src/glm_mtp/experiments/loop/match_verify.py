"""``verify=match``, seeded exact match (DESIGN.md §14): the verify of ``[t_m, d_1 .. d_k]``
computes the target's own seeded samples ``y_m .. y_{m+k}`` from its rows (``loop/sampler.py``),
accepts the longest prefix with ``d_i == y_{m+i-1}`` and commits ``y`` at the first mismatch (the
bonus after k). The output is the target's seeded sampling whatever the drafter drafted, so it is
lossless and drafter-invariant; for argmax drafts it accepts ``d_i`` with probability ``p(d_i)``,
as rejection sampling with a one-hot draft does.

A target may answer its samples itself (``TargetOutput.sample``: a replay of a sampled trace
answers the recorded ones); otherwise they are drawn from its logits here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .sampler import SamplerSettings, seeded_sample


def target_samples(out: Any, settings: SamplerSettings, prompt_sha256: str, first: int, rows: int) -> list[int]:
    """The target's seeded samples after its first ``rows`` output rows, row t at item position
    ``first + t``: the target's own answer (``out.sample``) where it gives one, else
    ``seeded_sample`` of ``out.logits``."""
    given = getattr(out, "sample", None)
    if given is not None:
        return [int(x) for x in given[:rows].tolist()]
    logits: Tensor = out.logits[:rows]
    positions = torch.arange(first, first + rows, device=logits.device)
    return seeded_sample(logits, settings, prompt_sha256, positions).tolist()


def match_verify(samples: list[int], drafts: list[int]) -> tuple[int, int]:
    """``samples`` (len(drafts) + 1): ``y_m .. y_{m+k}``. Returns (drafts accepted, the committed
    sample after them)."""
    if len(samples) != len(drafts) + 1:
        raise ValueError(f"samples must hold one more token than drafts ({len(drafts) + 1}), got {len(samples)}")
    a = 0
    while a < len(drafts) and drafts[a] == samples[a]:
        a += 1
    return a, samples[a]
