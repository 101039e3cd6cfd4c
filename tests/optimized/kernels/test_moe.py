"""The MoE kernels (optimized/kernels/moe.py) and the pinned exp helper (pinned_math.py) against
their twins, byte for byte through Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET=1): the expert choice on random and quantised (tied) logits with and without
group limiting and normalisation, non-power-of-two expert counts, groups and k; the experts'
gate/up + SwiGLU and down + combine + shared + residual at power-of-two and non-power-of-two I and
H, with and without the shared expert, T = 1 and 3, bf16 and fp32; the three kernels chained
against ``h + moe_block``; exp over a sweep of float32 bit patterns. Kernels that break the order
(ties to the higher expert, a left-to-right combine, ``tl.exp``) are caught on the same inputs."""

import zlib

import pytest
import torch
import triton
import triton.language as tl

from glm_mtp.optimized.kernels import moe as K
from glm_mtp.optimized.kernels.launch import Launch
from glm_mtp.optimized.kernels.pinned_math import psum_grid
from glm_mtp.optimized.kernels.pinned_math import exp_launch, exp_torch, exp_triton, sigmoid_f32
from glm_mtp.reference import MtpConfig, MtpWeights, numerics
from glm_mtp.reference.bytes import bits, same_bytes
from glm_mtp.reference.moe import choose_experts, moe_block, route

BF16, FP32 = torch.bfloat16, torch.float32
DTYPES = pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
# numpy warns on inf - inf and overflow inside the interpreted exp; the results are checked.
NUMPY_WARNINGS = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _seed(*parts):
    """A seed fixed by the test's parameters (``hash`` of a str changes from run to run)."""
    return zlib.crc32(repr(parts).encode())


def _cfg(**kw):
    return MtpConfig.preset("tiny").replace(**kw)


# Routing configs: tiny (E=8, k=2, 4 groups keep 2); small (E=16, k=4); no group limiting and no
# normalisation; 3 groups of 4 (a masked group lane) with k = 3 (a masked slot of the weights'
# tree); 4 groups of 6 (masked lanes inside each group); glm5's routing (E=256, k=8, one group);
# 8 groups of 32 keep 4.
ROUTE_CFGS = {
    "tiny": _cfg(),
    "small": MtpConfig.preset("small"),
    "nogroup_nonorm": _cfg(n_group=1, topk_group=1, num_experts_per_tok=3, norm_topk_prob=False),
    "E12_G3_k3": _cfg(n_routed_experts=12, n_group=3, topk_group=2, num_experts_per_tok=3),
    "E24_G4_k5": _cfg(n_routed_experts=24, n_group=4, topk_group=3, num_experts_per_tok=5, routed_scaling_factor=1.7),
    "glm5": _cfg(n_routed_experts=256, num_experts_per_tok=8, n_group=1, topk_group=1),
    "E256_G8": _cfg(n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4),
}


def _logits(T, E, gen, tied):
    """Router logits in float32: continuous, or quantised to a few levels (with saturated
    sigmoids: many equal scores) so that the choice has ties at every stage."""
    if tied:
        levels = torch.tensor([-200.0, -3.0, -0.5, 0.0, 0.5, 1.0, 40.0, 200.0])
        return levels[torch.randint(0, len(levels), (T, E), generator=gen)]
    return torch.randn(T, E, generator=gen) * 3


def _bias(E, gen, tied):
    if tied:
        return (torch.randint(-2, 3, (E,), generator=gen) * 0.25).float()
    return torch.randn(E, generator=gen) * 0.1


# ---- exp ----------------------------------------------------------------------------------------


def _exp_sweep():
    bits = torch.arange(0, 1 << 32, 49999, dtype=torch.int64)  # every 49999th pattern: all exponents
    edges = torch.tensor([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                          0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF], dtype=torch.int64)
    x = torch.cat([bits, edges]).to(torch.int32).view(torch.float32)  # wraps to int32 bits
    named = torch.tensor([-104.0, 89.0, -103.97, -103.5, -100.0, -95.0, -88.0, -87.33, 88.72, 88.73, 1e-30, -1e-30])
    return torch.cat([x, named, torch.linspace(-110.0, 95.0, 4097)])


