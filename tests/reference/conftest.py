"""Fixtures for the reference tests: tiny random drafters and fresh random inputs."""

import zlib

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import keyed_bytes


@pytest.fixture(scope="session")
def tiny_cfg() -> MtpConfig:
    return MtpConfig.preset("tiny")


@pytest.fixture(scope="session", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def weights(request, tiny_cfg) -> MtpWeights:
    return MtpWeights.random(tiny_cfg, seed=1, dtype=request.param)


@pytest.fixture
def prop(weights) -> ReferenceProposer:
    return ReferenceProposer(weights, max_seq_len=64)


class Inputs:
    """Fresh random tokens and hiddens for a drafter (never zeros)."""

    def __init__(self, weights: MtpWeights, seed: int = 0):
        self.cfg, self.dtype = weights.config, weights.dtype
        self.gen = torch.Generator().manual_seed(seed)

    def tokens(self, n: int) -> torch.Tensor:
        return torch.randint(self.cfg.vocab_size, (n,), generator=self.gen)

    def hiddens(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.cfg.hidden_size, generator=self.gen).to(self.dtype)

    def token(self) -> int:
        return int(self.tokens(1)[0])


@pytest.fixture
def inputs(weights, request) -> Inputs:
    # A seed per test (crc32, stable across processes), so tests draw different inputs but each is reproducible.
    return Inputs(weights, seed=zlib.crc32(request.node.name.encode()))


def snapshot_bytes(prop, state) -> dict[str, bytes]:
    """export_state as raw bytes per key (plus shape and dtype), for byte-level comparisons."""
    return keyed_bytes(prop.export_state(state))


@pytest.fixture
def snap():
    return snapshot_bytes
