"""The fused GEMV family (optimized/kernels/fused_linear.py) against its twins, the reference's
composition (block.embed_rows + block_input, rms_norm + linear / linear_acc, residual + linear,
rms_norm + linear + greedy_token): byte equality on fresh random inputs through Triton's CPU
interpreter (tests/conftest.py sets TRITON_INTERPRET=1), bf16 and fp32, T = 1 and T > 1, K with
masked tails and several chunks (96 = 64 + 32, 200, 600, 6144 = 4096 + 2048), N not a multiple of
the block, 1..5 weights in one launch, a slot-0 row, ties and NaN in the argmax. Mutants (a
left-to-right sum, a truncating bf16 cast, a dropped intermediate rounding, ties to the higher
index, the last NaN winning) are swapped into the same kernel and give other bytes: the
comparisons can fail."""

import pytest
import torch
import triton
import triton.language as tl

from glm_mtp.optimized.kernels import fused_linear as fl
from glm_mtp.optimized.kernels.fused_linear import (
    argmax_reduce_torch, argmax_reduce_triton, block_input_torch, block_input_triton, head_partials_torch,
    head_partials_triton, head_slices, linear_residual_torch, linear_residual_triton, norm_linear_torch,
    norm_linear_triton,
)
from glm_mtp.reference import numerics
from glm_mtp.reference.attention import LATENT_NORM_EPS
from glm_mtp.reference.bytes import bits
from glm_mtp.reference.layers import greedy_token

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16
EPS = 1e-5
DTYPES = pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])


def _rand(gen, *shape, dtype):
    """Mixed magnitudes, so sums cancel and round differently in different orders."""
    return (torch.randn(*shape, generator=gen) * torch.exp(torch.randn(*shape, generator=gen))).to(dtype)


def _equal(a, b):
    """Byte equality on integer views (shape and dtype too)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _equal_nan(a, b):
    """Byte equality except NaN payloads (not pinned): NaN where the other has NaN."""
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    return (a.shape == b.shape and a.dtype == b.dtype and torch.equal(na, nb)
            and torch.equal(bits(a)[~na], bits(b)[~nb]))


# ---- block_input --------------------------------------------------------------------------------


def _block_inputs(T, H, N, dtype, seed, V=41):
    gen = torch.Generator().manual_seed(seed)
    embed, hiddens = _rand(gen, V, H, dtype=dtype), _rand(gen, T, H, dtype=dtype)
    enorm, hnorm = _rand(gen, H, dtype=dtype), _rand(gen, H, dtype=dtype)
    eh_proj = _rand(gen, N, 2 * H, dtype=dtype)
    tokens = torch.randint(0, V, (T,), generator=gen)
    slots = torch.randint(1, 1000, (T,), generator=gen)
    return embed, tokens, slots, hiddens, enorm, hnorm, EPS, eh_proj


@DTYPES
@pytest.mark.parametrize("T,H,N", [(1, 48, 37), (3, 48, 37), (3, 100, 9), (1, 300, 11), (2, 3072, 3)])
def test_block_input_bytes(T, H, N, dtype):
    """K = 2H = 96 (one chunk, a masked tail), 200, 600 (3 of 4 chunks; the norms' sums over 300
    in two chunks), 6144 (24 of 32 chunks): equal to the reference's composition, and the row at
    slot 0 has a zero embedding (its normed embedding is +-0.0 times enorm)."""
    args = list(_block_inputs(T, H, N, dtype, seed=T * 7919 + H * 31 + N))
    args[2][T // 2] = 0  # a slot-0 row
    got = block_input_triton(*args)
    assert _equal(got, block_input_torch(*args))
    embed, tokens, slots, hiddens, enorm, hnorm, eps, eh_proj = args
    e = embed[tokens].masked_fill((slots == 0)[:, None], 0.0)  # reference.block.embed_rows
    halves = (numerics.rms_norm(e, enorm, eps), numerics.rms_norm(hiddens, hnorm, eps))
    want = numerics.linear(torch.cat(halves, -1), eh_proj)
    assert _equal(got, want)
    unzeroed = args[:2] + [torch.full_like(slots, 5)] + args[3:]
    assert not _equal(block_input_triton(*unzeroed)[T // 2], got[T // 2])  # slot 0 matters


def test_block_input_rows_are_independent():
    """A row's bytes do not depend on the rows beside it (T = 5 spans two row blocks)."""
    args = _block_inputs(5, 48, 20, BF16, seed=3)
    whole = block_input_triton(*args)
    embed, tokens, slots, hiddens, enorm, hnorm, eps, eh_proj = args
    for t in range(5):
        one = block_input_triton(embed, tokens[t:t + 1], slots[t:t + 1], hiddens[t:t + 1], enorm, hnorm, eps, eh_proj)
        assert _equal(one, whole[t:t + 1])