@NUMPY_WARNINGS
def test_exp_bytes_over_a_sweep_of_bit_patterns():
    x = _exp_sweep()
    want = numerics.exp(x)
    tiny = float(torch.finfo(torch.float32).tiny)
    assert ((want > 0) & (want < tiny)).sum() > 100  # denormal results
    assert torch.isinf(want).any() and (want == 0).any() and torch.isnan(want).any()
    got = exp_triton(x)
    assert same_bytes(got, want)  # NaN included: both return the input NaN itself
    assert same_bytes(exp_torch(x), want)


@triton.jit
def _tl_exp_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.exp(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


@NUMPY_WARNINGS
def test_tl_exp_is_caught():
    """The library's exp in the same launch gives other bytes on the sweep."""
    x = _exp_sweep()
    out = torch.empty_like(x)
    launch = exp_launch(x, out)
    Launch(_tl_exp_kernel, launch.grid, launch.args, launch.meta).run()
    assert not same_bytes(out, numerics.exp(x))


# ---- the expert choice --------------------------------------------------------------------------


@NUMPY_WARNINGS
@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("name", list(ROUTE_CFGS))
def test_route_bytes(name, T, tied):
    cfg = ROUTE_CFGS[name]
    gen = torch.Generator().manual_seed(_seed(name, T, tied))
    logits, bias = _logits(T, cfg.n_routed_experts, gen, tied), _bias(cfg.n_routed_experts, gen, tied)
    want_e, want_w = choose_experts(cfg, logits, bias)
    got_e, got_w = K.route_triton(cfg, logits, bias)
    assert same_bytes(got_e, want_e) and same_bytes(got_w, want_w)
    twin_e, twin_w = K.route_torch(cfg, logits, bias)
    assert same_bytes(twin_e, want_e) and same_bytes(twin_w, want_w)
    # Each row as if alone.
    for t in range(T):
        e1, w1 = K.route_triton(cfg, logits[t : t + 1], bias)
        assert same_bytes(e1, want_e[t : t + 1]) and same_bytes(w1, want_w[t : t + 1])


@DTYPES
def test_route_is_the_reference_route_after_the_router(dtype):
    """``route`` = the router's ``linear_acc`` + ``choose_experts``, and the kernel on those logits
    gives route's bytes (bf16 router and bias in S or float32)."""
    cfg = _cfg()
    moe = MtpWeights.random(cfg, seed=4, dtype=dtype).layer.mlp
    m = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(dtype)
    want_e, want_w = route(moe, cfg, m)
    got_e, got_w = K.route_triton(cfg, numerics.linear_acc(m, moe.router), moe.e_score_correction_bias)
    assert same_bytes(got_e, want_e) and same_bytes(got_w, want_w)
    bias_s = moe.e_score_correction_bias.to(dtype)  # a bias stored in S is promoted as route promotes it
    assert all(same_bytes(a, b) for a, b in zip(K.route_triton(cfg, numerics.linear_acc(m, moe.router), bias_s),
                                          choose_experts(cfg, numerics.linear_acc(m, moe.router), bias_s)))


@NUMPY_WARNINGS
def test_route_ties_and_specials():
    """Hand-made ties: equal group scores (the lower group wins), equal experts inside and across
    groups (the lower id wins), saturated sigmoids, and non-finite logits (NaN sorts first, as in
    torch's sort; -inf scores 0)."""
    cfg = _cfg()  # 4 groups of 2, keep 2, k = 2
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # every score equal: groups 0, 1; experts 0, 1
        [0.0, 2.0, 2.0, 0.0, 2.0, 0.0, 0.0, 2.0],  # equal groups; equal experts across groups
        [50.0, 60.0, 70.0, 80.0, -inf, inf, 30.0, 20.0],  # sigmoid saturates to 1 for all but -inf
        [0.0, 1.0, nan, -1.0, 3.0, 2.0, 0.0, 0.0],  # a NaN score wins its group and a slot
        [-inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf],  # all scores 0: weights 0 / 1e-20
    ])
    bias = torch.zeros(8)
    want_e, want_w = choose_experts(cfg, logits, bias)
    got_e, got_w = K.route_triton(cfg, logits, bias)
    assert same_bytes(got_e, want_e)
    assert want_e[:3].tolist() == [[0, 1], [1, 2], [0, 1]] and want_e[3].tolist() == [2, 4]
    nan_w = torch.isnan(want_w)
    assert nan_w[3].all() and not nan_w[[0, 1, 2, 4]].any()
    assert torch.equal(torch.isnan(got_w), nan_w) and torch.equal(bits(got_w)[~nan_w], bits(want_w)[~nan_w])
    assert (want_w[4] == 0).all()


