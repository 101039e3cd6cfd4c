"""The lockstep runner: reference against a second reference (also across processes), and what
a failure report says."""

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from glm_mtp.conformance import BackendError, run
from glm_mtp.conformance.backends import resolve_backend
from glm_mtp.conformance.runner import record
from glm_mtp.reference import ReferenceProposer
from glm_mtp.reference.bytes import same_bytes

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("scenarios", [12, pytest.param(40, marks=pytest.mark.slow)])
def test_reference_equals_a_second_reference(scenarios):
    r = run("reference", "reference", scenarios=scenarios, seed=1)
    assert r.ok, r.first_difference
    half = scenarios // 2
    assert r.scenarios_run == scenarios and r.by_generator == {"realistic": half, "adversarial": half}
    # The scenarios really exercise refusals and no-ops, not only the happy path.
    for kind in ("prefill", "catchup", "propose"):
        assert r.outcomes[kind].get("ok", 0) > 0 and r.outcomes[kind].get("ValueError", 0) > 0, r.outcomes
    assert r.outcomes["verify"]["RuntimeError"] > 0 and r.outcomes["catchup"]["noop"] > 0


def test_a_factory_is_a_backend():
    def factory(w, n):
        return ReferenceProposer(w, n)

    r = run(factory, "reference", scenarios=2, seed=2, dtype=torch.float32)
    assert r.ok and "factory" in r.candidate


def test_unknown_or_missing_backends_are_clear_errors(monkeypatch):
    with pytest.raises(BackendError, match="unknown backend"):
        resolve_backend("fastest")
    with pytest.raises(BackendError, match="unknown mutant"):
        resolve_backend("mutant:nope")
    monkeypatch.setitem(sys.modules, "glm_mtp.optimized", None)  # as if it could not be imported here
    with pytest.raises(BackendError, match="glm_mtp.optimized.OptimizedProposer is not importable"):
        resolve_backend("optimized")


CHILD = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    from glm_mtp.conformance.runner import record
    torch.save(record("reference", [0, 1, 2, 3], seed=11), sys.argv[1])
    """
)


def test_reference_is_deterministic_across_processes(tmp_path):
    out = tmp_path / "child.pt"
    subprocess.run([sys.executable, "-c", CHILD, str(out)], check=True, cwd=REPO, timeout=300)
    child_outcomes, child = torch.load(out)
    outcomes, mine = record("reference", [0, 1, 2, 3], seed=11)
    assert child_outcomes == outcomes
    assert child.keys() == mine.keys() and len(mine) > 500
    bad = [k for k in mine if not same_bytes(mine[k], child[k])]
    assert not bad, f"{len(bad)} tensors differ between processes, first {bad[0]}"


def test_failure_report_names_step_tensor_and_a_replay_that_reproduces_it(tmp_path):
    r = run("mutant:pair_shift", "reference", scenarios=10, seed=0)
    d = r.first_difference
    assert not r.ok and d is not None and r.scenarios_run == d.scenario_index + 1
    assert d.op.startswith("prefill(") and d.what == "export_state" and d.tensor == "kv_rows"
    assert d.row is not None and d.element is not None and "0x" in d.candidate and "0x" in d.baseline
    assert d.step > 0 and d.scenario_seed > 0 and "replay: python -m glm_mtp.conformance" in str(d)
    assert f"--scenario-index {d.scenario_index}" in d.replay and "--candidate mutant:pair_shift" in d.replay

    # The same scenario alone, in process ...
    again = run("mutant:pair_shift", "reference", scenario_index=d.scenario_index, seed=0).first_difference
    assert (again.step, again.tensor, again.row, again.element, again.candidate, again.baseline) == (
        d.step, d.tensor, d.row, d.element, d.candidate, d.baseline)
    # ... and through the replay command itself, in a fresh process.
    report = tmp_path / "replay.json"
    argv = shlex.split(d.replay)
    assert argv[:3] == ["python", "-m", "glm_mtp.conformance"]
    proc = subprocess.run([sys.executable] + argv[1:] + ["--json", str(report)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "RESULT: FAIL" in proc.stdout and f"step {d.step}: prefill(" in proc.stdout
    got = json.loads(report.read_text())["first_difference"]
    assert (got["step"], got["tensor"], got["row"], got["element"], got["candidate"]) == (
        d.step,
        d.tensor,
        d.row,
        d.element,
        d.candidate,
    )


def test_a_refused_call_that_changes_the_state_is_caught():
    r = run("mutant:rewind_before_validate", "reference", scenarios=40, seed=0)
    assert not r.ok and r.first_difference.what == "refused call changed the state"
    assert r.first_difference.side == "candidate"
