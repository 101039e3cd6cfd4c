"""The measuring tools' tests run one intra-op thread, as the optimized backend's do: on a
shared 2-core machine two spinning threads make tiny GEMMs ~100x slower; restored afterwards."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
