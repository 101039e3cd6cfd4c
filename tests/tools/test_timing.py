"""Timing helpers (glm_mtp.tools.timing): a state's bytes, a timed call, the copy bandwidth."""

import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.tools.timing import copy_bandwidth, state_nbytes, timed


def test_state_nbytes_counts_each_storage_once():
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=0, dtype=torch.float32)
    prop = ReferenceProposer(w, 64)
    state = prop.alloc_state("cpu")
    assert state_nbytes(state) == sum(
        t.numel() * t.element_size()
        for t in (state.cache.kv_pool, state.cache.index_pool, state.cache.block_table, state.x)
    )


def test_timed_and_copy_bandwidth_are_positive():
    assert timed(lambda: torch.randn(64).sum(), torch.device("cpu")) > 0
    assert copy_bandwidth(torch.device("cpu"), 1 << 20, repeats=3) > 0
