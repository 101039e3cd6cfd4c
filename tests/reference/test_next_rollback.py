"""Rollback across KPool pool boundaries (DESIGN.md §7) and the invariances of the glm5_next
family, byte for byte:

- any sequence of prefill, catch-up, propose (rewinding or not) and after_verify leaves the state
  a fresh state reaches by prefilling the surviving rows alone: every ``export_state`` byte a
  prefilled state has (rows, pooled keys, which pools are complete, gates, counters), and the same
  drafts and bytes after the next propose on both; a trim that cuts into a complete pool makes it
  incomplete, and its rewritten rows give it a new key;
- M-invariance (prefill 20 == prefill 12 + catch-up 8, and other splits), capacity invariance
  (``max_seq_len`` 64 vs 1024), batch invariance (``propose_batch`` == each state alone).
"""

import random

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference import proposer as proposer_mod
from glm_mtp.reference.bytes import same_bytes

CFG = MtpConfig.preset("glm5next_tiny")
# Bytes a prefilled state has: x, pending and last_drafted belong to a propose.
PREFILL_KEYS = ("kv_rows", "index_rows", "seq_len", "block_table", "pool_keys", "pool_complete", "pool_gates")


@pytest.fixture(scope="module", params=[torch.bfloat16], ids=["bf16"])
def weights(request):
    return MtpWeights.random(CFG, seed=7, dtype=request.param)


def differing(a: dict, b: dict, keys=None) -> list[str]:
    keys = keys or sorted(a.keys() | b.keys())
    return [k for k in keys if k not in a or k not in b or not same_bytes(a[k], b[k])]


class RowLog:
    """Records the (token, hidden) every block call writes at each slot: the surviving rows'
    inputs are the last ones written at slots ``< seq_len``."""

    def __init__(self, monkeypatch):
        self.rows: dict[int, tuple[int, torch.Tensor]] = {}
        real = proposer_mod.mtp_rows

        def logged(w, tokens, hiddens, slots, *args, **kwargs):
            for tok, h, s in zip(tokens.tolist(), hiddens, slots.tolist()):
                self.rows[s] = (tok, h.clone())
            return real(w, tokens, hiddens, slots, *args, **kwargs)

        monkeypatch.setattr(proposer_mod, "mtp_rows", logged)

    def fresh(self, prop, n: int):
        """A new state holding only rows [0, n), written by one prefill."""
        state = prop.alloc_state("cpu")
        tokens = torch.tensor([0] + [self.rows[r][0] for r in range(n)])
        hiddens = torch.stack([self.rows[r][1] for r in range(n)] + [self.rows[0][1]])
        assert prop.prefill_drafter(tokens, hiddens, state) == n
        return state


def random_walk(prop, log, rng: random.Random, steps: int, gen: torch.Generator):
    """Random prefill / catch-up / propose (sometimes rewinding) / after_verify calls; checks the
    state against a fresh prefill of its surviving rows after every verified step."""
    V, H = CFG.vocab_size, CFG.hidden_size

    def hid(n):
        return torch.randn(n, H, generator=gen).to(prop.weights.dtype)

    def tok(n):
        return torch.randint(V, (n,), generator=gen)

    state = prop.alloc_state("cpu")
    n0 = rng.randint(2, 14)
    prop.prefill_drafter(tok(n0 + 1), hid(n0 + 1), state)
    checked = 0
    for _ in range(steps):
        seq = prop.drafter_rows(state)
        if seq > 44:
            break
        if rng.random() < 0.3:
            k = rng.randint(1, 6)
            prop.catchup_drafter(tok(k), hid(k), seq, seq, state)
        else:
            position = seq if rng.random() < 0.6 else rng.randint(1, seq)  # a rewind cuts rows off
            k = rng.randint(0, 5)
            prop.propose(int(tok(1)), hid(1)[0], position, k, state)
            prop.after_verify(rng.randint(0, k), state)
        n = prop.drafter_rows(state)
        got = prop.export_state(state)
        fresh = log.fresh(prop, n)
        want = prop.export_state(fresh)
        assert not differing(got, want, PREFILL_KEYS), (n, differing(got, want, PREFILL_KEYS))
        t, h = int(tok(1)), hid(1)[0]
        k = rng.randint(1, 5)
        assert prop.propose(t, h, n, k, state) == prop.propose(t, h, n, k, fresh)
        assert not differing(prop.export_state(state), prop.export_state(fresh))
        a = rng.randint(0, k)
        prop.after_verify(a, state)
        prop.after_verify(a, fresh)
        checked += 1
    return checked


@pytest.mark.parametrize("seed", [0, 1])
def test_any_walk_equals_a_fresh_prefill_of_its_surviving_rows(weights, monkeypatch, seed):
    prop = ReferenceProposer(weights, max_seq_len=64)
    log = RowLog(monkeypatch)
    assert random_walk(prop, log, random.Random(seed), 6, torch.Generator().manual_seed(seed)) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 10))
