"""The absorbed-query and sparse-MLA kernels (optimized/kernels/mla.py) against their twins, the
reference's own ``absorb_query`` / ``apply_rope`` / ``mla_over_lists``: byte equality on fresh
random inputs through Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1).

Shapes: tiny (nh=4, Lkv=16, R=8), small-like (nh=8, Lkv=64, R=16) and an odd one (nh=6: a
masked head block; Lkv=24 and nope=12: non-power-of-two trees; v=20). Lists of width K up to 40
with counts 1..K over a multi-block paged pool whose block table is shuffled; float32 and
bfloat16; T = 1 and 3; both RoPE layouts; default blocks and small blocks (many chunks); rows
of several states, each row in its own paged cache (a per-row ``RowCaches``), equal to the twin
and to each row run alone. Then kernels with one plausible mistake each (a library-order
denominator, ``tl.exp``, padding entries loaded as +0.0, the whole-width tree in place of
``psum_prefix``, every row reading line 0 of a per-row address table) are caught."""

import zlib

import pytest
import torch
import triton
import triton.language as tl

from glm_mtp.optimized.kernels import absorbed_query_torch, absorbed_query_triton, sparse_mla_torch, sparse_mla_triton
from glm_mtp.optimized.kernels import mla
from glm_mtp.optimized.kernels.launch import Launch
from glm_mtp.optimized.kernels.mla import (
    MlaBlocks, MlaScratch, _list_level, _physical_rows, sparse_mla_launches,
)
from glm_mtp.optimized.kernels.paged import ADDRESS_COLUMNS, RowCaches, row_pools
from glm_mtp.optimized.kernels.pinned_math import exp_f32 as _exp
from glm_mtp.optimized.kernels.pinned_math import psum_prefix_grid
from glm_mtp.reference import MtpConfig
from glm_mtp.reference.attention import Rope, absorb_query, latent_query, sparse_mla
from glm_mtp.reference.bytes import bits, same_bytes
from glm_mtp.reference.numerics import exp, linear
from glm_mtp.reference.state import LayerCache
from glm_mtp.reference.weights import MtpWeights

F32, BF16 = torch.float32, torch.bfloat16
DTYPES = [F32, BF16]
# Small caps: every tree in several chunks at these shapes (results must not change).
SMALL = MlaBlocks(gemv_k=4, absorb_k=4, tile=128, score_heads=2, score_rows=8, score_l=8, soft_heads=2, soft_k=8,
                  latent_heads=2,
                  latent_l=8, latent_k=8)

SHAPES = {
    "tiny": dict(),
    "small_like": dict(num_attention_heads=8, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                       index_head_dim=32),
    "odd": dict(num_attention_heads=6, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=20),
}


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _cfg(shape: str, interleave: bool = True) -> MtpConfig:
    return MtpConfig.preset("tiny").replace(rope_interleave=interleave, **SHAPES[shape])


def _mixed(gen, *shape, scale=1.0):
    """Mixed magnitudes: sums cancel and round differently in different orders."""
    return torch.randn(*shape, generator=gen) * torch.exp(0.5 * torch.randn(*shape, generator=gen)) * scale


def _query_inputs(cfg, dtype, T, gen):
    nh, nope, R, Lkv, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                           cfg.v_head_dim)
    q = _mixed(gen, T, nh * (nope + R)).to(dtype)
    kv_b = _mixed(gen, nh * (nope + v), Lkv, scale=0.3).to(dtype)
    rope = Rope.build(cfg, 128, "cpu")
    cos, sin = rope.at(torch.randint(0, 128, (T,), generator=gen))
    return q, kv_b, cos, sin


def _lists(T, K, counts, capacity, gen):
    """rows (T, K) int64 ascending with slot-0 padding, as select_rows makes them."""
    rows = torch.zeros(T, K, dtype=torch.int64)
    for t, n in enumerate(counts):
        rows[t, :n] = torch.randperm(capacity, generator=gen)[:n].sort().values
    return rows, torch.tensor(counts, dtype=torch.int64)


