"""Index sharing across the draft steps of one propose (DESIGN.md §9,
``MtpConfig.index_share_for_mtp_iteration``).

Draft step 1 of a propose writes row p and selects its rows ``S = sel(p)`` as always; every
later step i >= 2, writing row ``q = p + i - 1``, attends exactly ``S`` (not q itself, not rows
p+1 .. q-1, no tail of its own, no pool completed during the propose) and runs none of the
indexer's query side, while it still writes every cache entry of row q (the MLA latent, the index
key, and for KPool the gate and the key of a pool q completes). ``S`` belongs to one propose of
one state: the drafter makes a fresh ``SharedSelection`` per propose (per state in a batch), so
nothing else ever reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class SharedSelection:
    """Step 1's selection of one propose, kept for its later steps.

    ``rows`` (1, K) int64 and ``count`` (1,) int64 as ``indexer.select_rows`` returns them (row
    p's list in ascending slot order, padding past ``count``); both None until step 1 has run.
    """

    rows: Tensor | None = None
    count: Tensor | None = None

    @property
    def kept(self) -> tuple[Tensor, Tensor] | None:
        """``(rows, count)`` once step 1 has selected (a later step attends it), else None."""
        if self.rows is None or self.count is None:
            return None
        return self.rows, self.count

    def keep(self, rows: Tensor, count: Tensor) -> None:
        """Keep step 1's ``rows`` (1, K) and ``count`` (1,)."""
        self.rows, self.count = rows, count


def share_selection(enabled: bool) -> SharedSelection | None:
    """A fresh ``SharedSelection`` for one propose when sharing is ``enabled``, else None (every
    step selects for its own row)."""
    return SharedSelection() if enabled else None


__all__ = ["SharedSelection", "share_selection"]
