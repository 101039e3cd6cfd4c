"""The main check once the optimized backend exists: ``optimized`` vs ``reference``, byte for byte.

The module is skipped (``pytest.importorskip``) only while ``glm_mtp.optimized`` cannot be
imported at all; if it imports but lacks ``OptimizedProposer``, the tests fail.
"""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

optimized = pytest.importorskip("glm_mtp.optimized", reason="the optimized backend has not landed")

from glm_mtp.conformance import run  # noqa: E402
from glm_mtp.conformance.machine import lockstep_machine  # noqa: E402
from glm_mtp.reference import ReferenceProposer  # noqa: E402


def test_optimized_proposer_is_exported():
    assert hasattr(optimized, "OptimizedProposer"), "glm_mtp.optimized imports but has no OptimizedProposer"


def test_optimized_equals_reference_bf16():
    r = run("optimized", "reference", scenarios=100, seed=2, dtype=torch.bfloat16)
    assert r.ok, r.first_difference


def test_optimized_equals_reference_fp32():
    r = run("optimized", "reference", scenarios=30, seed=3, dtype=torch.float32)
    assert r.ok, r.first_difference


def pre_norm_optimized(w, n):
    return optimized.OptimizedProposer(w, n, feed_hidden="pre_norm")


def pre_norm_reference(w, n):
    return ReferenceProposer(w, n, feed_hidden="pre_norm")


def test_optimized_equals_reference_with_the_pre_norm_ablation():
    r = run(pre_norm_optimized, pre_norm_reference, scenarios=10, seed=4)
    assert r.ok, r.first_difference


def test_optimized_with_interpreted_triton_kernels_equals_reference():
    # Triton's CPU interpreter is slow: one realistic and one adversarial scenario.
    r = run("glm_mtp.optimized:with_triton_kernels", "reference", scenarios=2, seed=5)
    assert r.ok, r.first_difference


def test_machine_optimized_vs_reference():
    run_state_machine_as_test(
        lockstep_machine("optimized", "reference"),
        settings=settings(max_examples=8, stateful_step_count=20, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck)),
    )
