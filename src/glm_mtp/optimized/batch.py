"""Batched drafting: one draft step for many sequences, each weight read once for all of them.

A batch's rows go through the same fused launches as one sequence's row (``step.fused_rows``,
``step.fused_head``); what differs is where each row's cache lives. The cache kernels read a
per-row address table (``kernels.paged.RowCaches``) and the program's last writes (each state's
``x`` and device row count) go through another (``kernels.paged.RowTargets``), so the program
reads and writes only static buffers and the states' own tensors through addresses it is given.

``BatchBuffers`` holds the static inputs of up to ``max_batch`` rows on one device. On CUDA a
batch of B rows runs the program captured for its bucket (the next power of two, at most
``max_batch``), keyed by ``graphs.GraphKey`` (program, num_drafts, bucket); the bucket's spare rows are padding rows
that point at a private scratch state, so they never touch a caller's state. Rows never interact (every
kernel computes each row as if alone), so padding cannot change a real row's bytes.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from glm_mtp.reference.config import MtpConfig

from .kernels.paged import ADDRESS_COLUMNS, RowCaches, RowTargets
from .state import KeptSelection, OptimizedState

def bucket(rows: int, max_batch: int) -> int:
    """The captured batch size serving ``rows`` rows: the next power of two, at most ``max_batch``."""
    return min(max_batch, 1 << max(rows - 1, 0).bit_length())


@dataclass
class BatchBuffers:
    """The static buffers of the batched programs on one device.

    Args:
        max_batch: rows the buffers hold.
        tok_in: (max_batch,) int64, each row's token.
        hid_in: (max_batch, H), each row's hidden.
        pos: (max_batch,) int64, each row's first slot.
        ok: (1,) bool, the batch's device-side input check (all rows good); gates every write.
        always: (1,) bool, constant true: the gate of catch-up rows, checked on the host.
        cache_table: (max_batch, 3) int64, each row's paged cache (``RowCaches``).
        x_table / seq_table: (max_batch,) int64, each row's state ``x`` and device row count.
        kept: draft step 1's selection of each row, read by the shared steps (``KeptSelection``,
            line b the b-th state's: one selection per state).
        outs: per num_drafts k, (max_batch, k + 1) int64: each row's check code, then its drafts.
        steps: per num_drafts k, each row's kept step logits and rows (``BatchSteps``): what a
            state's confidence and a grammar's redo read (DESIGN.md §10, §12).
        pad: the scratch state padding rows read and write.
        graphs / graph_pool: captured programs keyed by ``graphs.GraphKey`` (rows = the bucket), and their pool.
        device: where it all lives.
    """

    max_batch: int
    tok_in: Tensor
    hid_in: Tensor
    pos: Tensor
    ok: Tensor
    always: Tensor
    cache_table: Tensor
    x_table: Tensor
    seq_table: Tensor
    pad: OptimizedState
    kept: KeptSelection
    device: torch.device
    outs: dict[int, Tensor] = field(default_factory=dict)
    steps: dict[int, BatchSteps] = field(default_factory=dict)
    graphs: dict[Any, Any] = field(default_factory=dict)
    graph_pool: Any = None
    user: int | None = None

    @classmethod
    def allocate(cls, cfg: MtpConfig, blocks: int, dtype: torch.dtype, device: torch.device,
                 max_batch: int) -> BatchBuffers:
        i64 = dict(dtype=torch.int64, device=device)
        return cls(
            max_batch=max_batch,
            tok_in=torch.zeros(max_batch, **i64),
            hid_in=torch.zeros(max_batch, cfg.hidden_size, dtype=dtype, device=device),
            pos=torch.zeros(max_batch, **i64),
            ok=torch.zeros(1, dtype=torch.bool, device=device),
            always=torch.ones(1, dtype=torch.bool, device=device),
            cache_table=torch.zeros(max_batch, ADDRESS_COLUMNS, **i64),
            x_table=torch.zeros(max_batch, **i64),
            seq_table=torch.zeros(max_batch, **i64),
            pad=(pad := OptimizedState.allocate(cfg, blocks, dtype, device)),
            kept=KeptSelection.allocate(cfg, pad.capacity, max_batch, device),
            device=device,
        )

    def out(self, k: int) -> Tensor:
        """The (max_batch, k + 1) read-back of a k-draft program, allocated on first use."""
        if k not in self.outs:
            self.outs[k] = torch.zeros(self.max_batch, k + 1, dtype=torch.int64, device=self.device)
        return self.outs[k]

    def step_buffers(self, k: int, vocab_size: int) -> BatchSteps:
        """The ``BatchSteps`` of a k-draft program, allocated on first use."""
        if k not in self.steps:
            H, dt = self.hid_in.shape[1], self.hid_in.dtype
            self.steps[k] = BatchSteps(
                logits=torch.zeros(self.max_batch, k, vocab_size, dtype=dt, device=self.device),
                xs=torch.zeros(self.max_batch, k, H, dtype=dt, device=self.device),
                pre=torch.zeros(self.max_batch, k, H, dtype=dt, device=self.device))
        return self.steps[k]

    def load(self, states: Sequence[OptimizedState], tokens: Tensor, hiddens: Tensor, positions: Sequence[int],
             rows: int) -> BatchRows:
        """Fill the first ``rows`` rows: state b's inputs in row b, padding rows (b >= B) on the
        scratch state with token 0, zero hiddens and slot 0. Host-to-device copies only."""
        B = len(states)
        self.tok_in[:B].copy_(tokens)
        self.hid_in[:B].copy_(hiddens)
        self.pos[:B].copy_(torch.tensor(list(positions), dtype=torch.int64), non_blocking=True)
        if rows > B:
            self.tok_in[B:rows].zero_()
            self.hid_in[B:rows].zero_()
            self.pos[B:rows].zero_()
        owners = list(states) + [self.pad] * (rows - B)
        caches = RowCaches.per_row([st.cache for st in owners], self.cache_table)
        xs = RowTargets.of([st.x for st in owners], self.x_table)
        seqs = RowTargets.of([st.seq_dev for st in owners], self.seq_table)
        return BatchRows(rows, caches, xs, seqs)

    @contextmanager
    def claim(self, call: str) -> Iterator[BatchBuffers]:
        """One batched call at a time on these buffers (a host-side flag, as a state's guard)."""
        with _CLAIM:
            if self.user is not None:
                raise RuntimeError(f"{call}: another batched call (thread {self.user}) is using this drafter's batch "
                                   "buffers; batched calls on one drafter and device run one at a time")
            self.user = threading.get_ident()
        try:
            yield self
        finally:
            self.user = None


_CLAIM = threading.Lock()


@dataclass(frozen=True)
class BatchSteps:
    """What a batch's k draft steps keep per row: ``logits`` (max_batch, k, V) S, row b's step i
    logits (stored by the head's launch); ``xs`` / ``pre`` (max_batch, k, H) S, its post-norm rows
    and layer outputs (``pre`` only when ``pre_norm`` is fed to the next step)."""

    logits: Tensor
    xs: Tensor
    pre: Tensor


@dataclass(frozen=True)
class BatchRows:
    """A loaded batch: ``rows`` rows (padding included), their caches and their states' ``x`` and
    device row counts."""

    rows: int
    caches: RowCaches
    xs: RowTargets
    seqs: RowTargets