def test_route_bad_arguments():
    cfg = _cfg()
    with pytest.raises(ValueError, match="logits must be"):
        K.route_triton(cfg, torch.zeros(2, 7), torch.zeros(8))
    with pytest.raises(ValueError, match="logits must be"):
        K.route_triton(cfg, torch.zeros(2, 8, dtype=BF16), torch.zeros(8))
    with pytest.raises(ValueError, match="bias must be"):
        K.route_triton(cfg, torch.zeros(2, 8), torch.zeros(9))
    e, w = K.route_triton(cfg, torch.zeros(0, 8), torch.zeros(8))
    assert e.shape == (0, 2) and w.shape == (0, 2)


@triton.jit
def _route_high_ties_kernel(logits_ptr, bias_ptr, experts_ptr, weights_ptr, stride_l, stride_x, stride_w, scaling,
                            E: tl.constexpr, G: tl.constexpr, EG: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_EG: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                            BLOCK_KS: tl.constexpr, LEVELS_KS: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr):
    """The expert choice without group limiting, equal scores going to the HIGHER expert id."""
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_G * BLOCK_EG)
    valid = e < E
    logit = tl.load(logits_ptr + t * stride_l + e, mask=valid, other=0.0)
    biased = sigmoid_f32(logit) + tl.load(bias_ptr + e, mask=valid, other=0.0)
    key = tl.where(valid, biased, float("-inf"))
    chosen = e < 0
    for _ in tl.static_range(K):
        best = tl.max(tl.where(chosen, float("-inf"), key), axis=0)
        pick = tl.max(tl.where((key == best) & ~chosen & valid, e, -1), axis=0)  # the mistake
        chosen = chosen | (e == pick)
    slot = tl.arange(0, BLOCK_KS)
    out = tl.zeros((BLOCK_KS,), tl.int32)
    taken = e < 0
    for j in tl.static_range(K):
        low = tl.min(tl.where(chosen & ~taken, e, BLOCK_G * BLOCK_EG), axis=0)
        taken = taken | (e == low)
        out = tl.where(slot == j, low, out)
    s_in = slot < K
    w = tl.where(s_in, sigmoid_f32(tl.load(logits_ptr + t * stride_l + out, mask=s_in, other=0.0)), 0.0)
    if NORM:
        total = tl.reshape(psum_grid(tl.reshape(w, (1, 1, BLOCK_KS)), 1, 1, BLOCK_KS, LEVELS_KS), (1,))
        w = tl.math.div_rn(w, total + EPS)
    tl.store(experts_ptr + t * stride_x + slot, out.to(tl.int64), mask=s_in)
    tl.store(weights_ptr + t * stride_w + slot, w * scaling, mask=s_in)


@NUMPY_WARNINGS
def test_ties_to_the_higher_expert_are_caught():
    """On the tied logits the same launch with ties going to the higher id chooses other experts,
    while the kernel matches; on continuous logits (no ties) the mutant agrees: the tie rule is
    what the comparison catches."""
    cfg = ROUTE_CFGS["nogroup_nonorm"]  # E = 8, k = 3
    gen = torch.Generator().manual_seed(31)
    for tied, agree in ((True, False), (False, True)):
        if tied:  # two levels, no bias: the third and fourth best are equal in some row
            logits, bias = torch.randint(0, 2, (3, 8), generator=gen).float(), torch.zeros(8)
            top = logits.sort(dim=-1, descending=True).values
            assert (top[:, 2] == top[:, 3]).any()
        else:
            logits, bias = _logits(3, 8, gen, False), _bias(8, gen, False)
        want_e, want_w = choose_experts(cfg, logits, bias)
        experts, weights = torch.empty_like(want_e), torch.empty_like(want_w)
        launch = K.route_launch(cfg, logits, bias, experts, weights)
        launch.run()
        assert same_bytes(experts, want_e) and same_bytes(weights, want_w)
        Launch(_route_high_ties_kernel, launch.grid, launch.args, launch.meta).run()
        assert same_bytes(experts, want_e) == agree


