"""The KPool kernels (optimized/kernels/kpool.py, and the gate store of rope_cache's
cache_rows_write) against their twins, byte for byte through Triton's CPU interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), and the twins against the reference's
``kpool`` functions: rows that complete pools and rows that do not in one call, rows of several
states through one address table, the device flag off (nothing stored), bf16 and fp32, kpool 4
(glm5next_tiny) and 16 (the release). Mutants: a left-to-right pool sum, a selection without
its tail, a score kernel that reads every row's keys from line 0."""

from dataclasses import replace

import pytest
import torch

from glm_mtp.optimized.kernels import kpool as K
from glm_mtp.optimized.kernels.paged import RowCaches
from glm_mtp.optimized.kernels.rope_cache import cache_rows_write_torch, cache_rows_write_triton
from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.attention import Rope, normed_latent
from glm_mtp.reference.indexer import normed_index_keys
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.kpool import KPoolCache, pool_scores, pooled_keys, select_pool_rows, write_pools
from glm_mtp.reference.numerics import softmax, up
from glm_mtp.reference.state import LayerCache

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
BLOCKS = 4  # 64 rows per cache
ORDER = [2, 0, 1, 0]  # row t of a batch lives in state ORDER[t]; state 3 is in no row


def _cfg(kpool):
    cfg = MtpConfig.preset("glm5next_tiny")
    return cfg if kpool == cfg.index_kpool else cfg.replace(index_kpool=kpool, index_topk=2 * kpool)


def _cache(cfg, dtype, gen):
    """A cache of random contents: shuffled block table, index rows, gates, stale keys, random flags."""
    cache = LayerCache.allocate(cfg, BLOCKS, dtype, "cpu")
    cache.block_table.copy_(torch.randperm(BLOCKS, generator=gen).to(torch.int32))
    cache.kv_pool.copy_(torch.randn(cache.kv_pool.shape, generator=gen).to(dtype))
    cache.index_pool.copy_(torch.randn(cache.index_pool.shape, generator=gen).to(dtype))
    cache.kpool.gates.copy_((torch.randn(cache.kpool.gates.shape, generator=gen) * 2).to(dtype))
    cache.kpool.keys.copy_(torch.randn(cache.kpool.keys.shape, generator=gen).to(dtype))
    cache.kpool.complete.copy_(torch.rand(cache.kpool.complete.shape, generator=gen) < 0.5)
    return cache


def _case(kpool, dtype, seed):
    cfg = _cfg(kpool)
    w = MtpWeights.random(cfg, seed=seed, dtype=dtype)
    return cfg, w, _cache(cfg, dtype, torch.Generator().manual_seed(seed))


def _clone(c):
    kp = c.kpool
    return LayerCache(c.kv_pool.clone(), c.index_pool.clone(), c.block_table.clone(),
                      KPoolCache(kp.gates.clone(), kp.keys.clone(), kp.complete.clone(), kp.kpool))


def _same(a, b):
    return all(same_bytes(x, y) for x, y in ((a.kv_pool, b.kv_pool), (a.index_pool, b.index_pool),
                                             (a.kpool.gates, b.kpool.gates), (a.kpool.keys, b.kpool.keys),
                                             (a.kpool.complete, b.kpool.complete)))


def _states(cfg, dtype, seed, n=4):
    gen = torch.Generator().manual_seed(seed)
    return [_cache(cfg, dtype, gen) for _ in range(n)]


# ---- the pooled-key write -------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("kpool", [4, 16])
def test_pool_keys_write_bytes(kpool, dtype):
    """One cache: rows completing pools 0 and 2 and rows that complete nothing, out of order;
    the kernel equals the twin, the twin the reference's write_pools; nothing stored when ok is off."""
    cfg, w, cache = _case(kpool, dtype, seed=kpool + (dtype == torch.bfloat16))
    ix, kp = w.layer.attn.indexer, cfg.index_kpool
    cache.kpool.complete.zero_()
    slots = torch.tensor([3 * kp - 1, 5, kp - 1, 2 * kp + 1], dtype=torch.int64)
    for ok in (True, False):
        okt = torch.tensor([ok])
        want, got = _clone(cache), _clone(cache)
        K.pool_keys_write_torch(cfg, ix, slots, want, okt)
        K.pool_keys_write_triton(cfg, ix, slots, got, okt)
        assert _same(got, want)
        if not ok:
            assert _same(got, cache)
    assert got is not None
    got = _clone(cache)
    K.pool_keys_write_triton(cfg, ix, slots, got, torch.tensor([True]))
    assert got.kpool.complete.nonzero().flatten().tolist() == [0, 2]
    ref = _clone(cache)  # the reference: write_pools (the gates are already stored)
    write_pools(ix, cfg, cache.kpool.gates[slots], slots, ref)
    assert _same(ref, got)


