"""The optimized drafter's device programs: what runs between a call's input fill and its one
read-back. They read no device value on the host, so on CUDA each is captured once (under its
``graphs.GraphKey``) and replayed.

- ``draft``: one state's k draft steps, argmax or sampled, gated by the device-side input check;
- ``catchup``: the spec-decode loop's one-row catch-up, from the state's static inputs;
- ``rows``: context rows (prefill, a longer catch-up), run eagerly;
- ``draft_batch`` / ``catchup_batch``: the same for many states' rows through the same fused
  launches (``optimized/batch.py``), with the batch's bucket and its capture rule.

The host API (``optimized/proposer.py``) checks the arguments, fills the inputs, runs these,
reads the result back and applies the contract's counters.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from glm_mtp.reference import contract
from glm_mtp.reference.attention import Rope
from glm_mtp.reference.contract import FeedHidden
from glm_mtp.reference.layers import draft_probs, greedy_token, sampled_token
from glm_mtp.reference.numerics import rms_norm
from glm_mtp.reference.sharing import share_selection
from glm_mtp.reference.weights import MtpWeights

from .batch import BatchBuffers, BatchRows, bucket
from .kernels.confidence import allowed_tokens, masked_argmax_torch, masked_argmax_triton
from .unfused_block import PrimitiveKernels, block_rows, gated_forget
from .graphs import GraphKey, run_program
from .state import OptimizedState
from .step import StepKernels, fused_head, fused_rows

# Bits of the device-side check code (out[0]); all set means the propose's inputs were good
# (a sampled propose also sets NOISE_POSITIVE when its noise is positive and finite).
HIDDEN_FINITE, TOKEN_IN_RANGE, NOISE_POSITIVE = 1, 2, 4
CHECK_OK = HIDDEN_FINITE | TOKEN_IN_RANGE
SAMPLED_CHECK_OK = CHECK_OK | NOISE_POSITIVE


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

    # ---- one state ----------------------------------------------------------------------------
    def run_draft(self, st: OptimizedState, k: int, sampled: bool = False, first: int = 0, last: int | None = None,
                  masked: bool = False) -> None:
        """The k draft steps on ``st`` (or steps ``first`` .. ``last - 1`` of them: a grammar's
        programs, ``draft``): replayed under their key, or run (``k == 0`` only rewinds: a handful
        of tiny ops, not worth a graph)."""
        run_program(st, GraphKey.draft(k, sampled=sampled, first=first, last=last, masked=masked),
                    lambda: self.draft(st, k, sampled, first, last, masked), capture=self.captures and k > 0)

    def run_catchup(self, st: OptimizedState) -> None:
        """The one-row catch-up from the static inputs, replayed under its key, or run."""
        run_program(st, GraphKey.catchup(), lambda: self.catchup(st), capture=self.captures)

    def masked_argmax(self, logits: Tensor, masks: Tensor) -> Tensor:
        """``kernels.masked_argmax_triton``: the kernel where the drafter runs Triton, else its twin."""
        triton = self.step.triton if self.step is not None else self.primitives.use_triton(logits)
        return (masked_argmax_triton if triton else masked_argmax_torch)(logits, masks)

    def draft(self, st: OptimizedState, k: int, sampled: bool = False, first: int = 0, last: int | None = None,
              masked: bool = False) -> None:
        """The k draft steps on the state's static buffers: no host reads, so it is captured as is.

        Draft 1 writes slot ``pos`` from ``(tok_in, hid_in)``; draft i > 1 slot ``pos + i - 1``
        from the previous draft (straight from its argmax) and the drafter's own hidden. Every
        write (rows, ``x``, the device row count) is gated by the input check ``ok``. ``sampled``:
        draft i is ``argmax(q_i / noise[i])`` with ``q_i`` (the reference's ``draft_probs`` at
        ``temp``) stored in ``q[i]``, and the check covers the noise too. Each step's logits and
        rows are kept in ``st.draft_buffers(k)`` (its confidence and a grammar's redo read them).

        A grammar's programs (DESIGN.md §10) run steps ``first`` .. ``last - 1`` only (0-based;
        ``first = 0`` checks the inputs as above, a later first trusts the check already read):
        - greedy, ``first > 0`` or ``masked``: a redo from the forbidden step ``first``, whose row
          stands: its draft is the masked argmax of its kept logits under ``masks[first]``, then
          steps ``first + 1 ..`` run unmasked on the rows of the first run past it;
        - sampled and ``masked``: each step draws from its masked ``q`` under ``masks[i]``, from
          draft ``first - 1`` (``out[first]``) and that step's kept row (the host runs one step
          at a time: step i's mask needs draft i - 1)."""
        V = self.config.vocab_size
        last = k if last is None else last
        bufs = st.draft_buffers(k, V) if k else None
        noise = q = None
        if sampled and k:
            noise, q = st.sample_buffers(k, V)
        post_norm = self.feed_hidden == "post_norm"
        redo = not sampled and (first > 0 or masked)
        if first == 0 and not redo:
            tok_ok = (st.tok_in >= 0) & (st.tok_in < V)  # (1,)
            finite = torch.isfinite(st.hid_in).all().reshape(1)  # (1,)
            code = finite.long() * HIDDEN_FINITE + tok_ok.long() * TOKEN_IN_RANGE
            ok = finite & tok_ok
            if sampled and k:
                noise_ok = ((noise > 0) & (noise < math.inf)).all().reshape(1)  # NaN fails both
                code = code + noise_ok.long() * NOISE_POSITIVE
                ok = ok & noise_ok
            st.ok.copy_(ok)
            st.out[:1].copy_(code)
            gated_forget(st.cache, st.pos, st.ok)  # rows past pos become unreachable: their pools incomplete
            token = torch.where(tok_ok, st.tok_in, 0)  # a safe row for the lookup when the check fails
            hidden = st.hid_in
            begin = 0
        elif redo:  # step `first`'s row stands; its draft comes from its kept logits under its mask
            token = self.masked_argmax(bufs.logits[first : first + 1], bufs.masks[first : first + 1])  # (1,)
            st.out[1 + first : 2 + first].copy_(token)
            hidden = bufs.xs[first : first + 1] if post_norm else bufs.pre[first : first + 1]
            begin = first + 1
            gated_forget(st.cache, st.pos + begin, st.ok)  # the rows past it are written again
        else:  # a sampled step under its mask, from the previous draft and the previous step's row
            token = st.out[first : first + 1]
            hidden = bufs.xs[first - 1 : first] if post_norm else bufs.pre[first - 1 : first]
            begin = first
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
            slot = st.pos + i  # (1,)
            index_shared = sharing and i > 0
            if self.step is not None and not sampled:
                pre_norm = fused_rows(self.weights, token, hidden, slot, st.row_table, rope, st.ok, self.step, kept,
                                      index_shared)
                # (1, H), (1,): the draft, on the device; the head's launch stores the logits and x
                x, token = fused_head(self.weights, pre_norm, self.step, bufs.xs[i : i + 1], bufs.logits[i : i + 1])
            else:
                if self.step is not None:  # sampled: the fused block, then the head's logits whole (q needs them)
                    pre_norm = fused_rows(self.weights, token, hidden, slot, st.row_table, rope, st.ok, self.step, kept,
                                          index_shared)
                    x = rms_norm(pre_norm, self.weights.shared_head_norm, self.config.rms_norm_eps)
                else:
                    x, pre_norm = block_rows(self.weights, token, hidden, slot, st.cache, rope, st.ok, self.primitives,
                                             share)
                logits = self.primitives.linear(x, self.weights.lm_head)  # (1, V): the head, in the pinned GEMV
                bufs.logits[i : i + 1].copy_(logits)
                if not sampled or masked:  # what a redo or a stop reads
                    bufs.xs[i : i + 1].copy_(x)
                if sampled and masked:
                    allowed = allowed_tokens(bufs.masks[i : i + 1], V)  # (1, V)
                    q[i : i + 1].copy_(draft_probs(logits, st.temp, allowed))  # the masked softmax
                    token = sampled_token(q[i : i + 1], noise[i : i + 1], allowed)  # (1,), over the allowed only
                elif sampled:
                    q[i : i + 1].copy_(draft_probs(logits, st.temp))
                    token = sampled_token(q[i : i + 1], noise[i : i + 1])  # (1,) on the device
                else:
                    token = greedy_token(logits)  # (1,): argmax on the device
            if not post_norm:
                bufs.pre[i : i + 1].copy_(pre_norm)
            st.out[1 + i : 2 + i].copy_(token)
            hidden = x if post_norm else pre_norm
        if x is not None:
            st.x.copy_(torch.where(st.ok, x[0], st.x))
            st.out[1 : k + 1].copy_(torch.where(st.ok, st.out[1 : k + 1], -1))
        st.seq_dev.copy_(torch.where(st.ok, st.pos + last, st.seq_dev))

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
        """The batch's k draft steps on the static buffers: the single-state program's steps
        with rows for states. No host reads."""
        n = loaded.rows
        tok, hid, pos = bb.tok_in[:n], bb.hid_in[:n], bb.pos[:n]
        rope = self.rope(bb.device)
        V = self.config.vocab_size
        out = bb.out(k)[:n]  # (n, k + 1)
        tok_ok = (tok >= 0) & (tok < V)  # (n,)
        finite = torch.isfinite(hid).all(dim=1)  # (n,)
        out[:, 0].copy_(finite.long() * HIDDEN_FINITE + tok_ok.long() * TOKEN_IN_RANGE)
        bb.ok.copy_((finite & tok_ok).all().reshape(1))  # one bad row refuses the batch
        if self.config.is_next:  # each state's rows past its position are gone: their pools incomplete
            self.step.pools_forget(self.config, pos, loaded.caches, bb.ok)
        token = torch.where(tok_ok, tok, 0)
        hidden, x = hid, None
        # Index sharing (DESIGN.md §9): one kept selection per state, line b of the buffer.
        sharing = self.config.index_share_for_mtp_iteration
        kept = bb.kept.lines(n) if sharing else None
        steps = bb.step_buffers(k, V) if k else None
        for i in range(k):
            pre_norm = fused_rows(self.weights, token, hidden, pos + i, loaded.caches, rope, bb.ok, self.step, kept,
                                  sharing and i > 0)
            # (n, H), (n,); the head's launch keeps each row's logits and x (confidence, a grammar's redo)
            x, token = fused_head(self.weights, pre_norm, self.step, steps.xs[:n, i], steps.logits[:n, i])
            if self.feed_hidden != "post_norm":
                steps.pre[:n, i].copy_(pre_norm)
            out[:, 1 + i].copy_(token)
            hidden = x if self.feed_hidden == "post_norm" else pre_norm
        if x is not None:
            self.step.scatter_rows(x, loaded.xs, bb.ok)
            out[:, 1:].copy_(torch.where(bb.ok, out[:, 1:], -1))
        self.step.scatter_rows((pos + k)[:, None], loaded.seqs, bb.ok)

    def catchup_batch(self, bb: BatchBuffers, loaded: BatchRows) -> None:
        """One context row per state, checked on the host (the gate is constant true)."""
        n = loaded.rows
        tok, hid, pos = bb.tok_in[:n], bb.hid_in[:n], bb.pos[:n]
        fused_rows(self.weights, tok, hid, pos, loaded.caches, self.rope(bb.device), bb.always, self.step)
        self.step.scatter_rows((pos + 1)[:, None], loaded.seqs, bb.always)


def batch_tokens(args: list[contract.ProposeArgs], device: torch.device) -> Tensor:
    """A batch's last tokens as one (B,) int64 tensor (one copy for Python ints)."""
    if all(not isinstance(a.token, Tensor) for a in args):
        return torch.tensor([a.token for a in args], dtype=torch.int64)
    return torch.cat([a.token.to(device=device, dtype=torch.int64).reshape(1) if isinstance(a.token, Tensor)
                      else torch.tensor([a.token], dtype=torch.int64, device=device) for a in args])