# ---- the experts --------------------------------------------------------------------------------


# (name, E, k, H, I, n_shared): tiny; small's widths (E=16, k=4, H=256, I=128); non-power-of-two
# I = 48 and H = 96 with a shared expert of Is = 96 (two fused); no shared expert; k = 3, T tails.
EXPERT_SHAPES = [
    ("tiny", 8, 2, 64, 32, 1),
    ("small", 16, 4, 256, 128, 1),
    ("I48_H96_Is96", 8, 3, 96, 48, 2),
    ("no_shared", 8, 3, 96, 48, 0),
]


def _experts_case(E, k, H, I, n_shared, T, dtype, seed, quantised_weights=False):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        # Mixed magnitudes, so sums cancel and round differently in different orders.
        return (torch.randn(*shape, generator=gen) * torch.exp(torch.randn(*shape, generator=gen)) * scale).to(dtype)

    Is = I * n_shared
    w = dict(gate=rnd(E, I, H, scale=H ** -0.5), up=rnd(E, I, H, scale=H ** -0.5), down=rnd(E, H, I, scale=I ** -0.5))
    if n_shared:
        w.update(sg=rnd(Is, H, scale=H ** -0.5), su=rnd(Is, H, scale=H ** -0.5), sd=rnd(H, Is, scale=Is ** -0.5))
    else:
        w.update(sg=None, su=None, sd=None)
    m, res = rnd(T, H), rnd(T, H)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k].sort().values for _ in range(T)])
    weights = torch.rand(T, k, generator=gen) * 2.5
    return w, m, res, experts, weights


EXPERT_CASES = [pytest.param(*shape, T, id=f"{shape[0]}-T{T}",
                             marks=[pytest.mark.slow] if (shape[0], T) == ("small", 3) else [])
                for shape in EXPERT_SHAPES for T in (1, 3)]


@NUMPY_WARNINGS
@DTYPES
@pytest.mark.parametrize("name,E,k,H,I,n_shared,T", EXPERT_CASES)
def test_experts_bytes(name, E, k, H, I, n_shared, T, dtype):
    w, m, res, experts, weights = _experts_case(E, k, H, I, n_shared, T, dtype, seed=_seed(name, T, str(dtype)))
    want_h, want_sh = K.experts_gate_up_torch(m, experts, w["gate"], w["up"], w["sg"], w["su"])
    got_h, got_sh = K.experts_gate_up_triton(m, experts, w["gate"], w["up"], w["sg"], w["su"])
    assert same_bytes(got_h, want_h)
    assert (got_sh is None and want_sh is None) if not n_shared else same_bytes(got_sh, want_sh)
    want = K.experts_down_combine_torch(want_h, want_sh, experts, weights, w["down"], w["sd"], res)
    got = K.experts_down_combine_triton(want_h, want_sh, experts, weights, w["down"], w["sd"], res)
    assert same_bytes(got, want)
    if dtype == BF16:  # the roundings are exercised: truncating would differ somewhere
        acc = numerics.linear_acc(m, w["gate"][experts[0, 0]])
        assert not torch.equal((acc.view(torch.int32) >> 16).to(torch.int16), bits(acc.to(BF16)))
    if T > 1 and name != "small":  # each row as if alone (small's widths cost the interpreter most)
        for t in range(T):
            h1, s1 = K.experts_gate_up_triton(m[t : t + 1], experts[t : t + 1], w["gate"], w["up"], w["sg"], w["su"])
            assert same_bytes(h1, want_h[t : t + 1]) and (s1 is None or same_bytes(s1, want_sh[t : t + 1]))
            o1 = K.experts_down_combine_triton(want_h[t : t + 1], None if want_sh is None else want_sh[t : t + 1],
                                               experts[t : t + 1], weights[t : t + 1], w["down"], w["sd"],
                                               res[t : t + 1])
            assert same_bytes(o1, want[t : t + 1])


