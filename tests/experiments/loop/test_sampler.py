"""The seeded sampler (DESIGN.md §14): a pure function of the logits and the key (seed, prompt
sha256, position, token), batch-invariant, ``top_k = 1`` the argmax exactly, the race's noise the
written splitmix64 stream, truncation as written, and draws distributed as the kept softmax."""

import math

import pytest
import torch

from glm_mtp.experiments.loop import sampler
from glm_mtp.experiments.loop.sampler import SamplerSettings, kept_tokens, race_noise, seeded_sample
from glm_mtp.reference.bytes import same_bytes

H = "ab" * 32  # a prompt sha256
M64 = (1 << 64) - 1


def splitmix_py(x):
    """splitmix64's finalizer on Python ints, the written algorithm."""
    x &= M64
    x = ((x ^ (x >> 30)) * sampler._MIX1) & M64
    x = ((x ^ (x >> 27)) * sampler._MIX2) & M64
    return x ^ (x >> 31)


def noise_py(seed, h, p, j):
    g = sampler._GOLDEN
    key = splitmix_py(seed + g)
    key = splitmix_py((key ^ int(h[:16], 16)) + g)
    key = splitmix_py((p ^ key) + g)
    bits = splitmix_py(key + (j + 1) * g)
    return -math.log(((bits >> 11) + 0.5) * 2.0**-53)


def logits(T, V, seed=0, dtype=torch.float32):
    return (torch.randn(T, V, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def test_noise_is_the_written_stream():
    pos = torch.tensor([0, 5, 1 << 40])
    for seed in (0, -7, (1 << 63) - 1):
        e = race_noise(seed, H, pos, 9)
        for t, p in enumerate(pos.tolist()):
            for j in (0, 3, 8):
                assert float(e[t, j]) == noise_py(seed & M64, H, p, j), (seed, p, j)
    assert not same_bytes(race_noise(0, H, pos, 9), race_noise(1, H, pos, 9))
    assert not same_bytes(race_noise(0, H, pos, 9), race_noise(0, "cd" * 32, pos, 9))


def test_top_k_1_and_temperature_0_are_the_argmax():
    x = logits(64, 50)
    x[:, 7] = x.max(dim=1).values  # ties: the lower id wins
    x[3, :] = 1.0
    want = torch.argmax(x, dim=-1)
    for s in (SamplerSettings(1.0, top_k=1, seed=3), SamplerSettings(0.7, top_p=0.5, top_k=1, seed=1),
              SamplerSettings(0.0, top_p=0.9, seed=2), SamplerSettings(1e-30, top_k=1)):
        assert same_bytes(seeded_sample(x, s, H, torch.arange(64)), want), s


def test_batch_invariant_and_keyed_by_position():
    x = logits(12, 300, seed=1)
    pos = torch.arange(20, 32)
    s = SamplerSettings(1.0, top_p=0.95, top_k=40, seed=5)
    whole = seeded_sample(x, s, H, pos)
    rows = torch.cat([seeded_sample(x[t : t + 1], s, H, pos[t : t + 1]) for t in range(12)])
    assert same_bytes(whole, rows)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert same_bytes(seeded_sample(x[perm], s, H, pos[perm]), whole[perm])
    same_logits = x[:1].expand(200, -1).contiguous()
    draws = seeded_sample(same_logits, SamplerSettings(1.0, seed=5), H, torch.arange(200))
    assert len(set(draws.tolist())) > 1  # one row's logits, another position: another noise


def test_truncation_as_written():
    x = logits(40, 60, seed=2)
    s = SamplerSettings(0.8, top_p=0.7, top_k=20)
    kept = kept_tokens(x, s)
    for t in range(40):
        top = sorted(range(60), key=lambda j: (-float(x[t, j]), j))[:20]
        e = {j: math.exp((float(x[t, j]) - float(x[t, top[0]])) / 0.8) for j in top}
        z = sum(e.values())
        order = sorted(top, key=lambda j: (-e[j], j))
        acc, want = 0.0, set()
        for j in order:
            if acc >= 0.7:
                break
            want.add(j)
            acc += e[j] / z
        got = set(kept[t].nonzero()[:, 0].tolist())
        assert got == want, t  # float64 here, pinned float32 there: no boundary within 1e-6 in these logits
    assert int(kept_tokens(x, SamplerSettings(1.0, top_p=1.0)).sum()) == 40 * 60


def test_draws_follow_the_kept_softmax():
    V, N = 6, 20000
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    s = SamplerSettings(1.0, top_p=0.9, seed=11)
    draws = seeded_sample(row.expand(N, V).contiguous(), s, H, torch.arange(N))
    p = torch.softmax(row[0].double(), -1)
    kept = kept_tokens(row, s)[0]
    q = torch.where(kept, p, 0.0)
    q = q / q.sum()
    freq = torch.bincount(draws, minlength=V).double() / N
    assert bool((freq[~kept] == 0).all())
    assert float((freq - q).abs().max()) < 4 * math.sqrt(0.25 / N), (freq, q)


def test_settings_are_checked():
    for bad, key in (({"temperature": -1.0}, "temperature"), ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
                     ({"temperature": 1.0, "top_k": 0}, "top_k"), ({"temperature": 1.0, "seed": 1 << 63}, "seed")):
        with pytest.raises(ValueError, match=key):
            SamplerSettings(**bad)