def _mla_inputs(cfg, dtype, counts, K, gen, blocks=6, score_scale=4.0):
    T = len(counts)
    R, Lkv = cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q, kv_b, cos, sin = _query_inputs(cfg, dtype, T, gen)
    q_abs, q_pe = absorbed_query_torch(cfg, q, kv_b, cos, sin)
    q_abs = q_abs * score_scale  # spread the scores: a softmax that is neither flat nor one-hot
    kv_pool = _mixed(gen, blocks, 16, Lkv + R).to(dtype)
    block_table = torch.randperm(blocks, generator=gen).to(torch.int32)  # shuffled pages
    assert not torch.equal(block_table, torch.arange(blocks, dtype=torch.int32))
    rows, count = _lists(T, K, counts, blocks * 16, gen)
    return q_abs, q_pe, _cache(cfg, kv_pool, block_table), rows, count, kv_b


def _cache(cfg, kv_pool, block_table):
    """A LayerCache around a kv pool (the index pool, which sparse_mla never reads, zeros)."""
    return LayerCache(kv_pool, torch.zeros(*kv_pool.shape[:2], cfg.index_head_dim, dtype=kv_pool.dtype), block_table)


# ---- the absorbed query -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,interleave,T", [("tiny", True, 1), ("tiny", False, 3), ("small_like", True, 3),
                                                ("odd", False, 1), ("odd", True, 3)])
def test_absorbed_query_bytes(shape, interleave, T, dtype):
    cfg = _cfg(shape, interleave)
    gen = torch.Generator().manual_seed(_seed(shape, interleave, T))
    q, kv_b, cos, sin = _query_inputs(cfg, dtype, T, gen)
    want_abs, want_pe = absorbed_query_torch(cfg, q, kv_b, cos, sin)
    for blocks in (MlaBlocks(), SMALL):
        got_abs, got_pe = absorbed_query_triton(cfg, q, kv_b, cos, sin, blocks=blocks)
        assert got_abs.dtype == F32 and got_pe.dtype == dtype
        assert same_bytes(got_abs, want_abs) and same_bytes(got_pe, want_pe)


def test_absorbed_query_twin_is_the_reference():
    """The twin on q_b_proj's output is latent_query's rope part and absorb_query of its nope part."""
    cfg = _cfg("odd")
    w = MtpWeights.random(cfg, seed=3, dtype=BF16)
    attn = w.layer.attn
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(3, cfg.hidden_size, generator=gen).to(BF16)
    cos, sin = Rope.build(cfg, 16, "cpu").at(torch.tensor([0, 5, 9]))
    q_latent, q_nope, q_pe = latent_query(attn, cfg, a, cos, sin)
    q_abs, q_pe2 = absorbed_query_triton(cfg, linear(q_latent, attn.q_b_proj), attn.kv_b_proj, cos, sin)
    assert same_bytes(q_pe2, q_pe) and same_bytes(q_abs, absorb_query(attn, cfg, q_nope))


# ---- the MLA over the lists -------------------------------------------------------------------------