def test_experts_read_in_place_from_strided_stacks():
    """Gate and up as the two halves of one fused (E, 2I, H) stack (expert stride 2IH), down with
    a padded row stride, and the result equals the contiguous case's; the kernels never copy."""
    E, k, H, I, T = 8, 3, 64, 32, 2
    w, m, res, experts, weights = _experts_case(E, k, H, I, 1, T, BF16, seed=77)
    fused = torch.cat([w["gate"], w["up"]], dim=1)  # (E, 2I, H)
    gate, upw = fused[:, :I], fused[:, I:]
    down_pad = torch.cat([w["down"], torch.zeros(E, H, 16, dtype=BF16)], dim=2)[:, :, :I]  # row stride I + 16
    assert gate.stride() == (2 * I * H, H, 1) and down_pad.stride() == (H * (I + 16), I + 16, 1)
    want_h, want_sh = K.experts_gate_up_torch(m, experts, w["gate"], w["up"], w["sg"], w["su"])
    got_h, got_sh = K.experts_gate_up_triton(m, experts, gate, upw, w["sg"], w["su"])
    assert same_bytes(got_h, want_h) and same_bytes(got_sh, want_sh)
    want = K.experts_down_combine_torch(want_h, want_sh, experts, weights, w["down"], w["sd"], res)
    assert same_bytes(K.experts_down_combine_triton(want_h, want_sh, experts, weights, down_pad, w["sd"], res), want)
    # Ids and weights as column views of wider (T, 2k) buffers, and transposed (k, T) ones.
    ex_wide, wt_wide = torch.cat([experts, experts], 1)[:, :k], torch.cat([weights, weights], 1)[:, :k]
    ex_t, wt_t = experts.T.contiguous().T, weights.T.contiguous().T
    assert ex_wide.stride(0) == 2 * k and ex_t.stride(1) == T
    for ex, wt in ((ex_wide, wt_wide), (ex_t, wt_t)):
        assert same_bytes(K.experts_gate_up_triton(m, ex, gate, upw, w["sg"], w["su"])[0], want_h)
        assert same_bytes(K.experts_down_combine_triton(want_h, want_sh, ex, wt, down_pad, w["sd"], res), want)


@NUMPY_WARNINGS
@DTYPES
@pytest.mark.parametrize("preset,T", [("tiny", 1), ("tiny", 3), ("small", 2)])
def test_kernels_chain_to_the_reference_moe(preset, T, dtype):
    """route_triton on the router's logits, then gate/up, then down/combine: ``h + moe_block``
    of the reference, byte for byte (the twins compose the reference's own functions)."""
    cfg = MtpConfig.preset(preset)
    moe = MtpWeights.random(cfg, seed=T, dtype=dtype).layer.mlp
    gen = torch.Generator().manual_seed(100 + T)
    m, h = (
        torch.randn(T, cfg.hidden_size, generator=gen).to(dtype),
        torch.randn(T, cfg.hidden_size, generator=gen).to(dtype),
    )
    want = h + moe_block(moe, cfg, m)
    experts, weights = K.route_triton(cfg, numerics.linear_acc(m, moe.router), moe.e_score_correction_bias)
    sh = moe.shared
    hidden, shared = K.experts_gate_up_triton(m, experts, moe.experts_gate, moe.experts_up, sh.gate_proj, sh.up_proj)
    got = K.experts_down_combine_triton(hidden, shared, experts, weights, moe.experts_down, sh.down_proj, h)
    assert same_bytes(got, want)
    e2, w2 = K.route_torch(cfg, numerics.linear_acc(m, moe.router), moe.e_score_correction_bias)
    h2, s2 = K.experts_gate_up_torch(m, e2, moe.experts_gate, moe.experts_up, sh.gate_proj, sh.up_proj)
    assert same_bytes(K.experts_down_combine_torch(h2, s2, e2, w2, moe.experts_down, sh.down_proj, h), want)


