"""The optimized drafter's per-sequence state: the reference's rows plus every static buffer a
propose reads or writes, all allocated once in ``alloc_state`` and released in ``free_state``.

The host keeps the same counters as the reference (``seq_len``, ``pending``, ``last_drafted``);
the device keeps its own copies of the position and row count, so the k draft steps run (and a
CUDA graph replays them) without reading anything back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.numerics import acc_dtype
from glm_mtp.reference.contract_guards import Owner
from glm_mtp.reference.state import DrafterState, LayerCache

from .kernels.kpool import list_width
from .kernels.paged import RowCaches


@dataclass(frozen=True)
class KeptSelection:
    """Draft step 1's selection, kept on the device for the shared steps of the same propose
    (index sharing, DESIGN.md §9): ``rows`` (lines, K) int64 and ``count`` (lines,) int64, line b
    the list of the propose's b-th row (one line for a state, ``max_batch`` for a batch's
    buffers), as the fused step's selection kernels write them. Step 1 of every sharing propose
    overwrites it before a shared step reads it, so no propose reads another's."""

    rows: Tensor
    count: Tensor

    @classmethod
    def allocate(cls, cfg: MtpConfig, capacity: int, lines: int, device: torch.device) -> KeptSelection:
        """Zeroed buffers as wide as a list over ``capacity`` rows (``selection_width``)."""
        return cls(torch.zeros(lines, selection_width(cfg, capacity), dtype=torch.int64, device=device),
                   torch.zeros(lines, dtype=torch.int64, device=device))

    def lines(self, n: int) -> tuple[Tensor, Tensor]:
        """The first ``n`` lines, ``(rows, count)``: where a propose of ``n`` rows keeps its lists."""
        return self.rows[:n], self.count[:n]


