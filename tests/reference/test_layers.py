"""Each building block against a float64 re-derivation of its formula, on fresh random inputs,
and the tie rules on constructed ties."""

import math

import pytest
import torch

from glm_mtp.reference.layers import apply_rope, greedy_token, rope_table, topk_indices
from glm_mtp.reference.numerics import layer_norm, rms_norm, swiglu

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)]


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rms_norm(dtype, tol):
    x, w = rand(5, 48, seed=1), 1 + 0.1 * rand(48, seed=2)
    want = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    got = rms_norm(x.to(dtype), w.to(dtype), 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_layer_norm(dtype, tol):
    x, w, b = rand(7, 16, seed=3), 1 + 0.1 * rand(16, seed=4), 0.1 * rand(16, seed=5)
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    want = (x - mu) / torch.sqrt(var + 1e-6) * w + b
    torch.testing.assert_close(layer_norm(x.to(dtype), w.to(dtype), b.to(dtype), 1e-6).double(), want, atol=tol * 4,
                               rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_swiglu(dtype, tol):
    x, g, u, d = rand(3, 32, seed=6), rand(24, 32, seed=7) / 6, rand(24, 32, seed=8) / 6, rand(32, 24, seed=9) / 5
    a = x @ g.T
    want = ((a / (1 + torch.exp(-a))) * (x @ u.T)) @ d.T
    torch.testing.assert_close(swiglu(x.to(dtype), g.to(dtype), u.to(dtype), d.to(dtype)).double(), want, atol=tol * 10,
                               rtol=tol * 5)


def test_rope_table_values():
    cos, sin = rope_table(40, 8, 10000.0)
    assert cos.shape == sin.shape == (40, 4) and cos.dtype == torch.float32
    for pos in (0, 1, 17, 39):
        for i in range(4):
            angle = pos * 10000.0 ** (-2 * i / 8)
            assert cos[pos, i].item() == pytest.approx(math.cos(angle), abs=1e-7)
            assert sin[pos, i].item() == pytest.approx(math.sin(angle), abs=1e-7)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_apply_rope_is_a_rotation_of_the_right_pairs(interleave, dtype, tol):
    R, T = 8, 6
    x = rand(T, 3, R, seed=10)
    cos, sin = rope_table(T, R, 500.0, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    got = apply_rope(x.to(dtype), cos[:, None], sin[:, None], interleave).double()
    # Complex multiplication in float64: pair (a, b) -> (a + ib) * e^{i pos theta_j}.
    pairs = (
        (torch.arange(0, R, 2), torch.arange(1, R, 2))
        if interleave
        else (torch.arange(R // 2), torch.arange(R // 2, R))
    )
    z = torch.complex(x[..., pairs[0]], x[..., pairs[1]])
    angle = torch.arange(T, dtype=torch.float64)[:, None, None] * 500.0 ** (
        -torch.arange(0, R, 2, dtype=torch.float64) / R
    )
    rz = z * torch.exp(1j * angle)
    want = torch.empty_like(x)
    want[..., pairs[0]], want[..., pairs[1]] = rz.real, rz.imag
    torch.testing.assert_close(got, want, atol=tol * 4, rtol=tol)
    # Position 0 is the identity; norms are preserved.
    torch.testing.assert_close(got[0], x[0].to(dtype).double(), atol=0, rtol=0)


def test_topk_ties_go_to_the_lower_index():
    scores = torch.tensor([[0.0, 3.0, 1.0, 3.0, 0.0, 1.0, 3.0]])
    assert topk_indices(scores, 2).tolist() == [[1, 3]]
    assert topk_indices(scores, 4).tolist() == [[1, 3, 6, 2]]
    zeros = torch.zeros(1, 9)  # the indexer's ReLU makes all-zero rows common
    assert topk_indices(zeros, 3).tolist() == [[0, 1, 2]]
    neg = torch.tensor([[-1.0, float("-inf"), -1.0, float("-inf")]])
    assert topk_indices(neg, 3).tolist() == [[0, 2, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_ties_go_to_the_lower_id(dtype):
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0], [7.0, 7.0, 7.0, 7.0]], dtype=dtype)
    assert greedy_token(logits).tolist() == [1, 0]
    big = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    big[:, 10] = big[:, 900] = big.max() + 1
    assert greedy_token(big).tolist() == [10, 10, 10]


def test_a_forbidden_logit_is_never_compared_even_where_every_allowed_one_is_minus_inf():
    """DESIGN.md §10: the masked argmax ranks the allowed tokens alone. With every allowed logit
    -inf, a forbidden token (finite or -inf, below the allowed ids) must still never win."""
    from glm_mtp.reference.layers import sampled_token

    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 40, generator=gen).to(torch.bfloat16)  # (T, V)
    allowed = torch.zeros(40, dtype=torch.bool)
    allowed[[17, 29]] = True
    logits[:, 17] = -math.inf
    logits[:, 29] = -math.inf
    logits[1, :] = -math.inf  # every entry -inf: the lowest allowed id wins, not token 0
    assert greedy_token(logits, allowed).tolist() == [17, 17, 17]
    q = torch.rand(3, 40, generator=gen)
    q[:, [17, 29]] = 0.0  # allowed probabilities that underflowed: still ranked alone
    noise = torch.rand(3, 40, generator=gen) + 0.5
    assert sampled_token(q, noise, allowed).tolist() == [17, 17, 17]
