"""Fixtures for the experiment tests: tiny random targets and drafters sharing embedding and head."""

import pytest
import torch

from glm_mtp.experiments.checkpoint import random_model
from glm_mtp.experiments.target import Target


@pytest.fixture(autouse=True)
def one_thread():
    # The tests' models are tiny: more threads only contend with other test processes.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny64():
    """A random tiny target + MTP layer in float64 (near-ties cannot flip an argmax)."""
    return random_model("tiny", seed=3, dtype=torch.float64)


@pytest.fixture
def target64(tiny64):
    return Target(tiny64.target, max_seq_len=128)


def _random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def random_prompt():
    """``random_prompt(vocab, n, seed)``: n random token ids."""
    return _random_prompt
