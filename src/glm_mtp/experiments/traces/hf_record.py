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

from .recorder import ContinueFn


def batched_continue(model: Any, topk_ties: str) -> ContinueFn:
    """``(prompts, n) -> (continuations, forwards)``: n greedy tokens after each prompt, the prompts
    of each length batched (``topk_ties`` as ``HfTarget``'s)."""
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
                    nxt = torch.argmax(model.lm_head(hidden).float(), dim=-1)  # (B,)
                    forwards += 1
                    for t, x in zip(toks, nxt.tolist()):
                        t.append(int(x))
                    ids = nxt[:, None]
            for i, t in zip(rows, toks):
                out[i] = t
        return [o for o in out if o is not None], forwards

    return run
