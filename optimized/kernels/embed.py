"""The embedding gather of new rows, with the row-0 zeroing, as one kernel.

Replaces, in ``glm_mtp.reference.block.mtp_rows``::

    e = F.embedding(tokens, embed_tokens).masked_fill((slots == 0)[:, None], 0.0)

A pure copy (or a +0.0 fill): exact by construction. The kernel reads the token ids from the
device, so a draft's argmax feeds the next draft's lookup without leaving the device. Ids
outside ``[0, vocab)`` read row 0 instead of faulting: callers check ids before they count
(the proposer folds the check into its device-side ``ok`` flag).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _embed_rows_kernel(
    embed_ptr,  # (V, H)
    tokens_ptr,  # (T,) integer ids
    slots_ptr,  # (T,) int64 slots
    out_ptr,  # (T, H)
    V,
    H,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = cols < H
    tok = tl.load(tokens_ptr + t).to(tl.int64)
    tok = tl.where((tok >= 0) & (tok < V), tok, 0)
    slot = tl.load(slots_ptr + t)
    row = tl.load(embed_ptr + tok * H + cols, mask=inside)
    # Row 0 pairs with position 0, which has no previous token: its embedding is zero (+0.0).
    row = tl.where(slot == 0, tl.zeros_like(row), row)
    tl.store(out_ptr + t * H + cols, row, mask=inside)


def embed_rows_torch(embed: Tensor, tokens: Tensor, slots: Tensor) -> Tensor:
    """The reference's ops: ``embed[tokens]`` (T, H) with rows at slot 0 zeroed."""
    return F.embedding(tokens, embed).masked_fill((slots == 0)[:, None], 0.0)


def embed_rows_triton(embed: Tensor, tokens: Tensor, slots: Tensor, out: Tensor | None = None) -> Tensor:
    """The kernel: ``embed`` (V, H) contiguous, ``tokens`` (T,) ints, ``slots`` (T,) int64 -> (T, H).

    ``out`` (T, H), when given, receives the rows (a static buffer under graph capture)."""
    T, (V, H) = tokens.shape[0], embed.shape
    if out is None:
        out = torch.empty(T, H, dtype=embed.dtype, device=embed.device)
    block = min(1024, triton.next_power_of_2(H))
    _embed_rows_kernel[(T, triton.cdiv(H, block))](
        embed, tokens, slots, out, V, H, BLOCK_H=block, enable_fp_fusion=False
    )
    return out
