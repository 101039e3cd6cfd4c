"""The conformance suite (glm_mtp.conformance) on the optimized backend: every step of its
realistic and adversarial scenarios equal to the reference byte for byte."""

import pytest
import torch

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from glm_mtp.conformance import run
from glm_mtp.conformance.machine import lockstep_machine
from glm_mtp.optimized import with_triton_kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_conformance_cpu(dtype):
    report = run("optimized", "reference", scenarios=16, seed=4, device="cpu", dtype=dtype, preset="tiny")
    assert report.ok, report.first_difference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_conformance_hypothesis_machine(dtype):
    """The suite's hypothesis state machine: misuse and odd call orders, shrunk on a difference."""
    machine = lockstep_machine("optimized", "reference", dtype=dtype)
    run_state_machine_as_test(machine, settings=settings(max_examples=25, deadline=None, stateful_step_count=25,
                                                         suppress_health_check=list(HealthCheck), database=None))


def test_conformance_cpu_interpreted_kernels():
    """The same with the Triton kernels (interpreted) inside the orchestration."""
    report = run(with_triton_kernels, "reference", scenarios=1, seed=5, device="cpu", dtype=torch.bfloat16, preset="tiny")
    assert report.ok, report.first_difference


@pytest.mark.gpu
def test_conformance_cuda():
    """A short CUDA run (scripts/gpu_check.sh runs the long ones through the CLI)."""
    report = run("optimized", "reference", scenarios=10, seed=6, device="cuda", dtype=torch.bfloat16, preset="tiny")
    assert report.ok, report.first_difference
