"""Fixtures for the optimized-backend tests: tiny random drafters, fresh random inputs, and a
lockstep driver that makes the same call on a reference and an optimized drafter and demands the
same outcome (return value or exception type) and the same export_state bytes after every call."""

from __future__ import annotations

import os
import zlib
from typing import Any, Callable

import pytest
import torch

# tests/conftest.py turns deterministic algorithms on; on CUDA cuBLAS then refuses to run unless
# this is set before its first GEMM (no effect on CPU).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import keyed_bytes


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread per test here: on a shared 2-core machine torch's default of two
    threads spin-waits against other processes and tiny GEMMs run ~100x slower. Both backends
    run under the same setting, so byte comparisons are unaffected; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_cfg() -> MtpConfig:
    return MtpConfig.preset("tiny")


@pytest.fixture(scope="session", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def weights(request, tiny_cfg) -> MtpWeights:
    return MtpWeights.random(tiny_cfg, seed=7, dtype=request.param)


def state_bytes(prop, state) -> dict[str, tuple]:
    """export_state as (shape, dtype, raw bytes) per key: byte equality, -0.0 != 0.0."""
    return keyed_bytes(prop.export_state(state))


class DrafterPair:
    """One reference and one optimized drafter on the same weights, driven call by call with raw
    tensors (the conformance suite's ``Lockstep`` plays ops as data; this one lets a test pass
    any tensor, view or device, and also checks the optimized state's device row count)."""

    def __init__(self, weights: MtpWeights, max_seq_len: int = 64, device: str = "cpu", feed_hidden: str = "post_norm",
                 **opt_kwargs: Any) -> None:
        self.ref = ReferenceProposer(weights, max_seq_len, feed_hidden)
        self.opt = OptimizedProposer(weights, max_seq_len, feed_hidden, **opt_kwargs)
        self.rs, self.os = self.ref.alloc_state(device), self.opt.alloc_state(device)
        self.calls = 0
        self.refused = 0  # calls both refused (a test of successful calls asserts none were)

    def call(self, name: str, *args: Any) -> Any:
        """``getattr(prop, name)(*args, state)`` on both; same result or same exception type, and
        byte-identical exported states afterwards. Returns the result (or the exception)."""
        before = state_bytes(self.opt, self.os)
        outcomes = []
        for prop, state in ((self.ref, self.rs), (self.opt, self.os)):
            try:
                outcomes.append(("ok", getattr(prop, name)(*args, state)))
            except Exception as e:  # compared below
                outcomes.append(("raised", e))
        (kr, vr), (ko, vo) = outcomes
        assert kr == ko, f"{name}{args!r}: reference {kr} {vr!r}, optimized {ko} {vo!r}"
        if kr == "raised":
            assert type(vr) is type(vo), f"{name}: reference raised {vr!r}, optimized {vo!r}"
            assert state_bytes(self.opt, self.os) == before, f"{name}: a refused call changed the optimized state"
            self.refused += 1
        else:
            assert vr == vo, f"{name}: reference returned {vr!r}, optimized {vo!r}"
        self.check()
        self.calls += 1
        return vr

    def check(self) -> None:
        a, b = state_bytes(self.ref, self.rs), state_bytes(self.opt, self.os)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == b[k], f"export_state[{k!r}] differs after call {self.calls}"
        assert self.ref.drafter_rows(self.rs) == self.opt.drafter_rows(self.os)
        assert self.ref.last_pair_key(self.rs) == self.opt.last_pair_key(self.os)
        if not self.os.released:  # the device's row count follows the host's
            assert int(self.os.seq_dev[0]) == self.os.seq_len


@pytest.fixture
def lockstep() -> Callable[..., DrafterPair]:
    return DrafterPair


class Inputs:
    """Fresh random tokens and hiddens for a drafter (never zeros)."""

    def __init__(self, weights: MtpWeights, seed: int = 0):
        self.cfg, self.dtype, self.device = weights.config, weights.dtype, weights.device
        self.gen = torch.Generator().manual_seed(seed)

    def tokens(self, n: int) -> torch.Tensor:
        return torch.randint(self.cfg.vocab_size, (n,), generator=self.gen)

    def hiddens(self, n: int) -> torch.Tensor:
        """(n, H) on the weights' device, in their dtype."""
        return torch.randn(n, self.cfg.hidden_size, generator=self.gen).to(device=self.device, dtype=self.dtype)

    def bad_hiddens(self, n: int, row: int, col: int, value: float) -> torch.Tensor:
        """``hiddens(n)`` with one entry set to ``value`` (NaN, inf)."""
        h = torch.randn(n, self.cfg.hidden_size, generator=self.gen)
        h[row, col] = value
        return h.to(device=self.device, dtype=self.dtype)

    def token(self) -> int:
        return int(self.tokens(1)[0])

    def randint(self, lo: int, hi: int) -> int:
        """Uniform in [lo, hi]."""
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen)[0])


@pytest.fixture
def inputs(weights, request) -> Inputs:
    # A seed per test (crc32, not hash(): str hashes change per process), so tests draw
    # different inputs but each test is reproducible.
    return Inputs(weights, seed=zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def make_inputs() -> Callable[..., Inputs]:
    return Inputs
