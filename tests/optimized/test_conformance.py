"""The conformance suite (glm_mtp.conformance) on the optimized backend: every step of its
realistic and adversarial scenarios equal to the reference byte for byte."""

import pytest
import torch

from glm_mtp.conformance import run
from glm_mtp.optimized import with_triton_kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_conformance_cpu(dtype):
    report = run("optimized", "reference", scenarios=16, seed=4, device="cpu", dtype=dtype, preset="tiny")
    assert report.ok, report.first_difference


def test_conformance_cpu_interpreted_kernels():
    """The same with the Triton kernels (interpreted) inside the orchestration."""
    report = run(with_triton_kernels, "reference", scenarios=1, seed=5, device="cpu", dtype=torch.bfloat16, preset="tiny")
    assert report.ok, report.first_difference


@pytest.mark.gpu
def test_conformance_cuda():
    """A short CUDA run (scripts/gpu_check.sh runs the long ones through the CLI)."""
    report = run("optimized", "reference", scenarios=10, seed=6, device="cuda", dtype=torch.bfloat16, preset="tiny")
    assert report.ok, report.first_difference
