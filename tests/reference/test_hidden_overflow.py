"""A finite hidden whose float32 sum of squares overflows (DESIGN.md §5): accepted, normalised to
zeros by the pinned RMSNorm, so it drafts exactly as a zero hidden; the reference and the
optimized drafter (its kernels' torch twins on CPU, byte-equal to the kernels) agree byte for byte."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_mtp.optimized import OptimizedProposer
from glm_mtp.reference import MtpConfig, MtpWeights, ReferenceProposer
from glm_mtp.reference.bytes import same_bytes
from glm_mtp.reference.numerics import psum, up

WEIGHTS = {p: MtpWeights.random(MtpConfig.preset(p), seed=0, dtype=torch.bfloat16) for p in ("tiny", "glm5next_tiny")}
DRAFTERS = {p: (ReferenceProposer(w, 32), OptimizedProposer(w, 32)) for p, w in WEIGHTS.items()}


def draft(prop, prompt, hiddens, hidden):
    state = prop.alloc_state("cpu")
    prop.prefill_drafter(prompt, hiddens, state)
    drafts = prop.propose(5, hidden, prompt.numel() - 1, 3, state)
    snap = prop.export_state(state)
    prop.free_state(state)
    return drafts, snap


@settings(max_examples=15, deadline=None, database=None)
@given(preset=st.sampled_from(sorted(WEIGHTS)), exponent=st.integers(50, 126), spread=st.sampled_from([0, 4, 16]),
       seed=st.integers(0, 2**31 - 1))
def test_a_hidden_near_float32s_square_root_of_its_range_drafts_alike_in_both_backends(preset, exponent, spread, seed):
    w = WEIGHTS[preset]
    H, gen = w.config.hidden_size, torch.Generator().manual_seed(seed)
    prompt = torch.randint(w.config.vocab_size, (6,), generator=gen)
    hiddens = torch.randn(6, H, generator=gen).to(torch.bfloat16)
    # values 2^(exponent - spread .. exponent): below, around and past where x * x overflows float32
    scale = torch.pow(2.0, exponent - torch.randint(0, spread + 1, (H,), generator=gen).double())
    hidden = (torch.randn(H, generator=gen, dtype=torch.float64) * scale).clamp(-3e38, 3e38).to(torch.bfloat16)
    assert bool(torch.isfinite(hidden).all())
    ref, opt = (draft(p, prompt, hiddens, hidden) for p in DRAFTERS[preset])
    assert ref[0] == opt[0] and all(same_bytes(ref[1][k], opt[1][k]) for k in ref[1])
    if not torch.isfinite(psum(up(hidden) * up(hidden))):  # the row normalises to zeros
        zero = draft(DRAFTERS[preset][0], prompt, hiddens, torch.zeros(H, dtype=torch.bfloat16))
        assert ref[0] == zero[0]


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(WEIGHTS))
def test_the_triton_kernels_agree_on_an_overflowing_hidden(preset):
    # The kernels themselves (the interpreter on CPU, the GPU under CUDA), not their torch twins.
    w = WEIGHTS[preset]
    H, gen = w.config.hidden_size, torch.Generator().manual_seed(3)
    prompt = torch.randint(w.config.vocab_size, (6,), generator=gen)
    hiddens = torch.randn(6, H, generator=gen).to(torch.bfloat16)
    hidden = (torch.randn(H, generator=gen) * 2.0**64).to(torch.bfloat16)
    ref = draft(DRAFTERS[preset][0], prompt, hiddens, hidden)
    opt = draft(OptimizedProposer(w, 32, kernels="triton"), prompt, hiddens, hidden)
    assert ref[0] == opt[0] and all(same_bytes(ref[1][k], opt[1][k]) for k in ref[1])
