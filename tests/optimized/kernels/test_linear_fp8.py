"""The fp8 GEMV (optimized/kernels/linear_fp8.py) against ``numerics.linear`` / ``linear_acc``
over block-scaled weights: its e4m3 decoder on all 256 byte patterns, then byte equality on fresh
random inputs through Triton's CPU interpreter (several scale blocks, partial last blocks in N
and K, K below one block), and a kernel that scales once after the whole tree is caught."""

import pytest
import torch
import triton
import triton.language as tl

from glm_mtp.optimized.kernels import AUDITED, linear_fp8
from glm_mtp.optimized.kernels.pinned_math import psum_grid
from glm_mtp.optimized.kernels.linear_fp8 import (
    _e4m3_kernel, fp8_weight_bytes, linear_fp8_acc_triton, linear_fp8_launch, linear_fp8_torch, linear_fp8_triton,
)
from glm_mtp.reference import numerics
from glm_mtp.reference.fp8 import FP8_DTYPE, quantize_fp8
from glm_mtp.reference.weights import same_bytes

BF16, FP32 = torch.bfloat16, torch.float32


def test_the_decoder_is_exact_on_every_byte():
    """All 256 patterns decode to torch's float8_e4m3fn -> float32 (the format's values), NaN to NaN.
    Triton's interpreter's own float8 cast is not exact there: it reads S.1111.111 as +-480."""
    b = torch.arange(256, dtype=torch.uint8)
    got = torch.empty(256)
    _e4m3_kernel[(1,)](b, got, 256, BLOCK=256)
    want = b.view(FP8_DTYPE).float()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and int(nan.sum()) == 2
    assert same_bytes(got[~nan], want[~nan])


def _inputs(T, N, K, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    # Mixed magnitudes, so sums cancel and round differently in different orders.
    w = quantize_fp8(torch.randn(N, K, generator=gen) * torch.exp(torch.randn(N, K, generator=gen)))
    x = (torch.randn(T, K, generator=gen) * torch.exp(torch.randn(T, K, generator=gen))).to(dtype)
    return x, w


# (T, N, K): K below one block; several K blocks with a partial last one and N crossing a scale
# row (130 = 128 + 2); 3 K blocks (a padded tree over blocks); K = 1; T above MAX_BLOCK_T.
SHAPES = [(1, 5, 96), (2, 130, 200), (3, 17, 300), (5, 11, 1), (9, 20, 64)]


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,N,K", SHAPES)
def test_linear_fp8_bytes(T, N, K, dtype):
    x, w = _inputs(T, N, K, dtype, seed=T * 100003 + N * 101 + K)
    assert same_bytes(linear_fp8_triton(x, w), numerics.linear(x, w))
    assert same_bytes(linear_fp8_acc_triton(x, w), numerics.linear_acc(x, w))
    assert same_bytes(linear_fp8_torch(x, w), numerics.linear(x, w))


def test_a_nan_weight_stays_nan():
    x, w = _inputs(2, 3, 40, FP32, seed=1)
    w.w8.view(torch.uint8)[1, 7] = 0x7F
    y = linear_fp8_acc_triton(x, w)
    assert torch.equal(y.isnan(), numerics.linear_acc(x, w).isnan()) and bool(y[:, 1].isnan().all())


@triton.jit
def _scale_once_kernel(x_ptr, w_ptr, s_ptr, out_ptr, T, N, K, stride_x, stride_w, stride_s, stride_out,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LEVELS_K: tl.constexpr,
                       NCHUNK: tl.constexpr, LEVELS_C: tl.constexpr, SCALE_ROWS: tl.constexpr, TO_BF16: tl.constexpr,
                       TO_F16: tl.constexpr, NAN_BITS: tl.constexpr):
    """A mutant: the blocks' unscaled roots summed, then one scale (right only when every block of
    a row has the same scale)."""
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    col = tl.arange(0, NCHUNK)
    roots = tl.zeros((BLOCK_T, BLOCK_N, NCHUNK), tl.float32)
    for c in range(0, tl.cdiv(K, BLOCK_K)):
        k = c * BLOCK_K + kk
        xv = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=(t[:, None] < T) & (k[None, :] < K), other=0.0)
        wb = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0)
        wv = linear_fp8.e4m3_to_f32(wb)
        root = psum_grid(xv[:, None, :] * wv[None, :, :], BLOCK_T, BLOCK_N, BLOCK_K, LEVELS_K)
        roots = tl.where(col[None, None, :] == c, root[:, :, None], roots)
    s = tl.load(s_ptr + (n // SCALE_ROWS) * stride_s, mask=n < N, other=0.0)
    y = psum_grid(roots, BLOCK_T, BLOCK_N, NCHUNK, LEVELS_C) * s[None, :]
    tl.store(out_ptr + t[:, None] * stride_out + n[None, :], y, mask=(t[:, None] < T) & (n[None, :] < N))


def test_scaling_after_the_tree_is_caught():
    x, w = _inputs(2, 130, 300, FP32, seed=7)
    out = torch.empty(2, 130)
    launch = linear_fp8_launch(x, w.w8, w.scale_inv, out)
    _scale_once_kernel[launch.grid](*launch.args, **launch.meta)
    assert not same_bytes(out, numerics.linear_acc(x, w))


def test_refusals_name_the_argument():
    x, w = _inputs(2, 4, 40, FP32, seed=2)
    with pytest.raises(ValueError, match=r"x must be \(T, K=40\)"):
        linear_fp8_triton(x[:, :39], w)
    with pytest.raises(TypeError, match="weight must be a 2-d BlockScaledWeight"):
        linear_fp8_triton(x, w.w8)
    with pytest.raises(TypeError, match="x dtype torch.float64"):
        linear_fp8_triton(x.double(), w)


def test_the_fp8_floor_and_the_audit_list():
    assert fp8_weight_bytes(130, 200) == 130 * 200 + 4 * 2 * 2
    assert linear_fp8 in AUDITED
