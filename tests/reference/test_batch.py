"""The reference's batched calls (``propose_batch``, ``catchup_batch``): the per-state loop that
pins the semantics. Each state as alone; every state's checks before any compute (a refusal names
``states[b]``, keeps the per-state exception type and changes no state); a failure midway poisons
every state of the batch."""

import pytest
import torch

from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference import proposer as proposer_module


@pytest.fixture(scope="module")
def drafter():
    w = MtpWeights.random(MtpConfig.preset("tiny"), seed=4, dtype=torch.float32)
    return ReferenceProposer(w, 48)


def _bytes(p, st):
    return {k: v.reshape(-1).view(torch.uint8).clone() for k, v in p.export_state(st).items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _states(p, gen, lengths):
    out = []
    for n in lengths:
        st = p.alloc_state("cpu")
        p.prefill_drafter(torch.randint(0, p.config.vocab_size, (n,), generator=gen),
                          torch.randn(n, p.config.hidden_size, generator=gen), st)
        out.append(st)
    return out


def test_batch_is_each_state_alone(drafter):
    gen = torch.Generator().manual_seed(1)
    lengths = (2, 9, 20)
    g2 = torch.Generator().manual_seed(1)
    batch, alone = _states(drafter, gen, lengths), _states(drafter, g2, lengths)
    for k in (3, 0, 2):
        pos = [drafter.drafter_rows(st) for st in batch]
        last = torch.randint(0, drafter.config.vocab_size, (3,), generator=gen)
        hid = torch.randn(3, drafter.config.hidden_size, generator=gen)
        got = drafter.propose_batch(last, hid, pos, k, batch[::-1][::-1])
        want = [drafter.propose(int(last[b]), hid[b], pos[b], k, alone[b]) for b in range(3)]
        assert got == want
        for b in range(3):
            drafter.after_verify(k, batch[b])
            drafter.after_verify(k, alone[b])
        if k:
            rows = [drafter.drafter_rows(st) for st in batch]
            toks, hs = [1, 2, 3], torch.randn(3, drafter.config.hidden_size, generator=gen)
            assert drafter.catchup_batch(toks, hs, [rows[0], rows[1] + 1, rows[2]], batch) == [1, 0, 1]
            for b in (0, 2):
                drafter.catchup_drafter([toks[b]], hs[b : b + 1], rows[b], rows[b], alone[b])
        assert all(_same(_bytes(drafter, x), _bytes(drafter, y)) for x, y in zip(batch, alone))


def test_refusals_name_the_state_and_change_nothing(drafter):
    gen = torch.Generator().manual_seed(2)
    states = _states(drafter, gen, (3, 5, 7))
    before = [_bytes(drafter, st) for st in states]
    pos = [drafter.drafter_rows(st) for st in states]
    hid = torch.randn(3, drafter.config.hidden_size, generator=gen)
    bad = hid.clone()
    bad[1, 4] = float("inf")
    cases = [
        (([1, 2, 3], bad, pos, 2, states), ValueError, "propose_batch: states\\[1\\]: target_hidden holds NaN or inf"),
        (([1, 2, 3], hid, [pos[0], pos[1] + 1, pos[2]], 2, states), RuntimeError, "states\\[1\\]: the drafter holds"),
        (([1, 2, drafter.config.vocab_size], hid, pos, 2, states), ValueError, "states\\[2\\]: last_token"),
        (([1, 2, 3], hid, pos, 2, [states[0], states[1], states[0]]), ValueError, "states\\[2\\] is states\\[0\\]"),
        (([1, 2], hid, pos, 2, states), ValueError, "last_tokens has 2 entries for 3 states"),
        (([1, 2, 3], hid[:2], pos, 2, states), ValueError, "target_hiddens must have shape"),
        (([1, 2, 3], hid, pos, -1, states), ValueError, "num_drafts"),
        (([1, 2, 3], hid, pos, 2, states[0]), ValueError, "states must be a list or tuple"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            drafter.propose_batch(*args)
        assert all(_same(b, _bytes(drafter, st)) for b, st in zip(before, states))
    with pytest.raises(ValueError, match="catchup_batch: states\\[1\\]: hiddens holds NaN or inf"):
        drafter.catchup_batch([1, 2, 3], bad, pos, states)
    assert all(_same(b, _bytes(drafter, st)) for b, st in zip(before, states))
    assert drafter.propose_batch([], torch.zeros(0, drafter.config.hidden_size), [], 2, []) == []


def test_a_failure_midway_poisons_every_state_of_the_batch(drafter, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    states = _states(drafter, gen, (3, 5))
    pos = [drafter.drafter_rows(st) for st in states]
    calls = []
    real = proposer_module.mtp_rows

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second state's first row
            raise MemoryError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(proposer_module, "mtp_rows", failing)
    with pytest.raises(MemoryError):
        drafter.propose_batch([1, 2], torch.randn(2, drafter.config.hidden_size, generator=gen), pos, 1, states)
    for st in states:
        with pytest.raises(RuntimeError, match="propose_batch failed midway"):
            drafter.propose(1, torch.randn(drafter.config.hidden_size), pos[0], 1, st)
        drafter.free_state(st)
