"""Conformance tests run with one torch thread.

The shapes are tiny, and on a machine whose cores are shared (CI, several jobs at once) an
oversubscribed OpenMP pool made the same scenarios 15-60x slower. The thread count is restored
after each test so other packages' tests see torch's default.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# cuBLAS refuses deterministic mode (tests/conftest.py turns it on) unless this is set before it
# initialises; harmless on the CPU.
import os  # noqa: E402

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
