"""What the pinned numerics buy (DESIGN.md §5), in both backends, byte for byte:

- M-invariance: a prefill of n rows equals a prefill of m rows plus catch-ups of the rest (any
  split, one-row catch-ups included), in every ``export_state`` tensor and in the next drafts;
- capacity invariance: ``max_seq_len`` 64 vs 1024 give the same drafts, ``x`` and live rows;
- both hold with sequences longer than ``index_topk``, where the indexer really drops rows.
"""

import pytest
import torch

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.indexer import select_rows

BACKENDS = {"reference": ReferenceProposer, "optimized": OptimizedProposer}
# (preset, rows): tiny's index_topk is 6, small's 32; both sequences run past it.
CASES = [("tiny", 20), ("small", 40)]


def snapshot(prop, state) -> dict[str, bytes]:
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in prop.export_state(state).items()
            if v.dim() > 0} | {k: v.item() for k, v in prop.export_state(state).items() if v.dim() == 0}


def inputs(cfg, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (n + 1,), generator=g)
    hiddens = torch.randn(n + 1, cfg.hidden_size, generator=g).to(dtype)
    return tokens, hiddens


def filled(prop, tokens, hiddens, split: list[int]):
    """Rows [0, n) written as a prefill of ``split[0]`` rows, then catch-ups ending at each
    following split point; returns the state and the next 3 drafts."""
    n = tokens.shape[0] - 1
    state = prop.alloc_state("cpu")
    assert prop.prefill_drafter(tokens[: split[0] + 1], hiddens[: split[0] + 1], state) == split[0]
    for a, b in zip(split, split[1:] + [n]):
        assert prop.catchup_drafter(tokens[a + 1 : b + 1], hiddens[a:b], a, a, state) == b - a
    before = snapshot(prop, state)
    drafts = prop.propose(int(tokens[n]), hiddens[n], n, 3, state)
    return before, drafts, snapshot(prop, state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("preset,n", CASES)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_prefill_equals_every_split_into_catchups(backend, preset, n, dtype):
    cfg = MtpConfig.preset(preset)
    prop = BACKENDS[backend](MtpWeights.random(cfg, seed=1, dtype=dtype), 128)
    tokens, hiddens = inputs(cfg, n, dtype, seed=2)
    whole = filled(prop, tokens, hiddens, [n])
    splits = [[1], [n // 2], [n - 1], [3, 4, n // 2, n - 2], list(range(1, n))]  # the last: one row at a time
    for split in splits:
        assert filled(prop, tokens, hiddens, split) == whole, split


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("preset,n", CASES)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_capacity_does_not_change_a_bit(backend, preset, n, dtype):
    cfg = MtpConfig.preset(preset)
    w = MtpWeights.random(cfg, seed=3, dtype=dtype)
    tokens, hiddens = inputs(cfg, n, dtype, seed=4)
    small, large = (filled(BACKENDS[backend](w, cap), tokens, hiddens, [n // 2]) for cap in (64, 1024))
    (_, d1, s1), (_, d2, s2) = small, large
    assert d1 == d2
    for key in ("kv_rows", "index_rows", "x", "seq_len"):
        assert s1[key] == s2[key], key


@pytest.mark.parametrize("preset,n", CASES)
def test_the_indexer_drops_rows_in_these_cases(preset, n):
    """The sequences above are long enough for the sparse path: later rows attend to
    ``index_topk`` of their visible rows, not all of them."""
    cfg = MtpConfig.preset(preset)
    assert n > cfg.index_topk
    rows, count = select_rows(torch.randn(1, n), torch.tensor([n - 1]), cfg.index_topk)
    assert int(count[0]) == cfg.index_topk < n and rows.shape == (1, cfg.index_topk)
