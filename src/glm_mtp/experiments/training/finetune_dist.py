"""Data parallel fine-tuning over ``torch.distributed`` (DESIGN.md §13, docs/finetune.md "Data
parallel"): what ``finetune_run`` does differently when launched by ``torchrun`` (``WORLD_SIZE``
> 1 in the environment).

- Every rank draws the whole step's batch from the same seeded generator (so all ranks agree on
  it without talking) and takes its contiguous share (``share``): ``batch_size`` items split
  into ``WORLD_SIZE`` runs differing by at most one item.
- Each rank backpropagates its items' summed loss divided by the *global* ``batch_size``; the
  gradients are then summed over ranks (``sum_gradients``, one all-reduce per trained tensor, in
  the masters' order), which is the gradient of the global batch's mean loss. Gradient clipping
  and AdamW then run on every rank on the same bytes, so every rank holds the same masters.
- The stop decision (``finetune.max_minutes``) is rank 0's clock, broadcast (``rank0_says``):
  every rank leaves the loop at the same step.
- The ranks check at the start that they agree on the split, seed and settings, and at the end
  that they hold the same masters (``check_agree``), then leave the group; only rank 0 writes
  anything (checkpoint, summary, card, PNG, W&B).

The trainer runs on CPU, so the process group is gloo. World 1 (no ``torchrun``) runs none of
this: no process group, no collective.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import Tensor


def world_from_env() -> tuple[int, int]:
    """``(rank, world)`` as ``torchrun`` sets them (``RANK``, ``WORLD_SIZE``); ``(0, 1)`` without it.

    Raises ``ValueError`` naming the variable when it is not an integer in range."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} and RANK={os.environ.get('RANK')!r} must be "
                         "integers (torchrun sets them)") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"WORLD_SIZE={world}, RANK={rank}: need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE")
    return rank, world


def start(world: int) -> bool:
    """Join the gloo process group ``torchrun`` describes (``MASTER_ADDR``/``MASTER_PORT``) when
    ``world`` > 1 and none is joined yet; whether this call joined it (and so must leave it)."""
    import torch.distributed as dist

    if world == 1 or dist.is_initialized():
        return False
    dist.init_process_group("gloo")
    return True


def finish(started: bool) -> None:
    """Leave together (a barrier), then destroy the group when ``start`` made it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        if started:
            dist.destroy_process_group()


def share(pick: list[int], rank: int, world: int) -> list[int]:
    """Rank ``rank``'s contiguous share of the step's batch ``pick`` (every rank draws the same
    ``pick``): items ``[rank * B // world, (rank + 1) * B // world)``, non-empty when ``B >= world``."""
    B = len(pick)
    return pick[rank * B // world:(rank + 1) * B // world]


def sum_gradients(params: list[Tensor], world: int) -> None:
    """Sum every parameter's gradient over the ranks, in place, in ``params``' order (the same on
    every rank). A parameter with no gradient on some rank (its items did not reach it) gets
    zeros there when another rank has one; one no rank reached stays ``None``, as at world 1, so
    the optimizer skips it alike."""
    import torch.distributed as dist

    if world == 1:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)  # (n,)
    dist.all_reduce(has)
    for p, n in zip(params, has.tolist()):
        if n == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


def sum_over_ranks(x: float, world: int) -> float:
    """``x`` summed over the ranks (float64); ``x`` itself at world 1."""
    import torch.distributed as dist

    if world == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def rank0_says(flag: bool, world: int) -> bool:
    """Rank 0's ``flag`` on every rank (a broadcast); ``flag`` itself at world 1."""
    import torch.distributed as dist

    if world == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.broadcast(t, 0)
    return bool(t)


def digest(tensors: dict[str, Tensor]) -> str:
    """sha256 over the tensors' names, shapes, dtypes and bytes, in name order."""
    from glm_mtp.reference.bytes import raw_bytes

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(raw_bytes(t.contiguous()))
    return h.hexdigest()


def check_agree(what: str, value: Any, world: int) -> None:
    """Raise ``RuntimeError`` naming ``what`` and the ranks when the ranks' ``value`` (any
    picklable, compared with ``==``) differ; nothing at world 1."""
    import torch.distributed as dist

    if world == 1:
        return
    values: list[Any] = [None] * world
    dist.all_gather_object(values, value)
    odd = [r for r, v in enumerate(values) if v != values[0]]
    if odd:
        raise RuntimeError(f"data parallel: ranks {odd} disagree with rank 0 on {what} ({values[odd[0]]!r} vs "
                           f"{values[0]!r}); every rank must run the same command on the same files")