@DTYPES
def test_pool_keys_write_per_row_caches(dtype):
    """Rows of 3 states through one address table: byte-equal to the twin and to each row written
    alone into its own state; state 3 (in no row) untouched."""
    cfg = _cfg(4)
    ix = MtpWeights.random(cfg, seed=3, dtype=dtype).layer.attn.indexer
    kp = cfg.index_kpool
    slots = torch.tensor([kp - 1, 2 * kp - 1, 5, 4 * kp - 1], dtype=torch.int64)  # the third completes nothing
    states = _states(cfg, dtype, seed=7)
    twin, alone = [_clone(c) for c in states], [_clone(c) for c in states]
    before = [_clone(c) for c in states]
    ok = torch.tensor([True])
    K.pool_keys_write_torch(cfg, ix, slots, RowCaches.per_row([twin[i] for i in ORDER]), ok)
    K.pool_keys_write_triton(cfg, ix, slots, RowCaches.per_row([states[i] for i in ORDER]), ok)
    for t in range(len(ORDER)):
        K.pool_keys_write_triton(cfg, ix, slots[t : t + 1], alone[ORDER[t]], ok)
    assert all(_same(a, b) for a, b in zip(states, twin)) and all(_same(a, b) for a, b in zip(states, alone))
    assert _same(states[3], before[3]) and not _same(states[2], before[2])


