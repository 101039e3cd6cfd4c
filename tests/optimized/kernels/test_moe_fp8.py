"""The expert kernels over block-scaled fp8 experts (DESIGN.md §8): ``experts_gate_up`` and
``experts_down_combine`` read each chosen expert's e4m3 bytes and scales in place, byte-equal to
their torch twins (``numerics.swiglu_hidden`` / ``linear`` in the §8 order, ``moe.combine``)
through Triton's CPU interpreter, with two scale blocks of H (the last partial) and a scale row
boundary inside the expert width."""

import pytest
import torch

from glm_mtp.optimized.kernels.moe import (
    experts_down_combine_torch, experts_down_combine_triton, experts_gate_up_torch, experts_gate_up_triton,
)
from glm_mtp.reference.fp8 import quantize_fp8
from glm_mtp.reference.weights import same_bytes


def _moe(T, E, k, H, I, Is, dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def mat(*shape):
        return quantize_fp8(torch.randn(*shape, generator=gen) * shape[-1] ** -0.5)

    m = torch.randn(T, H, generator=gen).to(dtype)
    shared = (mat(Is, H), mat(Is, H), mat(H, Is)) if Is else (None, None, None)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k].sort().values for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    residual = torch.randn(T, H, generator=gen).to(dtype)
    return m, experts, weights, residual, (mat(E, I, H), mat(E, I, H), mat(E, H, I)), shared


@pytest.mark.parametrize("T,E,k,H,I,Is,dtype", [
    (1, 3, 2, 136, 72, 72, torch.bfloat16),  # H = 128 + 8: two blocks; a shared expert
    (2, 3, 2, 64, 136, 0, torch.float32),  # one partial block of H; I crosses a scale row; no shared expert
])
def test_experts_fp8_bytes(T, E, k, H, I, Is, dtype):
    m, experts, weights, residual, (g, u, d), (sg, su, sd) = _moe(T, E, k, H, I, Is, dtype, seed=H + I)
    hidden, shared = experts_gate_up_triton(m, experts, g, u, sg, su)
    want_hidden, want_shared = experts_gate_up_torch(m, experts, g, u, sg, su)
    assert same_bytes(hidden, want_hidden) and (shared is None or same_bytes(shared, want_shared))
    out = experts_down_combine_triton(want_hidden, want_shared, experts, weights, d, sd, residual)
    assert same_bytes(out, experts_down_combine_torch(want_hidden, want_shared, experts, weights, d, sd, residual))


def test_a_launch_reads_one_format():
    m, experts, _, _, (g, u, _), (sg, su, _) = _moe(1, 3, 2, 64, 32, 32, torch.bfloat16, seed=1)
    plain = torch.randn(32, 64).to(torch.bfloat16)
    with pytest.raises(TypeError, match="mix block-scaled fp8 and plain weights"):
        experts_gate_up_triton(m, experts, g, u, plain, plain)
