"""The confidence and masked-argmax kernels (``kernels.confidence``) against their torch twins and
against a plain statement of DESIGN.md §10/§12's definitions: fresh random logits (with ties, a
single allowed token, an empty row and vocabularies past one chunk), byte for byte."""

from __future__ import annotations

import pytest
import torch

from glm_mtp.optimized.kernels.confidence import (
    CONFIDENCE_BLOCK, allowed_tokens, draft_confidence_torch, draft_confidence_triton, mask_words,
    masked_argmax_torch, masked_argmax_triton,
)
from glm_mtp.reference import numerics
from glm_mtp.reference.bytes import bits

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])


def _equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _inputs(R, V, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, V, generator=gen) * 4).to(dtype)
    if V > 8:
        logits[0, 5] = logits[0].max()  # a tie for the maximum: the lower index wins
    mask = torch.randint(-(2**31), 2**31 - 1, (R, mask_words(V)), generator=gen, dtype=torch.int64).to(torch.int32)
    mask[0, :] = -1  # every token allowed (and bits past V set: never allowed)
    if R > 1:
        mask[1, :] = 0
        mask[1, 0] = 1 << min(3, V - 1)  # exactly one allowed token
    return logits, mask


def _definition(logits, d, allowed):
    """DESIGN.md §12 written out per row with plain Python lists: the max over the allowed
    logits, the masked softmax's psum over all V in vocabulary order, the margin over the best
    other allowed logit."""
    probs, margins = [], []
    for r in range(logits.shape[0]):
        l = numerics.up(logits[r]).float()
        ok = allowed[r]
        m = l[ok].max()
        e = torch.where(ok, numerics.exp(l - m), torch.zeros(()))
        s = numerics.psum(e)
        probs.append(numerics.exp(l[d[r]] - m) / s)
        others = ok.clone()
        others[d[r]] = False
        margins.append(l[d[r]] - l[others].max() if others.any() else torch.tensor(float("inf")))
    return torch.stack(probs), torch.stack(margins)


@DTYPES
@pytest.mark.parametrize("R,V", [(3, 1), (3, 37), (4, CONFIDENCE_BLOCK + 77)])
def test_confidence_bytes(R, V, dtype):
    logits, mask = _inputs(R, V, dtype, seed=R * V)
    if V == 1:
        mask[:, 0] = 1
    allowed = allowed_tokens(mask, V)
    drafts = masked_argmax_torch(logits, mask)
    assert (drafts >= 0).all()
    for m, ok in ((mask, allowed), (None, torch.ones(R, V, dtype=torch.bool))):
        d = drafts if m is not None else torch.argmax(numerics.up(logits).float(), dim=-1)
        got = draft_confidence_triton(logits, d, m)
        twin = draft_confidence_torch(logits, d, m)
        want = _definition(logits, d, ok)
        for g, t, w in zip(got, twin, want):
            assert _equal(g, t) and _equal(t, w)
        prob, margin = got
        assert (margin >= 0).all()
        if R > 1 and m is not None:  # one allowed token: probability 1, margin +inf
            assert prob[1].item() == 1.0 and margin[1].item() == float("inf")


@DTYPES
def test_confidence_of_a_draft_that_is_not_the_max(dtype):
    """A sampled draft need not be the argmax: its margin is negative, its prob below the max's."""
    logits, mask = _inputs(2, 300, dtype, seed=5)
    d = torch.argmin(numerics.up(logits).float(), dim=-1)
    got, twin = draft_confidence_triton(logits, d), draft_confidence_torch(logits, d)
    want = _definition(logits, d, torch.ones(2, 300, dtype=torch.bool))
    assert all(_equal(g, t) and _equal(t, w) for g, t, w in zip(got, twin, want))
    assert (got[1] < 0).all()


@DTYPES
@pytest.mark.parametrize("R,V", [(3, 1), (3, 37), (4, CONFIDENCE_BLOCK + 77)])
def test_masked_argmax_bytes(R, V, dtype):
    logits, mask = _inputs(R, V, dtype, seed=R + V)
    logits[-1, :] = float("-inf")  # every logit -inf: the lowest allowed token, never a forbidden one
    mask[-1, 0] &= ~1  # token 0 forbidden in that row
    if R > 2:
        mask[2, :] = 0  # no allowed token: -1
    got, twin = masked_argmax_triton(logits, mask), masked_argmax_torch(logits, mask)
    allowed = allowed_tokens(mask, V)
    want = []
    for r in range(R):  # the lowest index holding the max over the allowed tokens only
        idx = allowed[r].nonzero()[:, 0]
        if idx.numel() == 0:
            want.append(-1)
            continue
        vals = numerics.up(logits[r]).float()[idx]
        want.append(int(idx[(vals == vals.max()).nonzero()[0, 0]]))
    assert _equal(got, twin) and got.tolist() == want


def test_bits_past_the_vocabulary_are_never_allowed():
    mask = torch.full((1, 2), -1, dtype=torch.int32)
    assert allowed_tokens(mask, 40).shape == (1, 40) and allowed_tokens(mask, 40).all()
    logits = torch.randn(1, 40).to(torch.bfloat16)
    assert masked_argmax_triton(logits, mask).item() < 40


def test_refusals_name_the_argument():
    logits = torch.randn(2, 40).to(torch.bfloat16)
    with pytest.raises(ValueError, match="mask"):
        draft_confidence_triton(logits, torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="tokens"):
        draft_confidence_triton(logits, torch.zeros(3, dtype=torch.int64))
