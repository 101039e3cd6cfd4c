"""The optimized drafter's device programs: what runs between a call's input fill and its one
read-back. They read no device value on the host, so on CUDA each is captured once (under its
``graphs.GraphKey``) and replayed.

- ``draft_steps`` / ``sampled_draft_steps``: one state's k draft steps, argmax or sampled, gated
  by the device-side input check (``input_check``);
- ``redo_from``: a grammar's redo from a forbidden step (DESIGN.md §10): that step's draft from
  its kept logits under its mask, then the later steps;
- ``masked_sampled_step``: one sampled step drawn under its grammar mask (§10);
- ``catchup``: the spec-decode loop's one-row catch-up, from the state's static inputs;
- ``rows``: context rows (prefill, a longer catch-up), run eagerly;
- ``draft_batch`` / ``catchup_batch``: the same for many states' rows through the same fused
  launches (``optimized/batch.py``), with the batch's bucket and its capture rule; the batch's
  draft steps check their inputs by the same ``input_check``.

The host API (``optimized/proposer.py``) checks the arguments, fills the inputs, runs these,
reads the result back and applies the contract's counters.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Protocol

import torch
from torch import Tensor

from glm_mtp.reference import contract
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.contract import FeedHidden
from glm_mtp.reference.layers import draft_probs, greedy_token, sampled_token
from glm_mtp.reference.numerics import rms_norm
from glm_mtp.reference.sharing import SharedSelection, share_selection
from glm_mtp.reference.weights import MtpWeights

from .batch import BatchBuffers, BatchRows, bucket
from .kernels.confidence import allowed_tokens, masked_argmax_torch, masked_argmax_triton
from .unfused_block import PrimitiveKernels, block_rows, gated_forget
from .graphs import GraphKey, run_program
from .state import DraftBuffers, OptimizedState
from .step import StepKernels, fused_head, fused_rows

# Bits of the device-side check code (out[0]); all set means the propose's inputs were good
# (a sampled propose also sets NOISE_POSITIVE when its noise is positive and finite).
HIDDEN_FINITE, TOKEN_IN_RANGE, NOISE_POSITIVE = 1, 2, 4
CHECK_OK = HIDDEN_FINITE | TOKEN_IN_RANGE
SAMPLED_CHECK_OK = CHECK_OK | NOISE_POSITIVE


def input_check(tokens: Tensor, hiddens: Tensor, vocab_size: int, *, per_row: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The device-side check of a propose's data, one state's or a batch's (no host read): a
    row's inputs are good when its token is in ``[0, vocab_size)`` and its hidden is finite.

    Args:
        tokens: (n,) int64, each row's last token.
        hiddens: (n, H), each row's target hidden.
        vocab_size: the head's vocabulary.
        per_row: ``False`` for one state's inputs (n = 1, its hidden checked whole), ``True``
            for a batch's (each row's hidden apart).

    Returns ``(code, finite, tok_ok)``, each (n,): the check code (``HIDDEN_FINITE`` and
    ``TOKEN_IN_RANGE`` set for what passed), whether the hidden is finite and whether the token
    is in range. The caller gates its writes on them (one state: its own row; a batch: all rows)."""
    tok_ok = (tokens >= 0) & (tokens < vocab_size)  # (n,)
    finite_values = torch.isfinite(hiddens)  # (n, H)
    finite = finite_values.all(dim=1) if per_row else finite_values.all().reshape(1)  # (n,)
    code = finite.long() * HIDDEN_FINITE + tok_ok.long() * TOKEN_IN_RANGE  # (n,)
    return code, finite, tok_ok


class Step(Protocol):
    """One draft step ``i`` of a state's program: from ``(token, hidden)`` (1,), (1, H), the
    block's row at slot ``pos + i`` and the step's draft; returns ``(x, pre_norm, draft)``
    (1, H), (1, H), (1,), with the step's logits (and, where read later, ``x``) kept in ``bufs``."""

    def __call__(self, st: OptimizedState, bufs: DraftBuffers, i: int, token: Tensor, hidden: Tensor, rope: Rope,
                 kept: tuple[Tensor, Tensor] | None, share: SharedSelection | None) -> tuple[Tensor, Tensor, Tensor]:
        ...


