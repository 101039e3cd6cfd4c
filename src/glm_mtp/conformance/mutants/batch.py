"""Mutants that break a batched call (``propose_batch``, ``catchup_batch``): each state of a
batch must be exactly as its own call alone."""

from __future__ import annotations

from glm_mtp.reference import contract_batch as _contract_batch
from glm_mtp.reference.contract import check_int

from .base import Mutant, swapped


class BatchPermuted(Mutant):
    name = "batch_permuted"
    rule = "propose_batch returns states[b]'s drafts at index b (here: the batch's results rotated by one)"
    generators = ("batched",)

    def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states, grammars=None):
        out = super().propose_batch(last_tokens, target_hiddens, positions, num_drafts, states, grammars)
        return out[1:] + out[:1]  # MUTATION: every state drafted right, returned in the wrong order


class BatchChecksAsItGoes(Mutant):
    name = "batch_checks_as_it_goes"
    rule = "a batched call checks every state before it drafts any: a refusal leaves every state byte-identical"
    generators = ("batched",)

    def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states, grammars=None):
        call = "propose_batch"
        states = _contract_batch.batch_states(call, states)
        B, H = len(states), self.config.hidden_size
        tokens = _contract_batch.batch_values(call, "last_tokens", last_tokens, B)
        hiddens = _contract_batch.batch_hiddens(call, "target_hiddens", target_hiddens, B, H)
        pos = _contract_batch.batch_ints(call, "positions", positions, B)
        check_int("num_drafts", num_drafts)
        matchers = _contract_batch.batch_grammars(call, grammars, B)
        # MUTATION: each state checked and drafted in turn (the single call), not all checked first.
        out = []
        for b, st in enumerate(states):
            with _contract_batch.batch_item(call, b):
                out.append(self.propose(tokens[b], hiddens[b], pos[b], num_drafts, st, grammar=matchers[b]))
        return out


class BatchXOfState0(Mutant):
    name = "batch_x_of_state0"
    rule = "each state of a batch keeps its own drafter hidden x (here: states[0]'s x written into every state)"
    generators = ("batched",)

    def propose_batch(self, last_tokens, target_hiddens, positions, num_drafts, states, grammars=None):
        out = super().propose_batch(last_tokens, target_hiddens, positions, num_drafts, states, grammars)
        if num_drafts and len(states) > 1:
            for st in states[1:]:
                st.x = states[0].x.clone()  # MUTATION
        return out


class CatchupBatchWritesMisaligned(Mutant):
    name = "catchup_batch_writes_misaligned"
    rule = "a catchup_batch row whose row_base is not the state's drafter_rows writes nothing and returns 0 for it"
    generators = ("batched",)

    def catchup_batch(self, tokens, hiddens, row_bases, states):
        original = _contract_batch.batch_catchup_args

        def every_row(call, tokens, hiddens, row_bases, states, weights, capacity, check_live_state):
            original(call, tokens, hiddens, row_bases, states, weights, capacity, check_live_state)  # the real checks
            # MUTATION: every row written, each at its state's drafter_rows.
            return original(call, tokens, hiddens, [st.seq_len for st in states], states, weights, capacity,
                            check_live_state)

        with swapped(_contract_batch, "batch_catchup_args", every_row):
            return super().catchup_batch(tokens, hiddens, row_bases, states)


# This module's mutants, in the registry (``mutants.MUTANTS``) through ``mutants.GROUPS``.
MUTANTS: tuple[type[Mutant], ...] = (
    BatchPermuted, BatchChecksAsItGoes, BatchXOfState0, CatchupBatchWritesMisaligned,
)
