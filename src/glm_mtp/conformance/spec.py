"""The model of the spec: ``SpecModel`` tracks what DESIGN.md §4 says each call does to a state
(rows, pending, drafted count, freed; under a grammar, §10, how many drafts its automaton lets a
propose return, and whether its matcher refuses midway) and stamps every op (``ops.Op``) with the expected outcome,
so the lockstep checks the baseline against the spec as well as the candidate against the
baseline. The generators that choose the ops live in ``single_state.py`` and ``batched.py``, a
run's scenarios in ``scenarios.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from glm_mtp.reference.config import MtpConfig
from glm_mtp.reference.state import num_blocks

from .grammars import Grammar
from .ops import FOREIGN, Hidden, Op, Sampling, TokenIds, valid_int


@dataclass
class SeqModel:
    """What the spec says one state holds."""

    seq_len: int = 0
    pending: bool = False
    last_drafted: int = 0
    released: bool = False
    drafts: int = 0  # drafts of the latest successful propose, which "dN" tokens may name
    # Index sharing (DESIGN.md §9): the row whose selection the pending propose's steps 2..k
    # attend (its first row p), None when no propose is pending, it drafted fewer than 2 rows, or
    # the drafter does not share. It belongs to that propose alone: verify drops it.
    shared_from: int | None = None


@dataclass
class SpecModel:
    """The spec's bookkeeping of a scenario's states; builds ``Op``s stamped with their outcome.

    Args:
        config: the drafter's config (vocabulary, widths, max context).
        max_seq_len: what the proposers are built with (capped at the model's max context).
        index_share: whether the drafters share step 1's selection across a propose (DESIGN.md
            §9; the scenario's draw, ``Scenario.index_share``).
        grammars: whether the generators draw grammars (§10) and sampled proposes for the
            proposes they make (both backends take them: ``contract.takes_grammars``).
    """

    config: MtpConfig
    max_seq_len: int
    index_share: bool = False
    grammars: bool = False
    seqs: list[SeqModel] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.max_seq_len = min(self.max_seq_len, self.config.max_position_embeddings)
        self.capacity = 16 * num_blocks(self.max_seq_len)
        self.vocab = self.config.vocab_size

    # Each builder checks in the order of DESIGN.md §4 (lifecycle, arguments, no-ops), updates
    # the model when the call succeeds, and returns the op.
    def _lifecycle(self, s: SeqModel) -> str | None:
        return "RuntimeError" if s.released or s.pending else None

    def info(self) -> Op:
        lengths = [0, 1, self.max_seq_len - 1, self.max_seq_len, self.max_seq_len + 1, 10 * self.max_seq_len]
        expected = {"prefill_hidden_rows": [min(n, self.max_seq_len) for n in lengths],
                    "prefill_uses_shared_buffers": True}
        return Op("info", -1, {"lengths": lengths}, "ok", returns=expected)

    def alloc(self, device_fault: bool = False) -> Op:
        if device_fault:
            return Op("alloc", -1, {"device": "other"}, "ValueError", note="alloc on another device than the weights'")
        self.seqs.append(SeqModel())
        return Op("alloc", len(self.seqs) - 1, {"device": "same"}, "ok", rows_after=0)

    def free(self, i: int) -> Op:
        s = self.seqs[i]
        if s.released:
            return Op("free", i, {}, "noop", rows_after=0, note="second free_state: a no-op")
        self.seqs[i] = SeqModel(released=True)
        return Op("free", i, {}, "ok", rows_after=0)

    def prefill(self, i: int, tokens: TokenIds, hiddens: Hidden, note: str = "") -> Op:
        s, n = self.seqs[i], len(tokens)
        args = {"prompt_tokens": tokens, "hiddens": hiddens}
        out = self._lifecycle(s)
        if out is None and (not tokens.valid(self.vocab) or n > self.max_seq_len or not hiddens.valid_for(n)):
            out = "ValueError"
        if out is None and (s.seq_len > 0 or n < 2):
            return Op("prefill", i, args, "noop", returns=0, rows_after=s.seq_len, note=note)
        if out is not None:
            return Op("prefill", i, args, out, rows_after=s.seq_len, note=note)
        s.seq_len = n - 1
        return Op("prefill", i, args, "ok", returns=n - 1, rows_after=s.seq_len, note=note)

    def catchup(self, i: int, tokens: TokenIds, hiddens: Hidden, row_base: Any, pos_base: Any, note: str = "") -> Op:
        s, n = self.seqs[i], len(tokens)
        args = {"tokens": tokens, "hiddens": hiddens, "row_base": row_base, "pos_base": pos_base}
        out = self._lifecycle(s)
        if out is None and (
            not tokens.valid(self.vocab) or not valid_int(row_base) or not valid_int(pos_base)
            or not hiddens.valid_for(n) or row_base + n > self.capacity
        ):
            out = "ValueError"
        if out is None and (row_base != s.seq_len or n == 0):
            return Op("catchup", i, args, "noop", returns=0, rows_after=s.seq_len, note=note)
        if out is not None:
            return Op("catchup", i, args, out, rows_after=s.seq_len, note=note)
        s.seq_len += n
        return Op("catchup", i, args, "ok", returns=n, rows_after=s.seq_len, note=note)

    def propose(self, i: int, token: TokenIds, hidden: Hidden, position: Any, num_drafts: Any, note: str = "",
                grammar: Grammar | None = None, sampling: Sampling | None = None) -> Op:
        """``propose`` (``propose_sampled`` with a ``sampling``), under ``grammar`` when one is
        given: it returns ``grammar.drafts(num_drafts)`` drafts (§10's stop), or a matcher that
        refuses midway is a ``ValueError`` that changes nothing."""
        s = self.seqs[i]
        args = {"last_token": token, "target_hidden": hidden, "position": position, "num_drafts": num_drafts}
        args.update({"grammar": grammar} if grammar is not None else {})
        args.update({"sampling": sampling} if sampling is not None else {})
        out = self._propose_refusal(s, position, num_drafts,
                                    token.valid(self.vocab, single=True) and hidden.valid_for(1), grammar)
        if out is None and grammar is not None and grammar.refuses(num_drafts):
            out, note = "ValueError", self._refusal_note(grammar, num_drafts, note)
        if out is not None:
            return Op("propose", i, args, out, rows_after=s.seq_len, note=note)
        count = grammar.drafts(num_drafts) if grammar is not None else num_drafts
        self._proposed(s, position, count)
        return Op("propose", i, args, "ok", returns=count, rows_after=s.seq_len, note=self._shared_note(s, note))

    @staticmethod
    def _refusal_note(grammar: Grammar, num_drafts: int, note: str) -> str:
        """The note of a propose whose matcher refuses a token its mask allowed (§10)."""
        step = (grammar.liar or 0) - grammar.start + 1
        refusal = f"the matcher refuses draft step {step}'s allowed token: state and matcher as found"
        return f"{note}; {refusal}" if note else refusal

    @staticmethod
    def _shared_note(s: SeqModel, note: str) -> str:
        """The op's note, with the rows a valid propose's later steps attend (§9) when it shares."""
        if s.shared_from is None:
            return note
        shared = f"steps 2..{s.last_drafted} attend row {s.shared_from}'s selection"
        return f"{note}; {shared}" if note else shared

    def _propose_refusal(self, s: Any, position: Any, num_drafts: Any, data_valid: bool,
                         grammar: Grammar | None = None) -> str | None:
        """A propose's refusal on one state, in the contract's order: lifecycle, ``position``, the
        rows held, then the arguments (``data_valid``: its token and hidden), ``num_drafts``, the
        capacity and the grammar (no matcher at all, or one of another vocabulary asked for step 1, §10);
        None when it is valid."""
        out = self._lifecycle(s)
        if out is None and not valid_int(position):
            out = "ValueError"
        if out is None and s.seq_len < position:
            out = "RuntimeError"
        if out is None and (not data_valid or not valid_int(num_drafts) or position + num_drafts > self.capacity):
            out = "ValueError"
        if out is None and grammar is not None and grammar.refused(num_drafts):
            out = "ValueError"
        return out

    def _proposed(self, s: Any, position: int, num_drafts: int) -> None:
        """A valid propose's counters: the rewind, the rows drafted, pending, and (§9) the row
        whose selection its later steps share."""
        s.seq_len = position + num_drafts if num_drafts else min(s.seq_len, position)
        s.pending, s.last_drafted, s.drafts = True, num_drafts, num_drafts
        s.shared_from = position if self.index_share and num_drafts >= 2 else None

    def verify(self, i: int, num_accepted: Any, note: str = "") -> Op:
        s = self.seqs[i]
        args = {"num_accepted": num_accepted}
        out = "RuntimeError" if s.released or not s.pending else None
        if out is None and (not valid_int(num_accepted) or num_accepted > s.last_drafted):
            out = "ValueError"
        if out is not None:
            return Op("verify", i, args, out, rows_after=s.seq_len, note=note)
        keep = min(s.last_drafted, num_accepted + 1)
        s.seq_len -= s.last_drafted - keep
        s.pending, s.last_drafted, s.shared_from = False, 0, None
        return Op("verify", i, args, "ok", rows_after=s.seq_len, note=note)

    # ---- batches: many states in one call (reference/contract.py, "batches") ----------------
    # The order of the checks: the batch's states (a list, each once), rule 0 of every state
    # (a state of another drafter is refused), the batch's shapes (one entry per state, (B, H)
    # rows) and ``num_drafts``, then each state's own checks, those of the single call with one
    # row, in index order. A refusal changes no state; a valid batch is each state's single call.

    def _batch_front(self, states: Sequence[Any], lengths: Sequence[int], hiddens: Hidden) -> str | None:
        """The checks before any state's own: ``ValueError`` or None."""
        B = len(states)
        if len(set(states)) != B or FOREIGN in states:
            return "ValueError"
        if any(n != B for n in lengths) or not hiddens.batch_shape_valid(B):
            return "ValueError"
        return None

    def _batch_op(self, kind: str, states: Sequence[Any], args: dict[str, Any], out: str, returns: Any,
                  note: str) -> Op:
        rows = [None if i == FOREIGN else self.seqs[i].seq_len for i in states]
        return Op(kind, -1, {"states": tuple(states), **args}, out, returns=returns if out == "ok" else None,
                  rows_after=rows, note=note)

    def propose_batch(self, states: Sequence[Any], tokens: TokenIds, hiddens: Hidden, positions: TokenIds,
                      num_drafts: Any, note: str = "",
                      grammars: tuple[Grammar | None, ...] | None = None) -> Op:
        """``propose_batch``: state ``states[b]`` drafts after ``tokens[b]`` from row b of
        ``hiddens`` at ``positions[b]`` under ``grammars[b]``; ``positions`` is a ``TokenIds`` of
        ints (its form: ``list``, or an integer tensor). ``grammars``: one per state (checked with
        the batch's shapes), each state's as its single propose's; a matcher that refuses midway
        refuses the whole batch, every state as found."""
        args = {"last_tokens": tokens, "target_hiddens": hiddens, "positions": positions, "num_drafts": num_drafts}
        args.update({"grammars": grammars} if grammars is not None else {})
        out = self._batch_front(states, (len(tokens), len(positions)), hiddens)
        if out is None and (not valid_int(num_drafts) or (grammars is not None and len(grammars) != len(states))):
            out = "ValueError"
        per_state = grammars if grammars is not None else (None,) * len(states)
        for b, i in enumerate(states):
            if out is not None:
                break
            tok = tokens.ids[b]
            out = self._propose_refusal(self.seqs[i], positions.ids[b], num_drafts,
                                        (isinstance(tok, str) or 0 <= tok < self.vocab) and hiddens.row_valid(b),
                                        per_state[b])
        liar = next((g for g in per_state if g is not None and g.refuses(num_drafts)), None) if out is None else None
        if liar is not None:
            out, note = "ValueError", self._refusal_note(liar, num_drafts, note)
        if out is not None:
            return self._batch_op("propose_batch", states, args, out, None, note)
        counts = [g.drafts(num_drafts) if g is not None else num_drafts for g in per_state]
        for b, i in enumerate(states):
            self._proposed(self.seqs[i], positions.ids[b], counts[b])
        return self._batch_op("propose_batch", states, args, "ok", counts, note)

    def catchup_batch(self, states: Sequence[Any], tokens: TokenIds, hiddens: Hidden, row_bases: TokenIds,
                      note: str = "") -> Op:
        """``catchup_batch``: state ``states[b]`` gets row ``row_bases[b]`` from ``tokens[b]`` and
        row b of ``hiddens`` when ``row_bases[b]`` is its ``drafter_rows`` (else 0 rows)."""
        args = {"tokens": tokens, "hiddens": hiddens, "row_bases": row_bases}
        out = self._batch_front(states, (len(tokens), len(row_bases)), hiddens)
        for b, i in enumerate(states):
            if out is not None:
                break
            s, base, tok = self.seqs[i], row_bases.ids[b], tokens.ids[b]
            out = self._lifecycle(s)
            if out is None and (
                not (isinstance(tok, str) or 0 <= tok < self.vocab) or not valid_int(base) or not hiddens.row_valid(b)
                or base + 1 > self.capacity
            ):
                out = "ValueError"
        if out is not None:
            return self._batch_op("catchup_batch", states, args, out, None, note)
        written = []
        for b, i in enumerate(states):
            s = self.seqs[i]
            written.append(int(row_bases.ids[b] == s.seq_len))
            s.seq_len += written[-1]
        return self._batch_op("catchup_batch", states, args, "ok", written, note)