class DevicePrograms:
    """One drafter's device programs.

    Args:
        weights: the MTP layer.
        feed_hidden: what draft i > 1 consumes (``post_norm`` or ``pre_norm``).
        primitives: the per-primitive block's kernels (a layer the fused step does not take) and
            the pinned GEMV of a sampled propose's head.
        step: the fused step's kernels, or ``None`` for a layer it does not take.
        rope: the RoPE table of a device.
        captures: whether programs are captured on CUDA (graphs on, no collectives).
    """

    def __init__(self, weights: MtpWeights, feed_hidden: FeedHidden, primitives: PrimitiveKernels,
                 step: StepKernels | None, rope: Callable[[torch.device], Rope], captures: bool) -> None:
        self.weights = weights
        self.config = weights.config
        self.feed_hidden: FeedHidden = feed_hidden
        self.primitives = primitives
        self.step = step
        self.rope = rope
        self.captures = captures

    # ---- one state: run under its key -----------------------------------------------------------
    def run_draft_steps(self, st: OptimizedState, k: int) -> None:
        """``draft_steps``, replayed under its key, or run (``k == 0`` only rewinds: a handful of
        tiny ops, not worth a graph)."""
        run_program(st, GraphKey.draft(k), lambda: self.draft_steps(st, k), capture=self.captures and k > 0)

    def run_sampled_draft_steps(self, st: OptimizedState, k: int) -> None:
        """``sampled_draft_steps``, replayed under its key, or run (``k == 0`` as above)."""
        run_program(st, GraphKey.sampled_draft(k), lambda: self.sampled_draft_steps(st, k),
                    capture=self.captures and k > 0)

    def run_redo_from(self, st: OptimizedState, k: int, first: int) -> None:
        """``redo_from`` step ``first`` of a k-draft propose, replayed under its key, or run."""
        run_program(st, GraphKey.redo(k, first), lambda: self.redo_from(st, k, first), capture=self.captures)

    def run_masked_sampled_step(self, st: OptimizedState, k: int, i: int) -> None:
        """``masked_sampled_step`` ``i`` of a k-draft propose, replayed under its key, or run."""
        run_program(st, GraphKey.masked_sampled_step(k, i), lambda: self.masked_sampled_step(st, k, i),
                    capture=self.captures)

    def run_catchup(self, st: OptimizedState) -> None:
        """The one-row catch-up from the static inputs, replayed under its key, or run."""
        run_program(st, GraphKey.catchup(), lambda: self.catchup(st), capture=self.captures)

    def masked_argmax(self, logits: Tensor, masks: Tensor) -> Tensor:
        """``kernels.masked_argmax_triton``: the kernel where the drafter runs Triton, else its twin."""
        triton = self.step.triton if self.step is not None else self.primitives.use_triton(logits)
        return (masked_argmax_triton if triton else masked_argmax_torch)(logits, masks)

    # ---- one state: the programs ----------------------------------------------------------------
    def draft_steps(self, st: OptimizedState, k: int) -> None:
        """The k argmax draft steps on the state's static buffers: no host reads, so it is
        captured as is.

        Draft 1 writes slot ``pos`` from ``(tok_in, hid_in)``; draft i > 1 slot ``pos + i - 1``
        from the previous draft (straight from its argmax) and the drafter's own hidden. Every
        write (rows, ``x``, the device row count) is gated by the input check ``ok``. Each step's
        logits and rows are kept in ``st.draft_buffers(k)`` (its confidence and a grammar's
        redo read them)."""
        bufs = st.draft_buffers(k, self.config.vocab_size) if k else None
        token = self._check_inputs(st, None)
        self._steps(st, k, bufs, token, st.hid_in, 0, k, self._argmax_step)

    def sampled_draft_steps(self, st: OptimizedState, k: int) -> None:
        """``draft_steps`` with sampled drafts: draft i is ``argmax(q_i / noise[i])`` with ``q_i``
        (the reference's ``draft_probs`` at ``temp``) stored in ``q[i]``, and the input check
        covers the noise too."""
        V = self.config.vocab_size
        bufs = st.draft_buffers(k, V) if k else None
        noise = q = None
        if k:
            noise, q = st.sample_buffers(k, V)
        token = self._check_inputs(st, noise)
        self._steps(st, k, bufs, token, st.hid_in, 0, k, partial(self._sampled_step, noise=noise, q=q, masks=None))

    def redo_from(self, st: OptimizedState, k: int, first: int) -> None:
        """A grammar's redo (DESIGN.md §10) of a k-draft propose from its forbidden step
        ``first`` (0-based), trusting the input check its first run read: that step's row stands
        and its draft is the masked argmax of its kept logits under ``masks[first]``; steps
        ``first + 1 ..`` then run unmasked on the rows of the first run past it."""
        bufs = st.draft_buffers(k, self.config.vocab_size)
        token = self.masked_argmax(bufs.logits[first : first + 1], bufs.masks[first : first + 1])  # (1,)
        st.out[1 + first : 2 + first].copy_(token)
        hidden = self._kept_row(bufs, first)
        begin = first + 1
        gated_forget(st.cache, st.pos + begin, st.ok)  # the rows past it are written again
        self._steps(st, k, bufs, token, hidden, begin, k, self._argmax_step)

    def masked_sampled_step(self, st: OptimizedState, k: int, i: int) -> None:
        """Sampled step ``i`` (0-based) of a k-draft propose under a grammar (DESIGN.md §10):
        draft i drawn from its ``q`` renormalised over ``masks[i]``. Step 0 checks the inputs
        (the noise included) as ``sampled_draft_steps``; a later step trusts the check already
        read and runs from draft ``i - 1`` (``out[i]``) and step i - 1's kept row (the host runs
        one step at a time: step i's mask needs draft i - 1)."""
        V = self.config.vocab_size
        bufs = st.draft_buffers(k, V)
        noise, q = st.sample_buffers(k, V)
        if i == 0:
            token, hidden = self._check_inputs(st, noise), st.hid_in
        else:  # from the previous draft and the previous step's row
            token, hidden = st.out[i : i + 1], self._kept_row(bufs, i - 1)
        self._steps(st, k, bufs, token, hidden, i, i + 1,
                    partial(self._sampled_step, noise=noise, q=q, masks=bufs.masks))

    def catchup(self, st: OptimizedState) -> None:
        """One context row from the static inputs, already checked on the host: slot ``pos``."""
        self.rows(st.tok_in, st.hid_in, st.pos, st)
        st.seq_dev.copy_(st.pos + 1)

    def rows(self, tokens: Tensor, hiddens: Tensor, slots: Tensor, st: OptimizedState) -> None:
        """Context rows (no head): the fused block, or the per-primitive one."""
        if self.step is not None:
            fused_rows(self.weights, tokens, hiddens, slots, st.row_table, self.rope(st.device), st.always, self.step)
        else:
            block_rows(self.weights, tokens, hiddens, slots, st.cache, self.rope(st.device), st.always, self.primitives)

    # ---- one state: the pieces of its programs ------------------------------------------------
    def _check_inputs(self, st: OptimizedState, noise: Tensor | None) -> Tensor:
        """The state's input check (``input_check``, and with ``noise`` (k, V) its values
        positive and finite) into ``st.ok`` and the code ``out[0]``; the rows past ``pos`` made
        unreachable where it passed. Returns the token to look up (1,): ``tok_in``, or a safe 0
        when it is out of range (every write is gated off then)."""
        code, finite, tok_ok = input_check(st.tok_in, st.hid_in, self.config.vocab_size, per_row=False)
        ok = finite & tok_ok  # (1,)
        if noise is not None:
            noise_ok = ((noise > 0) & (noise < math.inf)).all().reshape(1)  # NaN fails both
            code = code + noise_ok.long() * NOISE_POSITIVE
            ok = ok & noise_ok
        st.ok.copy_(ok)
        st.out[:1].copy_(code)
        gated_forget(st.cache, st.pos, st.ok)  # rows past pos become unreachable: their pools incomplete
        return torch.where(tok_ok, st.tok_in, 0)  # a safe row for the lookup when the check fails

    def _kept_row(self, bufs: DraftBuffers, i: int) -> Tensor:
        """Step i's kept row that the next step consumes (1, H): its ``x``, or its layer output."""
        return bufs.xs[i : i + 1] if self.feed_hidden == "post_norm" else bufs.pre[i : i + 1]

    def _steps(self, st: OptimizedState, k: int, bufs: DraftBuffers | None, token: Tensor, hidden: Tensor,
               begin: int, last: int, step: Step) -> None:
        """Steps ``begin`` .. ``last - 1`` of a k-draft propose from ``(token, hidden)`` (1,),
        (1, H), each by ``step``, each draft into ``out[1 + i]``; then, gated by ``ok``: ``x`` the
        last step's, the drafts (-1 where the check failed) and the device row count ``pos + last``."""
        post_norm = self.feed_hidden == "post_norm"
        rope = self.rope(st.device)
        # Index sharing (DESIGN.md §9): draft step 1 keeps its selection in the state's buffer,
        # steps 2..k attend it (the per-primitive block keeps it in the state's SharedSelection).
        sharing = self.config.index_share_for_mtp_iteration
        kept = st.kept.lines(1) if sharing else None
        if begin == 0:
            st.unfused_share = share_selection(sharing)
        share = st.unfused_share
        x = None
        for i in range(begin, last):
            assert bufs is not None  # a step has its buffers (k > 0)
            x, pre_norm, token = step(st, bufs, i, token, hidden, rope, kept, share)
            if not post_norm:
                bufs.pre[i : i + 1].copy_(pre_norm)
            st.out[1 + i : 2 + i].copy_(token)
            hidden = x if post_norm else pre_norm
        if x is not None:
            st.x.copy_(torch.where(st.ok, x[0], st.x))
            st.out[1 : k + 1].copy_(torch.where(st.ok, st.out[1 : k + 1], -1))
        st.seq_dev.copy_(torch.where(st.ok, st.pos + last, st.seq_dev))

    def _argmax_step(self, st: OptimizedState, bufs: DraftBuffers, i: int, token: Tensor, hidden: Tensor, rope: Rope,
                     kept: tuple[Tensor, Tensor] | None,
                     share: SharedSelection | None) -> tuple[Tensor, Tensor, Tensor]:
        """An argmax ``Step``: the fused block and head (the head's launch keeps the logits and
        ``x``), or the per-primitive block and the pinned GEMV."""
        slot = st.pos + i  # (1,)
        if self.step is not None:
            pre_norm = fused_rows(self.weights, token, hidden, slot, st.row_table, rope, st.ok, self.step, kept,
                                  self._index_shared(i))
            # (1, H), (1,): the draft, on the device; the head's launch stores the logits and x
            x, draft = fused_head(self.weights, pre_norm, self.step, bufs.xs[i : i + 1], bufs.logits[i : i + 1])
            return x, pre_norm, draft
        x, pre_norm = block_rows(self.weights, token, hidden, slot, st.cache, rope, st.ok, self.primitives, share)
        logits = self.primitives.linear(x, self.weights.lm_head)  # (1, V): the head, in the pinned GEMV
        bufs.logits[i : i + 1].copy_(logits)
        bufs.xs[i : i + 1].copy_(x)  # what a redo or a stop reads
        return x, pre_norm, greedy_token(logits)  # (1,): argmax on the device

    def _sampled_step(self, st: OptimizedState, bufs: DraftBuffers, i: int, token: Tensor, hidden: Tensor, rope: Rope,
                      kept: tuple[Tensor, Tensor] | None, share: SharedSelection | None, *, noise: Tensor, q: Tensor,
                      masks: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """A sampled ``Step``: the block (fused, then the head's norm; or the per-primitive one)
        and the head's logits whole in the pinned GEMV (``q`` needs them), ``q_i`` into ``q[i]``
        and the draw ``argmax(q_i / noise[i])``. ``masks`` (k, ceil(V / 32)): draw over the
        step's allowed tokens only (``q_i`` renormalised over them), and keep ``x`` (a stop reads
        it); ``None``: every token."""
        slot = st.pos + i  # (1,)
        if self.step is not None:
            pre_norm = fused_rows(self.weights, token, hidden, slot, st.row_table, rope, st.ok, self.step, kept,
                                  self._index_shared(i))
            x = rms_norm(pre_norm, self.weights.shared_head_norm, self.config.rms_norm_eps)
        else:
            x, pre_norm = block_rows(self.weights, token, hidden, slot, st.cache, rope, st.ok, self.primitives, share)
        logits = self.primitives.linear(x, self.weights.lm_head)  # (1, V): the head, in the pinned GEMV
        bufs.logits[i : i + 1].copy_(logits)
        allowed = None  # every token
        if masks is not None:
            bufs.xs[i : i + 1].copy_(x)  # what a stop reads
            allowed = allowed_tokens(masks[i : i + 1], self.config.vocab_size)  # (1, V)
        q[i : i + 1].copy_(draft_probs(logits, st.temp, allowed))  # the (masked) softmax
        return x, pre_norm, sampled_token(q[i : i + 1], noise[i : i + 1], allowed)  # (1,) on the device

    def _index_shared(self, i: int) -> bool:
        """Whether step i (0-based) attends step 1's kept selection (DESIGN.md §9)."""
        return self.config.index_share_for_mtp_iteration and i > 0

    # ---- batches ------------------------------------------------------------------------------
    def batch_captures(self, bb: BatchBuffers) -> bool:
        """Whether batch programs are captured: only with the Triton kernels, which read the
        per-row address tables on the device (the twins index the states' tensors on the host,
        which a replay would not follow)."""
        return self.captures and self.step is not None and self.step.triton and bb.device.type == "cuda"

    def batch_rows(self, states: int, bb: BatchBuffers, captured: bool) -> int:
        """Rows a batch program of ``states`` states runs: the captured bucket, else exactly them."""
        return bucket(states, bb.max_batch) if captured and self.batch_captures(bb) else states

    def run_draft_batch(self, bb: BatchBuffers, loaded: BatchRows, k: int) -> None:
        """The batch's k draft steps, replayed under the (bucket, k) key or run."""
        run_program(bb, GraphKey.draft(k, rows=loaded.rows), lambda: self.draft_batch(bb, loaded, k),
                    capture=self.batch_captures(bb) and k > 0)

    def run_catchup_batch(self, bb: BatchBuffers, loaded: BatchRows) -> None:
        """The batch's one-row catch-up, replayed under the bucket's key or run."""
        run_program(bb, GraphKey.catchup(rows=loaded.rows), lambda: self.catchup_batch(bb, loaded),
                    capture=self.batch_captures(bb))

    def draft_batch(self, bb: BatchBuffers, loaded: BatchRows, k: int) -> None:
        """The batch's k draft steps on the static buffers: ``draft_steps`` with rows for states
        (the fused step only), each row checked by ``input_check``; one bad row refuses the
        batch. No host reads."""
        step = self.step
        assert step is not None, "a batch's programs run the fused step"
        n = loaded.rows
        tok, hid, pos = bb.tok_in[:n], bb.hid_in[:n], bb.pos[:n]
        rope = self.rope(bb.device)
        V = self.config.vocab_size
        out = bb.out(k)[:n]  # (n, k + 1)
        code, finite, tok_ok = input_check(tok, hid, V, per_row=True)  # (n,) each
        out[:, 0].copy_(code)
        bb.ok.copy_((finite & tok_ok).all().reshape(1))  # one bad row refuses the batch
        if self.config.is_next:  # each state's rows past its position are gone: their pools incomplete
            step.pools_forget(self.config, pos, loaded.caches, bb.ok)
        token = torch.where(tok_ok, tok, 0)
        hidden, x = hid, None
        # Index sharing (DESIGN.md §9): one kept selection per state, line b of the buffer.
        sharing = self.config.index_share_for_mtp_iteration
        kept = bb.kept.lines(n) if sharing else None
        steps = bb.step_buffers(k, V) if k else None
        for i in range(k):
            assert steps is not None
            pre_norm = fused_rows(self.weights, token, hidden, pos + i, loaded.caches, rope, bb.ok, step, kept,
                                  self._index_shared(i))
            # (n, H), (n,); the head's launch keeps each row's logits and x (confidence, a grammar's redo)
            x, token = fused_head(self.weights, pre_norm, step, steps.xs[:n, i], steps.logits[:n, i])
            if self.feed_hidden != "post_norm":
                steps.pre[:n, i].copy_(pre_norm)
            out[:, 1 + i].copy_(token)
            hidden = x if self.feed_hidden == "post_norm" else pre_norm
        if x is not None:
            step.scatter_rows(x, loaded.xs, bb.ok)
            out[:, 1:].copy_(torch.where(bb.ok, out[:, 1:], -1))
        step.scatter_rows((pos + k)[:, None], loaded.seqs, bb.ok)

    def catchup_batch(self, bb: BatchBuffers, loaded: BatchRows) -> None:
        """One context row per state, checked on the host (the gate is constant true)."""
        step = self.step
        assert step is not None, "a batch's programs run the fused step"
        n = loaded.rows
        tok, hid, pos = bb.tok_in[:n], bb.hid_in[:n], bb.pos[:n]
        fused_rows(self.weights, tok, hid, pos, loaded.caches, self.rope(bb.device), bb.always, step)
        step.scatter_rows((pos + 1)[:, None], loaded.seqs, bb.always)


def batch_tokens(args: list[contract.ProposeArgs], device: torch.device) -> Tensor:
    """A batch's last tokens as one (B,) int64 tensor (one copy for Python ints)."""
    if all(not isinstance(a.token, Tensor) for a in args):
        return torch.tensor([a.token for a in args], dtype=torch.int64)
    return torch.cat([a.token.to(device=device, dtype=torch.int64).reshape(1) if isinstance(a.token, Tensor)
                      else torch.tensor([a.token], dtype=torch.int64, device=device) for a in args])