def selection_width(cfg: MtpConfig, capacity: int) -> int:
    """The width of the fused step's row list over a cache of ``capacity`` rows: GLM-5's
    ``min(index_topk, capacity)`` (``select_rows_triton``), glm5_next's best pools' rows and a
    tail (``kpool.list_width`` over the capacity's pools)."""
    if cfg.is_next:
        return list_width(cfg, capacity // cfg.index_kpool)
    return min(cfg.index_topk, capacity)


@dataclass(frozen=True)
class DraftBuffers:
    """What a k-draft propose keeps of each draft step, for the step's confidence (DESIGN.md §12)
    and a grammar's redo from a forbidden step (§10): ``logits`` (k, V) S, the head's logits of
    step i in row i (stored by the head's own launch); ``xs`` (k, H) S, the post-norm rows;
    ``pre`` (k, H) S, the layer outputs (kept only when ``pre_norm`` is fed to the next step);
    ``masks`` (k, ceil(V / 32)) int32, a grammar's bitmask rows on the device (a redone step's
    row is copied in before the redo runs)."""

    logits: Tensor
    xs: Tensor
    pre: Tensor
    masks: Tensor


@dataclass
class PendingConfidence:
    """The inputs of the pending propose's confidence (DESIGN.md §12), and the result once
    computed: ``logits`` (n, V) S, each draft's step logits; ``tokens`` (n,) int64 on the device,
    the drafts; ``masks`` (n, ceil(V / 32)) int32 on the host, the grammar's bitmask rows, or None;
    ``q`` (n, V), a sampled propose's draft distributions (``prob`` is read from them), or None;
    ``result``: ``(prob, margin)`` once computed (or given: a batch computes every state's at once)."""

    logits: Tensor | None
    tokens: Tensor | None
    masks: Tensor | None = None
    q: Tensor | None = None
    result: tuple[Tensor, Tensor] | None = None


@dataclass
class Unsettled:
    """A ``propose_device`` whose device-side input check the host has not read yet: the counters
    it replaced, restored if the check failed."""

    seq_len: int
    num_drafts: int


@dataclass
class OptimizedState(DrafterState):
    """``DrafterState`` (cache, x, counters) plus the static buffers of the optimized drafter.

    Args (beyond ``DrafterState``'s):
        tok_in: (1,) int64, the propose's ``last_token``.
        hid_in: (1, H), the propose's ``target_hidden``.
        pos: (1,) int64, the propose's ``position`` (draft i writes slot ``pos + i``).
        seq_dev: (1,) int64, the device's copy of ``seq_len``.
        row_table: ``cache`` as the cache kernels take it (``kernels.paged.RowCaches``: a one-line
            address table on the device), made once so a captured program reads no host data.
        ok: (1,) bool, this propose's device-side input check; gates every state write.
        always: (1,) bool, constant true: the gate of context rows, checked on the host.
        out: (capacity + 1,) int64, the read-back: ``out[0]`` the check's code (bit 0: hidden
            finite, bit 1: token in range), ``out[1:k+1]`` the drafts (-1 when the check failed).
        slots: (capacity,) int64, ``arange(capacity)``: context rows take slices of it.
        temp: (1,) in A, a sampled propose's temperature.
        kept: draft step 1's selection, read by the propose's shared steps (``KeptSelection``).
        sample_bufs: per ``num_drafts`` k of a sampled propose, its static ``(noise, q)``, each
            (k, V) in A: allocated at the first sampled propose of that k (as its graph is captured).
        draft_bufs: per ``num_drafts`` k, the steps' kept logits and rows (``DraftBuffers``),
            allocated at the first propose of that k.
        x_prev: (H,) S, ``x`` as a grammar propose found it (restored when it stops before draft 1).
        confidence_inputs: the pending propose's confidence inputs (``PendingConfidence``), or None.
        unfused_share: the per-primitive block's index-sharing selection of the last propose (a
            grammar's redo from step i >= 2 attends it, as the propose's later steps did).
        graphs: captured CUDA graphs by ``graphs.GraphKey``: one per ``num_drafts`` (argmax and
            sampled apart), one per redo step and masked sampled step of a grammar's proposes,
            and one for the one-row catch-up.
        graph_pool: the CUDA graphs' shared memory pool (its graphs replay one at a time).
        unsettled: a ``propose_device`` the host has not yet confirmed.
        deferred_error: the message of a discarded ``propose_device``, raised by the next
            mutating call.
    """

    tok_in: Tensor | None = None
    hid_in: Tensor | None = None
    pos: Tensor | None = None
    row_table: RowCaches | None = None
    seq_dev: Tensor | None = None
    ok: Tensor | None = None
    always: Tensor | None = None
    out: Tensor | None = None
    slots: Tensor | None = None
    temp: Tensor | None = None
    kept: KeptSelection | None = None
    sample_bufs: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    draft_bufs: dict[int, DraftBuffers] = field(default_factory=dict)
    x_prev: Tensor | None = None
    confidence_inputs: PendingConfidence | None = None
    unfused_share: Any = None
    graphs: dict[int, Any] = field(default_factory=dict)
    graph_pool: Any = None
    unsettled: Unsettled | None = None
    deferred_error: str | None = None

    @classmethod
    def allocate(
        cls, cfg: MtpConfig, blocks: int, dtype: torch.dtype, device: torch.device, owner: Owner | None = None
    ) -> OptimizedState:
        """Every buffer of one sequence, zeroed (``x`` starts at zero, as in the reference);
        ``owner`` is the allocating drafter (``reference.contract_guards.Owner``)."""
        cache = LayerCache.allocate(cfg, blocks, dtype, device)
        capacity = cache.capacity
        return cls(
            cache=cache,
            x=torch.zeros(cfg.hidden_size, dtype=dtype, device=device),
            device=device,
            owner=owner,
            tok_in=torch.zeros(1, dtype=torch.int64, device=device),
            hid_in=torch.zeros(1, cfg.hidden_size, dtype=dtype, device=device),
            pos=torch.zeros(1, dtype=torch.int64, device=device),
            row_table=RowCaches.of(cache),
            seq_dev=torch.zeros(1, dtype=torch.int64, device=device),
            ok=torch.zeros(1, dtype=torch.bool, device=device),
            always=torch.ones(1, dtype=torch.bool, device=device),
            out=torch.zeros(capacity + 1, dtype=torch.int64, device=device),
            slots=torch.arange(capacity, dtype=torch.int64, device=device),
            temp=torch.ones(1, dtype=acc_dtype(dtype), device=device),
            kept=KeptSelection.allocate(cfg, capacity, 1, device),
            x_prev=torch.zeros(cfg.hidden_size, dtype=dtype, device=device),
        )

    def sample_buffers(self, k: int, vocab_size: int) -> tuple[Tensor, Tensor]:
        """The static ``(noise, q)`` of a sampled propose of ``k`` drafts, allocated on first use."""
        if k not in self.sample_bufs:
            assert self.temp is not None, "sample_buffers: the state is freed"
            A = self.temp.dtype
            self.sample_bufs[k] = (torch.ones(k, vocab_size, dtype=A, device=self.device),
                                   torch.zeros(k, vocab_size, dtype=A, device=self.device))
        return self.sample_bufs[k]

    def draft_buffers(self, k: int, vocab_size: int) -> DraftBuffers:
        """The static ``DraftBuffers`` of a ``k``-draft propose, allocated on first use."""
        if k not in self.draft_bufs:
            H, dt, dev = self.x.shape[0], self.x.dtype, self.device
            self.draft_bufs[k] = DraftBuffers(
                logits=torch.zeros(k, vocab_size, dtype=dt, device=dev), xs=torch.zeros(k, H, dtype=dt, device=dev),
                pre=torch.zeros(k, H, dtype=dt, device=dev),
                masks=torch.zeros(k, -(-vocab_size // 32), dtype=torch.int32, device=dev))
        return self.draft_bufs[k]

    def tensors(self) -> list[Tensor]:
        """Every tensor the state holds (empty once freed)."""
        if self.released:
            return []
        assert self.row_table is not None, "a state holds its address table until released"
        found: list[Tensor | None] = [self.cache.kv_pool, self.cache.index_pool, self.cache.block_table, self.x,
                                      self.row_table.addresses]
        if self.cache.kpool is not None:
            found += [self.cache.kpool.gates, self.cache.kpool.keys, self.cache.kpool.complete]
        found += [self.tok_in, self.hid_in, self.pos, self.seq_dev, self.ok, self.always, self.out, self.slots,
                  self.temp]
        found += [self.kept.rows, self.kept.count] if self.kept is not None else []
        found += [t for pair in self.sample_bufs.values() for t in pair]
        found += [t for b in self.draft_bufs.values() for t in (b.logits, b.xs, b.pre, b.masks)]
        found += [self.x_prev] if self.x_prev is not None else []
        return [t for t in found if t is not None]

    def release(self) -> None:
        """Drop every buffer and captured graph; counters back to a freed state's."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.graph_pool = None
        self.cache = None  # type: ignore[assignment]  # a released state drops its cache; the field's type is the live one
        self.row_table = None
        self.x = None  # type: ignore[assignment]  # a released state drops its rows; the field's type is the live one
        self.tok_in = self.hid_in = self.pos = self.seq_dev = None
        self.ok = self.always = self.out = self.slots = self.temp = None
        self.kept = None
        self.sample_bufs = {}
        self.draft_bufs = {}
        self.x_prev = None
        self.confidence_inputs = None
        self.unfused_share = None
        self.unsettled = None
        self.deferred_error = None
        self.released = True
        self.seq_len = 0
        self.pending = False
        self.last_drafted = 0