def test_a_left_to_right_pool_sum_is_caught():
    """The same pools with the sum over positions taken left to right: a different key somewhere."""
    cfg, w, cache = _case(16, torch.float32, seed=5)
    ix = w.layer.attn.indexer
    slots = torch.tensor([15, 31, 47, 63], dtype=torch.int64)
    K.pool_keys_write_triton(cfg, ix, slots, cache, torch.tensor([True]))
    got = cache.kpool.keys
    rows = torch.arange(64).reshape(4, 16)
    block = cache.block_table[rows // 16].long()
    k = cache.index_pool[block, rows % 16]
    logits = up(cache.kpool.gates[rows]) + up(ix.kpool_ape)[None]
    p = softmax(logits.transpose(1, 2))  # (P, D, kp)
    prod = p * up(k).transpose(1, 2)
    serial = prod[..., 0]
    for j in range(1, 16):
        serial = serial + prod[..., j]
    assert same_bytes(got, pooled_keys(ix, k, cache.kpool.gates[rows]))
    assert not same_bytes(got, serial.to(torch.float32))


# ---- the gate store (cache_rows_write) ------------------------------------------------------------


@DTYPES
def test_cache_rows_write_stores_gates(dtype):
    """NoPE rows with their gates, rows of 3 states in one launch: the kernel equals the twin (the
    reference's normed rows and ``kpool.gates[slot] = g``); nothing stored when ok is off."""
    cfg = _cfg(4)
    w = MtpWeights.random(cfg, seed=11, dtype=dtype)
    attn, ix = w.layer.attn, w.layer.attn.indexer
    gen = torch.Generator().manual_seed(12)
    T, D = len(ORDER), cfg.index_head_dim
    slots = torch.tensor([3, 17, 40, 9], dtype=torch.int64)
    kv = torch.randn(T, cfg.kv_lora_rank, generator=gen).to(dtype)
    k = torch.randn(T, D, generator=gen).to(dtype)
    gates = torch.randn(T, D, generator=gen).to(dtype)
    rope = Rope.build(cfg, BLOCKS * 16, "cpu")
    for ok in (True, False):
        states = _states(cfg, dtype, seed=13)
        twin, before = [_clone(c) for c in states], [_clone(c) for c in states]
        args = (kv, k, attn.kv_a_layernorm, ix.k_norm_weight, ix.k_norm_bias, slots, rope.cos, rope.sin)
        okt = torch.tensor([ok])
        cache_rows_write_torch(cfg, *args, RowCaches.per_row([twin[i] for i in ORDER]), okt, gates)
        cache_rows_write_triton(cfg, *args, RowCaches.per_row([states[i] for i in ORDER]), okt, gates)
        assert all(_same(a, b) for a, b in zip(states, twin))
        if ok:  # the reference's rows: normed_latent (at cfg.latent_norm_eps) and k_norm, no RoPE
            latent, key = normed_latent(attn, cfg, kv), normed_index_keys(ix, k)
            for t, i in enumerate(ORDER):
                c, s = states[i], slots[t : t + 1]
                assert same_bytes(c.kpool.gates[s][0], gates[t])
                assert same_bytes(c.kv_rows()[s][0], latent[t]) and same_bytes(c.index_rows()[s][0], key[t])
        else:
            assert all(_same(a, b) for a, b in zip(states, before))


# ---- pool scores ----------------------------------------------------------------------------------


def _score_inputs(cfg, dtype, seed, T):
    gen = torch.Generator().manual_seed(seed)
    Hi, D = cfg.index_n_heads, cfg.index_head_dim
    return torch.randn(T, Hi * D, generator=gen).to(dtype), torch.randn(T, Hi, generator=gen).to(dtype)


def _visible(cfg, slots, P):
    return torch.arange(P)[None, :] < ((slots + 1) // cfg.index_kpool)[:, None]


@DTYPES
@pytest.mark.parametrize("kpool", [4, 16])
def test_pool_scores_bytes(kpool, dtype):
    """Rows seeing no pool, some and all of them: the kernel equals the twin at every visible pool
    and writes nothing past them (a sentinel there survives); the twin is the reference's
    pool_scores on the visible pools and -inf past them."""
    cfg, _, cache = _case(kpool, dtype, seed=20 + kpool)
    Hi, D, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    P = cache.kpool.keys.shape[0]
    slots = torch.tensor([0, kp - 1, 3 * kp + 1, P * kp - 1], dtype=torch.int64)
    q, w = _score_inputs(cfg, dtype, kpool, 4)
    want = K.pool_scores_torch(cfg, q, w, cache, slots)
    got = torch.full((4, P), 12345.0)
    K.pool_scores_launch(cfg, q, w, RowCaches.of(cache), slots, got).run()
    vis = _visible(cfg, slots, P)
    assert same_bytes(got[vis], want[vis]) and bool((got[~vis] == 12345.0).all())
    assert bool(torch.isinf(want[~vis]).all()) and vis.sum(1).tolist() == [0, 1, 3, P]
    ref = pool_scores(q.reshape(4, Hi, D), up(w) * Hi**-0.5, cache.kpool.keys[:3], cfg)
    assert same_bytes(want[2, :3], ref[2])


@DTYPES
def test_pool_scores_per_row_caches(dtype):
    """Rows of 3 states through one address table: each row scored on its own state's keys."""
    cfg = _cfg(4)
    states = _states(cfg, dtype, seed=31)
    slots = torch.tensor([63, 20, 9, 47], dtype=torch.int64)
    q, w = _score_inputs(cfg, dtype, 32, 4)
    rc = RowCaches.per_row([states[i] for i in ORDER])
    want = K.pool_scores_torch(cfg, q, w, rc, slots)
    got = K.pool_scores_triton(cfg, q, w, rc, slots)
    vis = _visible(cfg, slots, want.shape[1])
    assert same_bytes(got[vis], want[vis])
    for t, i in enumerate(ORDER):
        alone = K.pool_scores_torch(cfg, q[t : t + 1], w[t : t + 1], states[i], slots[t : t + 1])
        assert same_bytes(alone[0], want[t])


def test_pool_scores_mutant_every_row_reads_line_zero():
    """Every row's keys read through line 0 of a per-row table (stride 0): caught."""
    cfg = _cfg(4)
    states = _states(cfg, torch.float32, seed=33)
    slots = torch.tensor([63, 20, 9, 47], dtype=torch.int64)
    q, w = _score_inputs(cfg, torch.float32, 34, 4)
    rc = RowCaches.per_row([states[i] for i in ORDER])
    want = K.pool_scores_torch(cfg, q, w, rc, slots)
    out = torch.empty_like(want)
    launch = K.pool_scores_launch(cfg, q, w, rc, slots, out)
    replace(launch, args=launch.args[:3] + (0,) + launch.args[4:]).run()
    vis = _visible(cfg, slots, want.shape[1])
    assert not same_bytes(out[vis], want[vis])


# ---- pool selection -------------------------------------------------------------------------------


@pytest.mark.parametrize("kpool", [4, 16])
def test_select_pool_rows_bytes(kpool):
    """One launch: rows with no complete pool, fewer pools than selected, more (quantised scores:
    ties), a row completing its pool (no tail), NaN and -0.0 scores, garbage past each row's
    visible pools (never read); equal to the reference's select_pool_rows."""
    cfg = _cfg(kpool)
    kp, P = cfg.index_kpool, 12
    gen = torch.Generator().manual_seed(kpool)
    slots = torch.tensor([0, kp - 1, kp + 1, 5 * kp - 1, 7 * kp + 2, P * kp - 1], dtype=torch.int64)
    scores = (torch.randn(len(slots), P, generator=gen) * 2).round() / 2  # ties
    scores[4, 1], scores[4, 3], scores[5, 2] = float("nan"), -0.0, 0.0
    scores[~_visible(cfg, slots, P)] = 1e30  # would win every selection if read
    want = K.select_pool_rows_torch(cfg, scores, slots)
    got = K.select_pool_rows_triton(cfg, scores, slots)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
    assert got[1].tolist() == [1, kp, kp + 2, 2 * kp, 2 * kp + 3, 2 * kp]


def test_select_pool_rows_mutant_without_tail_is_caught():
    """A selection that drops the tail (each row run as if at its last complete pool's last row,
    so its own incomplete pool's rows are not listed): caught."""
    cfg = _cfg(4)
    slots = torch.tensor([6, 13, 30], dtype=torch.int64)
    scores = torch.randn(3, 8, generator=torch.Generator().manual_seed(9))
    want = select_pool_rows(scores, slots, cfg)
    rows = torch.empty(3, K.list_width(cfg, 8), dtype=torch.int64)
    count = torch.empty(3, dtype=torch.int64)
    launch = K.select_pool_rows_launch(cfg, scores, slots.clone(), rows, count)
    replace(launch, args=(launch.args[0], (slots + 1) // 4 * 4 - 1) + launch.args[2:]).run()
    assert not (same_bytes(rows, want[0]) and same_bytes(count, want[1]))


# ---- forgetting pools -----------------------------------------------------------------------------


def test_pools_forget_bytes():
    """Rows of 3 states (two rows in state 0, in order) through one table: the kernel equals the
    twin (``KPoolCache.forget_from`` of each row's count); nothing changes when ok is off."""
    cfg = _cfg(4)
    n = torch.tensor([5, 40, 0, 23], dtype=torch.int64)
    for ok in (True, False):
        states = _states(cfg, torch.bfloat16, seed=41)
        for s in states:
            s.kpool.complete.fill_(True)
        twin, before = [_clone(c) for c in states], [_clone(c) for c in states]
        okt = torch.tensor([ok])
        K.pools_forget_torch(cfg, n, RowCaches.per_row([twin[i] for i in ORDER]), okt)
        K.pools_forget_triton(cfg, n, RowCaches.per_row([states[i] for i in ORDER]), okt)
        assert all(_same(a, b) for a, b in zip(states, twin))
        if ok:
            assert states[2].kpool.complete.tolist() == [True] * 1 + [False] * 15
            assert states[0].kpool.complete.tolist() == [True] * 5 + [False] * 11  # min of 40 and 23 rows
            assert states[1].kpool.complete.sum().item() == 0 and bool(states[3].kpool.complete.all())
        else:
            assert all(_same(a, b) for a, b in zip(states, before))


def test_kpool_kernels_check_their_arguments():
    cfg, w, cache = _case(4, torch.float32, seed=50)
    ix = w.layer.attn.indexer
    slots = torch.tensor([3], dtype=torch.int64)
    with pytest.raises(ValueError, match="slots must be"):
        K.pool_keys_write_triton(cfg, ix, slots.int(), cache, torch.tensor([True]))
    with pytest.raises(ValueError, match="ok must be one bool"):
        K.pool_keys_write_triton(cfg, ix, slots, cache, torch.tensor([1]))
    bare = LayerCache(cache.kv_pool, cache.index_pool, cache.block_table)
    with pytest.raises(ValueError, match="needs its KPool cache"):
        K.pool_scores_triton(cfg, *_score_inputs(cfg, torch.float32, 1, 1), bare, slots)
    with pytest.raises(ValueError, match="q_raw"):
        K.pool_scores_triton(cfg, *_score_inputs(cfg, torch.float32, 1, 2), cache, slots)
    with pytest.raises(TypeError, match="storage dtype"):
        f16 = LayerCache.allocate(cfg, BLOCKS, torch.float16, "cpu")
        K.pools_forget_triton(cfg, slots, f16, torch.tensor([True]))