def test_experts_bad_arguments():
    w, m, res, experts, weights = _experts_case(8, 2, 64, 32, 1, 2, FP32, seed=3)
    with pytest.raises(ValueError, match="experts must be"):
        K.experts_gate_up_triton(m, experts.int(), w["gate"], w["up"])
    with pytest.raises(TypeError, match="experts_gate dtype"):
        K.experts_gate_up_triton(m, experts, w["gate"].to(BF16), w["up"])
    with pytest.raises(ValueError, match="must take H"):
        K.experts_gate_up_triton(m, experts, w["gate"][:, :, :32], w["up"][:, :, :32])
    with pytest.raises(ValueError, match="both shared_gate and shared_up"):
        K.experts_gate_up_triton(m, experts, w["gate"], w["up"], w["sg"])
    h, sh = K.experts_gate_up_triton(m, experts, w["gate"], w["up"], w["sg"], w["su"])
    with pytest.raises(ValueError, match="weights must be"):
        K.experts_down_combine_triton(h, sh, experts, weights.double(), w["down"], w["sd"], res)
    with pytest.raises(ValueError, match="both shared_hidden and shared_down"):
        K.experts_down_combine_triton(h, sh, experts, weights, w["down"], None, res)
    with pytest.raises(ValueError, match="residual must be"):
        K.experts_down_combine_triton(h, sh, experts, weights, w["down"], w["sd"], res[:, :32])
    h0, sh0 = K.experts_gate_up_triton(m[:0], experts[:0], w["gate"], w["up"], w["sg"], w["su"])
    assert h0.shape == (0, 2, 32) and sh0.shape == (0, 32)


K_dot = K._dot_cols