# ---- norm_linear --------------------------------------------------------------------------------


def _norm_inputs(T, K, Ns, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, nw = _rand(gen, T, K, dtype=dtype), _rand(gen, K, dtype=dtype)
    return x, nw, [_rand(gen, N, K, dtype=dtype) for N in Ns]


@DTYPES
@pytest.mark.parametrize("T,K,Ns,acc,store_normed", [
    (1, 96, [37], False, False),
    (3, 96, [5, 37, 8, 3], True, True),
    (3, 200, [33, 1], False, True),
    (1, 200, [8, 17, 2], True, False),
    (2, 160, [11, 6, 3, 19, 2], True, True),  # five weights: glm5_next's input norm
    (5, 600, [9, 16], False, True),  # two row blocks, each storing its normed rows
    (1, 6144, [3, 9, 1, 4], True, True),
])
def test_norm_linear_bytes(T, K, Ns, dtype, acc, store_normed):
    """1..5 weights (N = 1 included, N not a multiple of the block) in one launch, S or A outputs,
    the normed rows stored or not: each output equal to rms_norm + linear / linear_acc."""
    x, nw, ws = _norm_inputs(T, K, Ns, dtype, seed=T * 1009 + K + sum(Ns))
    outs, normed = norm_linear_triton(x, nw, EPS, ws, acc=acc, store_normed=store_normed)
    want, want_normed = norm_linear_torch(x, nw, EPS, ws, acc=acc, store_normed=store_normed)
    a = numerics.rms_norm(x, nw, EPS)
    assert len(outs) == len(ws)
    for got, w, tw in zip(outs, ws, want):
        assert got.dtype == (FP32 if acc else dtype)
        assert _equal(got, tw)
        assert _equal(got, numerics.linear_acc(a, w) if acc else numerics.linear(a, w))
    if store_normed:
        assert _equal(normed, want_normed) and _equal(normed, a)
    else:
        assert normed is None and want_normed is None


def test_norm_linear_other_eps_dtype_and_strided_weights():
    """The q_a_layernorm's eps (1e-6), float16, and weights that are views with a row stride
    (read in place, never copied)."""
    x, nw, ws = _norm_inputs(3, 130, [11, 7], FP16, seed=11)
    outs, normed = norm_linear_triton(x, nw, LATENT_NORM_EPS, ws, store_normed=True)
    want, want_normed = norm_linear_torch(x, nw, LATENT_NORM_EPS, ws, store_normed=True)
    assert all(_equal(g, w) for g, w in zip(outs, want)) and _equal(normed, want_normed)

    gen = torch.Generator().manual_seed(12)
    wide = _rand(gen, 30, 250, dtype=BF16)
    x, nw = _rand(gen, 2, 200, dtype=BF16), _rand(gen, 200, dtype=BF16)
    views = [wide[::2, 50:], wide[1:8, :200]]  # row strides 500 and 250
    assert views[0].stride() == (500, 1)
    outs, _ = norm_linear_triton(x, nw, EPS, views)
    want, _ = norm_linear_torch(x, nw, EPS, views)
    assert all(_equal(g, w) for g, w in zip(outs, want))


def test_norm_linear_bad_arguments():
    x, nw, ws = _norm_inputs(2, 16, [3] * 6, FP32, seed=1)
    with pytest.raises(ValueError, match="1..5 weights"):
        norm_linear_triton(x, nw, EPS, ws)
    with pytest.raises(ValueError, match="16 columns"):
        norm_linear_triton(x, nw, EPS, [ws[0][:, :8]])
    with pytest.raises(ValueError, match="contiguous last dim"):
        norm_linear_triton(x[:, :8], nw[:8], EPS, [ws[0][:, ::2]])
    with pytest.raises(TypeError, match="share a dtype"):
        norm_linear_triton(x, nw, EPS, [ws[0], ws[1].to(BF16)])


def test_empty_shapes():
    """No rows, a weight with no outputs beside others; an empty K is refused."""
    x, nw, ws = _norm_inputs(2, 16, [3, 0, 4], FP32, seed=2)
    outs, normed = norm_linear_triton(x, nw, EPS, ws, store_normed=True)
    # numerics.linear refuses N = 0: the twin runs on the other two.
    want, want_normed = norm_linear_torch(x, nw, EPS, [ws[0], ws[2]], store_normed=True)
    assert [o.shape for o in outs] == [(2, 3), (2, 0), (2, 4)]
    assert _equal(outs[0], want[0]) and _equal(outs[2], want[1]) and _equal(normed, want_normed)
    outs, normed = norm_linear_triton(x[:0], nw, EPS, ws, store_normed=True)
    assert [o.shape for o in outs] == [(0, 3), (0, 0), (0, 4)] and normed.shape == (0, 16)
    with pytest.raises(ValueError, match="empty width"):  # numerics.linear has no K = 0 either
        norm_linear_triton(x[:, :0], nw[:0], EPS, [ws[0][:, :0]])
    with pytest.raises(ValueError, match="empty width"):
        linear_residual_triton(x[:, :0], ws[0][:, :0], torch.ones(2, 3))
    args = _block_inputs(3, 8, 5, BF16, seed=4)
    assert block_input_triton(args[0], args[1][:0], args[2][:0], args[3][:0], *args[4:]).shape == (0, 5)


# ---- linear_residual ------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("T,N,K", [(1, 37, 96), (3, 37, 96), (3, 20, 200), (1, 5, 6144)])
def test_linear_residual_bytes(T, N, K, dtype):
    """``residual + linear(x, W)``: the GEMV rounded to S, then one S addition."""
    gen = torch.Generator().manual_seed(T * 31 + N * 7 + K)
    x, w, res = _rand(gen, T, K, dtype=dtype), _rand(gen, N, K, dtype=dtype), _rand(gen, T, N, dtype=dtype)
    got = linear_residual_triton(x, w, res)
    assert _equal(got, linear_residual_torch(x, w, res)) and _equal(got, res + numerics.linear(x, w))


# ---- head_partials + argmax_reduce ----------------------------------------------------------------


def _head_inputs(T, V, H, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return _rand(gen, T, H, dtype=dtype), _rand(gen, H, dtype=dtype), _rand(gen, V, H, dtype=dtype)


def _check_head(out, nw, lm_head, nan_ok=False):
    """Partials equal to the twin's, and the reduced tokens equal to greedy_token(linear(x, lm_head))."""
    x, pv, pi = head_partials_triton(out, nw, EPS, lm_head)
    wx, wpv, wpi = head_partials_torch(out, nw, EPS, lm_head)
    assert _equal(x, wx) and _equal(x, numerics.rms_norm(out, nw, EPS))
    assert (_equal_nan if nan_ok else _equal)(pv, wpv) and _equal(pi, wpi)
    assert pv.shape == (out.shape[0], head_slices(out.shape[0], lm_head.shape[0], out.shape[1])[0])
    tokens = argmax_reduce_triton(pv, pi)
    want = greedy_token(numerics.linear(x, lm_head))
    assert _equal(tokens, want) and _equal(argmax_reduce_torch(wpv, wpi), want)
    return x, tokens


@DTYPES
@pytest.mark.parametrize("T,V,H", [(1, 203, 96), (3, 45, 200)])
def test_head_stores_logits_and_x_where_told(T, V, H, dtype):
    """``logits_out`` gets the S logits ``linear(x, lm_head)`` and ``x_out`` the normed rows, from
    the same launch, kernel and twin alike; the partials are those of the launch without them."""
    out, nw, lm_head = _head_inputs(T, V, H, dtype, seed=7 * T + V)
    want_x = numerics.rms_norm(out, nw, EPS)
    want_logits = numerics.linear(want_x, lm_head)
    _, pv, pi = head_partials_triton(out, nw, EPS, lm_head)
    for head in (head_partials_triton, head_partials_torch):
        x_out = torch.full((T, H), float("nan"), dtype=dtype)
        logits_out = torch.full((T, V), float("nan"), dtype=dtype)
        x, got_pv, got_pi = head(out, nw, EPS, lm_head, x_out, logits_out)
        assert x.data_ptr() == x_out.data_ptr() and _equal(x_out, want_x)
        assert _equal(logits_out, want_logits)
        assert _equal(got_pv, pv) and _equal(got_pi, pi)
    with pytest.raises(ValueError, match="logits_out"):
        head_partials_triton(out, nw, EPS, lm_head, None, torch.empty(T, V + 1, dtype=dtype))


@DTYPES
@pytest.mark.parametrize("T,V,H", [(1, 50, 96), (3, 203, 96), (3, 45, 200), (1, 70, 6144)])
def test_head_bytes(T, V, H, dtype):
    """Partials per vocabulary slice (the last one short) and the reduced draft tokens."""
    _check_head(*_head_inputs(T, V, H, dtype, seed=T + V + H))


@DTYPES
def test_head_ties_go_to_the_lower_index(dtype):
    """Equal lm_head rows make equal logits: the maximum sits at several tokens in one slice and
    across slices, and the lowest of them wins (every row of T = 3)."""
    out, nw, lm_head = _head_inputs(3, 203, 96, dtype, seed=5)
    out, nw = out.abs(), nw.abs() + 0.5  # x > 0: a row of large positive weights wins every row
    ties = [17, 19, 120, 201]  # slices of 8: 17 and 19 share one
    for j in ties:
        lm_head[j] = 100.0
    x, tokens = _check_head(out, nw, lm_head)
    logits = numerics.linear(x, lm_head).float()
    assert (logits[:, ties] == logits.max(-1, keepdim=True).values).all()  # a real tie
    assert tokens.tolist() == [17, 17, 17]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on NaN in the interpreter
@DTYPES
def test_head_nan_counts_as_the_maximum_first_nan_wins(dtype):
    """A NaN logit beats every number and the first NaN wins: NaN rows of lm_head in two slices
    (and two in one slice) with a larger finite maximum elsewhere; a row whose logits hold no NaN
    beside rows that do."""
    out, nw, lm_head = _head_inputs(3, 203, 96, dtype, seed=6)
    lm_head[150] = 1000.0
    for j in (42, 45, 130):
        lm_head[j, 7] = float("nan")
    _, tokens = _check_head(out, nw, lm_head, nan_ok=True)
    assert tokens.tolist() == [42, 42, 42]
    # NaN in only one row of x: the other rows keep their finite argmax.
    out2, nw2, lm2 = _head_inputs(3, 60, 96, dtype, seed=8)
    out2[1, 3] = float("nan")
    x2, tokens = _check_head(out2, nw2, lm2, nan_ok=True)
    assert torch.isnan(x2[1].float()).all() and not torch.isnan(x2[[0, 2]].float()).any()
    assert tokens[1] == 0  # every logit of the NaN row is NaN: the first token


def test_argmax_reduce_across_chunks():
    """Partials wider than one chunk of the reduce loop (2500 > 1024): ties (+-0.0 among them)
    and NaN in later chunks, rows of -inf only; equal to greedy_token on the same values."""
    gen = torch.Generator().manual_seed(9)
    T, P = 6, 2500
    pv = torch.randn(T, P, generator=gen)
    pi = torch.arange(P)[None, :].expand(T, P) * 8 + torch.randint(0, 8, (T, P), generator=gen)
    pv[0, [700, 1500, 2400]] = 50.0  # ties in three chunks
    pv[1, :] = -torch.rand(P, generator=gen) - 1.0
    pv[1, [1800, 2100]] = -0.0
    pv[1, 1900] = 0.0  # +-0.0 compare equal: the lower index, 1800, wins
    pv[2, [1100, 2300]] = float("nan")  # the first NaN wins, even past a larger number
    pv[2, 5] = 1e30
    pv[3, :] = float("-inf")  # nothing finite: the first index
    pv[4, [3, 2499]] = float("inf")
    pi = pi.contiguous()
    got = argmax_reduce_triton(pv, pi)
    assert _equal(got, argmax_reduce_torch(pv, pi))
    assert got[:5].tolist() == [pi[0, 700], pi[1, 1800], pi[2, 1100], pi[3, 0], pi[4, 3]]


@DTYPES
def test_width_one(dtype):
    """H = 1 (K = 2: no chunk tree for the norms) and K = 1 (no tree at all), N = 1 weights."""
    args = _block_inputs(3, 1, 4, dtype, seed=30)
    args[2][1] = 0
    assert _equal(block_input_triton(*args), block_input_torch(*args))
    x, nw, ws = _norm_inputs(3, 1, [1, 3], dtype, seed=31)
    outs, normed = norm_linear_triton(x, nw, EPS, ws, store_normed=True)
    want, want_normed = norm_linear_torch(x, nw, EPS, ws, store_normed=True)
    assert all(_equal(g, w) for g, w in zip(outs, want)) and _equal(normed, want_normed)
    res = _rand(torch.Generator().manual_seed(32), 3, 1, dtype=dtype)
    assert _equal(linear_residual_triton(x, ws[0], res), linear_residual_torch(x, ws[0], res))


# ---- mutants: the same kernel with one piece swapped gives other bytes --------------------------


@triton.jit
def _left_to_right(x, R: tl.constexpr, N: tl.constexpr, W: tl.constexpr, LEVELS: tl.constexpr):
    """A mutant of ``psum_grid``: the W lanes added left to right (lane i picked out exactly by a max)."""
    lane = tl.arange(0, W)[None, None, :]
    acc = tl.zeros((R, N), tl.float32)
    for i in tl.static_range(W):
        acc = acc + tl.max(tl.where(lane == i, x, float("-inf")), axis=2)
    return acc


@triton.jit
def _truncate_bf16(y, TO_BF16: tl.constexpr, NAN_BITS: tl.constexpr):
    """A mutant of ``round_to_storage``: bfloat16 by truncation (what a plain cast does in the interpreter)."""
    if TO_BF16:
        return (y.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y


@triton.jit
def _truncating_storage(y, TO_BF16: tl.constexpr, TO_F16: tl.constexpr, NAN_BITS: tl.constexpr):
    """A mutant of ``rounding.to_storage`` with the truncating bfloat16 cast."""
    if TO_F16:
        return y.to(tl.float16)
    else:
        return _truncate_bf16(y, TO_BF16, NAN_BITS)


@triton.jit
def _keep_f32(y, S_BF16: tl.constexpr, S_F16: tl.constexpr, NAN_BITS: tl.constexpr):
    """A mutant of ``_round_s``: the intermediate rounding to S dropped."""
    return y


@triton.jit
def _argmax_high(v, idx, valid):
    """A mutant of ``argmax_reduce``: ties (and NaNs) go to the HIGHER index."""
    nan = valid & (v != v)
    has_nan = tl.max(nan.to(tl.int32), axis=1) > 0
    nan_idx = tl.max(tl.where(nan, idx, -1), axis=1)
    num = valid & (v == v)
    m = tl.max(tl.where(num, v, float("-inf")), axis=1)
    m_idx = tl.max(tl.where(num & (v == m[:, None]), idx, -1), axis=1)
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, nan_idx, m_idx)


@triton.jit
def _combine_high(v1, i1, v2, i2):
    """A mutant of ``argmax_combine``: an equal or NaN later candidate replaces the earlier one."""
    take2 = (v2 != v2) | (v2 >= v1)
    return tl.where(take2, v2, v1), tl.where(take2, i2, i1)


def test_mutant_left_to_right_sum_is_caught(monkeypatch):
    x, nw, ws = _norm_inputs(2, 96, [16, 5], FP32, seed=21)
    want, _ = norm_linear_torch(x, nw, EPS, ws, acc=True)
    got, _ = norm_linear_triton(x, nw, EPS, ws, acc=True)
    assert all(_equal(g, w) for g, w in zip(got, want))
    monkeypatch.setattr(fl, "psum_grid", _left_to_right)
    got, _ = norm_linear_triton(x, nw, EPS, ws, acc=True)
    assert not all(_equal(g, w) for g, w in zip(got, want))
    args = _block_inputs(1, 48, 16, FP32, seed=22)
    assert not _equal(block_input_triton(*args), block_input_torch(*args))


def test_mutant_truncating_bf16_cast_is_caught(monkeypatch):
    x, nw, ws = _norm_inputs(3, 96, [37], BF16, seed=23)
    want, want_normed = norm_linear_torch(x, nw, EPS, ws, acc=True, store_normed=True)
    monkeypatch.setattr(fl, "to_storage", _truncating_storage)
    (got,), normed = norm_linear_triton(x, nw, EPS, ws, acc=True, store_normed=True)
    assert not _equal(normed, want_normed) and not _equal(got, want[0])


def test_mutant_dropped_intermediate_rounding_is_caught(monkeypatch):
    """bf16: the normed rows (and the residual's GEMV result) must be rounded to S before use."""
    x, nw, ws = _norm_inputs(3, 96, [37], BF16, seed=24)
    want, _ = norm_linear_torch(x, nw, EPS, ws, acc=True)
    gen = torch.Generator().manual_seed(25)
    xr, wr, res = _rand(gen, 3, 96, dtype=BF16), _rand(gen, 37, 96, dtype=BF16), _rand(gen, 3, 37, dtype=BF16)
    monkeypatch.setattr(fl, "_round_s", _keep_f32)
    (got,), _ = norm_linear_triton(x, nw, EPS, ws, acc=True)
    assert not _equal(got, want[0])
    assert not _equal(linear_residual_triton(xr, wr, res), linear_residual_torch(xr, wr, res))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_mutant_ties_to_higher_is_caught(monkeypatch):
    out, nw, lm_head = _head_inputs(1, 203, 96, FP32, seed=26)
    out, nw = out.abs(), nw.abs() + 0.5
    lm_head[[17, 19, 120]] = 100.0
    _, pv, pi = head_partials_triton(out, nw, EPS, lm_head)
    want = greedy_token(numerics.linear(numerics.rms_norm(out, nw, EPS), lm_head))
    assert want.tolist() == [17] and argmax_reduce_triton(pv, pi).tolist() == [17]
    with monkeypatch.context() as m:
        m.setattr(fl, "argmax_reduce", _argmax_high)
        _, pv_high, pi_high = head_partials_triton(out, nw, EPS, lm_head)
        assert not _equal(pi_high, pi)  # the slice holding 17 and 19 picks 19
    with monkeypatch.context() as m:
        m.setattr(fl, "argmax_reduce", _argmax_high)
        assert argmax_reduce_triton(pv, pi).tolist() == [120]  # the later slice wins the tie
    # Ties between chunks of the reduce loop (1024 partials each) meet in argmax_combine.
    pvc = torch.zeros(1, 2500)
    pvc[0, [700, 1500]] = 1.0
    pic = torch.arange(2500)[None, :]
    assert argmax_reduce_triton(pvc, pic).tolist() == [700]
    with monkeypatch.context() as m:
        m.setattr(fl, "argmax_combine", _combine_high)
        assert argmax_reduce_triton(pvc, pic).tolist() == [1500]
    # The first NaN, not the last.
    pvn = torch.tensor([[1.0, float("nan"), 3.0, float("nan")]])
    pin = torch.arange(4)[None, :] * 10
    assert argmax_reduce_triton(pvn, pin).tolist() == [10] == argmax_reduce_torch(pvn, pin).tolist()
    with monkeypatch.context() as m:
        m.setattr(fl, "argmax_reduce", _argmax_high)
        assert argmax_reduce_triton(pvn, pin).tolist() == [30]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_fused_linear_bytes_on_cuda(dtype):
    """Compiled for the GPU at glm5's widths (H = 6144, K = 2H = 12288, a vocabulary slice with a
    tail): the same bytes as the twins on the CPU."""
    T, H = 3, 6144
    args = _block_inputs(T, H, 300, dtype, seed=1, V=100)
    args[2][0] = 0
    cuda = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    assert _equal(block_input_triton(*cuda).cpu(), block_input_torch(*args))
    x, nw, ws = _norm_inputs(T, H, [2048, 576, 128, 32], dtype, seed=2)
    outs, normed = norm_linear_triton(x.cuda(), nw.cuda(), EPS, [w.cuda() for w in ws], store_normed=True)
    want, want_normed = norm_linear_torch(x, nw, EPS, ws, store_normed=True)
    assert all(_equal(g.cpu(), w) for g, w in zip(outs, want)) and _equal(normed.cpu(), want_normed)
    gen = torch.Generator().manual_seed(3)
    xr, wr, res = _rand(gen, T, 16384, dtype=dtype), _rand(gen, H, 16384, dtype=dtype), _rand(gen, T, H, dtype=dtype)
    assert _equal(linear_residual_triton(xr.cuda(), wr.cuda(), res.cuda()).cpu(), linear_residual_torch(xr, wr, res))
    out, hn, lm = _head_inputs(T, 4099, H, dtype, seed=4)
    lm[[7, 4000]] = lm[2000]  # ties
    x, pv, pi = head_partials_triton(out.cuda(), hn.cuda(), EPS, lm.cuda())
    wx, wpv, wpi = head_partials_torch(out, hn, EPS, lm)
    assert _equal(x.cpu(), wx) and _equal(pv.cpu(), wpv) and _equal(pi.cpu(), wpi)
    assert _equal(argmax_reduce_triton(pv, pi).cpu(), greedy_token(numerics.linear(wx, lm)))
