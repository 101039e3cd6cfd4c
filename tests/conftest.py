"""Shared test setup.

Triton kernels run through Triton's CPU interpreter when no GPU is present; the variable must be
set before triton is first imported, so it is set here, at collection time.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Deterministic cuBLAS needs a fixed workspace (CUDA refuses deterministic GEMMs without it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# One intra-op thread: the tests' GEMMs are tiny, and on a shared 2-core machine two OpenMP
# threads per process made them up to 100x slower. Subprocesses inherit it through the env.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# Deterministic algorithms: the package promises run-to-run equality.
torch.use_deterministic_algorithms(True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
