"""The KPool pooled-key write (optimized/kernels/kpool.py) against its twin, byte for byte through
Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1), and the twin against the
reference's ``kpool.write_pools``: rows that complete pools and rows that do not in one call,
the device flag off (nothing stored), bf16 and fp32, kpool 4 (glm5next_tiny) and 16 (the
release). A key from a left-to-right sum over the pool is caught on the same inputs."""

import pytest
import torch

from glm_mtp.optimized.kernels import kpool as K
from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.kpool import pooled_keys, write_pools
from glm_mtp.reference.numerics import softmax, up
from glm_mtp.reference.state import LayerCache

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _ints(x):
    return x.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.bool: torch.uint8}[x.dtype])


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_ints(a), _ints(b))


def _case(kpool, dtype, seed):
    cfg = MtpConfig.preset("glm5next_tiny")
    if kpool != cfg.index_kpool:
        cfg = cfg.replace(index_kpool=kpool, index_topk=2 * kpool)
    w = MtpWeights.random(cfg, seed=seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    cache = LayerCache.allocate(cfg, 4, dtype, "cpu")  # 64 rows
    cache.block_table.copy_(torch.randperm(4, generator=gen).to(torch.int32))  # a shuffled table
    cache.index_pool.copy_(torch.randn(cache.index_pool.shape, generator=gen).to(dtype))
    cache.kpool.gates.copy_((torch.randn(cache.kpool.gates.shape, generator=gen) * 2).to(dtype))
    cache.kpool.keys.copy_(torch.randn(cache.kpool.keys.shape, generator=gen).to(dtype))  # stale keys
    return cfg, w.layer.attn.indexer, cache


def _run(fn, cfg, ix, cache, slots, ok):
    keys, complete = cache.kpool.keys.clone(), cache.kpool.complete.clone()
    fn(cfg, ix, slots, cache.index_pool, cache.block_table, cache.kpool.gates, keys, complete, ok)
    return keys, complete


@DTYPES
@pytest.mark.parametrize("kpool", [4, 16])
def test_pool_keys_write_bytes(kpool, dtype):
    cfg, ix, cache = _case(kpool, dtype, seed=kpool + (dtype == torch.bfloat16))
    kp = cfg.index_kpool
    # Rows completing pools 0 and 2 and rows that complete nothing, out of order.
    slots = torch.tensor([3 * kp - 1, 5, kp - 1, 2 * kp + 1], dtype=torch.int64)
    for ok in (True, False):
        okt = torch.tensor([ok])
        want = _run(K.pool_keys_write_torch, cfg, ix, cache, slots, okt)
        got = _run(K.pool_keys_write_triton, cfg, ix, cache, slots, okt)
        assert same(got[0], want[0]) and same(got[1], want[1])
        if not ok:
            assert same(want[0], cache.kpool.keys) and not bool(want[1].any())
    keys, complete = _run(K.pool_keys_write_triton, cfg, ix, cache, slots, torch.tensor([True]))
    assert complete.nonzero().flatten().tolist() == [0, 2]
    # The twin is the reference: write_pools on a copy of the cache (gates already stored).
    ref = LayerCache(cache.kv_pool, cache.index_pool, cache.block_table, type(cache.kpool)(
        cache.kpool.gates.clone(), cache.kpool.keys.clone(), cache.kpool.complete.clone(), kp))
    write_pools(ix, cfg, cache.kpool.gates[slots], slots, ref)
    assert same(ref.kpool.keys, keys) and same(ref.kpool.complete, complete)


def test_a_left_to_right_pool_sum_is_caught():
    """The same pools with the sum over positions taken left to right: a different key somewhere."""
    cfg, ix, cache = _case(16, torch.float32, seed=5)
    slots = torch.tensor([15, 31, 47, 63], dtype=torch.int64)
    got, _ = _run(K.pool_keys_write_triton, cfg, ix, cache, slots, torch.tensor([True]))
    rows = torch.arange(64).reshape(4, 16)
    block = cache.block_table[rows // 16].long()
    k = cache.index_pool[block, rows % 16]
    logits = up(cache.kpool.gates[rows]) + up(ix.kpool_ape)[None]
    p = softmax(logits.transpose(1, 2))  # (P, D, kp)
    prod = p * up(k).transpose(1, 2)
    serial = prod[..., 0]
    for j in range(1, 16):
        serial = serial + prod[..., j]
    assert same(got, pooled_keys(ix, k, cache.kpool.gates[rows]))
    assert not same(got, serial.to(torch.float32))


@DTYPES
@pytest.mark.parametrize("kpool", [4, 16])
def test_pool_scores_bytes(kpool, dtype):
    """Rows seeing no pool, some and all of them; -inf past each row's visible pools; the
    kernel equals the twin and the twin the reference's pool_scores on the visible pools."""
    cfg, ix, cache = _case(kpool, dtype, seed=20 + kpool)
    gen = torch.Generator().manual_seed(kpool)
    Hi, D, kp = cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    P = cache.kpool.keys.shape[0]
    slots = torch.tensor([0, kp - 1, 3 * kp + 1, P * kp - 1], dtype=torch.int64)
    q = torch.randn(4, Hi * D, generator=gen).to(dtype)
    w = torch.randn(4, Hi, generator=gen).to(dtype)
    want = K.pool_scores_torch(cfg, q, w, cache.kpool.keys, slots)
    got = K.pool_scores_triton(cfg, q, w, cache.kpool.keys, slots)
    assert same(got, want)
    assert bool(torch.isinf(want[0]).all()) and bool(torch.isfinite(want[3]).all())
    assert torch.isfinite(want[2]).sum().item() == 3
    from glm_mtp.reference.kpool import pool_scores as ref_scores
    ref = ref_scores(q.reshape(4, Hi, D), up(w) * Hi**-0.5, cache.kpool.keys[:3], cfg)
    assert same(want[2, :3], ref[2])


@pytest.mark.parametrize("kpool", [4, 16])
def test_select_pool_rows_bytes(kpool):
    """Through GLM-5's top-k kernel (interpreted) and the expansion: rows with no complete pool,
    fewer pools than selected, more (quantised scores: ties), a row completing its pool (no tail),
    NaN and -0.0 scores; equal to the reference's select_pool_rows."""
    cfg = MtpConfig.preset("glm5next_tiny")
    if kpool != cfg.index_kpool:
        cfg = cfg.replace(index_kpool=kpool, index_topk=2 * kpool)
    kp, P = cfg.index_kpool, 12
    gen = torch.Generator().manual_seed(kpool)
    slots = torch.tensor([0, kp - 1, kp + 1, 5 * kp - 1, 7 * kp + 2, P * kp - 1], dtype=torch.int64)
    scores = (torch.randn(len(slots), P, generator=gen) * 2).round() / 2  # ties
    scores[4, 1], scores[4, 3], scores[5, 2] = float("nan"), -0.0, 0.0
    want = K.select_pool_rows_torch(cfg, scores, slots)
    got = K.select_pool_rows_triton(cfg, scores, slots)
    assert same_int(got[0], want[0]) and same_int(got[1], want[1])
    assert got[1].tolist() == [1, kp, kp + 2, 2 * kp, 2 * kp + 3, 2 * kp]


def same_int(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
