"""Expert-parallel and row-parallel drafting over torch.distributed.

GLM-5's MTP layer holds 256 routed experts; engines split them over expert-parallel ranks and
split the attention's ``o_proj`` row-wise (its input dims, i.e. whole heads, per rank). A sharded
``MtpWeights`` (``MtpWeights.shard`` or ``from_pretrained(..., ep_rank=, ep_world=)``) carries a
``ShardSpec``; the reference's MoE and attention then combine rank-local results with
collectives, so both backends, which run those functions, shard the same way.

Numerics:
- MoE: each rank runs the row's k chosen experts that it holds (slots it does not hold run on a
  clamped local expert and are discarded), every rank all-gathers the per-slot outputs and takes
  each slot from its owner, then sums in the reference's order (ascending expert id). A gather
  copies bytes, so the sharded MoE equals the single-rank one bit for bit.
- ``o_proj`` row-parallel (a power-of-two world): rank r holds the input columns of the r-th
  aligned subtree of the pinned ``psum`` over ``o_proj``'s inputs (DESIGN.md §5), sums them as
  that subtree, and the ranks' float32 partials are all-gathered and summed in tree order: the
  single-rank result bit for bit. ``row_parallel_o_proj=False`` keeps ``o_proj`` whole.

``GLM_MTP_NO_EP_PROPOSE=1`` disables expert-parallel propose: sharding then keeps every weight on
every rank and ``needs_comm()`` is false.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from .numerics import next_pow2

NO_EP_ENV = "GLM_MTP_NO_EP_PROPOSE"


def ep_propose_enabled() -> bool:
    """False when ``GLM_MTP_NO_EP_PROPOSE=1``: every rank then holds every weight."""
    return os.environ.get(NO_EP_ENV, "0") != "1"


@dataclass(frozen=True)
class ShardSpec:
    """This rank's share of a sharded MTP layer.

    Args:
        rank / world: position in, and size of, the expert-parallel group.
        group: the torch.distributed process group (None: the default group).
        row_parallel_o_proj: split ``o_proj``'s inputs over the ranks (tree-aligned, exact) or keep it whole.
    """

    rank: int
    world: int
    group: Any = None
    row_parallel_o_proj: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, world={self.world}), got {self.rank}")
        if self.row_parallel_o_proj and self.world & (self.world - 1):
            raise ValueError(
                f"row_parallel_o_proj needs a power-of-two world (each rank sums an aligned subtree of o_proj's psum), "
                f"got world={self.world}; pass row_parallel_o_proj=False"
            )

    def expert_range(self, n_routed_experts: int) -> range:
        """The experts this rank holds: a contiguous block of ``n_routed_experts / world``."""
        if n_routed_experts % self.world:
            raise ValueError(f"n_routed_experts ({n_routed_experts}) must divide evenly over world={self.world} ranks")
        per = n_routed_experts // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    def o_proj_subtree(self, in_features: int) -> int:
        """Width of one rank's subtree of the ``psum`` over ``o_proj``'s ``in_features`` inputs:
        the padded tree's width over ``world`` (a power of two)."""
        return max(1, next_pow2(in_features) // self.world)

    def o_proj_columns(self, in_features: int) -> slice:
        """The ``o_proj`` input columns this rank holds when row-parallel: its aligned subtree
        ``[rank * w, (rank + 1) * w)`` of the padded tree, cut at ``in_features`` (possibly empty)."""
        w = self.o_proj_subtree(in_features)
        return slice(min(self.rank * w, in_features), min((self.rank + 1) * w, in_features))

    def all_gather(self, t: Tensor) -> Tensor:
        """``(world, *t.shape)``: every rank's ``t``, in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)


# ------------------------------------------------------------------------------------------------
# Launching ranks as processes on one machine (tests, CPU experiments).


def _rank_main(rank: int, world: int, init_file: str, backend: str, timeout_s: float, fn: Callable,
               args: tuple) -> None:
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s)
    )
    fn(rank, world, *args)
    # Leave together, then skip the interpreter's teardown: a rank whose gloo threads are still
    # winding down while C++ destructors run can abort ("terminate called without an active
    # exception", seen here) after its work succeeded.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0, collective_timeout_s: float = 30.0,
           backend: str = "gloo") -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes joined in one process group.

    Raises ``RuntimeError`` with the failing rank's traceback if a rank raises or dies, and
    ``TimeoutError`` if the ranks have not finished after ``timeout_s`` (a stalled collective
    raises inside the ranks after ``collective_timeout_s``). Never hangs: leftover ranks are
    killed before it returns or raises.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(
            _rank_main, args=(world, init_file, backend, collective_timeout_s, fn, args), nprocs=world, join=False,
            start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                    raise TimeoutError(f"ranks {alive} of {world} still running after {timeout_s:.0f} s; killed")
        except mp.ProcessRaisedException as e:
            raise RuntimeError(f"a rank raised:\n{e}") from None
        except mp.ProcessExitedException as e:
            raise RuntimeError(f"rank {e.error_index} died (exit code {e.exit_code}); the others "
                               "were stopped") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
