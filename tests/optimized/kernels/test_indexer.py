"""The indexer's kernels against their twins (the reference's own functions), byte for byte,
through Triton's CPU interpreter: the cache write with the norms fused in, the index scores over
a shuffled paged pool, and the top-k selection. Mutants show each comparison can fail."""

import pytest
import torch
from einops import rearrange

from glm_mtp.optimized.kernels.paged import ADDRESS_COLUMNS
from glm_mtp.optimized.kernels import (
    cache_rows_write_torch,
    cache_rows_write_triton,
    index_scores_torch,
    index_scores_triton,
    select_rows_torch,
    select_rows_triton,
)
from glm_mtp.reference import MtpConfig, MtpWeights
from glm_mtp.reference.attention import LATENT_NORM_EPS, Rope, new_cache_rows
from glm_mtp.reference.bytes import bits, same_bytes
from glm_mtp.reference.indexer import index_queries, index_scores, index_weight_scale, rope_first
from glm_mtp.reference.numerics import linear, linear_acc, psum, recip, sqrt, up
from glm_mtp.reference.state import LayerCache

DTYPES = [torch.float32, torch.bfloat16]
TINY = MtpConfig.preset("tiny")  # Hi = 2, D = 16, R = 8, topk 6, interleaved RoPE
SMALL = MtpConfig.preset("small")  # Hi = 4, D = 32, R = 16, topk 32
# Nothing a power of two: Hi = 3, D = 20, R = 6, Lkv = 24 (masked tails everywhere); RoPE on halves.
ODD = TINY.replace(index_n_heads=3, index_head_dim=20, qk_rope_head_dim=6, kv_lora_rank=24, index_topk=5,
                   rope_interleave=False, indexer_rope_interleave=False)
MIXED = TINY.replace(rope_interleave=True, indexer_rope_interleave=False)
CONFIGS = {"tiny": TINY, "small": SMALL, "odd": ODD, "mixed": MIXED}


def _pool(cfg, dtype, blocks, gen, quantised=False):
    """A random index pool (never zeros) over a shuffled block table."""
    D = cfg.index_head_dim
    if quantised:
        pool = torch.randint(-1, 2, (blocks, 16, D), generator=gen).float()
    else:
        pool = torch.randn(blocks, 16, D, generator=gen) * 2
    return pool.to(dtype), torch.randperm(blocks, generator=gen).to(torch.int32)


def _queries(cfg, dtype, T, gen, quantised=False):
    Hi, D = cfg.index_n_heads, cfg.index_head_dim
    if quantised:
        return torch.randint(-1, 2, (T, Hi * D), generator=gen).float().to(dtype), torch.ones(T, Hi).to(dtype)
    return (torch.randn(T, Hi * D, generator=gen) * 2).to(dtype), torch.randn(T, Hi, generator=gen).to(dtype)


# ---- index scores ---------------------------------------------------------------------------------

