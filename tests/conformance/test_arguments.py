"""The hostile-argument machine (``conformance.arguments``): random sequences of valid and
invalid calls on the reference and the optimized drafter (its torch twins on CPU), checked
after every step. The default run is bounded to seconds; ``slow`` runs thousands of examples."""

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from glm_mtp.conformance.arguments import argument_machine

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
    from glm_mtp.conformance.mutants import MUTANTS

    with pytest.raises(AssertionError, match="as found|different results"):
        run_state_machine_as_test(argument_machine(MUTANTS[mutant]), settings=settings(
            max_examples=40, stateful_step_count=10, derandomize=True, phases=[Phase.generate],
            report_multiple_bugs=False, **SETTINGS))
