"""The hypothesis state machine: misuse and odd orders, in lockstep, and it can fail too."""

import re
import shlex

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from glm_mtp.conformance import run
from glm_mtp.conformance.machines.machine import lockstep_machine

SETTINGS = dict(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


def test_machine_reference_vs_reference():
    run_state_machine_as_test(lockstep_machine("reference", "reference"),
                              settings=settings(max_examples=12, stateful_step_count=20, **SETTINGS))


@pytest.mark.parametrize("mutant", ["second_verify", "trim_first_row", "grammar_no_rollback"])
def test_machine_catches_a_mutant_and_saves_a_replayable_scenario(mutant, tmp_path, monkeypatch):
    monkeypatch.setenv("GLM_MTP_CONFORMANCE_DIR", str(tmp_path))
    with pytest.raises(AssertionError, match="differ at step") as e:
        run_state_machine_as_test(lockstep_machine(f"mutant:{mutant}", "reference"),
                                  settings=settings(max_examples=40, stateful_step_count=20, phases=[Phase.generate],
                                                    **SETTINGS))
    replay = re.search(r"replay: (python -m glm_mtp\.conformance .*)", str(e.value)).group(1)
    argv = shlex.split(replay)
    path = argv[argv.index("--scenario-file") + 1]
    assert path.startswith(str(tmp_path))
    r = run(f"mutant:{mutant}", "reference", scenario_file=path)
    assert not r.ok and r.first_difference.replay == replay
