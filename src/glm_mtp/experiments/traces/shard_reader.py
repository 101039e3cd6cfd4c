"""A trace read shard by shard and item by item, never whole (DESIGN.md §11, §13 "Scale"): what
fine-tuning reads instead of ``validate.open_trace``, which keeps every item in memory.

``open_items(directory)`` checks the trace with the one validator (``validate.walk``, the walk
``traces check`` and the replay run: ``trace.json``, each shard's header, then every item's rules,
one item's rows in memory at a time) and keeps nothing of it but ``trace.json``. So a damaged
trace is still refused before any work, and the memory is an item's, not the trace's.

Afterwards ``TraceItems.item(i)`` reads item i's rows of its shard on demand (safetensors slices:
the item's bytes, never the rest of the shard) and checks the item again (``validate.check_item``:
its sha256 among the rest, so a shard changed since the first check is refused naming the item).
An item read is its own tensors: holding it holds no shard. ``prompt_tokens(i)`` reads only the
item's prompt tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .format import Trace, TraceError, TraceItem, shard_name
from .validate import Reading, check_item, item_from_rows, walk


def read_rows(directory: str, shard: int, start: int, stop: int, names: tuple[str, ...] | None = None
              ) -> dict[str, Tensor]:
    """Rows ``[start, stop)`` of shard ``shard``'s arrays (``names``: these only; None: all), read
    as slices and copied: fresh tensors holding those rows' bytes alone (a safetensors slice may
    be a view of the whole array's buffer). ``TraceError`` naming the shard when its file cannot
    be read."""
    from safetensors import SafetensorError, safe_open

    name = shard_name(shard)
    try:
        with safe_open(os.path.join(directory, name), "pt") as f:
            return {n: f.get_slice(n)[start:stop].clone() for n in (names or tuple(f.keys()))}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise TraceError(f"shards[{shard}].file", f"{name} is not readable ({e})"[:300]) from None


@dataclass(frozen=True)
class TraceItems:
    """A checked trace whose items are read on demand (module docstring): its directory, metadata
    and the sha256 of its ``trace.json``."""

    path: str
    meta: dict[str, Any]
    sha256: str

    def __len__(self) -> int:
        return len(self.meta["items"])

    def item(self, i: int) -> TraceItem:
        """Item ``i``, read from its shard and checked (``validate.check_item``)."""
        e = self.meta["items"][i]
        item = item_from_rows(read_rows(self.path, e["shard"], e["start"], e["start"] + e["length"]), e)
        check_item(self.meta, i, item)
        return item

    def prompt_tokens(self, i: int) -> tuple[int, ...]:
        """Item ``i``'s prompt, ``tokens[:prompt_len]``, the only rows read (checked with the
        whole item by ``open_items`` and again by every ``item``)."""
        e = self.meta["items"][i]
        rows = read_rows(self.path, e["shard"], e["start"], e["start"] + e["prompt_len"], ("tokens",))
        return tuple(rows["tokens"].tolist())

    def trace_of(self, indices: list[int]) -> Trace:
        """A ``Trace`` holding items ``indices`` only (read now, in that order), for the code that
        takes one (``targets.replay.ReplayTarget``)."""
        return Trace(self.path, self.meta, self.sha256, [self.item(i) for i in indices])

    def record(self) -> dict[str, Any]:
        """What a run records of the trace (``Trace.record``'s fields)."""
        return {**Trace(self.path, self.meta, self.sha256).record(), "items": len(self)}


def open_items(directory: str) -> TraceItems:
    """Check the trace at ``directory`` (module docstring; ``TraceError``, a ``ValueError``: the
    first line ``validate.problems`` reports, as ``open_trace``) and return it with its items left
    in their shards."""
    reading = Reading(keep=False)
    for e in walk(directory, reading):
        raise e
    assert reading.meta is not None and reading.sha256 is not None
    return TraceItems(directory, reading.meta, reading.sha256)
