"""``OptimizedProposer``: the reference drafter with static buffers, a CUDA-graph-captured k-draft
propose and exact fused kernels, equal to ``ReferenceProposer`` bit for bit (DESIGN.md §4-§5).

What differs from the reference is scheduling only:

- every buffer is allocated in ``alloc_state``: the paged pools, the static propose inputs
  (token, hidden, position), the device row count, the read-back buffer;
- the k draft steps read the position from the device and pass each draft from its argmax to
  the next embedding lookup on the device; on CUDA they are one captured graph per
  ``num_drafts``, replayed; the drafts come back in one read at the end (``propose``), or stay on
  the device (``propose_device``);
- the input checks that need the data (a finite ``target_hidden``, a token tensor in range) run
  on the device as a flag ``ok`` that gates every state write, and are read back with the drafts:
  a refused propose leaves the state byte-identical, as in the reference, without an extra sync.

``propose_batch`` / ``catchup_batch`` run many states' rows through the same fused launches
(``optimized/batch.py``): static buffers for ``max_batch`` rows per device, each row on its own
state's cache through a device-side address table, one captured program per (bucket,
``num_drafts``) on CUDA; every state's bytes are those of its single calls.

This module is the host side: argument checks, input fills, the read-back, refusals and
counters. The device programs it runs (the k draft steps, the catch-ups, their batched forms)
are ``optimized/programs.py``'s, captured and replayed by ``optimized/graphs.py``.

Every check and counter rule the two drafters share is ``glm_mtp.reference.contract``'s, called
by both. Prefill and catch-up take the contract's host-side checks (a sync, as in the reference)
and run the same fused block in the reference's batches: eagerly, except the one-row catch-up of the spec-decode
loop, which runs from the static buffers as a captured program too.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from glm_mtp.reference import contract, contract_batch
from glm_mtp.reference.attention import Rope, rope_for
from glm_mtp.reference.contract import NOISE_MESSAGE, FeedHidden, Matcher, SampledDrafts, Tokens, sampling_inputs
from glm_mtp.reference.grammar import FirstStep, MatcherRefusedToken, refusal_as_value_error
from glm_mtp.reference.numerics import acc_dtype
from glm_mtp.reference.contract_guards import Owner, check_sound, use_state, writing, writing_all
from glm_mtp.reference.state import DrafterState, snapshot
from glm_mtp.reference.weights import MtpWeights

from .batch import BatchBuffers
from .grammar import Walk, fill_row, first_row, host_masks, refused, walk_greedy
from .kernels.confidence import draft_confidence_torch, draft_confidence_triton
from .unfused_block import KernelMode, PrimitiveKernels, takes_triton, triton_runs_on
from .kernels import KERNEL_DTYPES
from .programs import (
    CHECK_OK, HIDDEN_FINITE, NOISE_POSITIVE, SAMPLED_CHECK_OK, TOKEN_IN_RANGE, DevicePrograms, batch_tokens,
)
from .state import OptimizedState, PendingConfidence, Unsettled
from .step import StepKernels, fusable, step_kernels


def read_back(t: Tensor) -> list[int]:
    """The one device-to-host read of a propose: ``t`` (n,) int64 as Python ints."""
    return t.tolist()


def commit(st: OptimizedState, call: str, position: int, n: int, k: int,
           kept_rows: Callable[[], Tensor] | None = None) -> None:
    """The counters of a propose at ``position`` that kept ``n`` of its ``k`` draft steps:
    ``seq_len = position + n``, pending, ``last_drafted = n``. One that stopped early (``n < k``:
    a grammar's walk) is made exactly a propose asked for ``n`` drafts: ``x`` the last kept
    step's row (``kept_rows()`` (k, H), read only then) or as found (``x_prev``), the device row
    count, and the KPool pools past the rows kept incomplete. ``call`` names the writing call."""
    if n < k:
        assert kept_rows is not None, "a propose that stopped early needs its kept rows"
        with writing(st, call):
            st.x.copy_(kept_rows()[n - 1] if n else st.x_prev)
            st.seq_dev.fill_(position + n)
            if st.cache.kpool is not None:
                st.cache.kpool.forget_from(position + n)
    st.seq_len, st.pending, st.last_drafted = position + n, True, n


class OptimizedProposer:
    """The GLM-5 MTP drafter for production: ``ReferenceProposer``'s constructor, contract and
    bytes, with static buffers, CUDA-graph replay and fused kernels.

    Args:
        weights: the MTP layer with the target's embedding and head; states live on its device.
        max_seq_len: the longest sequence a state serves (capped at the model's DSA context);
            a state holds ``16 * (max_seq_len // 16 + 2)`` rows.
        feed_hidden: what draft i > 1 consumes: ``post_norm`` (default) or ``pre_norm``.
        kernels: ``auto`` (Triton kernels on CUDA, their proven-equal torch twins on CPU),
            ``triton`` (kernels everywhere; on CPU needs ``TRITON_INTERPRET=1`` before triton is
            imported) or ``torch`` (twins everywhere).
        cuda_graphs: capture and replay the k-draft propose on CUDA (the default); off runs the
            same program eagerly.
        max_batch: the most states one ``propose_batch`` / ``catchup_batch`` takes; the static
            batch buffers hold this many rows.
    """

    def __init__(self, weights: MtpWeights, max_seq_len: int, feed_hidden: FeedHidden = "post_norm", *,
                 kernels: KernelMode = "auto", cuda_graphs: bool = True, max_batch: int = 16) -> None:
        # The contract's argument checks and sizes (the reference's, the same function).
        sizes = contract.drafter_sizes(weights, max_seq_len, feed_hidden)
        if weights.block_scaled and not fusable(weights):  # only the fused step's kernels read fp8 bytes
            raise ValueError("OptimizedProposer: block-scaled fp8 weights (DESIGN.md §8) run in the fused step only "
                             f"(GLM-5's family, a MoE layer, no shards, storage dtype one of {KERNEL_DTYPES}), got "
                             f"storage {weights.dtype}; draft them with ReferenceProposer, or pass "
                             "weights.dequantize(...)")
        if kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be 'auto', 'triton' or 'torch', got {kernels!r}")
        if kernels == "triton" and (why := triton_runs_on(weights.device)) is not None:
            raise ValueError(f"kernels='triton' cannot run here: {why}")
        self.weights = weights
        # The head's logit bound (contract.logit_bound) for the temperature rule: read here, once,
        # so a sampled propose reads nothing on the host.
        self.logit_limit = contract.logit_bound(weights)
        self.config = weights.config
        self.max_seq_len = sizes.max_seq_len
        self.blocks = sizes.blocks
        self.capacity = sizes.capacity
        self.feed_hidden: FeedHidden = feed_hidden
        self._rope: dict[torch.device, Rope] = {}
        self.primitives = PrimitiveKernels(kernels)
        # The fused step (optimized/step.py) runs GLM-5's MTP layer; other layers (a dense MLP,
        # shards, float64) take the per-primitive block.
        step = step_kernels(takes_triton(kernels, weights.embed_tokens)) if fusable(weights) else None
        self.cuda_graphs = bool(cuda_graphs)
        self.max_batch = contract.check_int("max_batch", max_batch, 1)
        self._batch: dict[torch.device, BatchBuffers] = {}
        # No collectives in a captured program: sharded weights all-gather / all-reduce eagerly.
        self.programs = DevicePrograms(weights, feed_hidden, self.primitives, step, self.rope,
                                       captures=self.cuda_graphs and weights.shard_spec is None)

    # ---- the contract's simple queries ------------------------------------------------------
    def prefill_hidden_rows(self, max_seq_len: int) -> int:
        """How many hidden rows the target must capture at prefill."""
        return contract.prefill_hidden_rows(max_seq_len, self.max_seq_len)

    def needs_comm(self) -> bool:
        """True when the weights are sharded over ranks (``contract.needs_comm``): every propose
        then runs the reference's collectives, eagerly (a sharded drafter is never captured)."""
        return contract.needs_comm(self.weights)

    def prefill_uses_shared_buffers(self) -> bool:
        """True: context rows use the caller's workspace (``x`` is left as it is)."""
        return True

    def drafter_rows(self, state: DrafterState) -> int:
        """Rows held (``seq_len``)."""
        with self._use(state, "drafter_rows") as st:
            self._settle(st)
            return st.seq_len

    def last_pair_key(self, state: DrafterState) -> int | None:
        """The newest row's slot, ``seq_len - 1``, or ``None`` without rows."""
        with self._use(state, "last_pair_key") as st:
            self._settle(st)
            return st.seq_len - 1 if st.seq_len > 0 else None

    def rope(self, device: torch.device) -> Rope:
        """The RoPE table of ``device`` (the reference's table, built once per device)."""
        return rope_for(self._rope, self.weights, self.capacity, device)

    # ---- lifetime -----------------------------------------------------------------------
    def alloc_state(self, device: torch.device | str) -> OptimizedState:
        """A fresh state (``seq_len = 0``) with every buffer a propose will touch."""
        device = contract.state_device(self.weights, device)
        self.rope(device)
        if self.step is not None:
            self._batch_on(device, "alloc_state")
        return OptimizedState.allocate(self.config, self.blocks, self.weights.dtype, device,
                                       Owner(self.weights, self.capacity))

    def free_state(self, state: DrafterState) -> None:
        """Release every buffer and captured graph; a second call is a no-op. A poisoned state
        is freed too."""
        with self._use(state, "free_state") as st:
            if not st.released:
                st.release()

    def reset_state(self, state: DrafterState) -> None:
        """Make a live state fresh again (as ``alloc_state`` returns it) in place, keeping its
        buffers and captured graphs: an engine that reuses states for new sequences skips the
        allocation and the one-off graph capture of each ``num_drafts``. It also makes a poisoned
        state sound again: every byte it holds is rewritten."""
        with self._use(state, "reset_state") as st:
            if st.released:
                raise RuntimeError("reset_state: the state was freed (free_state); allocate a new one")
            st.unsettled, st.deferred_error = None, None
            with writing(st, "reset_state"):
                st.cache.kv_pool.zero_()
                st.cache.index_pool.zero_()
                if st.cache.kpool is not None:
                    st.cache.kpool.gates.zero_()
                    st.cache.kpool.keys.zero_()
                    st.cache.kpool.complete.zero_()
                st.x.zero_()
                st.seq_dev.zero_()
            st.seq_len, st.pending, st.last_drafted = 0, False, 0
            st.poisoned = None

    def export_state(self, state: DrafterState) -> dict[str, Tensor]:
        """Every byte the conformance suite compares: the reference's keys, shapes and dtypes."""
        with self._use(state, "export_state") as st:
            self._settle(st)
            return snapshot(st, self.weights)  # once settled, the state's fields are the reference's

    # ---- validation ---------------------------------------------------------------------
    def _use(self, state: DrafterState, call: str):
        """The reference's guard (``state.use_state``) with this backend's state type."""
        return use_state(state, call, type(self).__name__, OptimizedState, self.weights, self.capacity)

    def _settle(self, st: OptimizedState) -> None:
        """Confirm an outstanding ``propose_device`` (one read of its check code). If its inputs
        were bad, restore the counters it replaced (the device state never changed) and keep the
        error for the next mutating call."""
        if st.unsettled is None or st.released:
            return
        code = read_back(st.out[:1])[0]
        u, st.unsettled = st.unsettled, None  # only once read: an interrupt above leaves it unsettled
        if code != CHECK_OK:
            st.seq_len, st.pending, st.last_drafted = u.seq_len, False, 0
            st.deferred_error = (
                f"propose_device: {self._refusal(code, st.tok_in)}; that propose of {u.num_drafts} drafts was "
                "discarded and left the state unchanged"
            )

    def _check_live(self, st: OptimizedState, call: str) -> None:
        """The contract's lifecycle checks, after settling and raising a deferred error."""
        self._settle(st)
        check_sound(st, call)
        self._raise_deferred(st)
        contract.check_live(st, call)

    @staticmethod
    def _raise_deferred(st: OptimizedState) -> None:
        if st.deferred_error is not None:
            message, st.deferred_error = st.deferred_error, None
            raise ValueError(message)

    def _propose_inputs(self, st: OptimizedState, call: str, last_token: int | Tensor, target_hidden: Tensor,
                        position: int, num_drafts: int, sample: tuple[object, object] | None = None,
                        grammar: object = None) -> tuple[int, int, FirstStep | None]:
        """The contract's propose checks (``contract.propose_args``), minus the ones that read
        the data (a token tensor's range, the hidden's finiteness, a sampled propose's noise
        values): those run on the device. Fills the static inputs (with ``sample = (temperature,
        noise)``, the temperature and the noise too). Returns ``(position, num_drafts, first)``,
        ``first`` the grammar's answer for draft step 1, asked with the checks, before any write
        (None without a grammar or drafts)."""
        self._check_live(st, call)
        args = contract.propose_args(call, last_token, target_hidden, position, num_drafts, st, self.weights,
                                     self.capacity, device_checks=True, grammar=grammar)
        if sample is not None:
            try:
                temperature, noise = sampling_inputs(*sample, args.num_drafts, self.weights, st.device,
                                                     self.logit_limit)
            except ValueError:
                contract.check_args_data(args, self.weights)  # the data checks come first (on refusal only: a read)
                raise
        # Static inputs: copies and fills enqueue on the device, nothing comes back.
        with writing(st, call):
            self._fill_inputs(st, args)
            if args.num_drafts:  # allocated before a program first runs (and is captured) on them
                st.draft_buffers(args.num_drafts, self.config.vocab_size)
            if sample is not None:
                st.temp.fill_(temperature)  # already rounded to A by the check: exact
                if args.num_drafts:
                    st.sample_buffers(args.num_drafts, self.config.vocab_size)[0].copy_(noise)
        return args.position, args.num_drafts, args.first

    @staticmethod
    def _fill_inputs(st: OptimizedState, args: contract.ProposeArgs) -> None:
        """A propose's static inputs: the token, the hidden, the position."""
        if isinstance(args.token, Tensor):
            st.tok_in.copy_(args.token)
        else:
            st.tok_in.fill_(args.token)
        st.hid_in.copy_(args.hidden)
        st.pos.fill_(args.position)

    # ---- drafting ----------------------------------------------------------------------
    @property
    def step(self) -> StepKernels | None:
        """The fused step's kernels (``programs.step``), or ``None`` for a layer it does not take."""
        return self.programs.step

    @property
    def captures(self) -> bool:
        """Whether programs are captured on CUDA: graphs on, and no collectives in the block
        (sharded weights all-gather / all-reduce, which this backend does not capture)."""
        return self.programs.captures

    def propose(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int,
                state: DrafterState, grammar: Matcher | None = None) -> list[int]:
        """Draft ``num_drafts`` tokens after ``last_token`` (see ``ReferenceProposer.propose``);
        the k steps run without a host sync and the drafts come back in one read at the end.

        ``grammar``: a matcher (DESIGN.md §10): the drafts are drafted unmasked and read back once
        as without one, then the host walks the matcher; a forbidden draft costs one redo program
        from its step and one more read-back (``optimized.grammar``). The propose may stop early
        (fewer drafts); the matcher is rolled back to how it was found.

        Raises what the reference raises for the same input, leaving the state byte-identical."""
        with self._use(state, "propose") as st, refusal_as_value_error():
            position, k, first = self._propose_inputs(st, "propose", last_token, target_hidden, position,
                                                      num_drafts, grammar=grammar)
            constrained = grammar is not None and k > 0
            with writing(st, "propose"):
                restore = self._keep_for_restore(st, position, k) if constrained else None
                self.programs.run_draft_steps(st, k)
                values = read_back(st.out[: k + 1])  # the one sync: the check code and the drafts
            if not constrained or values[0] != CHECK_OK:
                drafts = self._finish_propose(st, values, position, k)
                self._pending_confidence(st, k, k)
                return drafts
            walk = self._walk(st, grammar, values[1:], position, k, restore, first)
            return self._finish_walk(st, walk, position, k)

    def propose_sampled(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int,
                        temperature: float, noise: Tensor, state: DrafterState,
                        grammar: Matcher | None = None) -> SampledDrafts:
        """``ReferenceProposer.propose_sampled``, the same bytes: the k steps (each draft's
        ``q`` and its draw included) run on the device without a host sync, the drafts come back
        in the one read at the end and ``q`` (k, V) stays on the device (a copy of the static
        buffer). The noise's values are checked on the device, like the hidden.

        ``grammar``: a matcher (DESIGN.md §10): each step draws from its own ``q`` renormalised
        over the step's allowed tokens, so the steps run one per program, each read back (draft
        i's mask needs draft i - 1); ``q`` covers the drafts produced."""
        with self._use(state, "propose_sampled") as st, refusal_as_value_error():
            position, k, first = self._propose_inputs(st, "propose_sampled", last_token, target_hidden, position,
                                                      num_drafts, (temperature, noise), grammar=grammar)
            if grammar is not None and k > 0:
                assert first is not None  # asked with the checks of every propose that drafts under a grammar
                return self._propose_sampled_masked(st, grammar, position, k, first)
            with writing(st, "propose_sampled"):
                self.programs.run_sampled_draft_steps(st, k)
                q = (
                    st.sample_buffers(k, self.config.vocab_size)[1].clone()
                    if k
                    else noise.new_zeros(0, self.config.vocab_size)
                )
                values = read_back(st.out[: k + 1])  # the one sync: the check code and the drafts
            drafts = self._finish_propose(st, values, position, k, sampled=True)
            self._pending_confidence(st, k, k, q=q)
            return SampledDrafts(drafts, q)

    # ---- grammars (DESIGN.md §10) and confidence (§12) ------------------------------------------
    def _keep_for_restore(self, st: OptimizedState, position: int, k: int):
        """Copies of what a grammar propose's program overwrites that a matcher's refusal must put
        back (``x``, and the rows ``[position, seq_len)`` it rewrites with their KPool entries),
        and the function that puts them back (the device row count and the pools a rewrite
        completed included): the state as found."""
        st.x_prev.copy_(st.x)
        held = st.seq_len
        a, b = position, position + k  # every row the propose may write
        cache = st.cache
        kv, ix = cache.kv_pool.flatten(0, 1), cache.index_pool.flatten(0, 1)  # (capacity, ·): slot r is row r
        rows = (kv[a:b].clone(), ix[a:b].clone()) if b > a else None
        kp = cache.kpool
        pools = None
        if kp is not None:
            p0, p1 = a // kp.kpool, -(-(position + k) // kp.kpool)
            pools = (kp.gates[a:b].clone(), kp.keys[p0:p1].clone(), kp.complete.clone(), p0, p1)

        def restore() -> None:
            st.x.copy_(st.x_prev)
            st.seq_dev.fill_(held)
            if rows is not None:
                kv[a:b].copy_(rows[0])
                ix[a:b].copy_(rows[1])
            if pools is not None:
                gates, keys, complete, q0, q1 = pools
                kp.gates[a:b].copy_(gates)
                kp.keys[q0:q1].copy_(keys)
                kp.complete.copy_(complete)

        return restore

    def _walk(self, st: OptimizedState, grammar: Matcher, drafts: list[int], position: int, k: int,
              restore, first: FirstStep | None, call: str = "propose") -> Walk:
        """Walk the matcher over the read-back ``drafts`` (step 1 answered by ``first``); a
        forbidden draft redoes its step and the later ones (``programs.redo_from``) and
        reads them back. A refusal by the matcher puts the state back as found (``restore``)
        before the ``ValueError``; any other failure of the matcher comes after the program wrote
        the rows, so it poisons the state (``writing``), as in the reference."""
        bufs = st.draft_buffers(k, self.config.vocab_size)

        def redo(i: int, masks: Tensor) -> list[int]:
            with writing(st, "propose"):
                bufs.masks[i : i + 1].copy_(masks[i : i + 1], non_blocking=True)
                self.programs.run_redo_from(st, k, i)
                return read_back(st.out[1 + i : k + 1])  # one more sync per forbidden step

        try:
            with writing(st, call):
                return walk_greedy(grammar, drafts, self.config.vocab_size, redo, first)
        except MatcherRefusedToken:
            with writing(st, call):
                restore()
            raise

    def _finish_walk(self, st: OptimizedState, walk: Walk, position: int, k: int) -> list[int]:
        """The counters of a grammar propose that kept ``walk.n`` drafts; a propose that stopped
        early is made exactly one asked for ``walk.n`` drafts: ``x`` the last kept step's (or as
        found), the device row count, the KPool pools past the rows kept incomplete."""
        n = walk.n
        commit(st, "propose", position, n, k, lambda: st.draft_buffers(k, self.config.vocab_size).xs)
        self._pending_confidence(st, k, n, masks=walk.masks)
        return walk.drafts

    def _propose_sampled_masked(self, st: OptimizedState, grammar: Matcher, position: int, k: int,
                                first: FirstStep) -> SampledDrafts:
        """``propose_sampled`` under a grammar: before step i the host stops on a terminated
        matcher or an empty mask (step 1: ``first``, asked with the checks), else copies step i's
        mask to the device and runs the step (``programs.masked_sampled_step``), reads its draft
        back and accepts it. The matcher is asked from step 2 on, after step 1 wrote its row: a
        failure of it then poisons the state (``writing``), as in the reference."""
        V = self.config.vocab_size
        bufs = st.draft_buffers(k, V)
        masks = host_masks(k, V)
        drafts: list[int] = []
        accepted = 0
        with writing(st, "propose_sampled"):
            restore = self._keep_for_restore(st, position, k)
        try:
            for i in range(k):
                with writing(st, "propose_sampled"):  # a refusal (MatcherRefusedToken) restores, never poisons
                    if i:  # d_{i-1}, accepted only to find A_i (the reference's walk)
                        if not grammar.accept_token(drafts[-1]):
                            restore()
                            raise refused(grammar, i, drafts[-1])
                        accepted += 1
                    go = (first_row(first, masks, V) if i == 0
                          else not grammar.is_terminated() and fill_row(grammar, masks, i, V))
                if not go:
                    break
                with writing(st, "propose_sampled"):
                    bufs.masks[i : i + 1].copy_(masks[i : i + 1], non_blocking=True)
                    self.programs.run_masked_sampled_step(st, k, i)
                    values = read_back(st.out[: i + 2])  # the check code and the drafts so far
                if i == 0 and values[0] != SAMPLED_CHECK_OK:
                    raise ValueError(self._refusal(values[0], st.tok_in))  # nothing was written
                drafts.append(values[i + 1])
        finally:
            if accepted:
                grammar.rollback(accepted)
        n = len(drafts)
        if n == 0:  # no step ran, so the device never checked the data: the host does (a read, this case only)
            noise = st.sample_buffers(k, V)[0]
            tok_ok = bool(((st.tok_in >= 0) & (st.tok_in < V)).all())
            code = (int(bool(torch.isfinite(st.hid_in).all())) * HIDDEN_FINITE + int(tok_ok) * TOKEN_IN_RANGE
                    + int(bool(((noise > 0) & (noise < math.inf)).all())) * NOISE_POSITIVE)
            if code != SAMPLED_CHECK_OK:
                raise ValueError(self._refusal(code, st.tok_in))
        q = st.sample_buffers(k, V)[1][:n].clone()
        commit(st, "propose_sampled", position, n, k, lambda: bufs.xs)
        self._pending_confidence(st, k, n, masks=masks[:n], q=q)
        return SampledDrafts(drafts, q)

    def _pending_confidence(self, st: OptimizedState, k: int, n: int, masks: Tensor | None = None,
                            q: Tensor | None = None) -> None:
        """Record what ``draft_confidence`` reads for the propose just made (``n`` of its ``k``
        steps kept): views of the kept logits and drafts, the host masks, a sampled propose's q."""
        bufs = st.draft_buffers(k, self.config.vocab_size) if k else None
        st.confidence_inputs = PendingConfidence(bufs.logits[:n] if bufs else None, st.out[1 : n + 1], masks, q)

    def draft_confidence(self, state: DrafterState) -> tuple[Tensor, Tensor]:
        """``(prob, margin)`` of the pending propose's drafts (DESIGN.md §12): two tensors
        ``(last_drafted,)`` in A (float32; float64 for float64 weights) on the state's device,
        computed on first call from the logits the head kept (one launch,
        ``kernels.draft_confidence_triton``; no host sync) and valid until the next call that changes
        the state. ``prob[i]``: the pinned (masked, under a grammar)
        softmax probability of draft i (a sampled propose: ``q_i[d_i]``); ``margin[i]``: its
        logit minus the best other allowed logit (``+inf`` when it is the only one allowed).
        ``RuntimeError`` when no propose is pending."""
        with self._use(state, "draft_confidence") as st:
            self._settle(st)
            contract.check_pending(st, "draft_confidence")
            if st.confidence_inputs is None:
                raise RuntimeError("draft_confidence: no propose is pending (a propose's confidences are read before "
                                   "its after_verify)")
            c = st.confidence_inputs
            if c.result is None:
                c.result = self._confidence(c, st.device)
            return c.result

    def _confidence(self, c: PendingConfidence, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(prob, margin)`` in A, the reference's accumulation dtype (float32; float64 for
        float64 weights, DESIGN.md §12), from ``c``'s kept logits (a sampled propose: prob from q)."""
        A = acc_dtype(self.weights.dtype)
        if c.logits is None or c.logits.shape[0] == 0:
            empty = torch.zeros(0, dtype=A, device=device)
            return empty, empty.clone()
        masks = c.masks.to(device, non_blocking=True) if c.masks is not None else None
        triton = self.step.triton if self.step is not None else self.primitives.use_triton(c.logits)
        confidence = draft_confidence_triton if triton else draft_confidence_torch
        prob, margin = confidence(c.logits, c.tokens, masks)
        if c.q is not None:  # a sampled draft's probability is its q at the temperature drawn from
            prob = c.q.gather(1, c.tokens[:, None])[:, 0].to(A)  # q is in A already: no rounding
        return prob, margin

    def _finish_propose(self, st: OptimizedState, values: list[int], position: int, k: int,
                        sampled: bool = False) -> list[int]:
        """``propose`` after its read-back: the refusal of bad data (nothing was written), or the counters."""
        if values[0] != (SAMPLED_CHECK_OK if sampled and k else CHECK_OK):
            raise ValueError(self._refusal(values[0], st.tok_in))
        commit(st, "propose", position, k, k)
        return values[1:]

    def _refusal(self, code: int, tok_in: Tensor) -> str:
        """What a propose's failed device-side check ``code`` says: the token out of range (its id
        read back from ``tok_in``), else the hidden, else the noise (a sampled propose)."""
        if not code & TOKEN_IN_RANGE:
            bad = read_back(tok_in)[0]
            return f"last_token: token id {bad} is outside [0, vocab_size={self.config.vocab_size})"
        if not code & HIDDEN_FINITE:
            return "target_hidden holds NaN or inf"
        return NOISE_MESSAGE

    def propose_device(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int,
                       state: DrafterState) -> Tensor:
        """``propose`` without any host sync: returns the drafts as a ``(num_drafts,)`` int64
        tensor on the state's device, a view of a static buffer that the state's next propose
        overwrites (copy it to keep it).

        The checks that read data (``target_hidden`` finite, a token tensor in range) run on the
        device. If one fails, nothing on the device changes, the returned drafts are all -1,
        and the host learns it at the next call on the state: queries (``drafter_rows``,
        ``export_state``, ...) then show the state as before this call, and the next mutating
        call (``after_verify``, ``propose``, ``catchup_drafter``, ...) raises ``ValueError``
        naming the input, without changing anything. Every other check (lifecycle, shapes,
        dtypes, Python-int ranges, capacity) raises here, as in ``propose``."""
        with self._use(state, "propose_device") as st:
            self._settle(st)
            before = st.seq_len
            position, k, _ = self._propose_inputs(st, "propose_device", last_token, target_hidden, position,
                                                  num_drafts)
            with writing(st, "propose_device"):
                self.programs.run_draft_steps(st, k)
            commit(st, "propose_device", position, k, k)
            st.unsettled = Unsettled(seq_len=before, num_drafts=k)
            self._pending_confidence(st, k, k)
            return st.out[1 : k + 1]

    # ---- batches --------------------------------------------------------------------------
    def propose_batch(self, last_tokens: Tokens, target_hiddens: Tensor, positions: Tokens, num_drafts: int,
                      states: list[DrafterState], grammars: list[Matcher | None] | None = None) -> list[list[int]]:
        """``ReferenceProposer.propose_batch``, the same bytes per state: the B states' rows run
        through each fused launch together (one read of every weight per draft step for all of
        them), each row on its own state's cache; on CUDA one captured program per (bucket,
        ``num_drafts``) replays. The data checks (token tensors in range, hiddens finite) run on
        the device and gate every write of every state: a bad row refuses the whole batch,
        naming ``states[b]``, with every state byte-identical. One read-back at the end.

        ``grammars``: None, or one matcher or None per state (DESIGN.md §10): the batch drafts
        unmasked and reads back once as without them, then each state's matcher is walked in
        index order; a state with a forbidden draft is redone alone from that step (its kept
        logits and rows handed to its own buffers, ``propose``'s redo program). A matcher that
        refuses a token its mask allowed puts every state back as found and raises naming
        ``states[b]``. Each state's confidence is computed with the batch (one launch).

        A layer the fused step does not run (``step.fusable``) drafts the states one by one,
        after checking every state's data on the host."""
        call = "propose_batch"
        states = self._batch_states(call, states)
        with contract_batch.guard_all(call, states, self._use), refusal_as_value_error():
            has_step_kernels = self.step is not None  # the fused step's kernel set takes this layer
            batch = contract_batch.batch_propose_args(call, last_tokens, target_hiddens, positions, num_drafts, states,
                                                      self.weights, self.capacity, self._check_live,
                                                      device_checks=has_step_kernels, grammars=grammars)
            k = batch.num_drafts
            if not states:
                return []
            if not has_step_kernels:
                return self._propose_each(states, batch.args, k, call)
            constrained = k > 0 and any(a.grammar is not None for a in batch.args)
            bb = self._batch_on(states[0].device, call)
            rows = self.programs.batch_rows(len(states), bb, captured=k > 0)
            if k:  # allocated before a program first runs (and is captured) on them
                bb.step_buffers(k, self.config.vocab_size)
            with bb.claim(call):
                with writing_all(states, call):
                    # a matcher's refusal puts every state back (the batch program wrote them all)
                    restores = [self._keep_for_restore(st, a.position, k) for st, a in zip(states, batch.args)
                                ] if constrained else []
                    loaded = bb.load(states, batch_tokens(batch.args, bb.device), target_hiddens,
                                     [a.position for a in batch.args], rows)
                    self.programs.run_draft_batch(bb, loaded, k)
                    values = read_back(bb.out(k)[: len(states)].flatten())  # the one sync: codes and drafts
                return self._finish_batch(call, bb, states, batch.args, values, k, restores)

    def catchup_batch(self, tokens: Tokens, hiddens: Tensor, row_bases: Tokens,
                      states: list[DrafterState]) -> list[int]:
        """``ReferenceProposer.catchup_batch``, the same bytes: the rows owed (one per state whose
        ``row_bases[b]`` is its ``drafter_rows``) written by one pass of the fused block, each on
        its own state's cache; checks on the host, as ``catchup_drafter``'s."""
        call = "catchup_batch"
        states = self._batch_states(call, states)
        with contract_batch.guard_all(call, states, self._use):
            rows = contract_batch.batch_catchup_args(call, tokens, hiddens, row_bases, states, self.weights,
                                                     self.capacity, self._check_live)
            owed = [states[r.b] for r in rows]
            written = [0] * len(states)
            if not rows:
                return written
            if self.step is None:
                with writing_all(owed, call):
                    for r, st in zip(rows, owed):
                        self._write_rows(r.token, r.hidden, r.row_base, st)
            else:
                bb = self._batch_on(owed[0].device, call)
                n = self.programs.batch_rows(len(owed), bb, captured=True)
                with bb.claim(call), writing_all(owed, call):
                    loaded = bb.load(owed, torch.cat([r.token for r in rows]), torch.cat([r.hidden for r in rows]),
                                     [r.row_base for r in rows], n)
                    self.programs.run_catchup_batch(bb, loaded)
            for r, st in zip(rows, owed):
                st.seq_len = r.row_base + 1
                written[r.b] = 1
            return written

    def batch_buffers(self, device: torch.device | str) -> BatchBuffers:
        """The static buffers of the batched programs on ``device`` (made by its first ``alloc_state``)."""
        device = torch.empty(0, device=device).device
        if device not in self._batch:
            raise ValueError(f"no batch buffers on {device}: allocate a state there first (a fused layer only)")
        return self._batch[device]

    def _batch_on(self, device: torch.device, call: str) -> BatchBuffers:
        """The batched programs' static buffers on ``device``, made on first use: by
        ``alloc_state``, or by a batched call on states another drafter of these weights and this
        capacity allocated (``use_state`` accepts them, as single calls do). Buffers of
        ``max_batch`` rows the device cannot hold are refused naming ``max_batch`` (nothing is kept)."""
        if device not in self._batch:
            try:
                self._batch[device] = BatchBuffers.allocate(self.config, self.blocks, self.weights.dtype, device,
                                                            self.max_batch)
            except (RuntimeError, TypeError, OverflowError, MemoryError) as e:  # out of memory, or past int64 sizes
                why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"{call}: max_batch={self.max_batch}: the batched programs' buffers of that many rows "
                                 f"cannot be allocated on {device} ({why}); construct the drafter with a smaller "
                                 "max_batch") from None
        return self._batch[device]

    def _batch_states(self, call: str, states: object) -> list[DrafterState]:
        states = contract_batch.batch_states(call, states)
        if len(states) > self.max_batch:
            raise ValueError(f"{call}: {len(states)} states, more than this drafter's max_batch={self.max_batch}")
        return states

    def _finish_batch(self, call: str, bb: BatchBuffers, states: list[DrafterState], args: list[contract.ProposeArgs],
                      values: list[int], k: int, restores: list) -> list[list[int]]:
        """``propose_batch`` after its read-back: the refusal naming the first bad row (nothing
        was written); else each grammar's walk (``_walk_batch``), every state's counters and
        drafts, and every state's confidence from the batch's kept logits (one launch)."""
        rows = [values[b * (k + 1) : (b + 1) * (k + 1)] for b in range(len(states))]
        for b, row in enumerate(rows):
            if row[0] != CHECK_OK:
                raise ValueError(f"{call}: states[{b}]: {self._refusal(row[0], bb.tok_in[b : b + 1])}")
        drafts = [row[1:] for row in rows]
        walks = self._walk_batch(call, bb, states, args, drafts, k, restores) if restores else [None] * len(states)
        V = self.config.vocab_size
        steps = bb.step_buffers(k, V) if k else None
        for b, (st, a, walk) in enumerate(zip(states, args, walks)):
            n = k if walk is None else walk.n
            if walk is not None:
                drafts[b] = walk.drafts
            # a redone state's rows are in its own buffers, else in its batch row
            commit(st, call, a.position, n, k,
                   lambda st=st, walk=walk, b=b: st.draft_buffers(k, V).xs if walk.redos else steps.xs[b])
        self._batch_confidence(bb, states, walks, k)
        return drafts

    def _walk_batch(self, call: str, bb: BatchBuffers, states: list[OptimizedState], args: list[contract.ProposeArgs],
                    drafts: list[list[int]], k: int, restores: list) -> list[Walk | None]:
        """Each state's matcher walked over its read-back drafts, in index order. A forbidden draft
        hands the state's kept logits, rows and step-1 selection from the batch's buffers to its
        own (once) and runs ``propose``'s redo program on it. A refusal puts every state back."""
        V = self.config.vocab_size
        steps = bb.step_buffers(k, V)
        walks: list[Walk | None] = [None] * len(states)
        for b, (st, a) in enumerate(zip(states, args)):
            if a.grammar is None:
                continue
            handed = [False]

            def redo(i: int, masks: Tensor, b: int = b, st: OptimizedState = st, a: contract.ProposeArgs = a,
                     handed: list[bool] = handed) -> list[int]:
                bufs = st.draft_buffers(k, V)
                with writing(st, call):
                    if not handed[0]:  # the state's own buffers take over its batch row
                        bufs.logits.copy_(steps.logits[b])
                        bufs.xs.copy_(steps.xs[b])
                        if self.feed_hidden != "post_norm":
                            bufs.pre.copy_(steps.pre[b])
                        st.kept.rows[0].copy_(bb.kept.rows[b])
                        st.kept.count[0].copy_(bb.kept.count[b])
                        st.out[1 : k + 1].copy_(bb.out(k)[b, 1:])
                        st.pos.fill_(a.position)
                        st.ok.fill_(True)
                        handed[0] = True
                    bufs.masks[i : i + 1].copy_(masks[i : i + 1], non_blocking=True)
                    self.programs.run_redo_from(st, k, i)
                    return read_back(st.out[1 + i : k + 1])  # one more sync per forbidden step

            try:
                with writing_all(states, call):  # a matcher failing after the batch wrote every state poisons them all
                    walks[b] = walk_greedy(a.grammar, drafts[b], V, redo, a.first)
            except MatcherRefusedToken as e:
                with writing_all(states, call):
                    for restore in restores:
                        restore()
                raise MatcherRefusedToken(f"{call}: states[{b}]: {e}") from e
        return walks

    def _batch_confidence(self, bb: BatchBuffers, states: list[OptimizedState], walks: list[Walk | None],
                          k: int) -> None:
        """Every state's confidence, computed now from the batch's kept logits (the next batch
        overwrites them): one launch over the B x k steps, a step under no grammar with every
        token allowed (the same bytes as no mask); a redone state's from its own buffers."""
        V, B = self.config.vocab_size, len(states)
        if k == 0:
            for st in states:
                self._pending_confidence(st, 0, 0)
            return
        steps = bb.step_buffers(k, V)
        masks = None
        if any(w is not None for w in walks):
            masks = host_masks(B * k, V)
            words = masks.numpy()
            words[:] = -1
            for b, w in enumerate(walks):
                if w is not None:
                    words[b * k : b * k + w.n] = w.masks.numpy()
        # the drafts (B, k) as one list: always one copy (a strided slice's reshape would copy for
        # some B and k only, so a propose's launches would depend on its k past the steps)
        drafts = bb.out(k)[:B, 1:].clone().reshape(B * k)
        confidence = PendingConfidence(steps.logits[:B].reshape(B * k, V), drafts, masks)
        prob, margin = self._confidence(confidence, bb.device)
        for b, (st, w) in enumerate(zip(states, walks)):
            n = k if w is None else w.n
            if w is not None and w.redos:  # its drafts came from its own redo
                self._pending_confidence(st, k, n, masks=w.masks)
            else:
                st.confidence_inputs = PendingConfidence(None, None, result=(prob[b * k : b * k + n],
                                                                             margin[b * k : b * k + n]))

    def _propose_each(self, states: list[DrafterState], args: list[contract.ProposeArgs], k: int,
                      call: str) -> list[list[int]]:
        """A batch on the per-primitive path: each state's own program in turn (its data was
        checked on the host, so no state can refuse on data midway), each state's grammar walked
        as ``propose`` walks it; a matcher's refusal puts every state back as found."""
        constrained = k > 0 and any(a.grammar is not None for a in args)
        counters = [(st.seq_len, st.pending, st.last_drafted) for st in states]
        restores = []
        drafts = []
        for b, (st, a) in enumerate(zip(states, args)):
            with writing_all(states, call):
                self._fill_inputs(st, a)
                restore = self._keep_for_restore(st, a.position, k) if constrained else None
                restores.append(restore)
                self.programs.run_draft_steps(st, k)
                values = read_back(st.out[: k + 1])
            if a.grammar is None or k == 0:
                drafts.append(values[1:])
                commit(st, call, a.position, k, k)
                self._pending_confidence(st, k, k)
                continue
            try:
                with writing_all(states, call):  # a matcher failing midway poisons every state of the batch
                    walk = self._walk(st, a.grammar, values[1:], a.position, k, restore, a.first, call)
            except MatcherRefusedToken as e:
                with writing_all(states, call):
                    for earlier, put_back, c in zip(states[:b], restores, counters):
                        put_back()
                        earlier.seq_len, earlier.pending, earlier.last_drafted = c
                raise MatcherRefusedToken(f"{call}: states[{b}]: {e}") from e
            drafts.append(self._finish_walk(st, walk, a.position, k))
        return drafts

    def after_verify(self, num_accepted: int, state: DrafterState) -> None:
        """Keep the first ``num_accepted + 1`` rows of the pending propose (at least one) and
        trim the rest: counters only, nothing is copied."""
        with self._use(state, "after_verify") as st:
            self._settle(st)
            check_sound(st, "after_verify")
            self._raise_deferred(st)
            contract.apply_verify(num_accepted, st)  # the contract's checks and counters
            with writing(st, "after_verify"):
                st.seq_dev.fill_(st.seq_len)

    # ---- context rows ------------------------------------------------------------------
    def _write_rows(self, tokens: Tensor, hiddens: Tensor, row_base: int, st: OptimizedState) -> None:
        """Rows ``row_base + i`` from ``(tokens[i], hiddens[i])``: the reference's batch, one call."""
        slots = st.slots[row_base : row_base + tokens.shape[0]]  # (T,), a view: no allocation
        self.programs.rows(tokens, hiddens, slots, st)
        st.seq_len = row_base + tokens.shape[0]
        st.seq_dev.fill_(st.seq_len)

    def prefill_drafter(self, prompt_tokens: Tokens, hiddens: Tensor, state: DrafterState) -> int:
        """Write rows ``[0, n-1)`` from prompt ``t_0..t_{n-1}`` and hiddens ``h_0..h_{n-1}``
        (see ``ReferenceProposer.prefill_drafter``); checks as there, on the host."""
        with self._use(state, "prefill_drafter") as st:
            self._check_live(st, "prefill_drafter")
            return contract.write_prefill(prompt_tokens, hiddens, st, self._write_rows, self.weights, self.max_seq_len)

    def catchup_drafter(self, tokens: Tokens, hiddens: Tensor, row_base: int, pos_base: int,
                        state: DrafterState) -> int:
        """Write rows ``row_base + i`` from ``tokens[i] = t_{row_base+i+1}`` and ``hiddens[i] =
        h_{row_base+i}`` (see ``ReferenceProposer.catchup_drafter``); ``pos_base`` is ignored."""
        with self._use(state, "catchup_drafter") as st:
            self._check_live(st, "catchup_drafter")
            return contract.write_catchup(tokens, hiddens, row_base, pos_base, st, self._write_catchup_rows,
                                          self.weights,
                                          self.capacity)

    def _write_catchup_rows(self, ids: Tensor, hiddens: Tensor, row_base: int, st: OptimizedState) -> None:
        if ids.shape[0] == 1:  # the loop's catch-up after a fully accepted propose: a captured program
            st.tok_in.copy_(ids)
            st.hid_in.copy_(hiddens)
            st.pos.fill_(row_base)
            self.programs.run_catchup(st)
            st.seq_len = row_base + 1
            return
        self._write_rows(ids, hiddens, row_base, st)

def with_triton_kernels(weights: MtpWeights, max_seq_len: int) -> OptimizedProposer:
    """An ``OptimizedProposer`` that runs its Triton kernels on every device (on CPU through the
    interpreter: set ``TRITON_INTERPRET=1`` before triton is imported). A conformance backend:
    ``--candidate glm_mtp.optimized:with_triton_kernels``."""
    return OptimizedProposer(weights, max_seq_len, kernels="triton")


def with_torch_twins(weights: MtpWeights, max_seq_len: int) -> OptimizedProposer:
    """An ``OptimizedProposer`` that runs the kernels' torch twins on every device (CUDA
    included): ``--kernels torch`` of the conformance CLI."""
    return OptimizedProposer(weights, max_seq_len, kernels="torch")
