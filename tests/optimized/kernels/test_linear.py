"""The pinned GEMV kernel (optimized/kernels/linear.py) against ``numerics.linear`` /
``linear_acc``: byte equality on fresh random inputs through Triton's CPU interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), on shapes with multi-level trees, several chunks,
masked tails in T, N and K, and non-power-of-two K; and kernels that sum in another order (a
``tl.sum`` chunk, a left-to-right combine of the chunks) are caught on the same inputs."""

import pytest
import torch
import triton
import triton.language as tl

from glm_mtp.optimized.kernels.launch import Launch
from glm_mtp.optimized.kernels.linear import (
    linear_acc_torch, linear_acc_triton, linear_blocks, linear_launch, linear_torch, linear_triton,
)
from glm_mtp.optimized.kernels.pinned_math import psum_grid
from glm_mtp.reference import numerics
from glm_mtp.reference.bytes import same_bytes

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16


def _inputs(T, N, K, x_dtype, w_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # Mixed magnitudes, so sums cancel and round differently in different orders.
    x = (torch.randn(T, K, generator=gen) * torch.exp(torch.randn(T, K, generator=gen))).to(x_dtype)
    w = (torch.randn(N, K, generator=gen) * torch.exp(torch.randn(N, K, generator=gen))).to(w_dtype)
    return x, w


# (T, N, K): one chunk with a masked K tail (96 = 64 + 32); several chunks with tails in T, N, K;
# 1000 -> 4 chunks of 256; K = 6144 = 4096 + 2048 (glm5's H: 32 chunks, half of them padding) and
# K = 2H = 12288 on a few rows; K = 1 (no tree at all); T > MAX_BLOCK_T (two row blocks).
SHAPES = [(1, 5, 96), (3, 37, 300), (1, 7, 1000), (6, 3, 6144), (2, 2, 12288), (5, 11, 1), (9, 20, 64)]


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,N,K", SHAPES)
def test_linear_bytes(T, N, K, dtype):
    x, w = _inputs(T, N, K, dtype, dtype, seed=T * 100003 + N * 101 + K)
    assert same_bytes(linear_triton(x, w), numerics.linear(x, w))
    assert same_bytes(linear_acc_triton(x, w), numerics.linear_acc(x, w))
    # The twins are the pinned functions themselves.
    assert same_bytes(linear_torch(x, w), numerics.linear(x, w)) and same_bytes(
        linear_acc_torch(x, w), numerics.linear_acc(x, w)
    )


@pytest.mark.parametrize("x_dtype,w_dtype", [(FP16, FP16), (FP32, BF16), (BF16, FP32)],
                         ids=["fp16", "fp32xbf16", "bf16xfp32"])
def test_linear_other_dtypes(x_dtype, w_dtype):
    """float16, and activations and weights of different dtypes (the result is in x's dtype)."""
    x, w = _inputs(3, 13, 130, x_dtype, w_dtype, seed=5)
    assert same_bytes(linear_triton(x, w), numerics.linear(x, w))
    assert same_bytes(linear_acc_triton(x, w), numerics.linear_acc(x, w))


def test_linear_strided_views_and_leading_dims():
    """Rows at any stride (a column slice of activations, every other weight row) and (..., K)
    inputs, as numerics.linear takes them."""
    x, w = _inputs(4, 22, 200, BF16, BF16, seed=9)
    xs, ws = x[:, 40:], w[::2, 40:]  # (4, 160) row stride 200; (11, 160) row stride 400
    assert xs.stride() == (200, 1) and ws.stride() == (400, 1)
    assert same_bytes(linear_triton(xs, ws), numerics.linear(xs, ws))
    x3 = x.reshape(2, 2, 200)
    assert same_bytes(linear_triton(x3, w), numerics.linear(x3, w))
    assert same_bytes(linear_acc_triton(x[0], w), numerics.linear_acc(x[0], w))  # a single (K,) row
    xt = x.T.contiguous().T  # (4, 200) with a strided last dim: copied by the wrapper
    assert xt.stride(1) != 1 and same_bytes(linear_triton(xt, w), numerics.linear(xt, w))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on inf - inf in the interpreter
def test_linear_rounds_to_nearest_even_and_keeps_specials():
    """bf16 results that truncation would get wrong come out as torch rounds them; the padding of
    a non-power-of-two K turns an all ``-0.0`` sum into ``+0.0`` (and a power of two does not);
    inf and NaN land where torch puts them (NaN payloads are not pinned)."""
    x, w = _inputs(4, 33, 96, BF16, BF16, seed=17)
    acc = numerics.linear_acc(x, w)
    truncated = (acc.view(torch.int32) >> 16).to(torch.int16)
    assert not torch.equal(truncated, acc.to(BF16).view(torch.int16))  # rounding is exercised
    assert same_bytes(linear_triton(x, w), numerics.linear(x, w))

    for K, want in ((96, 0x0000), (64, 0x8000)):  # -0.0 * positive weights: -0.0 products
        xz = torch.full((1, K), -0.0, dtype=BF16)
        wz = torch.rand(3, K).add(0.5).to(BF16)
        got = linear_triton(xz, wz)
        assert same_bytes(got, numerics.linear(xz, wz)) and (got.view(torch.int16) & 0xFFFF == want).all()

    xs, ws = x.clone(), w.clone()
    xs[0, 3], xs[1, 5], ws[2, 7] = float("nan"), float("inf"), float("-inf")
    want, got = numerics.linear(xs, ws), linear_triton(xs, ws)
    nan = torch.isnan(want.float())
    assert nan.any() and torch.isinf(want.float()).any()
    assert torch.equal(nan, torch.isnan(got.float()))
    assert torch.equal(want.view(torch.int16)[~nan], got.view(torch.int16)[~nan])


def test_linear_empty_and_bad_arguments():
    x, w = _inputs(2, 3, 8, FP32, FP32, seed=1)
    assert linear_triton(x[:0], w).shape == (0, 3) and linear_triton(x, w[:0]).shape == (2, 0)
    with pytest.raises(ValueError, match="agree on K"):
        linear_triton(x, w[:, :7])
    with pytest.raises(ValueError, match="weight must have a contiguous last dim"):
        linear_triton(x[:, :4], w[:, ::2])
    with pytest.raises(TypeError, match="x dtype torch.float64"):
        linear_triton(x.double(), w)
    with pytest.raises(ValueError, match=r"weight \(N, K\)"):
        linear_triton(x, w[0])


# ---- the test can fail: the same launch with the sum in another order --------------------------


@triton.jit
def _other_order_kernel(x_ptr, w_ptr, out_ptr, T, N, K, stride_x, stride_w, stride_out, BLOCK_T: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LEVELS_K: tl.constexpr, NCHUNK: tl.constexpr,
                        LEVELS_C: tl.constexpr, TO_BF16: tl.constexpr, TO_F16: tl.constexpr, NAN_BITS: tl.constexpr,
                        ORDER: tl.constexpr):
    """linear_acc with each chunk summed by ``tl.sum`` (ORDER 0) or the chunks' roots added left
    to right (ORDER 1); float32 output only."""
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
    roots = tl.zeros((BLOCK_T, BLOCK_N, NCHUNK), tl.float32)
    col = tl.arange(0, NCHUNK)
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        xv = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K), other=0.0)
        wv = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        p = xv.to(tl.float32)[:, None, :] * wv.to(tl.float32)[None, :, :]
        if ORDER == 0:
            roots = tl.where(col[None, None, :] == c, tl.sum(p, axis=2)[:, :, None], roots)
        else:
            acc = acc + psum_grid(p, BLOCK_T, BLOCK_N, BLOCK_K, LEVELS_K)
    if ORDER == 0:
        acc = psum_grid(roots, BLOCK_T, BLOCK_N, NCHUNK, LEVELS_C)
    tl.store(out_ptr + t[:, None] * stride_out + n[None, :], acc, mask=(t[:, None] < T) & (n[None, :] < N))