# (shape, K, counts): single-entry lists, powers of two and one more (8/9, 16/17, 32/33), full
# lists, a K that is not a power of two (40, 24) and K = 1.
CASES = [
    ("tiny", 40, [1]),
    ("tiny", 40, [17, 40, 2]),
    ("tiny", 40, [33, 16, 32]),
    ("small_like", 40, [9, 40, 8]),
    ("small_like", 13, [13]),
    ("odd", 24, [5, 24, 17]),
    ("odd", 1, [1, 1, 1]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,K,counts", CASES)
def test_sparse_mla_bytes(shape, K, counts, dtype):
    cfg = _cfg(shape)
    gen = torch.Generator().manual_seed(_seed(shape, K, counts))
    args = _mla_inputs(cfg, dtype, counts, K, gen)
    want = sparse_mla_torch(cfg, *args)
    got = sparse_mla_triton(cfg, *args)
    assert got.shape == (len(counts), cfg.num_attention_heads * cfg.v_head_dim) and got.dtype == dtype
    assert same_bytes(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,K,counts,interleave", [("tiny", 40, [3, 40, 25], False), ("odd", 24, [24, 9], True)])
def test_sparse_mla_small_blocks(shape, K, counts, interleave, dtype):
    """Many chunks in every tree (latent, list, GEMV): the same bytes."""
    cfg = _cfg(shape, interleave)
    gen = torch.Generator().manual_seed(K + sum(counts))
    args = _mla_inputs(cfg, dtype, counts, K, gen)
    assert same_bytes(sparse_mla_triton(cfg, *args, blocks=SMALL), sparse_mla_torch(cfg, *args))


@pytest.mark.slow
def test_sparse_mla_every_count():
    """Counts 1..K at K = 40, one row each, in one call (each row as if alone)."""
    cfg = _cfg("tiny")
    gen = torch.Generator().manual_seed(40)
    counts = list(range(1, 41))
    args = _mla_inputs(cfg, BF16, counts, 40, gen, blocks=4)
    want = sparse_mla_torch(cfg, *args)
    got = sparse_mla_triton(cfg, *args, blocks=MlaBlocks(soft_k=8, latent_k=8))
    assert same_bytes(got, want)
    # Each row alone gives its bytes of the batch.
    q_abs, q_pe, cache, rows, count, kv_b = args
    for t in (0, 16, 32, 39):
        alone = sparse_mla_triton(cfg, q_abs[t : t + 1], q_pe[t : t + 1], cache, rows[t : t + 1], count[t : t + 1],
                                  kv_b)
        assert same_bytes(alone, want[t : t + 1])


def test_sparse_mla_passes_bound_the_scratch(monkeypatch):
    """Rows beyond the scratch bound run in further passes (views of the inputs): the same bytes."""
    cfg = _cfg("tiny")
    gen = torch.Generator().manual_seed(77)
    args = _mla_inputs(cfg, BF16, [3, 9, 1, 6, 2], 9, gen)
    monkeypatch.setattr(mla, "MLA_SCRATCH_ELEMENTS", 2 * cfg.num_attention_heads * 16)  # 2 rows a pass
    assert same_bytes(sparse_mla_triton(cfg, *args), sparse_mla_torch(cfg, *args))


def test_sparse_mla_is_the_reference_on_a_layer_cache():
    """Through the reference's own objects: sparse_mla of latent_query's q over a LayerCache with a
    shuffled block table equals the two kernels in a row."""
    cfg = _cfg("tiny")
    w = MtpWeights.random(cfg, seed=11, dtype=BF16)
    attn = w.layer.attn
    gen = torch.Generator().manual_seed(12)
    cache = LayerCache.allocate(cfg, 4, BF16, "cpu")
    cache.block_table = torch.randperm(4, generator=gen).to(torch.int32)
    cache.write(torch.arange(64), _mixed(gen, 64, cfg.kv_row_width).to(BF16),
                torch.zeros(64, cfg.index_head_dim, dtype=BF16))
    a = torch.randn(2, cfg.hidden_size, generator=gen).to(BF16)
    cos, sin = Rope.build(cfg, 64, "cpu").at(torch.tensor([20, 63]))
    rows, count = _lists(2, 6, [6, 3], 64, gen)
    q_latent, q_nope, q_pe = latent_query(attn, cfg, a, cos, sin)
    want = sparse_mla(attn, cfg, q_nope, q_pe, cache.kv_rows(), rows, count)
    q_abs, q_pe2 = absorbed_query_triton(cfg, linear(q_latent, attn.q_b_proj), attn.kv_b_proj, cos, sin)
    got = sparse_mla_triton(cfg, q_abs, q_pe2, cache, rows, count, attn.kv_b_proj)
    assert same_bytes(got, want)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: -inf - -inf of an empty list
def test_sparse_mla_edge_counts_and_specials():
    """count = 0 (an empty list: zeros through W_uv) and count > K (clamped, as numerics does);
    an inf in slot 0's latent reaches the rows whose padding lies inside next_pow2(count) (0 * inf)
    and only those."""
    cfg = _cfg("tiny")
    gen = torch.Generator().manual_seed(7)
    args = list(_mla_inputs(cfg, F32, [0, 7, 8, 8], 8, gen))
    args[4] = torch.tensor([0, 7, 9, 8])
    assert same_bytes(sparse_mla_triton(cfg, *args), sparse_mla_torch(cfg, *args))
    pool, table, rows = args[2].kv_pool, args[2].block_table, args[3]
    args[4] = torch.tensor([3, 7, 8, 4])
    rows[:, 3:] = 0
    rows[:, :3] = torch.tensor([5, 9, 30])
    rows[1, 3:7] = torch.tensor([33, 34, 40, 41])
    rows[2, 3:8] = torch.tensor([33, 34, 40, 41, 50])
    rows[3, 3] = 60
    pool[table[0], 0, 2] = float("inf")
    want, got = sparse_mla_torch(cfg, *args), sparse_mla_triton(cfg, *args)
    nan = torch.isnan(want).reshape(4, -1).any(-1)
    assert nan.tolist() == [True, True, False, False]  # count 3 and 7 pad inside their trees; 8 and 4 do not
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(bits(got)[~torch.isnan(want)],
                                                                            bits(want)[~torch.isnan(want)])


def test_bad_arguments():
    cfg = _cfg("tiny")
    gen = torch.Generator().manual_seed(1)
    q_abs, q_pe, cache, rows, count, kv_b = _mla_inputs(cfg, BF16, [2, 3], 4, gen)
    pool, table = cache.kv_pool, cache.block_table
    with pytest.raises(TypeError, match="share one dtype"):
        sparse_mla_triton(cfg, q_abs, q_pe.float(), cache, rows, count, kv_b)
    with pytest.raises(ValueError, match="block_table"):
        sparse_mla_triton(cfg, q_abs, q_pe, _cache(cfg, pool, table.long()), rows, count, kv_b)
    with pytest.raises(ValueError, match="rows must be"):
        sparse_mla_triton(cfg, q_abs, q_pe, cache, rows.int(), count, kv_b)
    # Per-row caches: one per row, every pool of one dtype and shape, every table of one length.
    with pytest.raises(ValueError, match="one per row"):
        sparse_mla_triton(cfg, q_abs, q_pe, RowCaches.per_row([cache, cache, cache]), rows, count, kv_b)
    other = _cache(cfg, pool.float(), table)
    with pytest.raises(ValueError, match="one dtype and shape"):
        sparse_mla_triton(cfg, q_abs, q_pe, RowCaches.per_row([cache, other]), rows, count, kv_b)
    bigger = _cache(cfg, torch.cat((pool, pool)), torch.cat((table, table + table.shape[0])))
    with pytest.raises(ValueError, match="one dtype and shape"):
        sparse_mla_triton(cfg, q_abs, q_pe, RowCaches.per_row([bigger, cache]), rows, count, kv_b)
    longer = _cache(cfg, pool, torch.cat((table, table)))
    with pytest.raises(ValueError, match="block_table"):
        sparse_mla_triton(cfg, q_abs, q_pe, RowCaches.per_row([cache, longer]), rows, count, kv_b)
    with pytest.raises(TypeError, match="share one dtype"):
        absorbed_query_triton(cfg, torch.zeros(1, 96, dtype=torch.float16), kv_b.half(), *Rope.build(cfg, 4, "cpu").at(
            torch.tensor([0])))


# ---- per-row caches: one launch over rows of many sequences (a batched draft step) -----------------

OWNER = [0, 1, 1, 2, 0]  # row t's state: rows 1 and 2 share one, row 4 is back in row 0's
VISIBLE = [1, 8, 21, 40, 64]  # row t's visible length (its newest slot: 0, 7, 20, 39, 63)


def _states(cfg, dtype, n, blocks, gen):
    """``n`` states' caches (``LayerCache.allocate``, the same number of blocks), each with its own
    random pools and shuffled block table."""
    states = []
    for _ in range(n):
        c = LayerCache.allocate(cfg, blocks, dtype, "cpu")
        c.kv_pool.copy_(_mixed(gen, *c.kv_pool.shape).to(dtype))
        c.index_pool.copy_(_mixed(gen, *c.index_pool.shape).to(dtype))
        c.block_table = torch.randperm(blocks, generator=gen).to(torch.int32)
        states.append(c)
    return states


def _batch_inputs(cfg, dtype, K, counts, gen, blocks=4):
    """Rows ``OWNER`` of three states, row t's list drawn from its first ``VISIBLE[t]`` slots."""
    T = len(OWNER)
    states = _states(cfg, dtype, 3, blocks, gen)
    q, kv_b, cos, sin = _query_inputs(cfg, dtype, T, gen)
    q_abs, q_pe = absorbed_query_torch(cfg, q, kv_b, cos, sin)
    q_abs = q_abs * 4.0
    rows = torch.zeros(T, K, dtype=torch.int64)
    for t, (n, visible) in enumerate(zip(counts, VISIBLE)):
        assert n <= min(visible, K)
        rows[t, :n] = torch.randperm(visible, generator=gen)[:n].sort().values
    return states, q_abs, q_pe, rows, torch.tensor(counts, dtype=torch.int64), kv_b


BATCH_CASES = [("tiny", 24, [1, 8, 17, 24, 5], MlaBlocks()), ("odd", 13, [1, 5, 13, 9, 13], SMALL)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,K,counts,blocks", BATCH_CASES, ids=["tiny", "odd_small_blocks"])
def test_sparse_mla_per_row_caches(shape, K, counts, blocks, dtype):
    """Row t reads its own state's pool: the kernel equals the twin (runs of rows per cache), and
    each row equals the same kernel called on its state alone (batch invariance)."""
    cfg = _cfg(shape)
    gen = torch.Generator().manual_seed(_seed("batch", shape, K))
    states, q_abs, q_pe, rows, count, kv_b = _batch_inputs(cfg, dtype, K, counts, gen)
    table = torch.full((8, ADDRESS_COLUMNS), -1, dtype=torch.int64)  # a static buffer, longer than the batch
    caches = RowCaches.per_row([states[o] for o in OWNER], table)
    assert caches.stride == ADDRESS_COLUMNS
    want = sparse_mla_torch(cfg, q_abs, q_pe, caches, rows, count, kv_b)
    got = sparse_mla_triton(cfg, q_abs, q_pe, caches, rows, count, kv_b, blocks=blocks)
    assert got.shape == (len(OWNER), cfg.num_attention_heads * cfg.v_head_dim) and got.dtype == dtype
    assert same_bytes(got, want)
    for t, o in enumerate(OWNER):
        one = (q_abs[t : t + 1], q_pe[t : t + 1])
        alone = sparse_mla_triton(cfg, *one, states[o], rows[t : t + 1], count[t : t + 1], kv_b, blocks=blocks)
        assert same_bytes(alone, got[t : t + 1]), t
        assert same_bytes(sparse_mla_torch(cfg, *one, states[o], rows[t : t + 1], count[t : t + 1], kv_b),
                          want[t : t + 1])
    # A one-row RowCaches (stride 0) is the same as its LayerCache.
    t = 3
    one = RowCaches.per_row([states[OWNER[t]]])
    assert one.stride == 0
    assert same_bytes(sparse_mla_triton(cfg, q_abs[t:], q_pe[t:], one, rows[t:], count[t:], kv_b, blocks=blocks),
                 sparse_mla_triton(cfg, q_abs[t:], q_pe[t:], states[OWNER[t]], rows[t:], count[t:], kv_b,
                                   blocks=blocks))


def test_sparse_mla_per_row_passes(monkeypatch):
    """Passes of 2 rows over a per-row table (each pass a slice of the table): the same bytes."""
    cfg = _cfg("tiny")
    gen = torch.Generator().manual_seed(78)
    states, q_abs, q_pe, rows, count, kv_b = _batch_inputs(cfg, BF16, 9, [1, 8, 9, 3, 9], gen)
    caches = RowCaches.per_row([states[o] for o in OWNER])
    monkeypatch.setattr(mla, "MLA_SCRATCH_ELEMENTS", 2 * cfg.num_attention_heads * 16)  # 2 rows a pass
    assert same_bytes(sparse_mla_triton(cfg, q_abs, q_pe, caches, rows, count, kv_b),
                 sparse_mla_torch(cfg, q_abs, q_pe, caches, rows, count, kv_b))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("which", [0, 2], ids=["scores", "latent"])
def test_per_row_mutant_is_caught(which, dtype):
    """A launch that reads every row's caches from line 0 of a per-row table (stride 0) gives
    other bytes for the rows whose state is not row 0's, and the same for those that are."""
    cfg = _cfg("tiny")
    gen = torch.Generator().manual_seed(_seed("mutant", which))
    states, q_abs, q_pe, rows, count, kv_b = _batch_inputs(cfg, dtype, 24, [1, 8, 17, 24, 5], gen)
    caches = RowCaches.per_row([states[o] for o in OWNER])
    want = sparse_mla_torch(cfg, q_abs, q_pe, caches, rows, count, kv_b)
    T, K = rows.shape
    out = torch.empty_like(want)
    scratch = MlaScratch.empty(T, cfg.num_attention_heads, K, cfg.kv_lora_rank, "cpu")
    launches = sparse_mla_launches(cfg, q_abs, q_pe, caches, rows, count, kv_b, scratch, out)
    args = list(launches[which].args)
    stride_at = next(i for i, a in enumerate(args) if a is caches.addresses) + 1
    assert args[stride_at] == ADDRESS_COLUMNS
    args[stride_at] = 0
    launches[which] = Launch(launches[which].kernel, launches[which].grid, tuple(args), launches[which].meta)
    for launch in launches:
        launch.run()
    for t, o in enumerate(OWNER):
        assert same_bytes(out[t], want[t]) == (o == OWNER[0]), t


# ---- the tests can fail: kernels with one plausible mistake -------------------------------------------


@triton.jit
def _softmax_mutant(s_ptr, p_ptr, count_ptr, nh, K, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                    LEVELS_K: tl.constexpr, NCHUNK: tl.constexpr, LEVELS_C: tl.constexpr, MODE: tl.constexpr):
    """The softmax with, MODE 0: a plain denominator, each chunk by ``tl.sum`` and the chunks
    added left to right over the whole width; MODE 1: ``tl.exp`` in place of the pinned exp."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_in = h < nh
    count = tl.minimum(tl.maximum(tl.load(count_ptr + t), 0), K)
    level = _list_level(count, LEVELS_K + LEVELS_C)
    kk = tl.arange(0, BLOCK_K)
    rows = s_ptr + (t * nh + h[:, None]) * K
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        s = tl.load(rows + k[None, :], mask=h_in[:, None] & (k < count)[None, :], other=float("-inf"))
        m = tl.maximum(m, tl.max(s, axis=1))
    m = tl.where(h_in, m, 0.0)
    col = tl.arange(0, NCHUNK)
    roots = tl.zeros((1, BLOCK_H, NCHUNK), tl.float32)
    den = tl.zeros((BLOCK_H,), tl.float32)
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        s = tl.load(rows + k[None, :], mask=h_in[:, None] & (k < count)[None, :], other=float("-inf"))
        if MODE == 1:
            e = tl.exp(s - m[:, None])
        else:
            e = _exp(s - m[:, None])
        e = tl.where((k < K)[None, :], e, 0.0)
        den = den + tl.sum(e, axis=1)
        root = psum_prefix_grid(tl.reshape(e, (1, BLOCK_H, BLOCK_K)), 1, BLOCK_H, BLOCK_K, LEVELS_K, level, 0)
        roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
    if MODE == 1:
        den = tl.reshape(psum_prefix_grid(roots, 1, BLOCK_H, NCHUNK, LEVELS_C, level, LEVELS_K), (BLOCK_H,))
    out = p_ptr + (t * nh + h[:, None]) * K
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        s = tl.load(rows + k[None, :], mask=h_in[:, None] & (k < count)[None, :], other=float("-inf"))
        if MODE == 1:
            e = tl.exp(s - m[:, None])
        else:
            e = _exp(s - m[:, None])
        tl.store(out + k[None, :], tl.math.div_rn(e, den[:, None]), mask=h_in[:, None] & (k < K)[None, :])


@triton.jit
def _latent_mutant(p_ptr, addresses_ptr, addr_stride, rows_ptr, count_ptr, o_ptr, nh, K, Lkv, R, stride_rows,
                   BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, LEVELS_K: tl.constexpr,
                   NCHUNK: tl.constexpr, LEVELS_C: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr, TO_BF16: tl.constexpr,
                   MODE: tl.constexpr):
    """The latent outputs with, MODE 0: the padding entries' rows loaded as +0.0 (a mask at
    count) instead of read as listed; MODE 1: the whole-width tree instead of psum_prefix."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    l = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    h_in = h < nh
    l_in = l < Lkv
    kv_pool_ptr, _, block_table_ptr = row_pools(addresses_ptr, t, addr_stride, TO_BF16)
    count = tl.minimum(tl.maximum(tl.load(count_ptr + t), 0), K)
    level = _list_level(count, LEVELS_K + LEVELS_C)
    if MODE == 1:
        level = level * 0 + LEVELS_K + LEVELS_C
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, NCHUNK)
    p_rows = p_ptr + (t * nh + h[:, None]) * K
    roots = tl.zeros((BLOCK_H, BLOCK_L, NCHUNK), tl.float32)
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        k_in = k < K
        kv_rows = kv_pool_ptr + _physical_rows(rows_ptr + t * stride_rows, block_table_ptr, k, k_in,
                                               ROWS_PER_BLOCK) * (Lkv + R)
        if MODE == 0:
            live = k < count
        else:
            live = k_in
        cv = tl.load(kv_rows[None, :] + l[:, None], mask=l_in[:, None] & live[None, :], other=0.0).to(tl.float32)
        pv = tl.load(p_rows + k[None, :], mask=h_in[:, None] & k_in[None, :], other=0.0)
        root = psum_prefix_grid(pv[:, None, :] * cv[None, :, :], BLOCK_H, BLOCK_L, BLOCK_K, LEVELS_K, level, 0)
        roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
    o = psum_prefix_grid(roots, BLOCK_H, BLOCK_L, NCHUNK, LEVELS_C, level, LEVELS_K)
    tl.store(o_ptr + (t * nh + h[:, None]) * Lkv + l[None, :], o, mask=h_in[:, None] & l_in[None, :])


def _run_with(cfg, args, blocks, which, kernel, mode):
    """sparse_mla_triton's launches with launch ``which`` (1: softmax, 2: latent) swapped for a
    mutant kernel on the same grid and arguments."""
    q_abs, q_pe, caches, rows, count, kv_b = args
    T, K = rows.shape
    out = torch.empty(T, cfg.num_attention_heads * cfg.v_head_dim, dtype=q_pe.dtype)
    scratch = MlaScratch.empty(T, cfg.num_attention_heads, K, cfg.kv_lora_rank, "cpu")
    scratch.probs.zero_()  # the mutants may read entries the pinned kernels never write
    launches = sparse_mla_launches(cfg, *args, scratch, out, blocks)
    launches[which] = Launch(kernel, launches[which].grid, launches[which].args, dict(launches[which].meta, MODE=mode))
    for launch in launches:
        launch.run()
    return out


@pytest.mark.parametrize("mode", [0, 1], ids=["plain_denominator", "tl_exp"])
def test_softmax_mutants_are_caught(mode):
    cfg = _cfg("tiny")
    gen = torch.Generator().manual_seed(31)
    args = _mla_inputs(cfg, F32, [40, 37, 21], 40, gen)
    blocks = MlaBlocks(soft_k=16)
    want = sparse_mla_torch(cfg, *args)
    assert same_bytes(sparse_mla_triton(cfg, *args, blocks=blocks), want)
    assert not same_bytes(_run_with(cfg, args, blocks, 1, _softmax_mutant, mode), want)


def _signed_zero_case(cfg, dtype):
    """Rows whose listed latents are all -0.0, slot 0 (the padding) negative, W_uv positive: the
    reference's output is -0.0 everywhere for a list of 3 in width 5 (its padding entry inside
    next_pow2(3) = 4 gives +0.0 * negative = -0.0; the lanes past 5 are +0.0 outside that subtree)."""
    gen = torch.Generator().manual_seed(5)
    args = list(_mla_inputs(cfg, dtype, [3, 3], 5, gen))
    q_abs, q_pe, cache, rows, count, kv_b = args
    pool, table = cache.kv_pool, cache.block_table
    Lkv = cfg.kv_lora_rank
    rows[:, :3] = torch.tensor([[4, 20, 33], [1, 2, 3]])
    for slot in (1, 2, 3, 4, 20, 33):
        pool[table[slot // 16], slot % 16, :Lkv] = -0.0
    pool[table[0], 0, :Lkv] = -(torch.rand(Lkv, generator=gen) + 0.5).to(dtype)
    args[5] = kv_b.abs()
    return args


@pytest.mark.parametrize("mode", [0, 1], ids=["padding_as_zero", "whole_width_tree"])
def test_latent_mutants_are_caught(mode):
    cfg = _cfg("tiny")
    args = _signed_zero_case(cfg, BF16)
    want = sparse_mla_torch(cfg, *args)
    assert (bits(want) == torch.tensor(-0.0, dtype=BF16).view(torch.int16)).all()  # the case is what it claims
    assert same_bytes(sparse_mla_triton(cfg, *args), want)
    assert not same_bytes(_run_with(cfg, args, MlaBlocks(), 2, _latent_mutant, mode), want)


@triton.jit
def _exp_both(x_ptr, y_ptr, z_ptr, n, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, _exp(x), mask=i < n)
    tl.store(z_ptr + i, tl.exp(x), mask=i < n)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy, on exp(89.5) in the interpreter
def test_exp_port_is_numerics_exp():
    """The kernels' exp is numerics.exp bit for bit on a sweep with specials (and tl.exp is not)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.cat((torch.randn(20000, generator=gen) * 40, torch.rand(20000, generator=gen) * -20,
                   torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 88.7, 89.5, -103.9, -104.5, -87.3])))
    y, z = torch.empty_like(x), torch.empty_like(x)
    _exp_both[(triton.cdiv(x.numel(), 1024),)](x, y, z, x.numel(), B=1024)
    assert same_bytes(y, exp(x))
    assert not same_bytes(z, exp(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_nope_mla_bytes(dtype):
    """glm5_next's NoPE MLA (qk_rope_head_dim 0: no rotation compiled, no rope lanes read): the
    absorbed query and the sparse MLA over lists equal their twins (the reference's code) at
    glm5next_tiny, a -0.0-free result included."""
    cfg = MtpConfig.preset("glm5next_tiny")
    assert cfg.qk_rope_head_dim == 0
    attn = MtpWeights.random(cfg, seed=4, dtype=dtype).layer.attn
    g = torch.Generator().manual_seed(12)
    T = 2
    q = torch.randn(T, cfg.num_attention_heads * cfg.qk_nope_head_dim, generator=g).to(dtype)
    cos = sin = torch.zeros(T, 0)
    want = absorbed_query_torch(cfg, q, attn.kv_b_proj, cos, sin)
    got = absorbed_query_triton(cfg, q, attn.kv_b_proj, cos, sin)
    assert same_bytes(got[0], want[0]) and got[1].shape == want[1].shape == (T, cfg.num_attention_heads, 0)
    cache = LayerCache.allocate(cfg, 2, dtype, "cpu")
    cache.kv_pool.copy_(torch.randn(cache.kv_pool.shape, generator=g).to(dtype))
    rows, count = torch.tensor([[0, 1, 2, 5, 0], [3, 4, 7, 8, 9]]), torch.tensor([4, 5])
    want_o = sparse_mla_torch(cfg, want[0], want[1], cache, rows, count, attn.kv_b_proj)
    got_o = sparse_mla_triton(cfg, want[0], want[1], cache, rows, count, attn.kv_b_proj)
    assert same_bytes(got_o, want_o)
