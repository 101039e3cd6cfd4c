"""The fused GEMV family over block-scaled fp8 weights (DESIGN.md §8): ``norm_linear`` and
``linear_residual`` read the e4m3 bytes and scales in one launch, byte-equal to their torch twins
(the reference's ``rms_norm`` + ``numerics.linear``, which takes the §8 order) through Triton's
CPU interpreter, with several scale blocks, partial last blocks and K below one block."""

import pytest
import torch

from glm_mtp.optimized.kernels.fused_linear import (
    linear_residual_torch, linear_residual_triton, norm_linear_torch, norm_linear_triton,
)
from glm_mtp.reference.fp8 import quantize_fp8
from glm_mtp.reference.weights import same_bytes

BF16, FP32 = torch.bfloat16, torch.float32


def _inputs(T, K, Ns, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, K, generator=gen) * torch.exp(torch.randn(T, K, generator=gen))).to(dtype)
    norm = (1 + 0.1 * torch.randn(K, generator=gen)).to(dtype)
    ws = [quantize_fp8(torch.randn(N, K, generator=gen) * torch.exp(torch.randn(N, K, generator=gen))) for N in Ns]
    return x, norm, ws


# (T, K, Ns): K = 200 (two blocks, the last of 72) with N crossing a scale row (136); K = 64 (one
# partial block) with three weights; K = 300 (three blocks: a padded tree over blocks).
CASES = [(1, 200, [136, 24, 16]), (3, 64, [40, 7, 130]), (2, 300, [5])]


@pytest.mark.parametrize("T,K,Ns,dtype", [(*c, BF16) for c in CASES] + [(*CASES[-1], FP32)])
def test_norm_linear_fp8_bytes(T, K, Ns, dtype):
    x, norm, ws = _inputs(T, K, Ns, dtype, seed=T * 1009 + K)
    for acc in (False, True):
        got, got_normed = norm_linear_triton(x, norm, 1e-6, ws, acc=acc, store_normed=True)
        want, want_normed = norm_linear_torch(x, norm, 1e-6, ws, acc=acc, store_normed=True)
        assert all(same_bytes(g, w) for g, w in zip(got, want)) and same_bytes(got_normed, want_normed)


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_linear_residual_fp8_bytes(dtype):
    x, _, (w,) = _inputs(3, 200, [130], dtype, seed=11)
    r = torch.randn(3, 130, generator=torch.Generator().manual_seed(12)).to(dtype)
    assert same_bytes(linear_residual_triton(x, w, r), linear_residual_torch(x, w, r))


def test_a_launch_reads_one_format():
    x, norm, ws = _inputs(1, 64, [8, 8], BF16, seed=3)
    with pytest.raises(TypeError, match="must share a dtype .*one launch reads one format"):
        norm_linear_triton(x, norm, 1e-6, [ws[0], torch.randn(8, 64).to(BF16)])