@triton.jit
def _down_combine_left_to_right_kernel(
    hidden_ptr, shidden_ptr, experts_ptr, weights_ptr, down_ptr, sdown_ptr, res_ptr, out_ptr, down_s, sdown_s, H, I, Is,
    stride_cde, stride_cdn, stride_csd, stride_ht, stride_hj, stride_st, stride_x, stride_w, stride_de, stride_dn,
    stride_sd, stride_r, stride_o, K: tl.constexpr,
    BLOCK_KS: tl.constexpr, LEVELS_KS: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, LEVELS_K: tl.constexpr, NCHUNK: tl.constexpr, LEVELS_C: tl.constexpr,
    BLOCK_KSH: tl.constexpr, LEVELS_KSH: tl.constexpr, NCHUNK_SH: tl.constexpr, LEVELS_CSH: tl.constexpr,
    TO_BF16: tl.constexpr, TO_F16: tl.constexpr, NAN_BITS: tl.constexpr, FP8: tl.constexpr):
    """down/combine with the slots accumulated left to right (the mistake); float32 only."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.program_id(1)
    n_in = n < H
    moe = tl.zeros((BLOCK_N,), tl.float32)
    for j in range(0, K):
        e = tl.load(experts_ptr + t * stride_x + j)
        rows = down_ptr + e * stride_de + n[:, None] * stride_dn
        y = K_dot(hidden_ptr + t * stride_ht + j * stride_hj, rows, n_in, I, BLOCK_N, BLOCK_K, LEVELS_K, NCHUNK,
                  LEVELS_C,
                  down_s, FP8)
        moe = moe + tl.load(weights_ptr + t * stride_w + j) * y
    if HAS_SHARED:
        rows = sdown_ptr + n[:, None] * stride_sd
        moe = moe + K_dot(shidden_ptr + t * stride_st, rows, n_in, Is, BLOCK_N, BLOCK_KSH, LEVELS_KSH, NCHUNK_SH,
                          LEVELS_CSH, sdown_s, FP8)
    res = tl.load(res_ptr + t * stride_r + n, mask=n_in, other=0.0)
    tl.store(out_ptr + t * stride_o + n, res + moe, mask=n_in)


def test_left_to_right_combine_is_caught():
    """The same launch summing the k = 4 slots left to right gives other bytes (float32, where no
    final rounding to bf16 hides the difference), while the kernel matches the twin."""
    w, m, res, experts, weights = _experts_case(16, 4, 256, 128, 1, 3, FP32, seed=41)
    hidden, shared = K.experts_gate_up_torch(m, experts, w["gate"], w["up"], w["sg"], w["su"])
    want = K.experts_down_combine_torch(hidden, shared, experts, weights, w["down"], w["sd"], res)
    out = torch.empty_like(want)
    launch = K.experts_down_combine_launch(hidden, shared, experts, weights, w["down"], w["sd"], res, out)
    launch.run()
    assert same_bytes(out, want)
    Launch(_down_combine_left_to_right_kernel, launch.grid, launch.args, launch.meta).run()
    assert not same_bytes(out, want)


@NUMPY_WARNINGS
def test_experts_float16():
    """float16 storage (Triton's round-to-nearest-even cast) on the non-power-of-two shape."""
    w, m, res, experts, weights = _experts_case(8, 3, 96, 48, 2, 3, torch.float16, seed=59)
    want_h, want_sh = K.experts_gate_up_torch(m, experts, w["gate"], w["up"], w["sg"], w["su"])
    got_h, got_sh = K.experts_gate_up_triton(m, experts, w["gate"], w["up"], w["sg"], w["su"])
    assert same_bytes(got_h, want_h) and same_bytes(got_sh, want_sh)
    want = K.experts_down_combine_torch(want_h, want_sh, experts, weights, w["down"], w["sd"], res)
    assert torch.isfinite(want).all()
    assert same_bytes(K.experts_down_combine_triton(want_h, want_sh, experts, weights, w["down"], w["sd"], res), want)


@NUMPY_WARNINGS
@DTYPES
def test_clamped_gate_up_bytes(dtype):
    """glm5_next's clamped SwiGLU inside the gate/up kernel (routed and shared experts) against
    the twin built from ``layers.clamped_swiglu_hidden``, at a limit that clamps a good share of
    gates and ups from above and below, a NaN row kept NaN; the unclamped kernel differs there."""
    E, k, H, I, T = 8, 3, 32, 16, 2
    w, m, res, experts, weights = _experts_case(E, k, H, I, 1, T, dtype, seed=91)
    m = m * 8  # projections of O(1..10): the limit bites
    m[1, 3] = float("nan")
    limit = 1.25
    want_h, want_sh = K.experts_gate_up_torch(m, experts, w["gate"], w["up"], w["sg"], w["su"], limit=limit)
    got_h, got_sh = K.experts_gate_up_triton(m, experts, w["gate"], w["up"], w["sg"], w["su"], limit=limit)

    def same_nan_free(a, b):  # NaN payloads are not pinned (kernels/rounding.py): NaN where NaN, bytes elsewhere
        nan = torch.isnan(a)
        return torch.equal(nan, torch.isnan(b)) and same_bytes(a.masked_fill(nan, 0), b.masked_fill(nan, 0))

    assert same_nan_free(got_h, want_h) and same_nan_free(got_sh, want_sh)
    assert same_bytes(got_h[0], want_h[0]) and same_bytes(got_sh[0], want_sh[0])  # the finite row: every byte
    assert bool(torch.isnan(got_h[1]).all()) and bool(torch.isfinite(got_h[0]).all())
    raw = numerics.linear(m[0], w["gate"][experts[0, 0]]).float()
    assert bool((raw > limit).any()) and bool((raw < -limit).any())  # both sides exercised (g above, u both)
    plain_h, _ = K.experts_gate_up_triton(m, experts, w["gate"], w["up"], w["sg"], w["su"])
    assert not same_bytes(plain_h[0], want_h[0])  # the clamp matters here: a kernel without it is caught
    with pytest.raises(ValueError, match="limit must be a positive number"):
        K.experts_gate_up_triton(m, experts, w["gate"], w["up"], w["sg"], w["su"], limit=-1.0)