def test_any_walk_equals_a_fresh_prefill_long(weights, monkeypatch, seed):
    prop = ReferenceProposer(weights, max_seq_len=64)
    log = RowLog(monkeypatch)
    random_walk(prop, log, random.Random(seed), 20, torch.Generator().manual_seed(seed))


def inputs(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(CFG.vocab_size, (n + 1,), generator=g), torch.randn(n + 1, CFG.hidden_size, generator=g).to(
        dtype
    )


def test_a_trim_into_a_complete_pool_makes_it_incomplete_and_rewriting_gives_a_new_key(weights):
    prop = ReferenceProposer(weights, max_seq_len=64)
    state = prop.alloc_state("cpu")
    tokens, hiddens = inputs(10, weights.dtype, seed=3)
    prop.prefill_drafter(tokens, hiddens, state)  # rows 0..9: pools 0, 1 complete
    prop.propose(int(tokens[10]), hiddens[10], 10, 4, state)  # rows 10..13: pool 2 completes at row 11
    old_key = prop.export_state(state)["pool_keys"][2].clone()
    prop.after_verify(0, state)  # keeps row 10 only: pool 2 cut
    snap = prop.export_state(state)
    assert snap["pool_complete"].tolist() == [True, True, False] and snap["pool_keys"].shape[0] == 2
    prop.catchup_drafter([5], hiddens[:1], 11, 11, state)  # row 11 rewritten from other inputs
    new = prop.export_state(state)
    assert new["pool_complete"].tolist() == [True, True, True] and not same_bytes(new["pool_keys"][2], old_key)


def filled(prop, tokens, hiddens, split):
    n = tokens.shape[0] - 1
    state = prop.alloc_state("cpu")
    assert prop.prefill_drafter(tokens[: split[0] + 1], hiddens[: split[0] + 1], state) == split[0]
    for a, b in zip(split, split[1:] + [n]):
        assert prop.catchup_drafter(tokens[a + 1 : b + 1], hiddens[a:b], a, a, state) == b - a
    before = prop.export_state(state)
    drafts = prop.propose(int(tokens[n]), hiddens[n], n, 3, state)
    return before, drafts, prop.export_state(state)


def same_fill(x, y):
    return x[1] == y[1] and not differing(x[0], y[0]) and not differing(x[2], y[2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_prefill_20_equals_12_plus_8_and_other_splits(dtype):
    prop = ReferenceProposer(MtpWeights.random(CFG, seed=1, dtype=dtype), 64)
    tokens, hiddens = inputs(20, dtype, seed=2)
    whole = filled(prop, tokens, hiddens, [20])
    for split in ([12], [1], [3, 4, 11, 18], [7, 8, 9, 15]):
        assert same_fill(filled(prop, tokens, hiddens, split), whole), split


@pytest.mark.slow
def test_prefill_equals_one_row_at_a_time():
    prop = ReferenceProposer(MtpWeights.random(CFG, seed=1, dtype=torch.bfloat16), 64)
    tokens, hiddens = inputs(20, torch.bfloat16, seed=2)
    assert same_fill(filled(prop, tokens, hiddens, list(range(1, 20))), filled(prop, tokens, hiddens, [20]))


def test_capacity_does_not_change_a_bit(weights):
    tokens, hiddens = inputs(22, weights.dtype, seed=4)
    (_, d1, s1), (_, d2, s2) = (filled(ReferenceProposer(weights, cap), tokens, hiddens, [11]) for cap in (64, 1024))
    assert d1 == d2
    assert not differing(s1, s2, ("kv_rows", "index_rows", "x", "seq_len", "pool_keys", "pool_complete", "pool_gates"))


def test_propose_batch_equals_each_state_alone(weights):
    prop = ReferenceProposer(weights, max_seq_len=64)
    lengths = [5, 12, 19]  # row 5 in pool 1, 12 completes... each state's first draft at another pool offset
    alone, batched = [], []
    for target in (alone, batched):
        for i, n in enumerate(lengths):
            tokens, hiddens = inputs(n, weights.dtype, seed=10 + i)
            st = prop.alloc_state("cpu")
            prop.prefill_drafter(tokens, hiddens, st)
            target.append((st, tokens, hiddens))
    want = [prop.propose(int(t[-1]), h[-1], t.shape[0] - 1, 4, st) for st, t, h in alone]
    got = prop.propose_batch([int(t[-1]) for _, t, _ in batched], torch.stack([h[-1] for _, _, h in batched]),
                             [t.shape[0] - 1 for _, t, _ in batched], 4, [st for st, _, _ in batched])
    assert got == want
    for (a, _, _), (b, _, _) in zip(alone, batched):
        assert not differing(prop.export_state(a), prop.export_state(b))
