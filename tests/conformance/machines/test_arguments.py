"""The hostile-argument machine (``conformance.machines.arguments``): random sequences of valid and
invalid calls on the reference and the optimized drafter (its torch twins on CPU), checked
after every step. The default run is bounded to seconds; ``slow`` runs thousands of examples."""

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from glm_mtp.conformance.machines.arguments import argument_machine

SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


def test_hostile_arguments_reference_vs_optimized():
    run_state_machine_as_test(argument_machine(),
                              settings=settings(max_examples=10, stateful_step_count=12, derandomize=True,
                                                **SETTINGS))


@pytest.mark.slow
def test_hostile_arguments_reference_vs_optimized_long():
    run_state_machine_as_test(argument_machine(),
                              settings=settings(max_examples=2000, stateful_step_count=25, **SETTINGS))


def test_the_machine_catches_a_backend_that_writes_before_it_refuses():
    """A drafter that fills its inputs before checking the token: the machine must fail."""
    from glm_mtp.optimized import OptimizedProposer

    class WritesFirst(OptimizedProposer):
        def propose(self, last_token, target_hidden, position, num_drafts, state):
            state.x.add_(1)  # a write before the checks
            return super().propose(last_token, target_hidden, position, num_drafts, state)

    with pytest.raises(AssertionError, match="changed a state|differs|different"):
        run_state_machine_as_test(argument_machine(WritesFirst), settings=settings(
            max_examples=60, stateful_step_count=12, derandomize=True, phases=[Phase.generate],
            report_multiple_bugs=False,
            **SETTINGS))


def test_hostile_grammars_and_confidences_reference_vs_reference():
    """Where both drafters take grammars (DESIGN.md §10, §12) the machine also passes matchers,
    lying matchers and non-matchers to propose and propose_sampled and reads draft_confidence."""
    from glm_mtp.reference import ReferenceProposer

    machine = argument_machine(ReferenceProposer)
    assert machine.grammars
    run_state_machine_as_test(machine, settings=settings(max_examples=10, stateful_step_count=12, derandomize=True,
                                                         **SETTINGS))


@pytest.mark.parametrize("mutant", ["grammar_no_rollback", "confidence_margin_unmasked"])
def test_the_machine_catches_a_grammar_or_confidence_mutant(mutant):
    """200 examples, not 80: derandomized, hypothesis still draws from a pool of the constants in
    the modules loaded so far, so the examples depend on which tests ran before; at 80 both
    mutants went uncaught after ``test_hostile_arguments_reference_vs_optimized`` (caught alone)."""
    from glm_mtp.conformance.mutants import MUTANTS

    with pytest.raises(AssertionError, match="as found|different results"):
        run_state_machine_as_test(argument_machine(MUTANTS[mutant]), settings=settings(
            max_examples=200, stateful_step_count=12, derandomize=True, phases=[Phase.generate],
            report_multiple_bugs=False, **SETTINGS))


def test_the_machine_catches_a_count_taken_unchecked():
    """A drafter whose ``prefill_hidden_rows`` takes any value (``min`` with a float, a string):
    the machine must fail."""
    from glm_mtp.optimized import OptimizedProposer

    class TakesAnything(OptimizedProposer):
        def prefill_hidden_rows(self, max_seq_len):
            return max_seq_len if not isinstance(max_seq_len, int) else min(max_seq_len, self.max_seq_len)

    with pytest.raises(AssertionError, match="one backend refused|different"):
        run_state_machine_as_test(argument_machine(TakesAnything), settings=settings(
            max_examples=60, stateful_step_count=12, derandomize=True, phases=[Phase.generate],
            report_multiple_bugs=False, **SETTINGS))


def test_the_machine_catches_batch_buffers_only_its_own_states_have():
    """A drafter whose batched calls find buffers only where it allocated a state itself: a second
    drafter's batch on the first one's states fails, and the machine must say so."""
    from glm_mtp.optimized import OptimizedProposer

    class OwnBuffersOnly(OptimizedProposer):
        def _batch_on(self, device, call):
            if call == "alloc_state":
                return super()._batch_on(device, call)
            return self._batch[device]  # a KeyError on states another drafter allocated

    with pytest.raises(KeyError):
        run_state_machine_as_test(argument_machine(OwnBuffersOnly), settings=settings(
            max_examples=60, stateful_step_count=12, derandomize=True, phases=[Phase.generate],
            report_multiple_bugs=False, **SETTINGS))


# The grammar arguments that reach the failing-matcher rule, so
# a derandomized run meets them within a few examples whatever ran before.
FAILING = ("breaks", "other_vocab")


def test_the_machine_catches_a_drafter_that_asks_its_matcher_after_writing():
    """The mutant ``grammar_asked_after_writing`` leaves step 1's question to its walk, after the
    rewind wrote: a matcher of another vocabulary (or one whose fill fails at once) then raises
    its own error and poisons the state, where the reference refuses it before any write
    (DESIGN.md §4, §10). The machine must see the two backends end differently."""
    from glm_mtp.conformance.mutants import MUTANTS

    with pytest.raises(AssertionError, match="different refusals|one backend refused|poisoned"):
        run_state_machine_as_test(argument_machine(MUTANTS["grammar_asked_after_writing"], grammar_kinds=FAILING),
                                  settings=settings(max_examples=200, stateful_step_count=12, derandomize=True,
                                                    phases=[Phase.generate], report_multiple_bugs=False, **SETTINGS))


# 2-35 s, by what ran before (derandomized draws); tests/optimized/test_failing_matchers.py is the fast check
@pytest.mark.slow
def test_the_machine_catches_an_optimized_drafter_that_does_not_poison_on_a_failing_matcher():
    """An optimized drafter whose proposes never poison (the host walk outside ``writing``, as it
    was before the rule): a matcher failing midway leaves its states unpoisoned, with the rows its
    program wrote, where the reference's are poisoned. The machine must say the backends poisoned
    different states."""
    from contextlib import contextmanager

    import glm_mtp.optimized.proposer as opt_proposer
    from glm_mtp.conformance.mutants.base import swapped
    from glm_mtp.optimized import OptimizedProposer

    @contextmanager
    def never_poisons(*states, **kwargs):
        with torch.no_grad():
            yield

    class NeverPoisons(OptimizedProposer):
        def propose(self, *args, **kwargs):
            with swapped(opt_proposer, "writing", never_poisons):
                return super().propose(*args, **kwargs)

        def propose_sampled(self, *args, **kwargs):
            with swapped(opt_proposer, "writing", never_poisons):
                return super().propose_sampled(*args, **kwargs)

        def propose_batch(self, *args, **kwargs):
            with swapped(opt_proposer, "writing", never_poisons), swapped(opt_proposer, "writing_all", never_poisons):
                return super().propose_batch(*args, **kwargs)

    with pytest.raises(AssertionError, match="poisoned"):
        run_state_machine_as_test(argument_machine(NeverPoisons, grammar_kinds=FAILING), settings=settings(
            max_examples=200, stateful_step_count=12, derandomize=True, phases=[Phase.generate],
            report_multiple_bugs=False, **SETTINGS))
