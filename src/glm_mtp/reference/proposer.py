"""The eager drafter, ``ReferenceProposer``: the contract (``contract.DraftProposer``) computed
with the reference's own functions.

Row r pairs token ``t_{r+1}`` with the target's hidden ``h_r``, lives in slot r and is rotated at
RoPE position r. A propose writes one row per draft; ``after_verify`` keeps the first row of a
propose always (it pairs the last committed token with the target's own hidden) and trims the
rows of rejected drafts by lowering ``seq_len``. See DESIGN.md §3-§4. A propose may be given a
grammar's matcher (§10: each draft the best allowed token) and leaves each draft's confidence on
the state (§12, ``draft_confidence``).

Every call validates before it changes anything (the checks are ``contract``'s, shared with the
optimized drafter), in the order: the state's owner and its one
caller (``TypeError``/``ValueError``/``RuntimeError``, ``state.use_state``), lifecycle
(``RuntimeError``), arguments (``ValueError``), no-ops (return 0). A refused call leaves the state
byte-identical; a call that fails midway poisons it (``state.writing``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import contract, contract_batch
from .attention import KPoolRowsFn, Rope, rope_for
from .block import REFERENCE_HOOKS, BlockHooks, draft_logits, mtp_rows
from .contract import NOISE_MESSAGE, FeedHidden, Matcher, SampledDrafts, Tokens, sampling_inputs
from .contract_guards import Owner, use_state, writing, writing_all
from .grammar import MatcherRefusedToken, refusal_as_value_error, walking
from .kpool import check_selection, kpool_rows
from .layers import draft_margin, draft_prob, draft_probs, greedy_token, sampled_token
from .numerics import acc_dtype, masked_softmax, up
from .sharing import share_selection
from .state import DrafterState, LayerCache, RowsBackup, rewind_rows, snapshot
from .weights import MtpWeights


class ReferenceProposer:
    """The eager MTP drafter of either family (``MtpConfig.family``): GLM-5's layer, or
    GLM-5.3-Flash's (NoPE MLA, KPool indexer, clamped SwiGLU; DESIGN.md §7).

    Args:
        weights: the MTP layer with the target's embedding and head; states live on its device.
        max_seq_len: the longest sequence a state serves; capped at the model's
            ``max_position_embeddings`` (its DSA context). A state holds
            ``16 * (max_seq_len // 16 + 2)`` rows, so drafts may run a little past it.
        feed_hidden: what draft i > 1 consumes: ``post_norm`` (the drafter's ``x``, the
            default and the right choice for GLM-5) or ``pre_norm`` (the layer output; an ablation).
        kpool: the KPool indexer of a glm5_next layer (``attention.KPoolRowsFn``): the default
            ``kpool.kpool_rows``; ``kpool.kpool_all_rows`` is the dense ablation (every visible
            row attended at every draft step, sharing or not), and experiments wrap either (as its
            ``select``) to measure the selection. Anything else, or a piece other than the default
            on a GLM-5 layer, is refused here (``kpool.check_selection``).

    Index sharing (DESIGN.md §9) follows ``weights.config.index_share_for_mtp_iteration``
    (``MtpWeights.with_index_share`` overrides it): draft steps 2..k of a propose attend draft
    step 1's selection.
    """

    def __init__(self, weights: MtpWeights, max_seq_len: int, feed_hidden: FeedHidden = "post_norm",
                 kpool: KPoolRowsFn = kpool_rows) -> None:
        sizes = contract.drafter_sizes(weights, max_seq_len, feed_hidden)
        check_selection(kpool, weights.config)
        self.weights = weights
        # The head's logit bound (contract.logit_bound) for the temperature rule: read here, once,
        # so a sampled propose reads nothing on the host.
        self.logit_limit = contract.logit_bound(weights)
        self.config = weights.config
        self.max_seq_len = sizes.max_seq_len
        self.blocks = sizes.blocks
        self.capacity = sizes.capacity
        self.feed_hidden: FeedHidden = feed_hidden
        self.hooks = REFERENCE_HOOKS if kpool is kpool_rows else BlockHooks(kpool=kpool)
        self._rope: dict[torch.device, Rope] = {}

    # ---- the contract's simple queries ------------------------------------------------------
    def prefill_hidden_rows(self, max_seq_len: int) -> int:
        return contract.prefill_hidden_rows(max_seq_len, self.max_seq_len)

    def needs_comm(self) -> bool:
        """True when the weights are sharded over ranks (``MtpWeights.shard``): every propose
        then runs collectives (``contract.needs_comm``)."""
        return contract.needs_comm(self.weights)

    def prefill_uses_shared_buffers(self) -> bool:
        return True

    def drafter_rows(self, state: DrafterState) -> int:
        with self.use(state, "drafter_rows"):
            return state.seq_len

    def last_pair_key(self, state: DrafterState) -> int | None:
        with self.use(state, "last_pair_key"):
            return state.seq_len - 1 if state.seq_len > 0 else None

    # ---- lifetime -----------------------------------------------------------------------
    def rope(self, device: torch.device) -> Rope:
        return rope_for(self._rope, self.weights, self.capacity, device)

    def alloc_state(self, device: torch.device | str) -> DrafterState:
        device = contract.state_device(self.weights, device)
        self.rope(device)
        return DrafterState(
            cache=LayerCache.allocate(self.config, self.blocks, self.weights.dtype, device),
            x=torch.zeros(self.config.hidden_size, dtype=self.weights.dtype, device=device),
            device=device,
            owner=Owner(self.weights, self.capacity),
        )

    def use(self, state: DrafterState, call: str):
        """``state.use_state`` for this drafter: its own states only, one caller at a time."""
        return use_state(state, call, type(self).__name__, DrafterState, self.weights, self.capacity)

    def free_state(self, state: DrafterState) -> None:
        """Release the state's rows; a second call is a no-op. A poisoned state is freed too."""
        with self.use(state, "free_state"):
            if state.released:
                return
            state.released = True
            state.cache = None  # type: ignore[assignment]  # a released state drops its cache; the field's type is the live one
            state.x = None  # type: ignore[assignment]  # a released state drops its rows; the field's type is the live one
            state.seq_len = 0
            state.pending = False
            state.last_drafted = 0
            state.confidence = None

    def export_state(self, state: DrafterState) -> dict[str, Tensor]:
        """Every byte the conformance suite compares; rows past ``seq_len`` are never exported.
        Works on a freed or a poisoned state (the bytes as they are)."""
        with self.use(state, "export_state"):
            return snapshot(state, self.weights)

    # ---- context rows ------------------------------------------------------------------
    def _write_rows(self, tokens: Tensor, hiddens: Tensor, row_base: int, state: DrafterState) -> None:
        end = row_base + tokens.shape[0]
        slots = torch.arange(row_base, end, device=state.device)
        mtp_rows(self.weights, tokens, hiddens, slots, state.cache, self.rope(state.device), rows_read=end,
                 hooks=self.hooks)
        state.seq_len = row_base + tokens.shape[0]

    def prefill_drafter(self, prompt_tokens: Tokens, hiddens: Tensor, state: DrafterState) -> int:
        """Write rows ``[0, n-1)`` from prompt ``t_0..t_{n-1}`` and hiddens ``h_0..h_{n-1}``."""
        with self.use(state, "prefill_drafter"):
            contract.check_live(state, "prefill_drafter")
            return contract.write_prefill(prompt_tokens, hiddens, state, self._write_rows, self.weights,
                                          self.max_seq_len)

    def catchup_drafter(self, tokens: Tokens, hiddens: Tensor, row_base: int, pos_base: int,
                        state: DrafterState) -> int:
        """Write rows ``row_base + i`` pairing ``tokens[i] = t_{row_base+i+1}`` with
        ``hiddens[i] = h_{row_base+i}``. ``pos_base`` is ignored: a row's position is its slot."""
        with self.use(state, "catchup_drafter"):
            contract.check_live(state, "catchup_drafter")
            return contract.write_catchup(tokens, hiddens, row_base, pos_base, state, self._write_rows, self.weights,
                                          self.capacity)

    # ---- drafting ----------------------------------------------------------------------
    def propose(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int,
                state: DrafterState, grammar: Matcher | None = None) -> list[int]:
        """Draft ``num_drafts`` tokens after ``last_token``; draft 1 writes row ``position`` from
        ``(last_token, target_hidden)``, draft i > 1 row ``position + i - 1`` from the previous
        draft and the drafter's own hidden. Rewinds first if the drafter is ahead of ``position``.

        ``grammar``: a matcher (``contract.Matcher``, DESIGN.md §10) or None. Draft i is then the
        best token its mask allows after ``d_1 .. d_{i-1}``; the propose stops early (fewer
        drafts) when the matcher is terminated or allows nothing, and leaves it as found."""
        with self.use(state, "propose"), refusal_as_value_error():
            return self._propose(last_token, target_hidden, position, num_drafts, state, grammar=grammar)[0]

    def propose_sampled(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int,
                        temperature: float, noise: Tensor, state: DrafterState,
                        grammar: Matcher | None = None) -> SampledDrafts:
        """``propose`` with sampled drafts: draft i is ``argmax(q_i / noise[i])`` (ties to the
        lower id) with ``q_i = softmax(up(logits_i) / temperature)`` in A (``layers.draft_probs``,
        the temperature rounded to A once), instead of ``argmax(logits_i)``. ``noise``
        (num_drafts, V) in A on the state's device, positive and finite: i.i.d. Exponential(1)
        makes each draft a draw from its ``q_i``; the caller owns the randomness, so every
        backend and device drafts the same tokens. Rows, ``x`` and counters are written as by
        ``propose`` (for the drafts drawn). Returns the drafts and the (k', V) ``q`` of the k'
        drafts drawn (k' < k when a ``grammar`` stops the propose, as in ``propose``; under a
        grammar ``q`` is the masked softmax and the argmax runs over the allowed tokens)."""
        with self.use(state, "propose_sampled"), refusal_as_value_error():
            drafts, q = self._propose(last_token, target_hidden, position, num_drafts, state, (temperature, noise),
                                      "propose_sampled", grammar)
            assert q is not None  # a sampled propose stacks its q_i (empty at k = 0)
            return SampledDrafts(drafts, q)

    def draft_confidence(self, state: DrafterState) -> tuple[Tensor, Tensor]:
        """``(prob, margin)`` of the pending propose's drafts (DESIGN.md §12), each
        ``(last_drafted,)`` in A on the state's device: ``prob[i]`` the pinned (masked)
        softmax probability of draft i (``q_i[d_i]`` after ``propose_sampled``), ``margin[i]``
        its logit minus the best other allowed logit (``+inf`` when it was the only one).
        ``RuntimeError`` when no propose is pending."""
        with self.use(state, "draft_confidence"):
            contract.check_pending(state, "draft_confidence")
            assert state.confidence is not None  # every propose sets it
            return state.confidence

    def sampling_inputs(
        self, temperature: object, noise: object, num_drafts: int, state: DrafterState
    ) -> tuple[float, Tensor]:
        """``sampling_inputs`` for this drafter's weights and ``state``'s device."""
        return sampling_inputs(temperature, noise, num_drafts, self.weights, state.device, self.logit_limit)

    def propose_batch(self, last_tokens: Tokens, target_hiddens: Tensor, positions: Tokens, num_drafts: int,
                      states: list[DrafterState],
                      grammars: list[Matcher | None] | None = None) -> list[list[int]]:
        """``propose`` for many states at once: state b drafts ``num_drafts`` tokens after
        ``last_tokens[b]`` from ``target_hiddens[b]`` (B, H) at ``positions[b]`` under
        ``grammars[b]`` (``grammars``: None, or one matcher or None per state). Every state's
        drafts and bytes are those of ``propose`` on it alone (this reference is that loop).

        Checks: every state's guard first, then the batch's shapes, then each state's
        ``propose`` checks in index order; a refusal names ``states[b]`` and changes no state,
        a matcher that breaks its contract midway included (every state and matcher as found)."""
        call = "propose_batch"
        states = contract_batch.batch_states(call, states)
        with contract_batch.guard_all(call, states, self.use), refusal_as_value_error():
            batch = contract_batch.batch_propose_args(call, last_tokens, target_hiddens, positions, num_drafts, states,
                                                      self.weights, self.capacity, contract.check_live,
                                                      grammars=grammars)
            # Under a grammar a matcher may refuse midway: every state is kept to be put back then.
            backups = ([RowsBackup.take(st, a.position, a.position + a.num_drafts) for a, st in zip(batch.args, states)]
                       if any(a.grammar is not None for a in batch.args) else [])
            drafts: list[list[int]] = []
            with writing_all(states, call):
                for b, (args, st) in enumerate(zip(batch.args, states)):
                    try:
                        drafts.append(self._draft(args, st, call)[0])
                    except MatcherRefusedToken as e:  # state b put itself back; so do the states before it
                        for earlier, backup in zip(states[:b], backups):
                            backup.restore(earlier)
                        raise MatcherRefusedToken(f"{call}: states[{b}]: {e}") from e
            return drafts

    def catchup_batch(self, tokens: Tokens, hiddens: Tensor, row_bases: Tokens,
                      states: list[DrafterState]) -> list[int]:
        """``catchup_drafter`` of one row for many states: state b gets row ``row_bases[b]`` from
        ``tokens[b]`` and ``hiddens[b]`` (B, H), the row a fully accepted propose owes. Returns the
        rows written per state (0 where ``row_bases[b]`` is not the state's ``drafter_rows``).
        Checks as ``propose_batch``'s."""
        call = "catchup_batch"
        states = contract_batch.batch_states(call, states)
        with contract_batch.guard_all(call, states, self.use):
            rows = contract_batch.batch_catchup_args(call, tokens, hiddens, row_bases, states, self.weights,
                                                     self.capacity, contract.check_live)
            with writing_all(states, call):
                for r in rows:
                    self._write_rows(r.token, r.hidden, r.row_base, states[r.b])
            written = [0] * len(states)
            for r in rows:
                written[r.b] = 1
            return written

    def _propose(self, last_token: int | Tensor, target_hidden: Tensor, position: int, num_drafts: int,
                 state: DrafterState, sample: tuple[object, object] | None = None, call: str = "propose",
                 grammar: object = None) -> tuple[list[int], Tensor | None]:
        contract.check_live(state, call)
        args = contract.propose_args(call, last_token, target_hidden, position, num_drafts, state, self.weights,
                                     self.capacity, grammar=grammar)
        return self._draft(args, state, call, sample)

    def _draft(self, args: contract.ProposeArgs, state: DrafterState, call: str,
               sample: tuple[object, object] | None = None) -> tuple[list[int], Tensor | None]:
        """A propose after its checks: the rewind, the draft steps (sharing step 1's selection
        when the config says so, §9; each step's token the best one ``args.grammar`` allows, §10;
        its probability and margin kept for ``draft_confidence``, §12), the counters."""
        position, num_drafts, hidden = args.position, args.num_drafts, args.hidden
        token = (
            args.token
            if isinstance(args.token, Tensor)
            else torch.tensor([args.token], dtype=torch.int64, device=state.device)
        )
        temp = noise = None
        if sample is not None:
            temperature, noise = self.sampling_inputs(*sample, num_drafts, state)
            if num_drafts and not bool(((noise > 0) & (noise < math.inf)).all()):  # NaN fails both
                raise ValueError(NOISE_MESSAGE)
            temp = torch.tensor([temperature], dtype=noise.dtype, device=state.device)
        drafts: list[int] = []
        qs: list[Tensor] = []
        probs: list[Tensor] = []
        margins: list[Tensor] = []
        rope = self.rope(state.device)
        # Index sharing (DESIGN.md §9): step 1 keeps its selection here, later steps attend it;
        # this propose's own, read by nothing else.
        share = share_selection(self.config.index_share_for_mtp_iteration)
        # A matcher that refuses a token its mask allowed leaves the state as found (§10): kept here.
        backup = RowsBackup.take(state, position, position + num_drafts) if args.grammar is not None else None
        with walking(args.grammar, self.config.vocab_size, state.device, args.first) as walk, writing(state, call):
            rewind_rows(state, min(state.seq_len, position))  # rows past position become unreachable
            try:
                for i in range(num_drafts):
                    allowed = None  # (V,) bool: A_{i+1}, the tokens draft i + 1 may be (None: all)
                    if walk is not None:
                        if i:
                            walk.accept(drafts[-1], i)  # d_i, accepted only to find A_{i+1}
                        allowed = walk.allowed()
                        if allowed is None:  # terminated, or nothing allowed: i drafts, no row for step i + 1
                            break
                    slot = torch.tensor([position + i], device=state.device)
                    out = mtp_rows(self.weights, token, hidden, slot, state.cache, rope, rows_read=position + i + 1,
                                   hooks=self.hooks, share=share)
                    logits = draft_logits(self.weights, out.x)  # (1, V) in S
                    if temp is None:
                        token = greedy_token(logits, allowed)  # (1,)
                        dist = masked_softmax(up(logits), allowed)  # (1, V) in A: temperature 1
                    else:
                        assert noise is not None  # set with temp, above
                        dist = draft_probs(logits, temp, allowed)  # (1, V) in A: q
                        qs.append(dist)
                        token = sampled_token(dist, noise[i : i + 1], allowed)  # (1,)
                    probs.append(draft_prob(dist, token))
                    margins.append(draft_margin(logits, token, allowed))
                    drafts.append(int(token[0]))
                    state.x = out.x[0].clone()
                    hidden = out.x if self.feed_hidden == "post_norm" else out.pre_norm
                    state.seq_len = position + i + 1
            except MatcherRefusedToken:
                assert backup is not None
                backup.restore(state)
                raise
        state.pending = True
        state.last_drafted = len(drafts)
        A = acc_dtype(self.weights.dtype)
        empty = torch.zeros(0, dtype=A, device=state.device)
        state.confidence = (torch.cat(probs) if probs else empty, torch.cat(margins) if margins else empty.clone())
        if temp is None:
            return drafts, None
        V = self.config.vocab_size
        return drafts, torch.cat(qs) if qs else torch.zeros(0, V, dtype=temp.dtype, device=state.device)

    def after_verify(self, num_accepted: int, state: DrafterState) -> None:
        """Keep the first ``num_accepted + 1`` rows of the pending propose (never fewer than
        one: the first row is always kept) and trim the rest."""
        with self.use(state, "after_verify"):
            contract.apply_verify(num_accepted, state)
