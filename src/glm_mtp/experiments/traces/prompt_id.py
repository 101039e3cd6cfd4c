"""Each item's prompt identity (DESIGN.md §13 "Split", §14): which prompt of which source an item
was recorded from, so fine-tuning splits by prompt and the seeded sampler keys its noise by it.

``prompt_sha256`` is the prompt's token ids as int32 little-endian bytes, hashed: a function of the
tokens alone, so an engine that records a trace computes the same digest from the same prompt.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any


def prompt_sha256(tokens: list[int]) -> str:
    """sha256 hex of ``tokens`` (the prompt's ids) packed as int32 little-endian, in order."""
    return hashlib.sha256(struct.pack(f"<{len(tokens)}i", *(int(t) for t in tokens))).hexdigest()


def prompt_identity(source: str, index: int, tokens: list[int]) -> dict[str, Any]:
    """``{"source", "index", "sha256"}``: the prompts' source (``heldout``, ``ood``, ``jsonl``,
    ``text``, ...), the prompt's index in the run's prompt list from that source (a jsonl file's
    line order; a window source's window order for the run's seed), the prompt's ``prompt_sha256``."""
    return {"source": source, "index": int(index), "sha256": prompt_sha256(tokens)}
