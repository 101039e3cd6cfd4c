"""The fine-tuning split (DESIGN.md §13 "Split"): by prompt, never by position, recorded.

A trace item names its prompt (version 2: ``items[i].prompt``, source, index, sha256); items of one
prompt stay together. A version-1 trace names none: each item is then its own prompt (the
recorder writes one item per prompt, in prompt order), keyed ``item:<i>``. The prompts' keys are
shuffled by a generator seeded with ``finetune.seed`` and the last ``round(heldout * n)`` are
held out: a function of the trace's metadata and the seed alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


def prompt_key(meta: dict[str, Any], i: int) -> str:
    """Item ``i``'s prompt key: ``source:sha256`` of its prompt identity, or ``item:<i>`` (version 1)."""
    p = meta["items"][i].get("prompt")
    return f"{p['source']}:{p['sha256']}" if isinstance(p, dict) else f"item:{i}"


@dataclass(frozen=True)
class PromptSplit:
    """Item indices for training and held out, and the prompt keys of each side."""

    train_items: list[int]
    heldout_items: list[int]
    train_prompts: list[str]
    heldout_prompts: list[str]

    def record(self) -> dict[str, Any]:
        """What summary.json and the model card record of the split."""
        return {"train": len(self.train_prompts), "heldout": len(self.heldout_prompts),
                "train_items": len(self.train_items), "heldout_items": len(self.heldout_items),
                "by": "prompt", "heldout_prompts": self.heldout_prompts, "heldout_item_indices": self.heldout_items}


def split_by_prompt(meta: dict[str, Any], heldout: float, seed: int) -> PromptSplit:
    """The split of the trace ``meta``'s items (module docstring). ``ValueError`` (naming
    ``finetune.heldout``) when it leaves no training or no held-out prompt."""
    keys: dict[str, list[int]] = {}
    for i in range(len(meta["items"])):
        keys.setdefault(prompt_key(meta, i), []).append(i)
    order = sorted(keys)
    random.Random(seed).shuffle(order)
    n = len(order)
    n_held = round(heldout * n)
    if n_held < 1 or n_held >= n:
        raise ValueError(f"finetune.heldout={heldout}: the trace's {n} prompt(s) split into {n - n_held} for "
                         f"training and {n_held} held out; both must be >= 1")
    train, held = order[: n - n_held], order[n - n_held :]
    return PromptSplit(sorted(i for k in train for i in keys[k]), sorted(i for k in held for i in keys[k]),
                       sorted(train), sorted(held))
