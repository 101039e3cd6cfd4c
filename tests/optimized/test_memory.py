"""Allocating and freeing states leaks nothing.

On CPU, torch has no allocator counter, so two measures:
- live tensor storage: the bytes of every distinct storage reachable from Python objects
  (gc.get_objects), exact: after 100 alloc / prefill / propose / free cycles it must be back to its
  value after one warm-up cycle (which builds the proposer's RoPE table, shared by its states);
- resident memory (RSS), with a tolerance: the allocator may keep freed pages, so RSS is allowed
  to grow by at most a quarter of what 100 leaked states would hold, which a leak would exceed
  four times over.
On CUDA (gpu-marked): torch.cuda.memory_allocated() returns to its value before alloc_state,
captured graphs included.
"""

from __future__ import annotations

import gc

import pytest
import torch

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights

CYCLES = 100


def live_storage_bytes() -> int:
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        # issubclass on the type: isinstance would read __class__ of every object (deprecation noise)
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            s = obj.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def cycle(prop: OptimizedProposer, tokens, hiddens, keep: list, device: str = "cpu") -> int:
    state = prop.alloc_state(device)
    size = sum(t.untyped_storage().nbytes() for t in state.tensors())
    prop.prefill_drafter(tokens, hiddens, state)
    prop.propose(int(tokens[-1]), hiddens[-1], tokens.shape[0] - 1, 3, state)
    prop.after_verify(1, state)
    prop.free_state(state)
    keep.append(state)  # an engine may keep the freed object around: its buffers must still go
    return size


def test_alloc_free_100_states_cpu():
    cfg = MtpConfig.preset("small")  # big enough states (~1 MB) for RSS to see a leak
    w = MtpWeights.random(cfg, seed=3, dtype=torch.bfloat16)
    prop = OptimizedProposer(w, max_seq_len=4096)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(cfg.vocab_size, (6,), generator=gen)
    hiddens = torch.randn(6, cfg.hidden_size, generator=gen).to(w.dtype)
    kept: list = []
    state_size = cycle(prop, tokens, hiddens, kept)  # warm-up: the shared RoPE table, lazy inits
    live0, rss0 = live_storage_bytes(), rss_bytes()
    for _ in range(CYCLES):
        cycle(prop, tokens, hiddens, kept)
    live1, rss1 = live_storage_bytes(), rss_bytes()
    assert all(s.released and s.tensors() == [] and s.graphs == {} for s in kept)
    assert live1 == live0, f"live tensor storage grew by {live1 - live0} bytes over {CYCLES} states"
    assert state_size > 900_000
    assert rss1 - rss0 < CYCLES * state_size // 4, f"RSS grew by {rss1 - rss0} bytes (one state holds {state_size})"


def test_live_storage_sees_a_leak():
    """The measure is not blind: states kept alive (not freed) show up in it."""
    cfg = MtpConfig.preset("tiny")
    prop = OptimizedProposer(MtpWeights.random(cfg, seed=3, dtype=torch.bfloat16), max_seq_len=64)
    prop.free_state(prop.alloc_state("cpu"))
    live0 = live_storage_bytes()
    leaked = [prop.alloc_state("cpu") for _ in range(3)]
    assert live_storage_bytes() - live0 == 3 * sum(t.untyped_storage().nbytes() for t in leaked[0].tensors())


@pytest.mark.gpu
def test_alloc_free_100_states_cuda():
    cfg = MtpConfig.preset("tiny")
    w = MtpWeights.random(cfg, seed=3, dtype=torch.bfloat16, device="cuda")
    prop = OptimizedProposer(w, max_seq_len=256)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(cfg.vocab_size, (6,), generator=gen)
    hiddens = torch.randn(6, cfg.hidden_size, generator=gen).to(w.dtype).cuda()
    kept: list = []
    cycle(prop, tokens, hiddens, kept, "cuda")  # warm-up: RoPE table, cuBLAS workspaces, Triton
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(CYCLES):
        cycle(prop, tokens, hiddens, kept, "cuda")
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