@pytest.mark.parametrize("order", [0, 1], ids=["tl_sum_chunks", "left_to_right_chunks"])
def test_other_orders_are_caught(order):
    """The same launch (grid, blocks, arguments) with a kernel that sums in another order gives
    other bytes on these inputs, while the pinned kernel matches them: the byte test can fail."""
    x, w = _inputs(2, 16, 2000, FP32, FP32, seed=23)  # 8 chunks of 256
    assert linear_blocks(2, 16, 2000)[2] == 256
    want = numerics.linear_acc(x, w)
    out = torch.empty(2, 16, dtype=FP32)
    launch = linear_launch(x, w, out)
    launch.run()
    assert same_bytes(out, want)
    Launch(_other_order_kernel, launch.grid, launch.args, dict(launch.meta, ORDER=order)).run()
    assert not same_bytes(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,N,K", [(1, 2048, 6144), (5, 300, 12288), (8, 4099, 6144), (3, 64, 96)])
def test_linear_bytes_on_cuda(T, N, K, dtype):
    """Compiled for the GPU: the same bytes as numerics.linear / linear_acc on the CPU (glm5's
    widths: q_a_proj, eh_proj on a few outputs, an lm_head slice with an N tail)."""
    x, w = _inputs(T, N, K, dtype, dtype, seed=T + N + K)
    xc, wc = x.cuda(), w.cuda()
    assert same_bytes(linear_triton(xc, wc).cpu(), numerics.linear(x, w))
    assert same_bytes(linear_acc_triton(xc, wc).cpu(), numerics.linear_acc(x, w))
