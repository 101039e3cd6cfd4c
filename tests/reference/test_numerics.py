"""The pinned primitives (DESIGN.md §5) against independent statements of their order: numpy
float32/float64 arithmetic (IEEE, one rounding per operation) written out step by step, compared
byte for byte; ``exp`` against float64 over a sweep of the float32 range."""

import math

import numpy as np
import pytest
import torch

from glm_mtp.reference import numerics as nm
from glm_mtp.reference.bytes import raw_bytes

FLOATS = [torch.float32, torch.float64]


def np_psum(v: np.ndarray) -> np.ndarray:
    """The tree of §5 read literally: pad with +0.0 to the next power of two, then halve."""
    n = v.shape[-1]
    if n == 0:
        return np.zeros(v.shape[:-1], dtype=v.dtype)
    width = 1 << (n - 1).bit_length()
    w = np.concatenate([v, np.zeros(v.shape[:-1] + (width - n,), dtype=v.dtype)], axis=-1)
    while w.shape[-1] > 1:
        w = w[..., 0::2] + w[..., 1::2]
    return w[..., 0]


def rand(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_psum_is_the_padded_tree(dtype):
    for n in list(range(0, 34)) + [63, 64, 65, 100, 6144 // 16, 1000]:
        x = rand(3, n, seed=n, dtype=dtype, scale=10 ** (n % 5))
        assert raw_bytes(nm.psum(x)) == raw_bytes(torch.from_numpy(np_psum(x.numpy()))), n


def test_psum_zero_signs_and_specials():
    z = torch.tensor
    assert raw_bytes(nm.psum(z([-0.0]))) == raw_bytes(z(-0.0))  # n = 1 is the value itself
    assert raw_bytes(nm.psum(z([-0.0, -0.0]))) == raw_bytes(z(-0.0))
    assert raw_bytes(nm.psum(z([-0.0, -0.0, -0.0]))) == raw_bytes(z(0.0))  # the padding's +0.0 enters
    assert raw_bytes(nm.psum(torch.zeros(0))) == raw_bytes(z(0.0))
    assert math.isnan(nm.psum(z([1.0, float("nan"), 2.0])).item())
    assert nm.psum(z([float("inf"), 1.0, 5.0])).item() == float("inf")


def test_the_order_is_observable():
    """The tests above can fail: a left-to-right sum, or torch's own, gives other bytes."""
    x = rand(200, 1000, seed=1, scale=1e3)
    tree = nm.psum(x)
    seq = torch.from_numpy(np.add.reduce(x.numpy(), axis=-1, dtype=np.float32))
    assert raw_bytes(tree) != raw_bytes(torch.sum(x, -1))
    left = x[:, 0].clone()
    for i in range(1, 1000):
        left = left + x[:, i]
    assert raw_bytes(tree) != raw_bytes(left) and raw_bytes(tree) != raw_bytes(seq)


@pytest.mark.parametrize("dtype", FLOATS)
def test_psum_prefix_is_psum_of_each_prefix(dtype):
    g = torch.Generator().manual_seed(3)
    for W in (1, 2, 5, 16, 33, 64):
        lengths = torch.randint(0, W + 1, (40,), generator=g)
        x = rand(40, W, seed=W, dtype=dtype)
        x = torch.where(torch.arange(W) < lengths[:, None], x, torch.zeros_like(x))
        got = nm.psum_prefix(x, lengths)
        for t in range(40):
            assert raw_bytes(got[t]) == raw_bytes(nm.psum(x[t, : int(lengths[t])])), (W, t)


def test_dot_and_linear_follow_the_tree_and_ignore_chunking(monkeypatch):
    x = rand(3, 6144, seed=5, dtype=torch.bfloat16)  # 6144 = 4096 + 2048: a non-power-of-two tree
    w = rand(40, 6144, seed=6, dtype=torch.bfloat16, scale=0.02)
    prods = x.float().numpy()[:, None, :] * w.float().numpy()[None]  # exact: bf16 x bf16 fits float32
    want = torch.from_numpy(np_psum(prods)).to(torch.bfloat16)
    assert raw_bytes(nm.linear(x, w)) == raw_bytes(want)
    monkeypatch.setattr(nm, "LINEAR_CHUNK_ELEMENTS", 3 * 6144 * 7)  # chunks of 7 output columns
    assert raw_bytes(nm.linear(x, w)) == raw_bytes(want)
    assert raw_bytes(nm.dot(x[0], w[3])) == raw_bytes(torch.from_numpy(np_psum(prods[0, 3])))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_rms_norm_step_by_step(dtype):
    x, w = rand(5, 96, seed=7, dtype=dtype), rand(96, seed=8, dtype=dtype, scale=0.1) + 1
    f = np.float32
    xf = x.float().numpy()
    r = f(1) / np.sqrt(np_psum(xf * xf) / f(96) + f(1e-5))
    normed = torch.from_numpy(xf * r[:, None]).to(dtype)
    want = (torch.from_numpy(w.float().numpy() * normed.float().numpy())).to(dtype)
    assert raw_bytes(nm.rms_norm(x, w, 1e-5)) == raw_bytes(want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_norm_step_by_step(dtype):
    x, w, b = rand(7, 48, seed=9, dtype=dtype), rand(48, seed=10, dtype=dtype) + 1, rand(48, seed=11, dtype=dtype)
    f = np.float32
    xf = x.float().numpy()
    d = xf - (np_psum(xf) / f(48))[:, None]
    inv = f(1) / np.sqrt(np_psum(d * d) / f(48) + f(1e-6))
    want = torch.from_numpy((d * inv[:, None]) * w.float().numpy() + b.float().numpy()).to(dtype)
    assert raw_bytes(nm.layer_norm(x, w, b, 1e-6)) == raw_bytes(want)


def np_exp(x: np.ndarray) -> np.ndarray:
    """DESIGN.md's exp algorithm, step by step, in numpy float32."""
    f = np.float32
    c = np.minimum(np.maximum(x, f(nm.EXP_MIN_IN)), f(nm.EXP_MAX_IN))
    k = (c * f(nm.LOG2E) + f(nm.ROUND_MAGIC)) - f(nm.ROUND_MAGIC)
    r = (c - k * f(nm.LN2_HI)) - k * f(nm.LN2_LO)
    p = np.full_like(r, f(nm.EXP_POLY[0]))
    for coeff in nm.EXP_POLY[1:]:
        p = p * r + f(coeff)
    ki = k.astype(np.int32)
    k1 = ki // 2
    k2 = ki - k1
    two = lambda e: ((e + 127) << 23).astype(np.int32).view(np.float32)  # noqa: E731
    with np.errstate(over="ignore", under="ignore"):
        y = (p * two(k1)) * two(k2)
    return np.where(np.isnan(x), x, y)


def ulp_error(got: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    want = torch.exp(x.double())
    mag = want.float().abs().double().clamp(min=2.0**-149)
    ulp = torch.pow(2.0, (torch.floor(torch.log2(mag)) - 23).clamp(min=-149))
    finite = torch.isfinite(want.float())
    return torch.where(finite, (got.double() - want).abs() / ulp, torch.zeros_like(want))


def test_exp_within_2_ulp_over_the_float32_range():
    """Every 1021st float32 bit pattern (4.2 million inputs, both signs, normal and denormal)
    whose exp is finite and nonzero in float64, then the overflow and underflow edges."""
    bits32 = torch.arange(0, 2**32, 1021, dtype=torch.int64)
    x = torch.where(bits32 >= 2**31, bits32 - 2**32, bits32).to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x)]
    got = nm.exp(x)
    assert ulp_error(got, x).max().item() <= 2.0
    # Overflow goes to inf exactly where float32 exp does; past the smallest denormal, to +0.0.
    assert (torch.isinf(got) == torch.isinf(torch.exp(x.double()).float())).all()
    assert raw_bytes(nm.exp(x)) == raw_bytes(torch.from_numpy(np_exp(x.numpy())))  # the written algorithm


def test_exp_edges():
    t = torch.tensor
    edge = t([0.0, -0.0, float("inf"), float("-inf"), 88.72283, 88.72284, 89.5, 1e30,
              -87.33654, -87.5, -100.0, -103.9, -103.98, -104.5, -1e30, 1e-30, -1e-30, 2.0**-149])
    got = nm.exp(edge)
    assert got[0].item() == 1.0 and got[1].item() == 1.0
    assert got[2].item() == float("inf") and raw_bytes(got[3]) == raw_bytes(t(0.0))
    assert math.isfinite(got[4].item()) and got[5].item() == got[6].item() == got[7].item() == float("inf")
    assert 0 < got[8].item() < 2.0**-125 and 0 < got[10].item() < 2.0**-126  # denormal results
    assert raw_bytes(got[12:15]) == raw_bytes(torch.zeros(3))  # underflow to +0.0
    assert got[15].item() == got[16].item() == got[17].item() == 1.0
    assert ulp_error(got, edge).max().item() <= 2.0
    assert math.isnan(nm.exp(t([float("nan")])).item())
    assert raw_bytes(nm.exp(t([1.5], dtype=torch.float64))) == raw_bytes(torch.exp(t([1.5], dtype=torch.float64)))


def test_sigmoid_silu_softmax_are_their_compositions():
    x = rand(4, 37, seed=12, scale=6)
    e = nm.exp(-x)
    assert raw_bytes(nm.sigmoid(x)) == raw_bytes(torch.div(torch.ones_like(x), 1.0 + e))
    assert raw_bytes(nm.silu(x)) == raw_bytes(x * nm.sigmoid(x))
    ex = nm.exp(x - x.amax(-1, keepdim=True))
    assert raw_bytes(nm.softmax(x)) == raw_bytes(ex / nm.psum(ex)[:, None])
    torch.testing.assert_close(nm.softmax(x).double(), torch.softmax(x.double(), -1), rtol=1e-6, atol=1e-7)


def test_list_softmax_is_softmax_of_each_list():
    s = rand(6, 9, seed=13, scale=4)
    lengths = torch.tensor([1, 2, 5, 8, 9, 3])
    masked = s.masked_fill(torch.arange(9) >= lengths[:, None], float("-inf"))
    p = nm.list_softmax(masked, lengths)
    for t in range(6):
        n = int(lengths[t])
        assert raw_bytes(p[t, :n]) == raw_bytes(nm.softmax(s[t, :n]))
        assert raw_bytes(p[t, n:]) == raw_bytes(torch.zeros(9 - n))


def test_sqrt_is_correctly_rounded():
    """torch's own float32 sqrt on the CPU is not (a vector-math library): numerics.sqrt must be,
    as numpy's (the hardware instruction) is."""
    x = torch.cat([torch.rand(200_000) * 4, rand(50_000, seed=14).abs() * 1e-30, rand(50_000, seed=15).abs() * 1e30])
    assert raw_bytes(nm.sqrt(x)) == raw_bytes(torch.from_numpy(np.sqrt(x.numpy())))