SCORE_CASES = [
    ("tiny", 3, [15]),
    ("tiny", 3, [0, 16, 47]),
    ("small", 32, [511]),
    ("small", 32, [15, 16, 300]),
    ("odd", 5, [79]),
    ("odd", 5, [0, 40, 17]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,blocks,slots", SCORE_CASES)
def test_index_scores(dtype, name, blocks, slots):
    cfg = CONFIGS[name]
    gen = torch.Generator().manual_seed(blocks * 100 + len(slots) + sum(slots))
    slots = torch.tensor(slots)
    T = slots.shape[0]
    pool, table = _pool(cfg, dtype, blocks, gen)
    q, w = _queries(cfg, dtype, T, gen)
    rope = Rope.build(cfg, 16 * blocks, "cpu")
    cos, sin = rope.at(slots)
    want = index_scores_torch(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots)
    got = index_scores_triton(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots)
    assert same_bytes(want, got)
    C = 16 * blocks
    visible = torch.arange(C)[None, :] <= slots[:, None]
    assert torch.isfinite(got[visible]).all() and (got[~visible] == float("-inf")).all()
    assert (got[visible] != 0).any()
    # Each row is scored as if alone (T = 1 gives the same bytes).
    for t in range(T):
        r = slice(t, t + 1)
        alone = index_scores_triton(cfg, q[r], w[r], cos[r], sin[r], LayerCache(pool, pool, table), slots[r])
        assert same_bytes(alone, got[t : t + 1])


def test_index_scores_twin_is_the_reference_path():
    """The twin from raw GEMV outputs equals ``index_queries`` + ``index_scores`` on real weights."""
    cfg, dtype = SMALL, torch.bfloat16
    attn = MtpWeights.random(cfg, seed=3, dtype=dtype).layer.attn
    gen = torch.Generator().manual_seed(5)
    T, blocks = 3, 4
    a = torch.randn(T, cfg.hidden_size, generator=gen).to(dtype)
    q_latent = torch.randn(T, cfg.q_lora_rank, generator=gen).to(dtype)
    slots = torch.tensor([0, 17, 63])
    rope = Rope.build(cfg, 16 * blocks, "cpu")
    cos, sin = rope.at(slots)
    pool, table = _pool(cfg, dtype, blocks, gen)
    q_idx, w_idx = index_queries(attn.indexer, cfg, a, q_latent, cos, sin)
    want = index_scores(q_idx, w_idx, LayerCache(pool, pool, table).index_rows())
    want = want.masked_fill(torch.arange(16 * blocks)[None, :] > slots[:, None], float("-inf"))
    q, w = linear(q_latent, attn.indexer.wq_b), linear(a, attn.indexer.weights_proj)
    assert same_bytes(want, index_scores_torch(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots))
    assert same_bytes(want, index_scores_triton(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots))


def test_index_scores_relu_keeps_negative_zero():
    """torch.relu(-0.0) is -0.0: a row whose every product is -0.0 scores -0.0, not +0.0."""
    cfg, dtype = TINY, torch.float32
    gen = torch.Generator().manual_seed(9)
    pool, table = _pool(cfg, dtype, 2, gen)
    pool[:, 3] = -0.0  # physical row 3 of every block: slot 3 and slot 19
    q, w = _queries(cfg, dtype, 1, gen)
    q, w = q.abs() + 0.5, w.abs() + 0.25
    slots = torch.tensor([31])
    cos, sin = torch.ones(1, cfg.qk_rope_head_dim // 2), torch.zeros(1, cfg.qk_rope_head_dim // 2)  # RoPE keeps q > 0
    want = index_scores_torch(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots)
    got = index_scores_triton(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots)
    assert same_bytes(want, got)
    assert int(bits(got)[0, 3]) == int(bits(torch.tensor(-0.0))) and int(bits(got)[0, 19]) == int(
        bits(torch.tensor(-0.0))
    )


def test_index_scores_mutants():
    """The comparison catches an unrotated query (the kernel run with cos = 1, sin = 0) and a
    sum over heads in another order (a left fold, as a plain loop or a library sum might)."""
    cfg, dtype = SMALL, torch.float32
    gen = torch.Generator().manual_seed(21)
    blocks = 4
    slots = torch.tensor([63, 20, 33])
    pool, table = _pool(cfg, dtype, blocks, gen)
    q, w = _queries(cfg, dtype, 3, gen)
    cos, sin = Rope.build(cfg, 16 * blocks, "cpu").at(slots)
    want = index_scores_torch(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots)
    assert same_bytes(want, index_scores_triton(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots))
    unrotated = index_scores_triton(cfg, q, w, torch.ones_like(cos), torch.zeros_like(sin),
                                    LayerCache(pool, pool, table), slots)
    assert not same_bytes(want, unrotated)
    # Heads summed left to right instead of the psum tree.
    qh = rope_first(rearrange(q, "t (h d) -> t h d", h=cfg.index_n_heads), cos[:, None], sin[:, None], cfg)
    per_head = rearrange(linear_acc(rearrange(qh, "t h d -> (t h) d"), pool[table.long()].flatten(0, 1)),
                         "(t h) s -> t s h", h=cfg.index_n_heads)
    v = (up(w) * index_weight_scale(cfg))[:, None, :] * torch.relu(per_head)
    folded = v[..., 0]
    for h in range(1, cfg.index_n_heads):
        folded = folded + v[..., h]
    assert same_bytes(want[0], psum(v)[0])  # the tree is what the twin computes
    visible = torch.arange(16 * blocks)[None, :] <= slots[:, None]
    assert not same_bytes(want[visible], folded[visible])


# ---- selection ------------------------------------------------------------------------------------


def _scores(kind, T, S, gen):
    if kind == "random":
        return torch.randn(T, S, generator=gen)
    s = torch.randint(-3, 4, (T, S), generator=gen).float()  # many ties
    if kind == "special":
        pick = torch.randint(0, 12, (T, S), generator=gen)
        s = torch.where(pick == 0, float("nan"), s)
        s = torch.where(pick == 1, -float("nan"), s)
        s = torch.where(pick == 2, float("inf"), s)
        s = torch.where(pick == 3, float("-inf"), s)
        s = torch.where(pick == 4, -0.0, s)
        s = torch.where(pick == 5, 0.0, s)
        s = torch.where(pick == 6, 1e-45, s)  # a denormal
    return s


SELECT_CASES = [
    (48, [15]),
    (48, [0, 16, 47]),
    (512, [511]),
    (512, [15, 16, 300]),
    (300, [299, 5, 310]),  # a width that is no multiple of 16; a slot past it sees every row
]


@pytest.mark.parametrize("kind", ["random", "quantised", "special"])
@pytest.mark.parametrize("topk", [6, 32, 1000])
@pytest.mark.parametrize("S,slots", SELECT_CASES)
def test_select_rows(kind, topk, S, slots):
    gen = torch.Generator().manual_seed(S + topk + len(slots) + sum(slots))
    slots = torch.tensor(slots)
    scores = _scores(kind, slots.shape[0], S, gen)
    want_rows, want_count = select_rows_torch(scores, slots, topk)
    rows, count = select_rows_triton(scores, slots, topk)
    assert same_bytes(want_rows, rows) and same_bytes(want_count, count)


def test_select_rows_nan_goes_first():
    """torch's stable descending sort puts NaNs first, in index order, ±0.0 tie: mirrored."""
    scores = torch.tensor([[1.0, float("nan"), 5.0, -0.0, -float("nan"), 0.0, float("inf"), float("nan")]])
    slots = torch.tensor([6])
    rows, count = select_rows_triton(scores, slots, 3)
    want_rows, want_count = select_rows_torch(scores, slots, 3)
    assert rows.tolist() == [[1, 4, 6]] and count.tolist() == [3]
    assert same_bytes(want_rows, rows) and same_bytes(want_count, count)
    rows, _ = select_rows_triton(scores, slots, 6)  # -0.0 at row 3 before +0.0 at row 5
    assert rows.tolist() == [[0, 1, 2, 3, 4, 6]] == select_rows_torch(scores, slots, 6)[0].tolist()


def test_select_rows_mutant_ties_to_higher():
    """With many ties, taking the higher row of a tie gives other lists: the comparison sees it."""
    gen = torch.Generator().manual_seed(4)
    S, topk = 96, 6
    slots = torch.tensor([95, 40, 16])
    scores = _scores("quantised", 3, S, gen)
    rows, count = select_rows_triton(scores, slots, topk)
    assert same_bytes(rows, select_rows_torch(scores, slots, topk)[0])
    masked = scores.masked_fill(torch.arange(S)[None, :] > slots[:, None], float("-inf"))
    higher = (S - 1) - torch.sort(masked.flip(-1), dim=-1, descending=True, stable=True).indices[:, :topk]
    listed = torch.arange(topk)[None, :] < count[:, None]
    mutant = torch.where(listed, torch.where(listed, higher, S).sort(dim=-1).values, 0)
    assert not same_bytes(rows, mutant)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_scores_then_selection_with_ties(dtype):
    """Quantised queries and keys (integer scores, ties everywhere) through both kernels."""
    cfg = SMALL
    gen = torch.Generator().manual_seed(77)
    blocks = 8
    slots = torch.tensor([127, 0, 16])
    pool, table = _pool(cfg, dtype, blocks, gen, quantised=True)
    q, w = _queries(cfg, dtype, 3, gen, quantised=True)
    cos, sin = Rope.build(cfg, 16 * blocks, "cpu").at(slots)
    cos, sin = torch.ones_like(cos), torch.zeros_like(sin)  # keep the integer queries integer
    scores = index_scores_triton(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots)
    assert same_bytes(scores, index_scores_torch(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots))
    visible = scores[0, :128]
    assert visible.unique().numel() < 40  # ties
    rows, count = select_rows_triton(scores, slots, cfg.index_topk)
    want_rows, want_count = select_rows_torch(scores, slots, cfg.index_topk)
    assert same_bytes(want_rows, rows) and same_bytes(want_count, count)
    assert count.tolist() == [32, 1, 17]


# ---- the cache write with the norms fused ---------------------------------------------------------


def _write_inputs(cfg, dtype, slots, blocks, gen):
    """Fresh raw GEMV outputs, norm weights, a shuffled block table and randomly filled pools."""
    Lkv, R, D = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    T = slots.shape[0]
    rope = Rope.build(cfg, 16 * blocks, "cpu")
    kv = (torch.randn(T, Lkv + R, generator=gen) * 3).to(dtype)
    k = (torch.randn(T, D, generator=gen) * 3 + 1).to(dtype)
    kv_norm = (torch.randn(Lkv, generator=gen) * 0.5 + 1).to(dtype)
    k_w = (torch.randn(D, generator=gen) * 0.5 + 1).to(dtype)
    k_b = (torch.randn(D, generator=gen) * 0.1).to(dtype)
    table = torch.randperm(blocks, generator=gen).to(torch.int32)
    pools = [torch.randn(blocks, 16, Lkv + R, generator=gen).to(dtype),
             torch.randn(blocks, 16, D, generator=gen).to(dtype)]
    return (kv, k, kv_norm, k_w, k_b, slots, rope.cos, rope.sin), pools, table


def _write_both(cfg, dtype, slots, blocks, gen, ok_value):
    """Both implementations on the same fresh inputs: (twin's pools, kernel's pools, the pools
    before, the inputs, the block table)."""
    args, pools, table = _write_inputs(cfg, dtype, slots, blocks, gen)
    before = [p.clone() for p in pools]
    mine = [p.clone() for p in pools]
    ok = torch.tensor([ok_value])
    cache_rows_write_torch(cfg, *args, LayerCache(pools[0], pools[1], table), ok)
    cache_rows_write_triton(cfg, *args, LayerCache(mine[0], mine[1], table), ok)
    return pools, mine, before, args, table


WRITE_CASES = [("tiny", 3, [0, 15, 16]), ("tiny", 3, [47]), ("odd", 4, [63, 2, 16]), ("mixed", 2, [31]),
               ("small", 2, [5, 16, 31])]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,blocks,slots", WRITE_CASES)
def test_cache_rows_write(dtype, name, blocks, slots):
    cfg = CONFIGS[name]
    slots = torch.tensor(slots)
    for ok_value in (True, False):
        gen = torch.Generator().manual_seed(blocks * 10 + len(slots))
        want, got, before, _, _ = _write_both(cfg, dtype, slots, blocks, gen, ok_value)
        assert same_bytes(want[0], got[0]) and same_bytes(want[1], got[1])
        if ok_value:
            assert not same_bytes(before[0], got[0]) and not same_bytes(before[1], got[1])
        else:  # nothing written: the pools keep every byte
            assert same_bytes(before[0], got[0]) and same_bytes(before[1], got[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cache_rows_write_is_new_cache_rows(dtype):
    """From the real GEMV outputs, the kernel stores what ``new_cache_rows`` + ``LayerCache.write`` store."""
    cfg = TINY
    attn = MtpWeights.random(cfg, seed=11, dtype=dtype).layer.attn
    gen = torch.Generator().manual_seed(12)
    a = torch.randn(3, cfg.hidden_size, generator=gen).to(dtype)
    slots = torch.tensor([16, 0, 47])
    rope = Rope.build(cfg, 48, "cpu")
    ref = LayerCache.allocate(cfg, 3, dtype, "cpu")
    ref.block_table = torch.randperm(3, generator=gen).to(torch.int32)
    ref.kv_pool.normal_(generator=gen)
    ref.index_pool.normal_(generator=gen)
    mine = LayerCache(ref.kv_pool.clone(), ref.index_pool.clone(), ref.block_table)
    cos, sin = rope.at(slots)
    ref.write(slots, *new_cache_rows(attn, cfg, a, cos, sin))
    ix = attn.indexer
    kv, k = linear(a, attn.kv_a_proj_with_mqa), linear(a, ix.wk)
    cache_rows_write_triton(cfg, kv, k, attn.kv_a_layernorm, ix.k_norm_weight, ix.k_norm_bias, slots, rope.cos,
                            rope.sin,
                            mine, torch.tensor([True]))
    assert same_bytes(ref.kv_pool, mine.kv_pool) and same_bytes(ref.index_pool, mine.index_pool)


def test_cache_rows_write_mutant_dropped_rounding():
    """RMSNorm without its rounding of ``x * r`` to bfloat16 stores other latents: caught."""
    cfg, dtype = TINY, torch.bfloat16
    slots = torch.tensor([0, 15, 16])
    gen = torch.Generator().manual_seed(31)
    want, got, _, (kv, _, kv_norm, *_rest), table = _write_both(cfg, dtype, slots, 3, gen, True)
    assert same_bytes(want[0], got[0])
    Lkv = cfg.kv_lora_rank
    xf = up(kv[:, :Lkv])
    r = recip(sqrt(psum(xf * xf) / torch.tensor(float(Lkv)) + torch.tensor(LATENT_NORM_EPS)))
    mutant = (up(kv_norm) * (xf * r[:, None])).to(dtype)  # one rounding, not two
    stored = got[0][table[slots // 16].long(), slots % 16, :Lkv]
    assert not same_bytes(stored, mutant)


# ---- compiled for the GPU -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_indexer_bytes_on_cuda(dtype):
    """Compiled for the GPU at GLM-5's indexer widths (Hi = 32, D = 128, R = 64, topk 2048,
    Lkv = 512) over 4096 rows: the same bytes as the twins on the CPU."""
    cfg = MtpConfig.preset("glm5")
    gen = torch.Generator().manual_seed(2048)
    blocks, T = 256, 3
    C = 16 * blocks
    slots = torch.tensor([0, 2500, C - 1])
    rope = Rope.build(cfg, C, "cpu")
    cos, sin = rope.at(slots)
    pool, table = _pool(cfg, dtype, blocks, gen)
    q, w = _queries(cfg, dtype, T, gen)
    want = index_scores_torch(cfg, q, w, cos, sin, LayerCache(pool, pool, table), slots)
    q_, w_, cos_, sin_, pool_, table_, slots_ = [x.cuda() for x in (q, w, cos, sin, pool, table, slots)]
    got = index_scores_triton(cfg, q_, w_, cos_, sin_, LayerCache(pool_, pool_, table_), slots_).cpu()
    assert same_bytes(want, got)
    for kind in ("random", "quantised", "special"):
        scores = want if kind == "random" else _scores(kind, T, C, gen)
        want_rows, want_count = select_rows_torch(scores, slots, cfg.index_topk)
        rows, count = select_rows_triton(scores.cuda(), slots.cuda(), cfg.index_topk)
        assert same_bytes(want_rows, rows.cpu()) and same_bytes(want_count, count.cpu())
    for ok_value in (True, False):
        args, want_pools, table = _write_inputs(cfg, dtype, slots, blocks, gen)
        mine = [p.cuda() for p in want_pools]
        cache_rows_write_torch(cfg, *args, LayerCache(*want_pools, table), torch.tensor([ok_value]))
        cache_rows_write_triton(cfg, *[a.cuda() for a in args], LayerCache(*mine, table.cuda()),
                                torch.tensor([ok_value]).cuda())
        assert same_bytes(want_pools[0], mine[0].cpu()) and same_bytes(want_pools[1], mine[1].cpu())


# ---- per-row caches: one launch over rows of many sequences ---------------------------------------


def _random_cache(cfg, dtype, blocks, gen):
    """A state's cache (``LayerCache.allocate``) with random contents over a shuffled block table."""
    c = LayerCache.allocate(cfg, blocks, dtype, "cpu")
    c.kv_pool.copy_(torch.randn(c.kv_pool.shape, generator=gen) * 2)
    c.index_pool.copy_(torch.randn(c.index_pool.shape, generator=gen) * 2)
    c.block_table.copy_(torch.randperm(blocks, generator=gen).to(torch.int32))
    return c


def _clone(c):
    return LayerCache(c.kv_pool.clone(), c.index_pool.clone(), c.block_table.clone())


def _same_caches(a, b):
    return all(
        same_bytes(x.kv_pool, y.kv_pool) and same_bytes(x.index_pool, y.index_pool) for x, y in zip(a, b, strict=True)
    )


# Row t in state ORDER[t]: rows 1, 2 share a state (one run), rows 0 and 4 another (two runs).
ORDER = [0, 1, 1, 2, 0]
ROW_SLOTS = [0, 7, 20, 33, 47]
BLOCKS = 3  # 48 rows per state


def _with_stride(launch, stride):
    """``launch`` with the address table read at another row stride (a broken variant)."""
    from glm_mtp.optimized.kernels import Launch

    args = list(launch.args)
    i = next(j for j, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dtype == torch.int64 and a.dim() == 2)
    assert args[i + 1] == ADDRESS_COLUMNS
    args[i + 1] = stride
    return Launch(launch.kernel, launch.grid, tuple(args), launch.meta)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["tiny", "odd"])
def test_index_scores_per_row_caches(dtype, name):
    """Rows of 3 states in one launch: byte-equal to the twin (each run of rows scored in its own
    state's cache) and to the kernel called row by row on each state's cache alone."""
    from glm_mtp.optimized.kernels.paged import RowCaches

    cfg = CONFIGS[name]
    gen = torch.Generator().manual_seed(len(name) * 13 + (dtype == torch.bfloat16))
    states = [_random_cache(cfg, dtype, BLOCKS, gen) for _ in range(3)]
    slots = torch.tensor(ROW_SLOTS)
    T = slots.shape[0]
    q, w = _queries(cfg, dtype, T, gen)
    cos, sin = Rope.build(cfg, 16 * BLOCKS, "cpu").at(slots)
    caches = RowCaches.per_row([states[i] for i in ORDER], table=torch.zeros(8, ADDRESS_COLUMNS, dtype=torch.int64))
    want = index_scores_torch(cfg, q, w, cos, sin, caches, slots)
    got = index_scores_triton(cfg, q, w, cos, sin, caches, slots)
    assert same_bytes(want, got)
    visible = torch.arange(16 * BLOCKS)[None, :] <= slots[:, None]
    assert torch.isfinite(got[visible]).all() and (got[~visible] == float("-inf")).all()
    for t in range(T):  # batch invariance: each row as if alone, in its own state's cache
        r = slice(t, t + 1)
        alone = index_scores_triton(cfg, q[r], w[r], cos[r], sin[r], states[ORDER[t]], slots[r])
        assert same_bytes(alone, got[r])
        assert same_bytes(alone, index_scores_torch(cfg, q[r], w[r], cos[r], sin[r], states[ORDER[t]], slots[r]))


def test_index_scores_per_row_mutant_every_row_reads_line_zero():
    """A kernel that reads line 0 of a per-row table for every row (stride 0) scores the other
    states' rows against state 0's keys: the comparison sees it."""
    from glm_mtp.optimized.kernels.indexer import index_scores_launch
    from glm_mtp.optimized.kernels.paged import RowCaches

    cfg, dtype = TINY, torch.float32
    gen = torch.Generator().manual_seed(41)
    states = [_random_cache(cfg, dtype, BLOCKS, gen) for _ in range(3)]
    slots = torch.tensor(ROW_SLOTS)
    q, w = _queries(cfg, dtype, slots.shape[0], gen)
    cos, sin = Rope.build(cfg, 16 * BLOCKS, "cpu").at(slots)
    caches = RowCaches.per_row([states[i] for i in ORDER])
    want = index_scores_torch(cfg, q, w, cos, sin, caches, slots)
    launch = index_scores_launch(cfg, q, w, cos, sin, caches, slots, torch.empty_like(want))
    launch.run()
    assert same_bytes(want, launch.args[7])
    broken = torch.empty_like(want)
    args = list(_with_stride(launch, 0).args)
    args[7] = broken
    type(launch)(launch.kernel, launch.grid, tuple(args), launch.meta).run()
    rows_elsewhere = torch.tensor([ORDER[t] != 0 for t in range(len(ORDER))])
    assert same_bytes(want[~rows_elsewhere], broken[~rows_elsewhere])  # the rows in state 0 are right
    assert not same_bytes(want[rows_elsewhere], broken[rows_elsewhere])


def _written(cache, slots):
    """A bool mask over ``cache``'s pool rows (blocks, 16): the rows at ``slots``."""
    mask = torch.zeros(cache.block_table.shape[0], 16, dtype=torch.bool)
    if len(slots):
        s = torch.tensor(slots)
        mask[cache.block_table[s // 16].long(), s % 16] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["tiny", "odd"])
def test_cache_rows_write_per_row_caches(dtype, name):
    """Rows of 3 states written in one launch: byte-equal to the twin, and to the kernel called
    row by row on each state's cache alone; every byte but the written rows stays (a state the
    batch does not name is untouched); nothing at all is written when ok is false."""
    from glm_mtp.optimized.kernels.paged import RowCaches

    cfg = CONFIGS[name]
    slots = torch.tensor(ROW_SLOTS)
    T = slots.shape[0]
    for ok_value in (True, False):
        gen = torch.Generator().manual_seed(len(name) * 7 + (dtype == torch.bfloat16))
        states = [_random_cache(cfg, dtype, BLOCKS, gen) for _ in range(4)]  # state 3: in no row
        args, _, _ = _write_inputs(cfg, dtype, slots, BLOCKS, gen)
        kv, k = args[0], args[1]
        ok = torch.tensor([ok_value])
        before = [_clone(c) for c in states]
        twin = [_clone(c) for c in states]
        alone = [_clone(c) for c in states]
        cache_rows_write_torch(cfg, *args, RowCaches.per_row([twin[i] for i in ORDER]), ok)
        cache_rows_write_triton(cfg, *args, RowCaches.per_row([states[i] for i in ORDER]), ok)
        assert _same_caches(twin, states)
        for t in range(T):  # batch invariance
            r = slice(t, t + 1)
            cache_rows_write_triton(cfg, kv[r], k[r], *args[2:5], slots[r], *args[6:], alone[ORDER[t]], ok)
        assert _same_caches(alone, states)
        for i, (c, b) in enumerate(zip(states, before)):
            mine = [ROW_SLOTS[t] for t in range(T) if ORDER[t] == i] if ok_value else []
            kept = ~_written(c, mine)
            assert same_bytes(c.kv_pool[kept], b.kv_pool[kept]) and same_bytes(c.index_pool[kept], b.index_pool[kept])
            if mine:  # the written rows changed (fresh random values over random contents)
                w = _written(c, mine)
                assert not same_bytes(c.kv_pool[w], b.kv_pool[w]) and not same_bytes(c.index_pool[w], b.index_pool[w])
        if not ok_value:
            assert _same_caches(before, states)


def test_cache_rows_write_per_row_mutant_every_row_writes_line_zero():
    """Every row written through line 0 of a per-row table (stride 0) lands in state 0: caught."""
    from glm_mtp.optimized.kernels.paged import RowCaches
    from glm_mtp.optimized.kernels.rope_cache import cache_rows_write_launch

    cfg, dtype = TINY, torch.bfloat16
    gen = torch.Generator().manual_seed(43)
    slots = torch.tensor(ROW_SLOTS)
    states = [_random_cache(cfg, dtype, BLOCKS, gen) for _ in range(3)]
    args, _, _ = _write_inputs(cfg, dtype, slots, BLOCKS, gen)
    ok = torch.tensor([True])
    twin = [_clone(c) for c in states]
    cache_rows_write_torch(cfg, *args, RowCaches.per_row([twin[i] for i in ORDER]), ok)
    launch = cache_rows_write_launch(cfg, *args, RowCaches.per_row([states[i] for i in ORDER]), ok)
    _with_stride(launch, 0).run()
    assert not _same_caches(twin, states)
    fixed = [_clone(c) for c in twin]
    cache_rows_write_triton(cfg, *args, RowCaches.per_row([fixed[i] for i in ORDER]), ok)
    assert _same_caches(twin, fixed)


def test_per_row_caches_are_checked():
    """A table that is neither one cache nor one per row, or states of other dtypes or sizes, is
    refused on the host (no device read) before any launch."""
    from glm_mtp.optimized.kernels.paged import RowCaches

    cfg, dtype = TINY, torch.float32
    gen = torch.Generator().manual_seed(45)
    slots = torch.tensor([3, 9, 12])
    args, _, _ = _write_inputs(cfg, dtype, slots, BLOCKS, gen)
    q, w = _queries(cfg, dtype, 3, gen)
    cos, sin = Rope.build(cfg, 16 * BLOCKS, "cpu").at(slots)
    a, b = _random_cache(cfg, dtype, BLOCKS, gen), _random_cache(cfg, dtype, BLOCKS, gen)
    ok = torch.tensor([True])
    bad = {
        "2 caches for 3 rows": RowCaches.per_row([a, b]),
        "every cache must hold": RowCaches.per_row([a, b, _random_cache(cfg, torch.bfloat16, BLOCKS, gen)]),
        "every block table": RowCaches.per_row([a, b, _random_cache(cfg, dtype, BLOCKS + 1, gen)]),
    }
    for message, caches in bad.items():
        with pytest.raises(ValueError, match=message):
            cache_rows_write_triton(cfg, *args, caches, ok)
        with pytest.raises(ValueError, match=message):
            index_scores_triton(cfg, q, w, cos, sin, caches, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_per_row_caches_on_cuda(dtype):
    """Compiled for the GPU, rows of 3 states in one launch (an address table of device
    pointers): the same bytes as the twins on the CPU, for the scores and the cache write."""
    from glm_mtp.optimized.kernels.paged import RowCaches

    cfg = SMALL
    gen = torch.Generator().manual_seed(99)
    states = [_random_cache(cfg, dtype, BLOCKS, gen) for _ in range(3)]
    on_gpu = [LayerCache(c.kv_pool.cuda(), c.index_pool.cuda(), c.block_table.cuda()) for c in states]
    slots = torch.tensor(ROW_SLOTS)
    T = slots.shape[0]
    q, w = _queries(cfg, dtype, T, gen)
    cos, sin = Rope.build(cfg, 16 * BLOCKS, "cpu").at(slots)
    want = index_scores_torch(cfg, q, w, cos, sin, RowCaches.per_row([states[i] for i in ORDER]), slots)
    got = index_scores_triton(cfg, q.cuda(), w.cuda(), cos.cuda(), sin.cuda(),
                              RowCaches.per_row([on_gpu[i] for i in ORDER]), slots.cuda()).cpu()
    assert same_bytes(want, got)
    args, _, _ = _write_inputs(cfg, dtype, slots, BLOCKS, gen)
    ok = torch.tensor([True])
    cache_rows_write_torch(cfg, *args, RowCaches.per_row([states[i] for i in ORDER]), ok)
    cache_rows_write_triton(cfg, *[a.cuda() for a in args], RowCaches.per_row([on_gpu[i] for i in ORDER]), ok.cuda())
    for c, g in zip(states, on_gpu, strict=True):
        assert same_bytes(c.kv_pool, g.kv_pool.cpu()) and same_bytes(c.index_pool, g.index_pool.cpu())
