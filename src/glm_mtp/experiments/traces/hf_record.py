"""Pass 1 of a recording on transformers' model (``model=hf``): the greedy continuation of many
prompts at once, batched as an engine would run it.

Prompts of one length run as one batch (no padding, so no attention mask enters the numerics);
each step feeds every row's newest token through the same cache. A batched decode may round
differently from the one-row teacher-forced pass 2 (vLLM #54506): the recorder cuts an item at
the first position where the two disagree.
"""

from __future__ import annotations

from typing import Any

import torch

from ..loop.sampler import SamplerSettings
from .recorder import ContinueFn, next_tokens, sampled


def batched_continue(model: Any, topk_ties: str, settings: SamplerSettings | None = None) -> ContinueFn:
    """``(prompts, n) -> (continuations, forwards)``: n greedy tokens after each prompt, the prompts
    of each length batched (``topk_ties`` as ``HfTarget``'s); with ``settings`` at temperature > 0
    each row's seeded sample (its own prompt's key and position: the sampler is per row)."""
    from transformers import DynamicCache

    from ..targets.hf_target import pinned_topk

    device = model.get_input_embeddings().weight.device

    def run(prompts: list[list[int]], n: int) -> tuple[list[list[int]], int]:
        out: list[list[int] | None] = [None] * len(prompts)
        forwards = 0
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_len.setdefault(len(p), []).append(i)
        for rows in by_len.values():
            ids = torch.tensor([prompts[i] for i in rows], device=device)  # (B, P)
            cache = DynamicCache(config=model.config)
            toks: list[list[int]] = [[] for _ in rows]
            with torch.no_grad(), pinned_topk(topk_ties):
                while len(toks[0]) < n:
                    hidden = model.model(input_ids=ids, cache=cache, use_cache=True).last_hidden_state[:, -1]  # (B, H)
                    logits = model.lm_head(hidden).float()  # (B, V)
                    if sampled(settings):
                        P = len(prompts[rows[0]]) + len(toks[0]) - 1  # every row's newest position
                        nxt = torch.tensor([next_tokens(logits[b : b + 1], settings, prompts[i], P)[0]
                                            for b, i in enumerate(rows)], device=device)
                    else:
                        nxt = torch.argmax(logits, dim=-1)  # (B,)
                    forwards += 1
                    for t, x in zip(toks, nxt.tolist()):
                        t.append(int(x))
                    ids = nxt[:, None]
            for i, t in zip(rows, toks):
                out[i] = t
        return [o for o in out if o is not None], forwards

    return run
