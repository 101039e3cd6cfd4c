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

from glm_mtp.reference.config import MtpConfig

from .launch import AuditLaunch, Launch, abstract


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


def embed_rows_launch(embed: Tensor, tokens: Tensor, slots: Tensor, out: Tensor) -> Launch:
    """The kernel's launch on ``embed`` (V, H) contiguous, ``tokens`` (T,) ints, ``slots`` (T,)
    int64, ``out`` (T, H): the one place its grid and constexprs are computed."""
    T, (V, H) = tokens.shape[0], embed.shape
    block = min(1024, triton.next_power_of_2(H))
    return Launch(_embed_rows_kernel, (T, triton.cdiv(H, block)), (embed, tokens, slots, out, V, H),
                  dict(BLOCK_H=block, enable_fp_fusion=False))


def embed_rows_triton(embed: Tensor, tokens: Tensor, slots: Tensor) -> Tensor:
    """The kernel: ``embed`` (V, H) contiguous, ``tokens`` (T,) ints, ``slots`` (T,) int64 -> (T, H)."""
    out = torch.empty(tokens.shape[0], embed.shape[1], dtype=embed.dtype, device=embed.device)  # (T, H)
    embed_rows_launch(embed, tokens, slots, out).run()
    return out


def audit_launches(cfg: MtpConfig, dtype: torch.dtype) -> list[AuditLaunch]:
    """The launches the drafter makes at ``cfg`` with ``dtype`` weights, on abstract tensors
    (see ``glm_mtp.tools.audit``). Token ids are int64 everywhere (the proposer converts).

    ``aligned``: a draft step or the one-row catch-up (fresh (1,) tensors). ``unaligned``:
    context rows, where a prefill reads ``tokens[1:]`` and a catch-up at an odd row reads
    ``slots[row:]``, each 8 bytes off a 16-byte boundary (Triton drops its alignment hint)."""
    V, H, rows = cfg.vocab_size, cfg.hidden_size, 4
    embed = abstract((V, H), dtype)
    one = embed_rows_launch(embed, abstract((1,), torch.int64), abstract((1,), torch.int64), abstract((1, H), dtype))
    ids, slots = abstract((rows + 1,), torch.int64), abstract((rows + 1,), torch.int64)
    many = embed_rows_launch(embed, ids[1:], slots[1:], abstract((rows, H), dtype))
    return [AuditLaunch("embed_rows", "aligned", one), AuditLaunch("embed_rows", "unaligned", many)]
