"""The main check: the optimized backend (glm_mtp.optimized) against the reference, byte for
byte, through the conformance suite: its scenarios, bf16 and fp32, the pre-norm ablation, the
Triton kernels (interpreted on CPU) inside the orchestration, and the hypothesis state machine.
(On CUDA: test_gpu.py.)"""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from glm_mtp.conformance import run
from glm_mtp.conformance.machines.machine import lockstep_machine
from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import ReferenceProposer


@pytest.mark.slow
def test_optimized_equals_reference_bf16():
    r = run("optimized", "reference", scenarios=100, seed=2, dtype=torch.bfloat16)
    assert r.ok, r.first_difference


@pytest.mark.slow
def test_optimized_equals_reference_fp32():
    r = run("optimized", "reference", scenarios=30, seed=3, dtype=torch.float32)
    assert r.ok, r.first_difference


def test_optimized_equals_reference_fp32_fast():
    """The default run's case of the fp32 sweep above: its first 8 scenarios."""
    r = run("optimized", "reference", scenarios=8, seed=3, dtype=torch.float32)
    assert r.ok, r.first_difference


def pre_norm_optimized(w, n):
    return OptimizedProposer(w, n, feed_hidden="pre_norm")


def pre_norm_reference(w, n):
    return ReferenceProposer(w, n, feed_hidden="pre_norm")


def test_optimized_equals_reference_with_the_pre_norm_ablation():
    r = run(pre_norm_optimized, pre_norm_reference, scenarios=4, seed=4)
    assert r.ok, r.first_difference


@pytest.mark.slow
def test_optimized_with_interpreted_triton_kernels_equals_reference():
    # Triton's CPU interpreter is slow (~0.5 s a row at tiny): one realistic and one adversarial
    # scenario over short sequences.
    r = run("glm_mtp.optimized:with_triton_kernels", "reference", scenarios=2, seed=5, max_seq_len=24)
    assert r.ok, r.first_difference


def test_interpreted_triton_kernels_equal_the_reference_on_a_realistic_scenario():
    """The default run's case of the sweep above: its realistic scenario alone (the kernels on the
    happy path; the adversarial one's refusals happen before any kernel runs and are covered by
    the plain optimized backend's scenarios)."""
    r = run("glm_mtp.optimized:with_triton_kernels", "reference", scenario_index=0, seed=5, max_seq_len=24)
    assert r.ok and r.scenarios_run == 1 and r.outcomes["propose"]["ok"] > 0, r.first_difference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_machine_optimized_vs_reference(dtype):
    """The suite's hypothesis state machine: misuse and odd call orders, shrunk on a difference."""
    run_state_machine_as_test(
        lockstep_machine("optimized", "reference", dtype=dtype),
        settings=settings(max_examples=25, stateful_step_count=25, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck)),
    )
